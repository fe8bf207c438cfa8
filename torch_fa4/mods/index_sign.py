"""Which indices of a mod's captured-tensor reads may be negative, decided once per graph.

Captured tensors are indexed as in PyTorch, negative indices counting from the end (index_bounds.py
refuses any index that may leave [-size, size - 1]). The PyTorch lowering gets the wrap from tensor
indexing itself; the CuTe DSL lowering has to emit it (`i < 0 ? i + size : i`), and does so only
where this pass cannot prove the index non-negative, so reads such as slopes[h], doc[q_idx] or
table[h, clamp(q_idx - kv_idx + 4, 0, 8)] compile to the same code as without the rule.

Provably >= 0: the inputs b, h, q_idx, kv_idx; constants >= 0; loads from uint8 tensors and bool
values turned into 0 / 1; add, mul, minimum, floordiv of values >= 0; maximum with one side >= 0;
abs; x % d for d >= 0 (floor semantics: the result has the divisor's sign); where of two values
>= 0. Not: subtraction, negation, loads from signed tensors. Sums and products of non-negative
values stay non-negative in the kernels' int32 arithmetic because the host check also refuses
index computations that may leave int32, and a divisor >= 0 is nonzero because it refuses
divisors whose range contains 0.
"""

from __future__ import annotations

import functools

from torch_fa4.mods.graph import INT, ModGraph

KEEP, WRAP, SHIFT = 0, 1, 2  # index as is / i < 0 ? i + size : i / i + size (a negative constant)

_NONNEG_ARGS_ALL = ("add", "mul", "minimum", "floordiv")
_NONNEG_INPUTS = ("b", "h", "q_idx", "kv_idx")


def nonnegative_nodes(graph: ModGraph) -> frozenset[int]:
    """The int / bool nodes whose value is >= 0 on every element (bool nodes count as 0 / 1)."""
    nonneg: set[int] = set()
    for i, n in enumerate(graph.nodes):
        op, a = n.op, n.args
        if n.kind == "bool":
            ok = True
        elif n.kind != INT:
            ok = False
        elif op == "input":
            ok = n.attr in _NONNEG_INPUTS
        elif op == "const":
            ok = n.attr >= 0
        elif op == "load":
            ok = graph.aux[n.attr].dtype == "torch.uint8"
        elif op in _NONNEG_ARGS_ALL:
            ok = all(x in nonneg for x in a)
        elif op == "maximum":
            ok = any(x in nonneg for x in a)
        elif op == "abs":
            ok = True
        elif op == "mod":
            ok = a[1] in nonneg
        elif op == "where":
            ok = a[1] in nonneg and a[2] in nonneg
        else:
            ok = False
        if ok:
            nonneg.add(i)
    return frozenset(nonneg)


@functools.lru_cache(maxsize=None)
def index_wraps(graph: ModGraph) -> dict[int, tuple[int, ...]]:
    """load node -> for each of its indices KEEP, WRAP or SHIFT: what a lowering that does not wrap
    negative indices by itself must emit. Loads whose indices are all KEEP are left out."""
    nonneg = nonnegative_nodes(graph)
    out: dict[int, tuple[int, ...]] = {}
    for i, n in enumerate(graph.nodes):
        if n.op != "load" or all(a in nonneg for a in n.args):
            continue
        out[i] = tuple(KEEP if a in nonneg else SHIFT if graph.nodes[a].op == "const" else WRAP
                       for a in n.args)
    return out
