"""Order in which (query tile, head, batch) work items are handed to CTAs.

Work items are numbered 0 .. num_tiles-1. A one-shot grid has one CTA per item; a persistent grid
of `num_ctas` CTAs (about one per SM) takes items c, c + num_ctas, ... (or, dynamically, from a
global counter: kernels/common/tile_mailbox.py). Items are grouped by `heads_per_group` (batch,
head) pairs, sized on the host (host.fwd_launch.l2_group_bytes), so the CTAs in flight read the
K and V of only a few heads. Inside a group the query tile index is the slowest coordinate and,
with `longest_first`, runs from the last tile down: under causal masking the last query tiles see
the most keys, so the longest work starts first and the short tail fills the gaps (LPT).

Under a causal mask that order alone leaves a long item for the end of the grid: a group of a few
pairs holds less work per SM than its longest item, so the last group's longest items start when
every other SM is about to finish and run on alone. The last `tail_pairs` pairs therefore form one
group of their own, sized on the host (host.fwd_launch.tail_pairs) so its work holds every SM's
share of the longest walk; the backward orders its key tiles the same way (`grouped_order`).

Work units: with a split tail (kernels/common/split_tail.py) the last `split_items` items run as
`split_ways` pieces each, numbered after the whole items, so a grid (or a persistent loop) runs
num_tiles() = items + split_items * (split_ways - 1) units; `work` maps a unit to its item and
`piece` to its piece.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from torch_fa4.kernels.common.dsl_state import DynamicState


class TileScheduler(DynamicState):
    # carried through the persistent loop (the DSL must be able to yield it)
    _dynamic_fields = ("num_m_blocks", "num_heads", "num_batch", "heads_per_group", "tail_pairs",
                       "split_items")

    def __init__(self, num_m_blocks: Int32, num_heads: Int32, num_batch: Int32,
                 heads_per_group: Int32, tail_pairs: Int32, longest_first: bool,
                 split_items=0, split_ways: int = 0, split_pair: int = 1):
        self.num_m_blocks = Int32(num_m_blocks)
        self.num_heads = Int32(num_heads)
        self.num_batch = Int32(num_batch)
        self.heads_per_group = Int32(heads_per_group)
        self.tail_pairs = Int32(tail_pairs)  # 0: no tail group
        self.longest_first = longest_first
        # the last split_items items are each split into split_ways pieces along the keys
        # (kernels/common/split_tail.py); split_ways is a compile-time constant (its divisions
        # stay shifts and multiplies on the uniform datapath), 0: no split code at all.
        # split_pair = 2: K / V multicast clusters take units in pairs (2i, 2i + 1), which must
        # be the same piece of two adjacent items
        self.split_ways = split_ways
        self.split_items = Int32(split_items if split_ways else 0)
        self.split_pair = split_pair

    @staticmethod
    def grid(num_m_blocks, num_heads, num_batch, split_items=0, split_ways: int = 0):
        extra = split_items * (split_ways - 1) if split_ways else 0
        return (num_m_blocks * num_heads * num_batch + extra, 1, 1)

    def num_items(self) -> Int32:
        return self.num_m_blocks * self.num_heads * self.num_batch

    def num_tiles(self) -> Int32:
        """Work units: the whole items, then the split items' pieces."""
        if const_expr(not self.split_ways):
            return self.num_items()
        return self.num_items() + self.split_items * (self.split_ways - 1)

    @cute.jit
    def _split_unit(self, v: Int32):
        """(piece, split index) of the v-th piece unit: item-major (an item's pieces on adjacent
        units, so they start together on different SMs), or with split_pair = 2 pair-major (units
        2i, 2i + 1 the same piece of two adjacent split items)."""
        k = self.split_ways
        if const_expr(self.split_pair == 1):
            return item_major_piece(v, k)
        g = v // (2 * k)
        rem = v - g * (2 * k)
        return rem // 2, 2 * g + rem % 2

    @cute.jit
    def piece(self, t: Int32):
        """(piece, split index) of work unit t: piece -1 for a whole item, else unit t is piece
        `piece` of the split items' `split index`-th."""
        p = Int32(-1)
        j = Int32(0)
        if const_expr(self.split_ways):
            first = self.num_items() - self.split_items
            if t >= first:
                p, j = self._split_unit(t - first)
        return p, j

    @cute.jit
    def persistent_tile(self, rnd: Int32, cta: Int32, num_ctas: Int32) -> Int32:
        """The work item CTA `cta` of a persistent grid takes in round `rnd` (rounds of num_ctas
        items). The rounds alternate direction (CTA 0 takes the first item of even rounds and the
        last of odd ones): in a longest-first order a plain round-robin would hand CTA 0 the
        longest item of every round, and under causal masking those differences add up."""
        pos = cta
        if rnd % 2 == 1:
            pos = num_ctas - 1 - cta
        return rnd * num_ctas + pos

    @cute.jit
    def work(self, t: Int32):
        """(m_block, head, batch) of work unit t."""
        if const_expr(self.split_ways):
            first = self.num_items() - self.split_items
            if t >= first:  # a piece of split item j
                _, j = self._split_unit(t - first)
                t = first + j
        m_idx, bh = grouped_order(t, self.num_m_blocks, self.num_heads * self.num_batch,
                                  self.heads_per_group, self.tail_pairs)
        m_block = m_idx
        if const_expr(self.longest_first):
            m_block = self.num_m_blocks - 1 - m_idx
        batch = bh // self.num_heads
        head = bh - batch * self.num_heads
        return m_block, head, batch


@cute.jit
def grouped_order(t: Int32, tiles_per_pair: Int32, pairs: Int32, group: Int32, tail: Int32):
    """(tile position, pair) of item t in a grouped order: groups of `group` (batch, head) pairs,
    the tile position the slowest coordinate inside a group (every pair's first tile, then every
    pair's second, ...), except that the last `tail` pairs form one group of their own (0: none;
    the last ordinary group may hold fewer pairs). The forward's items and the backward's key
    tiles both run in this order."""
    tail = cutlass.min(tail, pairs)
    tail_start = (pairs - tail) * tiles_per_pair  # the tail group's first item
    pos = Int32(0)
    pair = Int32(0)
    if t >= tail_start:
        r = t - tail_start
        pos = r // tail
        pair = pairs - tail + r - pos * tail
    else:
        span = group * tiles_per_pair
        g = t // span
        size = cutlass.min(group, pairs - tail - g * group)
        r = t - g * span
        pos = r // size
        pair = g * group + r - pos * size
    return pos, pair


@cute.jit
def split_unit(t: Int32, items: Int32, split_items: Int32, ways):
    """(item, piece, split index) of work unit t of a grid whose last `split_items` of `items`
    run as `ways` pieces each, numbered after the whole items and item-major: piece -1 for a
    whole item (the sm90 backward's order; TileScheduler above adds the forward's pairs)."""
    first = items - split_items
    item = t
    piece = Int32(-1)
    j = Int32(0)
    if t >= first:
        piece, j = item_major_piece(t - first, ways)
        item = first + j
    return item, piece, j


@cute.jit
def item_major_piece(v: Int32, ways):
    """(piece, split index) of the v-th piece unit when each split item's `ways` pieces take
    adjacent units (so they start together on different SMs)."""
    j = v // ways
    return v - j * ways, j
