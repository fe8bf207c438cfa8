"""Bounds of a mod's captured-tensor indexing, checked on the host before a call runs.

A mod reads captured tensors at indices computed from b, h, q_idx and kv_idx (t[h, kv_idx - q_idx],
table[doc[q_idx]]). Both lowerings index as PyTorch does: i in [-size, -1] reads element
i + size (index_sign.py says how the kernels do it), anything else is out of bounds. A kernel
cannot raise, so `check_call` runs first on every path (dispatch.py, reference and kernels alike):
interval arithmetic over the graph, with b in [0, B - 1], h in [0, Hq - 1], q_idx in [0, Sq - 1],
kv_idx in [0, Sk - 1] from the call's shapes (packed varlen batches: max_seqlen_q / max_seqlen_k),
and, for an integer tensor whose values are themselves used as indices, its [min, max] (read once
per tensor version: a device read). Any index that may leave [-size, size - 1] raises
ModIndexError naming the mod, the tensor, the dimension, the index range and the size. So does an
index that cannot be bounded: a // or % by a value whose range holds 0, or an intermediate that
may leave int32 (where the kernels' index arithmetic would differ from PyTorch's int64). The check
must prove every read in bounds, never assume it. Masks do not narrow the ranges: both lowerings
evaluate the mods on masked elements too.

A repeated call costs a dict lookup: a verdict is kept per (mod key, B, Hq, Sq, Sk, the captured
tensors' shapes, the value ranges of those whose values are indices).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from torch_fa4.mods import naming
from torch_fa4.mods.graph import BOOL, FLOAT, INT, ModGraph, ancestors

INT32 = (-(2 ** 31), 2 ** 31 - 1)
Interval = tuple[int, int]


class ModIndexError(IndexError):
    """A score_mod / mask_mod may index a captured tensor out of bounds for this call (or its
    indices cannot be bounded). Raised on the host before anything is computed."""


class _Unbounded(Exception):
    """An index interval that cannot be computed; the message says why."""


@dataclass(frozen=True, eq=False)
class _GraphPlan:
    """What checking one graph needs, derived once per graph."""

    key: str  # the mod key, for names in messages
    role: str
    graph: ModGraph
    aux_offset: int  # where this graph's captured tensors start in the call's list
    order: tuple[int, ...]  # the loads and every node an index depends on, in node order
    feeds: dict  # index-cone node -> (load, dimension) it first feeds, for messages
    value_slots: tuple[int, ...]  # slots of integer tensors whose values feed an index


@dataclass(frozen=True)
class _ModsPlan:
    key: str
    graphs: tuple[_GraphPlan, ...]  # only graphs with indexed loads
    num_aux: int
    value_aux: tuple[int, ...]  # positions in the call's captured tensors read for value ranges


def _graph_plan(key: str, role: str, graph: ModGraph, aux_offset: int) -> Optional[_GraphPlan]:
    live = ancestors(graph, [graph.output])
    loads = tuple(i for i in sorted(live) if graph.nodes[i].op == "load" and graph.nodes[i].args)
    if not loads:
        return None
    feeds: dict[int, tuple[int, int]] = {}
    for load in loads:
        for d, a in enumerate(graph.nodes[load].args):
            for x in ancestors(graph, [a]):
                feeds.setdefault(x, (load, d))
    value_slots = sorted({graph.nodes[i].attr for i in feeds
                          if graph.nodes[i].op == "load" and graph.nodes[i].kind == INT})
    order = tuple(sorted(set(feeds) | set(loads)))
    return _GraphPlan(key, role, graph, aux_offset, order, feeds, tuple(value_slots))


def _plan(mods) -> _ModsPlan:
    """What checking `mods` needs, derived once per mod key."""
    plan = _PLANS.get(mods.key)
    if plan is not None:
        return plan
    graphs, value_aux = [], []
    offset = 0
    for role, graph in (("score", mods.score_graph), ("mask", mods.mask_graph)):
        if graph is None:
            continue
        graph_plan = _graph_plan(mods.key, role, graph, offset)
        if graph_plan is not None:
            graphs.append(graph_plan)
            value_aux += [offset + s for s in graph_plan.value_slots]
        offset += len(graph.aux)
    plan = _PLANS[mods.key] = _ModsPlan(mods.key, tuple(graphs), offset, tuple(value_aux))
    return plan


# ---- interval arithmetic ------------------------------------------------------------------------

def _corners(fn, a: Interval, b: Interval) -> Interval:
    values = [fn(x, y) for x in a for y in b]
    return min(values), max(values)


def _nonzero_divisor(b: Interval, what: str) -> None:
    if b[0] <= 0 <= b[1]:
        raise _Unbounded(f"it takes {what} by a value in [{b[0]}, {b[1]}], which may be 0")


def _mod(a: Interval, b: Interval) -> Interval:
    """x % y, floor semantics (the result has y's sign, |result| < |y|)."""
    _nonzero_divisor(b, "%")
    if b[0] > 0:
        return (a[0], a[1]) if 0 <= a[0] and a[1] < b[0] else (0, b[1] - 1)
    return (a[0], a[1]) if a[1] <= 0 and a[0] > b[1] else (b[0] + 1, 0)


def _floordiv(a: Interval, b: Interval) -> Interval:
    # monotone in each argument while the divisor keeps its sign: the extremes are at corners
    _nonzero_divisor(b, "//")
    return _corners(lambda x, y: x // y, a, b)


def _abs(a: Interval) -> Interval:
    lo, hi = sorted((abs(a[0]), abs(a[1])))
    return (0 if a[0] <= 0 <= a[1] else lo), hi


_RULES = {
    "neg": lambda a: (-a[1], -a[0]),
    "abs": _abs,
    "add": lambda a, b: (a[0] + b[0], a[1] + b[1]),
    "sub": lambda a, b: (a[0] - b[1], a[1] - b[0]),
    "mul": lambda a, b: _corners(lambda x, y: x * y, a, b),
    "minimum": lambda a, b: (min(a[0], b[0]), min(a[1], b[1])),
    "maximum": lambda a, b: (max(a[0], b[0]), max(a[1], b[1])),
    "where": lambda c, a, b: (min(a[0], b[0]), max(a[1], b[1])),
    "floordiv": _floordiv,
    "mod": _mod,
}


def _interval(graph: ModGraph, i: int, env: dict, inputs: dict, value_range) -> Interval:
    n = graph.nodes[i]
    if n.op == "input":
        return inputs[n.attr]
    if n.op == "const":
        return int(n.attr), int(n.attr)
    if n.op == "load":
        return value_range(n.attr)
    rule = _RULES.get(n.op)
    if rule is None:
        raise _Unbounded(f"no bound is known for {n.op}")
    args = [env.get(a) for a in n.args]
    if any(a is None for a in args):
        raise _Unbounded(f"{n.op} of a value without a bound")
    return rule(*args)


# ---- the check ----------------------------------------------------------------------------------

def _check_graph(plan: _GraphPlan, aux: Sequence[torch.Tensor], bounds: tuple, ranges: dict) -> None:
    B, H, Sq, Sk = bounds
    inputs = {"b": (0, B - 1), "h": (0, H - 1), "q_idx": (0, Sq - 1), "kv_idx": (0, Sk - 1)}
    graph = plan.graph
    env: dict[int, Interval] = {}

    def value_range(slot: int) -> Interval:
        r = ranges.get(plan.aux_offset + slot)
        if r is None:
            raise _Unbounded(f"captured tensor #{slot} is empty")
        return r

    for i in plan.order:
        n = graph.nodes[i]
        if n.op == "load" and n.args:
            _check_load(plan, i, aux[plan.aux_offset + n.attr], env, bounds)
        if i not in plan.feeds or n.kind == FLOAT:
            continue
        if n.kind == BOOL:
            env[i] = (0, 1)
            continue
        try:
            r = _interval(graph, i, env, inputs, value_range)
            if r[0] < INT32[0] or r[1] > INT32[1]:
                raise _Unbounded(f"an intermediate value in [{r[0]}, {r[1]}] may leave int32, the kernels' "
                                 "index arithmetic")
        except _Unbounded as e:
            load, dim = plan.feeds[i]
            where = _where(plan, load, aux[plan.aux_offset + graph.nodes[load].attr], dim)
            raise ModIndexError(
                f"torch_fa4: {where} with an index that cannot be bounded: {e}. Every index of a captured "
                "tensor must be provably in range before the mod runs; clamp it (torch.clamp) or index with "
                "values of known range"
            ) from None
        env[i] = r


def _check_load(plan: _GraphPlan, i: int, t: torch.Tensor, env: dict, bounds: tuple) -> None:
    n = plan.graph.nodes[i]
    if t.dim() != len(n.args):
        raise ValueError(
            f"torch_fa4: {naming.mod_name(plan.key, plan.role)} indexes captured tensor #{n.attr} with "
            f"{len(n.args)} indices, but the tensor passed for it has shape {tuple(t.shape)}"
        )
    for d, (a, size) in enumerate(zip(n.args, t.shape)):
        lo, hi = env[a]
        if lo < -size or hi > size - 1:
            B, H, Sq, Sk = bounds
            raise ModIndexError(
                f"torch_fa4: {_where(plan, i, t, d)} with indices in [{lo}, {hi}], outside "
                f"[{-size}, {size - 1}] for a call with B={B}, H={H}, Sq={Sq}, Sk={Sk}. Indices in [-size, -1] "
                "count from the end, as in PyTorch; size the tensor for the call or clamp the index"
            )


def _where(plan: _GraphPlan, load: int, t: torch.Tensor, dim: int) -> str:
    """"score_mod 'f' indexes captured tensor #0 'tab' (shape (8, 50)) at dimension 1"."""
    slot = plan.graph.nodes[load].attr
    name = naming.tensor_name(plan.key, plan.role, slot)
    label = f"#{slot}" + (f" {name}" if name else "")
    return (f"{naming.mod_name(plan.key, plan.role)} indexes captured tensor {label} (shape {tuple(t.shape)}) "
            f"at dimension {dim}")


_PLANS: dict[str, _ModsPlan] = {}
_PASSED: dict[tuple, None] = {}
_PASSED_CAPACITY = 4096  # a bound, not an eviction policy
_RANGES: dict[int, tuple] = {}  # id(tensor) -> (weak reference, (version, data pointer), range)
_RANGES_CAPACITY = 256


def _value_range(t: torch.Tensor) -> Optional[Interval]:
    """[min, max] of an integer tensor (None when empty), read once per tensor version: kept as
    torch_fa4.tensor_memo keeps values, in a leaner form (this sits on every call of a mod that
    indexes with a tensor's values)."""
    try:
        stamp = (t._version, t.data_ptr())
    except RuntimeError:  # an inference tensor has no version counter: read it every time
        return _read_range(t)
    entry = _RANGES.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] == stamp:
        return entry[2]
    r = _read_range(t)
    if len(_RANGES) >= _RANGES_CAPACITY:
        _RANGES.clear()
    _RANGES[id(t)] = (weakref.ref(t), stamp, r)
    return r


def _read_range(t: torch.Tensor) -> Optional[Interval]:
    if t.numel() == 0:
        return None
    lo, hi = torch.aminmax(t.detach())
    return tuple(torch.stack((lo.long(), hi.long())).tolist())  # one device read


def check(mods, aux: Sequence[torch.Tensor], bounds: tuple[int, int, int, int]) -> None:
    """Raise ModIndexError unless every captured-tensor index of `mods` stays in range for a call
    whose b, h, q_idx, kv_idx lie in [0, B), [0, H), [0, Sq), [0, Sk) (bounds = (B, H, Sq, Sk))."""
    plan = _plan(mods)
    if plan.graphs:
        _check(plan, aux, bounds)


def check_call(call) -> None:
    """`check` for an AttentionCall, bounds from `call_bounds` (dispatch runs it before the
    reference or a kernel). On the path of every call with mods: a repeated call is a dict lookup."""
    mods = call.mods
    if mods is not None and (plan := _PLANS.get(mods.key) or _plan(mods)).graphs:
        _check(plan, call.aux_tensors, call_bounds(call))


def call_bounds(call) -> tuple[int, int, int, int]:
    """(B, Hq, Sq, Sk) bounding b, h, q_idx, kv_idx of an AttentionCall, without a device read:
    packed varlen sides use max_seqlen_q / max_seqlen_k (no longer than the packed total)."""
    q_shape = call.q.shape
    if call.cu_seqlens_q is None:  # q (B, Sq, Hq, D)
        batch, q_len = q_shape[0], q_shape[1]
    else:  # q (total_q, Hq, D)
        batch, q_len = call.cu_seqlens_q.shape[0] - 1, q_shape[0]
        if call.max_seqlen_q:
            q_len = min(q_len, call.max_seqlen_q)
    k_len = call.kv_len  # Sk, total_k when packed, max_pages * page_size when paged
    if call.cu_seqlens_k is not None and call.max_seqlen_k:
        k_len = min(k_len, call.max_seqlen_k)
    return batch, q_shape[-2], q_len, k_len


def _check(plan: _ModsPlan, aux: Sequence[torch.Tensor], bounds: tuple) -> None:
    if len(aux) != plan.num_aux:
        raise ValueError(f"torch_fa4: the mods of key {plan.key} capture {plan.num_aux} tensors, got {len(aux)}")
    ranges = tuple([_value_range(aux[i]) for i in plan.value_aux]) if plan.value_aux else ()
    memo = (plan.key, bounds, ranges, *[t.shape for t in aux])
    if memo in _PASSED or min(bounds) <= 0:  # passed before with these shapes and value ranges / nothing runs
        return
    by_position = dict(zip(plan.value_aux, ranges))
    for g in plan.graphs:
        _check_graph(g, aux, bounds, by_position)
    if len(_PASSED) >= _PASSED_CAPACITY:
        _PASSED.clear()
    _PASSED[memo] = None
