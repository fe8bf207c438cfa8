"""CPU: with compute capability 10.0 faked, every feature the sm100 forward advertises reaches it,
each variant after its first-use self-check (torch_fa4/self_check.py).

The sm100 forward is stood in by the reference (nothing launches on a CPU); what is tested is the
route: the public call -> dispatch -> `kernels.sm100.unsupported_reason` accepts it -> the
self-check launches the variant once on a small problem of the same features -> the call's own
launch, whose variant (`fwd_host.default_config`) is built for these exact features. The kernels
themselves are compile-checked in tests/test_sm100_fwd_compile.py.

The two-CTA forward (kernels/sm100/pair: a cluster of two CTAs per matmul) comes first: what it
takes reaches it after its own self-check; what it refuses reaches the one-CTA forward without a
warning; a pair variant that fails its self-check runs on the one-CTA forward.

The backward the same way: what the pair backward takes (kernels/sm100/pair/bwd.py: D = 128 /
192 / 256; deterministic D = 128 runs the one-CTA kernel's variant from there) reaches it, what it
refuses reaches the one-CTA sm100 backward (kernels/sm100/bwd.py) quietly, each after its own
self-check with the variant its `variant_key` builds; what both refuse (here D = 256 with Dv =
128) reaches the portable backward with the refusal warned once (compile-checked in
tests/test_sm100_pair_bwd_compile.py and tests/test_sm100_bwd_compile.py).
"""

import warnings

import pytest
import torch

from _self_check_state import forget_verdicts
import torch_fa4
from torch_fa4 import mods as M
from torch_fa4 import reference, self_check

BLACKWELL = (10, 0)


@pytest.fixture(autouse=True)
def fresh_verdicts(tmp_path, monkeypatch):
    forget_verdicts(monkeypatch, tmp_path)


@pytest.fixture
def launches(monkeypatch):
    """The calls the sm100 forwards (one-CTA and pair) receive (computed by the reference), with
    their variants (`two_cta` tells which forward)."""
    from torch_fa4 import dispatch
    from torch_fa4.kernels import sm100
    from torch_fa4.kernels.sm100 import fwd_host, pair

    seen = []

    def stand_in(config_of):
        def forward(call, out, lse):
            seen.append((call, config_of(call)))
            o, l = reference.forward(call)
            out.copy_(o)
            lse.copy_(l)
        return forward

    monkeypatch.setattr(dispatch, "on_gpu", lambda call: True)
    monkeypatch.setattr(dispatch, "capability", lambda device: BLACKWELL)
    monkeypatch.setattr(sm100, "forward", stand_in(fwd_host.default_config))
    monkeypatch.setattr(pair, "forward", stand_in(pair.fwd_host.default_config))
    return seen


def _qkv(D=64, S=600, H=4, Hkv=2, B=2, dtype=torch.bfloat16):
    q = torch.randn(B, S, H, D, dtype=dtype)
    k, v = (torch.randn(B, S, Hkv, D, dtype=dtype) for _ in range(2))
    return q, k, v


def _check_route(launches, out, ref, **variant):
    """One self-check launch, then the call's own; both variants have `variant`'s fields."""
    assert len(launches) == 2 and self_check.checks_run == 1, "one check, then the call's own launch"
    (check, check_cfg), (real, real_cfg) = launches
    for name, value in variant.items():
        assert getattr(real_cfg, name) == value, (name, getattr(real_cfg, name), value)
    # the small problem keeps the features: same variant but for nothing the features decide
    fields = ("mod_key", "block_sparse", "q_tiles", "head_dim", "two_cta")
    assert [getattr(check_cfg, f) for f in fields] == [getattr(real_cfg, f) for f in fields]
    assert (out.double() - ref).abs().max() < 0.05


@pytest.mark.parametrize("D, features", [
    (192, dict(causal=True)),
    (256, dict(softcap=15.0)),
    (256, dict(window_size=(100, 20))),
])
def test_large_head_dims_reach_the_sm100_forward(launches, D, features):
    q, k, v = _qkv(D=D, S=300)
    out = torch_fa4.attention(q, k, v, **features)
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), **features)
    # (D=256 on the pair of CTAs: tests below)
    _check_route(launches, out, ref, head_dim=D, q_tiles=2 if D == 192 else 1, tile_n=64 if D == 192 else 128,
                 two_cta=D == 256)


