"""Dynamic persistent scheduling: work items from a global counter, handed out through shared memory.

Persistent CTAs take the next work item from a global atomic counter when they are ready for it,
instead of a fixed round-robin: items go to whichever SM frees first, so the unequal items of a
longest-first causal order balance out, while item boundaries still overlap as in any persistent
kernel.

CTA c starts with item c; every later item is `num_ctas + atomic_add(counter, 1)`, so the counter
(one int32 in global memory) must be zero at launch. One producer warp takes the items and
publishes each in a two-slot mailbox in shared memory; the other warps that need it (`readers`
warps) read it from there. Barrier block (4 mbarriers): full[2] (arrive count 1: the producer),
empty[2] (arrive count `readers`: one arrival per reading warp). A value >= the item count ends
the loop of every warp.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def init_mailbox(bar, readers: cutlass.Constexpr[int]):
    """One thread: the mailbox's four barriers (before the CTA's mbarrier init fence)."""
    for slot in cutlass.range_constexpr(2):
        cute.arch.mbarrier_init(bar + slot, 1)  # the producer
        cute.arch.mbarrier_init(bar + 2 + slot, readers)  # each reading warp, once it has read


@cute.jit
def publish_item(bar, slots, i, t):
    """Producer warp: work item t into mailbox slot i % 2, once its readers freed it."""
    slot = i % 2
    cute.arch.mbarrier_wait(bar + 2 + slot, ((i // 2) % 2) ^ 1)
    if cute.arch.lane_idx() == 0:
        slots[slot] = t
        cute.arch.mbarrier_arrive(bar + slot)  # (release: the slot's write is seen)
    cute.arch.sync_warp()


@cute.jit
def read_item(bar, slots, i):
    """A reading warp: the i-th work item from its mailbox slot; the slot is handed back once
    every lane of the warp has read it."""
    slot = i % 2
    cute.arch.mbarrier_wait(bar + slot, (i // 2) % 2)
    t = slots[slot]
    cute.arch.sync_warp()
    if cute.arch.lane_idx() == 0:
        cute.arch.mbarrier_arrive(bar + 2 + slot)
    return t


@cute.jit
def next_item(counter, num_ctas):
    """Producer warp: the next work item from the counter (items below num_ctas are the CTAs'
    first ones)."""
    taken = Int32(0)
    if cute.arch.lane_idx() == 0:
        taken = cute.arch.atomic_add(counter, Int32(1), scope="gpu")
    return cute.arch.shuffle_sync(taken, 0) + num_ctas
