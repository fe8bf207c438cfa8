"""GPU: the sm_90 backward where dense keys end inside a key tile and every score of a row is very
negative. The tail's K and V are zero-filled, but its P = exp2(0 - lse2) is then huge, so its dS
overflows a 16-bit operand unless the tail is masked, and dS K gives inf * 0 = NaN in dQ.
References are float64 autograd (tests/naive.py); the error bound is twice that of the same math in
the inputs' dtype."""

import pytest
import torch

import torch_fa4
from naive import naive_attention, rel_error
from torch_fa4 import dispatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                       reason="needs an sm_90 GPU"),
]


def _attend(q, k, v, bias):
    """tests/naive.py with a constant score bias, in q's dtype, with PyTorch autograd."""
    return naive_attention(q, k, v, score_mod=(lambda score, *_: score + bias) if bias else None,
                           differentiable=True)[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sk", [1, 129, 333])
@pytest.mark.parametrize("d,bias", [(64, 0.0), (128, -100.0), (256, -100.0)], ids=["d64_aligned_q", "d128_bias", "d256_bias"])
def test_key_tail_with_very_negative_scores(dtype, sk, d, bias, monkeypatch):
    picked = []
    original = dispatch.kernel_for
    monkeypatch.setattr(dispatch, "kernel_for",
                        lambda call, direction, **kw: picked.append(m := original(call, direction, **kw)) or m)
    B, S, H, HKV = 2, 200, 4, 2
    if bias == 0.0:  # no mod: queries point away from a direction every key shares
        base = torch.randn(d, device="cuda")
        k = (base + 0.3 * torch.randn(B, sk, HKV, d, device="cuda")).to(dtype)
        q = (-3 * base + 0.3 * torch.randn(B, S, H, d, device="cuda")).to(dtype)
        mods = {}
    else:
        q, k = (torch.randn(B, n, h, d, device="cuda", dtype=dtype) for n, h in ((S, H), (sk, HKV)))
        mods = dict(score_mod=lambda score, b, h, q_idx, kv_idx: score + bias)
    v = torch.randn(B, sk, HKV, d, device="cuda", dtype=dtype)
    grad = torch.randn(B, S, H, d, device="cuda", dtype=dtype)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = torch_fa4.attention(*leaves, **mods)
    out.backward(grad)
    assert picked and all(m is not None for m in picked), "a kernel did not run"
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _attend(*refs, bias)
    ref.backward(grad.double())
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    eager = _attend(*low, bias)
    eager.backward(grad)
    assert rel_error(out, ref) <= 2 * rel_error(eager, ref) + 1e-3
    for ours, e, r in zip(leaves, low, refs):
        if r.grad.norm() == 0:  # one key: P = 1 and dS = 0 exactly, so dQ = dK = 0
            assert not ours.grad.isnan().any()
            assert ours.grad.double().norm() <= 1e-3 * refs[2].grad.norm()
            continue
        assert rel_error(ours.grad, r.grad) <= 2 * rel_error(e.grad, r.grad) + 1e-3
