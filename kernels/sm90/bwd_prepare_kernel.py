"""The row-statistics kernel of bwd_prepare.py (its docstring has the scheme); compiled there."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .bwd_prepare import LOG2E, ROWS_PER_CTA, THREADS_PER_ROW, VEC, ZERO_VEC

_SHUFFLE_STEPS = THREADS_PER_ROW.bit_length() - 1  # butterfly steps over a row's threads


class RowStatisticsKernel:
    """fn(dout, out, lse, lse2, dpsum, dq_acc): dout/out (B, S, H, Dv), lse (B, H, S), lse2/dpsum
    (B, H, rows) with rows >= S (written in full, padding included); dq_acc (B, S, H, d_zero) fp32
    is zeroed on the way (None when d_zero = 0)."""

    threads = ROWS_PER_CTA * THREADS_PER_ROW

    def __init__(self, dtype, dv: int, d_zero: int = 0, dependent_launch: bool = True):
        if dv % (VEC * THREADS_PER_ROW):
            raise ValueError(f"Dv={dv} is not a multiple of {VEC * THREADS_PER_ROW}")
        if d_zero % (ZERO_VEC * THREADS_PER_ROW):
            raise ValueError(f"D={d_zero} is not a multiple of {ZERO_VEC * THREADS_PER_ROW}")
        self.dtype = dtype
        self.dependent_launch = dependent_launch  # griddepcontrol: sm_90 and later only
        self.dv = dv
        self.vecs_per_thread = dv // (VEC * THREADS_PER_ROW)
        self.d_zero = d_zero
        self.zero_vecs_per_thread = d_zero // (ZERO_VEC * THREADS_PER_ROW)

    @cute.jit
    def __call__(self, dout: cute.Tensor, out: cute.Tensor, lse: cute.Tensor, lse2: cute.Tensor,
                 dpsum: cute.Tensor, dq_acc, stream):
        batch, heads, rows = lse2.shape
        grid = ((rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, heads, batch)
        self.kernel(dout, out, lse, lse2, dpsum, dq_acc).launch(grid=grid, block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, dout: cute.Tensor, out: cute.Tensor, lse: cute.Tensor, lse2: cute.Tensor,
               dpsum: cute.Tensor, dq_acc):
        # The main backward kernel (launched with programmatic dependent launch) may start its
        # prologue now; it waits for this grid before it reads anything this one writes.
        if const_expr(self.dependent_launch):
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        tile, h, b = cute.arch.block_idx()
        # slabs last to first (bwd_prepare's docstring)
        n_tiles, n_heads, n_batch = cute.arch.grid_dim()
        tile, h, b = n_tiles - 1 - tile, n_heads - 1 - h, n_batch - 1 - b
        seqlen = dout.shape[1]
        rows = lse2.shape[2]
        row = tile * ROWS_PER_CTA + tidx // THREADS_PER_ROW
        part = tidx % THREADS_PER_ROW

        acc = Float32(0.0)
        x = Float32(0.0)
        if row < seqlen:
            x = lse[b, h, row]  # issued first, so its latency overlaps the row loads
            # (VEC, Dv / VEC): column j is the j-th 16-byte vector of the row
            do_vecs = cute.logical_divide(dout[b, row, h, None], cute.make_layout(VEC))
            o_vecs = cute.logical_divide(out[b, row, h, None], cute.make_layout(VEC))
            r_do = cute.make_rmem_tensor((VEC, self.vecs_per_thread), self.dtype)
            r_o = cute.make_rmem_tensor((VEC, self.vecs_per_thread), self.dtype)
            # all loads first: up to 2 x 8 x 16 bytes in flight per thread hide DRAM latency
            for j in cutlass.range_constexpr(self.vecs_per_thread):
                cute.autovec_copy(do_vecs[None, part + j * THREADS_PER_ROW], r_do[None, j])
                cute.autovec_copy(o_vecs[None, part + j * THREADS_PER_ROW], r_o[None, j])
            if const_expr(self.d_zero > 0):
                # the backward's dQ buffer row, zeroed while the loads are in flight (a separate
                # fill pass costs one more launch and a pass over the buffer)
                z_vecs = cute.logical_divide(dq_acc[b, row, h, None], cute.make_layout(ZERO_VEC))
                zero = cute.make_rmem_tensor((ZERO_VEC,), Float32)
                zero.fill(0.0)
                for j in cutlass.range_constexpr(self.zero_vecs_per_thread):
                    cute.autovec_copy(zero, z_vecs[None, part + j * THREADS_PER_ROW])
            prod = r_do.load().to(Float32) * r_o.load().to(Float32)
            acc = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        # outside the branch: every lane of the warp takes part in the shuffles
        for i in cutlass.range_constexpr(_SHUFFLE_STEPS):
            acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=THREADS_PER_ROW >> (i + 1))

        at = row
        if part == 0:
            if row < seqlen:
                # same fp32 product as the torch path (lse * log2 e), +inf where no key is seen
                lse2[b, h, at] = cutlass.select_(x == -Float32.inf, Float32.inf, x * Float32(LOG2E))
                dpsum[b, h, at] = acc
            elif row < rows:
                lse2[b, h, at] = Float32.inf
                dpsum[b, h, at] = Float32(0.0)
