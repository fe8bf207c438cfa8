"""GPU: mods recognised as built-ins (causal, windows, tanh softcap; torch_fa4/mods/idioms.py) and
near misses that must keep their mods, forward and backward on the sm_90 kernels against float64
computed from the user's own callables."""

import pytest
import torch

import torch_fa4
from naive import naive_attention, rel_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs a CUDA sm_90 device",
    ),
]

MODS = {
    "causal": dict(mask_mod=lambda b, h, q, kv: q >= kv),
    "causal, near miss": dict(mask_mod=lambda b, h, q, kv: q > kv),
    "window": dict(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < 100)),
    "window, near miss": dict(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < 100) & (q - kv != 7)),
    "band": dict(mask_mod=lambda b, h, q, kv: (q - kv).abs() <= 33),
    "softcap": dict(score_mod=lambda s, b, h, q, kv: 30 * torch.tanh(s / 30)),
    "softcap, near miss": dict(score_mod=lambda s, b, h, q, kv: 30 * torch.tanh(s / 29)),
    "softcap and causal": dict(score_mod=lambda s, b, h, q, kv: 10 * torch.tanh(s / 10),
                               mask_mod=lambda b, h, q, kv: q >= kv),
}


@pytest.mark.parametrize("name", list(MODS))
@pytest.mark.parametrize("sq, sk, d", [(513, 513, 128), (700, 300, 64), (129, 1000, 64)])
def test_recognised_and_near_miss_mods_against_float64(name, sq, sk, d):
    mods = MODS[name]
    q = torch.randn(2, sq, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, sk, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = torch_fa4.attention(q, k, v, **mods)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = lambda dtype: [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]  # noqa: E731
    refs, lows = leaves(torch.float64), leaves(torch.bfloat16)
    ref, _ = naive_attention(*refs, **mods, differentiable=True)
    low, _ = naive_attention(*lows, **mods, differentiable=True)
    ref_grads = torch.autograd.grad(ref, refs, dout.double())
    low_grads = torch.autograd.grad(low, lows, dout)
    assert rel_error(out, ref) <= 2 * rel_error(low, ref)
    for g, r, lg in zip(grads, ref_grads, low_grads):
        assert rel_error(g, r) <= 2 * rel_error(lg, r)
