"""GPU: the public API end to end on the sm_90 kernels -- forward and backward through dispatch,
a score_mod with a captured tensor under GQA, and a torch.compile(fullgraph=True) training step.

Every call runs with fallback warnings turned into errors, and the dispatcher is asked which
module it picked, so a silent fallback to the reference cannot pass.
"""

import warnings

import pytest
import torch

import torch_fa4
from gpu_harness import (SM90_ONLY, check_training_step, leaves as _leaves, public_training_step,
                         record_kernel_picks, rel as _rel)
from naive import naive_attention

pytestmark = SM90_ONLY


@pytest.fixture
def picked(monkeypatch):
    return record_kernel_picks(monkeypatch)


@pytest.mark.parametrize("d", [64, 128])
def test_training_step_with_alibi_gqa_runs_on_kernels(picked, d):
    B, S, H, HKV = 2, 333, 8, 2
    q, k, v = (torch.randn(B, S, h, d, device="cuda", dtype=torch.bfloat16) for h in (H, HKV, HKV))
    slopes = torch.rand(H, device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    out, grad, ours = public_training_step(q, k, v, causal=True, score_mod=alibi)
    assert ("forward", "torch_fa4.kernels.sm90") in picked
    assert ("backward", "torch_fa4.kernels.sm90.bwd") in picked
    check_training_step(out, grad, ours, q, k, v,
                        lambda q, k, v: naive_attention(q, k, v, causal=True, score_mod=alibi,
                                                        differentiable=True))


def test_varlen_training_step_with_a_score_mod_runs_on_kernels(picked):
    """Packed sequences (starting at rows 0, 17, 317, 446) with a score_mod that reads b, the
    sequence's index, and positions within the sequence: forward and backward on the kernels."""
    lens, H, HKV, d = [17, 300, 129, 64], 4, 2, 128
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16) for h in (H, HKV, HKV))
    slopes = torch.rand(H, device="cuda")

    def alibi_by_sequence(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (b + 1) * 0.25 * (q_idx - kv_idx).abs()

    qa, ka, va = _leaves(q, k, v)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch_fa4: .*falls back")
        out = torch_fa4.attention(qa, ka, va, causal=True, score_mod=alibi_by_sequence, cu_seqlens_q=cu,
                                  cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
        grad = torch.randn_like(out)
        out.backward(grad)
    assert ("forward", "torch_fa4.kernels.sm90") in picked
    assert ("backward", "torch_fa4.kernels.sm90.bwd") in picked

    def per_sequence(q, k, v, dtype):  # each sequence alone, as batch 0 with b shifted to its index
        leaves = _leaves(*(t.to(dtype) for t in (q, k, v)))
        outs = []
        for n, (a, e) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
            mod = lambda s, b, h, i, j, n=n: alibi_by_sequence(s, b + n, h, i, j)  # noqa: E731
            outs.append(naive_attention(*(t[a:e][None] for t in leaves), causal=True, score_mod=mod,
                                        differentiable=True)[0][0])
        o = torch.cat(outs)
        o.backward(grad.to(dtype))
        return o, leaves

    ref, (q64, k64, v64) = per_sequence(q, k, v, torch.float64)
    base, (qb, kb, vb) = per_sequence(q, k, v, torch.bfloat16)  # eager bf16 attention: the error budget
    assert _rel(out, ref) <= 2 * _rel(base, ref) + 1e-3
    for ours, eager, want in ((qa.grad, qb.grad, q64.grad), (ka.grad, kb.grad, k64.grad), (va.grad, vb.grad, v64.grad)):
        assert _rel(ours, want) <= 2 * _rel(eager, want) + 1e-3


class _TinyAttention(torch.nn.Module):
    def __init__(self, dim=256, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.hd, bias=False)
        self.out = torch.nn.Linear(heads * self.hd, dim, bias=False)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], -1)
        o = torch_fa4.attention(q.view(B, S, self.heads, self.hd), k.view(B, S, self.kv_heads, self.hd),
                                v.view(B, S, self.kv_heads, self.hd), causal=True)
        return self.out(o.reshape(B, S, -1))


def test_compiled_training_step_matches_eager(picked):
    torch._dynamo.reset()
    torch.manual_seed(torch.seed() % 2**31)
    model = _TinyAttention().cuda().to(torch.bfloat16)
    x = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16)

    def step(m, x):
        return m(x).float().square().mean()

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(model, x)
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    step(model, x).backward()
    want = [p.grad for p in model.parameters()]
    assert ("forward", "torch_fa4.kernels.sm90") in picked
    assert ("backward", "torch_fa4.kernels.sm90.bwd") in picked
    for g, w in zip(got, want):
        assert _rel(g, w) < 2e-2


@pytest.mark.parametrize("causal", [False, True])
def test_negative_scale_with_large_logits(picked, causal):
    """A negative scale makes a row's smallest q.k its largest score. The forward kernels take the
    row max of the raw q.k and scale it, so their launch runs such calls on -q with -scale
    (fwd_launch.nonnegative_scale). Logits spanning hundreds of log2 units would overflow a softmax
    referenced to the wrong end of the row."""
    B, S, H, D, scale = 2, 700, 4, 64, -0.5
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q, k = q * 4, k * 4  # q.k * scale: a spread of ~90 natural units per row

    def reference(q, k, v):
        return naive_attention(q, k, v, causal=causal, scale=scale, differentiable=True)

    (out, lse), grad, ours = public_training_step(q, k, v, causal=causal, scale=scale, return_lse=True)
    assert ("forward", "torch_fa4.kernels.sm90") in picked
    _, ref_lse = check_training_step(out, grad, ours, q, k, v, reference)
    assert torch.isfinite(lse).all()
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2 * ref_lse.abs().max().item()
