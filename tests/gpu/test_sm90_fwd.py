"""sm90 forward kernel against float64 attention on fresh random inputs.

Every test draws new inputs, poisons out/lse with NaN before the launch, and requires the kernel's
error to be at most twice that of eager attention in the input dtype (both against float64).
"""

import math

import pytest
import torch

from torch_fa4.call import AttentionCall

cuda_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_sm90, reason="needs a CUDA sm_90 device"),
]


def _attention_dense(q, k, v, scale, causal, wl, wr, softcap, seqlen_k_used=None, dtype=torch.float64):
    """q (Sq, H, D), k/v (Sk, Hkv, D) of one sequence -> out (Sq, H, Dv), lse (H, Sq); in `dtype`."""
    Sq, H, _ = q.shape
    Sk, Hkv, _ = k.shape
    qq, kk, vv = (t.to(dtype).transpose(0, 1) for t in (q, k, v))
    kk = kk.repeat_interleave(H // Hkv, 0)
    vv = vv.repeat_interleave(H // Hkv, 0)
    s = (qq @ kk.transpose(-1, -2)).to(torch.float64 if dtype == torch.float64 else dtype) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq, device=q.device)[:, None]
    j = torch.arange(Sk, device=q.device)[None, :]
    diag = i + (Sk - Sq)
    vis = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        vis &= j <= diag
    if wl >= 0:
        vis &= j >= diag - wl
    if wr >= 0:
        vis &= j <= diag + wr
    if seqlen_k_used is not None:
        vis &= j < seqlen_k_used
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s.double(), -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = (p.to(vv.dtype) @ vv).transpose(0, 1)
    return out, lse.float()


def _reference(call: AttentionCall, dtype):
    scale, c = call.scale, call
    if not call.is_varlen:
        outs, lses = [], []
        for b in range(call.q.shape[0]):
            used = None if call.seqused_k is None else int(call.seqused_k[b])
            o, l = _attention_dense(call.q[b], call.k[b], call.v[b], scale, c.causal, c.window_left,
                                    c.window_right, c.softcap, used, dtype)
            outs.append(o)
            lses.append(l)
        return torch.stack(outs), torch.stack(lses)
    cq, ck = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
    out = torch.zeros(call.q.shape[0], call.num_heads, call.head_dim_v, dtype=dtype, device=call.q.device)
    lse = torch.full((call.num_heads, call.q.shape[0]), -math.inf, device=call.q.device)
    for b in range(len(cq) - 1):
        used = None if call.seqused_k is None else int(call.seqused_k[b])
        o, l = _attention_dense(call.q[cq[b]:cq[b + 1]], call.k[ck[b]:ck[b + 1]], call.v[ck[b]:ck[b + 1]],
                                scale, c.causal, c.window_left, c.window_right, c.softcap, used, dtype)
        out[cq[b]:cq[b + 1]] = o
        lse[:, cq[b]:cq[b + 1]] = l
    return out, lse


def _run_kernel(call: AttentionCall, **overrides):
    from torch_fa4.kernels.sm90 import fwd_host

    assert fwd_host.unsupported_reason(call) is None, fwd_host.unsupported_reason(call)
    out = torch.full(call.out_shape(), float("nan"), dtype=call.q.dtype, device="cuda")
    lse = torch.full(call.lse_shape(), float("nan"), dtype=torch.float32, device="cuda")
    fwd_host.forward(call, out, lse, **overrides)
    torch.cuda.synchronize()
    return out, lse


def _check(call: AttentionCall, **overrides):
    out, lse = _run_kernel(call, **overrides)
    assert not out.isnan().any(), "unwritten or NaN output"
    assert not lse.isnan().any(), "unwritten or NaN lse"
    ref_out, ref_lse = _reference(call, torch.float64)
    eager_out, _ = _reference(call, call.q.dtype)
    err = (out.double() - ref_out).abs().max().item()
    eager_err = (eager_out.double() - ref_out).abs().max().item()
    assert err <= 2 * eager_err + 1e-4, f"kernel err {err:.3e} vs eager {eager_err:.3e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse -inf pattern differs"
    assert torch.equal(lse[~finite], ref_lse[~finite])
    if finite.any():
        assert (lse[finite] - ref_lse[finite]).abs().max().item() < 2e-3
    return err, eager_err


def _dense_call(B, Sq, Sk, H, Hkv, D, dtype=torch.bfloat16, **kw):
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype)
    return AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 96, 128, 192, 256])
def test_dense_head_dims(dtype, D):
    _check(_dense_call(2, 300, 517, 4, 4, D, dtype))


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Sq,Sk", [(512, 512), (200, 700), (700, 200), (1, 333)])
def test_causal(D, Sq, Sk):
    _check(_dense_call(2, Sq, Sk, 3, 3, D, causal=True))


@pytest.mark.parametrize("H,Hkv", [(8, 2), (6, 1)])
def test_gqa_mqa(H, Hkv):
    _check(_dense_call(2, 257, 383, H, Hkv, 128, causal=True))


@pytest.mark.parametrize("wl,wr", [(64, 0), (100, 37), (-1, 50), (130, -1)])
def test_window(wl, wr):
    _check(_dense_call(2, 400, 450, 2, 2, 128, window_left=wl, window_right=wr))


def test_window_causal_gqa_d64():
    _check(_dense_call(1, 333, 333, 4, 2, 64, causal=True, window_left=100, window_right=-1))


@pytest.mark.parametrize("D", [64, 128])
def test_softcap(D):
    q = torch.randn(2, 300, 4, D, device="cuda", dtype=torch.bfloat16) * 3
    k = torch.randn(2, 300, 4, D, device="cuda", dtype=torch.bfloat16) * 3
    v = torch.randn(2, 300, 4, D, device="cuda", dtype=torch.bfloat16)
    _check(AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, softcap=5.0, causal=True))


def test_strided_views():
    # (B, H, S, D) tensors viewed as (B, S, H, D): no copies, non-contiguous strides
    B, H, S, D = 2, 4, 333, 128
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kv = torch.randn(B, H, S, 2 * D, device="cuda", dtype=torch.bfloat16)
    k, v = kv[..., :D].transpose(1, 2), kv[..., D:].transpose(1, 2)
    _check(AttentionCall(q=q, k=k, v=v, scale=0.1, causal=True))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_varlen(causal, D):
    lens_q = [1, 130, 257, 64, 500]
    lens_k = [5, 129, 300, 64, 400]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    H, Hkv = 4, 2
    q = torch.randn(sum(lens_q), H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), Hkv, D, device="cuda", dtype=torch.bfloat16)
    _check(AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, causal=causal, cu_seqlens_q=cu_q,
                         cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k)))


def test_seqused_k_dense():
    call = _dense_call(3, 100, 512, 2, 2, 128)
    call.seqused_k = torch.tensor([512, 77, 300], dtype=torch.int32, device="cuda")
    _check(call)


@pytest.mark.parametrize("opts", [
    dict(rescale_threshold=8.0),
    dict(exp2_emulate_every=4),
    dict(rescale_threshold=8.0, exp2_emulate_every=2, pingpong=False),
])
def test_softmax_options(opts):
    _check(_dense_call(2, 640, 640, 4, 4, 64, causal=True), **opts)
    _check(_dense_call(2, 300, 900, 4, 4, 128), **opts)
