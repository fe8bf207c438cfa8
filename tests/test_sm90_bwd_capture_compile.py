"""CPU: the sm90 backward variants that accumulate the gradients of captured tensors
(BwdConfig.capture_slots, kernels/sm90/bwd_scores.CapturedGrads) compile for sm_90a, and the plan
that groups equal addresses (captured_loads) classifies each load as it should.

The compiled variants keep the frozen variant's matrix products (the same HGMMA count), add the
gradients by fp32 reductions (REDG.E.ADD.F32) after warp shuffles where lanes share addresses, and
stay inside the mods variants' local-memory budget."""

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from sass import sass_of, spills_between_matmuls  # noqa: E402
from torch_fa4.call import AttentionCall  # noqa: E402


@pytest.fixture(autouse=True)
def _private_mod_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "torch_fa4_cache"))


S = 256


def _relative_table():
    table = torch.zeros(4, 257, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(q_idx - kv_idx, -128, 128) + 128]
    return score_mod, (table,)


def _tanh_alibi_key_bias():
    slopes, bias = torch.zeros(4, requires_grad=True), torch.zeros(1, 4, S, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / 8.0 + bias[b, h, kv_idx]) * 8.0 - slopes[h] * (q_idx - kv_idx).abs()
    return score_mod, (slopes, bias)


def _gathered_and_temperature():
    temp, table = torch.ones((), requires_grad=True), torch.zeros(4, 7, requires_grad=True)
    bucket = torch.arange(S, dtype=torch.int32) % 7

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * temp + table[h, bucket[kv_idx]] * table[h, bucket[q_idx]]
    return score_mod, (temp, table)