def test_score_mod_reaches_the_sm100_forward(launches):
    q, k, v = _qkv(D=128)
    slopes = M.alibi_slopes(4)
    out = torch_fa4.attention(q, k, v, causal=True, score_mod=M.alibi(slopes))
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), causal=True, score_mod=M.alibi(slopes))
    call, cfg = launches[-1]
    assert cfg.mod_key == call.mod_key != "" and cfg.aux_specs == (("torch.float32", 1),)
    _check_route(launches, out, ref, q_tiles=2, block_sparse=False)


def test_mask_mod_reaches_the_sm100_forward(launches):
    q, k, v = _qkv(D=64)
    doc = torch.randint(0, 3, (600,)).sort().values
    out = torch_fa4.attention(q, k, v, mask_mod=M.document_mask(doc))
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), mask_mod=M.document_mask(doc))
    _check_route(launches, out, ref, q_tiles=1, block_sparse=False)  # (a gathering mask_mod: one tile)


def _causal_stripes(b, h, q_idx, kv_idx):
    """A mask_mod without captured tensors that is no built-in mask (a causal mask alone would run
    as causal=True)."""
    return (q_idx >= kv_idx) & (kv_idx % 4 != 3)


@pytest.mark.parametrize("block", [128, (256, 128)])
def test_block_mask_reaches_the_sm100_forward(launches, block):
    q, k, v = _qkv(D=128, S=512)
    bm = M.create_block_mask(_causal_stripes, None, None, 512, 512, device="cpu", BLOCK_SIZE=block)
    out = torch_fa4.attention(q, k, v, block_mask=bm)
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), block_mask=bm)
    q_tiles = 2 if block == (256, 128) else 1
    _check_route(launches, out, ref, block_sparse=True, q_tiles=q_tiles, bm_tiles_m=1, bm_tiles_n=1)


def test_varlen_with_mods_reaches_the_sm100_forward(launches):
    q = torch.randn(900, 4, 96, dtype=torch.float16)
    k, v = (torch.randn(900, 2, 96, dtype=torch.float16) for _ in range(2))
    cu = torch.tensor([0, 200, 900], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=700, max_seqlen_k=700,
              score_mod=M.alibi(M.alibi_slopes(4)), causal=True, softcap=30.0)
    out = torch_fa4.attention(q, k, v, **kw)
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), **kw)
    assert launches[-1][1].mod_key and launches[-1][1].softcap
    _check_route(launches, out, ref, varlen_q=True, varlen_k=True, causal=True, q_tiles=2)


def test_a_block_mask_the_kernel_cannot_walk_falls_back_with_its_reason(launches):
    q, k, v = _qkv(D=64, S=256)
    bm = M.create_block_mask(_causal_stripes, None, None, 256, 256, device="cpu", BLOCK_SIZE=(64, 128))
    with pytest.warns(UserWarning, match="BLOCK_SIZE"):
        out = torch_fa4.attention(q, k, v, block_mask=bm)
    assert not launches and self_check.checks_run == 0
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), block_mask=bm)
    assert (out.double() - ref).abs().max() < 0.05


# ---- the two-CTA forward ----------------------------------------------------------------------------

