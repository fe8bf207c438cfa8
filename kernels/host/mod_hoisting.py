"""Where each node of a traced mod graph has to be computed inside a score tile, and when an
int -> float conversion can be done exactly in fp32 instead.

Pure Python over a `ModGraph` (no CuTe DSL import), so the CPU tests check the decisions directly;
`mod_fragment` follows them when it emits code for a thread's score fragment.

Hoisting by dependence. A node's *level* is the set of per-element inputs it depends on:

    TILE  b, h, constants, loads indexed by those   once per tile of work (kept in registers
                                                     across key tiles by the kernel)
    ROW   q_idx (and TILE values)                   once per fragment row (2 per warpgroup tile)
    COL   kv_idx (and TILE values)                  once per fragment column (tile_n / 4)
    ELEM  score, or both q_idx and kv_idx           per element

Levels are bit sets (ROW | COL == ELEM), so a node's level is the union of its arguments'.

Exact int -> float. On Hopper I2F issues on the quarter-rate pipe that MUFU.EX2 uses, so a
per-element conversion competes with the softmax exponentials. Every integer of magnitude
<= 2^24 is an fp32 value, and fp32 add / sub / mul / neg / abs / min / max of such integers are
exact as long as the true result is such an integer too. So `to_float(x)` of an integer
expression x may be computed in fp32 from converted parts when interval analysis bounds every
intermediate by 2^24; otherwise the integer path stays. Sequence positions are assumed to be in
[0, 2^23) (MAX_SEQLEN: the host must not send longer sequences with mods to the kernel), which
leaves room for offsets: kv_idx - q_idx + c stays exact for |c| < 2^23.

Affine indices. A thread's fragment positions are q_idx = q_base + row_off[r] and kv_idx =
kv_base + col_off[j], with compile-time offsets. An integer node that is affine in q_idx and
kv_idx, c_q * q_idx + c_kv * kv_idx + (TILE terms) + const, therefore splits into a dynamic
part that is the same for the whole fragment (c_q * q_base + c_kv * kv_base + ...) and a
compile-time offset per element (c_q * row_off[r] + c_kv * col_off[j]). Converted once per call,
`to_float` of it costs one fp32 add of an immediate per element, and elements that share an
offset (e.g. kv_idx - q_idx along a diagonal) share the value -- in the integer path too, with
everything computed from it (a window compare, a floor division).

Clamping (tile_mods.py): only indices that feed loads are clamped, so the others stay affine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from torch_fa4.mods.graph import INT, ModGraph, ancestors

TILE, ROW, COL, ELEM = 0, 1, 2, 3
LEVEL_NAMES = {TILE: "tile", ROW: "row", COL: "col", ELEM: "elem"}
INPUT_LEVELS = {"b": TILE, "h": TILE, "q_idx": ROW, "kv_idx": COL, "score": ELEM}

EXACT_INT = 2 ** 24  # every integer with |x| <= 2^24 is exactly representable in fp32
MAX_SEQLEN = 2 ** 23  # positions q_idx, kv_idx lie in [0, MAX_SEQLEN)
INT32 = (-(2 ** 31), 2 ** 31 - 1)

# value ranges of int loads by captured-tensor dtype (int64 is narrowed to int32 on load)
_DTYPE_RANGES = {
    "torch.int8": (-128, 127), "torch.uint8": (0, 255), "torch.int16": (-(2 ** 15), 2 ** 15 - 1),
    "torch.int32": INT32, "torch.int64": INT32,
}
# b and h are never bounded by anything the kernel checks: assume only that they are int32 >= 0
INPUT_RANGES = {"q_idx": (0, MAX_SEQLEN - 1), "kv_idx": (0, MAX_SEQLEN - 1), "b": (0, INT32[1]),
                "h": (0, INT32[1])}


def node_levels(graph: ModGraph) -> tuple[int, ...]:
    levels: list[int] = []
    for n in graph.nodes:
        lv = INPUT_LEVELS[n.attr] if n.op == "input" else TILE  # (inputs have no arguments)
        for a in n.args:
            lv |= levels[a]
        levels.append(lv)
    return tuple(levels)


def live_nodes(graph: ModGraph) -> frozenset[int]:
    """Nodes the output depends on (the tracer keeps unused inputs)."""
    return frozenset(ancestors(graph, [graph.output]))


def clamped_inputs(graph: ModGraph) -> frozenset[str]:
    """The index inputs that some load's index depends on: the kernel clamps these (and only these)
    into the sequence so every load stays inside its tensor."""
    roots = [a for i in live_nodes(graph) if graph.nodes[i].op == "load" for a in graph.nodes[i].args]
    cone = ancestors(graph, roots)
    return frozenset(graph.nodes[i].attr for i in cone
                     if graph.nodes[i].op == "input" and graph.nodes[i].attr in ("q_idx", "kv_idx"))


def tile_frontier(graph: ModGraph, levels=None) -> tuple[int, ...]:
    """TILE nodes, other than constants and the inputs b / h, whose values a non-TILE node or the
    output reads: what a kernel computes once per tile of work and keeps in registers."""
    levels = levels or node_levels(graph)
    needed = {a for i in live_nodes(graph) if levels[i] != TILE
              for a in graph.nodes[i].args if levels[a] == TILE}
    if levels[graph.output] == TILE:
        needed.add(graph.output)
    return tuple(sorted(i for i in needed if graph.nodes[i].op not in ("const", "input")))


# ---- integer value ranges ----------------------------------------------------------------------------

def _clip(lo: int, hi: int) -> tuple[int, int]:
    # int32 arithmetic wraps: a range that leaves int32 says nothing
    return (lo, hi) if INT32[0] <= lo and hi <= INT32[1] else INT32


# int op -> the interval of its result from its arguments' intervals (ops not listed: all of int32)
_OP_RANGES = {
    "neg": lambda x: (-x[1], -x[0]),
    "abs": lambda x: (0 if x[0] <= 0 <= x[1] else min(map(abs, x)), max(map(abs, x))),
    "add": lambda x, y: (x[0] + y[0], x[1] + y[1]),
    "sub": lambda x, y: (x[0] - y[1], x[1] - y[0]),
    "mul": lambda x, y: (min(a * b for a in x for b in y), max(a * b for a in x for b in y)),
    "minimum": lambda x, y: (min(x[0], y[0]), min(x[1], y[1])),
    "maximum": lambda x, y: (max(x[0], y[0]), max(x[1], y[1])),
    "where": lambda cond, x, y: (min(x[0], y[0]), max(x[1], y[1])),
    # by a constant divisor > 0 only
    "floordiv": lambda x, y: (x[0] // y[0], x[1] // y[0]) if y[0] == y[1] > 0 else INT32,
    "mod": lambda x, y: (0, y[0] - 1) if y[0] == y[1] > 0 else INT32,
}


def int_ranges(graph: ModGraph) -> tuple[Optional[tuple[int, int]], ...]:
    """Interval [lo, hi] of every int node (None for float / bool nodes), from INPUT_RANGES."""
    out: list = []
    for n in graph.nodes:
        if n.kind != INT:
            r = None
        elif n.op == "input":
            r = INPUT_RANGES[n.attr]
        elif n.op == "const":
            r = (int(n.attr), int(n.attr))
        elif n.op == "load":
            r = _DTYPE_RANGES.get(graph.aux[n.attr].dtype, INT32)
        elif n.op in _OP_RANGES:
            r = _OP_RANGES[n.op](*[out[i] for i in n.args])
        else:
            r = INT32
        out.append(None if r is None else _clip(*r))
    return tuple(out)


def _exact(r: Optional[tuple[int, int]]) -> bool:
    return r is not None and -EXACT_INT <= r[0] and r[1] <= EXACT_INT


# ---- affine forms -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Affine:
    """c_q * q_idx + c_kv * kv_idx + sum(coeff * value of TILE node) + const."""

    q: int = 0
    kv: int = 0
    tile: tuple[tuple[int, int], ...] = ()
    const: int = 0

    def plus(self, other: "Affine", sign: int = 1) -> "Affine":
        terms = dict(self.tile)
        for i, c in other.tile:
            terms[i] = terms.get(i, 0) + sign * c
        return Affine(self.q + sign * other.q, self.kv + sign * other.kv,
                      tuple(sorted((i, c) for i, c in terms.items() if c)), self.const + sign * other.const)

    def scaled(self, k: int) -> "Affine":
        return Affine(self.q * k, self.kv * k, tuple((i, c * k) for i, c in self.tile if c * k), self.const * k)

    def offset(self, row_off: int, col_off: int) -> int:
        """The compile-time part at an element whose positions are the bases plus these offsets."""
        return self.q * row_off + self.kv * col_off


def affine_forms(graph: ModGraph, levels, clamped) -> tuple[Optional[Affine], ...]:
    """The affine form of each int node, or None. Clamped inputs are not affine (min(., last))."""
    out: list = []
    for i, n in enumerate(graph.nodes):
        a = [out[j] for j in n.args]
        f = None
        if n.kind != INT:
            pass
        elif n.op == "const":
            f = Affine(const=int(n.attr))
        elif n.op == "input" and n.attr in ("q_idx", "kv_idx"):
            if n.attr not in clamped:
                f = Affine(q=1) if n.attr == "q_idx" else Affine(kv=1)
        elif levels[i] == TILE:
            f = Affine(tile=((i, 1),))
        elif n.op in ("add", "sub") and a[0] is not None and a[1] is not None:
            f = a[0].plus(a[1], 1 if n.op == "add" else -1)
        elif n.op == "neg" and a[0] is not None:
            f = a[0].scaled(-1)
        elif n.op == "mul" and a[0] is not None and a[1] is not None:
            x, y = a
            if not (y.q or y.kv or y.tile):
                f = x.scaled(y.const)
            elif not (x.q or x.kv or x.tile):
                f = y.scaled(x.const)
        out.append(f)
    return tuple(out)


def _affine_range(f: Affine, ranges) -> tuple[int, int]:
    lo = hi = f.const
    for c, r in ((f.q, INPUT_RANGES["q_idx"]), (f.kv, INPUT_RANGES["kv_idx"])) + tuple(
            (c, ranges[i]) for i, c in f.tile):
        lo += min(c * r[0], c * r[1])
        hi += max(c * r[0], c * r[1])
    return lo, hi


# ---- float forms of int expressions ------------------------------------------------------------------

# How mod_fragment computes the fp32 value of an int node exactly:
#   ("affine",)        convert the fragment-wide dynamic part once, add the element's offset
#   ("convert",)       convert the node's value (at its own level: cheap for TILE and ROW)
#   ("const", value)   an fp32 constant
#   ("op", name)       the same op on the float forms of the arguments (where: on args 1, 2)
FloatForm = tuple


@dataclass(frozen=True)
class HoistPlan:
    levels: tuple[int, ...]
    clamped: frozenset[str]
    ranges: tuple
    affine: tuple
    float_forms: dict  # int node -> FloatForm, for every int node reachable from a rewritten to_float
    rewritten: frozenset[int]  # to_float nodes computed through float_forms instead of an I2F
    tile_nodes: tuple[int, ...]  # tile_frontier


def _float_form(graph: ModGraph, i: int, plan: dict, levels, ranges, affine, allow_affine: bool):
    """Record in `plan` how to compute node i exactly in fp32; False when that is not possible."""
    if i in plan:
        return True
    if not _exact(ranges[i]):
        return False
    n, f = graph.nodes[i], affine[i]
    sub: dict = {}  # the arguments' forms, for ("op", name)
    if n.op == "const":
        form = ("const", float(n.attr))
    elif allow_affine and f is not None and levels[i] != TILE and _exact(_affine_range(f, ranges)):
        form = ("affine",)
    elif levels[i] in (TILE, ROW):  # converting once per tile or row is cheap
        form = ("convert",)
    elif n.op in ("neg", "abs", "add", "sub", "mul", "minimum", "maximum", "where") and all(
            _float_form(graph, a, sub, levels, ranges, affine, allow_affine)
            for a in (n.args[1:] if n.op == "where" else n.args)):
        form = ("op", n.op)
    elif levels[i] == COL:  # still once per column rather than per element
        form, sub = ("convert",), {}
    else:
        return False
    plan.update(sub)
    plan[i] = form
    return True


@functools.lru_cache(maxsize=None)
def hoist_plan(graph: ModGraph, allow_affine: bool = True) -> HoistPlan:
    """Everything mod_fragment needs to emit `graph` on a fragment (once per graph). allow_affine=False
    when the fragment's position offsets are not compile-time constants."""
    levels = node_levels(graph)
    clamped = clamped_inputs(graph)
    ranges = int_ranges(graph)
    affine = affine_forms(graph, levels, clamped)
    forms: dict = {}
    rewritten = set()
    for i in live_nodes(graph):
        x = graph.nodes[i].args[0] if graph.nodes[i].op == "to_float" else None
        if x is None or graph.nodes[x].kind != INT or levels[x] == TILE:
            continue  # (to_float of a TILE value: converted once per tile of work, nothing to gain)
        sub: dict = {}
        # a plain conversion at the node's own level is what the integer path does anyway
        if _float_form(graph, x, sub, levels, ranges, affine, allow_affine) and sub[x] != ("convert",):
            forms.update(sub)
            rewritten.add(i)
    return HoistPlan(levels, clamped, ranges, affine, forms, frozenset(rewritten), tile_frontier(graph, levels))


