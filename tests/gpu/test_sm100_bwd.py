"""sm100 backward kernel against float64 autograd on fresh random inputs (needs a Blackwell GPU,
compute capability 10.0; skipped elsewhere).

The kernel is launched directly (kernels.sm100.bwd.backward, no self-check in between), with the
float64 forward's out and LSE. Every test draws new inputs, poisons dq / dk / dv with NaN before
the launch, and requires each gradient's relative error (norm) to be at most twice that of eager
autograd in the input dtype, both against float64 (plus a small floor for gradients that are all
but zero). Covers every feature the sm100 backward advertises: head dims 64 / 96 / 128 (Dv may
differ), both dtypes, causal, window, softcap, GQA / MQA, varlen, seqused_k, deterministic dQ
(bitwise equal over two runs), score_mod (derivative from the traced graph), mask_mod, block masks
driving the walk (and walked densely in deterministic mode), and degenerate lengths (1, a tile
+- 1, empty sequences, keys no query sees).
"""

from __future__ import annotations

import math

import pytest
import torch

from bwd_mod_cases import MOD_CASES, _alibi, _documents, slopes_and_documents
from _mod_call_fields import mod_call_fields
from gpu_harness import SM100_ONLY
from naive import call_options, naive_varlen
from torch_fa4.call import AttentionCall

pytestmark = SM100_ONLY

BF, FP = torch.bfloat16, torch.float16


def _rel(got, ref):
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _case(dtype=BF, b=2, sq=333, sk=333, hq=4, hkv=2, d=128, dv=None, causal=False, left=-1, right=-1,
          softcap=0.0, varlen=False, seqused=False, deterministic=False, lens=None, score_mod=None,
          mask_mod=None, block_size=None, expect_sparse=None):
    """block_size: also hand the kernel a block mask of mask_mod at that (q, kv) tile size;
    expect_sparse: the (query steps, key tiles) per block-mask tile the walk must take (None: dense)."""
    from torch_fa4.kernels.sm100 import bwd

    dv = dv or d

    dev = "cuda"
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=torch.float64)  # noqa: E731
    cu_q = cu_k = used = None
    if varlen:
        if lens is None:
            lens = (torch.randint(1, sq + 1, (b,)).tolist(), torch.randint(1, sk + 1, (b,)).tolist())
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device=dev)
                      for x in lens)
        q, k, v = rnd(int(cu_q[-1]), hq, d), rnd(int(cu_k[-1]), hkv, d), rnd(int(cu_k[-1]), hkv, dv)
        do = rnd(int(cu_q[-1]), hq, dv)
        sq, sk = max(lens[0]), max(lens[1])
    else:
        q, k, v, do = rnd(b, sq, hq, d), rnd(b, sk, hkv, d), rnd(b, sk, hkv, dv), rnd(b, sq, hq, dv)
        if seqused:
            used = torch.randint(0, sk + 1, (b,), device=dev, dtype=torch.int32)
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    mod_kw = mod_call_fields(score_mod, mask_mod, block_size, sq, sk)
    call = AttentionCall(q=q, k=k, v=v, scale=1.0 / math.sqrt(d), causal=causal, window_left=left,
                         window_right=right, softcap=softcap, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         seqused_k=used, max_seqlen_q=sq if varlen else 0, max_seqlen_k=sk if varlen else 0,
                         **mod_kw)
    assert bwd.unsupported_reason(call) is None, bwd.unsupported_reason(call)
    assert bwd.variant_key(call, deterministic).sparse == expect_sparse
    mods = dict(score_mod=score_mod, mask_mod=mask_mod)

    # float64 forward + autograd: the oracle, and the out / lse a forward pass hands over
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse = naive_varlen(q64, k64, v64, **call_options(call), **mods, differentiable=True)
    want = torch.autograd.grad(out64, (q64, k64, v64), do.double())
    # eager autograd in the input dtype: the error budget
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out_low, _ = naive_varlen(ql, kl, vl, **call_options(call), **mods, differentiable=True)
    eager = torch.autograd.grad(out_low, (ql, kl, vl), do)
    out = out64.detach().to(dtype).contiguous()
    lse = lse.detach().float().contiguous()

    runs = []
    for _ in range(2 if deterministic else 1):
        got = [torch.full(t.shape, math.nan, dtype=dtype, device=dev) for t in (q, k, v)]
        bwd.backward(call, do, out, lse, *got, deterministic)
        torch.cuda.synchronize()
        runs.append(got)
    if deterministic:
        for a, c in zip(*runs):
            assert torch.equal(a, c), "deterministic mode gave two different results"
    for name, g, w, e in zip(("dq", "dk", "dv"), runs[0], want, eager):
        assert not torch.isnan(g).any(), f"{name} has NaN (unwritten or NaN math)"
        err, eager_err = _rel(g, w), _rel(e, w)
        assert err <= 2 * eager_err + 1e-3, f"{name}: relative error {err:.3e} vs eager {eager_err:.3e}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF, FP])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_dense(d, dtype, causal):
    _case(dtype, d=d, causal=causal)


