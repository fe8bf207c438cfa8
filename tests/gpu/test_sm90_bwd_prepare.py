"""GPU: the fused row statistics of the sm90 backward (kernels/sm90/bwd_prepare.py) on the device.

Fresh random dO / O / lse each case (some rows at lse = -inf), output buffers poisoned with NaN,
then compared with float64: lse2 = lse * log2 e (-inf -> +inf) and dpsum = rowsum(dO * O) in the
padded (B, H, rows) / (H, rows) layout, padding exactly +inf / 0. Dense, varlen, per-sequence
slices (as the varlen backward hands them), strided dO / O views, every Dv, fp16 and bf16. Then
bwd_row_stats.row_statistics on CUDA against its torch path on the same data, and torch_fa4.attention's
backward against float64 autograd with the fused path active.
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu_harness import ON_SM90, gpu_marks
from naive import naive_attention
from torch_fa4.call import AttentionCall

pytestmark = gpu_marks(ON_SM90, "needs an sm_90 GPU")

DVS = (64, 96, 128, 192, 256)
LOG2E = math.log2(math.e)


def _rand(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=torch.float64).to(dtype)


def _lse(*shape):
    lse = torch.randn(*shape, device="cuda") * 4
    lse.view(-1)[torch.randperm(lse.numel(), device="cuda")[: max(1, lse.numel() // 10)]] = -math.inf
    return lse


def _inputs(layout, dv, dtype):
    """(dout, out, lse) for one layout; dout/out are views with a unit last stride."""
    b, s, h = 3, 150, 5
    if layout == "dense":
        return _rand(b, s, h, dv, dtype=dtype), _rand(b, s, h, dv, dtype=dtype), _lse(b, h, s)
    if layout == "dense_bhsd_views":  # (B, H, S, Dv).transpose(1, 2), as flex/SDPA hand them
        return (_rand(b, h, s, dv, dtype=dtype).transpose(1, 2), _rand(b, h, s, dv, dtype=dtype).transpose(1, 2),
                _lse(b, h, s))
    if layout == "dense_wide_rows":  # Dv columns of wider rows, a head-sliced buffer
        return (_rand(b, s, h + 2, dv + 24, dtype=dtype)[:, :, 1 : h + 1, 8 : dv + 8],
                _rand(b, s, h, 2 * dv, dtype=dtype)[..., dv:], _lse(b, h, s))
    if layout == "varlen":
        t = 211
        return _rand(t, h, dv, dtype=dtype), _rand(t, h, dv, dtype=dtype), _lse(h, t)
    if layout == "varlen_strided":
        t = 97
        return (_rand(t, 2 * h, dv, dtype=dtype)[:, ::2], _rand(h, t, dv, dtype=dtype).transpose(0, 1), _lse(h, t))
    if layout == "per_sequence":  # bwd._backward_per_sequence: row slices of packed tensors
        t, lo, hi = 300, 37, 238  # lse starts at a 4-byte (not 16-byte) offset
        do, o, lse = _rand(t, h, dv, dtype=dtype), _rand(t, h, dv, dtype=dtype), _lse(h, t)
        return do[lo:hi].unsqueeze(0), o[lo:hi].unsqueeze(0), lse[:, lo:hi].unsqueeze(0)
    raise ValueError(layout)


def _reference(dout, out, lse, rows):
    """float64 (lse2, dpsum, |dO*O| row sums) in the padded layout."""
    dot = dout.double() * out.double()
    dp, absdot = dot.sum(-1), dot.abs().sum(-1)
    dp, absdot = (dp.transpose(0, 1), absdot.transpose(0, 1)) if dout.dim() == 3 else (dp.transpose(1, 2), absdot.transpose(1, 2))
    s = lse.shape[-1]
    pad = lambda x, v: torch.cat([x, torch.full((*x.shape[:-1], rows - s), v, dtype=x.dtype, device=x.device)], -1)
    lse2 = torch.where(lse == -math.inf, math.inf, lse.double() * LOG2E)
    return pad(lse2, math.inf), pad(dp, 0.0), pad(absdot, 0.0)


def _check(lse2, dpsum, dout, out, lse, rows):
    want_lse2, want_dp, absdot = _reference(dout, out, lse, rows)
    s = lse.shape[-1]
    assert not torch.isnan(lse2).any() and not torch.isnan(dpsum).any(), "unwritten (NaN) entries"
    assert (lse2[..., s:] == math.inf).all() and (dpsum[..., s:] == 0).all(), "padding rows"
    noinf = lse == -math.inf
    assert (lse2[..., :s][noinf] == math.inf).all(), "-inf rows must become +inf"
    # the torch path's fp32 product, bit for bit, and float64 within fp32 rounding
    assert torch.equal(lse2[..., :s][~noinf], (lse * LOG2E)[~noinf])
    torch.testing.assert_close(lse2.double(), want_lse2, rtol=2e-7, atol=0)
    # fp32 products of 16-bit inputs are exact; a sum of Dv of them errs by < Dv ulps of sum|dO*O|
    dv = dout.shape[-1]
    err = (dpsum.double() - want_dp).abs()
    bound = dv * 2.0**-24 * absdot + 1e-30
    assert (err <= bound).all(), f"dpsum error {(err / bound).max():.2f} x the fp32 summation bound"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dv", DVS)
@pytest.mark.parametrize("layout", ["dense", "dense_bhsd_views", "dense_wide_rows", "varlen", "varlen_strided",
                                    "per_sequence"])
def test_fused_row_statistics_match_float64(layout, dv, dtype):
    from torch_fa4.kernels.sm90 import bwd_prepare

    dout, out, lse = _inputs(layout, dv, dtype)
    assert bwd_prepare.unsupported_reason(dout, out, lse) is None, bwd_prepare.unsupported_reason(dout, out, lse)
    s = lse.shape[-1]
    for rows in (math.ceil(s / 64) * 64, math.ceil(s / 64) * 64 + 128, s):  # exact fit too: no padding
        lse2 = torch.full((*lse.shape[:-1], rows), math.nan, device="cuda")
        dpsum = torch.full_like(lse2, math.nan)
        bwd_prepare.row_statistics_into(dout, out, lse, lse2, dpsum)
        torch.cuda.synchronize()
        _check(lse2, dpsum, dout, out, lse, rows)


def _call(dout, varlen):
    q = torch.empty(dout.shape, dtype=dout.dtype, device="cuda")
    cu = torch.tensor([0, 50, dout.shape[0]], dtype=torch.int32, device="cuda") if varlen else None
    return AttentionCall(q=q, k=q, v=q, scale=1.0, cu_seqlens_q=cu, cu_seqlens_k=cu)


@pytest.mark.parametrize("varlen,min_rows", [(False, 0), (False, 384), (True, 0)])
def test_backward_host_uses_fused_path_and_matches_torch_path(varlen, min_rows, monkeypatch):
    from torch_fa4.kernels.sm90 import bwd_prepare
    from torch_fa4.kernels.sm90 import bwd_row_stats as bwd

    calls = []
    real = bwd_prepare.row_statistics_into
    monkeypatch.setattr(bwd_prepare, "row_statistics_into", lambda *a: calls.append(1) or real(*a))
    dout, out, lse = _inputs("varlen" if varlen else "dense_bhsd_views", 128, torch.bfloat16)
    call = _call(dout, varlen)
    lse2, dpsum, rows = bwd.row_statistics(call, dout, out, lse, min_rows)
    assert calls, "the fused kernel did not run"
    cpu = lambda t: t.cpu()
    call_cpu = AttentionCall(q=call.q.cpu(), k=call.q.cpu(), v=call.q.cpu(), scale=1.0,
                             cu_seqlens_q=call.cu_seqlens_q.cpu() if varlen else None)
    lse2_t, dpsum_t, rows_t = bwd.row_statistics(call_cpu, cpu(dout), cpu(out), cpu(lse), min_rows)
    assert rows == rows_t and lse2.shape == lse2_t.shape and dpsum.shape == dpsum_t.shape
    assert lse2.is_contiguous() and dpsum.is_contiguous()
    assert torch.equal(lse2.cpu(), lse2_t)  # same fp32 product, same +inf rows and padding
    torch.testing.assert_close(dpsum.cpu(), dpsum_t, rtol=1e-5, atol=1e-5)
    padding = torch.ones(dpsum.shape[-1], dtype=torch.bool)
    if varlen:  # each sequence's rows at its tile-aligned offset (bwd_row_stats.varlen_stat_layout)
        cu = call.cu_seqlens_q.tolist()
        for first, start, end in zip(bwd.stat_row_offsets(call.cu_seqlens_q, bwd.TILE_M).tolist(), cu, cu[1:]):
            padding[first : first + end - start] = False
    else:
        padding[: lse.shape[-1]] = False
    assert (dpsum[..., padding] == 0).all() and (lse2[..., padding] == math.inf).all()


def test_expanded_gradient_takes_the_torch_path(monkeypatch):
    """autograd hands `out.sum()`'s gradient over as an expanded (all strides 0) tensor."""
    from torch_fa4.kernels.sm90 import bwd_prepare
    from torch_fa4.kernels.sm90 import bwd_row_stats as bwd

    monkeypatch.setattr(bwd_prepare, "row_statistics_into", lambda *a: pytest.fail("fused path on stride-0 dO"))
    out = _rand(2, 70, 3, 64, dtype=torch.bfloat16)
    dout = torch.ones(1, 1, 1, 1, device="cuda", dtype=torch.bfloat16).expand(out.shape)
    lse = _lse(2, 3, 70)
    lse2, dpsum, rows = bwd.row_statistics(_call(dout, False), dout, out, lse)
    _check(lse2, dpsum, dout, out, lse, rows)


