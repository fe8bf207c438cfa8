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
import types
from typing import Any, Optional

_LOCK = threading.Lock()
_MOD_NAMES: dict[tuple[str, str], list[str]] = {}  # (key, role) -> function names seen
_TENSOR_NAMES: dict[tuple[str, str], list[list[str]]] = {}  # (key, role) -> per slot, names seen


def record(key: str, role: str, desc: Any, num_tensors: int) -> None:
    """Remember the names in `desc` (capture.collect's description of a mod, which captured
    `num_tensors` tensors) under (key, role)."""
    try:
        mod = _mod_name(desc)
        tensors: list[Optional[str]] = []
        _tensor_names(desc, None, tensors, 0)
    except Exception:  # noqa: BLE001 - names are a courtesy; an unexpected description gives none
        return
    if len(tensors) != num_tensors:  # a description this walk misread: no names rather than wrong ones
        tensors = [None] * num_tensors
    with _LOCK:
        if mod is not None:
            seen = _MOD_NAMES.setdefault((key, role), [])
            if mod not in seen:
                seen.append(mod)
        slots = _TENSOR_NAMES.setdefault((key, role), [[] for _ in tensors])
        if len(slots) == len(tensors):
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


def _tensor_names(desc: Any, name: Optional[str], out: list, depth: int) -> None:
    """Append a name (or None) per captured tensor, in capture.collect's order (the aux slots)."""
    if depth > 16:
        raise ValueError("description nested too deeply")
    tag = desc[0]
    if tag == "tensor":
        out.append(name)
    elif tag == "seq":
        for i, d in enumerate(desc[2:]):
            _tensor_names(d, None if name is None else f"{name}[{i}]", out, depth + 1)
    elif tag == "dict":
        for k, d in desc[1:]:
            _tensor_names(d, None if name is None else f"{name}[{k!r}]", out, depth + 1)
    elif tag == "partial":
        _, func, args, kw = desc
        _tensor_names(func, None, out, depth + 1)
        params = _params(func)
        for i, d in enumerate(args):
            _tensor_names(d, params[i] if i < len(params) else None, out, depth + 1)
        for k, d in kw:
            _tensor_names(d, k, out, depth + 1)
    elif tag in ("method", "callable"):
        _tensor_names(desc[1], None, out, depth + 1)
        for attr, d in desc[2]:
            _tensor_names(d, f"self.{attr}", out, depth + 1)
    elif tag == "object":
        for attr, d in desc[1]:
            _tensor_names(d, f"{name}.{attr}" if name else attr, out, depth + 1)
    elif tag == "function":
        _, code, _module, _name, cells, defaults, global_parts = desc
        for var, d in zip(code.co_freevars, cells):
            _tensor_names(d, var, out, depth + 1)
        if defaults is not None:
            params = code.co_varnames[code.co_argcount - len(defaults):code.co_argcount]
            for var, d in zip(params, defaults):
                _tensor_names(d, var, out, depth + 1)
        for var, d in global_parts:
            _tensor_names(d, var, out, depth + 1)
    elif tag in ("const", "opaque", "deep"):
        pass
    else:
        raise ValueError(f"unknown description {tag!r}")


def _params(func_desc: Any) -> tuple:
    """Positional parameter names of a described function (for functools.partial arguments)."""
    if func_desc[0] == "function" and isinstance(func_desc[1], types.CodeType):
        code = func_desc[1]
        return code.co_varnames[:code.co_argcount]
    return ()