# ---- scaled affine products and sign knowledge ------------------------------------------------------

def scaled_affine_operands(graph: ModGraph, plan: HoistPlan, i: int, resolve) -> Optional[tuple[int, int]]:
    """(t, x) when float node i is t * to_float(x) (either order) with t a float TILE value (a
    slope, a constant) and x an int node on the exact fp32 path that `resolve(x)` turns into an
    affine form: then t * x = t * base + t * off is one fma per distinct offset. None otherwise."""
    n = graph.nodes[i]
    if n.op != "mul" or n.kind != "float" or plan.levels[i] == TILE:
        return None
    for t, y in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
        if plan.levels[t] != TILE or graph.nodes[t].kind != "float" or y not in plan.rewritten:
            continue
        x = graph.nodes[y].args[0]
        if resolve(x) is not None:
            return t, x
    return None


def sign_split_form(graph: ModGraph, plan: HoistPlan) -> Optional[Affine]:
    """The affine form f of the first t * to_float(abs(f)) in the graph (ALiBi's slope * |q - kv|),
    or None. Where a kernel knows f's sign on a whole fragment, abs(f) is f or -f, affine again,
    and the product becomes one fma per distinct offset (`scaled_affine_operands`); without that
    knowledge it stays an add, an abs and a multiply per offset. Kernels branch on the sign at run
    time (mod_fragment.emit_score_mod): most tiles of a causal or banded walk lie on one side."""
    def abs_of_affine(x):
        if plan.float_forms.get(x) != ("op", "abs"):
            return None
        a = graph.nodes[x].args[0]
        return plan.affine[a] if plan.float_forms.get(a) == ("affine",) else None

    for i in sorted(live_nodes(graph)):
        hit = scaled_affine_operands(graph, plan, i, abs_of_affine)
        if hit is not None:
            return abs_of_affine(hit[1])
    return None