@pytest.mark.parametrize("d,varlen", [(128, False), (64, True), (256, False)])
def test_attention_backward_matches_float64_with_fused_statistics(d, varlen, monkeypatch):
    import torch_fa4
    from torch_fa4.kernels.sm90 import bwd_launch_record, bwd_prepare

    # count the fused pass's launches, through bwd.backward's general path and through a launch
    # record alike (no records kept from earlier tests: this one derives its own)
    calls = []
    real = bwd_prepare.compile_kernel
    counted = lambda fn: lambda *a: calls.append(1) or fn(*a)  # noqa: E731
    monkeypatch.setattr(bwd_prepare, "compile_kernel", lambda *a, **kw: counted(real(*a, **kw)))
    monkeypatch.setattr(bwd_launch_record, "_records", {})
    b, s, h = 2, 200, 4
    q, k, v = (_rand(b, s, h, d, dtype=torch.bfloat16) for _ in range(3))
    # the output gradient as a strided (B, H, S, D) transpose: the fused kernel reads it in place
    grad = _rand(b, h, s, d, dtype=torch.bfloat16).transpose(1, 2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if varlen:
        cu = torch.tensor([0, s, 2 * s], dtype=torch.int32, device="cuda")
        packed = [t.reshape(b * s, h, d) for t in leaves]
        out = torch_fa4.attention(*packed, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s,
                                  max_seqlen_k=s).view(b, s, h, d)
    else:
        out = torch_fa4.attention(*leaves, causal=True)
    out.backward(grad)
    assert calls, "the backward did not use the fused row statistics"
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    naive_attention(*ref_leaves, causal=True, differentiable=True)[0].backward(grad.double())
    for name, got, want in zip("qkv", leaves, ref_leaves):
        assert not torch.isnan(got.grad).any(), f"d{name} has NaN"
        err = ((got.grad.double() - want.grad).norm() / want.grad.norm()).item()
        assert err < 1.5e-2, f"d{name}: relative error {err:.3e}"


# ---- the last pass: dq = dq_acc * scale in the input dtype (kernels/sm90/bwd_dq_convert.py)

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [8, 2040, 2048, 2056, 3 * 517 * 5 * 64])
def test_dq_conversion_matches_torch(n, dtype):
    """Fresh fp32 values (some beyond the 16-bit range), a NaN-poisoned output: the same bits as
    torch's multiply-then-round, including a partial last CTA and a single chunk."""
    from torch_fa4.kernels.sm90 import bwd_dq_convert

    src = torch.randn(n, device="cuda") * 3
    src[:: 97] *= 1e5  # overflow to inf in fp16 alike
    dst = torch.full((n,), float("nan"), device="cuda", dtype=dtype)
    assert bwd_dq_convert.takes(src, dst)
    bwd_dq_convert.scaled_narrow(src, dst, 0.0883)
    want = (src * 0.0883).to(dtype)
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16))