def _packed(D, lengths=(200, 700)):
    total = sum(lengths)
    q = torch.randn(total, 4, D, dtype=torch.bfloat16)
    k, v = (torch.randn(total, 2, D, dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return (q, k, v), dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                           max_seqlen_k=max(lengths))


def _attend_quietly(D, S, features):
    """out and the float64 reference of a public call with `features` on fresh inputs of head dim D
    and length S (None: packed sequences); any warning is an error."""
    if S is None:
        (q, k, v), packed = _packed(D)
        features = dict(features, **packed)
    else:
        q, k, v = _qkv(D=D, S=S)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = torch_fa4.attention(q, k, v, **features)
    return out, torch_fa4.attention(q.double(), k.double(), v.double(), **features)


@pytest.mark.parametrize("D, S, features, q_tiles", [
    (256, 300, dict(), 1),
    (256, 300, dict(causal=True, softcap=20.0), 1),
    (256, 300, dict(window_size=(100, 20), seqused_k=torch.tensor([250, 300], dtype=torch.int32)), 1),
    (256, None, dict(causal=True), 1),  # packed sequences
    (128, 600, dict(), 2),
    (128, 600, dict(softcap=30.0), 2),
])
def test_what_the_pair_forward_takes_reaches_it(launches, D, S, features, q_tiles):
    out, ref = _attend_quietly(D, S, features)  # nothing falls back
    _check_route(launches, out, ref, two_cta=True, head_dim=D, q_tiles=q_tiles,
                 kv_stages={128: 8, 256: 4}[D], varlen_q=S is None)


@pytest.mark.parametrize("D, S, features", [
    (128, 600, dict(causal=True)),  # (a pair would walk keys half its rows never see)
    (128, 600, dict(window_size=(100, 0))),
    (128, None, dict()),  # packed sequences at D=128
    (128, 256, dict()),  # the queries fit one CTA (two 128-row tiles)
    (256, 128, dict(causal=True)),  # ... one 128-row tile
    (64, 600, dict()),
    (192, 600, dict()),
    (256, 300, dict(score_mod=M.alibi(M.alibi_slopes(4)))),
])
def test_what_the_pair_forward_refuses_reaches_the_one_cta_forward_quietly(launches, D, S, features):
    out, ref = _attend_quietly(D, S, features)  # a pair's refusal is no fallback worth a warning
    _check_route(launches, out, ref, two_cta=False, head_dim=D)


def test_a_pair_variant_failing_its_self_check_runs_on_the_one_cta_forward(launches, monkeypatch):
    from torch_fa4.kernels.sm100 import pair

    pair_launches = []

    def wrong(call, out, lse):  # a pair kernel gone wrong: every row's output off by one
        pair_launches.append(call)
        o, l = reference.forward(call)
        out.copy_(o + 1)
        lse.copy_(l)

    monkeypatch.setattr(pair, "forward", wrong)
    q, k, v = _qkv(D=256, S=300)
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), causal=True)
    with pytest.warns(self_check.SelfCheckWarning, match="pair forward variant"):
        out = torch_fa4.attention(q, k, v, causal=True)
    # the pair's check failed; the one-CTA kernel's check and the call's own launch followed
    assert len(pair_launches) == 1 and self_check.checks_run == 2 and len(launches) == 2
    assert not any(cfg.two_cta for _, cfg in launches) and launches[-1][1].head_dim == 256
    assert (out.double() - ref).abs().max() < 0.05
    # the verdict stands: the next call goes straight to the one-CTA kernel, unchecked
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_fa4.attention(q, k, v, causal=True)
    assert len(pair_launches) == 1 and self_check.checks_run == 2 and len(launches) == 3
    assert not launches[-1][1].two_cta


# ---- backward ---------------------------------------------------------------------------------------

@pytest.fixture
def bwd_launches(launches, monkeypatch):
    """The backward calls the pair, sm100 and portable backwards receive (computed by the
    reference), as (family, call, deterministic, pair / sm100 variant or None)."""
    from torch_fa4.kernels.portable import bwd as portable_bwd
    from torch_fa4.kernels.sm100 import bwd
    from torch_fa4.kernels.sm100.pair import bwd as pair_bwd

    seen = []
    keys = {"sm100": bwd.variant_key, "pair": pair_bwd.variant_key}

    def stand_in(family):
        def backward(call, dout, out, lse, dq, dk, dv, deterministic, *args, **kw):
            variant = keys[family](call, deterministic) if family in keys else None
            seen.append((family, call, deterministic, variant))
            for got, want in zip((dq, dk, dv), reference.backward(call, dout, out, lse)):
                got.copy_(want)
        return backward

    monkeypatch.setattr(bwd, "backward", stand_in("sm100"))
    monkeypatch.setattr(pair_bwd, "backward", stand_in("pair"))
    monkeypatch.setattr(portable_bwd, "backward", stand_in("portable"))
    return seen


