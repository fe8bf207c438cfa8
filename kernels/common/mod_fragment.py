"""Emit a traced score_mod / mask_mod over a thread's whole score fragment, hoisted by dependence.

`mod_lowering` inlines a graph for one element; here the same ops (through `emit_op`) are emitted
for a (rows, cols) fragment following `mod_hoisting.hoist_plan` (TILE, ROW, COL and ELEM values,
exact int -> float rewrites). Emission is hash-consed, so e.g. kv_idx - q_idx, which repeats along
the fragment's diagonals, is computed once per distinct offset. A tile value times such an affine
expression (ALiBi's slope * (kv_idx - q_idx)) is one fma per distinct offset; under abs,
`emit_score_mod` branches at run time on the expression's sign over the fragment so that the
one-signed sides get the same. Used by the sm90 forward (tile_mods.py) and, over the transposed
S^T fragment, the sm90 backward (bwd_scores.py).

Plain Python helpers called from inside @cute.jit code (like mod_lowering's); graphs and plans are
compile-time constants.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from torch_fa4.kernels.host.mod_hoisting import (COL, ROW, TILE, ancestors, hoist_plan, saturation_split,
                                                   scaled_affine_operands, sign_split_form)
from torch_fa4.kernels.common.mod_lowering import CUTE_OPS, as_kind, emit_nodes, emit_op, select, select_min_max
from torch_fa4.mods.graph import BOOL, FLOAT, ModGraph
from torch_fa4.mods.index_sign import index_wraps


def tile_values(graph: Optional[ModGraph], b, h, aux: Sequence) -> tuple:
    """The values of the graph's tile frontier (mod_hoisting.tile_frontier), e.g. slope[h]: what a
    kernel computes once per tile of work and hands to every FragmentEmitter of that tile."""
    if graph is None:
        return ()
    plan = hoist_plan(graph)
    # all TILE: a TILE node has TILE arguments
    env = emit_nodes(graph, {"b": b, "h": h}, aux, ancestors(graph, plan.tile_nodes))
    return tuple(env[i] for i in plan.tile_nodes)


class FragmentPositions:
    """Where a thread's fragment sits: q_idx of row r is q_base + row_offs[r], kv_idx of column j is
    kv_base + col_offs[j]. Offsets are Python ints when the coordinate layout is static (always for
    the attention kernels' wgmma fragments); otherwise row_offs is None and the positions are read
    per row / column from the coordinate tensor (no affine rewrites then)."""

    def __init__(self, c: cute.Tensor, row0, col0):
        """c: (rows, cols) identity-coordinate view of the fragment; row0 / col0: tile offsets."""
        rows, cols = cute.size(c, mode=[0]), cute.size(c, mode=[1])
        self.rows, self.cols = rows, cols
        base = c[0, 0]
        self.q_base = row0 + base[0]
        self.kv_base = col0 + base[1]
        offs = {(r, j): cute.crd2idx((r, j), c.layout) for r in range(rows) for j in range(cols)}
        self.row_offs, self.col_offs = _separable_offsets(offs, rows, cols)
        # the positions themselves, for the integer path (and clamping)
        self.q_rows = _Lazy(lambda r: row0 + c[r, 0][0])
        self.kv_cols = _Lazy(lambda j: col0 + c[0, j][1])

    @classmethod
    def transposed(cls, c0: cute.Tensor, q_base, kv_base) -> "FragmentPositions":
        """For a (keys, queries) fragment such as the backward's S^T: c0[r, c] = (key offset, query
        offset) from the thread's bases, static. The emitter's rows are c0's columns (queries), its
        columns c0's rows (keys): call value / score with (column, row)."""
        n_keys, n_queries = cute.size(c0, mode=[0]), cute.size(c0, mode=[1])
        offs = {(c, r): (c0[r, c][1], c0[r, c][0]) for r in range(n_keys) for c in range(n_queries)}
        row_offs, col_offs = _separable_offsets(offs, n_queries, n_keys)
        assert row_offs is not None, "the fragment's coordinates are not static (key, query) rows and columns"
        pos = object.__new__(cls)
        pos.rows, pos.cols = n_queries, n_keys
        pos.q_base, pos.kv_base = q_base, kv_base
        pos.row_offs, pos.col_offs = row_offs, col_offs
        pos.q_rows = _Lazy(lambda r: q_base + row_offs[r])
        pos.kv_cols = _Lazy(lambda j: kv_base + col_offs[j])
        return pos

    def fork(self) -> "FragmentPositions":
        """A copy whose positions emitted from now on stay on one side of a run-time branch."""
        other = copy.copy(self)
        other.q_rows, other.kv_cols = self.q_rows.fork(), self.kv_cols.fork()
        return other


