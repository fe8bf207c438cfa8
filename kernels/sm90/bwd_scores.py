"""The sm90 backward's element-wise step: P^T from S^T and the LSE, dS^T from P^T, dP^T and dPsum,
with softcap, score_mod (and its traced derivative), mask_mod and the causal / window / length
limits applied where a tile needs them.

Captured gradients (BwdConfig.capture_slots; the definition is torch_fa4/mods/capture_grad.py):
for each load of a captured tensor that wants a gradient, dS at the mod's output, P (dP - dPsum),
times d score_mod / d (loaded value) (mods.derivative.load_derivatives, emitted with the score
over the same fragment) is added into an fp32 buffer laid out like the tensor, at the element
the load read. Equal addresses are reduced before memory is touched (CapturedGrads): in registers
over a thread's elements whose index values are one hash-consed value (a diagonal of a relative
table, a row or column of a per-query / per-key bias, the whole fragment for slopes[h]), then by
shuffles across the lanes that share them (captured_loads classifies each load), then one
red.global.add.f32 per address and lane left; groups whose every lane lands on the warp's first
address (a clamped table's saturated ends) join one running sum per warp and step. Index values
come from unclamped positions where no load feeds them (so they stay affine and group), clamped
into the tensor at the end: only elements past the sequence, whose dS is 0, can land outside it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, const_expr

from ..common import masking
from ..common import mod_lowering as mods_dsl
from ..common.mod_fragment import FragmentEmitter, FragmentPositions
from ..common.mod_lowering import as_kind, select
from torch_fa4.mods.graph import FLOAT

LOG2_E = math.log2(math.e)


class BwdScores:
    """P / dS methods of Sm90AttentionBackward (a mixin: they read its configuration)."""

    def _column_stats(self, s_stat, cS, stage, S):
        """This thread's per-query statistics (LSE or dPsum), one per column of S, from shared
        memory into registers."""
        t_q, c0 = cS[1], cS[3]
        return [s_stat[t_q + c0[0, c][1], stage] for c in range(cute.size(S, mode=[1]))]

    @cute.jit
    def _p_and_ds(self, S, dP, at, lse_vals=None, limits: cutlass.Constexpr = None):
        """P^T in place of S^T (masked, softcapped); with dP given, dS^T in place of dP^T too.

        Only tiles that cross a mask boundary pay for the per-element test; the mask_mod runs on
        every tile of a dense walk, and on the partial tiles only of a block-sparse walk.
        limits (walks without a block mask or mask_mod): None tests here whether this tile
        crosses a limit; True / False say that it does / does not (split_mask_loops).
        at: (cS, sLSE, sDp, stage, row0, key0, seqlen_q, seqlen_k, diag, window_left, window_right,
        scale, scale_log2, softcap_val, mod_ctx) of the step (bwd_consumer._step)."""
        if const_expr(self.mask_graph is not None and not self.sparse):
            self._p_and_ds_tile(S, dP, at, True, True, lse_vals)
        elif const_expr(self.sparse):
            partial = at[-1][4]
            if partial:
                self._p_and_ds_tile(S, dP, at, True, True, lse_vals)
            else:
                self._p_and_ds_limits(S, dP, at, lse_vals)
        elif const_expr(limits is None):
            self._p_and_ds_limits(S, dP, at, lse_vals)
        else:
            self._p_and_ds_tile(S, dP, at, limits, False, lse_vals)

    @cute.jit
    def _p_and_ds_limits(self, S, dP, at, lse_vals=None):
        """P (and dS) with the length / causal / window limits only, tested where a tile crosses.
        _unmasked_query_tiles solves these same tests for the query-tile index: change both
        together."""
        tm, tn = self.tile_m, self.tile_n
        _, _, _, _, row0, key0, seqlen_q, seqlen_k, diag, window_left, window_right = at[:11]
        if const_expr(self.varlen or self.mask_k or self.has_right or self.has_left):
            crosses = Boolean(False)
            if const_expr(self.varlen):
                crosses = crosses | (row0 + tm > seqlen_q)
            if const_expr(self.mask_k):
                crosses = crosses | (key0 + tn > seqlen_k)
            if const_expr(self.has_right):
                crosses = crosses | (key0 + tn - 1 > row0 + diag + window_right)
            if const_expr(self.has_left):
                crosses = crosses | (key0 < row0 + tm - 1 + diag - window_left)
            if crosses:
                self._p_and_ds_tile(S, dP, at, True, False, lse_vals)
            else:
                self._p_and_ds_tile(S, dP, at, False, False, lse_vals)
        else:
            self._p_and_ds_tile(S, dP, at, False, False, lse_vals)

    @cute.jit
    def _unmasked_query_tiles(self, n_block, seqlen_q, seqlen_k, diag, window_left, window_right):
        """[lo, hi): the query tiles whose step crosses none of the limits _p_and_ds_limits tests
        for key tile n_block, from the same inequalities solved for the tile index m (row0 = m *
        tile_m). Every query tile below lo crosses the causal / right-window limit (or, with a
        partial key tile, every tile does: lo = hi = huge); every one from hi up crosses the
        left-window or the sequence-length limit."""
        tm, tn = self.tile_m, self.tile_n
        key0 = n_block * tn
        lo = Int32(0)
        hi = Int32(0x3FFFFFFF)
        if const_expr(self.has_right):
            # unmasked iff key0 + tn - 1 <= m * tm + diag + window_right
            x = key0 + tn - 1 - diag - window_right
            lo = cutlass.select_(x > 0, (x + tm - 1) // tm, Int32(0))
        if const_expr(self.has_left):
            # unmasked iff m * tm <= key0 - tm + 1 - diag + window_left
            y = key0 - tm + 1 - diag + window_left
            hi = cutlass.select_(y < 0, Int32(0), y // tm + 1)
        if const_expr(self.varlen):
            hi = cutlass.min(hi, seqlen_q // tm)  # unmasked iff m * tm + tm <= seqlen_q
        if const_expr(self.mask_k):
            partial_keys = key0 + tn > seqlen_k
            lo = cutlass.select_(partial_keys, Int32(0x3FFFFFFF), lo)
        return lo, hi

    @cute.jit
    def _p_and_ds_tile(self, S, dP, at, masked: cutlass.Constexpr, use_mask_mod: cutlass.Constexpr,
                       lse_vals=None):
        (cS, sLSE, sDp, stage, row0, key0, seqlen_q, seqlen_k, diag, window_left, window_right, scale,
         scale_log2, softcap_val, mod_ctx) = at
        t_key, t_q, t_rel, c0 = cS
        n_cols = cute.size(S, mode=[1])
        # The limits relative to this thread's first element: element (r, c) is key
        # key0 + t_key + dr, query row row0 + t_q + dc with static dr, dc (c0).
        lim_q = seqlen_q - row0 - t_q  # dc < lim_q: row inside the sequence
        lim_k = seqlen_k - key0 - t_key  # dr < lim_k: key inside the sequence
        rel = (row0 + diag - key0) + t_rel
        lim_right = rel + window_right  # dr - dc <= lim_right
        lim_left = rel - window_left  # dr - dc >= lim_left
        em = None
        if const_expr(self.score_graph is not None):
            # the score_mod's values for this thread's S^T fragment (keys along rows, queries along
            # columns), hoisted per query, key or distinct offset as in the forward
            # (kernels/common/mod_fragment); indices that feed a captured tensor's load are clamped
            pos = FragmentPositions.transposed(c0, row0 + t_q, key0 + t_key)
            # with captured gradients, the graph that also holds the loads' indices and
            # derivatives (its output is the score_mod's): one emission serves both
            graph = self.capture_graph if const_expr(self.captured) else self.score_graph
            last_q, last_k = cutlass.max(seqlen_q - 1, 0), cutlass.max(seqlen_k - 1, 0)
            em = FragmentEmitter(graph, pos, mod_ctx[0], mod_ctx[1], mod_ctx[2], None, last_q, last_k)
        captured = None
        if const_expr(self.captured):
            assert dP is not None, "captured gradients need dS: P and dS in one pass"
            captured = CapturedGrads(self.captured, em, (pos, *mod_ctx[:3], last_q, last_k), mod_ctx[5],
                                     not self.softcap and self.grad_graph is None,
                                     element_order(n_cols, cute.size(S, mode=[0])))
        for c in cutlass.range_constexpr(n_cols):
            dc = c0[0, c][1]
            m_local = t_q + dc
            lse2 = lse_vals[c] if const_expr(lse_vals is not None) else sLSE[m_local, stage]
            i = row0 + m_local
            dpsum = Float32(0.0)
            if const_expr(dP is not None):
                dpsum = sDp[m_local, stage]
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                dr = c0[r, c][0]
                j = key0 + t_key + dr
                x = S[r, c]
                grad_factor = Float32(1.0)
                if const_expr(self.softcap):
                    t = cute.math.tanh(x * scale / softcap_val, fastmath=True)
                    x = t * softcap_val * LOG2_E
                    grad_factor = 1.0 - t * t
                else:
                    x = x * scale_log2
                if const_expr(self.score_graph is not None):
                    # score_mod works in natural units on the scaled (softcapped) score; its
                    # derivative, taken at that same score, joins the chain rule for dS.
                    b, h, score_aux = mod_ctx[0], mod_ctx[1], mod_ctx[2]
                    s_in = x * (1.0 / LOG2_E)
                    # the emitter's rows are queries (this fragment's columns), its columns keys
                    if const_expr(self.softcap):
                        x = em.score(c, r, s_in) * LOG2_E
                    else:  # score * scale fused into the mod's first add (a bias: one fma)
                        x = em.score(c, r, S[r, c], scale) * LOG2_E
                    if const_expr(self.grad_graph is not None):
                        # Clamped like the mask_mod's below: a table read past the sequence could
                        # give inf / NaN, and the factor multiplies dS even where P is 0.
                        grad_factor = grad_factor * mods_dsl.score_grad_value(
                            self.grad_graph, s_in, b, h, cutlass.min(i, seqlen_q - 1),
                            cutlass.min(j, seqlen_k - 1), score_aux)
                p = cute.math.exp2(x - lse2, fastmath=True)
                # i < seqlen_q, j < seqlen_k, i + diag - window_left <= j <= i + diag + window_right
                visible = masking.visible(dc, dr, lim_q if const_expr(self.varlen) else None,
                                          lim_k if const_expr(self.mask_k) else None,
                                          lim_right if const_expr(self.has_right) else None,
                                          lim_left if const_expr(self.has_left) else None)
                if const_expr(use_mask_mod):
                    b, h, mask_aux = mod_ctx[0], mod_ctx[1], mod_ctx[3]
                    # Rows / keys past the sequence (the padded tail of the last tile, a block-mask
                    # row reaching past Sq) have P = 0 or zero operands whatever the mask says;
                    # clamping keeps the mask_mod's tensor reads inside their rows.
                    i_in = cutlass.min(i, seqlen_q - 1)
                    j_in = cutlass.min(j, seqlen_k - 1)
                    visible = visible & mods_dsl.mask_mod_value(self.mask_graph, b, h, i_in, j_in, mask_aux)
                if const_expr(masked):
                    p = Float32(cutlass.select_(visible, p, Float32(0.0)))  # a select, not an scf.if
                S[r, c] = p
                if const_expr(dP is not None):
                    ds = p * (dP[r, c] - dpsum)  # dS at the mod's output
                    if const_expr(captured is not None):
                        captured.element(r, c, ds)
                    dP[r, c] = ds * grad_factor
        if const_expr(captured is not None):
            captured.finish()


# ---- gradients of captured tensors (BwdConfig.capture_slots) ---------------------------------------
# Which lanes of a warp hold the same addresses of a load, from the wgmma accumulator layout: lane
# 4 g + t holds keys g (+ 8, + 16 per warp) and queries 2 t (+ 1, + 8 j) of S^T, the same static
# offsets from those bases on every lane.
TILE_LANES = "tile"  # index per (b, h): the whole warp adds to one address
QUERY_LANES = "query"  # index of the query only: lanes g = 0..7 of one t share theirs (xor 4, 8, 16)
KEY_LANES = "key"  # index of the key only: lanes t = 0..3 of one g share theirs (xor 1, 2)
# index a function of c (q_idx - kv_idx) (+ per-tile values): lanes (g, t) and (g + 2, t + 1) share
DIAGONAL_LANES = "diagonal"
OWN_LANE = "own"  # anything else: every lane adds its own


class CapturedLoad(NamedTuple):
    """One load of a captured tensor whose gradient the kernel accumulates (CapturedGrads)."""

    buffer: int  # position of its slot in BwdConfig.capture_slots: the gradient buffer
    index: tuple  # the LoadDerivatives graph's nodes of its index values, one per dimension
    nonneg: tuple  # per index: provably >= 0 (no wrap of negative indices)
    derivative: int  # the node of d score_mod / d (the loaded value)
    lanes: str  # *_LANES: how lanes share its addresses
    # index values from unclamped positions (no load among their inputs): equal along a diagonal,
    # so they group; else the clamped positions' values (a load must stay inside its tensor)
    unclamped: bool


def captured_loads(derivs, slots: tuple) -> tuple[CapturedLoad, ...]:
    """The loads of `derivs` (mods.derivative.LoadDerivatives) of the captured tensors at `slots`,
    planned for the kernel (CapturedGrads)."""
    from torch_fa4.kernels.host.mod_hoisting import ancestors, int_ranges, node_levels
    from torch_fa4.mods.index_sign import nonnegative_nodes

    graph = derivs.graph
    levels = node_levels(graph)
    ranges = int_ranges(graph)  # (clamp(q_idx - kv_idx, -R, R) + R: never negative)
    nonneg = nonnegative_nodes(graph) | {i for i, r in enumerate(ranges) if r is not None and r[0] >= 0}
    forms = _unclamped_affine(graph)
    found = []
    for load in derivs.loads:
        if load.slot not in slots:
            continue
        cone = ancestors(graph, list(load.index))
        level = 0
        for i in load.index:
            level |= levels[i]
        lanes = {0: TILE_LANES, 1: QUERY_LANES, 2: KEY_LANES}.get(level)  # (mod_hoisting's TILE, ROW, COL)
        if lanes is None:
            lanes = DIAGONAL_LANES if all(_of_diagonals(graph, forms, i) for i in load.index) else OWN_LANE
        unclamped = not any(graph.nodes[i].op == "load" for i in cone)
        found.append(CapturedLoad(slots.index(load.slot), load.index, tuple(i in nonneg for i in load.index),
                                  load.derivative, lanes, unclamped))
    return tuple(found)


def _unclamped_affine(graph):
    from torch_fa4.kernels.host.mod_hoisting import affine_forms, node_levels

    return affine_forms(graph, node_levels(graph), frozenset())


def _of_diagonals(graph, forms, i: int) -> bool:
    """Whether node i reads q_idx and kv_idx only through affine forms c (q_idx - kv_idx) + ...:
    then it is equal on elements whose (q_idx - kv_idx) is."""
    f = forms[i]
    if f is not None:
        return f.q == -f.kv
    n = graph.nodes[i]
    if n.op == "input":
        return n.attr not in ("q_idx", "kv_idx", "score")
    return all(_of_diagonals(graph, forms, a) for a in n.args)


def index_emitter(graph, pos, b, h, aux) -> FragmentEmitter:
    """An emitter of `graph` whose positions are not clamped, so that affine indices (q_idx - kv_idx)
    stay affine and equal offsets share one value: for index values without loads among their
    inputs (CapturedLoad.unclamped)."""
    import dataclasses

    from torch_fa4.kernels.host.mod_hoisting import hoist_plan

    em = FragmentEmitter(graph, pos, b, h, aux)
    em.plan = dataclasses.replace(hoist_plan(graph), clamped=frozenset(), affine=_unclamped_affine(graph))
    return em


def element_order(n_cols: int, n_rows: int) -> list:
    """The (r, c) order in which _p_and_ds_tile visits a fragment's elements."""
    return [(r, c) for c in range(n_cols) for r in range(n_rows)]


