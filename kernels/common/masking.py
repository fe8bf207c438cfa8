"""Element masks on a score tile: -inf where a key is invisible to its query row.

Works on the (rows, cols) view of a thread's accumulator together with the identity-coordinate
tensor partitioned the same way. That coordinate tensor is a dynamic per-thread origin plus a
static layout, so an element's column is `origin + constant`: each row's limits are shifted by the
origin once and every element compares a compile-time constant against them. Materialising each
element's column instead costs a register per column, which the compiler hoists out of the key
loop and then spills.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32

from torch_fa4.kernels.common.acc_layout import rows_cols, rows_cols_layout
from torch_fa4.kernels.common.block_range import BlockRange


def static_offsets(coords: cute.Tensor):
    """(row offsets, column offsets) of a partitioned identity tensor's (rows, cols) view,
    relative to its per-thread origin `coords.iterator`: Python ints."""
    layout = rows_cols_layout(coords.layout)
    rows = [layout((r, 0))[0] for r in range(cute.size(layout, mode=[0]))]
    cols = [layout((0, j))[1] for j in range(cute.size(layout, mode=[1]))]
    return rows, cols


@cute.jit
def apply_mask(acc_s: cute.Tensor, coords: cute.Tensor, block_range: BlockRange,
               m_block: Int32, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
               by_select: cutlass.Constexpr = False):
    """by_select: one select per element instead of a dynamic `if` (an scf.if region per
    element, slow to trace). The sm90 forward's cubins are identical either way; the sm100
    forward's are not (more instructions with selects), so it keeps the `if`."""
    s = rows_cols(acc_s)
    row_offsets, col_offsets = static_offsets(coords)
    row0 = m_block * block_range.tile_m + coords.iterator[0]
    col0 = n_block * block_range.tile_n + coords.iterator[1]
    for r in cutlass.range_constexpr(len(row_offsets)):
        row = row0 + row_offsets[r]
        hi = block_range.right_limit(row, seqlen_q, seqlen_k) - col0
        lo = block_range.left_limit(row, seqlen_q, seqlen_k) - col0
        for j in cutlass.range_constexpr(len(col_offsets)):
            masked = (col_offsets[j] >= hi) | (col_offsets[j] < lo)
            if cutlass.const_expr(by_select):
                s[r, j] = Float32(cutlass.select_(masked, -Float32.inf, s[r, j]))
            elif masked:
                s[r, j] = -Float32.inf


def visible(q_off: int, k_off: int, q_end=None, k_end=None, right=None, left=None) -> Boolean:
    """Whether the key at static offset `k_off` is visible from the query at static offset
    `q_off` (offsets from the thread's origin, as static_offsets gives them), against limits
    already shifted by that origin: q_off < q_end (the query inside its sequence), k_off < k_end
    (the key inside its sequence), k_off - q_off <= right (causal / right window), k_off - q_off
    >= left (left window). A limit given as None is not tested. The sm90 backward's masks (keys
    along its S^T tile's rows, queries along its columns)."""
    ok = Boolean(True)
    if cutlass.const_expr(q_end is not None):
        ok = ok & (q_off < q_end)
    if cutlass.const_expr(k_end is not None):
        ok = ok & (k_off < k_end)
    if cutlass.const_expr(right is not None):
        ok = ok & (k_off - q_off <= right)
    if cutlass.const_expr(left is not None):
        ok = ok & (k_off - q_off >= left)
    return ok