# ---- clamps that saturate on a whole fragment -------------------------------------------------------

# int ops a univariate chain g(f) may use between an affine form f and the clamp on top of it (each
# with at most one constant operand): their breakpoints all lie within the sum of the constants
_CHAIN_OPS = ("abs", "neg", "add", "sub", "minimum", "maximum")


@dataclass(frozen=True)
class SaturationSplit:
    """Int node `node` is g(f) for an affine form f and a piecewise linear g built from abs, neg,
    +- constants and min / max with constants (a clamp of q_idx - kv_idx, of its abs, ...). g is
    constant towards either end: node == value_above wherever f >= above, node == value_below
    wherever f <= below (None: no such side within f's range). On a fragment whose f lies wholly
    on one side the node is a constant and everything computed from it is per fragment."""

    node: int
    form: Affine
    above: Optional[int]
    value_above: int
    below: Optional[int]
    value_below: int


def _chain(graph: ModGraph, plan: HoistPlan, i: int):
    """(affine form f, g as a Python function of f's value, sum of |constants|) when int node i is
    g(f) for a chain of _CHAIN_OPS over one affine, non-TILE node; else None."""
    n = graph.nodes[i]
    if n.kind != INT or plan.levels[i] == TILE:
        return None
    if plan.affine[i] is not None and n.op != "const":
        return plan.affine[i], (lambda x: x), 0
    if n.op not in _CHAIN_OPS:
        return None
    if n.op in ("abs", "neg"):
        inner = _chain(graph, plan, n.args[0])
        if inner is None:
            return None
        f, g, span = inner
        return f, ((lambda x: abs(g(x))) if n.op == "abs" else (lambda x: -g(x))), span
    consts = [k for k, a in enumerate(n.args) if graph.nodes[a].op == "const" and graph.nodes[a].kind == INT]
    if len(consts) != 1:
        return None
    c = int(graph.nodes[n.args[consts[0]]].attr)
    inner = _chain(graph, plan, n.args[1 - consts[0]])
    if inner is None:
        return None
    f, g, span = inner
    op, const_first = n.op, consts[0] == 0
    fn = {"add": lambda x: g(x) + c, "minimum": lambda x: min(g(x), c), "maximum": lambda x: max(g(x), c),
          "sub": (lambda x: c - g(x)) if const_first else (lambda x: g(x) - c)}[op]
    return f, fn, span + abs(c)