class CapturedGrads:
    """Per (query tile, key tile) step: dS at the mod's output times d score_mod / d (loaded value),
    summed in registers over the elements whose index values are one (hash-consed) value, then
    across the lanes that share addresses (*_LANES), then one fp32 reduction (red.global.add) per
    address and lane left. Built per _p_and_ds_tile call (trace time) for its element order;
    `element` per score element as its dS is formed. A group is reduced right after its last
    element (lanes converged: every element of the fragment is straight-line code), so only the
    groups in progress hold registers: one per query column finishes with its column, a diagonal
    within a few columns."""

    def __init__(self, loads, em, fragment, bufs, ds_is_dp: bool, order):
        """em: the (clamped) emitter of the score; fragment: its (positions, b, h, score_aux, last_q,
        last_k);
        ds_is_dp: dS at the mod's output is what dP^T's registers keep (no softcap or score_mod
        factor); order: the (r, c) elements in the order `element` will see them."""
        self.loads, self.em, self.bufs = loads, em, bufs
        # Where the derivative is a constant (bias tables) and dS stays in dP^T's registers anyway,
        # a group's sum is formed when it is reduced; else as the elements come (each product dead
        # at once).
        graph = em.graph
        self.deferred = [ds_is_dp and graph.nodes[ld.derivative].op == "const" for ld in loads]
        # The groups, from emitters whose values only name them (equal index values are one
        # hash-consed value) and are never used, so they cost nothing; the addresses come from
        # `iem` (or the score's own emitter) when a group is reduced.
        pos, b, h, aux, last_q, last_k = fragment
        kem = {True: index_emitter(graph, pos, b, h, aux),
               False: FragmentEmitter(graph, pos, b, h, aux, None, last_q, last_k)}
        self.iem = index_emitter(graph, pos, b, h, aux)
        self.key = {}  # (load, r, c) -> its group
        self.last = {}  # (load, group) -> its last element
        for n, load in enumerate(loads):
            for r, c in order:
                key = tuple(id(kem[load.unclamped].value(i, c, r)) for i in load.index)
                self.key[n, r, c] = key
                self.last[n, key] = (r, c)
        self.groups = {}  # (load, group) -> [(r, c) of its first element, its dS list or running sum]
        self.warp_sums = {}  # load -> [the warp's first offset, running sum, whether any group joined]

    def element(self, r: int, c: int, ds):
        """Element (r, c) of S^T (the emitters' (c, r)) with dS `ds`."""
        for n, load in enumerate(self.loads):
            key = self.key[n, r, c]
            group = self.groups.get((n, key))
            if self.deferred[n]:
                if group is None:
                    group = self.groups[n, key] = [(r, c), [ds]]
                else:
                    group[1].append(ds)
            else:
                x = ds * as_kind(self.em.value(load.derivative, c, r), FLOAT)
                if group is None:
                    group = self.groups[n, key] = [(r, c), x]
                else:
                    group[1] = group[1] + x
            if self.last[n, key] == (r, c):
                self._reduce(n, load, *self.groups.pop((n, key)))

    def _reduce(self, n: int, load, first, v):
        r, c = first
        if self.deferred[n]:
            total = v[0]
            for ds in v[1:]:
                total = total + ds
            v = total * as_kind(self.em.value(load.derivative, c, r), FLOAT)
        source = self.iem if load.unclamped else self.em
        offset = self._offset(load, [source.value(i, c, r) for i in load.index])
        buf = self.bufs[load.buffer]
        lane = cute.arch.lane_idx()
        if load.lanes == TILE_LANES:
            for off in (16, 8, 4, 2, 1):
                v = v + cute.arch.shuffle_sync_bfly(v, offset=off)
            _red_where(lane == 0, buf.iterator + offset, v)
        elif load.lanes == QUERY_LANES:
            for off in (16, 8, 4):
                v = v + cute.arch.shuffle_sync_bfly(v, offset=off)
            _red_where(lane < 4, buf.iterator + offset, v)
        elif load.lanes == KEY_LANES:
            for off in (2, 1):
                v = v + cute.arch.shuffle_sync_bfly(v, offset=off)
            _red_where(lane % 4 == 0, buf.iterator + offset, v)
        else:
            # Where every lane's group lands on the warp's first address (a clamped relative
            # table far from the diagonal: every element reads its end), the group joins one
            # running sum per warp, reduced once at `finish`: same-address reductions from every
            # group of every lane would queue at one L2 address. Else per group: see _add_group.
            if n not in self.warp_sums:
                self.warp_sums[n] = [cute.arch.shuffle_sync(offset, 0), Float32(0.0), Boolean(False)]
            ws = self.warp_sums[n]
            same = cute.arch.vote_all_sync(offset == ws[0])
            ws[1] = ws[1] + select(same, v, 0.0, FLOAT)
            ws[2] = ws[2] | same
            _add_group(same, buf.iterator + offset, v, load.lanes == DIAGONAL_LANES)

    def finish(self):
        """The warps' running sums (see _reduce), once every element was seen."""
        lane = cute.arch.lane_idx()
        for n, (first_offset, v, used) in self.warp_sums.items():
            _add_warp_sum(used, self.bufs[self.loads[n].buffer].iterator + first_offset, v, lane)

    def _offset(self, load, index):
        """The element offset of `index` in the load's buffer. PyTorch's negative indices wrap;
        indices from unclamped positions are kept inside the tensor: only elements past the
        sequence, whose dS is 0, can land outside it."""
        buf = self.bufs[load.buffer]
        coord = []
        for d, x in enumerate(index):
            size = buf.shape[d]
            x = as_kind(x, "int")
            if not load.nonneg[d]:
                x = select(x < 0, x + size, x, "int")
            if load.unclamped:
                x = cutlass.min(cutlass.max(x, 0), size - 1)
            coord.append(x)
        if len(coord) == 0:
            coord = [Int32(0)]  # a 0-d tensor travels as shape (1,)
        return cute.crd2idx(coord[0] if len(coord) == 1 else tuple(coord), buf.layout)


