"""CPU: how mods are lowered to CuTe DSL.

- The hoisting plan (kernels/host/mod_hoisting.py, pure Python): the level of every graph node
  (tile / row / col / elem), which indices are clamped, integer ranges, and when an int -> float
  conversion is rewritten in fp32 -- with the exactness of each rewrite checked numerically in
  numpy float32 at the extremes of the assumed position range.
- The lowered code compiles (sm_90a cubins, no GPU needed): per element and per fragment (the
  probes of tests/_mod_probes.py), reading each captured tensor as often as the plan says,
  with the int -> float conversions gone where the plan rewrites them; and in the sm90 forward
  kernel, ALiBi adds no per-element I2F and no spills.
"""

import functools
import glob
import random
import re

import numpy as np
import pytest
import torch

from _mod_cases import alibi_abs, cases

from torch_fa4 import mods as M
from torch_fa4.kernels.host import mod_hoisting as H
from torch_fa4.mods.prepare import trace_graphs


def _score_graph(fn, **captured):
    mods, _ = trace_graphs(functools.partial(fn, **captured) if captured else fn, None)
    return mods.score_graph


def _mask_graph(fn):
    mods, _ = trace_graphs(None, fn)
    return mods.mask_graph


def _node(graph, op, attr=None):
    hits = [i for i, n in enumerate(graph.nodes) if n.op == op and (attr is None or n.attr == attr)]
    assert len(hits) == 1, (op, hits, graph.text())
    return hits[0]


def _describe(graph, plan) -> str:
    """The graph listing annotated with each node's level and float form (for failure messages)."""
    lines = graph.text().splitlines()
    out = [lines[0]]
    for i, line in enumerate(lines[1:-1]):
        extra = f"  [{H.LEVEL_NAMES[plan.levels[i]]}]"
        if i in plan.float_forms:
            extra += f" float:{plan.float_forms[i][0]}"
        if i in plan.rewritten:
            extra += " (exact fp32)"
        out.append(line + extra)
    out.append(lines[-1])
    return "\n".join(out) + "\n"


# ---- hoisting plan (pure Python) -------------------------------------------------------------------

