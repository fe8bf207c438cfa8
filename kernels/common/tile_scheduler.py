"""Order in which (query tile, head, batch) work items are handed to CTAs.

The grid is one-dimensional; CTA t takes work item t. Items are grouped by `heads_per_group`
(batch, head) pairs, sized on the host so one group's K and V fit in about half of L2: within a
group, consecutive CTAs share K/V through L2. Inside a group the query tile index is the slowest
coordinate and, with `longest_first`, runs from the last tile down: under causal masking the last
query tiles see the most keys, so the longest work starts first and the short tail fills the gaps
(LPT scheduling).
"""

import cutlass.cute as cute
from cutlass import Int32, const_expr


class TileScheduler:
    def __init__(self, num_m_blocks: Int32, num_heads: Int32, num_batch: Int32,
                 heads_per_group: Int32, longest_first: bool):
        self.num_m_blocks = num_m_blocks
        self.num_heads = num_heads
        self.num_batch = num_batch
        self.heads_per_group = heads_per_group
        self.longest_first = longest_first

    @staticmethod
    def grid(num_m_blocks, num_heads, num_batch):
        return (num_m_blocks * num_heads * num_batch, 1, 1)

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