def _separable_offsets(offs: dict, rows: int, cols: int):
    """(row_offs, col_offs) when every offs[r, j] is the static pair (row_offs[r], col_offs[j]) --
    rows_cols views keep a row's position independent of the column and vice versa --, else
    (None, None)."""
    if not all(isinstance(o, tuple) and len(o) == 2 and all(type(x) is int for x in o) for o in offs.values()):
        return None, None
    row_offs = tuple(offs[r, 0][0] for r in range(rows))
    col_offs = tuple(offs[0, j][1] for j in range(cols))
    if all(offs[r, j] == (row_offs[r], col_offs[j]) for r in range(rows) for j in range(cols)):
        return row_offs, col_offs
    return None, None


class _Lazy(dict):
    """index -> value, each emitted on first use (unused positions cost no instruction)."""

    def __init__(self, make, values=()):
        super().__init__(values)
        self._make = make

    def __missing__(self, k):
        self[k] = self._make(k)
        return self[k]

    def fork(self) -> "_Lazy":
        return _Lazy(self._make, self)


class FragmentEmitter:
    """One graph emitted over one fragment. `value(i, r, j)` is node i at element (r, j); each node is
    emitted once per distinct (row, col) it depends on, and ops with identical arguments once."""

    def __init__(self, graph: ModGraph, pos: FragmentPositions, b, h, aux: Sequence, tile_vals=None,
                 last_q=None, last_k=None, affine_fma: bool = True):
        """tile_vals: from tile_values() (None: emit TILE nodes here); last_q / last_k: the largest
        valid positions, to clamp indices that feed loads (None: no clamping); affine_fma: tile
        value * affine expression as one fma per distinct offset (`_scaled_affine`), else an add and
        a multiply."""
        self.graph = graph
        # {Affine: +1 or -1}: affine forms known to be >= 0 (+1) or <= 0 (-1) on every element of
        # this fragment (set by `fork` on one side of emit_score_mod's sign branch)
        self.signs: dict = {}
        # {int node: Python int}: nodes known to be this constant on every element of this fragment
        # (set by `fork` on a saturated side of emit_score_mod's clamp branch)
        self.fixed: dict = {}
        self.affine_fma = affine_fma
        self.plan = hoist_plan(graph, pos.row_offs is not None)
        self.wraps = index_wraps(graph)  # negative indices of loads, wrapped as in PyTorch
        self.pos = pos
        self.b, self.h, self.aux = b, h, aux
        self.tile_vals = dict(zip(self.plan.tile_nodes, tile_vals)) if tile_vals is not None else {}
        # indices that feed loads are clamped (tile_mods.py says why); emitted where first used
        self._last = {"q_idx": last_q if "q_idx" in self.plan.clamped else None,
                      "kv_idx": last_k if "kv_idx" in self.plan.clamped else None}
        self._memo, self._cons, self._score, self._fdyn = {}, {}, {}, {}
        inputs = [i for i, n in enumerate(graph.nodes) if n.op == "input" and n.attr == "score"]
        self.score_input = inputs[0] if inputs else None

    # ---- public ------------------------------------------------------------------------------
    def score(self, r: int, j: int, raw, scale=None) -> Float32:
        """score_mod at (r, j) of the score raw * scale (scale None: raw is the score).

        With a scale, the first add / sub of the score becomes one fma(raw, scale, other): a bias
        (ALiBi, tables) then costs no separate multiply per element, and the bias itself, shared
        by elements, stays a value of its own rather than being fused per element."""
        self._score[r, j] = (raw, scale)
        return as_kind(self.value(self.graph.output, r, j), FLOAT)

    def keep(self, r: int, j: int):
        return as_kind(self.value(self.graph.output, r, j), BOOL)

    # ---- emission ----------------------------------------------------------------------------
    def _key(self, i: int, r: int, j: int):
        lv = self.plan.levels[i]
        return (i, r if lv & ROW else None, j if lv & COL else None)

    def _hashcons(self, key_head: tuple, args: list, make):
        key = key_head + tuple(("py", x) if isinstance(x, (int, float, bool)) else id(x) for x in args)
        hit = self._cons.get(key)
        if hit is None:
            hit = (make(), args)  # args kept alive: their ids stay unique while the key exists
            self._cons[key] = hit
        return hit[0]

    def value(self, i: int, r: int, j: int):
        key = self._key(i, r, j)
        if key in self._memo:
            return self._memo[key]
        n = self.graph.nodes[i]
        if i in self.fixed:
            v = as_kind(self.fixed[i], n.kind)
        elif i in self.tile_vals:
            v = self.tile_vals[i]
        elif n.op == "input":
            v = {"score": lambda: self._scaled_score(r, j), "b": lambda: self.b, "h": lambda: self.h,
                 "q_idx": lambda: self.pos.q_rows[r], "kv_idx": lambda: self.pos.kv_cols[j]}[n.attr]()
            last = self._last.get(n.attr)
            v = as_kind(v if last is None else cutlass.min(v, last), n.kind)
        elif i in self.plan.rewritten:
            v = self._float(n.args[0], r, j)
        elif self._affine_int(i):
            v = self._affine_value(i, r, j)
        elif self._fusable_score_add(n, r, j):
            v = self._score_fma(n, r, j)
        elif self._scaled_affine_mul(i) is not None:
            v = self._scaled_affine(i, r, j)
        elif n.op == "div" and n.kind == FLOAT and self.plan.levels[n.args[1]] in (TILE, ROW) \
                and self.plan.levels[i] != self.plan.levels[n.args[1]]:
            v = self._div_by_hoisted(n, r, j)
        else:
            args = [self.value(a, r, j) for a in n.args]
            wraps = self.wraps.get(i, ())
            v = self._hashcons((n.op, n.kind, n.attr if n.op in ("const", "load") else None, wraps), args,
                               lambda: emit_op(n, args, self.aux, wraps))
        self._memo[key] = v
        return v

    def _scaled_score(self, r: int, j: int):
        raw, scale = self._score[r, j]
        return raw if scale is None else raw * scale

    def _fusable_score_add(self, n, r: int, j: int) -> bool:
        """score + other or a difference of the two, for a scaled score (else nothing to fuse)."""
        if n.op not in ("add", "sub") or n.kind != FLOAT or self.score_input is None:
            return False
        return self.score_input in n.args and n.args[0] != n.args[1] and self._score[r, j][1] is not None

    def _score_fma(self, n, r: int, j: int):
        raw, scale = self._score[r, j]
        first = n.args[0] == self.score_input
        other = as_kind(self.value(n.args[1] if first else n.args[0], r, j), FLOAT)
        if n.op == "add":
            return cute.math.fma(raw, scale, other)
        if first:  # score - other
            return cute.math.fma(raw, scale, -other)
        return cute.math.fma(-raw, scale, other)  # other - score

    def _div_by_hoisted(self, n, r: int, j: int) -> Float32:
        """x / y for a divisor that is the same for the whole fragment (or row), e.g. softcap's
        score / cap: the reciprocal once, then per element a multiply and two fmas, branch-free.
        An IEEE division per element costs a range check and a slow-path branch each, which also
        stops the scheduler from interleaving elements."""
        x = as_kind(self.value(n.args[0], r, j), FLOAT)
        y = as_kind(self.value(n.args[1], r, j), FLOAT)
        rcp = self._hashcons(("rcp",), [y], lambda: Float32(1.0) / y)
        return _div_with_reciprocal(x, y, rcp)

    def _float(self, i: int, r: int, j: int) -> Float32:
        """The exact fp32 value of int node i at (r, j), as plan.float_forms says."""
        form = self.plan.float_forms[i]
        kind = form[0]
        if i in self.fixed:
            form = ("const", float(self.fixed[i]))
            kind = "const"
        if kind == "const":
            return self._hashcons(("fconst", form[1]), [], lambda: Float32(form[1]))
        if kind == "convert":
            x = self.value(i, r, j)
            return self._hashcons(("i2f",), [x], lambda: x.to(Float32))
        f = self.resolved_affine(i)
        if f is not None:
            return self._affine_float(f, r, j)
        op = form[1]
        n = self.graph.nodes[i]
        a = [self.value(n.args[0], r, j)] if op == "where" else []  # the condition stays bool
        a += [self._float(x, r, j) for x in n.args[len(a):]]
        return self._hashcons(("f" + op,), a, lambda: _exact_float_op(op, a))

    def _affine_int(self, i: int) -> bool:
        """An int node of the fragment (not TILE) that is affine in the positions, with static offsets:
        emitted as its fragment-wide part plus the element's offset, so elements that share an
        offset (kv_idx - q_idx along a diagonal) share the value -- and, by hash-consing, every op
        computed from it (a compare, a floor division, a table load)."""
        return (self.pos.row_offs is not None and self.plan.levels[i] != TILE
                and self.graph.nodes[i].kind == "int" and self.plan.affine[i] is not None
                and self.graph.nodes[i].op != "input")

    def _affine_value(self, i: int, r: int, j: int):
        f = self.plan.affine[i]
        return self._at_offset(f, r, j, "iadd_imm", [self.form_base(f)], lambda base, off: base + off)

    def _at_offset(self, f, r: int, j: int, tag: str, args: list, make):
        """make(args[-1], off) for f's compile-time offset off at (r, j), once per distinct offset;
        args[-1] itself where off is 0 (args: what the value depends on)."""
        off = f.offset(self.pos.row_offs[r], self.pos.col_offs[j])
        if off == 0:
            return args[-1]
        return self._hashcons((tag, off), args, lambda: make(args[-1], off))

    def form_base(self, f):
        """An affine form's value at the fragment's offsets (0, 0), once per call and per form."""
        if f not in self._fdyn:
            acc = None
            terms = [(f.q, self.pos.q_base), (f.kv, self.pos.kv_base)]
            terms += [(c, self.value(t, 0, 0)) for t, c in f.tile]
            for c, x in terms:
                if c == 0:
                    continue
                t = x if c == 1 else (-x if c == -1 else x * c)
                acc = t if acc is None else acc + t
            if acc is None:
                acc = Int32(f.const)
            elif f.const:
                acc = acc + f.const
            self._fdyn[f] = as_kind(acc, "int")
        return self._fdyn[f]

    def _form_base_float(self, f) -> Float32:
        """fp32 of an affine form's fragment-wide part, converted once per call."""
        base = self.form_base(f)
        return self._hashcons(("i2f",), [base], lambda: base.to(Float32))

    def _affine_float(self, f, r: int, j: int) -> Float32:
        """The exact fp32 value of affine form f at (r, j): the converted base plus the element's
        offset, one add per distinct offset."""
        return self._at_offset(f, r, j, "fadd_imm", [self._form_base_float(f)],
                               lambda base, off: base + Float32(off))

    # ---- sign knowledge and scaled affine values -------------------------------------------------
    def resolved_affine(self, i: int):
        """The affine form whose fp32 value equals int node i's on this fragment, or None: an affine
        node itself, or abs / neg of one whose sign this emitter knows (abs(x) = x where x >= 0).
        Only for nodes on the exact fp32 path (plan.float_forms)."""
        form = self.plan.float_forms.get(i)
        if form == ("affine",):
            return self.plan.affine[i]
        if form not in (("op", "neg"), ("op", "abs")):
            return None
        f = self.resolved_affine(self.graph.nodes[i].args[0])
        if f is None or form == ("op", "neg"):
            return None if f is None else f.scaled(-1)
        sign = self.signs.get(f) or -(self.signs.get(f.scaled(-1)) or 0)
        return f.scaled(sign) if sign else None

    def _scaled_affine_mul(self, i: int):
        """(tile value node, int node) when float node i is t * to_float(x) with t the same for the
        whole tile of work and x resolved to an affine form; else None."""
        if not self.affine_fma:
            return None
        return scaled_affine_operands(self.graph, self.plan, i, self.resolved_affine)

    def _scaled_affine(self, i: int, r: int, j: int) -> Float32:
        """t * x for x = base + off: fma(t, off, t * base), one fma per distinct offset instead of
        an add and a multiply (ALiBi's slope * (kv_idx - q_idx)). base and off are exact integers
        in fp32, so this differs from the plain product by one rounding of t * base (~1 ulp)."""
        t_node, x_node = self._scaled_affine_mul(i)
        f = self.resolved_affine(x_node)
        t = as_kind(self.value(t_node, r, j), FLOAT)
        base = self._form_base_float(f)
        tb = self._hashcons(("fmul",), [t, base], lambda: t * base)
        return self._at_offset(f, r, j, "scaled_affine", [t, tb],
                               lambda tb, off: cute.math.fma(t, Float32(off), tb))

    def fork(self, signs: dict, fixed: Optional[dict] = None) -> "FragmentEmitter":
        """An emitter for one side of a run-time branch: the values emitted so far (which dominate
        the branch) are shared, new ones stay on that side; `signs` adds sign knowledge, `fixed`
        nodes known to be constants."""
        other = copy.copy(self)
        other.signs = {**self.signs, **signs}
        other.fixed = {**self.fixed, **(fixed or {})}
        other.pos = self.pos.fork()
        other._memo, other._cons, other._fdyn = dict(self._memo), dict(self._cons), dict(self._fdyn)
        return other


