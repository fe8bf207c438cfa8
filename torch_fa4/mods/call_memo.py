"""The mods' share of an eager call's host path, kept per what decides it.

Before the op, `torch_fa4.attention` turns a call's mods and block mask into op arguments: the
block mask's lists as the kernels take them (a torch BlockMask converted, block_mask.py), the
traced key and the captured tensors (`prepare`), the captured tensors' device check, and the
folding into built-in arguments (idioms.py), whose `causal & rest` case re-lists the block mask
(block_lists.py). Everything after `prepare` is decided by

- the mod key (`prepare` itself runs on every call: a closure's cells, the globals and the
  attributes a mod reads may change between calls while the mod object stays the same, and only
  its walk sees them),
- the captured tensors and the block mask's tensors: their identities, and their versions
  (bumped by every in-place write, views included) and data pointers, since the re-listing reads
  their values,
- the block sizes, q's length and device, the keys per sequence, whether the call is varlen or has
  seqused_k, the window, softcap and causal.

`ModsMemo` keeps the result per those. An entry holds weak references to its tensors and is
dropped when one of them dies, so a new tensor at a dead one's address never matches and the memo
keeps no tensor of the caller alive; it holds strongly only what it derived itself (re-listed
lists). Inference tensors have no version counter and tensors without storage no data pointer:
calls with such tensors are not kept. Writes that bypass PyTorch (through `.data` or a raw
pointer) are not seen, as in every memo of torch_fa4 (tensor_memo.py). Under torch.compile
nothing is kept: these steps are traced into the graph.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Optional, Sequence

import torch

from torch_fa4.kernels.host import shape_memo
from torch_fa4.mods.block_mask import BlockMask, _torch_lists
from torch_fa4.mods.prepare import prepare  # noqa: F401  (torch_fa4.api's, bound once)


def block_mask_lists(block_mask) -> Optional[tuple]:
    """(mask_mod, (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) as the kernels
    take them, (block q, block kv)) of a torch_fa4 or torch BlockMask; None for anything else
    (as_block_mask names the error)."""
    if isinstance(block_mask, BlockMask):
        bq, bkv = block_mask.BLOCK_SIZE
        return (block_mask.mask_mod, (block_mask.kv_num_blocks, block_mask.kv_indices,
                                      block_mask.full_kv_num_blocks, block_mask.full_kv_indices), (int(bq), int(bkv)))
    flex = sys.modules.get("torch.nn.attention.flex_attention")  # (not loaded: not one of its masks)
    if flex is not None and isinstance(block_mask, flex.BlockMask):
        bq, bkv = block_mask.BLOCK_SIZE
        return block_mask.mask_mod, _torch_lists(block_mask), (int(bq), int(bkv))
    return None


class ModsMemo:
    """get / put values keyed by a sequence of tensors (identity, version, data pointer) and
    hashable extras; an entry goes when one of its tensors dies. At most `capacity` entries (a
    bound for programs that meet ever-new tensors, not an eviction policy)."""

    def __init__(self, capacity: int):
        self._capacity = capacity
        self._entries = shape_memo.table()  # (emptied with the other host memos: shape_memo.clear_all)

    def get(self, tensors: Sequence[torch.Tensor], extra: tuple) -> Any:
        entry = self._entries.get((*map(id, tensors), *extra))
        if entry is None:
            return None
        refs, stamps, value = entry
        for t, ref, stamp in zip(tensors, refs, stamps):
            # (an entry's tensors are alive, so equal ids are the same tensors; checked anyway)
            if ref() is not t or stamp != (t._version, t.data_ptr()):
                return None
        return value

    def put(self, tensors: Sequence[torch.Tensor], extra: tuple, value: Any) -> None:
        try:
            stamps = tuple([(t._version, t.data_ptr()) for t in tensors])
        except RuntimeError:  # an inference tensor, or one without storage: not kept
            return
        key = (*map(id, tensors), *extra)
        entries = self._entries

        def drop(_ref, key=key):  # a tensor of the entry died: its id may be reused
            entries.pop(key, None)

        if len(entries) >= self._capacity:
            entries.clear()
        entries[key] = (tuple([weakref.ref(t, drop) for t in tensors]), stamps, value)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


MOD_ARGUMENTS = ModsMemo(capacity=256)  # torch_fa4.api's: the op arguments of a call's mods and block mask
