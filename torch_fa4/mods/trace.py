"""Trace a FlexAttention-style mod (a plain Python callable) into a ModGraph.

The mod is called once with `TraceValue` stand-ins for score / b / h / q_idx / kv_idx. Python
operators on them and the torch functions they reach (through `__torch_function__`, which torch
consults for any argument that defines it, including indices of `tensor[...]`) append nodes to the
graph. Captured tensors are recognised by identity against the list that capture.py collected, so
each becomes a numbered aux slot (a kernel argument), never a constant.

Anything outside the supported op set raises ModTraceError naming the operation and listing what
is supported, at trace time, before any kernel is built.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from torch_fa4.mods.graph import (AUX_DTYPE_KINDS, BOOL, FLOAT, INPUT_KINDS, INT, MASK_INPUTS, SCORE_INPUTS, AuxSpec,
                                  ModGraph, Node)

SUPPORTED_OPS_DOC = (
    "arithmetic (+, -, *, /, unary -), comparisons (==, !=, <, <=, >, >=), "
    "logical &, |, ^, ~ on booleans (and torch.logical_and/or/not), torch.where, abs, "
    "torch.exp/log/tanh/sigmoid (or the tensor methods), torch.minimum/maximum/clamp, "
    "integer // and %, .float() / .to(float dtype), and indexing captured tensors by index values "
    "(t[h], t[b, q_idx], ...)"
)


class ModTraceError(TypeError):
    """A mod uses something the tracer cannot turn into a ModGraph."""


def _unsupported(what: str) -> ModTraceError:
    return ModTraceError(f"unsupported operation in a score_mod/mask_mod: {what}. Supported: {SUPPORTED_OPS_DOC}.")


class GraphBuilder:
    def __init__(self, captured: Sequence[torch.Tensor]):
        self.nodes: list[Node] = []
        self._memo: dict[tuple, int] = {}  # common-subexpression elimination keeps graphs canonical
        self.captured = list(captured)
        self.slot_of = {id(t): i for i, t in enumerate(self.captured)}

    def add(self, op: str, args: tuple[int, ...] = (), attr: Any = None, kind: str = FLOAT) -> "TraceValue":
        key = (op, args, (type(attr).__name__, repr(attr)), kind)
        idx = self._memo.get(key)
        if idx is None:
            idx = len(self.nodes)
            self.nodes.append(Node(op, args, attr, kind))
            self._memo[key] = idx
        return TraceValue(self, idx)

    def value(self, x: Any) -> "TraceValue":
        """Turn an operand (TraceValue, Python number, 0-d captured tensor) into a TraceValue."""
        if isinstance(x, TraceValue):
            return x
        for py_type, kind in ((bool, BOOL), (int, INT), (float, FLOAT)):  # bool first: it is an int too
            if isinstance(x, py_type):
                return self.add("const", attr=x, kind=kind)
        if isinstance(x, torch.Tensor):
            if x.dim() != 0:
                raise ModTraceError(
                    f"a captured tensor of shape {tuple(x.shape)} was used as a value; index it down to one "
                    "element with index values (e.g. t[h] or t[b, q_idx])"
                )
            return self.load(x, ())
        raise _unsupported(f"operand of type {type(x).__name__}")

    def load(self, tensor: torch.Tensor, index: tuple) -> "TraceValue":
        slot = self.slot_of.get(id(tensor))
        if slot is None:
            raise ModTraceError(
                "a mod used a tensor that is not captured where torch_fa4 can find it again on every call "
                "(closure variables, globals the mod names, attributes of a captured object or of a bound "
                "method's self, functools.partial arguments); tensors created inside the mod are not supported"
            )
        if str(tensor.dtype) not in AUX_DTYPE_KINDS:
            raise ModTraceError(f"captured tensors of dtype {tensor.dtype} are not supported")
        if len(index) != tensor.dim():
            raise ModTraceError(
                f"a captured tensor of rank {tensor.dim()} was indexed with {len(index)} index value(s); "
                "index every dimension so each access reads one element"
            )
        args = []
        for i in index:
            if isinstance(i, (slice, type(None), type(Ellipsis))) or isinstance(i, torch.Tensor):
                raise ModTraceError("captured tensors may only be indexed by index values or Python ints")
            v = self.value(i)
            if v.kind == FLOAT:
                raise ModTraceError("captured tensors must be indexed by integer values, got a float value")
            args.append(self._to_int(v).idx)
        return self.add("load", tuple(args), attr=slot, kind=AUX_DTYPE_KINDS[str(tensor.dtype)])

    def unary(self, op: str, x: Any) -> "TraceValue":
        v = self.value(x)
        if op == "not":
            if v.kind != BOOL:
                raise ModTraceError("~ / logical_not is supported on boolean values only")
            return self.add("not", (v.idx,), kind=BOOL)
        if op == "to_float":
            return v if v.kind == FLOAT else self.add("to_float", (v.idx,), kind=FLOAT)
        if op in ("neg", "abs"):
            v = self._to_int(v)  # a bool as 0 / 1
            return self.add(op, (v.idx,), kind=v.kind)
        # transcendental: always float
        return self.add(op, (self.unary("to_float", v).idx,), kind=FLOAT)

    def binary(self, op: str, x: Any, y: Any) -> "TraceValue":
        a, b = self.value(x), self.value(y)
        if op in ("and", "or", "xor"):
            if a.kind != BOOL or b.kind != BOOL:
                raise ModTraceError(f"&, |, ^ are supported on boolean values only (got {a.kind} and {b.kind})")
            return self.add("ne" if op == "xor" else op, (a.idx, b.idx), kind=BOOL)
        if op in ("floordiv", "mod"):
            if a.kind == FLOAT or b.kind == FLOAT:
                raise ModTraceError(f"{'//' if op == 'floordiv' else '%'} is supported on integer values only")
            return self.add(op, (a.idx, b.idx), kind=INT)
        if a.kind == BOOL and b.kind == BOOL and op in ("eq", "ne"):
            return self.add(op, (a.idx, b.idx), kind=BOOL)
        kind = FLOAT if FLOAT in (a.kind, b.kind) or op == "div" else INT
        a, b = self._promoted(a, kind), self._promoted(b, kind)
        return self.add(op, (a.idx, b.idx), kind=BOOL if op in ("eq", "ne", "lt", "le", "gt", "ge") else kind)

    def _to_int(self, v: "TraceValue") -> "TraceValue":
        if v.kind == BOOL:
            return self.add("where", (v.idx, self.value(1).idx, self.value(0).idx), kind=INT)
        return v

    def _promoted(self, v: "TraceValue", kind: str) -> "TraceValue":
        """v as `kind` (FLOAT or INT): numeric promotion, bool -> int -> float."""
        return self.unary("to_float", v) if kind == FLOAT else self._to_int(v)

    def where(self, cond: Any, x: Any, y: Any) -> "TraceValue":
        c = self.value(cond)
        if c.kind != BOOL:
            raise ModTraceError("torch.where needs a boolean condition")
        a, b = self.value(x), self.value(y)
        if a.kind != b.kind:
            kind = FLOAT if FLOAT in (a.kind, b.kind) else INT
            a, b = self._promoted(a, kind), self._promoted(b, kind)
        return self.add("where", (c.idx, a.idx, b.idx), kind=a.kind)

    def clamp(self, x: Any, min: Any = None, max: Any = None) -> "TraceValue":
        v = self.value(x)
        if min is not None:
            v = self.binary("maximum", v, min)
        if max is not None:
            v = self.binary("minimum", v, max)
        return v


_BINARY_NAMES = {
    "add": "add", "sub": "sub", "mul": "mul", "div": "div", "true_divide": "div", "truediv": "div",
    "floor_divide": "floordiv", "floordiv": "floordiv", "remainder": "mod", "mod": "mod",
    "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
    "and": "and", "or": "or", "xor": "xor", "logical_and": "and", "logical_or": "or", "logical_xor": "xor",
    "bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor",
    "minimum": "minimum", "maximum": "maximum", "min": "minimum", "max": "maximum",
}
_UNARY_NAMES = {
    "neg": "neg", "negative": "neg", "abs": "abs", "exp": "exp", "log": "log", "tanh": "tanh",
    "sigmoid": "sigmoid", "logical_not": "not", "bitwise_not": "not", "invert": "not", "float": "to_float",
}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _method(op: str):
    return lambda self, o: self.g.binary(op, self, o)


def _binary(op: str):
    """The method and the reflected method (o <op> self) of a binary operator."""
    return _method(op), lambda self, o: self.g.binary(op, o, self)


def _unary(op: str):
    return lambda self: self.g.unary(op, self)


def _refused(what: str):
    def method(self, *args):
        raise _unsupported(what)
    return method


class TraceValue:
    """A scalar value of a mod during tracing (an index, the score, or something derived)."""

    __slots__ = ("g", "idx")

    def __init__(self, g: GraphBuilder, idx: int):
        self.g = g
        self.idx = idx

    @property
    def kind(self) -> str:
        return self.g.nodes[self.idx].kind

    def __repr__(self) -> str:
        return f"TraceValue(%{self.idx}: {self.kind})"

    __hash__ = object.__hash__

    # Python control flow on a traced value cannot be recorded.
    def __bool__(self):
        raise ModTraceError(
            "a mod used a traced value in Python control flow (if / and / or / not / min() / max() / "
            "chained comparison); use torch.where, &, |, ~, torch.minimum / torch.maximum instead"
        )

    __index__ = _refused("using a traced value as a Python int (e.g. range(), list indexing)")
    __int__ = _refused("int() of a traced value")
    __float__ = _refused("float() of a traced value")
    __getitem__ = _refused("indexing the score or an index value (only captured tensors can be indexed)")
    __pow__ = __rpow__ = _refused("** (pow)")
    __matmul__ = _refused("@ (matmul)")

    __add__, __radd__ = _binary("add")
    __sub__, __rsub__ = _binary("sub")
    __mul__, __rmul__ = _binary("mul")
    __truediv__, __rtruediv__ = _binary("div")
    __floordiv__, __rfloordiv__ = _binary("floordiv")
    __mod__, __rmod__ = _binary("mod")
    __and__, __rand__ = _binary("and")
    __or__, __ror__ = _binary("or")
    __xor__, __rxor__ = _binary("xor")
    __eq__, __ne__, __lt__, __le__, __gt__, __ge__ = map(_method, ("eq", "ne", "lt", "le", "gt", "ge"))
    logical_and, logical_or, minimum, maximum = map(_method, ("and", "or", "minimum", "maximum"))
    __neg__ = neg = _unary("neg")
    __abs__ = abs = _unary("abs")
    __invert__ = logical_not = _unary("not")
    float = _unary("to_float")
    exp, log, tanh, sigmoid = map(_unary, ("exp", "log", "tanh", "sigmoid"))

    def __pos__(self):
        return self

    def clamp(self, min=None, max=None):
        return self.g.clamp(self, min, max)

    def to(self, dtype, *args, **kwargs):
        if dtype in _FLOAT_DTYPES:
            return self.g.unary("to_float", self)
        raise _unsupported(f".to({dtype}) (only floating dtypes: values are computed in fp32)")

    def __getattr__(self, name):  # any other tensor method
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # protocol probes (copy, numpy, ...) must see a plain miss
        raise _unsupported(f"Tensor.{name}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        g = next(a.g for a in _flat(args, kwargs) if isinstance(a, TraceValue))
        name = getattr(func, "__name__", repr(func))
        if name == "__getitem__":
            tensor, index = args
            if not isinstance(tensor, torch.Tensor):
                raise _unsupported("indexing a traced value")
            return g.load(tensor, index if isinstance(index, tuple) else (index,))
        if func is torch.where:
            if len(args) + len(kwargs) != 3:
                raise _unsupported("torch.where with one argument")
            cond, x, y = _bind(args, kwargs, ("condition", "input", "other"))
            return g.where(cond, x, y)
        if name == "clamp" or name == "clip":
            x, lo, hi = _bind(args, kwargs, ("input", "min", "max"))
            return g.clamp(x, lo, hi)
        if kwargs:
            raise _unsupported(f"{name} with keyword arguments {sorted(kwargs)}")
        reflected = name.startswith("__r") and name.endswith("__") and name[3:-2] in _BINARY_NAMES
        base = name[3:-2] if reflected else name.strip("_")
        if base in _BINARY_NAMES and len(args) == 2:
            x, y = (args[1], args[0]) if reflected else args
            return g.binary(_BINARY_NAMES[base], x, y)
        if base == "rsub" and len(args) == 2:
            return g.binary("sub", args[1], args[0])
        if base in _UNARY_NAMES and len(args) == 1:
            return g.unary(_UNARY_NAMES[base], args[0])
        raise _unsupported(_public_name(func, name))


def _public_name(func: Any, name: str) -> str:
    """torch.sin / Tensor.cumsum rather than _VariableFunctionsClass.sin / TensorBase.cumsum."""
    if getattr(torch, name, None) is func:
        return f"torch.{name}"
    if getattr(torch.Tensor, name, None) is func or getattr(torch._C.TensorBase, name, None) is func:
        return f"Tensor.{name}"
    return getattr(func, "__qualname__", name)


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (tuple, list)):
            yield from a
        else:
            yield a


def _bind(args, kwargs, names):
    values = list(args) + [None] * (len(names) - len(args))
    for i, n in enumerate(names):
        if n in kwargs:
            values[i] = kwargs.pop(n)
    if kwargs:
        raise _unsupported(f"keyword arguments {sorted(kwargs)}")
    return values


def trace_mod(fn: Callable, role: str, captured: Sequence[torch.Tensor]) -> ModGraph:
    """Trace `fn` as a score_mod (role "score") or mask_mod (role "mask")."""
    g = GraphBuilder(captured)
    names = SCORE_INPUTS if role == "score" else MASK_INPUTS
    inputs = [g.add("input", attr=n, kind=INPUT_KINDS[n]) for n in names]
    result = fn(*inputs)
    if role == "mask":
        if isinstance(result, bool):
            result = g.value(result)
        if not isinstance(result, TraceValue) or result.kind != BOOL:
            got = result.kind if isinstance(result, TraceValue) else type(result).__name__
            raise ModTraceError(f"a mask_mod must return a boolean value (a comparison, &, |, ~), got {got}")
    else:
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            result = g.value(float(result))
        if not isinstance(result, TraceValue):
            got = (f"a tensor of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor)
                   else type(result).__name__)
            raise ModTraceError(
                f"a score_mod must return one value per score element (same shape as score), got {got}"
            )
        if result.kind == BOOL:
            raise ModTraceError("a score_mod must return a number per score element, got a boolean")
        result = g.unary("to_float", result)
    # aux specs cover every captured tensor: slot numbers are positions in prepare's tensor list
    aux = tuple(AuxSpec(str(t.dtype), t.dim()) for t in g.captured)
    nodes, output = _drop_dead_nodes(g.nodes, result.idx)
    return ModGraph(role, nodes, output, aux)


def _drop_dead_nodes(nodes: list[Node], output: int) -> tuple[tuple[Node, ...], int]:
    """Remove nodes the output does not depend on (inputs stay, so listings always start alike)."""
    kept, renumber = _keep_ancestors(nodes, [output])
    return kept, renumber[output]


def _keep_ancestors(nodes: list[Node], roots: list[int]) -> tuple[tuple[Node, ...], dict[int, int]]:
    """The nodes `roots` depend on (inputs always kept), renumbered; and old -> new numbers."""
    live = set(roots) | {i for i, n in enumerate(nodes) if n.op == "input"}
    for i in range(len(nodes) - 1, -1, -1):
        if i in live:
            live.update(nodes[i].args)
    renumber: dict[int, int] = {}
    kept: list[Node] = []
    for i, n in enumerate(nodes):
        if i in live:
            renumber[i] = len(kept)
            kept.append(Node(n.op, tuple(renumber[a] for a in n.args), n.attr, n.kind))
    return tuple(kept), renumber
