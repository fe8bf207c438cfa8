"""The sequence of key tiles one query tile visits: t = 0 .. count-1 -> key tile index n_block(t).

The producer (TMA loads) and the consumers (matmuls, softmax) walk the same sequence, each computing
n_block(t) on its own, so they agree without talking to each other.

- `DenseKvWalk`: every tile of the [n_min, n_max) range from BlockRange, last to first (the tiles
  that need causal / window / length masks come first).
- `SparseKvWalk`: only the tiles a block mask lists for this query tile, FlexAttention's layout
  (docs/INTERNALS.md): first the partial tiles (`kv_num_blocks` / `kv_indices`: mask_mod must be
  evaluated), then the full ones (`full_kv_*`: mask_mod is known to be true everywhere). Tiles the
  block mask does not list are empty and never loaded.

A block-mask tile of (ratio_m * tile_m, ratio_n * tile_n) covers ratio_m query tiles and ratio_n
key tiles. The sparse walk does not clip to BlockRange's [n_min, n_max): listed tiles outside it
are visited and masked to -inf element by element, which is exact and assumes nothing about the
order of the indices.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from torch_fa4.kernels.common.dsl_state import DynamicState

# Both walks are DynamicState: the DSL treats an object whose methods are called inside a dynamic
# `if` / loop as possibly changed there, so it must be able to carry its values through.


class DenseKvWalk(DynamicState):
    _dynamic_fields = ("n_min", "n_max")

    def __init__(self, n_min: Int32, n_max: Int32):
        self.n_min = n_min
        self.n_max = n_max

    @property
    def count(self) -> Int32:
        return self.n_max - self.n_min

    def nonempty(self):
        return self.n_max > self.n_min

    def n_block(self, t: Int32) -> Int32:
        return self.n_max - 1 - t


class SparseKvWalk(DynamicState):
    _dynamic_fields = ("num_partial", "count", "partial_indices", "full_indices")

    def __init__(self, kv_num_blocks: cute.Tensor, kv_indices: cute.Tensor,
                 full_num_blocks: cute.Tensor, full_indices: cute.Tensor,
                 batch: Int32, head: Int32, m_block: Int32, ratio_m: int, ratio_n: int):
        # a block mask built with B = None / H = None has size 1 there and applies to every batch/head
        b = cutlass.select_(kv_num_blocks.shape[0] == 1, Int32(0), batch)
        h = cutlass.select_(kv_num_blocks.shape[1] == 1, Int32(0), head)
        mq = m_block if const_expr(ratio_m == 1) else m_block // ratio_m
        self.ratio_n = ratio_n
        self.num_partial = kv_num_blocks[b, h, mq]
        num_full = full_num_blocks[b, h, mq]
        self.partial_indices = kv_indices[b, h, mq, None]
        self.full_indices = full_indices[b, h, mq, None]
        self.count = (self.num_partial + num_full) * ratio_n

    def nonempty(self):
        return self.count > 0

    @cute.jit
    def n_block(self, t: Int32) -> Int32:
        blk = t
        sub = Int32(0)
        if const_expr(self.ratio_n > 1):
            blk = t // self.ratio_n
            sub = t - blk * self.ratio_n
        bn = Int32(0)
        if blk < self.num_partial:
            bn = self.partial_indices[blk]
        else:
            bn = self.full_indices[blk - self.num_partial]
        return bn * self.ratio_n + sub

    def is_partial(self, t: Int32):
        """Whether tile t needs mask_mod (a dynamic Boolean, uniform over the CTA)."""
        return t < self.num_partial * self.ratio_n