def _red(ptr, v):
    cute.arch.red(ptr, v, op="add", dtype=Float32, sem="relaxed", scope="gpu")


@cute.jit
def _red_where(pred, ptr, v):
    """*ptr += v (fp32 reduction in global memory) on the lanes where pred holds."""
    if pred:
        _red(ptr, v)


@cute.jit
def _add_group(skip, ptr, v, diagonal: cutlass.Constexpr):
    """A group's sum v into *ptr unless `skip` (warp-uniform): every lane its own, or (diagonal)
    combined along the chains of lanes (g, t), (g + 2, t + 1), ..., which hold the same addresses
    (a function of q_idx - kv_idx: lane 4 g + t's first query is 2 t, its first key g); lanes + 9
    and + 18 hold this lane's, and the chain's head (t = 0 or g < 2) adds the chain's sum."""
    if not skip:
        if const_expr(diagonal):
            lane = cute.arch.lane_idx()
            g, t = lane // 4, lane % 4
            down = cute.arch.shuffle_sync_down(v, offset=9)
            v = v + select((t < 3) & (g < 6), down, 0.0, FLOAT)
            down = cute.arch.shuffle_sync_down(v, offset=18)
            v = v + select((t < 2) & (g < 4), down, 0.0, FLOAT)
            if (t == 0) | (g < 2):
                _red(ptr, v)
        else:
            _red(ptr, v)


@cute.jit
def _add_warp_sum(used, ptr, v, lane):
    """The warp's sum of v into *ptr (one lane's reduction), where `used` (warp-uniform)."""
    if used:
        for off in cutlass.range_constexpr(5):
            v = v + cute.arch.shuffle_sync_bfly(v, offset=16 >> off)
        if lane == 0:
            _red(ptr, v)
