"""GPU: torch_fa4 inside CUDA graphs, where serving engines run decode and training loops run whole
steps: captured once, replayed on new contents of the same tensors (cache lengths that grow in
place included), against float64 from fresh inputs with poisoned outputs."""

import pytest
import torch
import torch.nn.functional as F

import torch_fa4
from gpu_harness import SM90_ONLY, capture_graph as _capture
from naive import naive_attention, rel_error

pytestmark = SM90_ONLY


def _budget(q, k, v, **kw):
    ref, _ = naive_attention(q, k, v, device="cuda", **kw)
    low, _ = naive_attention(q, k, v, device="cuda", score_dtype=torch.bfloat16, **kw)
    return ref, 2 * max(rel_error(low, ref), 2 ** -9)


def _refill(*tensors):
    for t in tensors:
        t.copy_(torch.randn_like(t))


@pytest.mark.parametrize("B, Sk, Hq, Hkv, D", [(8, 4096, 32, 8, 128), (2, 40000, 16, 2, 128), (3, 777, 8, 8, 64)])
def test_decode_replays(B, Sk, Hq, Hkv, D):
    q = torch.empty(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.empty(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    _refill(q, k, v)
    graph, out = _capture(lambda: torch_fa4.attention(q, k, v, causal=True))
    for _ in range(2):
        _refill(q, k, v)
        out.fill_(float("nan"))
        graph.replay()
        ref, budget = _budget(q, k, v, causal=True)
        assert rel_error(out, ref) <= budget


def test_cache_lengths_grow_in_place():
    """A static cache with its lengths in a device tensor, advanced between replays as a serving
    loop does: the capture must not read the lengths (it cannot), the replays use the new ones."""
    B, Sk, Hq, Hkv, D = 4, 5000, 16, 4, 128
    q = torch.empty(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.empty(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    used = torch.tensor([1, 10, 100, 1000], dtype=torch.int32, device="cuda")
    _refill(q, k, v)
    graph, out = _capture(lambda: torch_fa4.attention(q, k, v, causal=True, seqused_k=used))
    for step in range(3):
        used.add_(torch.tensor([1, 7, 500, 1000], dtype=torch.int32, device="cuda"))
        _refill(q)
        out.fill_(float("nan"))
        graph.replay()
        ref, budget = _budget(q, k, v, causal=True, seqlen_k=used.tolist())
        assert rel_error(out, ref) <= budget, f"step {step}"


def test_sdpa_route_replays():
    q, k, v = (torch.empty(2, 16, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    _refill(q, k, v)
    with torch_fa4.sdpa.enabled():
        graph, out = _capture(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        _refill(q, k, v)
        out.fill_(float("nan"))
        graph.replay()
    ref, budget = _budget(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    assert rel_error(out.transpose(1, 2), ref) <= budget


def test_training_step_graphed():
    """Forward and backward captured by torch.cuda.make_graphed_callables."""
    B, S, H, D = 2, 1000, 8, 128

    def attend(q, k, v):
        return torch_fa4.attention(q, k, v, causal=True)

    sample = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    graphed = torch.cuda.make_graphed_callables(attend, tuple(sample))
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    out = graphed(q, k, v)
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = naive_attention(q64, k64, v64, causal=True, differentiable=True)
    ref.backward(grad.double())
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    low_out, _ = naive_attention(*low, causal=True, differentiable=True)
    low_out.backward(grad)
    assert rel_error(out, ref) <= 2 * max(rel_error(low_out, ref), 2 ** -9)
    for got, low_t, want in zip((q, k, v), low, (q64, k64, v64)):
        assert torch.isfinite(got.grad).all()
        assert rel_error(got.grad, want.grad) <= 2 * max(rel_error(low_t.grad, want.grad), 2 ** -9)
