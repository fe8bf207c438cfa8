"""Where the backward's per-query statistics (lse * log2 e and dPsum) sit inside a query tile.

The consumer warpgroups hold S^T / dP^T with queries along the columns: a thread's columns are
c0 + 8 j + 2 q + e (q = its lane % 4, e in {0, 1}, j over the tile), so in the natural order
each thread gathers its statistics as 64-bit pairs, 8 or 16 loads per statistic and step.
The permuted order (`TORCH_FA4_BWD_STATS_T`, bwd_kernel `permuted_stats`) stores a tile of tm
values as four segments of tm / 4, one per q, each holding 2 j + e in order, so a thread reads
its values as 16-byte vectors. The 16-byte chunks of segment q are rotated by `_rotation` so that
the four segments' k-th chunks fall on different banks (conflict-free vector loads).

The row-statistics pass (bwd_prepare.py, or the torch path in bwd.row_statistics) writes the
permuted order; the main kernel's loads read it (bwd_scores.BwdScores._column_stats). Both use
`position`, written so that it runs on Python ints, torch tensors and CuTe DSL integers alike.
"""

from __future__ import annotations

TILES = (64, 80, 128)  # the query tiles the permuted order is defined for


def _chunks(tm: int) -> int:
    """16-byte chunks per segment (tm / 4 floats)."""
    return tm // 16


def _rotation(q, tm: int):
    """Chunk rotation of segment q: segments start q * tm bytes apart, so without it their k-th
    chunks share banks at tm = 64 (segments 0 / 2, 1 / 3) and at tm = 128 (all four); at tm = 80
    they already differ."""
    if tm == 128:
        return q
    if tm == 64:
        return (q // 2) * 2
    return q * 0


def position(i, tm: int):
    """Position of query row i (any row of the padded buffer) in the permuted order."""
    r = i % tm
    q = (r % 8) // 2
    k = (r // 8) * 2 + r % 2  # 2 j + e: this row's place in segment q
    n = _chunks(tm)
    return (i - r) + q * (tm // 4) + ((k // 4 + _rotation(q, tm)) % n) * 4 + k % 4


def chunk_offset(q, chunk, tm: int):
    """Float offset in a stage of segment q's chunk `chunk` (0 <= chunk < tm / 16 before the
    rotation is applied)."""
    return q * (tm // 4) + ((chunk + _rotation(q, tm)) % _chunks(tm)) * 4


def permute_rows(x, tm: int):
    """torch: a (..., rows) buffer in natural order -> the permuted order (rows % tm == 0)."""
    import torch

    rows = x.shape[-1]
    assert rows % tm == 0, f"{rows} rows are not whole {tm}-row tiles"
    pos = position(torch.arange(rows, device=x.device), tm)
    out = torch.empty_like(x)
    out[..., pos] = x
    return out
