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


class TensorMemo:
    """get / put values keyed by a tuple of tensors (None allowed) and hashable extras."""

    def __init__(self, capacity: int):
        self._capacity = capacity
        self._entries: dict = {}

    def get(self, tensors: Sequence[Optional[torch.Tensor]], extra: tuple = ()) -> Any:
        """The value put for these very tensors, unmodified since, with these extras; else None."""
        entry = self._entries.get((*map(id, tensors), *extra))
        if entry is None:
            return None
        states, value = entry
        for t, state in zip(tensors, states):  # a None matched a None by id; the others are checked
            if t is not None and (state[0]() is not t or state[1] != t._version or state[2] != t.data_ptr()):
                return None
        return value

    def put(self, tensors: Sequence[Optional[torch.Tensor]], extra: tuple, value: Any) -> None:
        if any(t is not None and t.is_inference() for t in tensors):
            return
        if len(self._entries) >= self._capacity:  # a bound, not an eviction policy
            self._entries.clear()
        states = tuple(None if t is None else (weakref.ref(t), t._version, t.data_ptr()) for t in tensors)
        self._entries[(*map(id, tensors), *extra)] = (states, value)
