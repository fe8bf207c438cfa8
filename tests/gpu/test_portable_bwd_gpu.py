"""Portable backward kernel (kernels/portable/bwd.py) against float64 autograd, over its features.

Each case draws fresh random inputs, computes out / lse in float64 (tests/naive.py: what a forward
pass hands to backward), poisons dq / dk / dv with NaN, runs the kernel and compares with the
float64 gradients by relative norm error, held to twice the error of the same computation run
eagerly in the inputs' dtype, or of the exact one with rowsum(dO * O) taken from the rounded O
(as every flash backward takes it), with a small floor. Deterministic cases run twice and must
agree bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from _mod_call_fields import mod_call_fields
from naive import call_options, naive_varlen
from torch_fa4.call import AttentionCall

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8,
                       reason="needs an NVIDIA GPU of sm_80 or later"),
]

BF, FP = torch.bfloat16, torch.float16


def _inputs(dtype, b, sq, sk, hq, hkv, d, dv, varlen, seqused, lens):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(torch.seed() % (2**31))
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    cu_q = cu_k = used = None
    if varlen:
        if lens is not None:
            lens_q, lens_k = (torch.tensor(x) for x in lens)
        else:
            cpu = torch.Generator().manual_seed(torch.seed() % 2**31)
            lens_q = torch.randint(0, sq + 1, (b,), generator=cpu)
            lens_k = torch.randint(1, sk + 1, (b,), generator=cpu)
        cu_q, cu_k = (torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]).to(torch.int32).to(dev)
                      for n in (lens_q, lens_k))
        tq, tk = int(cu_q[-1]), int(cu_k[-1])
        q, k, v, do = rnd(tq, hq, d), rnd(tk, hkv, d), rnd(tk, hkv, dv), rnd(tq, hq, dv)
        sq, sk = int(lens_q.max()), int(lens_k.max())
    else:
        q, k, v, do = rnd(b, sq, hq, d), rnd(b, sk, hkv, d), rnd(b, sk, hkv, dv), rnd(b, sq, hq, dv)
    if seqused:
        lim = torch.tensor([int(cu_k[i + 1] - cu_k[i]) for i in range(b)]) if varlen else torch.full((b,), sk)
        used = (torch.rand(b) * lim).floor().to(torch.int32).clamp_min(0).to(dev)
    return q, k, v, do, cu_q, cu_k, used, sq, sk


def _case(dtype, b, sq, sk, hq, hkv, d, dv=None, causal=False, left=-1, right=-1, softcap=0.0,
          varlen=False, seqused=False, deterministic=False, lens=None, stages=None, score_mod=None,
          mask_mod=None, block_size=None, large_tiles=None, tuning=None):
    from torch_fa4.kernels.portable import bwd

    dv = dv or d
    q, k, v, do, cu_q, cu_k, used, sq, sk = _inputs(dtype, b, sq, sk, hq, hkv, d, dv, varlen, seqused, lens)
    mod_kw = mod_call_fields(score_mod, mask_mod, block_size, sq, sk)
    call = AttentionCall(q=q, k=k, v=v, scale=1.0 / math.sqrt(d), causal=causal, window_left=left,
                         window_right=right, softcap=softcap, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         seqused_k=used, max_seqlen_q=sq, max_seqlen_k=sk, **mod_kw)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod)
    assert bwd.unsupported_reason(call) is None, bwd.unsupported_reason(call)

    grads64, out, lse, rounded_out = _oracle(call, do, torch.float64, mods)
    eager = _oracle(call, do, dtype, mods)[0]  # the eager low-precision error budget
    runs = []
    for _ in range(2 if deterministic else 1):
        got = [torch.full(t.shape, math.nan, dtype=dtype, device="cuda") for t in (q, k, v)]
        bwd.backward(call, do, out, lse, *got, deterministic, stages=stages, large_tiles=large_tiles,
                     tuning=tuning)
        torch.cuda.synchronize()
        runs.append(got)
    if deterministic:
        for a, c in zip(*runs):
            assert torch.equal(a, c), "deterministic mode gave two different results"
    for name, got, ref, low, low_out in zip(("dq", "dk", "dv"), runs[0], grads64, eager, rounded_out):
        assert not torch.isnan(got).any(), f"{name} has NaN (unwritten or NaN math)"
        # (a floor of 1e-3 per element: a gradient that is 0 in exact math, e.g. of a row that sees
        # one key, comes out as fp32 rounding noise)
        norm = ref.norm().clamp_min(1e-3 * math.sqrt(max(ref.numel(), 1)))
        err = ((got.double() - ref).norm() / norm).item()
        budget = max(2 * ((low.double() - ref).norm() / norm).item(),
                     2 * ((low_out - ref).norm() / norm).item(), 2e-3)
        assert err <= budget, f"{name}: relative error {err:.3e} > {budget:.3e}"


def _oracle(call, do, dtype, mods):
    """(dq, dk, dv) by autograd through naive attention computed in `dtype`; the forward's out
    (in q's dtype) and lse (float32) as a forward pass hands them over; and the gradients with
    rowsum(dO * O) taken from that rounded out (what every flash backward computes: where a
    gradient is ~0, e.g. of a row that sees one key, that rounding is all that is left)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (call.q, call.k, call.v))
    out, lse = naive_varlen(q, k, v, **call_options(call), **mods, differentiable=True)
    do = do.to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), do, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, (q, k, v))]
    rounded = out.detach().to(call.q.dtype)
    with_rounded = None
    if dtype == torch.float64:
        with_rounded = _with_rounded_delta(call, grads, q.detach(), k.detach(), do, out.detach(), rounded,
                                           mods)
    return grads, rounded.contiguous(), lse.detach().float().contiguous(), with_rounded


