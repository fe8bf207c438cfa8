"""CPU: mods that are causal, a sliding window or a tanh softcap run as the built-in arguments
(torch_fa4/mods/idioms.py), exactly where they mean the same, and never where they do not."""

import math

import pytest
import torch

import torch_fa4
from naive import naive_attention, rel_error
from torch_fa4 import api
from torch_fa4.mods import idioms
from torch_fa4.mods.prepare import trace_graphs

INF = math.inf


def _band(mask_mod):
    return idioms.mask_band(trace_graphs(None, mask_mod)[0].mask_graph)


def _cap(score_mod):
    return idioms.score_softcap(trace_graphs(score_mod, None)[0].score_graph)


@pytest.mark.parametrize("mask_mod, band", [
    (lambda b, h, q, kv: q >= kv, (0, INF)),
    (lambda b, h, q, kv: kv <= q, (0, INF)),
    (lambda b, h, q, kv: q - kv >= 0, (0, INF)),
    (lambda b, h, q, kv: q > kv, (1, INF)),  # near miss of causal: a band, but not the diagonal's
    (lambda b, h, q, kv: (q >= kv) & (q - kv <= 256), (0, 256)),
    (lambda b, h, q, kv: (q >= kv) & (q - kv < 256), (0, 255)),  # off by one: 255, not 256
    (lambda b, h, q, kv: (q - kv).abs() <= 100, (-100, 100)),
    (lambda b, h, q, kv: (kv - q).abs() < 8, (-7, 7)),
    (lambda b, h, q, kv: 64 >= (q - kv).abs(), (-64, 64)),
    (lambda b, h, q, kv: 2 * (q - kv) <= 5, (-INF, 2)),
    (lambda b, h, q, kv: q == kv, (0, 0)),
    (lambda b, h, q, kv: (q >= kv) & (q < kv), None),  # empty
    (lambda b, h, q, kv: (q >= kv) | (q < 5), None),
    (lambda b, h, q, kv: (q - kv).abs() >= 4, None),
    (lambda b, h, q, kv: q + kv >= 3, None),
    (lambda b, h, q, kv: q * 2 >= kv, None),
    (lambda b, h, q, kv: (q >= kv) & (h == 0), None),
    (lambda b, h, q, kv: (q >= kv) & (b < 2), None),
    (lambda b, h, q, kv: q // 128 >= kv // 128, None),
])
def test_mask_bands(mask_mod, band):
    assert _band(mask_mod) == band


def test_mask_bands_with_captured_tensors_are_not_recognised():
    doc = torch.zeros(64, dtype=torch.int32)
    assert _band(lambda b, h, q, kv: (q >= kv) & (doc[q] == doc[kv])) is None
    limit = torch.tensor(5)
    assert _band(lambda b, h, q, kv: q - kv <= limit) is None


@pytest.mark.parametrize("score_mod, cap", [
    (lambda s, b, h, q, kv: 30 * torch.tanh(s / 30), 30.0),
    (lambda s, b, h, q, kv: torch.tanh(s / 50.0) * 50.0, 50.0),
    (lambda s, b, h, q, kv: torch.tanh(s * 0.1) * 10, 10.0),
    (lambda s, b, h, q, kv: 30 * torch.tanh(s / 31), 0.0),
    (lambda s, b, h, q, kv: 30 * torch.tanh(s / 30) + 1, 0.0),
    (lambda s, b, h, q, kv: -30 * torch.tanh(s / -30), 0.0),
    (lambda s, b, h, q, kv: 30 * torch.tanh(q / 30), 0.0),
    (lambda s, b, h, q, kv: s, 0.0),
])
def test_score_softcaps(score_mod, cap):
    assert _cap(score_mod) == cap


@pytest.mark.parametrize("sq, sk, wl, wr, band, want", [
    (100, 100, -1, -1, (0, INF), (-1, 0)),
    (100, 100, -1, -1, (0, 31), (31, 0)),
    (100, 100, -1, -1, (-7, 7), (7, 7)),
    (100, 300, -1, -1, (0, INF), None),  # top-left causal with more keys: not bottom-right's
    (300, 100, -1, -1, (0, INF), (-1, 200)),
    (100, 100, 10, 0, (0, INF), (10, 0)),  # the call's own window and the mask's together
    (100, 100, -1, 0, (-5, 20), (20, 0)),
    (100, 100, -1, -1, (1, INF), None),
    (100, 100, 3, 3, (5, INF), None),  # nothing visible
])
def test_window_for(sq, sk, wl, wr, band, want):
    assert idioms.window_for(band, sq, sk, wl, wr) == want


def _qkv(sq=200, sk=200, dtype=torch.float32):
    q = torch.randn(2, sq, 4, 64, dtype=dtype)
    k, v = (torch.randn(2, sk, 2, 64, dtype=dtype) for _ in range(2))
    return q, k, v


CASES = {
    "causal": (dict(mask_mod=lambda b, h, q, kv: q >= kv), dict(causal=True)),
    "window": (dict(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < 50)), dict(window=(49, 0))),
    "band": (dict(mask_mod=lambda b, h, q, kv: (q - kv).abs() <= 9), dict(window=(9, 9))),
    "softcap": (dict(score_mod=lambda s, b, h, q, kv: 20 * torch.tanh(s / 20)), dict(softcap=20.0)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("sq, sk", [(200, 200), (300, 100), (100, 300)])
def test_recognised_mods_fold_into_builtins_and_stay_exact(op_args, name, sq, sk):
    mods, builtin = CASES[name]
    q, k, v = _qkv(sq, sk)
    out = torch_fa4.attention(q, k, v, **mods)
    # float64 from the user's own callables: the fold must not change what is computed
    ref, _ = naive_attention(q, k, v, score_mod=mods.get("score_mod"), mask_mod=mods.get("mask_mod"))
    assert rel_error(out, ref) < 1e-5
    (rest,), = [op_args]
    mod_key, causal, wl, wr, cap = rest[12], rest[8], rest[9], rest[10], rest[11]
    # top-left masks are bottom-right windows only where the diagonal stays inside them
    folds = name == "softcap" or sq == sk or (name == "causal" and sq > sk)
    if folds:
        assert mod_key == ""
        if name == "softcap":
            assert cap == builtin["softcap"]
        else:
            want_window = builtin.get("window", (-1, 0)) if sq == sk else (-1, sq - sk)
            assert (wl, wr, causal) == (*want_window, want_window[1] == 0)
    else:
        assert mod_key != "" and (wl, wr, causal) == (-1, -1, False)


def test_a_block_mask_of_a_recognised_mask_is_dropped_with_it(op_args):
    bm = torch_fa4.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, device="cpu")
    q, k, v = _qkv(256, 256)
    out = torch_fa4.flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=bm, enable_gqa=True)
    ref, _ = naive_attention(q, k, v, causal=True)
    assert rel_error(out.transpose(1, 2), ref) < 1e-5
    (rest,), = [op_args]
    assert rest[12] == "" and rest[4] == [] and rest[8] is True


