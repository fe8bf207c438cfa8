"""torch_fa4 in one page: attention, a custom mask, gradients, and a check against plain PyTorch.

Runs anywhere: on an H100/H200 the CuTe DSL kernels do the work; on a CPU the exact reference does.
"""

import torch
import torch.nn.functional as F

import torch_fa4

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
print(f"torch_fa4 {torch_fa4.__version__} on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'reference path'})")

B, S, H, H_KV, D = 2, 1024, 8, 2, 128
q = torch.randn(B, S, H, D, device=device, dtype=dtype, requires_grad=True)
k = torch.randn(B, S, H_KV, D, device=device, dtype=dtype, requires_grad=True)
v = torch.randn(B, S, H_KV, D, device=device, dtype=dtype, requires_grad=True)

# 1. flash-attn style (B, S, H, D): causal GQA attention, differentiable.
out = torch_fa4.attention(q, k, v, causal=True)
out.sum().backward()

# Compare with PyTorch's own SDPA (which wants (B, H, S, D) and expanded KV heads).
expected = F.scaled_dot_product_attention(
    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
).transpose(1, 2)
err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
print(f"causal GQA attention: out {tuple(out.shape)}, relative difference to SDPA {err:.2e}, dq norm {q.grad.norm():.3f}")
assert err < 2e-2

# 2. FlexAttention style (B, H, S, D) with a plain-PyTorch score_mod (ALiBi) and a sliding-window mask.
slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)


def alibi(score, b, h, q_idx, kv_idx):
    return score - slopes[h] * (q_idx - kv_idx).abs()


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)


with torch.no_grad():
    qf, kf, vf = (t.detach().transpose(1, 2) for t in (q, k, v))
    flex_out = torch_fa4.flex_attention(qf, kf, vf, score_mod=alibi, mask_mod=sliding_window, enable_gqa=True)
print(f"flex_attention with ALiBi + sliding window: out {tuple(flex_out.shape)}, finite: {bool(flex_out.isfinite().all())}")