def _with_rounded_delta(call, grads, q, k, do, out, rounded, mods):
    """grads plus the change dS = P (dP - delta) takes from delta = rowsum(dO * rounded out):
    -P_ij e_i for delta's error e_i. P comes from the oracle itself (V = the identity)."""
    lead = q.dim() - 3  # batch dim or none (packed rows)
    sk = k.shape[-3]
    eye = torch.eye(sk, dtype=q.dtype, device=q.device).unsqueeze(-2)  # (Sk, 1, Sk)
    eye = eye.expand(*k.shape[:-1], sk)  # (..., Sk, Hkv, Sk)
    p, _ = naive_varlen(q, k, eye, **call_options(call), **mods, differentiable=True)  # (..., Sq, H, Sk)
    e = (do * (rounded.to(q.dtype) - out)).sum(-1)  # (..., Sq, H)
    pe = p * e.unsqueeze(-1) * call.scale
    group = q.shape[-2] // k.shape[-2]
    b = "b" if lead else ""
    dq = -torch.einsum(f"{b}qhk,{b}khd->{b}qhd", pe, k.repeat_interleave(group, dim=-2))
    dk = -torch.einsum(f"{b}qhk,{b}qhd->{b}khd", pe, q)
    dk = dk.unflatten(-2, (k.shape[-2], group)).sum(-2)
    return [grads[0] + dq, grads[1] + dk, grads[2]]


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [BF, FP])
def test_dense(dtype, d):
    _case(dtype, 2, 200, 264, 2, 2, d)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq,sk", [(256, 256), (200, 333), (333, 130), (64, 64), (63, 65), (65, 1), (1, 129)])
def test_causal(d, sq, sk):
    _case(BF, 2, sq, sk, 2, 2, d, causal=True)


