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
import sys
import types
from typing import Any, Optional

import torch

_MAX_DEPTH = 6
_SHARED_GLOBAL_TYPES = (types.ModuleType, type, types.BuiltinFunctionType, torch.dtype)


def collect(fn: Any) -> tuple[tuple, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    return _walk(fn, tensors, (), 0), tensors


def _walk(obj: Any, tensors: list, names: tuple, depth: int) -> tuple:
    if depth > _MAX_DEPTH:
        return ("deep",)
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("tensor", obj.dtype, obj.dim())
    if obj is None or isinstance(obj, (bool, str)):
        return ("const", type(obj).__name__, obj)
    if isinstance(obj, (int, float)):
        return ("const", type(obj).__name__, _static(obj))
    if isinstance(obj, (tuple, list)):
        return ("seq", type(obj).__name__) + tuple(_walk(x, tensors, names, depth + 1) for x in obj)
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return ("dict",) + tuple((k, _walk(obj[k], tensors, names, depth + 1)) for k in sorted(obj))
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
    if isinstance(obj, _SHARED_GLOBAL_TYPES):
        return ("opaque", obj)  # modules (torch), classes, dtypes, builtins: fixed objects
    if isinstance(obj, torch.nn.Module):
        # A module a mod captures (`self` in `self.slopes[h]`) is where its data lives; calling a
        # module inside a mod is not a supported op, so its __call__ machinery is not walked.
        return ("object", _walk_attrs(obj, names, tensors, depth + 1))
    call = getattr(type(obj), "__call__", None)
    if isinstance(call, types.FunctionType):
        # a callable object: its __call__, plus the attributes that code and the enclosing code read
        attr_names = tuple(dict.fromkeys(names + call.__code__.co_names))
        return ("callable", _walk_function(call, tensors, depth + 1),
                _walk_attrs(obj, attr_names, tensors, depth + 1))
    # Any other object: the attributes the enclosing code names (e.g. `self.slopes`, `cfg.window`).
    return ("object", _walk_attrs(obj, names, tensors, depth + 1))


def _static(x):
    """x itself; under Dynamo, forced to a guarded constant. A number whose value changed between
    calls would otherwise come back as a SymInt/SymFloat, which cannot be part of the key. Using it
    as a dict key is what makes Dynamo specialise it (dict keys must be hashable constants)."""
    return next(iter({x: None}))


def _walk_function(fn: types.FunctionType, tensors: list, depth: int) -> tuple:
    code = fn.__code__
    names = code.co_names
    nested = _nested_function_under_dynamo(fn) if torch.compiler.is_compiling() else None
    if nested is not None:
        values, module = nested
        fn_globals = sys.modules[module].__dict__
    else:
        module, fn_globals = fn.__module__, fn.__globals__
        values = [c.cell_contents for c in fn.__closure__] if code.co_freevars else []
    cells = tuple(_walk(v, tensors, names, depth + 1) for v in values)
    defaults = fn.__defaults__
    defaults_desc = None if defaults is None else tuple(_walk(d, tensors, names, depth + 1) for d in defaults)
    global_parts = []
    for name in names:
        # modules (torch, math), classes and builtins are fixed objects the rebuilt function can
        # share; anything else may hold tensors or constants the trace depends on
        if name in fn_globals and not isinstance(fn_globals[name], _SHARED_GLOBAL_TYPES):
            global_parts.append((name, _walk(fn_globals[name], tensors, names, depth + 1)))
    return ("function", code, module, fn.__name__, cells, defaults_desc, tuple(global_parts))


def _grab_nested_function(ctx) -> None:
    """Runs at Dynamo trace time (torch._dynamo.comptime). If the local `fn` is a function created
    inside the compiled region, put (its cell contents, its module's name) into the local `box`, so
    the traced code continues with the captured tensors as ordinary graph values. Such a function's
    `__closure__`, `__globals__` and `__module__` are values Dynamo models itself, and depending on
    the torch version reading them raises AttributeError or an Unsupported graph break. Uses Dynamo
    internals that carry no compatibility promise, hence every failure just leaves `box` as None
    (a function made outside the compiled region has no Dynamo-side closure: also None)."""
    try:
        from torch._dynamo.variables import ConstantVariable, TupleVariable

        tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
        fn_vt = ctx.get_local("fn")._i_will_not_complain_if_bc_breaks_VariableTracker()
        f_globals = fn_vt.f_globals  # only functions created under Dynamo carry these two
        closure = fn_vt.closure
        items = [tx.output.side_effects.load_cell(c) for c in closure.items] if closure is not None else []
        module = ConstantVariable.create(f_globals["__name__"])
        tx.symbolic_locals["box"] = TupleVariable([TupleVariable(items), module])
    except Exception:  # noqa: BLE001 - not a nested function, or Dynamo changed: ordinary reads
        pass


def _nested_function_under_dynamo(fn: types.FunctionType):
    from torch._dynamo.comptime import comptime

    box = None
    comptime(_grab_nested_function)
    return box


def _walk_attrs(obj: Any, names: tuple, tensors: list, depth: int) -> tuple:
    return tuple((name, _walk(getattr(obj, name), tensors, names, depth + 1))
                 for name in names if _has_instance_attr(obj, name))


def _has_instance_attr(obj: Any, name: str) -> bool:
    if isinstance(obj, torch.nn.Module):
        # parameters and buffers live outside __dict__
        return name in obj._parameters or name in obj._buffers or name in obj.__dict__
    d = getattr(obj, "__dict__", None)
    return d is not None and name in d


# ---- the inverse: a callable equivalent to the original, with placeholder tensors -------------------

def rebuild(desc: tuple) -> tuple[Any, list[torch.Tensor], list[Optional[str]]]:
    """Build a callable from `desc` whose captured tensors are fresh placeholders (in walk order),
    and a readable name per placeholder for messages (the closure variable, global, partial
    argument or attribute path that holds it; None where there is none).

    Tracing the rebuilt callable depends on nothing but `desc`, which is what makes `desc` a sound
    cache key for the traced graph (and lets tracing happen at torch.compile time from constants).
    """
    placeholders: list[torch.Tensor] = []
    names: list[Optional[str]] = []
    return _rebuild(desc, placeholders, names, None), placeholders, names


def _rebuild(desc: tuple, ph: list, names: list, name: Optional[str]) -> Any:
    """The value `desc` describes; `name` is what holds it, for the names of the tensors in it."""
    tag = desc[0]
    if tag == "tensor":
        _, dtype, ndim = desc
        ph.append(torch.empty((1,) * ndim, dtype=dtype, device="meta"))
        names.append(name)
        return ph[-1]
    if tag == "const":
        return desc[2]
    if tag == "seq":
        items = [_rebuild(d, ph, names, name and f"{name}[{i}]") for i, d in enumerate(desc[2:])]
        return tuple(items) if desc[1] == "tuple" else items
    if tag == "dict":
        return {k: _rebuild(d, ph, names, name and f"{name}[{k!r}]") for k, d in desc[1:]}
    if tag == "partial":
        _, func, args, kw = desc
        f = _rebuild(func, ph, names, None)
        code = func[1] if func[0] == "function" else None
        params = code.co_varnames[:code.co_argcount] if code is not None else ()
        args = [_rebuild(d, ph, names, _at(params, i)) for i, d in enumerate(args)]
        return functools.partial(f, *args, **{k: _rebuild(d, ph, names, k) for k, d in kw})
    if tag in ("method", "callable"):  # a bound method, or a callable object's __call__ bound to it
        f = _rebuild(desc[1], ph, names, None)
        return types.MethodType(f, types.SimpleNamespace(**_attrs(desc[2], ph, names, "self")))
    if tag == "function":
        return _rebuild_function(desc, ph, names)
    if tag == "opaque":
        return desc[1]
    if tag == "object":
        return types.SimpleNamespace(**_attrs(desc[1], ph, names, name))
    raise ValueError(f"a mod captures values nested more than {_MAX_DEPTH} levels deep")


def _at(seq: tuple, i: int) -> Optional[str]:
    return seq[i] if 0 <= i < len(seq) else None


def _attrs(attrs: tuple, ph: list, names: list, owner: Optional[str]) -> dict:
    return {a: _rebuild(d, ph, names, f"{owner}.{a}" if owner else a) for a, d in attrs}


def _rebuild_function(desc: tuple, ph: list, names: list) -> types.FunctionType:
    _, code, module, name, cells, defaults, global_parts = desc
    cell_values = [_rebuild(d, ph, names, _at(code.co_freevars, i)) for i, d in enumerate(cells)]
    default_values = None
    if defaults is not None:
        first = code.co_argcount - len(defaults)  # the parameter the first default belongs to
        params = code.co_varnames[:code.co_argcount]
        default_values = tuple(_rebuild(d, ph, names, _at(params, first + i)) for i, d in enumerate(defaults))
    mod = sys.modules.get(module) if module is not None else None
    fn_globals = dict(mod.__dict__) if mod is not None else {"__builtins__": __builtins__}
    for gname, d in global_parts:
        fn_globals[gname] = _rebuild(d, ph, names, gname)
    closure = tuple(types.CellType(v) for v in cell_values) if cell_values else None
    return types.FunctionType(code, fn_globals, name, default_values, closure)