def emit_score_mod(em: FragmentEmitter, s: cute.Tensor, scale=None):
    """s[r, j] = score_mod(s[r, j] * scale) over the (rows, cols) fragment s.

    Where the graph clamps a function of an affine form f so that it saturates towards an end
    (mod_hoisting.saturation_split: `(q_idx - kv_idx).abs().clamp(max=64)`), the code first
    branches at run time on f's range over this thread's fragment: wholly on a saturated side,
    the clamp is a constant and whatever is computed from it is computed once (a relative bias
    costs one fma per element there, as a constant bias does); otherwise the general code below.
    Under a causal mask all but the tiles near the diagonal are saturated.
    """
    split = saturation_split(em.graph, em.plan) if em.pos.row_offs is not None else None
    if split is None:
        _emit_score_mod_signed(em, s, scale)
        return
    offs = [split.form.offset(ro, co) for ro in em.pos.row_offs for co in em.pos.col_offs]
    base = em.form_base(split.form)
    values = {1: split.value_above, -1: split.value_below}

    def emit(side):
        if side:
            _emit_scores(em.fork({}, {split.node: values[side]}), s, scale)
        else:
            _emit_score_mod_signed(em, s, scale)

    _branch_on_saturation(base + min(offs), base + max(offs), split.above, split.below, emit)