@pytest.mark.parametrize("sq,sk", [(0, 64), (1, 1), (1, 64), (64, 0), (127, 129), (129, 127)])
def test_degenerate_lengths(sq, sk):
    _case(FP, 1, sq, sk, 1, 1, 64)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 1), (8, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(hq, hkv, causal):
    _case(BF, 2, 190, 260, hq, hkv, 128, causal=causal)


@pytest.mark.parametrize("d,dv", [(128, 64), (64, 128), (192, 128)])
def test_dv_differs(d, dv):
    _case(FP, 1, 160, 200, 2, 2, d, dv)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen(d, causal):
    _case(BF, 5, 300, 280, 4, 2, d, varlen=True, causal=causal)


def test_varlen_empty_sequences():
    _case(BF, 4, 0, 0, 2, 1, 64, varlen=True, lens=([0, 70, 1, 130], [5, 0, 64, 129]))


@pytest.mark.parametrize("varlen", [False, True])
def test_seqused_k(varlen):
    _case(BF, 3, 150, 300, 2, 2, 128, varlen=varlen, seqused=True, causal=varlen)


@pytest.mark.parametrize("left,right,causal", [(32, -1, True), (50, 20, False), (-1, 0, False), (0, 0, False),
                                               (100, 7, False)])
def test_window(left, right, causal):
    _case(BF, 2, 300, 260, 2, 1, 64, left=left, right=right, causal=causal)


@pytest.mark.parametrize("d", [64, 128])
def test_softcap(d):
    _case(BF, 2, 200, 250, 2, 2, d, softcap=15.0, causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic(d, causal):
    _case(BF, 2, 333, 300, 4, 2, d, causal=causal, deterministic=True)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("large", [False, True])
def test_tiles_and_buffers(d, stages, large):
    # one Q / dO buffer (the GPUs whose shared memory holds no second) and two; the tiles of the
    # ~99 KB GPUs and the large ones of sm_80 / Hopper
    _case(BF, 2, 300, 200, 4, 2, d, causal=True, stages=stages, large_tiles=large)
    _case(FP, 3, 100, 170, 2, 1, d, varlen=True, stages=stages, large_tiles=large, deterministic=True)


@pytest.mark.parametrize("name", ["alibi_doc_causal", "softcap_window", "bias_bf16_doc2d", "bucketed_chunked",
                                  "transcendental_bool_table"])
def test_mods(name):
    # score_mod (with its traced derivative) and mask_mod inlined per element (tests/_mod_cases.py)
    from _mod_cases import cases

    score_mod, mask_mod = cases("cuda")[name]
    _case(BF, 2, 70, 70, 3, 3, 64, score_mod=score_mod, mask_mod=mask_mod)
    _case(FP, 2, 70, 70, 3, 1, 128, score_mod=score_mod, mask_mod=mask_mod, deterministic=True)


@pytest.mark.parametrize("block", [(64, 64), (128, 128), (32, 96)])
@pytest.mark.parametrize("d", [64, 128])
def test_block_mask(d, block):
    # a block mask comes with its mask_mod, which decides every element; its empty (key tile,
    # query tile) steps are skipped (deterministic: the dense walk)
    from torch_fa4 import mods as M

    mask = M.and_masks(M.causal_mask, M.sliding_window_mask(100, 0))
    _case(BF, 2, 300, 300, 2, 2, d, mask_mod=mask, block_size=block)
    _case(BF, 2, 300, 300, 2, 2, d, mask_mod=mask, block_size=block, deterministic=True)


@pytest.mark.parametrize("d", [64, 128])
def test_scalar_dq_atomics(d):
    # the one-float dQ atomics of sm_8x (Hopper's variant adds column pairs): causal with Sq != Sk
    # and GQA, a two-sided window, varlen with the last key tile cut by the sequence's end
    scalar = dict(dq_pair_adds=False)
    _case(BF, 2, 300, 333, 4, 2, d, causal=True, tuning=scalar)
    _case(BF, 2, 300, 260, 2, 1, d, left=50, right=20, tuning=scalar)
    _case(FP, 3, 100, 170, 2, 1, d, varlen=True, causal=True, tuning=scalar)


def test_deterministic_varlen_window():
    _case(FP, 4, 300, 280, 2, 2, 64, varlen=True, left=40, right=10, deterministic=True)


# ---- through torch_fa4.attention with the portable kernels selected (forward and backward)

@pytest.mark.parametrize("causal,deterministic", [(False, False), (True, True)])
def test_through_attention(monkeypatch, causal, deterministic):
    import torch_fa4
    from torch_fa4 import dispatch
    from torch_fa4.kernels import portable

    if getattr(portable, "forward", None) is None:
        pytest.skip("the portable forward is not in this tree")
    monkeypatch.setenv("TORCH_FA4_BACKEND", "portable")
    b, sq, sk, hq, hkv, d = 2, 257, 190, 4, 2, 128
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=BF, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=BF, requires_grad=True)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=BF, requires_grad=True)
    call = AttentionCall(q=q, k=k, v=v, scale=1 / math.sqrt(d), causal=causal)
    assert dispatch.kernel_for(call, "backward").__name__ == "torch_fa4.kernels.portable.bwd"
    do = torch.randn(b, sq, hq, d, device="cuda", dtype=BF)
    out = torch_fa4.attention(q, k, v, causal=causal, deterministic=deterministic)
    got = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, _ = naive_varlen(q64, k64, v64, causal=causal, differentiable=True)
    ref = torch.autograd.grad(out64, (q64, k64, v64), do.double())
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert not torch.isnan(g).any(), name
        err = ((g.double() - r).norm() / r.norm()).item()
        assert err < 2e-2, f"{name}: relative error {err:.3e}"
