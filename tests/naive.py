"""Float64 attention written the obvious way (full S×S matrix): the oracle every test compares with.

Kept deliberately independent of torch_fa4/reference.py (no chunking, no online softmax), so the
two implementations check each other.
"""

import math

import torch


def naive_attention(q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                    score_mod=None, mask_mod=None, seqlen_k=None, differentiable=False):
    """q (B, Sq, H, D), k/v (B, Sk, Hkv, D); returns out (B, Sq, H, Dv) and lse (B, H, Sq), float64.

    score_mod(s, b, h, i, j) / mask_mod(b, h, i, j) receive broadcast index grids (a mod may also
    return a precomputed bias / keep tensor that broadcasts to (B, H, Sq, Sk)).
    seqlen_k: optional list of per-batch key counts (seqused_k).
    differentiable: q, k, v are used as given, in their dtype and on their device, so that autograd
    reaches them (float64: the oracle's gradients; the inputs' own dtype: an eager error budget);
    otherwise they are detached and converted to float64 on the CPU.
    Rows without a visible key give out 0 and lse -inf.
    """
    if not differentiable:
        q, k, v = (x.detach().double().cpu() for x in (q, k, v))
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = k.repeat_interleave(H // Hkv, dim=2)
    v = v.repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    dev = q.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    i = torch.arange(Sq, device=dev).view(1, 1, Sq, 1)
    j = torch.arange(Sk, device=dev).view(1, 1, 1, Sk)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j).to(s.dtype)  # captured float32 tensors must not promote bf16
    visible = torch.ones(B, H, Sq, Sk, dtype=torch.bool, device=dev)
    sk_b = torch.tensor(seqlen_k if seqlen_k is not None else [Sk] * B, device=dev).view(B, 1, 1, 1)
    diag = i + sk_b - Sq
    if causal:
        visible &= j <= diag
    if window[1] >= 0:
        visible &= j <= diag + window[1]
    if window[0] >= 0:
        visible &= j >= diag - window[0]
    visible &= j < sk_b
    if mask_mod is not None:
        visible &= mask_mod(b, h, i, j).bool()
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows without a visible key: 0
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def rel_error(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    assert not torch.isnan(x).any(), "NaN in result"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()
