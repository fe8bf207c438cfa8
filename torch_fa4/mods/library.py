"""Built-in mods, written as ordinary FlexAttention mods.

Parameterised built-ins are `functools.partial` objects over module-level functions rather than
closures: Dynamo can read a partial's arguments even when it is created inside a torch.compile'd
function, so `document_mask(doc_ids)` in a compiled forward traces without graph breaks (see
prepare.py). Index semantics are FlexAttention's: `q_idx`, `kv_idx` count from 0 in each sequence
and masks are top-left aligned (unlike `attention(causal=True)`, which aligns bottom-right).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Callable, Optional, Union

import torch


# ---- masks ---------------------------------------------------------------------------------------

def causal_mask(b, h, q_idx, kv_idx):
    """Key visible when it is not after the query (top-left aligned)."""
    return q_idx >= kv_idx


def _sliding_window(b, h, q_idx, kv_idx, left=None, right=None):
    if left is None and right is None:
        return q_idx == q_idx  # unbounded both ways: every key (an always-true boolean value)
    if right is None:
        return q_idx - kv_idx <= left
    if left is None:
        return kv_idx - q_idx <= right
    return (q_idx - kv_idx <= left) & (kv_idx - q_idx <= right)


def sliding_window_mask(left: Optional[int], right: Optional[int] = 0) -> Callable:
    """Keys with q_idx - left <= kv_idx <= q_idx + right; None leaves a side unbounded.

    `sliding_window_mask(w)` is causal sliding-window attention over the last w + 1 keys.
    """
    for name, v in (("left", left), ("right", right)):
        if v is not None and (not isinstance(v, int) or v < 0):
            raise ValueError(f"sliding_window_mask: {name} must be None or an int >= 0, got {v!r}")
    return functools.partial(_sliding_window, left=left, right=right)


def _document_1d(b, h, q_idx, kv_idx, doc_ids=None):
    return doc_ids[q_idx] == doc_ids[kv_idx]


def _document_2d(b, h, q_idx, kv_idx, doc_ids=None):
    return doc_ids[b, q_idx] == doc_ids[b, kv_idx]


def document_mask(doc_ids: torch.Tensor) -> Callable:
    """Packed sequences: a query sees only keys of its own document.

    doc_ids: integer tensor (S,) shared by the batch, or (B, S) per batch element; queries and keys
    index the same positions (self-attention over a packed sequence).
    """
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() not in (1, 2) or doc_ids.is_floating_point():
        raise ValueError("document_mask: doc_ids must be an integer tensor of shape (S,) or (B, S)")
    fn = _document_1d if doc_ids.dim() == 1 else _document_2d
    return functools.partial(fn, doc_ids=doc_ids)


def document_ids_from_lengths(lengths, device=None) -> torch.Tensor:
    """(S,) int32 document ids for documents of the given lengths packed back to back."""
    lengths = torch.as_tensor(lengths, device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device, dtype=torch.int32), lengths)


def _prefix_lm(b, h, q_idx, kv_idx, prefix=0):
    return (kv_idx <= q_idx) | (kv_idx < prefix)


def _prefix_lm_per_batch(b, h, q_idx, kv_idx, prefix=None):
    return (kv_idx <= q_idx) | (kv_idx < prefix[b])


def prefix_lm_mask(prefix_length: Union[int, torch.Tensor]) -> Callable:
    """Bidirectional over the first `prefix_length` keys, causal after (an int, or a (B,) tensor)."""
    if isinstance(prefix_length, torch.Tensor):
        if prefix_length.dim() != 1 or prefix_length.is_floating_point():
            raise ValueError("prefix_lm_mask: a tensor prefix_length must be an integer tensor of shape (B,)")
        return functools.partial(_prefix_lm_per_batch, prefix=prefix_length)
    return functools.partial(_prefix_lm, prefix=int(prefix_length))


def _chunked(b, h, q_idx, kv_idx, chunk=1):
    return (q_idx // chunk) == (kv_idx // chunk)


def chunked_mask(chunk_size: int) -> Callable:
    """Chunked local attention: a query sees the keys of its own chunk of `chunk_size` positions.

    Combine with causal for Llama-4-style chunked causal attention: `and_masks(causal_mask,
    chunked_mask(8192))`.
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunked_mask: chunk_size must be a positive int, got {chunk_size!r}")
    return functools.partial(_chunked, chunk=chunk_size)


def _and_masks(b, h, q_idx, kv_idx, masks=()):
    return functools.reduce(operator.and_, (m(b, h, q_idx, kv_idx) for m in masks))


def _or_masks(b, h, q_idx, kv_idx, masks=()):
    return functools.reduce(operator.or_, (m(b, h, q_idx, kv_idx) for m in masks))


def and_masks(*masks: Callable) -> Callable:
    """A key is visible when every mask allows it."""
    if not masks:
        raise ValueError("and_masks needs at least one mask_mod")
    return functools.partial(_and_masks, masks=tuple(masks))


def or_masks(*masks: Callable) -> Callable:
    """A key is visible when any mask allows it."""
    if not masks:
        raise ValueError("or_masks needs at least one mask_mod")
    return functools.partial(_or_masks, masks=tuple(masks))


# ---- score mods ----------------------------------------------------------------------------------

def _alibi(score, b, h, q_idx, kv_idx, slopes=None):
    return score + slopes[h] * (kv_idx - q_idx)


def alibi(slopes: torch.Tensor) -> Callable:
    """ALiBi: score + slopes[h] * (kv_idx - q_idx); slopes (H,) float, e.g. `alibi_slopes(H)`."""
    if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1 or not slopes.is_floating_point():
        raise ValueError("alibi: slopes must be a float tensor of shape (num_heads,)")
    return functools.partial(_alibi, slopes=slopes)


def alibi_slopes(num_heads: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The standard ALiBi head slopes (Press et al.): a geometric sequence starting at 2^(-8/n)
    for the nearest power of two n <= num_heads, then the odd terms of the sequence for 2n."""
    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if num_heads <= 0:
        raise ValueError("alibi_slopes: num_heads must be positive")
    n = 2 ** int(math.floor(math.log2(num_heads)))
    values = geometric(n)
    if n < num_heads:
        values += geometric(2 * n)[0::2][: num_heads - n]
    return torch.tensor(values, device=device, dtype=dtype)


def _softcap(score, b, h, q_idx, kv_idx, cap=1.0):
    return cap * torch.tanh(score / cap)


def softcap_score(cap: float) -> Callable:
    """Logit soft-capping as a score_mod: cap * tanh(score / cap)."""
    if not cap > 0:
        raise ValueError(f"softcap_score: cap must be > 0, got {cap!r}")
    return functools.partial(_softcap, cap=float(cap))


def _head_bias(score, b, h, q_idx, kv_idx, bias=None):
    return score + bias[h, q_idx, kv_idx]


def relative_bias(bias: torch.Tensor) -> Callable:
    """score + bias[h, q_idx, kv_idx] for a dense (H, Sq, Sk) float bias table."""
    if not isinstance(bias, torch.Tensor) or bias.dim() != 3 or not bias.is_floating_point():
        raise ValueError("relative_bias: bias must be a float tensor of shape (H, Sq, Sk)")
    return functools.partial(_head_bias, bias=bias)
