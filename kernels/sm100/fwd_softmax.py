"""Softmax pieces for score tiles read out of tensor memory, where one thread holds one whole row.

A 32x32b `tcgen05.ld` gives thread t of a warpgroup TMEM lane t (row t of the 128-row S tile),
so the row max and row sum need no cross-lane shuffles. `RowOnlineSoftmax` is
`common.online_softmax.OnlineSoftmax` with its per-row reductions inside the thread;
`as_wgmma_row` presents a thread's row fragment in the wgmma accumulator shape that
`common.masking.apply_mask` and `common.acc_layout.rows_cols` read, so the masks are sm90's code.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from torch_fa4.kernels.common.exp2_mufu import exp2_mufu
from torch_fa4.kernels.common.online_softmax import LN2, OnlineSoftmax, row_max


def as_wgmma_row(t: cute.Tensor) -> cute.Tensor:
    """A thread's 1-row fragment (any layout of N values) viewed as ((1, 1, N), 1, 1).

    `rows_cols` of that shape is ((1, 1), (1, N, 1)): one row, N columns, in the fragment's order."""
    n = cute.size(t)
    return cute.make_tensor(t.iterator, cute.composition(t.layout, cute.make_layout(((1, 1, n), 1, 1))))


class RowOnlineSoftmax(OnlineSoftmax):
    """Online softmax for a thread that owns one full score row (num_rows = 1)."""

    def __init__(self, scale_log2: Float32, rescale_threshold=None, emulate_every: int = 0):
        super().__init__(scale_log2, 1, rescale_threshold, emulate_every)

    @cute.jit
    def step(self, s_row: cute.Tensor, row_scale: cute.Tensor) -> cutlass.Boolean:
        """Scores -> p in place (s_row: the row's N values). row_scale[0] gets the factor O must be
        multiplied by before this tile's P V is added; returns whether the reference moved."""
        m = row_max(s_row, self.max_chains) * self.scale_log2
        old = self.ref[0]
        new = cute.arch.fmax(old, m)
        if cutlass.const_expr(self.rescale_threshold is not None):
            # FA4: keep the old reference unless the max grew past the threshold (-inf always moves)
            keep = m - old <= Float32(self.rescale_threshold)
            new = cutlass.select_(keep, old, new)
        ref_safe = cutlass.select_(new == -Float32.inf, Float32(0.0), new)
        corr = exp2_mufu(old - ref_safe)
        corr = cutlass.select_(new == old, Float32(1.0), corr)
        self.ref[0] = new
        row_scale[0] = corr
        self.row_sum[0] = self.row_sum[0] * corr + self._exp2_row(s_row, ref_safe)
        return new != old

    @cute.jit
    def finalize(self, row_scale: cute.Tensor, lse: cute.Tensor):
        """row_scale[0] = 1/sum (0 when nothing was visible); lse[0] natural-log LSE or -inf."""
        total = self.row_sum[0]
        empty = (self.ref[0] == -Float32.inf) | (total == Float32(0.0))
        row_scale[0] = cutlass.select_(empty, Float32(0.0), cute.arch.rcp_approx(total))
        lse[0] = cutlass.select_(
            empty, -Float32.inf, (self.ref[0] + cute.math.log2(total, fastmath=True)) * Float32(LN2))
