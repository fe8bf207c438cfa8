"""The "fa4" entry of Transformers' AttentionInterface: a model's attention call run by torch_fa4.

Models hand over query/key/value as (B, H, S, D) (keys and values possibly longer than the queries:
a KV cache) and expect (B, Sq, H, Dv) back. The (B, S, H, D) views go to `torch_fa4.attention`
without copies; GQA is native; `scaling`, logit softcapping (Gemma 2) and sliding windows
(Mistral, Gemma 2/3) become attention arguments. Masks come from `transformers_mask.fa4_mask`
(whose docstring gives their convention):

- None: a dense call; causal is bottom-right aligned, so decoding (Sq = 1) and chunked prefill
  against a longer cache need nothing more.
- int32 document ids of packed sequences: one variable-length sequence per document.
- a (B, M) bool mask: the keys are cut to M (a view) and the mask travels as a mask_mod reading
  `mask[b, kv_idx]`, so a padded batch (left or right padding, holes included) reads its KV cache
  where it lies: no step gathers, packs or copies the cache. Causality and windows count key slots,
  as Transformers' own masks do. A query row that sees no real key (a left-padded row's padding)
  gives zeros.

Continuous batching (Transformers' PagedAttentionCache) goes to `transformers_paged`.
Anything else (dropout, attention sinks, a position bias, a dense 4-D mask) raises an error that
names the feature.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

import torch_fa4
from torch_fa4.tensor_memo import TensorMemo


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


def fa4_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                          scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                          softcap: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """AttentionInterface function for "fa4". Returns (attn_output (B, Sq, H, Dv), None)."""
    if _is_continuous_batching(kwargs):
        from torch_fa4.integrations.transformers_paged import fa4_paged_attention_forward

        return fa4_paged_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                           scaling=scaling, sliding_window=sliding_window, softcap=softcap,
                                           **kwargs)
    _check_supported(attention_mask, dropout, kwargs)
    if kwargs.get("output_attentions"):
        warnings.warn('attn_implementation="fa4" never materialises attention weights; they are returned as '
                      'None', stacklevel=2)
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
        q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=_int_or_none(kwargs.get("max_length_q")),
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


def _is_continuous_batching(kwargs) -> bool:
    """Transformers' continuous batching calls with its PagedAttentionCache's indices (or page table)."""
    return "read_index" in kwargs or kwargs.get("block_table") is not None


# Whether a mask holds padding: a model hands the same mask to every layer, and asking the device is a
# sync, so each mask is asked once while it lives unmodified (transformers_mask tells what it knows).
_HAS_PADDING = TensorMemo(capacity=16)


def note_padding(mask: torch.Tensor, present: bool) -> None:
    if not torch.compiler.is_compiling():
        _HAS_PADDING.put((mask,), (), present)


# Masks whose real key slots are exactly their first n columns (a static cache's written slots, no
# padding): an eager call reads those n densely, without a mask_mod.
_REAL_PREFIX = TensorMemo(capacity=16)


def note_real_prefix(mask: torch.Tensor, n: int) -> None:
    if not torch.compiler.is_compiling():
        _REAL_PREFIX.put((mask,), (), n)


def is_noted(mask: torch.Tensor) -> bool:
    """Whether a mask came from transformers_mask (which noted its padding or its real prefix)."""
    return _REAL_PREFIX.get((mask,)) is not None or _HAS_PADDING.get((mask,)) is not None


def _has_padding(mask: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True  # (no device read in a graph: the mask_mod serves every mask)
    present = _HAS_PADDING.get((mask,))
    if present is None:
        present = not bool(mask.all())
        note_padding(mask, present)
    return present


def _real_key(b, h, q_idx, kv_idx, valid=None):
    return valid[b, kv_idx]


def key_padding_mask(valid: torch.Tensor):
    """A mask_mod keeping the key slots where the (B, M) bool `valid` is True."""
    return functools.partial(_real_key, valid=valid)


def _padded(q, k, v, mask, options):
    """Attention under a (B, M) key-validity mask (see transformers_mask); queries are its last Sq
    columns. K and V are read in place (views of the cache): the mask is a mask_mod over key slots."""
    b, sq = q.shape[:2]
    m = mask.shape[1]
    if m > k.shape[1] or (m < sq and options["causal"]) or mask.shape[0] != b:
        raise ValueError(
            f'attn_implementation="fa4": padding mask of shape {tuple(mask.shape)} does not fit {sq} '
            f"queries, {k.shape[1]} keys and batch {b}"
        )
    prefix = None if torch.compiler.is_compiling() else _REAL_PREFIX.get((mask,))
    if prefix is not None:
        return torch_fa4.attention(q, k[:, :prefix], v[:, :prefix], **options)
    mask = mask.to(device=q.device, dtype=torch.bool)
    k, v = k[:, :m], v[:, :m]  # slots past M were never written (views)
    if not _has_padding(mask):
        return torch_fa4.attention(q, k, v, **options)
    return torch_fa4.attention(q, k, v, mask_mod=key_padding_mask(mask), **options)