def _emit_score_mod_signed(em: FragmentEmitter, s: cute.Tensor, scale=None):
    """emit_score_mod's code where no clamp saturates.

    Where the graph multiplies a tile value by |f| for an affine f (mod_hoisting.sign_split_form:
    ALiBi written with abs), the code branches at run time on f's sign over this thread's
    fragment: f >= 0 everywhere, f <= 0 everywhere, or mixed. On the one-signed sides |f| is
    affine and t * |f| one fma per distinct offset (an add and a multiply otherwise). Under a
    causal mask or a band every tile but the diagonal ones is one-signed; threads of a warp
    straddling the diagonal run two sides (the branch costs a compare or two)."""
    form = sign_split_form(em.graph, em.plan) if em.pos.row_offs is not None and em.affine_fma else None
    if form is None:
        _emit_scores(em, s, scale)
        return
    offs = [form.offset(ro, co) for ro in em.pos.row_offs for co in em.pos.col_offs]
    base = em.form_base(form)
    _branch_on_sign(base + min(offs), base + max(offs),
                    lambda sign: _emit_scores(em.fork({form: sign} if sign else {}), s, scale))


def emit_mask_mod(em: FragmentEmitter, s: cute.Tensor):
    """s[r, j] = -inf where mask_mod is False, over the (rows, cols) fragment s."""
    _each(s, lambda r, j: cutlass.select_(em.keep(r, j), s[r, j], -Float32.inf))


