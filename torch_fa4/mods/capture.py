"""Find what a mod captures: its tensors (kernel arguments) and the constants its code depends on.

`collect(fn)` walks the places a Python callable can reach values from -- closure cells, globals the
code names, attributes of a captured object or of a bound method's `self` that the code names,
functools.partial arguments, nested functions in any of these -- and returns

- `desc`: a hashable tuple of Python constants (code objects, numbers, strings, dtype names, ranks)
  that determines which ModGraph tracing will produce, so equal descs can share one trace;
- `tensors`: the captured tensors in a fixed order (their positions are the aux slots).

It is written as plain attribute/item access on purpose: under torch.compile Dynamo traces it, so
each captured tensor becomes a graph input (new values or new closure objects: no recompile) and
each constant read here gets a guard (a closure over a different window size recompiles instead of
reusing a stale key).
"""

from __future__ import annotations

import functools
import operator
import sys
import types
from typing import Any

import torch

_MAX_DEPTH = 6
_CONSTANT_TYPES = (bool, int, float, str, type(None))


def collect(fn: Any) -> tuple[tuple, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    desc = _walk(fn, tensors, (), 0)
    return desc, tensors


def _walk(obj: Any, tensors: list, names: tuple, depth: int) -> tuple:
    if depth > _MAX_DEPTH:
        return ("deep",)
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("tensor", obj.dtype, obj.dim())
    if obj is None or isinstance(obj, (bool, str, float)):
        return ("const", type(obj).__name__, obj)
    if isinstance(obj, int):
        # operator.index makes Dynamo specialise the int (with a guard) instead of turning a changed
        # value into a SymInt, which could not be part of the key.
        return ("const", "int", operator.index(obj))
    if isinstance(obj, (tuple, list)):
        return ("seq", type(obj).__name__) + tuple(_walk(x, tensors, names, depth + 1) for x in obj)
    if isinstance(obj, functools.partial):
        # walk order (func, args, keywords) must match _rebuild's, so slots line up
        func = _walk(obj.func, tensors, names, depth + 1)
        args = tuple(_walk(a, tensors, names, depth + 1) for a in obj.args)
        kw = tuple((k, _walk(obj.keywords[k], tensors, names, depth + 1)) for k in sorted(obj.keywords))
        return ("partial", func, args, kw)
    if isinstance(obj, types.MethodType):
        code = obj.__func__.__code__
        return ("method", _walk(obj.__func__, tensors, names, depth + 1),
                _walk_attrs(obj.__self__, code.co_names, tensors, depth + 1))
    if isinstance(obj, types.FunctionType):
        return _walk_function(obj, tensors, depth)
    if isinstance(obj, (types.ModuleType, type, torch.dtype, types.BuiltinFunctionType)):
        return ("opaque", obj)  # modules (torch), classes, dtypes, builtins: fixed objects
    call = getattr(type(obj), "__call__", None)
    if isinstance(call, types.FunctionType):  # a callable object: its __call__ plus the attributes it reads
        return ("callable", _walk_function(call, tensors, depth + 1),
                _walk_attrs(obj, call.__code__.co_names, tensors, depth + 1))
    # Any other object: the attributes the enclosing code names (e.g. `self.slopes`, `cfg.window`).
    return ("object", _walk_attrs(obj, names, tensors, depth + 1))


def _walk_function(fn: types.FunctionType, tensors: list, depth: int) -> tuple:
    code = fn.__code__
    names = code.co_names
    if code.co_freevars:
        try:
            closure = fn.__closure__
        except AttributeError:
            # Dynamo cannot read the cells of a closure created inside the compiled function. If
            # every cell is a constant Dynamo can still hand the function itself to the planner;
            # captured tensors there need functools.partial or a mod defined outside (see prepare).
            return ("function_object", fn)
        cells = tuple(_walk(c.cell_contents, tensors, names, depth + 1) for c in closure)
    else:
        cells = ()
    defaults = fn.__defaults__
    defaults_desc = None
    if defaults is not None:
        defaults_desc = tuple(_walk(d, tensors, names, depth + 1) for d in defaults)
    fn_globals = fn.__globals__
    global_parts = []
    for name in names:
        if name in fn_globals:
            value = fn_globals[name]
            if isinstance(value, (torch.Tensor, types.FunctionType, functools.partial) + _CONSTANT_TYPES):
                global_parts.append((name, _walk(value, tensors, names, depth + 1)))
    return ("function", code, fn.__module__, fn.__name__, cells, defaults_desc, tuple(global_parts))


def _walk_attrs(obj: Any, names: tuple, tensors: list, depth: int) -> tuple:
    parts = []
    for name in names:
        if _has_instance_attr(obj, name):
            parts.append((name, _walk(getattr(obj, name), tensors, names, depth + 1)))
    return tuple(parts)


def _has_instance_attr(obj: Any, name: str) -> bool:
    if isinstance(obj, torch.nn.Module):
        # parameters and buffers live outside __dict__
        return name in obj._parameters or name in obj._buffers or name in obj.__dict__
    d = getattr(obj, "__dict__", None)
    return d is not None and name in d


# ---- the inverse: a callable equivalent to the original, with placeholder tensors -------------------

def rebuild(desc: tuple) -> tuple[Any, list[torch.Tensor]]:
    """Build a callable from `desc` whose captured tensors are fresh placeholders (in walk order).

    Tracing the rebuilt callable depends on nothing but `desc`, which is what makes `desc` a sound
    cache key for the traced graph (and lets tracing happen at torch.compile time from constants).
    """
    placeholders: list[torch.Tensor] = []
    return _rebuild(desc, placeholders), placeholders


def _rebuild(desc: tuple, ph: list) -> Any:
    tag = desc[0]
    if tag == "tensor":
        _, dtype, ndim = desc
        t = torch.empty((1,) * ndim, dtype=dtype, device="meta")
        ph.append(t)
        return t
    if tag == "const":
        return desc[2]
    if tag == "seq":
        items = [_rebuild(d, ph) for d in desc[2:]]
        return tuple(items) if desc[1] == "tuple" else items
    if tag == "partial":
        _, func, args, kw = desc
        f = _rebuild(func, ph)
        a = [_rebuild(d, ph) for d in args]
        k = {name: _rebuild(d, ph) for name, d in kw}
        return functools.partial(f, *a, **k)
    if tag == "method":
        _, func, attrs = desc
        f = _rebuild(func, ph)
        return types.MethodType(f, _namespace(attrs, ph))
    if tag == "function":
        return _rebuild_function(desc, ph)
    if tag == "function_object":
        return desc[1]
    if tag == "opaque":
        return desc[1]
    if tag == "callable":
        _, call, attrs = desc
        return types.MethodType(_rebuild(call, ph), _namespace(attrs, ph))
    if tag == "object":
        return _namespace(desc[1], ph)
    raise ValueError(f"a mod captures values nested more than {_MAX_DEPTH} levels deep")


def _namespace(attrs: tuple, ph: list) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{name: _rebuild(d, ph) for name, d in attrs})


def _rebuild_function(desc: tuple, ph: list) -> types.FunctionType:
    _, code, module, name, cells, defaults, global_parts = desc
    cell_values = [_rebuild(d, ph) for d in cells]
    default_values = None if defaults is None else tuple(_rebuild(d, ph) for d in defaults)
    mod = sys.modules.get(module) if module is not None else None
    fn_globals = dict(mod.__dict__) if mod is not None else {"__builtins__": __builtins__}
    for gname, d in global_parts:
        fn_globals[gname] = _rebuild(d, ph)
    closure = tuple(types.CellType(v) for v in cell_values) if cell_values else None
    return types.FunctionType(code, fn_globals, name, default_values, closure)
