"""d score_mod(score, ...) / d score as another ModGraph (for the backward kernels).

Forward-mode symbolic differentiation over the closed op set: each float node gets a tangent node
(None where it does not depend on the score). The result reads the same inputs and captured tensors
as the score graph, so backward kernels lower it with the same machinery and compute
`dscore_in = dscore_out * grad_graph(score, b, h, q_idx, kv_idx)` per element.

Non-smooth points follow torch autograd (which the reference backward uses): |x|' = 0 at 0, and
minimum/maximum split the gradient evenly between tied operands.
"""

from __future__ import annotations

from typing import Optional

from torch_fa4.mods.graph import BOOL, FLOAT, ModGraph
from torch_fa4.mods.trace import GraphBuilder, _drop_dead_nodes


def score_derivative(graph: ModGraph) -> ModGraph:
    if graph.role != "score":
        raise ValueError("only a score_mod graph has a derivative with respect to the score")
    g = GraphBuilder([])
    new: list[int] = []  # original node -> node in g
    for n in graph.nodes:
        new.append(g.add(n.op, tuple(new[a] for a in n.args), n.attr, n.kind).idx)

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
        return const(0.0) if a is None else a

    tangent: list[Optional[int]] = []
    for i, n in enumerate(graph.nodes):
        x = new[i]
        args = [new[a] for a in n.args]
        d = [tangent[a] for a in n.args]
        t: Optional[int] = None  # ints, bools, constants and loads do not vary with the score
        if n.kind != FLOAT or n.op in ("const", "load"):
            pass
        elif n.op == "input":
            t = const(1.0) if n.attr == "score" else None
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
    out = zero_if_none(tangent[graph.output])
    nodes, output = _drop_dead_nodes(g.nodes, out)
    return ModGraph("score_grad", nodes, output, graph.aux)
