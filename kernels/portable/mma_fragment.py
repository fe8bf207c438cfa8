"""The warp-level MMA (mma.sync m16n8k16) accumulator seen as the shared code expects it.

A thread's fp32 accumulator from a warp-MMA tiled over (M, N) has shape ((2, 2), MMA_M, MMA_N):
mode 0.0 picks one of two adjacent columns, mode 0.1 one of two rows 8 apart, MMA_M the 16-row
blocks, MMA_N the 8-column blocks. A Hopper wgmma accumulator is ((2, 2, N/8), MMA_M, MMA_N) with
the same two inner modes, so the warp-MMA fragment is exactly a wgmma fragment whose 8-column
groups sit in mode 0.2 and whose MMA_N is 1. Viewed that way (no data moves), the shared softmax,
masks, mods and P-operand views (kernels/common/acc_layout.py, online_softmax.py, masking.py,
tile_mods.py) apply unchanged. The A operand of mma.sync m16n8k16 holds (2 columns, 2 rows 8
apart, 2 k halves) per MMA block, the order in which acc_layout.a_operand reads two adjacent
8-column groups: P converts straight into the A fragment of O += P V.
"""

import cutlass.cute as cute


def wgmma_view_layout(layout: cute.Layout) -> cute.Layout:
    """((2, 2), M, N) -> ((2, 2, N), M, 1)."""
    s, d = layout.shape, layout.stride
    return cute.make_layout(((s[0][0], s[0][1], s[2]), s[1], 1), stride=((d[0][0], d[0][1], d[2]), d[1], 0))


def wgmma_view(t: cute.Tensor) -> cute.Tensor:
    """A warp-MMA accumulator (or a coordinate tensor partitioned like one) as a wgmma fragment."""
    return cute.make_tensor(t.iterator, wgmma_view_layout(t.layout))