def test_only_the_recognised_mod_is_taken_out(op_args):
    slopes = torch.rand(4)

    def alibi(s, b, h, q, kv):
        return s - slopes[h] * (q - kv).abs()

    doc = torch.arange(200) // 70

    def document(b, h, q, kv):
        return doc[q] == doc[kv]

    q, k, v = _qkv()
    out = torch_fa4.attention(q, k, v, score_mod=alibi, mask_mod=lambda b, h, qi, kv: qi >= kv)
    ref, _ = naive_attention(q, k, v, score_mod=alibi, causal=True)
    assert rel_error(out, ref) < 1e-5
    out = torch_fa4.attention(q, k, v, score_mod=lambda s, b, h, qi, kv: 5 * torch.tanh(s / 5), mask_mod=document)
    ref, _ = naive_attention(q, k, v, softcap=5.0, mask_mod=document)
    assert rel_error(out, ref) < 1e-5
    (a1, a2) = op_args
    assert a1[12] != "" and len(a1[0]) == 1 and a1[8] is True  # alibi kept, with its slopes
    assert a2[12] != "" and len(a2[0]) == 1 and a2[11] == 5.0  # the document mask kept, with doc


def test_varlen_and_seqused_calls_keep_their_masks(op_args):
    q, k, v = _qkv()
    mask = lambda b, h, qi, kv: qi >= kv  # noqa: E731
    torch_fa4.attention(q, k, v, mask_mod=mask, seqused_k=torch.tensor([200, 150], dtype=torch.int32))
    cu = torch.tensor([0, 120, 200], dtype=torch.int32)
    torch_fa4.attention(q[0], k[0], v[0], mask_mod=mask, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert all(rest[12] != "" for rest in op_args)


def test_folding_under_torch_compile():
    q, k, v = _qkv()

    def f(q, k, v):
        return torch_fa4.attention(q, k, v, mask_mod=lambda b, h, qi, kv: qi >= kv,
                                   score_mod=lambda s, b, h, qi, kv: 30 * torch.tanh(s / 30))

    out = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    ref, _ = naive_attention(q, k, v, causal=True, softcap=30.0)
    assert rel_error(out, ref) < 1e-5


# ---- clamps that saturate on a whole fragment (kernels/host/mod_hoisting.saturation_split) ------

def _split(score_mod):
    from torch_fa4.kernels.host import mod_hoisting as H

    graph = trace_graphs(score_mod, None)[0].score_graph
    return H.saturation_split(graph, H.hoist_plan(graph))


SATURATING = {  # score_mod -> (above, value_above, below, value_below) of the split, or None
    "relative bias": (lambda s, b, h, q, kv: s - 0.01 * (q - kv).abs().clamp(max=64), (64, 64, -64, 64)),
    # (thresholds in f = q - kv + 3)
    "two-sided clamp": (lambda s, b, h, q, kv: s + 0.05 * (q - kv + 3).clamp(-100, 37).float(),
                        (37, 37, -100, -100)),
    "one side": (lambda s, b, h, q, kv: s + torch.clamp(kv - q, max=7).float(), (7, 7, None, None)),
    "clamp of a clamp": (lambda s, b, h, q, kv: s + (q - kv).clamp(min=-9).clamp(max=20).float(),
                         (20, 20, -9, -9)),
    # a floor under |q - kv| never saturates towards the ends
    "floor under abs": (lambda s, b, h, q, kv: s + (q - kv).abs().clamp(min=5).float(), None),
    "no clamp": (lambda s, b, h, q, kv: s - 0.01 * (q - kv).abs(), None),
    "not affine": (lambda s, b, h, q, kv: s - ((q * kv) % 97).clamp(max=50).float(), None),
    "two affine operands": (lambda s, b, h, q, kv: s + torch.minimum(q - kv, kv - q).float(), None),
}


@pytest.mark.parametrize("name", list(SATURATING))
def test_saturation_splits(name):
    score_mod, want = SATURATING[name]
    split = _split(score_mod)
    got = None if split is None else (split.above, split.value_above, split.below, split.value_below)
    if want is not None and want[2] is None:
        got = got[:2] + (None, None)
    assert got == want


@pytest.mark.parametrize("name", [n for n, (_, want) in SATURATING.items() if want is not None])
def test_saturated_sides_are_exact(name):
    """On the sides the split names, the mod equals the one with the clamp's constant, for every
    position pair of a grid reaching past both thresholds; just inside, it differs."""
    score_mod, _ = SATURATING[name]
    split = _split(score_mod)
    q = torch.arange(400).view(-1, 1)
    kv = torch.arange(400).view(1, -1)
    f = split.form.q * q + split.form.kv * kv + split.form.const
    s = torch.zeros(400, 400)
    out = score_mod(s, 0, 0, q, kv)
    sides = [(f >= split.above, f == split.above - 1)] if split.above is not None else []
    sides += [(f <= split.below, f == split.below + 1)] if split.below is not None else []
    for side, edge in sides:
        assert side.any() and edge.any()
        vals = out[side]
        assert (vals == vals[0]).all()  # one constant over the whole side
        assert (out[edge] != vals[0]).all()  # the threshold is tight


def test_saturated_relative_bias_costs_one_fma_per_element(tmp_path):
    """SASS: the causal relative-bias forward has a key-loop side where the bias is one constant,
    64 FFMAs with the same immediate (one per element of a thread's 64 x 128 / 128 fragment)."""
    pytest.importorskip("cutlass")
    import os
    import re

    from sass import key_loops, sass_of
    from torch_fa4 import mods as M
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90 import fwd_host
    from torch_fa4.mods import registry

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    key, aux = M.prepare(SATURATING["relative bias"][0], None)
    q = torch.empty(1, 4096, 16, 128, dtype=torch.bfloat16)
    call = AttentionCall(q=q, k=q, v=q, scale=128 ** -0.5, causal=True, mod_key=key,
                         mods=registry.lookup(key), aux_tensors=tuple(aux))
    fwd_host.compile_fwd(fwd_host.default_config(call), dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    bias = -0.01 * 64
    fma_of_bias = r"FFMA R\d+, R\d+, R\d+(?:\.reuse)?, (-0\.63\d+)"
    consts = [re.findall(fma_of_bias, "\n".join(loop)) for loop in key_loops(sass)]
    counts = [len(c) for c in consts]
    assert max(counts) >= 2 * 64, counts  # both saturated sides of the unmasked loop
    assert all(abs(float(x) - bias) < 1e-6 for c in consts for x in c)


# ---- band & rest: the band as the built-in causal mask, the rest kept (idioms.mask_band_split) -------

def _split_band(mask_mod):
    found = idioms.mask_band_split(trace_graphs(None, mask_mod)[0].mask_graph)
    return None if found is None else found[0]


DOC = torch.tensor([0] * 70 + [1] * 3 + [2] * 200 + [3] * 127, dtype=torch.int32)  # 400 positions


@pytest.mark.parametrize("mask_mod, band", [
    (lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q >= kv), (0, INF)),
    (lambda b, h, q, kv: (q >= kv) & (DOC[q] == DOC[kv]), (0, INF)),
    (lambda b, h, q, kv: (q // 64 == kv // 64) & (q >= kv), (0, INF)),  # chunked, causal
    (lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q >= kv) & (q - kv < 100) & (h < 3), (0, 99)),
    (lambda b, h, q, kv: (q > kv) & (DOC[q] == DOC[kv]), (1, INF)),  # a band, not the diagonal's
    (lambda b, h, q, kv: (DOC[q] == DOC[kv]) | (q >= kv), None),
    (lambda b, h, q, kv: (kv <= 30) | (q >= kv), None),  # prefix-LM: an or
    (lambda b, h, q, kv: DOC[q] == DOC[kv], None),
    (lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q + kv >= 3), None),
    (lambda b, h, q, kv: (q >= kv) & (q < kv) & (DOC[q] == DOC[kv]), None),  # empty band
])
def test_band_splits(mask_mod, band):
    assert _split_band(mask_mod) == band


def _dense_tiles(mask_mod, S, bq, bkv):
    q = torch.arange(S).view(-1, 1)
    kv = torch.arange(S).view(1, -1)
    keep = mask_mod(0, 0, q, kv)
    causal = q >= kv
    nt = -(-S // bq)
    pad = nt * bq - S

    def grid(x, fill):
        return torch.nn.functional.pad(x, (0, pad, 0, pad), value=fill).view(nt, bq, nt, bkv)

    any_ = grid(keep, False).any(3).any(1)
    rest_full = grid(keep | ~causal, True).all(3).all(1)  # the rest holds wherever causal does
    return any_, any_ & rest_full


def test_block_lists_without_the_band_are_exact():
    from torch_fa4.mods import block_lists
    from torch_fa4.mods.block_lists import _flags
    from torch_fa4.mods.registry import lookup

    S, bq, bkv = 400, 64, 64
    doc = DOC.clone()
    mask_mod = lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)  # noqa: E731
    bm = torch_fa4.create_block_mask(mask_mod, None, None, S, S, device="cpu", BLOCK_SIZE=64)
    key, aux = api._prepare_mods(None, mask_mod)
    found = idioms.builtins_of(key)
    lists = block_lists.without_band(bm.as_tensors(), bq, bkv, found.rest_band, lookup(found.key_with_rest),
                                     aux, S, S)
    visible, full = _dense_tiles(mask_mod, S, bq, bkv)
    partial_got, full_got = _flags(*lists[:2])[0, 0], _flags(*lists[2:])[0, 0]
    assert torch.equal(full_got, full) and torch.equal(partial_got, visible & ~full)
    assert full_got.sum() > _flags(*bm.as_tensors()[2:])[0, 0].sum()  # the diagonal tiles moved
    # kept for the same tensors; a document id changed in place is another mask
    assert block_lists.without_band(bm.as_tensors(), bq, bkv, found.rest_band, lookup(found.key_with_rest),
                                    aux, S, S)[0] is lists[0]
    doc[300:] = 9
    again = block_lists.without_band(bm.as_tensors(), bq, bkv, found.rest_band, lookup(found.key_with_rest),
                                     aux, S, S)
    assert again[0] is not lists[0]


@pytest.mark.parametrize("mask_mod, folds", [
    (lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q >= kv), True),
    (lambda b, h, q, kv: (q // 64 == kv // 64) & (q >= kv), True),
    (lambda b, h, q, kv: (q > kv) & (DOC[q] == DOC[kv]), False),  # near miss: not the diagonal
    (lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q >= kv) & (q - kv <= 50), False),  # a window: kept whole
])
def test_band_and_rest_fold_into_causal_and_stay_exact(op_args, mask_mod, folds):
    S = 400
    bm = torch_fa4.create_block_mask(mask_mod, None, None, S, S, device="cpu", BLOCK_SIZE=128)
    q, k, v = _qkv(S, S)
    out = torch_fa4.flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=bm, enable_gqa=True)
    ref, _ = naive_attention(q, k, v, mask_mod=mask_mod)
    assert rel_error(out.transpose(1, 2), ref) < 1e-5
    out = torch_fa4.attention(q, k, v, mask_mod=mask_mod)  # no block mask: the rest alone
    assert rel_error(out, ref) < 1e-5
    (with_bm, without_bm) = op_args
    key, _ = api._prepare_mods(None, mask_mod)
    for rest in (with_bm, without_bm):
        assert (rest[12] != key and rest[8] is True) == folds
        assert rest[12] != ""  # the rest is always kept
    if folds:
        got = with_bm[4]
        want_visible, want_full = _dense_tiles(mask_mod, S, 128, 128)
        from torch_fa4.mods.block_lists import _flags
        assert torch.equal(_flags(*got[2:])[0, 0], want_full)
        assert without_bm[4] == []


