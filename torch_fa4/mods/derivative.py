"""Derivatives of a score_mod as ModGraphs: with respect to the score, and to each captured value.

Forward-mode symbolic differentiation over the closed op set: each float node gets a tangent node
(None where it does not depend on the seed). The results read the same inputs and captured tensors
as the score graph, so backward kernels lower them with the same machinery.

- `score_derivative(graph)`: d score_mod / d score, the seed being the `score` input. Backward
  kernels compute `dscore_in = dscore_out * grad_graph(score, b, h, q_idx, kv_idx)` per element.
- `load_derivatives(graph)`: for every load of a floating captured tensor, d score_mod / d (the
  loaded value), each load being a seed of its own, in one graph together with the score_mod's
  output and the load's index values. The gradient of a captured tensor is the sum, over score
  elements and loads of it, of `dscore_out * derivative` added at the element the load read
  (torch_fa4/mods/capture_grad.py). A value that reaches the output only through comparisons or
  indices (a mask-like use) has no tangent: its derivative is 0, as torch autograd's.

Non-smooth points follow torch autograd (which the reference backward uses): |x|' = 0 at 0, and
minimum/maximum split the gradient evenly between tied operands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from torch_fa4.mods.graph import BOOL, FLOAT, ModGraph, Node
from torch_fa4.mods.trace import GraphBuilder, _drop_dead_nodes, _keep_ancestors


def score_derivative(graph: ModGraph) -> ModGraph:
    if graph.role != "score":
        raise ValueError("only a score_mod graph has a derivative with respect to the score")
    g, new = _copy(graph)
    tangent = _tangents(g, new, graph, lambda i, n: n.op == "input" and n.attr == "score")
    out = _zero_if_none(g, tangent[graph.output])
    nodes, output = _drop_dead_nodes(g.nodes, out)
    return ModGraph("score_grad", nodes, output, graph.aux)


@dataclass(frozen=True)
class LoadDerivative:
    """One load of a floating captured tensor: nodes of `LoadDerivatives.graph` that hold the
    load's index values (one per dimension of the tensor) and d score_mod / d (the loaded value)."""

    slot: int
    index: tuple[int, ...]
    derivative: int


@dataclass(frozen=True)
class LoadDerivatives:
    """`graph` computes the score_mod's output (its `output`) and, in further nodes, every load's
    index values and derivative (`loads`). Loads whose derivative is identically 0 are left out."""

    graph: ModGraph
    loads: tuple[LoadDerivative, ...]

    def slots(self) -> frozenset[int]:
        return frozenset(d.slot for d in self.loads)


def load_derivatives(graph: ModGraph) -> LoadDerivatives:
    if graph.role != "score":
        raise ValueError("only a score_mod graph has captured values that change the score")
    g, new = _copy(graph)
    found = []  # (slot, index nodes, derivative node) in g's numbering
    for i, n in enumerate(graph.nodes):
        if n.op != "load" or n.kind != FLOAT:
            continue
        tangent = _tangents(g, new, graph, lambda j, m, seed=i: j == seed)
        if tangent[graph.output] is not None:
            found.append((n.attr, tuple(new[a] for a in n.args), tangent[graph.output]))
    roots = [new[graph.output]] + [x for _, index, d in found for x in (*index, d)]
    nodes, renumber = _keep_ancestors(g.nodes, roots)
    loads = tuple(LoadDerivative(slot, tuple(renumber[a] for a in index), renumber[d])
                  for slot, index, d in found)
    return LoadDerivatives(ModGraph("score", nodes, renumber[new[graph.output]], graph.aux), loads)


def _copy(graph: ModGraph) -> tuple[GraphBuilder, list[int]]:
    """A builder holding the graph's nodes, and the node each original one became."""
    g = GraphBuilder([])
    new: list[int] = []
    for n in graph.nodes:
        new.append(g.add(n.op, tuple(new[a] for a in n.args), n.attr, n.kind).idx)
    return g, new


def _zero_if_none(g: GraphBuilder, a: Optional[int]) -> int:
    return g.add("const", attr=0.0, kind=FLOAT).idx if a is None else a


def _tangents(g: GraphBuilder, new: list[int], graph: ModGraph,
              is_seed: Callable[[int, Node], bool]) -> list[Optional[int]]:
    """Append to `g` the tangent of every node of `graph` (whose nodes are `new` in g) with respect
    to the seed node(s) chosen by `is_seed`; returns them, None where a node does not vary."""

    def const(x: float) -> int:
        return g.add("const", attr=x, kind=FLOAT).idx

    def op(name: str, *args: int, kind: str = FLOAT) -> int:
        return g.add(name, tuple(args), kind=kind).idx

    def mul(a: Optional[int], b: int) -> Optional[int]:
        return None if a is None else op("mul", a, b)

    def add(a: Optional[int], b: Optional[int]) -> Optional[int]:
        if a is None:
            return b
        return a if b is None else op("add", a, b)

    def neg(a: Optional[int]) -> Optional[int]:
        return None if a is None else op("neg", a)

    def zero_if_none(a: Optional[int]) -> int:
        return _zero_if_none(g, a)

    tangent: list[Optional[int]] = []
    for i, n in enumerate(graph.nodes):
        x = new[i]
        args = [new[a] for a in n.args]
        d = [tangent[a] for a in n.args]
        t: Optional[int] = None  # ints, bools, constants and other leaves do not vary with the seed
        if n.kind != FLOAT:
            pass
        elif is_seed(i, n):
            t = const(1.0)
        elif n.op in ("const", "load", "input"):
            pass
        elif n.op == "to_float":
            t = d[0]  # None for an int or bool: they have no tangent
        elif n.op == "add":
            t = add(d[0], d[1])
        elif n.op == "sub":
            t = add(d[0], neg(d[1]))
        elif n.op == "mul":
            t = add(mul(d[0], args[1]), mul(d[1], args[0]))
        elif n.op == "div":  # (a/b)' = a'/b - a b'/b^2
            t = add(None if d[0] is None else op("div", d[0], args[1]),
                    None if d[1] is None else neg(op("div", op("mul", args[0], d[1]), op("mul", args[1], args[1]))))
        elif n.op == "neg":
            t = neg(d[0])
        elif n.op == "abs":
            if d[0] is not None:
                zero = const(0.0)
                pos, negv = op("gt", args[0], zero, kind=BOOL), op("lt", args[0], zero, kind=BOOL)
                t = op("where", pos, d[0], op("where", negv, op("neg", d[0]), zero))
        elif n.op == "exp":
            t = mul(d[0], x)
        elif n.op == "log":
            t = None if d[0] is None else op("div", d[0], args[0])
        elif n.op == "tanh":  # 1 - tanh^2
            t = mul(d[0], op("sub", const(1.0), op("mul", x, x)))
        elif n.op == "sigmoid":  # s (1 - s)
            t = mul(d[0], op("mul", x, op("sub", const(1.0), x)))
        elif n.op in ("minimum", "maximum"):
            if d[0] is not None or d[1] is not None:
                da, db = zero_if_none(d[0]), zero_if_none(d[1])
                first = op("lt" if n.op == "minimum" else "gt", args[0], args[1], kind=BOOL)
                tie = op("eq", args[0], args[1], kind=BOOL)
                half = op("mul", op("add", da, db), const(0.5))
                t = op("where", first, da, op("where", tie, half, db))
        elif n.op == "where":
            if d[1] is not None or d[2] is not None:
                t = op("where", args[0], zero_if_none(d[1]), zero_if_none(d[2]))
        else:
            raise AssertionError(f"no derivative rule for float op {n.op}")
        tangent.append(t)
    return tangent