@pytest.mark.parametrize("sq, sk", [(1, 1), (1, 300), (127, 129), (128, 128), (129, 127), (300, 40),
                                    (40, 300)])
def test_odd_lengths(sq, sk):
    _case(sq=sq, sk=sk, causal=True)
    _case(sq=sq, sk=sk, d=64, hq=6, hkv=3)


@pytest.mark.parametrize("hq, hkv", [(1, 1), (8, 1), (6, 2)])
def test_gqa_mqa(hq, hkv):
    _case(hq=hq, hkv=hkv, d=96, causal=True)


@pytest.mark.parametrize("left, right, causal", [(100, 20, False), (0, 0, False), (200, -1, True),
                                                 (-1, 50, False)])
def test_window(left, right, causal):
    _case(left=left, right=right, causal=causal, sq=400, sk=500)


def test_softcap():
    _case(softcap=15.0, causal=True)
    _case(FP, d=64, softcap=5.0)


def test_varlen():
    _case(varlen=True, b=3, sq=500, sk=500, causal=True)
    _case(varlen=True, b=3, d=64, lens=([1, 129, 300], [300, 1, 128]))
    _case(varlen=True, b=2, d=96, lens=([0, 200], [50, 0]), hq=4, hkv=1)  # empty sequences


def test_seqused_k():
    _case(seqused=True, sk=400)
    _case(seqused=True, causal=True, d=64)


@pytest.mark.parametrize("features", [dict(), dict(causal=True), dict(left=64, right=0),
                                      dict(varlen=True, causal=True)])
def test_deterministic(features):
    _case(deterministic=True, sq=700, sk=700, hq=4, hkv=1, **features)


def test_head_dims_differ():
    _case(d=128, dv=64, causal=True)
    _case(d=64, dv=128, hq=4, hkv=1)
    _case(d=96, dv=128, varlen=True, b=2, sq=300, sk=300)


@pytest.mark.parametrize("make_mods, causal", MOD_CASES)
def test_mods(make_mods, causal):
    slopes, doc = slopes_and_documents()
    score_mod, mask_mod = make_mods(slopes, doc)
    _case(sq=200, sk=300, causal=causal, score_mod=score_mod, mask_mod=mask_mod)


@pytest.mark.parametrize("deterministic", [False, True])
def test_block_mask(deterministic):
    """128 x 128 blocks drive the walk (partial tiles evaluate the mask_mod, full ones do not);
    deterministic mode walks densely with the mask_mod everywhere."""
    doc = torch.sort(torch.randint(0, 4, (600,), device="cuda")).values.to(torch.int32)
    _, mask_mod = _documents(None, doc)
    _case(sq=600, sk=600, d=64, mask_mod=mask_mod, block_size=128, deterministic=deterministic,
          expect_sparse=None if deterministic else (1, 1))
    slopes = torch.rand(4, device="cuda")
    _case(sq=600, sk=600, d=96, hq=4, hkv=1, score_mod=_alibi(slopes, doc)[0], mask_mod=mask_mod,
          block_size=(256, 128), deterministic=deterministic, expect_sparse=None if deterministic else (2, 1))
