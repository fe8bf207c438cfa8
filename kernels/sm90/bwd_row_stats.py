"""The sm90 backward's row statistics: per query row lse * log2(e) and rowsum(dO * O) in fp32,
padded to whole query tiles of the variant, and for packed varlen batches moved to tile-aligned
per-sequence offsets (a TMA load of fp32 rows must start 16-byte aligned, NOTES Experiment 160).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from torch_fa4.kernels.sm90.bwd_config import TILE_M
from torch_fa4.tensor_memo import TensorMemo

if TYPE_CHECKING:
    from torch_fa4.call import AttentionCall


def _pad_rows(x: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """Copy x (..., S) into a contiguous (..., rows) float32 buffer filled with `value`."""
    out = torch.full((*x.shape[:-1], rows), value, dtype=torch.float32, device=x.device)
    out[..., : x.shape[-1]] = x
    return out


def row_statistics(call: "AttentionCall", dout, out, lse, min_rows: int = 0, tile_m: int = TILE_M,
                   zero_dq=None):
    """(lse * log2 e, rowsum(dO * O), rows) in fp32 per query row, padded to whole query tiles
    of `tile_m` rows (at least `min_rows`, dense: a block-sparse walk's last block-mask row);
    (B, Hq, rows) dense, (Hq, rows) varlen. Rows with no visible key (lse = -inf) and padding
    rows get +inf, so that P = exp2(s - lse) = 0 there (dq 0, never NaN); dPsum is 0 on padding.

    The fused bwd_prepare kernel where it takes the tensors, else (CPU, odd views) the torch
    expression below. `zero_dq`: a dQ buffer to zero as well (inside the fused pass where it can).
    """
    rows = stat_rows(call, tile_m, min_rows)
    if dout.is_cuda:
        from . import bwd_prepare

        if bwd_prepare.unsupported_reason(dout, out, lse) is None:
            fused_zero = zero_dq is not None and bwd_prepare.dq_zeroing_takes(zero_dq, dout)
            stats = bwd_prepare.row_statistics(dout, out, lse, rows, zero_dq if fused_zero else None)
            if zero_dq is not None and not fused_zero:
                zero_dq.zero_()
            if call.is_varlen:
                stats = varlen_stat_layout(call, stats, tile_m)
            return (*stats, rows)
    if zero_dq is not None:
        zero_dq.zero_()
    lse2 = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse * math.log2(math.e))
    dpsum = (dout.float() * out.float()).sum(-1).transpose(-1, -2)  # (B, Hq, Sq) or (Hq, Tq)
    lse2, dpsum = _pad_rows(lse2, rows, math.inf), _pad_rows(dpsum, rows, 0.0)
    if call.is_varlen:
        lse2, dpsum = varlen_stat_layout(call, torch.stack((lse2, dpsum)), tile_m)
    return lse2, dpsum, rows


def stat_rows(call: "AttentionCall", tile_m: int, min_rows: int = 0) -> int:
    """The rows of row_statistics' buffers before any varlen layout: whole query tiles of tile_m
    (at least min_rows) dense; the packed rows and a tile more varlen."""
    if call.is_varlen:
        return (math.ceil(call.q.shape[0] / tile_m) + 1) * tile_m
    return max(math.ceil(call.q.shape[1] / tile_m) * tile_m, min_rows)


def stat_row_offsets(cu_seqlens_q: torch.Tensor, tile_m: int) -> torch.Tensor:
    """Where each sequence's LSE / dPsum rows start in the varlen backward's layout (int64, B):
    its first packed row moved down to a whole query tile, b tiles further on, so that every
    tile the kernel loads starts 16-byte aligned (bwd_kernel._stat_row_offset computes the same
    on the device). Sequence b's tiles end at or before sequence b + 1's start:
    (c + L + (b + 1) t) // t >= (c + b t) // t + ceil(L / t) for c = cu[b], L its length."""
    cu = cu_seqlens_q.to(torch.int64)
    b = torch.arange(cu.numel() - 1, device=cu.device)
    return (cu[:-1] + b * tile_m) // tile_m * tile_m


# stat_sources' results per live, unmodified cu_seqlens_q tensor (a model's layers share one)
_STAT_SOURCES = TensorMemo(capacity=16)


def stat_sources(cu_seqlens_q: torch.Tensor, total: int, tile_m: int) -> torch.Tensor:
    """For each row of the varlen statistics layout, the packed row it holds, or `total` where it
    holds none (int64, rows): row `total` of row_statistics' buffers is padding (+inf / 0), so one
    gather lays the statistics out, padding included. Kept per offsets tensor (NOTES Experiment
    161)."""
    cu = cu_seqlens_q
    hit = _STAT_SOURCES.get((cu,), (total, tile_m))
    if hit is not None:
        return hit
    cu64 = cu.to(torch.int64)
    rows = (math.ceil(total / tile_m) + cu64.numel()) * tile_m  # a tile more per sequence, and one
    t = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu64[1:], t, right=True)  # the sequence of each packed row
    src = torch.full((rows,), total, dtype=torch.int64, device=cu.device)
    src[t + (stat_row_offsets(cu64, tile_m) - cu64[:-1])[seq]] = t
    _STAT_SOURCES.put((cu,), (total, tile_m), src)
    return src


def varlen_stat_layout(call: "AttentionCall", stats: torch.Tensor, tile_m: int):
    """The packed rows' statistics, lse2 and dpsum stacked (2, Hq, > T: row T is padding), moved
    to the tile-aligned per-sequence offsets of stat_row_offsets in one gather: (lse2, dpsum),
    (Hq, rows) each, other rows +inf / 0."""
    total = call.q.shape[0]
    assert stats.shape[-1] > total, "row_statistics' varlen buffers end with padding rows"
    moved = stats.index_select(2, stat_sources(call.cu_seqlens_q, total, tile_m))
    return moved[0], moved[1]
