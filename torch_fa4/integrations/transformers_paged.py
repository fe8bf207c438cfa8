"""Continuous batching for "fa4": the attention call under Transformers' PagedAttentionCache
(`generate_batch`, `ContinuousBatchingManager`), registered as "paged|fa4".

Continuous batching packs every scheduled request into one row: query, key and value arrive as
(1, H, total, D) with `cu_seq_lens_q` / `cu_seq_lens_k` (per layer type when a model mixes full and
sliding layers), `max_seqlen_*` (later `max_length_*`), the `cache`, its physical slot indices
`read_index` / `write_index` per layer group, and a `block_table` on decode-only batches when
Transformers' decode fast path is on. What the attention function must do differs by version:

- "paged|<name>" functions (Transformers up to the 5.2x that retired the prefix, e.g. 5.17): the
  model leaves the cache alone and the function gets the new tokens' K/V; it writes them and reads
  the cache itself. Here, on full-attention layers, when `torch_fa4.attention` takes a page table:
  the new K/V are written at `write_index` (what the cache's own update does), the page table is
  read off `read_index` (a full-attention group puts token t of a request at slot
  `block_table[t // page] * page + t % page`, so every page-th read index names a page), and the
  attention reads the cache's pages where they lie. Sliding-window groups keep a ring of pages whose
  reads do not start on a page boundary: they, and a torch_fa4 without page tables, run varlen
  attention on the K/V that `cache.update` gathers.
- Later 5.x: the model calls `cache.update(..., kwargs)` itself before the attention function, and
  that update has already written the new tokens and gathered every sequence's keys into
  contiguous copies (index_select by `read_index`); the page table and the raw cache (`k_cache`,
  `v_cache`) reach the function only on the decode fast path, which Transformers turns on for
  flash_attention_2/3 alone. So the function gets gathered K/V and runs varlen attention on them
  (the page-table branch below serves that fast path should it ever be handed over). Those versions
  also refuse, in continuous batching, any implementation whose name does not contain "flash"
  (besides "sdpa" and "paged|eager"), "fa4" included.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch

import torch_fa4
from torch_fa4.integrations.transformers_attention import _check_supported, _window
from torch_fa4.tensor_memo import TensorMemo


def fa4_paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                dropout: float = 0.0, scaling: Optional[float] = None,
                                sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                                **kwargs):
    """AttentionInterface function for "paged|fa4". Returns (attn_output (1, total_q, Hq, Dv), None)."""
    _check_supported(None, dropout, kwargs)  # (no mask: continuous batching packs, it does not pad)
    if "read_index" not in kwargs and kwargs.get("block_table") is None:
        raise ValueError('attn_implementation="paged|fa4" needs the PagedAttentionCache of continuous '
                         'batching (generate_batch / ContinuousBatchingManager); use "fa4" for a standard '
                         'forward')
    cache = kwargs.get("cache")  # (handed over only where the attention owns the cache update)
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    layer_type = "sliding_attention" if sliding_window else "full_attention"
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = _for_layer(kwargs["cu_seq_lens_k"], layer_type).to(torch.int32)
    max_k = _int_or_none(_for_layer(_first(kwargs, "max_seqlen_k", "max_length_k"), layer_type))
    # (Transformers' maxima may be padded up, which torch_fa4 accepts; 1 on the decode fast path, exact there)
    max_q = _int_or_none(_first(kwargs, "max_seqlen_q", "max_length_q"))
    options = dict(scale=scaling, causal=True, window_size=_window(sliding_window, True),
                   softcap=float(softcap or 0.0), max_seqlen_q=max_q)
    q = query[0].transpose(0, 1)  # (total_q, Hq, D), a view
    n_q, n_k = _used_tokens(cu_q, cu_k)

    if "k_cache" in kwargs and kwargs.get("block_table") is not None:
        # Decode fast path, cache updated by the model (later 5.x): the new tokens are ours to write.
        out = _decode_on_pages(q[:n_q], key, value, kwargs["k_cache"], kwargs["v_cache"],
                               kwargs["block_table"], cu_q, cu_k, options)
    elif cache is None or _model_updated_cache(cache):
        k, v = (t[0].transpose(0, 1)[:n_k] for t in (key, value))  # (total_k, Hkv, D) views
        out = _varlen(q[:n_q], k, v, cu_q, cu_k, max_k, options)
    else:
        out = _attend_and_update(module, q[:n_q], key, value, cache, kwargs, cu_q, cu_k, max_k, options)
    if n_q < q.shape[0]:  # batches padded to a fixed size (CUDA graphs): padded rows are zero
        out = torch.cat([out, out.new_zeros((q.shape[0] - n_q, *out.shape[1:]))])
    return out.unsqueeze(0), None


def _attend_and_update(module, q, key, value, cache, kwargs, cu_q, cu_k, max_k, options):
    """The "paged|" protocol: write this layer's new K/V into the cache and attend over the cache."""
    group, layer_in_group = cache.layer_index_to_group_indices[module.layer_idx]
    k_new, v_new = (t[0].transpose(0, 1) for t in (key, value))  # (total_q, Hkv, D), as the cache stores them
    page = cache.block_size
    k_cache, v_cache = (c[layer_in_group].view(-1, page, *c[layer_in_group].shape[1:])
                        for c in (cache.key_cache, cache.value_cache))
    block_table = kwargs.get("block_table")
    if block_table is not None:  # decode fast path: one new token per sequence
        return _decode_on_pages(q, key, value, k_cache, v_cache, block_table[group], cu_q, cu_k, options)
    read_index, write_index = kwargs["read_index"][group], kwargs["write_index"][group]
    full_attention = getattr(cache, "sliding_windows", {}).get(module.layer_idx, 1) == 1
    if full_attention and read_index.numel() > 0 and takes_page_table():
        for c, new in ((k_cache, k_new), (v_cache, v_new)):
            c.view(-1, *c.shape[2:]).index_copy_(0, write_index, new)
        page_table = _pages_from_read_index(read_index, cu_k, max_k, page)
        return _on_pages(q, k_cache, v_cache, page_table, cu_k[1:] - cu_k[:-1], cu_q, options)
    k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                        read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    n_k = _used_tokens(cu_q, cu_k)[1]
    return _varlen(q, k[:n_k], v[:n_k], cu_q, cu_k, max_k, options)


