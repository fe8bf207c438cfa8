"""GPU: decode-shaped forwards (one query row per sequence against a long KV cache) on the sm_90
kernels, with the query heads of each KV head packed as rows and the keys split across SMs where
few work items would leave SMs idle, against float64 from fresh inputs with poisoned outputs."""

import pytest
import torch

import torch_fa4
from gpu_harness import SM90_ONLY, poison_forward
from naive import naive_attention, rel_error
from torch_fa4.kernels.sm90 import fwd_host

pytestmark = SM90_ONLY


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every sm90 forward launch first fills out / lse with NaN (views of the caller's tensors:
    the packed rows write through them), and is counted."""
    return poison_forward(monkeypatch, fwd_host, lambda call, overrides: call)


@pytest.fixture
def configs(monkeypatch):
    seen = []
    real = fwd_host.default_config

    def spy(call, **kw):
        cfg = real(call, **kw)
        seen.append((tuple(call.q.shape), cfg))
        return cfg

    monkeypatch.setattr(fwd_host, "default_config", spy)
    return seen


@pytest.mark.parametrize("B, Sk, Hq, Hkv, D", [
    (8, 4096, 32, 8, 128), (2, 32768 + 5, 16, 2, 128), (1, 100000, 8, 1, 64), (3, 1, 8, 2, 64),
    (4, 777, 8, 8, 64), (2, 20000, 12, 4, 256), (64, 1024, 4, 2, 96),
])
@pytest.mark.parametrize("causal", [True, False])
def test_decode_against_float64(configs, B, Sk, Hq, Hkv, D, causal):
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = torch_fa4.attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, causal=causal, device="cuda")
    low, _ = naive_attention(q, k, v, causal=causal, device="cuda", score_dtype=torch.bfloat16)
    assert rel_error(out, ref) <= 2 * max(rel_error(low, ref), 2 ** -9)
    assert (lse.double() - ref_lse).abs().max() < 1e-2
    (shape, cfg), = configs[-1:]
    if Hq > Hkv:
        assert shape == (B, Hq // Hkv, Hkv, D), "the query heads are packed as rows"
    if B * Hkv <= 16 and Sk >= 8192:
        assert cfg.split_ways > 1, "few long items: the keys are split across SMs"


@pytest.mark.parametrize("used", [[0, 5000, 1], [40000, 40000, 40000], [0, 0, 0], [17, 39999, 128]])
def test_decode_with_cache_lengths(used):
    B, Sk, Hq, Hkv, D = 3, 40000, 16, 4, 128
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    out, lse = torch_fa4.attention(q, k, v, causal=True, seqused_k=seqused, return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, causal=True, seqlen_k=used, device="cuda")
    low, _ = naive_attention(q, k, v, causal=True, seqlen_k=used, device="cuda", score_dtype=torch.bfloat16)
    assert not torch.isnan(out).any()
    if any(used):
        assert rel_error(out, ref) <= 2 * max(rel_error(low, ref), 2 ** -9)
    for b, n in enumerate(used):
        if n == 0:
            assert (out[b] == 0).all() and (lse[b] == float("-inf")).all()
        else:
            assert (lse[b].double() - ref_lse[b]).abs().max() < 1e-2


def test_decode_softcap_and_its_gradient():
    B, Sk, Hq, Hkv, D = 2, 9000, 8, 2, 128
    q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = torch_fa4.attention(q, k, v, causal=True, softcap=15.0)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = naive_attention(*leaves, causal=True, softcap=15.0, differentiable=True)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    assert rel_error(out, ref) < 2e-2
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) < 3e-2


def test_split_counters_are_left_zero_and_kept_per_stream(configs):
    """The split's piece counters come back to zero after each launch, so one buffer per stream
    (and one workspace per stream and shape) serves every decode step: consecutive steps (fresh
    inputs) on two streams stay exact."""
    from torch_fa4.kernels.host import split_scratch

    B, Sk, Hq, Hkv, D = 2, 32768 + 5, 16, 2, 128
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream()):
        for _ in range(2):
            q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out = torch_fa4.attention(q, k, v, causal=True)
            torch.cuda.synchronize()
            ref, _ = naive_attention(q, k, v, causal=True, device="cuda")
            low, _ = naive_attention(q, k, v, causal=True, device="cuda", score_dtype=torch.bfloat16)
            assert rel_error(out, ref) <= 2 * max(rel_error(low, ref), 2 ** -9)
            assert configs[-1][1].split_ways > 1
    streams = {key[1] for key in split_scratch._counters}
    assert {torch.cuda.current_stream().cuda_stream, side.cuda_stream} <= streams
    assert all(int(buf.abs().sum()) == 0 for buf in split_scratch._counters.values())
