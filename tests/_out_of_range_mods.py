"""Mods whose captured-tensor indices leave their tensors for a 1000 x 1000 problem with 8 heads: the
index-bounds tests (CPU and GPU) check that each raises ModIndexError naming the problem."""

import torch


def out_of_range_mods(device="cpu"):
    """name -> (score_mod, mask_mod, causal) over tensors on `device`: a document-id table shorter than
    the sequence, a bias table too narrow for q_idx - kv_idx, a per-head table with too few heads."""
    doc = torch.zeros(100, dtype=torch.int32, device=device)
    tab = torch.randn(8, 50, device=device)
    sl = torch.randn(4, device=device)

    def doc_mask(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + tab[h, q_idx - kv_idx]

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + sl[h]

    return {
        "doc_short": (None, doc_mask, False),
        "rel_bias_narrow": (rel_bias, None, True),
        "heads_short": (head_bias, None, False),
    }