def test_dq_conversion_refuses_layouts_it_cannot_read():
    from torch_fa4.kernels.sm90 import bwd_dq_convert

    src = torch.zeros(4, 64, device="cuda")
    dst = torch.zeros(4, 64, device="cuda", dtype=torch.bfloat16)
    assert bwd_dq_convert.takes(src, dst)
    assert not bwd_dq_convert.takes(src.t(), dst)  # not contiguous
    assert not bwd_dq_convert.takes(src.view(-1)[4:], dst.view(-1)[4:])  # 16-byte misaligned, odd count
    assert not bwd_dq_convert.takes(src, dst.float())  # not a 16-bit output
    assert bwd_dq_convert.takes(src[:, :60].contiguous(), dst[:, :60].contiguous())  # 240: a multiple of 8
    assert not bwd_dq_convert.takes(torch.zeros(36, device="cuda"), torch.zeros(36, device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("dv,d", [(128, 128), (64, 192), (256, 64)])
def test_fused_pass_zeroes_the_dq_buffer(dv, d):
    """The row-statistics pass zeroes the backward's (B, S, H, D) fp32 dQ buffer, NaN-poisoned
    here, and still writes the same statistics."""
    from torch_fa4.kernels.sm90 import bwd_prepare

    dout, out, lse = _inputs("dense", dv, torch.bfloat16)
    dq_acc = torch.full((*dout.shape[:3], d), math.nan, device="cuda")
    rows = math.ceil(lse.shape[-1] / 64) * 64
    lse2, dpsum = bwd_prepare.row_statistics(dout, out, lse, rows, dq_acc)
    torch.cuda.synchronize()
    assert (dq_acc == 0).all()
    _check(lse2, dpsum, dout, out, lse, rows)
