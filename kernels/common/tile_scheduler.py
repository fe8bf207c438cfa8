"""Order in which (query tile, head, batch) work items are handed to CTAs.

Work items are numbered 0 .. num_tiles-1. A one-shot grid has one CTA per item (CTA t takes item
t). A persistent grid has `num_ctas` CTAs (about one per SM) and CTA c takes items c, c + num_ctas,
c + 2*num_ctas, ...: a static round-robin over the same ordering, so the producer warp can load
the next item's Q and K while the consumers finish the current one (epilogue and prologue hide
under each other), and under causal masking (longest first, below) each CTA's share of work comes
out close to equal (LPT). Items are grouped by `heads_per_group`
(batch, head) pairs, sized on the host (common.fwd_launch.l2_group_bytes): under causal / window
masks so one group's K and V take about a sixth of L2, otherwise one pair per group, so the CTAs
in flight at once read the K and V of only a few heads; within a group, consecutive CTAs share
K/V through L2. Inside a group the query tile index is the slowest
coordinate and, with `longest_first`, runs from the last tile down: under causal masking the last
query tiles see the most keys, so the longest work starts first and the short tail fills the gaps
(LPT scheduling). A persistent kernel may instead take the same numbered items from a global
counter as its CTAs free (kernels/common/tile_mailbox.py), which balances unequal items better.
"""

import cutlass.cute as cute
from cutlass import Int32, const_expr

from torch_fa4.kernels.common.dsl_state import DynamicState


class TileScheduler(DynamicState):
    # carried through the persistent loop (the DSL must be able to yield it)
    _dynamic_fields = ("num_m_blocks", "num_heads", "num_batch", "heads_per_group")

    def __init__(self, num_m_blocks: Int32, num_heads: Int32, num_batch: Int32,
                 heads_per_group: Int32, longest_first: bool):
        self.num_m_blocks = Int32(num_m_blocks)
        self.num_heads = Int32(num_heads)
        self.num_batch = Int32(num_batch)
        self.heads_per_group = Int32(heads_per_group)
        self.longest_first = longest_first

    @staticmethod
    def grid(num_m_blocks, num_heads, num_batch):
        return (num_m_blocks * num_heads * num_batch, 1, 1)

    def num_tiles(self) -> Int32:
        return self.num_m_blocks * self.num_heads * self.num_batch

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
        """(m_block, head, batch) of work item t."""
        total_bh = self.num_heads * self.num_batch
        per_group = self.num_m_blocks * self.heads_per_group
        group = t // per_group
        r = t - group * per_group
        bh_first = group * self.heads_per_group
        # the last group may hold fewer (batch, head) pairs
        group_size = total_bh - bh_first
        if group_size > self.heads_per_group:
            group_size = self.heads_per_group
        m_idx = r // group_size
        bh = bh_first + (r - m_idx * group_size)
        m_block = m_idx
        if const_expr(self.longest_first):
            m_block = self.num_m_blocks - 1 - m_idx
        batch = bh // self.num_heads
        head = bh - batch * self.num_heads
        return m_block, head, batch