def _decode_on_pages(q, key, value, k_cache, v_cache, block_table, cu_q, cu_k, options):
    """One new token per sequence: write it after the sequence's cached tokens, then attend."""
    lens = cu_k[1:] - cu_k[:-1]
    b = lens.shape[0]
    k_new, v_new = (t[0].transpose(0, 1)[:b] for t in (key, value))  # (B, Hkv, D)
    page = k_cache.shape[1]
    position = (lens - 1).long()
    slots = block_table[torch.arange(b, device=lens.device), position // page].long() * page + position % page
    real = lens > 0  # (batches padded to a fixed size end in empty sequences: nothing of theirs is written)
    for c, new in ((k_cache, k_new), (v_cache, v_new)):
        c.view(-1, *c.shape[2:]).index_copy_(0, slots[real], new[real])
    if not takes_page_table():
        return _varlen(q, *(_gather_pages(c, block_table, lens) for c in (k_cache, v_cache)), cu_q, cu_k,
                       None, options)
    return _on_pages(q, k_cache, v_cache, block_table.to(torch.int32), lens, cu_q, options)


def _on_pages(q, k_cache, v_cache, page_table, lens, cu_q, options):
    return torch_fa4.attention(q, k_cache, v_cache, page_table=page_table, seqused_k=lens.to(torch.int32),
                               cu_seqlens_q=cu_q, **options)


def _varlen(q, k, v, cu_q, cu_k, max_k, options):
    return torch_fa4.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=max_k, **options)


def _pages_from_read_index(read_index, cu_k, max_k, page):
    """(B, max pages) int32: page j of sequence b holds its tokens [j * page, (j + 1) * page)."""
    lens = cu_k[1:] - cu_k[:-1]
    longest = int(max_k) if max_k is not None else int(lens.max())
    starts = torch.arange(0, max(longest, 1), page, device=cu_k.device, dtype=cu_k.dtype)
    at = (cu_k[:-1, None] + starts).clamp_(max=read_index.numel() - 1).long()
    pages = torch.div(read_index[at], page, rounding_mode="floor")
    return torch.where(starts < lens[:, None], pages, torch.zeros_like(pages)).to(torch.int32)


def _gather_pages(cache, page_table, lens):
    """The used tokens of every sequence, packed: (sum(lens), Hkv, D) (a copy)."""
    rows = []
    for b, n in enumerate(lens.tolist()):
        rows.append(cache[page_table[b].long()].flatten(0, 1)[:n])
    return torch.cat(rows) if rows else cache.new_empty((0, *cache.shape[2:]))


# cu_seq_lens read once per tensor while it lives unmodified (the model hands each layer the same)
_TOTALS = TensorMemo(capacity=16)


def _used_tokens(cu_q, cu_k) -> tuple[int, int]:
    found = _TOTALS.get((cu_q, cu_k))
    if found is None:
        found = tuple(torch.stack([cu_q[-1], cu_k[-1]]).tolist())
        _TOTALS.put((cu_q, cu_k), (), found)
    return found


def _int_or_none(x):
    return None if x is None else int(x)


def _for_layer(value, layer_type):
    return value[layer_type] if isinstance(value, dict) else value


def _first(kwargs, *names):
    for name in names:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def _model_updated_cache(cache) -> bool:
    """Whether this Transformers' model layers call `cache.update(..., kwargs)` themselves."""
    return _update_takes_kwargs(type(cache))


@functools.lru_cache(maxsize=None)
def _update_takes_kwargs(cache_type) -> bool:
    return "kwargs" in inspect.signature(cache_type.update).parameters


def takes_page_table() -> bool:
    """Whether `torch_fa4.attention` reads a paged KV cache (`page_table=`)."""
    return _takes_page_table(torch_fa4.attention)


@functools.lru_cache(maxsize=8)
def _takes_page_table(attention) -> bool:
    return "page_table" in inspect.signature(attention).parameters
