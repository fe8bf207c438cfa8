"""Paged KV caches on the forward kernels: which page sizes their TMA loads take, and the call on
gathered contiguous K / V for the others. Free of CuTe DSL (the host decides before compiling).

A paged call's k / v are caches of pages (num_pages, page_size, Hkv, D) and its page table
(B, max_pages) lists each sequence's pages in order (torch_fa4/call.py). The sm90 forward loads a
key tile page by page, one TMA box per page (or one per tile where a page holds whole tiles), the
box landing at its rows of the tile's swizzled shared-memory slot; the 128-byte swizzle repeats
every 8 rows, so a box must start and end on a multiple of 8 rows. Page sizes it cannot load that
way (1, 2, 3, 24 with 128-key tiles, ...) run on a contiguous copy of the used pages (`gathered`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from torch_fa4.call import AttentionCall

SWIZZLE_ROWS = 8  # rows of the 128-byte swizzle atom of K / V tiles (64 fp16 / bf16 columns)


def page_box(page_size: int, tile_n: int) -> int:
    """Rows per TMA box of a paged K / V tile of `tile_n` keys: the page size where it divides the
    tile (and is a multiple of the swizzle atom's 8 rows), the whole tile where each page holds
    whole tiles (page size a multiple of tile_n); 0 where the tile cannot be loaded from pages."""
    if page_size >= tile_n:
        return tile_n if page_size % tile_n == 0 else 0
    return page_size if page_size % SWIZZLE_ROWS == 0 and tile_n % page_size == 0 else 0


def gathered(call: AttentionCall) -> AttentionCall:
    """The call on contiguous K / V: each sequence's max_pages pages copied in order, into
    (B, max_pages * page_size, Hkv, D) (with packed queries: (B * max_pages * page_size, Hkv, D)
    and cu_seqlens_k at whole sequences). Pages past a sequence's last used one are not read: their
    rows are zeros, and seqused_k still ends each sequence. No device read (one gather launch per
    tensor); page ids outside the cache are clamped into it (eager calls were refused before, by
    checks.check_varlen_values)."""
    pt = call.page_table
    batch, max_pages = pt.shape
    num_pages, page_size = call.k.shape[0], call.k.shape[1]
    slots = torch.arange(max_pages, device=pt.device).view(1, -1)
    if call.seqused_k is not None:
        in_use = slots * page_size < call.seqused_k.view(-1, 1)
    else:
        in_use = torch.ones_like(pt, dtype=torch.bool)
    ids = torch.where(in_use, pt, 0).clamp_(0, max(num_pages - 1, 0)).long()
    unused = ~in_use.view(batch, max_pages, 1, 1, 1)
    cap = max_pages * page_size

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[ids].masked_fill_(unused, 0)  # (B, max_pages, page_size, Hkv, X)
        return rows.view(batch, cap, *cache.shape[2:])

    k, v = gather(call.k), gather(call.v)
    if not call.is_varlen:
        return replace(call, k=k, v=v, page_table=None, max_seqlen_k=cap)
    cu_k = torch.arange(0, (batch + 1) * cap, cap, dtype=torch.int32, device=pt.device)
    return replace(call, k=k.flatten(0, 1), v=v.flatten(0, 1), page_table=None, cu_seqlens_k=cu_k,
                   max_seqlen_k=cap)
