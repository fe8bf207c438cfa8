"""Readable names for a mod and its captured tensors, for error messages.

The ops carry only a mod key, so what a user would recognise -- the function's name, the variable
holding a captured tensor -- is recorded here when prepare.py traces a mod, from the description
capture.py built (closure variable, global, partial keyword or attribute names). Names never enter
the mod key: structurally equal mods share a key whatever they are called, and all names seen for a
key are kept. A key resolved from the on-disk registry in a process that never traced it has no
names; messages then say just "score_mod" or "captured tensor #0".
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

_LOCK = threading.Lock()
_MOD_NAMES: dict[tuple[str, str], list[str]] = {}  # (key, role) -> function names seen
_TENSOR_NAMES: dict[tuple[str, str], list[list[str]]] = {}  # (key, role) -> per slot, names seen


def record(key: str, role: str, desc: Any, tensors: Sequence[Optional[str]]) -> None:
    """Remember the function name in `desc` (capture.collect's description of a mod) and the names
    of its captured tensors (capture.rebuild's, one per aux slot) under (key, role)."""
    mod = _mod_name(desc)
    with _LOCK:
        if mod is not None:
            seen = _MOD_NAMES.setdefault((key, role), [])
            if mod not in seen:
                seen.append(mod)
        slots = _TENSOR_NAMES.setdefault((key, role), [[] for _ in tensors])  # the key fixes the count
        for seen, name in zip(slots, tensors):
            if name is not None and name not in seen:
                seen.append(name)


def mod_name(key: str, role: str) -> str:
    """e.g. "score_mod 'rel_bias'" (or just "score_mod")."""
    names = _MOD_NAMES.get((key, role))
    if not names:
        return f"{role}_mod"
    if len(names) == 1:
        return f"{role}_mod {names[0]!r}"
    return f"{role}_mod (one of {', '.join(map(repr, names))}, which trace to the same graph)"


def tensor_name(key: str, role: str, slot: int) -> Optional[str]:
    """e.g. "'tab'", "(one of 'tab', 'cfg.tab')", or None when unknown."""
    slots = _TENSOR_NAMES.get((key, role))
    if not slots or slot >= len(slots) or not slots[slot]:
        return None
    names = slots[slot]
    return repr(names[0]) if len(names) == 1 else f"(one of {', '.join(map(repr, names))})"


def _mod_name(desc: Any) -> Optional[str]:
    tag = desc[0]
    if tag == "function":
        # "make.<locals>.rel_bias" -> "rel_bias"; "RelBias.__call__" stays (the class says which)
        return (getattr(desc[1], "co_qualname", None) or desc[3]).rsplit("<locals>.", 1)[-1]
    if tag in ("partial", "method", "callable"):
        return _mod_name(desc[1])
    return None
