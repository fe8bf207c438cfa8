"""prepare(score_mod, mask_mod) -> (mod_key, aux_tensors): what the public API calls on every call.

How this stays cheap in eager mode and graph-break free under torch.compile(fullgraph=True):

1. `capture.collect(mod)` returns a `desc` (a tuple of Python constants: code objects, numbers,
   dtypes, ranks) and the captured tensors, by plain attribute access that Dynamo traces: tensors
   become graph inputs, constants get guards (capture.py).
2. `_key_for_descs(score_desc, mask_desc)` is marked `torch.compiler.assume_constant_result`:
   Dynamo runs it once at trace time on the constant descs and bakes the returned key string into
   the graph. It rebuilds a callable from the desc alone (placeholder tensors), traces it into a
   ModGraph, registers the ModSet and memoises desc -> key, so eager calls trace a mod once too.

Closures created *inside* the compiled function: Dynamo does not expose their cells as
attributes, so capture.py asks Dynamo for them at trace time (Dynamo internals without a
compatibility promise; tested in tests/test_mods_attention.py). Should that stop working, closures
over constants still work, and a mod capturing tensors can be a
`functools.partial(module_level_mod, tensor=...)` (as the built-ins are) or be created outside.
"""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Any, Callable, Optional

import torch

from torch_fa4.mods import capture, naming
from torch_fa4.mods.graph import ModGraph
from torch_fa4.mods.trace import ModTraceError, trace_mod

_LOCK = threading.Lock()


def _assume_constant_result(fn):
    """`torch.compiler.assume_constant_result`, without importing torch._dynamo (seconds, on the
    path of every kernel compile) when nothing has: while Dynamo is not loaded nothing can be
    tracing, and setting the attribute the decorator sets is equivalent (tests check it)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


_KEYS: dict[tuple, str] = {}


def prepare(score_mod: Optional[Callable], mask_mod: Optional[Callable]) -> tuple[str, list[torch.Tensor]]:
    if score_mod is None and mask_mod is None:
        return "", []
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a callable, got {type(fn).__name__}")
    score_desc, score_tensors = capture.collect(score_mod) if score_mod is not None else (None, [])
    mask_desc, mask_tensors = capture.collect(mask_mod) if mask_mod is not None else (None, [])
    key = _key_for_descs(score_desc, mask_desc)
    return key, score_tensors + mask_tensors


@_assume_constant_result
def _key_for_descs(score_desc: Any, mask_desc: Any) -> str:
    try:
        cache_key = (score_desc, mask_desc)
        hash(cache_key)
    except TypeError:  # an unhashable constant somewhere: correct, just not memoised
        return _trace_and_register(score_desc, mask_desc)
    key = _KEYS.get(cache_key)
    if key is None:
        key = _trace_and_register(score_desc, mask_desc)
        with _LOCK:
            _KEYS[cache_key] = key
    return key


def _check_arity(fn: Callable, role: str) -> None:
    params = ("score, b, h, q_idx, kv_idx" if role == "score" else "b, h, q_idx, kv_idx").split(", ")
    try:
        inspect.signature(fn).bind(*params)
    except TypeError as e:
        raise ModTraceError(f"{role}_mod must take {len(params)} arguments ({', '.join(params)}): {e}") from None
    except ValueError:  # no signature to read (a builtin): tracing will tell
        pass


def _trace_and_register(score_desc: Any, mask_desc: Any) -> str:
    from torch_fa4.mods.registry import register

    graphs: dict[str, Optional[ModGraph]] = {"score": None, "mask": None}
    traced = []  # (role, desc, names of its captured tensors)
    for desc, role in ((score_desc, "score"), (mask_desc, "mask")):
        if desc is None:
            continue
        fn, placeholders, names = capture.rebuild(desc)
        traced.append((role, desc, names))
        _check_arity(fn, role)
        try:
            graphs[role] = trace_mod(fn, role, placeholders)
        except (AttributeError, KeyError, NameError) as e:
            raise ModTraceError(
                f"tracing the {role}_mod failed with {type(e).__name__}: {e}. torch_fa4 traces a copy of the "
                "mod rebuilt from what it captures (closure cells, globals the code names, functools.partial "
                "arguments, dicts with str keys, plain attributes obj.name of captured objects); properties "
                "and methods of captured objects other than the mod itself are not captured"
            ) from e
    key = register(graphs["score"], graphs["mask"]).key
    for role, desc, names in traced:
        naming.record(key, role, desc, names)
    return key


def trace_graphs(score_mod: Optional[Callable], mask_mod: Optional[Callable]):
    """The ModSet for a pair of mods (for tests and tools; the API goes through prepare)."""
    from torch_fa4.mods.registry import lookup

    key, aux = prepare(score_mod, mask_mod)
    return lookup(key), aux
