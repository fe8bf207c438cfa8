"""One attention call as the ops see it: tensors, per-call scalars and the resolved mods.

The ops build an `AttentionCall` from their flat argument list and hand it to dispatch, so every
backend (reference, sm90, sm100) reads the same fields with the same meaning (docs/INTERNALS.md).

Paged KV caches: with a `page_table` (B, max_pages) int32, k / v are caches of pages,
(num_pages, page_size, Hkv, D), and sequence b's key j lies at row j % page_size of page
page_table[b, j // page_size]. Sequence b holds seqused_k[b] keys (max_pages * page_size without
seqused_k); page-table entries past its last used page are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:  # the registry imports torch.fx machinery; keep it out of import time
    from torch_fa4.mods.registry import ModSet


def empty_laid_out_like(like: torch.Tensor, shape: Sequence[int], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An uninitialised dense tensor of `shape` whose leading dims lie in memory in the order of
    `like`'s (larger stride outermost; the last dim innermost), as torch.empty_like lays out a dense
    tensor, for a shape that may differ in the last dim (Dv). The forward's output takes q's
    layout, so a (B, S, H, D) view of (B, H, S, D) memory -- SDPA's layout -- gets an output of
    that layout, and SDPA's callers receive it without a copy. Every backend and the fwd op's fake
    kernel allocate through here, so the strides are the same on every path."""
    if like.is_contiguous():  # the usual case, kept off the sort and the permute
        return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)
    lead = like.dim() - 1
    order = sorted(range(lead), key=lambda d: (-like.stride(d), d)) + [lead]  # outermost first
    t = torch.empty([shape[d] for d in order], dtype=dtype or like.dtype, device=like.device)
    return t.permute([order.index(d) for d in range(like.dim())])


@dataclass
class AttentionCall:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    causal: bool = False
    window_left: int = -1  # -1: unbounded
    window_right: int = -1
    softcap: float = 0.0
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    mod_key: str = ""
    mods: Optional["ModSet"] = None
    aux_tensors: Sequence[torch.Tensor] = field(default_factory=tuple)
    block_mask: Sequence[torch.Tensor] = field(default_factory=tuple)
    block_mask_q: int = 128
    block_mask_kv: int = 128
    page_table: Optional[torch.Tensor] = None  # (B, max_pages) int32: k / v are paged caches

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def is_paged(self) -> bool:
        return self.page_table is not None

    @property
    def page_size(self) -> int:
        """Keys per page of a paged cache (k is (num_pages, page_size, Hkv, D))."""
        return self.k.shape[1]

    @property
    def kv_len(self) -> int:
        """Key positions along the call's key axis: max_pages * page_size with a page table (the
        most keys a sequence can hold), else k's sequence mode (Sk dense, total_k packed)."""
        if self.page_table is not None:
            return self.page_table.shape[1] * self.k.shape[1]
        return self.k.shape[-3]

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.numel() - 1 if self.is_varlen else self.q.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q.shape[-2]

    @property
    def num_heads_kv(self) -> int:
        return self.k.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def head_dim_v(self) -> int:
        return self.v.shape[-1]

    @property
    def has_window(self) -> bool:
        """A sliding-window bound beyond the causal one. Causal calls come with window_right = 0
        (torch_fa4.attention and the SDPA route set it, flash-attn's convention), which bounds
        nothing the causal mask does not, so it must not pick the windowed kernel variants."""
        return self.window_left >= 0 or (self.window_right >= 0 and not self.causal)

    @property
    def score_aux(self) -> Sequence[torch.Tensor]:
        n = self.mods.num_score_aux if self.mods is not None else 0
        return tuple(self.aux_tensors[:n])

    @property
    def mask_aux(self) -> Sequence[torch.Tensor]:
        n = self.mods.num_score_aux if self.mods is not None else 0
        return tuple(self.aux_tensors[n:])

    @property
    def lse_dtype(self) -> torch.dtype:
        # float32 as flash-attn, except that float64 inputs keep float64 (an exact oracle).
        return torch.float64 if self.q.dtype == torch.float64 else torch.float32

    def out_shape(self) -> tuple[int, ...]:
        return (*self.q.shape[:-1], self.head_dim_v)

    def lse_shape(self) -> tuple[int, ...]:
        if self.is_varlen:
            return (self.num_heads, self.q.shape[0])
        return (self.q.shape[0], self.num_heads, self.q.shape[1])
