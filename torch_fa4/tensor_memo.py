"""Values derived from tensors' contents, kept while the same tensors live unmodified.

Reading a CUDA tensor's values on the host is a device sync, and deriving tensors from them costs
launches, while a model hands the same `cu_seqlens` to every layer. An entry is found by the
tensors' ids and holds weak references to them, so a tensor that died (its id and memory reused
by a new one) never matches; it also records their `_version` (bumped by every in-place write)
and data pointer, so a modified one does not either. Writes that bypass PyTorch (a raw pointer
handed to another library) are not seen. Inference tensors (made under `torch.inference_mode`)
have no version counter, so a write to one could not be seen: they are never memoised.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import torch


def _stamp(tensors: Sequence[Optional[torch.Tensor]]) -> tuple:
    return tuple(None if t is None else (t._version, t.data_ptr()) for t in tensors)


def _untracked(tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    return any(t is not None and t.is_inference() for t in tensors)


class TensorMemo:
    """get / put values keyed by a tuple of tensors (None allowed) and hashable extras."""

    def __init__(self, capacity: int):
        self._capacity = capacity
        self._entries: dict = {}

    def get(self, tensors: Sequence[Optional[torch.Tensor]], extra: tuple = ()) -> Any:
        """The value put for these very tensors, unmodified since, with these extras; else None."""
        if _untracked(tensors):
            return None
        entry = self._entries.get((*map(id, tensors), *extra))
        if entry is None:
            return None
        refs, stamp, value = entry
        same = all(t is None if r is None else r() is t for r, t in zip(refs, tensors))
        return value if same and stamp == _stamp(tensors) else None

    def put(self, tensors: Sequence[Optional[torch.Tensor]], extra: tuple, value: Any) -> None:
        if _untracked(tensors):
            return
        if len(self._entries) >= self._capacity:  # a bound, not an eviction policy
            self._entries.clear()
        refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        self._entries[(*map(id, tensors), *extra)] = (refs, _stamp(tensors), value)
