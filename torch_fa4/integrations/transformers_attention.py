"""The "fa4" entry of Transformers' AttentionInterface: a model's attention call run by torch_fa4.

Models hand over query/key/value as (B, H, S, D) (keys and values possibly longer than the queries:
a KV cache) and expect (B, Sq, H, Dv) back. The (B, S, H, D) views go to `torch_fa4.attention`
without copies; GQA is native; `scaling`, logit softcapping (Gemma 2) and sliding windows
(Mistral, Gemma 2/3) become attention arguments. Masks come from `transformers_mask.fa4_mask`
(whose docstring gives their convention):

- None: a dense call; causal is bottom-right aligned, so decoding (Sq = 1) and chunked prefill
  against a longer cache need nothing more.
- int32 document ids of packed sequences: one variable-length sequence per document.
- a (B, M) bool mask: the keys are cut to M (a view). If some of the M are padding, real queries
  and keys are gathered into variable-length sequences, as flash-attn's own Transformers path
  does, and the output is scattered back with zeros in padded query rows.

Anything else (dropout, attention sinks, a position bias, a dense 4-D mask) raises an error that
names the feature.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

import torch_fa4


def refuse(feature: str):
    raise NotImplementedError(
        f'attn_implementation="fa4" does not support {feature}; '
        f'use attn_implementation="sdpa" or "eager" for this model'
    )


def _check_supported(attention_mask, dropout, kwargs) -> None:
    if dropout:
        refuse(f"attention dropout (attention_dropout={dropout} in training mode)")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        refuse("attention sinks (s_aux)")
    if kwargs.get("position_bias") is not None:
        refuse("an additive position bias")
    if kwargs.get("head_mask") is not None:
        refuse("head_mask")
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        refuse(f"an attention mask of type {type(attention_mask).__name__} (built for another attention "
               f"implementation)")
    if attention_mask.dim() != 2:
        refuse(f"a dense {attention_mask.dim()}-D attention mask of shape {tuple(attention_mask.shape)} (fa4 "
               f"takes padding as a 2-D (batch, keys) mask; a custom 4-D mask needs sdpa or eager)")


def _window(sliding_window: Optional[int], causal: bool) -> tuple[Optional[int], Optional[int]]:
    if not sliding_window:
        return (None, None)
    # Transformers' masks: causal layers see kv > q - w (w - 1 keys back, plus the diagonal);
    # bidirectional ones see |q - kv| <= w.
    w = int(sliding_window)
    return (w - 1, 0) if causal else (w, w)


def fa4_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                          scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                          softcap: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """AttentionInterface function for "fa4". Returns (attn_output (B, Sq, H, Dv), None)."""
    _check_supported(attention_mask, dropout, kwargs)
    if kwargs.get("output_attentions"):
        warnings.warn('attn_implementation="fa4" never materialises attention weights; they are returned as None',
                      stacklevel=2)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    options = dict(scale=scaling, causal=causal, window_size=_window(sliding_window, causal),
                   softcap=float(softcap or 0.0))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D) views: no copies

    if kwargs.get("cu_seq_lens_q") is not None:
        return _packed_from_kwargs(q, k, v, kwargs, options), None
    if attention_mask is None:
        return torch_fa4.attention(q, k, v, **options), None
    if attention_mask.dtype == torch.int32:
        return _packed_documents(q, k, v, attention_mask, options), None
    return _padded(q, k, v, attention_mask, options), None


def _packed_from_kwargs(q, k, v, kwargs, options):
    """Sequences packed by a data collator, with flash-attn style cu_seq_lens_* given by the caller."""
    if q.shape[0] != 1 or k.shape[1] != q.shape[1]:
        refuse("cu_seq_lens_q/k with a batch of more than one row or with a KV cache")
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = kwargs.get("cu_seq_lens_k")
    cu_k = cu_q if cu_k is None else cu_k.to(torch.int32)
    out = torch_fa4.attention(
        q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=_int_or_none(kwargs.get("max_length_q")),
        max_seqlen_k=_int_or_none(kwargs.get("max_length_k")), **options,
    )
    return out.unsqueeze(0)


def _int_or_none(x):
    return None if x is None else int(x)


def _packed_documents(q, k, v, doc_ids, options):
    """Rows holding several documents (transformers_mask's int32 document ids): one variable-length
    sequence per document, over the flattened batch."""
    b, s = q.shape[:2]
    if doc_ids.shape != (b, s) or k.shape[1] != s:
        raise ValueError(
            f'attn_implementation="fa4": packed-sequence ids of shape {tuple(doc_ids.shape)} do not fit {s} '
            f"queries, {k.shape[1]} keys and batch {b}"
        )
    starts = torch.ones((b, s), dtype=torch.bool, device=q.device)
    starts[:, 1:] = doc_ids[:, 1:].to(q.device) != doc_ids[:, :-1].to(q.device)
    begin = torch.nonzero(starts.reshape(-1)).reshape(-1)
    cu_seqlens = torch.cat([begin, begin.new_tensor([b * s])]).to(torch.int32)
    flat = [t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)]
    out = torch_fa4.attention(*flat, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, **options)
    return out.reshape(b, s, *out.shape[1:])


def _padded(q, k, v, mask, options):
    """Attention under a (B, M) key-validity mask (see transformers_mask); queries are its last Sq
    columns."""
    b, sq = q.shape[:2]
    m = mask.shape[1]
    if m > k.shape[1] or (m < sq and options["causal"]) or mask.shape[0] != b:
        raise ValueError(
            f'attn_implementation="fa4": padding mask of shape {tuple(mask.shape)} does not fit {sq} queries, '
            f"{k.shape[1]} keys and batch {b}"
        )
    mask = mask.to(device=q.device, dtype=torch.bool)
    k, v = k[:, :m], v[:, :m]  # slots past M were never written (views)
    if options["causal"]:
        q_valid = mask[:, m - sq:]  # causal queries are the newest tokens: bottom-right aligned
    else:
        # Without causality a query's row does not depend on its own padding (and in cross-attention
        # the mask describes the keys only): compute every row, as eager does.
        q_valid = torch.ones((b, sq), dtype=torch.bool, device=q.device)
    n_k = mask.sum(1, dtype=torch.int32)
    n_q = q_valid.sum(1, dtype=torch.int32)
    # A row whose real tokens are not one run has holes; causal order survives packing, window
    # distances would not.
    runs = mask[:, :1].sum(1) + (mask[:, 1:] & ~mask[:, :-1]).sum(1)
    n_k_host, n_q_host, runs_host = torch.stack([n_k, n_q, runs.to(torch.int32)]).tolist()  # one device read
    if all(n == m for n in n_k_host):
        return torch_fa4.attention(q, k, v, **options)
    if options["window_size"] != (None, None) and any(r > 1 for r in runs_host):
        refuse("a padding mask with gaps between real tokens in a sliding-window layer")
    cu_q, cu_k = (torch.nn.functional.pad(n.cumsum(0, dtype=torch.int32), (1, 0)) for n in (n_q, n_k))
    out_packed = torch_fa4.attention(
        q[q_valid], k[mask], v[mask], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max(n_q_host), max_seqlen_k=max(n_k_host), **options,
    )
    out = out_packed.new_zeros((b, sq, *out_packed.shape[1:]))
    return out.index_put((q_valid,), out_packed)