def test_levels_of_each_class():
    """One node of each level: slope[h] per tile, a q-only chain per row, a kv-only load per
    column, and what mixes q and kv (or reads score) per element."""
    bias = torch.randn(4)
    flags = torch.rand(64) > 0.5

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[h] + (q_idx // 7) * 0.5 + flags[kv_idx] * (kv_idx - q_idx)

    g = _score_graph(mod)
    lv = H.node_levels(g)
    name = {i: H.LEVEL_NAMES[lv[i]] for i in range(len(g.nodes))}
    assert name[_node(g, "input", "b")] == name[_node(g, "input", "h")] == "tile"
    assert name[_node(g, "input", "q_idx")] == "row" and name[_node(g, "input", "kv_idx")] == "col"
    assert name[_node(g, "input", "score")] == "elem"
    loads = [i for i, n in enumerate(g.nodes) if n.op == "load"]
    assert sorted(name[i] for i in loads) == ["col", "tile"]
    assert name[_node(g, "floordiv")] == "row"
    assert name[_node(g, "sub")] == "elem" and name[g.output] == "elem"
    # only the slope-like load is kept across key tiles (b, h and constants need no register)
    assert H.tile_frontier(g) == tuple(i for i in loads if lv[i] == H.TILE)


def test_level_is_the_union_of_the_arguments():
    for name, (score_mod, mask_mod) in cases().items():
        mods, _ = trace_graphs(score_mod, mask_mod)
        for g in (mods.score_graph, mods.mask_graph):
            lv = H.node_levels(g)
            for i, n in enumerate(g.nodes):
                if n.op != "input":
                    want = 0
                    for a in n.args:
                        want |= lv[a]
                    assert lv[i] == want, (name, i)


def test_only_indices_that_feed_loads_are_clamped():
    alibi = _score_graph(M.alibi(M.alibi_slopes(4)))
    assert H.clamped_inputs(alibi) == frozenset()  # slope[h]: no index load
    doc = _mask_graph(M.document_mask(torch.zeros(8, dtype=torch.int32)))
    assert H.clamped_inputs(doc) == {"q_idx", "kv_idx"}
    flags = torch.rand(8) > 0.5
    g = _mask_graph(lambda b, h, q_idx, kv_idx: flags[kv_idx] & (q_idx >= kv_idx))
    assert H.clamped_inputs(g) == {"kv_idx"}
    # through arithmetic: table[h, clamp(q - kv + 4, 0, 8)] reads at an index derived from both
    bucketed, _ = cases()["bucketed_chunked"]
    assert H.clamped_inputs(_score_graph(bucketed)) == {"q_idx", "kv_idx"}


def test_int_ranges():
    i8 = torch.zeros(4, dtype=torch.int8)

    def mod(score, b, h, q_idx, kv_idx):
        return score + ((kv_idx - q_idx) // 16) + i8[h] + (q_idx % 5)

    g = _score_graph(mod)
    r = H.int_ranges(g)
    P = H.MAX_SEQLEN - 1
    assert r[_node(g, "sub")] == (-P, P)
    assert r[_node(g, "floordiv")] == ((-P) // 16, P // 16)  # floor, as torch
    assert r[_node(g, "load")] == (-128, 127)
    assert r[_node(g, "mod")] == (0, 4)
    assert r[_node(g, "input", "score")] is None  # float nodes have no int range


def _rewritten(fn, **kw):
    g = _score_graph(fn, **kw)
    plan = H.hoist_plan(g)
    return g, plan


def test_rewrites_where_exact_and_only_there():
    slopes = torch.rand(4)
    i8 = torch.zeros(64, dtype=torch.int8)
    i32 = torch.zeros(64, dtype=torch.int32)
    off16 = torch.zeros(4, dtype=torch.int16)
    yes = {
        "alibi": (M.alibi(slopes), "affine"),
        "abs": (alibi_abs(slopes), "op"),
        "tile_term": (lambda s, b, h, q, k: s + (k - q + off16[h]).float(), "affine"),
        "scaled": (lambda s, b, h, q, k: s + ((k - q) * -2).float(), "affine"),
        "min_max": (lambda s, b, h, q, k: s + torch.clamp(k - q, min=-64, max=64).float(), "op"),
        "int8_tables": (lambda s, b, h, q, k: s + (i8[q] - i8[k]).float(), "op"),
    }
    no = {
        "sum_too_large": lambda s, b, h, q, k: s + (q + k + k).float(),  # up to 3 * 2^23: not exact
        "scaled_too_large": lambda s, b, h, q, k: s + ((k - q) * 3).float(),  # up to 3 * 2^23
        "floordiv": lambda s, b, h, q, k: s + ((k - q) // 2).float(),
        "int32_tables": lambda s, b, h, q, k: s + (i32[q] - i32[k]).float(),  # any int32: not exact
    }
    for name, (fn, form) in yes.items():
        g, plan = _rewritten(fn)
        to_float = [i for i, n in enumerate(g.nodes) if n.op == "to_float" and plan.levels[n.args[0]] != H.TILE
                    and g.nodes[n.args[0]].kind == "int"]
        assert to_float and all(i in plan.rewritten for i in to_float), (name, _describe(g, plan))
        x = g.nodes[to_float[0]].args[0]
        assert plan.float_forms[x][0] == form, (name, _describe(g, plan))
    for name, fn in no.items():
        g, plan = _rewritten(fn)
        assert not plan.rewritten, (name, _describe(g, plan))


def test_scaled_affine_products_and_the_sign_split():
    """t * to_float(x) with t a tile value and x affine is found (one fma per distinct offset), under
    abs only once a sign is known; sign_split_form names the affine form under abs to branch on."""
    slopes = torch.rand(4)
    g, plan = _rewritten(M.alibi(slopes))  # slopes[h] * (kv_idx - q_idx)
    mul = _node(g, "mul")
    t, x = H.scaled_affine_operands(g, plan, mul, lambda i: plan.affine[i])
    assert g.nodes[t].op == "load" and plan.affine[x] == H.Affine(q=-1, kv=1)
    assert H.sign_split_form(g, plan) is None  # nothing under abs: no branch needed

    g, plan = _rewritten(alibi_abs(slopes))
    mul, ab = _node(g, "mul"), _node(g, "abs")
    assert H.scaled_affine_operands(g, plan, mul, lambda i: plan.affine[i]) is None  # abs: not affine
    assert H.sign_split_form(g, plan) == H.Affine(q=1, kv=-1)
    known = H.scaled_affine_operands(g, plan, mul, lambda i: H.Affine(q=1, kv=-1) if i == ab else None)
    assert known is not None and known[1] == ab

    # a per-element multiplier is no tile value: no split, no fma rewrite
    g, plan = _rewritten(lambda s, b, h, q, k: s * torch.abs(q - k).float())
    assert H.sign_split_form(g, plan) is None


def _int_value(g, i, env):
    n = g.nodes[i]
    a = [_int_value(g, x, env) for x in n.args]
    if n.op == "input":
        return env[n.attr]
    if n.op == "const":
        return int(n.attr)
    if n.op == "load":
        return env["loads"][i]
    return {"neg": lambda: -a[0], "abs": lambda: abs(a[0]), "add": lambda: a[0] + a[1], "sub": lambda: a[0] - a[1],
            "mul": lambda: a[0] * a[1], "minimum": lambda: min(a), "maximum": lambda: max(a),
            "where": lambda: a[1] if a[0] else a[2], "lt": lambda: a[0] < a[1], "gt": lambda: a[0] > a[1],
            "floordiv": lambda: a[0] // a[1]}[n.op]()


def _float_value(g, plan, i, env, base_env):
    """The fp32 value mod_lowering computes for int node i, in numpy float32 (as the kernel)."""
    form = plan.float_forms[i]
    f32 = np.float32
    if form[0] == "const":
        return f32(form[1])
    if form[0] == "convert":
        return f32(_int_value(g, i, env))
    if form[0] == "affine":
        aff = plan.affine[i]
        base = f32(_int_value(g, i, base_env))  # the fragment-wide part: the value at the base positions
        off = aff.offset(env["q_idx"] - base_env["q_idx"], env["kv_idx"] - base_env["kv_idx"])
        return base + f32(off)
    n = g.nodes[i]
    if form[1] == "where":
        c = _int_value(g, n.args[0], env)
        return _float_value(g, plan, n.args[1 if c else 2], env, base_env)
    a = [_float_value(g, plan, x, env, base_env) for x in n.args]
    return {"neg": lambda: -a[0], "abs": lambda: np.abs(a[0]), "add": lambda: a[0] + a[1], "sub": lambda: a[0] - a[1],
            "mul": lambda: a[0] * a[1], "minimum": lambda: min(a), "maximum": lambda: max(a)}[form[1]]()


def test_rewritten_conversions_are_exact_at_the_range_limits():
    """Evaluate each rewrite in float32 (numpy) the way the kernel does -- the fragment base
    converted once plus the element's offset -- and require it to equal float32(int value) at
    positions spanning the whole assumed range [0, MAX_SEQLEN)."""
    P = H.MAX_SEQLEN - 1
    off16 = torch.zeros(4, dtype=torch.int16)
    i8 = torch.zeros(64, dtype=torch.int8)
    fns = [
        M.alibi(torch.rand(4)),
        alibi_abs(torch.rand(4)),
        lambda s, b, h, q, k: s + (k - q + off16[h]).float(),
        lambda s, b, h, q, k: s + torch.clamp(k - q, min=-64, max=64).float(),
        lambda s, b, h, q, k: s + torch.where(q > k, q - k, (k - q) * -1).float(),
        lambda s, b, h, q, k: s + (i8[q] - i8[k] + q).float(),
    ]
    rng = random.Random(torch.initial_seed())  # conftest's fresh per-test seed
    extremes = [0, 1, 2, P - 200, P - 1, P, 2 ** 23, 2 ** 23 + 1] + [rng.randrange(P + 1) for _ in range(20)]
    for fn in fns:
        g, plan = _rewritten(fn)
        assert plan.rewritten, _describe(g, plan)
        for t in plan.rewritten:
            x = g.nodes[t].args[0]
            for qb in extremes:
                for kb in extremes:
                    for ro, co in ((0, 0), (8, 0), (0, 121), (8, 57)):
                        q, k = min(qb + ro, P), min(kb + co, P)
                        ro, co = q - qb, k - kb
                        loads = {i: rng.randrange(-128, 128) for i, n in enumerate(g.nodes) if n.op == "load"}
                        for hv in (0, 3):
                            env = {"q_idx": q, "kv_idx": k, "b": 0, "h": hv, "loads": loads}
                            base_env = dict(env, q_idx=qb, kv_idx=kb)
                            got = _float_value(g, plan, x, env, base_env)
                            want = np.float32(_int_value(g, x, env))
                            assert got == want, (_describe(g, plan), q, k, got, want)


def _rn32(value):
    """Round an exact rational to the nearest float32, ties to even (no double rounding)."""
    from fractions import Fraction

    c = np.float32(float(value))
    best = None
    for cand in (np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))):
        if np.isfinite(cand):
            key = (abs(Fraction(float(cand)) - value), int(cand.view(np.uint32)) & 1)
            if best is None or key < best[0]:
                best = (key, cand)
    return best[1]


def test_division_by_a_hoisted_divisor_rounds_correctly():
    """mod_fragment divides by a per-tile divisor (softcap's score / cap, a per-head temperature)
    as q0 = x * RN(1/y), rem = fma(-q0, y, x), q = fma(rem, RN(1/y), q0). Modelled here with exact
    rationals for the fmas, it must equal the IEEE quotient for every x (normal range)."""
    from fractions import Fraction

    def fma(a, b, c):
        return _rn32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))

    rng = random.Random(torch.initial_seed())
    divisors = [20.0, 3.0, 7.0, 0.1, 1 / 3, 30.0, 50.0, 1e-3, 12345.678] + [rng.uniform(0.01, 100) for _ in range(12)]
    for y in map(np.float32, divisors):
        rcp = np.float32(1) / y
        for _ in range(150):
            x = np.float32(rng.uniform(-1, 1) * 2.0 ** rng.randint(-40, 40))
            q0 = np.float32(x * rcp)
            q = fma(fma(-q0, y, x), rcp, q0)
            assert q == x / y, (float(x), float(y), float(q), float(x / y))


def test_plan_without_static_offsets_never_uses_affine():
    g = _score_graph(M.alibi(torch.rand(4)))
    plan = H.hoist_plan(g, allow_affine=False)
    assert all(f[0] != "affine" for f in plan.float_forms.values())


# ---- compiled code (CuTe DSL on CPU) ---------------------------------------------------------------

def _needs_dsl():
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")


@pytest.mark.parametrize("name", ["alibi_doc_causal", "bias_bf16_doc2d", "transcendental_bool_table"])
def test_probe_kernel_compiles(name, tmp_path):
    _needs_dsl()
    from _mod_probes import compile_probe

    score_mod, mask_mod = cases()[name]
    mods, aux = trace_graphs(score_mod, mask_mod)
    compile_probe(mods.score_graph, mods.mask_graph, arch="sm_90a", dump_dir=str(tmp_path))
    assert glob.glob(str(tmp_path / "*.cubin")), "no cubin written"
    ptx = open(glob.glob(str(tmp_path / "*.ptx"))[0]).read()
    loads = len(re.findall(r"\bld\.global", ptx))
    graph_loads = sum(1 for g in (mods.score_graph, mods.mask_graph) for n in g.nodes if n.op == "load")
    assert loads == 1 + graph_loads, "expected the score load plus one load per captured-tensor access"


def test_cute_lowering_covers_the_op_set():
    _needs_dsl()
    from torch_fa4.kernels.common import mod_lowering
    from torch_fa4.mods.graph import OPS

    assert set(mod_lowering.CUTE_OPS) == set(OPS)


def test_identity_grad_detected():
    _needs_dsl()
    from torch_fa4.kernels.common import mod_lowering

    alibi, _ = cases()["alibi_doc_causal"]
    bucketed, _ = cases()["bucketed_chunked"]
    softcap, _ = cases()["softcap_window"]
    for mod, identity in ((alibi, True), (bucketed, True), (softcap, False)):
        mods, _ = trace_graphs(mod, None)
        assert mod_lowering.mod_graph_is_identity_grad(mods.score_grad_graph) is identity


def _fragment_loads(graph, rows, cols):
    """Global loads of captured tensors one fragment needs under the plan."""
    lv = H.node_levels(graph)
    per = {H.TILE: 1, H.ROW: rows, H.COL: cols, H.ELEM: rows * cols}
    return sum(per[lv[i]] for i in H.live_nodes(graph) if graph.nodes[i].op == "load")


@pytest.mark.parametrize("name", ["alibi_doc_causal", "bias_bf16_doc2d"])
def test_tile_probe_hoists_loads_and_conversions(name, tmp_path):
    """Through mod_fragment: a (2, 8) fragment reads slope[h] once, doc[q] per row, doc[kv] per
    column, and converts ALiBi's kv_idx - q_idx once (the fragment base), not per element."""
    _needs_dsl()
    from _mod_probes import ModTileProbeKernel, compile_probe

    score_mod, mask_mod = cases()[name]
    mods, _ = trace_graphs(score_mod, mask_mod)
    compile_probe(mods.score_graph, mods.mask_graph, arch="sm_90a", dump_dir=str(tmp_path), tile=True)
    ptx = open(glob.glob(str(tmp_path / "*.ptx"))[0]).read()
    rows, cols = ModTileProbeKernel.rows, ModTileProbeKernel.cols
    want = rows * cols + _fragment_loads(mods.score_graph, rows, cols) + _fragment_loads(mods.mask_graph, rows, cols)
    assert len(re.findall(r"\bld\.global", ptx)) == want
    if name == "alibi_doc_causal":
        assert len(re.findall(r"cvt\.rn\.f32\.s32", ptx)) == 1


def _ptx_ops(ptx, *ops):
    return sum(len(re.findall(rf"^\s*(?:@%?\w+\s+)?{re.escape(op)}\b", ptx, re.M)) for op in ops)


def test_tile_probe_alibi_bias_is_one_fma_per_offset(tmp_path):
    """slope * (kv_idx - q_idx) on a (2, 8) fragment: nine distinct offsets, each one fma from
    slope * base (no fp32 add and multiply per offset); with abs, the run-time sign branch leaves
    abs only on the mixed-sign side (once per offset), the one-signed sides being fmas."""
    _needs_dsl()
    from _mod_probes import compile_probe

    slopes = torch.rand(3)
    for name, mod in (("lib", M.alibi(slopes)), ("abs", alibi_abs(slopes))):
        mods, _ = trace_graphs(mod, None)
        d = tmp_path / name
        d.mkdir()
        compile_probe(mods.score_graph, None, arch="sm_90a", dump_dir=str(d), tile=True)
        ptx = open(glob.glob(str(d / "*.ptx"))[0]).read()
        if name == "lib":
            assert _ptx_ops(ptx, "add.f32", "sub.f32", "mul.f32") <= 3, ptx.count("\n")
        else:
            assert _ptx_ops(ptx, "abs.f32") == 9  # the mixed side only
            assert _ptx_ops(ptx, "mul.f32") <= 9 + 2  # the mixed side's products, t * base per side


def test_tile_probe_compiles_every_case():
    _needs_dsl()
    from _mod_probes import compile_probe

    for name in ("softcap_window", "bucketed_chunked", "transcendental_bool_table"):
        score_mod, mask_mod = cases()[name]
        mods, _ = trace_graphs(score_mod, mask_mod)
        assert compile_probe(mods.score_graph, mods.mask_graph, arch="sm_90a", tile=True) is not None


def _sm90_fwd_sass(tmp_path, score_mod, name):
    from sass import sass_of
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90 import fwd_host
    from torch_fa4.mods import registry

    q = torch.empty(1, 256, 4, 128, dtype=torch.bfloat16)
    kw = {}
    if score_mod is not None:
        key, aux = M.prepare(score_mod, None)
        kw = dict(mod_key=key, mods=registry.lookup(key), aux_tensors=tuple(aux))
    call = AttentionCall(q=q, k=q, v=q, scale=128 ** -0.5, **kw)
    d = tmp_path / name
    d.mkdir()
    fwd_host.compile_fwd(fwd_host.default_config(call), dump_dir=str(d))
    return sass_of(d)


def _count(sass, *opcodes):
    return sum(len(re.findall(rf"\b{op}(\.[A-Z0-9.]+)?\s", sass)) for op in opcodes)


def test_sm90_forward_alibi_has_no_per_element_conversion(tmp_path):
    """ALiBi in the real forward kernel: the int -> float conversions of kv_idx - q_idx are gone
    (per element they would sit on the MUFU pipe) and nothing spills."""
    _needs_dsl()
    plain = _sm90_fwd_sass(tmp_path, None, "plain")
    alibi = _sm90_fwd_sass(tmp_path, M.alibi(M.alibi_slopes(4)), "alibi")
    i2f_plain, i2f_alibi = _count(plain, "I2F", "I2FP"), _count(alibi, "I2F", "I2FP")
    assert i2f_alibi <= i2f_plain + 4, (i2f_plain, i2f_alibi)  # one per key tile (+ the peeled first)
    assert _count(alibi, "STL", "LDL") <= _count(plain, "STL", "LDL")