def _grads(q, k, v, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = torch_fa4.attention(q, k, v, **kw)
    dout = torch.randn_like(out)
    out.backward(dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch_fa4.attention(qd, kd, vd, **kw)
    ref.backward(dout.double())
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert (got.double() - want).abs().max() < 0.05 * max(want.abs().max().item(), 1.0)


def _check_bwd_route(bwd_launches, family, checks=2, **variant):
    """The backward's self-check launch, then the call's own, both on `family`; `checks` self-checks
    in all (the forward's and the backward's)."""
    assert [f for f, *_ in bwd_launches] == [family, family], bwd_launches
    (_, check, _, check_key), (_, real, deterministic, real_key) = bwd_launches
    if family in ("sm100", "pair"):
        assert check_key == real_key, "the self-check ran another variant"
        for name, value in variant.items():
            assert getattr(real_key, name) == value, (name, getattr(real_key, name), value)
    assert self_check.checks_run == checks


@pytest.mark.parametrize("D, features, family, variant", [
    (128, dict(), "pair", dict(has_right=False, group=2, tile_n=256, mask_key_tail=True)),
    (64, dict(causal=True), "sm100", dict(has_right=True, mask_key_tail=True)),
    (96, dict(window_size=(100, 20)), "sm100", dict(has_left=True, has_right=True)),
    (128, dict(softcap=20.0, causal=True), "pair", dict(softcap=True, tile_n=256)),
    (64, dict(deterministic=True), "sm100", dict(deterministic=True)),
    # the pair module takes deterministic D = 128 and runs the one-CTA kernel's variant
    (128, dict(deterministic=True, causal=True), "pair", dict(deterministic=True, tile_n=128)),
    (192, dict(causal=True), "pair", dict(has_right=True, tile_n=128)),
    (256, dict(softcap=15.0), "pair", dict(softcap=True, tile_n=128)),
])
def test_backward_features_reach_the_sm100_backward(bwd_launches, D, features, family, variant):
    q, k, v = _qkv(D=D, S=300)
    with warnings.catch_warnings():
        # nothing falls back (the float64 reference of _grads warns about float64 only)
        warnings.filterwarnings("error", message=".*backward falls back to the (sm100|portable) kernels: "
                                "(?!.*float64)")
        _grads(q, k, v, **features)
    _check_bwd_route(bwd_launches, family, head_dim=D, **variant)


def test_the_pair_family_lets_backwards_it_does_not_take_pass_quietly(bwd_launches):
    """The pair family comes first for the backward too (`pair.bwd`, where it exists); a backward
    it does not take reaches the one-CTA backward without a warning."""
    q, k, v = _qkv(D=64, S=300)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _grads(q, k, v, causal=True)  # (its float64 reference warns about float64 only)
    assert not [w for w in caught if "pair" in str(w.message) or "no backward" in str(w.message)], caught
    assert all("float64" in str(w.message) for w in caught)
    _check_bwd_route(bwd_launches, "sm100", head_dim=64)


def test_varlen_and_seqused_backward_reach_the_sm100_backward(bwd_launches):
    q = torch.randn(900, 4, 64, dtype=torch.float16)
    k, v = (torch.randn(900, 2, 64, dtype=torch.float16) for _ in range(2))
    cu = torch.tensor([0, 200, 900], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=700, max_seqlen_k=700, causal=True)
    _grads(q, k, v, **kw)
    _check_bwd_route(bwd_launches, "sm100", varlen=True, has_right=True)
    bwd_launches.clear()
    self_check.checks_run = 0
    q, k, v = _qkv(D=64, S=256)
    _grads(q, k, v, seqused_k=torch.tensor([100, 256], dtype=torch.int32))
    # (the forward's variant was checked before: only the backward checks now)
    assert [f for f, *_ in bwd_launches] == ["sm100", "sm100"] and bwd_launches[-1][3].seqused_k


def test_mods_reach_the_sm100_backward(bwd_launches):
    q, k, v = _qkv(D=128, S=300)
    _grads(q, k, v, causal=True, score_mod=M.alibi(M.alibi_slopes(4)))
    _check_bwd_route(bwd_launches, "pair", sparse=None, has_right=True)
    assert bwd_launches[-1][3].mods_key == bwd_launches[-1][1].mod_key != ""


@pytest.mark.parametrize("deterministic", [False, True])
def test_block_mask_reaches_the_sm100_backward(bwd_launches, deterministic):
    """128 x 128 blocks drive the walk; deterministic mode walks densely with the mask_mod."""
    q, k, v = _qkv(D=64, S=512)
    bm = M.create_block_mask(_causal_stripes, None, None, 512, 512, device="cpu", BLOCK_SIZE=128)
    _grads(q, k, v, block_mask=bm, deterministic=deterministic)
    _check_bwd_route(bwd_launches, "sm100", sparse=None if deterministic else (1, 1),
                     deterministic=deterministic)


def test_head_dims_differ_reach_the_sm100_backward(bwd_launches):
    q, _, _ = _qkv(D=128, S=300)
    k, v = torch.randn(2, 300, 2, 128, dtype=torch.bfloat16), torch.randn(2, 300, 2, 64, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="sm100 forward falls back"):  # (the forward takes Dv = D only)
        _grads(q, k, v, causal=True)
    _check_bwd_route(bwd_launches, "sm100", checks=1, head_dim=128, head_dim_v=64)


def test_what_the_sm100_backward_refuses_reaches_the_portable_backward(bwd_launches):
    """D = 256 with Dv = 128: neither the pair (quietly) nor the one-CTA backward takes it."""
    q, _, _ = _qkv(D=256, S=300)
    k = torch.randn(2, 300, 2, 256, dtype=torch.bfloat16)
    v = torch.randn(2, 300, 2, 128, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="sm100 backward falls back to the portable kernels: .*head dims"):
        _grads(q, k, v, causal=True)
    _check_bwd_route(bwd_launches, "portable", checks=1)