def _per_query_diagonal():
    bias, table = torch.zeros(1, 4, S, requires_grad=True), torch.zeros(4, 2 * S - 1, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * bias[b, h, q_idx] + table[h, q_idx - kv_idx + S - 1] + table[h, 2 * q_idx - kv_idx + S]
    return score_mod, (bias, table)


def _prepared(make):
    from torch_fa4.mods.prepare import prepare
    from torch_fa4.mods.registry import lookup

    score_mod, learned = make()
    key, aux = prepare(score_mod, None)
    slots = tuple(i for i, t in enumerate(aux) if any(t is x for x in learned))
    assert len(slots) == len(learned)
    return key, lookup(key), aux, slots


def test_captured_loads_plan():
    """How each load's equal addresses are grouped: one per tile (slopes[h], a 0-d temperature),
    per query or key (lanes of one column / row), per diagonal (table[h, clamp(q - kv) + R], also
    unclamped), per element (an index through another load, 2 q - kv)."""
    from torch_fa4.kernels.sm90.bwd_scores import (DIAGONAL_LANES, KEY_LANES, OWN_LANE, QUERY_LANES,
                                                   TILE_LANES, captured_loads)

    def plan(make):
        _, mods, aux, slots = _prepared(make)
        return [(tuple(aux[slots[p.buffer]].shape), p.lanes, p.unclamped)
                for p in captured_loads(mods.load_derivatives, slots)]

    assert plan(_relative_table) == [((4, 257), DIAGONAL_LANES, True)]
    assert sorted(plan(_tanh_alibi_key_bias), key=str) == sorted(
        [((1, 4, S), KEY_LANES, True), ((4,), TILE_LANES, True)], key=str)
    # two loads of `table` through `bucket` (per key and per query, clamped positions) and `temp`
    assert sorted(plan(_gathered_and_temperature), key=str) == sorted(
        [((), TILE_LANES, True), ((4, 7), KEY_LANES, False), ((4, 7), QUERY_LANES, False)], key=str)
    assert sorted(plan(_per_query_diagonal), key=str) == sorted(
        [((1, 4, S), QUERY_LANES, True), ((4, 2 * S - 1), DIAGONAL_LANES, True),
         ((4, 2 * S - 1), OWN_LANE, True)], key=str)


def _call(mods, key, aux, d=128, hq=4, hkv=2, dtype=torch.bfloat16, varlen=False, **kw):
    q = torch.empty(*((S,) if varlen else (1, S)), hq, d, dtype=dtype)
    k = torch.empty(*((S,) if varlen else (1, S)), hkv, d, dtype=dtype)
    cu = torch.tensor([0, S], dtype=torch.int32) if varlen else None
    return AttentionCall(q=q, k=k, v=k, scale=d ** -0.5, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S,
                         max_seqlen_k=S, mod_key=key, mods=mods, aux_tensors=tuple(aux), **kw)


CASES = {
    # the benchmark's table: diagonal groups, the persistent D128 kernel (64 queries per step)
    "relative_table_d128_causal_gqa": (_relative_table, dict(causal=True)),
    # per tile and per key, a derivative that is not constant; D64: 128 queries per step
    "tanh_alibi_key_bias_d64_window_fp16": (_tanh_alibi_key_bias,
                                            dict(d=64, dtype=torch.float16, window_left=64, window_right=16)),
    # per element through a load, a 0-d tensor; packed varlen rows, softcap
    "gathered_temperature_d128_varlen_softcap": (_gathered_and_temperature, dict(varlen=True, causal=True,
                                                                                 softcap=20.0)),
    # per query, diagonal and per element in one mod; the narrow (64-key) variant
    "per_query_diagonal_d256": (_per_query_diagonal, dict(d=256, causal=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_capture_variant_compiles(case, tmp_path):
    from torch_fa4.kernels.sm90 import bwd

    make, kw = CASES[case]
    key, mods, aux, slots = _prepared(make)
    call = _call(mods, key, aux, **kw)
    assert bwd.captured_grad_reason(call, slots, False) is None
    frozen = bwd.variant_key(call, False)
    assert frozen.capture_slots == ()  # the dQ / dK / dV-only variant is unchanged
    variant = dataclasses.replace(frozen, capture_slots=slots)
    for name, v in (("capture", variant), ("frozen", frozen)):
        (tmp_path / name).mkdir()
        bwd.compile_variant(v, dump_dir=str(tmp_path / name))
    sass, plain = sass_of(tmp_path / "capture"), sass_of(tmp_path / "frozen")
    assert sass.count("HGMMA.") == plain.count("HGMMA.")
    reds = sass.count("REDG.E.ADD.F32")
    assert reds > plain.count("REDG.E.ADD.F32"), "no fp32 reductions added"
    assert sass.count("SHFL.") > plain.count("SHFL."), "no lanes combined before the reductions"
    if case.startswith("relative_table"):  # groups landing on the warp's first address: one sum per warp
        assert sass.count("VOTE.ALL") > plain.count("VOTE.ALL")
    # nothing spilled in the step loop (groups are reduced as soon as complete: only those in
    # progress hold registers); outside it the mods variants' budget (tests/test_sm90_bwd_compile.py)
    assert spills_between_matmuls(sass) == 0
    assert sass.count("LDL") + sass.count("STL") <= 64


@pytest.mark.parametrize("queries", [64, 128, 32])  # a warpgroup's S^T columns: tile_m, or its half (narrow)
def test_diagonal_lane_chains_add_each_element_once(queries):
    """The DIAGONAL_LANES reduction (bwd_scores._add_group) on a model of one warp's S^T fragment
    (wgmma accumulator: lane 4 g + t holds keys g, g + 8 and queries 2 t + e + 8 j): per lane, sums
    per q - kv; shfl.down by 9 and 18 where the partner lane (g + 2, t + 1) exists; the chains'
    heads (t = 0 or g < 2) add. Every element must reach its own diagonal's address exactly once."""
    import random

    rng = random.Random(queries)
    elems = {lane: [(g + 8 * i, 2 * t + e + 8 * j)
                    for i in range(2) for j in range(queries // 8) for e in range(2)]
             for lane in range(32) for g, t in [divmod(lane, 4)]}
    value = {(lane, kq): rng.random() for lane in elems for kq in elems[lane]}
    want = {}
    for (lane, (key, q)), x in value.items():
        want[q - key] = want.get(q - key, 0.0) + x
    # per lane: slot = the diagonal's static offset from the lane's base 2 t - g (the same set on every lane)
    slots = {lane: {} for lane in elems}
    for (lane, (key, q)), x in value.items():
        g, t = divmod(lane, 4)
        o = (q - 2 * t) - (key - g)
        slots[lane][o] = slots[lane].get(o, 0.0) + x
    assert len({frozenset(s) for s in slots.values()}) == 1

    def down(v, by, valid):
        return {lane: {o: v[lane][o] + (v[lane + by][o] if valid(*divmod(lane, 4)) else 0.0) for o in v[lane]}
                for lane in v}

    v = down(slots, 9, lambda g, t: t < 3 and g < 6)
    v = down(v, 18, lambda g, t: t < 2 and g < 4)
    got = {}
    for lane in elems:
        g, t = divmod(lane, 4)
        if t == 0 or g < 2:
            for o, x in v[lane].items():
                got[2 * t - g + o] = got.get(2 * t - g + o, 0.0) + x
    assert got.keys() == want.keys()
    assert all(abs(got[d] - want[d]) < 1e-9 for d in want)


def test_capture_variant_with_block_mask_compiles(tmp_path):
    """A relative table under a document block mask: the sparse walk's partial tiles (mask_mod)
    and full tiles both add the table's gradient."""
    from torch_fa4.kernels.sm90 import bwd
    from torch_fa4.mods import create_block_mask
    from torch_fa4.mods.prepare import prepare
    from torch_fa4.mods.registry import lookup

    doc = torch.zeros(S, dtype=torch.int32)
    table = torch.zeros(4, 257, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(q_idx - kv_idx, -128, 128) + 128]

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    bm = create_block_mask(mask_mod, None, None, S, S, device="cpu", BLOCK_SIZE=128)
    key, aux = prepare(score_mod, mask_mod)
    mods = lookup(key)
    slot = next(i for i, t in enumerate(aux) if t is table)
    call = _call(mods, key, aux, block_mask=tuple(bm.as_tensors()), block_mask_q=128, block_mask_kv=128)
    assert bwd.captured_grad_reason(call, (slot,), False) is None
    variant = dataclasses.replace(bwd.variant_key(call, False), capture_slots=(slot,))
    assert variant.sparse is not None
    bwd.compile_variant(variant, dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    assert sass.count("REDG.E.ADD.F32") > 0 and "VOTE.ALL" in sass
    assert spills_between_matmuls(sass) == 0
    assert sass.count("LDL") + sass.count("STL") <= 64
