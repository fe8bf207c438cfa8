"""Whether a call's block mask tensors have FlexAttention's layout, for every kernel's host side.

`call.block_mask` is (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices): int32 on
q's device, (B, H, nq) counts and (B, H, nq, nkv) indices, B and H either the call's or 1 (one
mask for every batch / head). Plain torch: no CuTe DSL import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from torch_fa4.call import AttentionCall


def block_mask_tensors_reason(call: "AttentionCall") -> Optional[str]:
    """Why the block mask tensors are not in FlexAttention's layout (None: they are)."""
    bm = call.block_mask
    if len(bm) != 4:
        return f"block_mask has {len(bm)} tensors (want kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)"
    num, idx, full_num, full_idx = bm
    for t in bm:
        if t.dtype != torch.int32 or t.device != call.q.device:
            return "block_mask tensors must be int32 on q's device"
    if num.dim() != 3 or idx.dim() != 4 or full_num.shape != num.shape or full_idx.shape[:3] != num.shape:
        return "block_mask tensors are not (B, H, nq) / (B, H, nq, nkv)"
    if num.shape[0] not in (1, call.batch) or num.shape[1] not in (1, call.num_heads):
        return f"block_mask batch/heads {tuple(num.shape[:2])} do not broadcast to ({call.batch}, {call.num_heads})"
    return None
