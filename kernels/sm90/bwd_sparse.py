"""Block sparsity for the sm90 backward: when the block mask can drive the walk, and its lists
turned around for a key-stationary kernel.

The call carries FlexAttention's lists per *query* block (docs/INTERNALS.md); the backward kernel
owns one key tile and walks query tiles, so it needs per key block which query blocks are partial
(`q_num_blocks` / `q_indices`) and full (`full_q_num_blocks` / `full_q_indices`), derived here
with a few torch ops over the (B, H, n_q_blocks, n_kv_blocks) tile map. Where the block mask
cannot drive the walk, the kernel walks densely and evaluates the mask_mod everywhere: slower,
never wrong.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

from torch_fa4.kernels.host.block_mask_layout import block_mask_tensors_reason
from torch_fa4.kernels.sm90.bwd_config import TILE_M

if TYPE_CHECKING:
    from torch_fa4.call import AttentionCall


def sparse_walk_reason(call: "AttentionCall", deterministic: bool, tile_n: int,
                       tile_m: int = TILE_M) -> Optional[str]:
    """None when the block mask can drive the backward's walk (kernel key tile `tile_n`, query
    step `tile_m`, see bwd_variant), else why the dense walk is used."""
    bm = call.block_mask
    if not bm:
        return "no block mask"
    if call.mods is None or call.mods.mask_graph is None:
        return "block mask without a mask_mod"
    if deterministic:  # (its dQ turns count every earlier key tile of a query tile)
        return "deterministic mode walks densely"
    if call.is_varlen or call.cu_seqlens_k is not None:
        return "varlen runs per sequence without the block mask"
    reason = block_mask_tensors_reason(call)
    if reason is not None:
        return reason
    num, idx, full_num, full_idx = bm
    if idx.shape[:3] != num.shape or full_idx.shape[3] != idx.shape[3]:
        # the transposed lists are built from one (B, H, nq, nkv) tile map
        return "block mask index tensors disagree in shape"
    if call.block_mask_q % tile_m:
        return f"block mask q tile {call.block_mask_q} is not a multiple of {tile_m}"
    if call.block_mask_kv % tile_n:
        return f"block mask kv tile {call.block_mask_kv} is not a multiple of {tile_n}"
    sq, sk = call.q.shape[1], call.k.shape[1]
    if num.shape[2] * call.block_mask_q < sq or idx.shape[3] * call.block_mask_kv < sk:
        return "block mask covers fewer positions than the call has"
    return None


def ratios(call: "AttentionCall", tile_n: int, tile_m: int = TILE_M) -> tuple[int, int]:
    """(kernel query steps per block-mask row, kernel key tiles per block-mask column)."""
    return call.block_mask_q // tile_m, call.block_mask_kv // tile_n


def tile_classes(kv_num, kv_idx, full_num, full_idx) -> torch.Tensor:
    """(B, H, nq, nkv) int8 from FlexAttention's lists: 0 empty, 1 partial, 2 full."""
    nkv = kv_idx.shape[-1]
    out = torch.zeros(*kv_idx.shape[:3], nkv + 1, dtype=torch.int8, device=kv_idx.device)
    cols = torch.arange(nkv, device=kv_idx.device)
    for num, idx, cls in ((kv_num, kv_idx, 1), (full_num, full_idx, 2)):
        valid = cols < num[..., None].long()
        # entries past the count are padding: send them to a spare column that is dropped
        target = torch.where(valid, idx.long().clamp(0, nkv - 1), torch.full_like(idx, nkv, dtype=torch.long))
        out.scatter_(-1, target, torch.where(valid, cls, 0).to(torch.int8))
    return out[..., :nkv]


def _lists(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., n) bool -> (count (...), indices (..., n): the set ones ascending, then zeros), int32."""
    n = flags.shape[-1]
    cols = torch.arange(n, device=flags.device)
    count = flags.sum(-1, dtype=torch.int32)
    order = torch.where(flags, cols, cols + n).argsort(dim=-1, stable=True)
    return count, torch.where(cols < count[..., None], order, 0).to(torch.int32).contiguous()


def transposed_lists(call: "AttentionCall") -> list[torch.Tensor]:
    """[q_num_blocks, q_indices, full_q_num_blocks, full_q_indices] for the call's lengths:
    (B', H', n_kv_blocks) and (B', H', n_kv_blocks, n_q_blocks), B', H' as the block mask's.
    Blocks past the call's sequence lengths are dropped, so the kernel never visits a query block
    wholly outside the sequence nor indexes past the key-block lists."""
    classes = tile_classes(*call.block_mask)
    nq = math.ceil(call.q.shape[1] / call.block_mask_q)
    nkv = math.ceil(call.k.shape[1] / call.block_mask_kv)
    t = classes[:, :, :nq, :nkv].transpose(-1, -2)  # (B', H', nkv, nq)
    q_num, q_idx = _lists(t == 1)
    full_num, full_idx = _lists(t == 2)
    return [q_num.contiguous(), q_idx, full_num.contiguous(), full_idx]


def padded_rows(call: "AttentionCall") -> int:
    """Query rows the row statistics and the dQ buffer must hold under the sparse walk: the last
    block-mask row may reach past the sequence; those steps read padding (+inf LSE: P = 0)."""
    return math.ceil(call.q.shape[1] / call.block_mask_q) * call.block_mask_q
