"""Element masks on a score tile: -inf where a key is invisible to its query row.

Works on the (rows, cols) view of a thread's accumulator together with the identity-coordinate
tensor partitioned the same way, so no lane/register index arithmetic is repeated here.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from torch_fa4.kernels.common.acc_layout import rows_cols
from torch_fa4.kernels.common.block_range import BlockRange


@cute.jit
def apply_mask(acc_s: cute.Tensor, coords: cute.Tensor, block_range: BlockRange,
               m_block: Int32, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
    s = rows_cols(acc_s)
    c = rows_cols(coords)
    row0 = m_block * block_range.tile_m
    col0 = n_block * block_range.tile_n
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        row = row0 + c[r, 0][0]
        hi = block_range.right_limit(row, seqlen_q, seqlen_k) - col0
        lo = block_range.left_limit(row, seqlen_q, seqlen_k) - col0
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            col = c[r, j][1]
            if (col >= hi) | (col < lo):
                s[r, j] = -Float32.inf