def _emit_scores(em: FragmentEmitter, s: cute.Tensor, scale):
    _each(s, lambda r, j: em.score(r, j, s[r, j], scale))


def _each(s: cute.Tensor, value):
    """s[r, j] = value(r, j) over the (rows, cols) fragment s, row by row."""
    for r in range(cute.size(s, mode=[0])):
        for j in range(cute.size(s, mode=[1])):
            s[r, j] = value(r, j)


@cute.jit
def _branch_on_saturation(lo: Int32, hi: Int32, above: cutlass.Constexpr, below: cutlass.Constexpr,
                          emit: cutlass.Constexpr):
    """emit(+1) where lo >= above, emit(-1) where hi <= below, emit(0) otherwise (a run-time
    branch; a side whose bound is None is never taken)."""
    if const_expr(above is not None and below is not None):
        if lo >= above:
            emit(1)
        elif hi <= below:
            emit(-1)
        else:
            emit(0)
    elif const_expr(above is not None):
        if lo >= above:
            emit(1)
        else:
            emit(0)
    else:
        if hi <= below:
            emit(-1)
        else:
            emit(0)


@cute.jit
def _branch_on_sign(lo: Int32, hi: Int32, emit: cutlass.Constexpr):
    """emit(+1) where lo >= 0, emit(-1) where hi <= 0, emit(0) otherwise (a run-time branch)."""
    if lo >= 0:
        emit(1)
    elif hi <= 0:
        emit(-1)
    else:
        emit(0)


def _div_with_reciprocal(x, y, rcp):
    """RN(x / y) from rcp = RN(1 / y): q0 = x * rcp is within an ulp, the fma gives the exact
    remainder x - q0 * y, and one correction step rounds correctly (Markstein's theorem; checked
    exhaustively enough in tests/test_mods_cute.py). When q0 is not finite (y = 0, x or y infinite,
    overflow) it already is the IEEE result (inf, or NaN for 0/0 and inf/inf). Quotients in the
    subnormal range may be off by an ulp: far below anything a score or a bias resolves."""
    q0 = x * rcp
    rem = cute.math.fma(-q0, y, x)
    q1 = cute.math.fma(rem, rcp, q0)
    return select(cute.math.abs(q0) < Float32.inf, q1, q0, FLOAT)


def _exact_float_op(op: str, a: list):
    """An op of the exact fp32 path (mod_hoisting float_forms): the operands are integers in fp32,
    never NaN, so min / max need one compare."""
    if op in ("minimum", "maximum"):
        return select_min_max(a[0], a[1], FLOAT, op == "minimum")
    return CUTE_OPS[op](FLOAT, *a)
