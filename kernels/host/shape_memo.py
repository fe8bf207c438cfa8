"""Per-shape memos of the host path (launch records, the backward's launch plans): one entry per
key in a plain dict, cleared past CAPACITY entries (a bound for programs that meet ever-new
shapes, not an eviction policy). `clear_all` empties every `table()`: the tests call it between
tests so that a derivation they patched does not reach the next one. `mods_layout` is the part of
such a key that a call's mods and block mask contribute.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

NOT_RECORDED = object()  # a derivation's answer for "this shape takes the general path every time"
CAPACITY = 4096
_tables: list = []


def table() -> dict:
    """A new memo table, known to clear_all."""
    made: dict = {}
    _tables.append(made)
    return made


def lookup(memo: dict, key: Hashable, derive: Callable[[], Any]) -> Any:
    """memo[key], derived (and kept) on the first call with this key."""
    value = memo.get(key)
    if value is None:
        value = derive()
        if len(memo) >= CAPACITY:
            memo.clear()
        memo[key] = value
    return value


def mods_layout(call) -> Any:
    """What the families' `unsupported_reason` (forward and backward) read of an AttentionCall's
    mods, captured tensors and block mask, beside the q / k / v layout and scalars: the mod key
    (which fixes the traced graphs), each captured tensor's dtype, device, shape, strides and
    requires_grad, each block-mask tensor's dtype, device, shape and strides, the block sizes;
    never values. None where a check would read values: packed varlen calls without
    max_seqlen_q (the longest sequence then comes from the offsets)."""
    if call.cu_seqlens_q is not None and not call.max_seqlen_q:
        return None
    aux = tuple([(t.dtype, t.device, t.shape, t.stride(), t.requires_grad) for t in call.aux_tensors])
    bm = tuple([(t.dtype, t.device, t.shape, t.stride()) for t in call.block_mask])
    return call.mod_key, call.mods is None, aux, bm, call.block_mask_q, call.block_mask_kv


def clear_all() -> None:
    for memo in _tables:
        memo.clear()
