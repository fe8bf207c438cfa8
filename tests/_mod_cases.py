"""Mods shared by the CuTe DSL lowering tests (CPU compile, GPU values): one per feature of the op set."""

import torch

from torch_fa4 import mods as M


def alibi_abs(slopes):
    """ALiBi spelled with abs, as the benchmark has it: score - slopes[h] * |q_idx - kv_idx| (the
    kernels branch on the sign of q_idx - kv_idx per tile; the library's M.alibi needs no abs)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * torch.abs(q_idx - kv_idx)

    return score_mod


def cases(device="cpu"):
    """name -> (score_mod, mask_mod); captured tensors are created on `device`, fresh each call."""
    H, S = 3, 70
    slopes = M.alibi_slopes(H, device=device)
    doc = torch.randint(0, 4, (S,), device=device).sort().values
    doc2 = torch.randint(0, 3, (2, S), device=device, dtype=torch.int32).sort(dim=1).values
    bias = torch.randn(H, S, S, device=device, dtype=torch.bfloat16)
    table = torch.randn(H, 9, device=device)
    flags = torch.rand(S, device=device) > 0.3

    def bucketed(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(q_idx - kv_idx + 4, min=0, max=8)]

    def transcendental(score, b, h, q_idx, kv_idx):
        x = torch.exp(score * 0.25) + torch.log(torch.abs(score) + 1) - torch.sigmoid(-score) * 2
        x = torch.tanh(x) + torch.minimum(score, x) - torch.maximum(score / 3, -x)
        return torch.where((q_idx - 40) // 7 % 3 == 1, x, -x / (1 + score * score)) + (kv_idx < 3) * 0.5

    def flagged(b, h, q_idx, kv_idx):
        return (flags[kv_idx] | (q_idx == kv_idx)) & ~((h == 1) & (q_idx < 5))

    return {
        "alibi_doc_causal": (M.alibi(slopes), M.and_masks(M.document_mask(doc), M.causal_mask)),
        "softcap_window": (M.softcap_score(4.0), M.or_masks(M.sliding_window_mask(9, 2), M.prefix_lm_mask(6))),
        "bias_bf16_doc2d": (M.relative_bias(bias), M.document_mask(doc2)),
        "bucketed_chunked": (bucketed, M.chunked_mask(16)),
        "transcendental_bool_table": (transcendental, flagged),
    }
