"""Float64 attention written the obvious way (full S×S matrix): the oracle every test compares with.

Kept deliberately independent of torch_fa4/reference.py (no chunking, no online softmax), so the
two implementations check each other. The same code run in the inputs' own dtype is the error
budget the kernels are held to (an implementation may err at most about twice as much).
"""

import math

import torch


def naive_attention(q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                    score_mod=None, mask_mod=None, seqlen_k=None, differentiable=False, device="cpu",
                    score_dtype=None, softmax_dtype=None):
    """q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) with Hkv dividing H; returns out
    (B, Sq, H, Dv) and lse (B, H, Sq), float64.

    score_mod(s, b, h, i, j) / mask_mod(b, h, i, j) receive broadcast index grids (a mod may also
    return a precomputed bias / keep tensor that broadcasts to (B, H, Sq, Sk)).
    seqlen_k: optional list of per-batch key counts (seqused_k).
    differentiable: q, k, v are used as given, in their dtype and on their device, so that autograd
    reaches them (float64: the oracle's gradients; the inputs' own dtype: an eager error budget);
    otherwise they are detached and converted to float64 on `device` (the CPU by default, where
    mods over CPU tensors evaluate).
    Eager budgets only: score_dtype is the dtype the scores are scaled, capped and modded in
    (default: the Q K^T matmul's), softmax_dtype that of the softmax (default: the scores'); P is
    rounded to v's dtype for P V.
    Rows without a visible key give out 0 and lse -inf.
    """
    if not differentiable:
        q, k, v = (x.detach().to(device, torch.float64) for x in (q, k, v))
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = k.repeat_interleave(H // Hkv, dim=2)
    v = v.repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    s = (s if score_dtype is None else s.to(score_dtype)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    dev = q.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    i = torch.arange(Sq, device=dev).view(1, 1, Sq, 1)
    j = torch.arange(Sk, device=dev).view(1, 1, 1, Sk)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j).to(s.dtype)  # captured float32 tensors must not promote bf16
    if softmax_dtype is not None:
        s = s.to(softmax_dtype)
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
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return out, lse


def naive_varlen(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, score_mod=None,
                 mask_mod=None, **kw):
    """naive_attention on a batch laid out as torch_fa4.attention takes it: q (Tq, H, D) packed,
    sequence b at rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] (or (B, Sq, H, D) without cu_seqlens_q),
    k / v likewise with cu_seqlens_k; seqused_k: the keys each sequence uses. A packed batch (of
    one sequence or more) runs one sequence at a time, its mods seeing b = the sequence's index. Returns out in q's layout
    (Dv last) and lse (H, Tq) packed or (B, H, Sq); `kw` as naive_attention's."""
    used = None if seqused_k is None else [int(n) for n in seqused_k]
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return naive_attention(q, k, v, seqlen_k=used, score_mod=score_mod, mask_mod=mask_mod, **kw)

    def rows(t, cu, n):
        return t[int(cu[n]):int(cu[n + 1])][None] if cu is not None else t[n:n + 1]

    def shifted(mod, n):  # b is the first index argument, after score_mod's score
        if mod is None:
            return None
        return lambda *a: mod(*a[:-4], a[-4] + n, *a[-3:])

    outs, lses = [], []
    for n in range(len(cu_seqlens_q) - 1 if cu_seqlens_q is not None else q.shape[0]):
        o, lse = naive_attention(rows(q, cu_seqlens_q, n), rows(k, cu_seqlens_k, n), rows(v, cu_seqlens_k, n),
                                 seqlen_k=None if used is None else used[n:n + 1],
                                 score_mod=shifted(score_mod, n), mask_mod=shifted(mask_mod, n), **kw)
        outs.append(o[0])
        lses.append(lse[0])
    if cu_seqlens_q is None:
        return torch.stack(outs), torch.stack(lses)
    return torch.cat(outs), torch.cat(lses, 1)


def call_options(call):
    """naive_varlen's keywords for an AttentionCall's layout and options (its mods aside)."""
    return dict(cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k, seqused_k=call.seqused_k,
                scale=call.scale, causal=call.causal, window=(call.window_left, call.window_right),
                softcap=call.softcap)


def rel_error(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    assert not torch.isnan(x).any(), "NaN in result"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()
