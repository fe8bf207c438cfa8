"""Which (key tile, query tile) steps of the portable backward a block mask lets it skip.

A block mask (FlexAttention layout, kernels/host/block_mask_layout.py) lists per query block the
key blocks with any visible element. The kernel's tiles need not match its blocks, so the lists
become one map at the kernel's own granularity: visit[b, h, n, m] = 1 when the block-mask area
under key tile n x query tile m holds a non-empty block (a 2-d prefix sum over the non-empty
block map, read at each tile's block range). The mask_mod still decides every element of a
visited step, so a map that visits too much costs time, never correctness.

Not used (dense walk instead, same result) for deterministic calls (their dQ turns count every
earlier key tile), varlen calls, and block masks that do not cover the call's positions.
Plain torch: no CuTe DSL import.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

from torch_fa4.kernels.host.block_mask_layout import block_mask_tensors_reason

if TYPE_CHECKING:
    from torch_fa4.call import AttentionCall


def walk_reason(call: "AttentionCall", deterministic: bool) -> Optional[str]:
    """None when the block mask can prune the walk, else why the dense walk runs."""
    if not call.block_mask:
        return "no block mask"
    if call.mods is None or call.mods.mask_graph is None:
        return "block mask without a mask_mod"
    if deterministic:
        return "deterministic mode walks densely"
    if call.is_varlen:
        return "varlen walks densely"
    reason = block_mask_tensors_reason(call)
    if reason is not None:
        return reason
    num, idx, _, full_idx = call.block_mask
    if full_idx.shape[3] != idx.shape[3]:
        return "block mask index tensors disagree in shape"
    if (num.shape[2] * call.block_mask_q < call.q.shape[1]
            or idx.shape[3] * call.block_mask_kv < call.k.shape[1]):
        return "block mask covers fewer positions than the call has"
    return None


def nonempty_blocks(block_mask) -> torch.Tensor:
    """(B', H', nq, nkv) bool: blocks listed as partial or full."""
    num, idx, full_num, full_idx = block_mask
    nkv = idx.shape[3]
    out = torch.zeros(*idx.shape[:3], nkv + 1, dtype=torch.bool, device=idx.device)
    cols = torch.arange(nkv, device=idx.device)
    for n, i in ((num, idx), (full_num, full_idx)):
        valid = cols < n[..., None].long()
        target = torch.where(valid, i.long(), torch.full_like(i, nkv, dtype=torch.long))  # padding: spare
        out.scatter_(-1, target, valid | out.gather(-1, target))
    return out[..., :nkv]


def tile_visits(call: "AttentionCall", tile_m: int, tile_n: int) -> torch.Tensor:
    """(B, Hq, key tiles, query tiles) uint8 visit map (batch / head dims broadcast by stride 0)."""
    blocks = nonempty_blocks(call.block_mask).to(torch.int32)  # (B', H', nq, nkv)
    bq, bk = call.block_mask_q, call.block_mask_kv
    nq, nkv = blocks.shape[2:]
    prefix = torch.zeros(*blocks.shape[:2], nq + 1, nkv + 1, dtype=torch.int32, device=blocks.device)
    prefix[..., 1:, 1:] = blocks.cumsum(2).cumsum(3)
    sq, sk = call.q.shape[1], call.k.shape[1]
    m_tiles, n_tiles = max(1, math.ceil(sq / tile_m)), max(1, math.ceil(sk / tile_n))

    def ranges(tiles, tile, block, count):  # [first block, last block + 1) under each tile, clamped
        start = torch.arange(tiles, device=blocks.device) * tile
        lo = (start // block).clamp(max=count)
        hi = ((start + tile - 1) // block + 1).clamp(max=count)
        return lo, hi

    q_lo, q_hi = ranges(m_tiles, tile_m, bq, nq)
    k_lo, k_hi = ranges(n_tiles, tile_n, bk, nkv)
    area = (prefix[..., q_hi[:, None], k_hi[None, :]] - prefix[..., q_lo[:, None], k_hi[None, :]]
            - prefix[..., q_hi[:, None], k_lo[None, :]] + prefix[..., q_lo[:, None], k_lo[None, :]])
    visits = (area > 0).transpose(-1, -2).to(torch.uint8).contiguous()  # (B', H', n_tiles, m_tiles)
    return visits.expand(call.batch, call.num_heads, n_tiles, m_tiles)
