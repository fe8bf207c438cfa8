"""What every backward kernel family checks first of a call: its q / k / v dtypes, head dims and
resolved mods (each family then adds what its own kernel cannot take)."""

from __future__ import annotations

from typing import Optional

import torch


def operand_reason(call, family: str, head_dims: tuple) -> Optional[str]:
    """Why a `family` backward kernel cannot take these operands (None: it can)."""
    q, k, v = call.q, call.k, call.v
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{family} backward takes fp16/bf16, not {q.dtype}"
    if not (q.dtype == k.dtype == v.dtype):
        return "q, k, v dtypes differ"
    if call.head_dim not in head_dims or call.head_dim_v not in head_dims:
        return f"{family} backward takes head dims {head_dims}, not D={call.head_dim}, Dv={call.head_dim_v}"
    if call.mod_key and call.mods is None:
        return "score_mod/mask_mod key given but not resolved to a ModSet"
    if call.num_heads % call.num_heads_kv != 0:
        return "query heads are not a multiple of KV heads"
    return None