def saturation_split(graph: ModGraph, plan: HoistPlan) -> Optional[SaturationSplit]:
    """The outermost clamp of a chain over an affine form that saturates towards an end of the
    form's range (`s - 0.01 * (q_idx - kv_idx).abs().clamp(max=64)`: the clamp is 64 wherever
    q_idx - kv_idx >= 64 or <= -64), or None. The sides are found by evaluating g on every integer
    within its breakpoints (they all lie within the sum of the chain's constants)."""
    live = live_nodes(graph)
    for i in sorted(live, reverse=True):  # the last one in graph order: outermost of nested clamps
        if graph.nodes[i].op not in ("minimum", "maximum"):
            continue
        chain = _chain(graph, plan, i)
        if chain is None:
            continue
        f, g, span = chain
        reach = span + 2  # g is linear beyond +-(span + 1)
        if reach > 1 << 16:  # (a huge constant: not worth the compile-time scan)
            continue
        lo_f, hi_f = _affine_range(f, plan.ranges)
        above = below = None
        v_above, v_below = g(reach), g(-reach)
        if g(reach + 1) == v_above:
            t = reach
            while t - 1 >= -reach and g(t - 1) == v_above:
                t -= 1
            above = t if t <= hi_f else None
        if g(-reach - 1) == v_below:
            t = -reach
            while t + 1 <= reach and g(t + 1) == v_below:
                t += 1
            below = t if t >= lo_f else None
        if above is None and below is None:
            continue
        if not all(_exact((v, v)) for v in (v_above, v_below)):
            continue
        return SaturationSplit(i, f, above, v_above, below, v_below)
    return None
