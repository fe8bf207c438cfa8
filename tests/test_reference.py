"""The public API on the CPU (the reference path) against float64 math, feature by feature."""

import math

import pytest
import torch

import torch_fa4
from naive import naive_attention, rel_error


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def check(out, lse, ref_out, ref_lse, tol):
    assert rel_error(out, ref_out) < tol
    alive = ref_lse > -math.inf
    assert torch.equal(lse.isinf(), ~alive), "fully masked rows must have lse -inf, others finite"
    assert rel_error(lse[alive], ref_lse[alive]) < tol


TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(causal=True),
        dict(causal=True, sq=23, sk=57),  # bottom-right aligned
        dict(causal=True, sq=57, sk=23),  # leading rows fully masked
        dict(window=(7, 3)),
        dict(window=(5, -1), causal=True),
        dict(window=(-1, 0)),
        dict(softcap=4.0),
        dict(scale=0.3),
        dict(hkv=1),  # MQA
        dict(hkv=2, causal=True, softcap=2.5),  # GQA
        dict(dv=32),
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain",
)
def test_dense_features(dtype, case):
    B, H, D = 2, 4, 64
    sq, sk = case.get("sq", 33), case.get("sk", 41)
    hkv, dv = case.get("hkv", H), case.get("dv", D)
    q, k, v = rand(B, sq, H, D, dtype=dtype), rand(B, sk, hkv, D, dtype=dtype), rand(B, sk, hkv, dv, dtype=dtype)
    window = case.get("window", (-1, -1))
    out, lse = torch_fa4.attention(
        q, k, v, causal=case.get("causal", False), window_size=window, softcap=case.get("softcap", 0.0),
        scale=case.get("scale"), return_lse=True,
    )
    assert out.shape == (B, sq, H, dv) and out.dtype == dtype
    assert lse.shape == (B, H, sq) and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ref_out, ref_lse = naive_attention(q, k, v, causal=case.get("causal", False), window=window,
                                       softcap=case.get("softcap", 0.0), scale=case.get("scale"))
    check(out, lse, ref_out, ref_lse, max(TOL[dtype], 2e-6))


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = rand(1, 8, 2, 64), rand(1, 4, 2, 64), rand(1, 4, 2, 64)
    out, lse = torch_fa4.attention(q, k, v, causal=True, return_lse=True)  # rows 0..3 see nothing
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.isneginf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()


def test_long_sequence_is_chunked_and_exact():
    # 3000 keys cross several KV chunks; 1500 queries cross query chunks for this head count.
    q, k, v = rand(1, 1500, 2, 64, dtype=torch.float64), rand(1, 3000, 2, 64, dtype=torch.float64), rand(1, 3000, 2, 64, dtype=torch.float64)
    out, lse = torch_fa4.attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = naive_attention(q, k, v, causal=True)
    check(out, lse, ref_out, ref_lse, 1e-12)


def test_reference_memory_is_linear_in_sequence():
    from torch_fa4 import reference

    # The largest score chunk must stay bounded however long the sequence is.
    for s in (1 << 12, 1 << 16, 1 << 20):
        qc, kc = reference._chunk_sizes(1, 16, s, s)
        assert qc * kc * 16 <= reference._CHUNK_ELEMENTS


def _varlen_pack(lengths, H, D, dtype=torch.float64):
    seqs = [rand(n, H, D, dtype=dtype) for n in lengths]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return seqs, torch.cat(seqs) if seqs else rand(0, H, D, dtype=dtype), cu


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_per_sequence(causal):
    lq, lk = [5, 0, 17, 9], [7, 3, 17, 30]
    H, Hkv, D = 4, 2, 32
    qs, q, cu_q = _varlen_pack(lq, H, D)
    ks, k, cu_k = _varlen_pack(lk, Hkv, D)
    vs, v, _ = _varlen_pack(lk, Hkv, D)
    out, lse = torch_fa4.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, softcap=3.0,
                                   return_lse=True)
    assert out.shape == q.shape and lse.shape == (H, q.shape[0])
    for i in range(len(lq)):
        if lq[i] == 0:
            continue
        ro, rl = naive_attention(qs[i][None], ks[i][None], vs[i][None], causal=causal, softcap=3.0)
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        check(out[rows], lse[:, rows], ro[0], rl[0], 1e-7)


