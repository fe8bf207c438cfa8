"""Which key tiles a query tile visits, and which of those need element masks.

Conventions (docs/INTERNALS.md): query row i sees key j when j < Sk and, with causal,
j <= i + (Sk - Sq); with a window (left, right), i + (Sk - Sq) - left <= j <= i + (Sk - Sq) + right.
An unbounded window side is passed as a huge number (UNBOUNDED), so one formula serves every case.
A tile range may be empty (e.g. causal rows above the diagonal when Sq > Sk): then n_max <= n_min
and the kernel writes out = 0, lse = -inf without loading any key.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from torch_fa4.kernels.common.dsl_state import DynamicState

UNBOUNDED = 1 << 30


class BlockRange(DynamicState):
    _dynamic_fields = ("window_left", "window_right")

    def __init__(self, tile_m: int, tile_n: int, causal: bool, has_window: bool,
                 window_left: Int32, window_right: Int32):
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.causal = causal
        self.has_window = has_window
        self.window_left = Int32(window_left)
        self.window_right = Int32(window_right)

    @cute.jit
    def right_limit(self, row: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """Exclusive key limit for query row `row` (may exceed seqlen_k before clamping)."""
        lim = seqlen_k
        diag = row + seqlen_k - seqlen_q
        if const_expr(self.causal):
            lim = cutlass.min(lim, diag + 1)
        if const_expr(self.has_window):
            lim = cutlass.min(lim, diag + self.window_right + 1)
        return lim

    @cute.jit
    def left_limit(self, row: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """Inclusive lower key limit (0 without a left window)."""
        lim = Int32(0)
        if const_expr(self.has_window):
            lim = cutlass.max(lim, row + seqlen_k - seqlen_q - self.window_left)
        return lim

    @cute.jit
    def n_block_range(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """(n_min, n_max): key tiles [n_min, n_max) hold every visible key of this query tile."""
        first_row = m_block * self.tile_m
        last_row = cutlass.min(first_row + self.tile_m, seqlen_q) - 1
        hi = cutlass.max(self.right_limit(last_row, seqlen_q, seqlen_k), 0)
        n_max = (hi + self.tile_n - 1) // self.tile_n
        return self.left_limit(first_row, seqlen_q, seqlen_k) // self.tile_n, n_max

    @cute.jit
    def masked_ends(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, n_min: Int32, n_max: Int32):
        """Walking key tiles n_max-1 down to n_min (walk index t = n_max-1-n): (r, l) such that
        tiles t < r and t >= l may need element masks and t in [r, l) need none. r counts the
        tiles cut by the right limit (causal diagonal, window right, seqlen_k) of the tile's first
        row; l starts the tiles cut by the left window limit of its last row. Agrees with
        needs_mask tile by tile."""
        count = n_max - n_min
        first_row = m_block * self.tile_m
        last_row = first_row + self.tile_m - 1
        # (n + 1) * tile_n > right  <=>  n >= right // tile_n   (right clamped at 0: all masked)
        n_right = cutlass.max(self.right_limit(first_row, seqlen_q, seqlen_k), 0) // self.tile_n
        r = cutlass.min(cutlass.max(n_max - n_right, 0), count)
        l = count
        if const_expr(self.has_window):
            # n * tile_n < left  <=>  n < ceil(left / tile_n)   (left >= 0)
            n_left = (self.left_limit(last_row, seqlen_q, seqlen_k) + self.tile_n - 1) // self.tile_n
            l = cutlass.min(cutlass.max(n_max - n_left, r), count)
        return r, l

    @cute.jit
    def needs_mask(self, n_block: Int32, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """True when some element of tile (m_block, n_block) is invisible to its row."""
        first_row = m_block * self.tile_m
        last_row = first_row + self.tile_m - 1
        col_lo = n_block * self.tile_n
        col_hi = col_lo + self.tile_n  # exclusive
        # the first row has the smallest right limit, the last row the largest left limit
        return (col_hi > self.right_limit(first_row, seqlen_q, seqlen_k)) | (
            col_lo < self.left_limit(last_row, seqlen_q, seqlen_k)
        )
