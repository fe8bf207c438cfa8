"""Mods that say what a built-in argument says, recognised from their traced graphs.

A mask_mod that keeps a band of the index difference (`q_idx >= kv_idx`, `q_idx - kv_idx <= 256`,
`(q_idx - kv_idx).abs() < w`, and `&` of such) is causal / a sliding window; a score_mod that is
`c * tanh(score / c)` is `softcap=c`. The built-ins run the kernels' analytic paths (tiles outside
the band are never visited, tiles inside it are never masked), so `attention` hands such calls to
them, with what the mods did taken out. Recognition is exact, on integer arithmetic of the graph:
a mask is recognised only if it equals the band for every index, and only where the band is a
window of the call (the call's own lengths decide the diagonal, so varlen and `seqused_k` calls,
whose diagonals differ per sequence, keep their mods).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

from torch_fa4.mods.graph import ModGraph
from torch_fa4.mods.prepare import _assume_constant_result

INF = math.inf


class Builtins(NamedTuple):
    """What the mods of one key amount to: `band` (lo, hi) bounds q_idx - kv_idx (top-left
    aligned, ±inf unbounded) or None; `softcap` (0: none); the keys of what is left without the
    mask_mod, without the score_mod and without both; how many captured tensors are the
    score_mod's (they come first). Where the mask_mod is not a band but `band & rest` (a document
    mask ANDed with causal), `rest_band` is that band and `key_with_rest` the key of the score_mod
    with `rest` as the mask_mod (same captured tensors); else None and ""."""

    band: Optional[tuple[float, float]]
    softcap: float
    key_without_mask: str
    key_without_score: str
    score_aux: int
    rest_band: Optional[tuple[float, float]] = None
    key_with_rest: str = ""


_MEMO: dict[str, Optional[Builtins]] = {}


@_assume_constant_result
def builtins_of(mod_key: str) -> Optional[Builtins]:
    """The built-in equivalent of the mods of `mod_key`, or None where neither mod is one."""
    if mod_key not in _MEMO:
        _MEMO[mod_key] = _analyse(mod_key)
    return _MEMO[mod_key]


def _analyse(mod_key: str) -> Optional[Builtins]:
    from torch_fa4.mods.registry import lookup, register

    mods = lookup(mod_key)
    band = mask_band(mods.mask_graph) if mods.mask_graph is not None else None
    cap = score_softcap(mods.score_graph) if mods.score_graph is not None else 0.0
    split = mask_band_split(mods.mask_graph) if mods.mask_graph is not None and band is None else None
    if band is None and not cap and split is None:
        return None
    key_of = lambda score, mask: register(score, mask).key if (score or mask) else ""
    rest_band, key_with_rest = None, ""
    if split is not None:
        rest_band, rest = split
        key_with_rest = key_of(mods.score_graph, rest)
    return Builtins(band, cap, key_of(mods.score_graph, None), key_of(None, mods.mask_graph),
                    mods.num_score_aux, rest_band, key_with_rest)


# ---- the mask: a band of q_idx - kv_idx ---------------------------------------------------------

def mask_band(graph: ModGraph) -> Optional[tuple[float, float]]:
    """(lo, hi) with graph(b, h, q, kv) == (lo <= q - kv <= hi) for all indices, or None."""
    values: list = []
    for node in graph.nodes:
        values.append(_band_value(node, values))
    out = values[graph.output]
    if not (isinstance(out, tuple) and out[0] == "band"):
        return None
    lo, hi = out[1], out[2]
    return (lo, hi) if lo <= hi else None


def mask_band_split(graph: ModGraph) -> Optional[tuple[tuple[float, float], ModGraph]]:
    """((lo, hi), rest) where graph == band(lo, hi) & rest for every index: the output is an `&`
    of conjuncts some of which are bands of q_idx - kv_idx (their intersection is the band) and
    some not (a document mask ANDed with causal); else None. `rest` is the mask graph of the other
    conjuncts, on the same nodes and captured tensors."""
    from torch_fa4.mods.graph import BOOL, Node

    values: list = []
    for node in graph.nodes:
        values.append(_band_value(node, values))

    def conjuncts(i):
        n = graph.nodes[i]
        return conjuncts(n.args[0]) + conjuncts(n.args[1]) if n.op == "and" else [i]

    parts = conjuncts(graph.output)
    bands = [values[i] for i in parts if isinstance(values[i], tuple) and values[i][0] == "band"]
    others = [i for i in parts if not (isinstance(values[i], tuple) and values[i][0] == "band")]
    if not bands or not others:
        return None
    lo, hi = max(b[1] for b in bands), min(b[2] for b in bands)
    if lo > hi:
        return None
    nodes, rest = list(graph.nodes), others[0]
    for other in others[1:]:
        nodes.append(Node("and", (rest, other), None, BOOL))
        rest = len(nodes) - 1
    return (lo, hi), ModGraph(graph.role, tuple(nodes), rest, graph.aux)


def _band_value(node, values):
    """An int node as ("affine", a_q, a_kv, c), |affine| as ("abs", a_q, a_kv, c), a bool node as
    ("band", lo, hi); None for anything else."""
    args = [values[i] for i in node.args]
    op = node.op
    if op == "input":
        return {"q_idx": ("affine", 1, 0, 0), "kv_idx": ("affine", 0, 1, 0)}.get(node.attr)
    if op == "const":
        if isinstance(node.attr, bool):
            return ("band", -INF, INF) if node.attr else None
        return ("affine", 0, 0, node.attr) if isinstance(node.attr, int) else None
    if any(a is None for a in args):
        return None
    if op in ("add", "sub", "neg", "mul"):
        return _affine(op, args)
    if op == "abs" and args[0][0] == "affine":
        return ("abs",) + args[0][1:]
    if op in ("le", "lt", "ge", "gt", "eq"):
        return _compare(op, *args)
    if op == "and" and args[0][0] == args[1][0] == "band":
        return ("band", max(args[0][1], args[1][1]), min(args[0][2], args[1][2]))
    return None


def _affine(op, args):
    if any(a[0] != "affine" for a in args):
        return None
    if op == "neg":
        return ("affine",) + tuple(-x for x in args[0][1:])
    x, y = args[0][1:], args[-1][1:]
    if op == "add":
        return ("affine",) + tuple(a + b for a, b in zip(x, y))
    if op == "sub":
        return ("affine",) + tuple(a - b for a, b in zip(x, y))
    if x[:2] == (0, 0):  # mul by a constant on either side
        return ("affine",) + tuple(x[2] * b for b in y)
    if y[:2] == (0, 0):
        return ("affine",) + tuple(a * y[2] for a in x)
    return None


def _compare(op, x, y):
    """The band where `x op y` holds, for x, y affine (or |affine| against a constant)."""
    if op in ("ge", "gt"):  # x >= y  <=>  y <= x
        return _compare("le" if op == "ge" else "lt", y, x)
    if x[0] == "abs" and y[0] == "affine" and y[1:3] == (0, 0):  # |a d + c| <= w  (or < w)
        w = y[3] - (1 if op == "lt" else 0)
        if op not in ("le", "lt") or x[1] != -x[2] or x[1] == 0:
            return None
        return _linear_band(x[1], x[3], -w, w)
    if x[0] != "affine" or y[0] != "affine":
        return None
    a_q, a_kv, c = (p - r for p, r in zip(x[1:], y[1:]))  # x - y = a_q q + a_kv kv + c
    if a_q != -a_kv or a_q == 0:  # not a function of q - kv alone
        return None
    if op == "eq":
        return _linear_band(a_q, c, 0, 0)
    return _linear_band(a_q, c, -INF, -1 if op == "lt" else 0)


def _linear_band(a: int, c: int, lo: float, hi: float):
    """The band of d where lo <= a d + c <= hi (integers d)."""
    lo, hi = lo - c, hi - c  # lo <= a d <= hi
    if a < 0:
        a, lo, hi = -a, -hi, -lo
    lo_d = -INF if lo == -INF else math.ceil(lo / a)
    hi_d = INF if hi == INF else math.floor(hi / a)
    return ("band", lo_d, hi_d)


# ---- the score: c * tanh(score / c) -------------------------------------------------------------

def score_softcap(graph: ModGraph) -> float:
    """c where graph(score, ...) == c * tanh(score / c) with a constant c > 0, else 0."""
    nodes = graph.nodes

    def const(i):
        n = nodes[i]
        if n.op == "const" and isinstance(n.attr, (int, float)) and not isinstance(n.attr, bool):
            return float(n.attr)
        if n.op == "to_float":
            return const(n.args[0])
        return None

    def scaled_score(i):  # score * k or score / c  ->  k
        n = nodes[i]
        if n.op not in ("mul", "div"):
            return None
        a, b = n.args
        if n.op == "div":
            c = const(b)
            return 1.0 / c if nodes[a].op == "input" and nodes[a].attr == "score" and c else None
        for s, k in ((a, b), (b, a)):
            if nodes[s].op == "input" and nodes[s].attr == "score" and const(k) is not None:
                return const(k)
        return None

    out = nodes[graph.output]
    if out.op != "mul":
        return 0.0
    for t, c in (out.args, out.args[::-1]):
        cap = const(c)
        if cap is None or cap <= 0 or nodes[t].op != "tanh":
            continue
        k = scaled_score(nodes[t].args[0])
        if k is not None and math.isclose(k * cap, 1.0, rel_tol=1e-6):
            return cap
    return 0.0


# ---- the call ------------------------------------------------------------------------------------

def window_for(band, sq: int, sk: int, window_left: int, window_right: int) -> Optional[tuple[int, int]]:
    """The call's (window_left, window_right) (-1 unbounded, bottom-right aligned as the API's)
    once the mask's band is added to them, or None where the result is no window."""
    offset = sk - sq  # key index of query row 0's diagonal
    lo, hi = band  # in d = q - kv
    if window_right >= 0:
        lo = max(lo, -offset - window_right)
    if window_left >= 0:
        hi = min(hi, window_left - offset)
    left = -1 if hi == INF else hi + offset
    right = -1 if lo == -INF else -lo - offset
    if left < -1 or right < -1 or (left == -1 and hi != INF) or (right == -1 and lo != -INF):
        return None
    return int(left), int(right)