@pytest.mark.parametrize("hkv", [1, 2, 4])
@pytest.mark.parametrize(
    "lengths",
    [([129, 0], [129, 0]), ([0, 7], [0, 7]), ([5, 0, 3], [6, 0, 3]), ([4, 3], [0, 5]), ([0, 0], [0, 0]),
     ([1, 0, 1], [1, 2, 0])],
    ids=["last-empty", "first-empty", "middle-empty", "no-keys", "all-empty", "one-token"],
)
def test_varlen_backward_with_empty_sequences(lengths, hkv):
    """Sequences of length 0 at any position of a packed batch (with GQA) give zero gradients for
    their rows and keys, and the others match float64 autograd sequence by sequence."""
    lq, lk = lengths
    H, D = 4, 32
    qs, q, cu_q = _varlen_pack(lq, H, D)
    ks, k, cu_k = _varlen_pack(lk, hkv, D)
    vs, v, _ = _varlen_pack(lk, hkv, D)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = torch_fa4.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                              max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for i in range(len(lq)):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        qi, ki, vi = (x.detach().clone().requires_grad_() for x in (qs[i][None], ks[i][None], vs[i][None]))
        ref, _ = naive_attention(qi, ki, vi, causal=True, differentiable=True)
        if ref.numel() == 0:
            ref_grads = (torch.zeros_like(qi), torch.zeros_like(ki), torch.zeros_like(vi))
        else:
            ref_grads = torch.autograd.grad(ref, (qi, ki, vi), dout[rows][None], allow_unused=True)
            ref_grads = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(ref_grads, (qi, ki, vi)))
        for got, want in zip((dq[rows], dk[keys], dv[keys]), ref_grads):
            assert not got.isnan().any()
            torch.testing.assert_close(got, want[0], atol=1e-9, rtol=1e-7)


def test_seqused_k_limits_keys_per_batch():
    q, k, v = rand(3, 4, 2, 64, dtype=torch.float64), rand(3, 20, 2, 64, dtype=torch.float64), rand(3, 20, 2, 64, dtype=torch.float64)
    used = torch.tensor([20, 6, 0], dtype=torch.int32)
    out, lse = torch_fa4.attention(q, k, v, seqused_k=used, causal=True, return_lse=True)
    ref_out, ref_lse = naive_attention(q, k, v, causal=True, seqlen_k=[20, 6, 0])
    check(out, lse, ref_out, ref_lse, 1e-7)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_zero_length_inputs_give_empty_results():
    q, k, v = rand(2, 0, 2, 64), rand(2, 5, 2, 64), rand(2, 5, 2, 64)
    out, lse = torch_fa4.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 0, 2, 64) and lse.shape == (2, 2, 0)
    q, k, v = rand(2, 3, 2, 64), rand(2, 0, 2, 64), rand(2, 0, 2, 64)
    out, lse = torch_fa4.attention(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    q, k, v = rand(0, 3, 2, 64), rand(0, 3, 2, 64), rand(0, 3, 2, 64)
    assert torch_fa4.attention(q, k, v).shape == (0, 3, 2, 64)


def test_strided_views_need_no_copy():
    # SDPA/flex layout (B, H, S, D) viewed as (B, S, H, D): non-contiguous, last dim contiguous.
    q = rand(2, 4, 19, 64, dtype=torch.float64).transpose(1, 2)
    k = rand(2, 4, 23, 64, dtype=torch.float64).transpose(1, 2)
    v = rand(2, 4, 23, 64, dtype=torch.float64).transpose(1, 2)
    assert not q.is_contiguous()
    out = torch_fa4.attention(q, k, v, causal=True)
    ref, _ = naive_attention(q, k, v, causal=True)
    assert rel_error(out, ref) < 1e-12


def test_flex_attention_signature_and_layout():
    B, H, S, D = 2, 4, 21, 64
    q, k, v = rand(B, H, S, D, dtype=torch.float64), rand(B, 2, S, D, dtype=torch.float64), rand(B, 2, S, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="enable_gqa"):
        torch_fa4.flex_attention(q, k, v)
    out, lse = torch_fa4.flex_attention(q, k, v, enable_gqa=True, scale=0.2, return_lse=True)
    ref_out, ref_lse = naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.2)
    assert out.shape == (B, H, S, D)
    check(out.transpose(1, 2), lse, ref_out, ref_lse, 1e-7)


def test_flex_attention_matches_torch_flex_on_cpu():
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    B, H, S, D = 1, 2, 16, 32
    q, k, v = rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D)
    ours = torch_fa4.flex_attention(q, k, v)
    theirs = torch_flex(q, k, v)
    assert rel_error(ours, theirs) < 1e-5


def test_varlen_under_inference_mode_sees_every_write():
    """Offsets made under torch.inference_mode have no version counter: each call reads them anew,
    so one changed in place is never answered from a stale memo."""
    H, D = 2, 32
    q, k, v = rand(12, H, D, dtype=torch.float64), rand(12, H, D, dtype=torch.float64), rand(12, H, D, dtype=torch.float64)
    with torch.inference_mode():
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        for split in (5, 9):
            cu[1] = split
            out = torch_fa4.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=12,
                                      max_seqlen_k=12, causal=True)
            for rows in (slice(0, split), slice(split, 12)):
                ref, _ = naive_attention(q[rows][None], k[rows][None], v[rows][None], causal=True)
                torch.testing.assert_close(out[rows], ref[0])
