"""Online softmax over key tiles, in the log2 domain, for one thread's rows of a score tile.

Each row of a wgmma score tile is spread over the 4 lanes of a quad; a thread holds a few rows
(`rows_cols` view). Scores arrive in "softmax units": the kernel folds every per-call factor into
`scale_log2` so that  p = 2^(s * scale_log2 - ref)  with one FFMA per element.

`ref` (kept per row, already multiplied by scale_log2) is the reference max that O and the row sum
are both expressed against. Two policies:
- always rescale (threshold None): ref follows the running max every tile, as in FA2/FA3;
- conditional rescale (FA4): ref moves only when the tile max exceeds it by more than `threshold`
  (8 in log2 = factor 256). p then stays <= 2^8, harmless in fp32 and bf16, and the O rescale is
  skipped for the whole warp when no row moved. Exact: O and the sum always share one reference.

Exponentials: hardware ex2 (MUFU) for most columns; with `emulate_every = k > 0`, every k-th
column uses the FMA-pipe polynomial (exp2_emulation), the FA4 split between the two units.
Rows whose max is still -inf (nothing visible yet) use reference 0, so no -inf - -inf NaN appears.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from torch_fa4.kernels.common.acc_layout import rows_cols
from torch_fa4.kernels.common.dsl_state import DynamicState
from torch_fa4.kernels.common.exp2_emulation import exp2_fma
from torch_fa4.kernels.common.exp2_mufu import exp2_mufu

LN2 = 0.6931471805599453


@cute.jit
def quad_allreduce(x: Float32, combine: cutlass.Constexpr) -> Float32:
    # the 4 lanes of a quad hold one row: butterfly over lane bits 0 and 1
    x = combine(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return combine(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def row_max(s_row: cute.Tensor, chains: cutlass.Constexpr[int]) -> Float32:
    """max over s_row's values as `chains` independent FMNMX chains joined at the end: ptxas does
    not reassociate the max, so one chain is len(s_row) - 1 dependent instructions deep."""
    n = cute.size(s_row)
    parts = [s_row[c] for c in range(chains)]
    for c in cutlass.range_constexpr(chains, n):
        parts[c % chains] = cute.arch.fmax(parts[c % chains], s_row[c])
    return _pairwise_max(parts)


def _pairwise_max(parts: list) -> Float32:
    # plain Python (a trace-time loop): cute.jit would turn this `while` into a device loop
    while len(parts) > 1:
        parts = [cute.arch.fmax(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)] + (
            [parts[-1]] if len(parts) % 2 else [])
    return parts[0]


class OnlineSoftmax(DynamicState):
    _dynamic_fields = ("scale_log2", "ref", "row_sum")

    def __init__(self, scale_log2: Float32, num_rows: int, rescale_threshold=None, emulate_every: int = 0,
                 max_chains: int = 1, row_lanes: int = 4):
        self.scale_log2 = scale_log2
        self.row_lanes = row_lanes  # lanes holding one row: a wgmma quad, or 1 (sm100: a thread per row)
        self.max_chains = max_chains
        self.num_rows = num_rows
        self.rescale_threshold = rescale_threshold
        self.emulate_every = emulate_every
        self.ref = cute.make_rmem_tensor(num_rows, Float32)  # reference max, log2 units
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)  # this thread's partial sum
        self.ref.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    def _allreduce(self, x: Float32, combine) -> Float32:
        return quad_allreduce(x, combine) if const_expr(self.row_lanes == 4) else x

    @cute.jit
    def _exp2_row(self, s_row: cute.Tensor, ref_safe: Float32) -> Float32:
        """p = 2^(s * scale_log2 - ref) in place; returns the partial row sum."""
        total = Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(s_row)):
            x = s_row[c] * self.scale_log2 - ref_safe
            if const_expr(self.emulate_every > 0 and c % self.emulate_every == self.emulate_every - 1):
                p = exp2_fma(x)
            else:
                p = exp2_mufu(x)
            s_row[c] = p
            total += p  # (the value, not a reload of s_row[c]: one op less per element to trace)
        return total

    @cute.jit
    def step(self, acc_s: cute.Tensor, row_scale: cute.Tensor) -> cutlass.Boolean:
        """Turn scores into p in place; row_scale[r] gets the factor O's row r must be multiplied by.

        Returns whether any row of this warp changed its reference (else row_scale is all 1 and
        the caller may skip the O rescale)."""
        s = rows_cols(acc_s)
        any_moved = cutlass.Boolean(False)
        for r in cutlass.range_constexpr(self.num_rows):
            m = row_max(s[r, None], self.max_chains)
            m = self._allreduce(m, cute.arch.fmax) * self.scale_log2
            old = self.ref[r]
            new = cute.arch.fmax(old, m)
            if const_expr(self.rescale_threshold is not None):
                # keep the old reference unless the max grew past the threshold; -inf old always moves
                keep = m - old <= Float32(self.rescale_threshold)
                new = cutlass.select_(keep, old, new)
            ref_safe = cutlass.select_(new == -Float32.inf, Float32(0.0), new)
            corr = exp2_mufu(old - ref_safe)
            if const_expr(self.rescale_threshold is not None):
                corr = cutlass.select_(new == old, Float32(1.0), corr)
                any_moved = any_moved | (new != old)
            self.ref[r] = new
            row_scale[r] = corr
            self.row_sum[r] = self.row_sum[r] * corr + self._exp2_row(s[r, None], ref_safe)
        if const_expr(self.rescale_threshold is not None):
            any_moved = cute.arch.vote_any_sync(any_moved)
        else:
            any_moved = cutlass.Boolean(True)
        return any_moved

    @cute.jit
    def finalize(self, row_scale: cute.Tensor, lse: cute.Tensor):
        """row_scale[r] = 1/sum (0 for rows with nothing visible); lse[r] natural-log LSE or -inf."""
        for r in cutlass.range_constexpr(self.num_rows):
            total = self._allreduce(self.row_sum[r], operator.add)
            empty = (self.ref[r] == -Float32.inf) | (total == Float32(0.0))
            row_scale[r] = cutlass.select_(empty, Float32(0.0), cute.arch.rcp_approx(total))
            lse[r] = cutlass.select_(
                empty, -Float32.inf, (self.ref[r] + cute.math.log2(total, fastmath=True)) * Float32(LN2)
            )


@cute.jit
def scale_rows(acc_o: cute.Tensor, row_scale: cute.Tensor):
    """O's row r times row_scale[r]."""
    o = rows_cols(acc_o)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] = o[r, c] * row_scale[r]
