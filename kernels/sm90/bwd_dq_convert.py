"""sm90 backward's last pass as one CuTe DSL kernel: the fp32 dQ buffer -> dq in the input dtype.

The backward kernel adds every key tile's dQ into an fp32 buffer laid out like dq itself
(B, Sq, Hq, D), and leaves the softmax scale out (bwd_kernel: one multiply per element less in
the loop). This pass applies it while narrowing: dq = dq_acc * scale, element for element, both
contiguous, so it is a flat loop over N = B * Sq * Hq * D elements.

`torch.mul(dq_acc, scale, out=dq)` into a narrower dtype runs torch's unrolled, not vectorized,
elementwise kernel; here each thread reads 8 floats as two 16-byte loads and writes 8 16-bit
values as one 16-byte store, close to DRAM bandwidth.

Launched as a programmatic dependent of the main backward kernel (scheduled under its last
wave); CTAs take the buffer last chunk first: the main kernel's last pairs added their dQ last,
so their lines are the ones still in L2 (NOTES Experiment 128).

Compiled once per output dtype; N is symbolic (a multiple of 8: head dims are).
The kernel itself is in bwd_dq_convert_kernel.py, imported only to compile it: this module's
host side loads no CuTe DSL, so a kernel loaded from the disk cache (kernels/disk_cache.py) runs
without it.
"""

from __future__ import annotations

import torch

VEC = 8  # elements per thread: 2 x 16-byte fp32 loads, 1 x 16-byte store of 16-bit values
THREADS = 256
MAX_ELEMENTS = 2**31 - VEC * THREADS  # 32-bit element indices


def compile_kernel(dtype: torch.dtype, arch: str = "sm_90a", dump_dir: str | None = None):
    """cute.compile the kernel for the output dtype against a symbolic length (no GPU needed);
    cached per process (kernels/compile_cache.py). dump_dir: also keep the cubin there."""
    from .bwd_compile import cached_compile

    build = lambda dump, jit=True: _compile(dtype, arch, dump, jit)  # noqa: E731
    return cached_compile(("sm90_bwd_dq_convert", arch, dtype), build, dump_dir)


def _compile(dtype: torch.dtype, arch: str, dump_dir: str | None, jit: bool = True):
    import cutlass.cute as cute
    from cutlass import Float32

    from .bwd_compile import compile_with_stream, cute_dtype
    from .bwd_dq_convert_kernel import ScaledNarrowKernel

    n = cute.sym_int(divisibility=VEC)
    src = cute.runtime.make_fake_tensor(Float32, (n,), stride=(1,), assumed_align=16)
    dst = cute.runtime.make_fake_tensor(cute_dtype(dtype), (n,), stride=(1,), assumed_align=16)
    kernel = ScaledNarrowKernel(cute_dtype(dtype))
    return compile_with_stream(kernel, (src, dst, Float32(1.0)), arch, dump_dir, jit)


def takes(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether the kernel takes this pair: CUDA, contiguous, fp32 -> fp16/bf16, equal sizes that
    are multiples of 8, 16-byte aligned, within 32-bit indexing."""
    return (src.is_cuda and src.dtype == torch.float32 and dst.dtype in (torch.float16, torch.bfloat16)
            and src.is_contiguous() and dst.is_contiguous() and src.numel() == dst.numel()
            and src.numel() % VEC == 0 and 0 < src.numel() <= MAX_ELEMENTS
            and src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0)


def scaled_narrow(src: torch.Tensor, dst: torch.Tensor, scale: float) -> None:
    """dst = src * scale in dst's dtype (call when `takes(src, dst)`)."""
    compile_kernel(dst.dtype)(src.view(-1), dst.view(-1), float(scale))