def test_schedule_and_rescale_of_mod_calls():
    """D128 block-list walks of a mask_mod alone take the persistent CTAs' counter (short, unequal
    walks), the conditional rescale and the early Q release; with a score_mod beside it, other
    head dims, softcap: one CTA per item as before; score_mod calls keep the early rescale."""
    from torch_fa4 import mods as M
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90 import fwd_host
    from torch_fa4.mods import registry

    doc = torch.arange(1024, dtype=torch.int32) // 256

    def cfg(D=128, score_mod=None, mask_mod=None, block=True, **kw):
        q = torch.empty(2, 1024, 4, D, dtype=torch.bfloat16)
        key, aux = M.prepare(score_mod, mask_mod)
        extra = {}
        if block and mask_mod is not None:
            bm = M.create_block_mask(mask_mod, None, None, 1024, 1024, device="cpu")
            extra = dict(block_mask=tuple(bm.as_tensors()), block_mask_q=128, block_mask_kv=128)
        call = AttentionCall(q=q, k=q, v=q, scale=0.1, mod_key=key, mods=registry.lookup(key),
                             aux_tensors=tuple(aux), **extra, **kw)
        return fwd_host.default_config(call)

    document = lambda b, h, q, kv: doc[q] == doc[kv]  # noqa: E731
    relative = lambda s, b, h, q, kv: s - 0.01 * (q - kv).abs().clamp(max=64)  # noqa: E731
    for kw in (dict(), dict(causal=True)):
        c = cfg(mask_mod=document, **kw)
        assert c.block_sparse and c.persistent and c.dynamic_schedule and c.early_q_release
        assert (c.rescale_threshold, c.early_o_rescale) == (8.0, False)
    assert not cfg(mask_mod=document, block=False).persistent  # a mask_mod everywhere: one CTA per item
    assert not cfg(mask_mod=document, score_mod=relative).persistent
    assert not cfg(D=64, mask_mod=document).persistent
    assert not cfg(mask_mod=document, softcap=5.0).persistent
    c = cfg(score_mod=relative, causal=True)  # score_mods keep the early rescale
    assert c.dynamic_schedule and (c.rescale_threshold, c.early_o_rescale) == (None, True)
    q = torch.empty(2, 4096, 4, 128, dtype=torch.bfloat16)  # (long plain walks keep Q)
    assert not fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1, causal=True)).early_q_release
