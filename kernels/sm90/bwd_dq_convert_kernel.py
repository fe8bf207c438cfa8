"""The fp32 dQ buffer -> dq kernel of bwd_dq_convert.py (its docstring has the scheme); compiled there."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32

from .bwd_dq_convert import THREADS, VEC


class ScaledNarrowKernel:
    """fn(src, dst, scale): dst[i] = src[i] * scale for i < N, src fp32 (N,), dst 16-bit (N,)."""

    def __init__(self, dtype):
        self.dtype = dtype

    @cute.jit
    def __call__(self, src: cute.Tensor, dst: cute.Tensor, scale: Float32, stream):
        per_cta = VEC * THREADS
        grid = ((cute.size(src) + per_cta - 1) // per_cta, 1, 1)
        # programmatic dependent launch: scheduled while the main kernel's last CTAs run
        self.kernel(src, dst, scale).launch(grid=grid, block=(THREADS, 1, 1), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, scale: Float32):
        cute.arch.griddepcontrol_wait()  # the main kernel's dQ adds have all landed
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        bidx = cute.arch.grid_dim()[0] - 1 - bidx  # last chunk first (bwd_dq_convert's docstring)
        chunk = bidx * THREADS + tidx  # this thread's 8 elements: column `chunk` below
        src_v = cute.logical_divide(src, cute.make_layout(VEC))  # (VEC, N / VEC)
        dst_v = cute.logical_divide(dst, cute.make_layout(VEC))
        if chunk * VEC < cute.size(src):
            r_src = cute.make_rmem_tensor((VEC,), Float32)
            cute.autovec_copy(src_v[None, chunk], r_src)
            r_dst = cute.make_rmem_tensor((VEC,), self.dtype)
            r_dst.store((r_src.load() * scale).to(self.dtype))
            cute.autovec_copy(r_dst, dst_v[None, chunk])
