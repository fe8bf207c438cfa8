"""A block mask of `band & rest` as a kernel sees it once the band is its own causal / window mask.

FlexAttention's lists (block_mask.py) call a tile *partial* where the mask_mod must be evaluated
and *full* where it is true everywhere. For a mask `band & rest` (a document mask ANDed with
causal: torch_fa4.mods.idioms.mask_band_split) whose band the kernel applies itself, a tile that
is partial only because the band cuts it (the diagonal tiles of a document) needs no mask_mod:
`rest` holds wherever the band does. `without_band` moves those tiles from the partial lists to
the full ones, by evaluating `rest | ~band` over the tiles (the lists are kept where they were:
visible tiles stay visible, empty ones empty). The kernel then evaluates `rest` only where it
cuts, and the band's test is the built-in one, an affine compare on the tiles it crosses.

The result depends on the block mask's tensors, `rest` and its captured tensors, so it is kept
per them (call_memo.ModsMemo: identities, versions and data pointers; an entry goes when one of
its tensors dies, and keeps none of them alive). Plain torch ops on the mask's device, no host
synchronisation.
"""

from __future__ import annotations

from typing import Sequence

import torch

from torch_fa4.mods.block_mask import _compress, _evaluate_tiles
from torch_fa4.mods.call_memo import ModsMemo

_CACHE = ModsMemo(capacity=16)


def without_band(bm_tensors: Sequence[torch.Tensor], bq: int, bkv: int, band: tuple, rest_mods,
                 mask_aux: Sequence[torch.Tensor], q_len: int, kv_len: int) -> list[torch.Tensor]:
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) of the block mask
    `bm_tensors` (built from band & rest) with the tiles on which `rest` holds wherever the band
    (lo, hi) of q_idx - kv_idx does moved to the full lists. rest_mods: the ModSet whose mask
    graph is `rest`."""
    tensors = (*bm_tensors, *mask_aux)
    extra = (bq, bkv, tuple(band), rest_mods.key, q_len, kv_len)
    hit = _CACHE.get(tensors, extra)
    if hit is not None:
        return list(hit)
    lists = _reclassify(bm_tensors, bq, bkv, band, rest_mods, mask_aux, q_len, kv_len)
    _CACHE.put(tensors, extra, lists)
    return list(lists)


def _reclassify(bm_tensors, bq, bkv, band, rest_mods, mask_aux, q_len, kv_len):
    num, idx, full_num, full_idx = bm_tensors
    B, H, nq = num.shape
    nkv = idx.shape[-1]
    partial, full = _flags(num, idx), _flags(full_num, full_idx)
    _, rest_full = _evaluate_tiles(_RestOutsideBand(rest_mods, band), mask_aux, B, H, q_len, kv_len, bq, bkv,
                                   num.device)
    # (lists longer than the lengths need: tiles past them hold no position, `rest` holds there)
    grid = torch.ones(B, H, nq, nkv, dtype=torch.bool, device=num.device)
    tq, tk = min(nq, rest_full.shape[2]), min(nkv, rest_full.shape[3])
    grid[:, :, :tq, :tk] = rest_full[:, :, :tq, :tk]
    moved = partial & grid
    return (*_compress(partial & ~moved), *_compress(full | moved))


def _flags(count: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(B, H, nq, nkv) bool: the tiles a (count, indices) list pair names."""
    cols = torch.arange(indices.shape[-1], device=indices.device)
    listed = (cols < count[..., None]).to(torch.int32)
    hits = torch.zeros(indices.shape, dtype=torch.int32, device=indices.device)
    # (padding entries point at tile 0 and add 0)
    return hits.scatter_add_(-1, indices.long(), listed) > 0


class _RestOutsideBand:
    """A ModSet stand-in for _evaluate_tiles: `rest | ~band`, true wherever the kernel needs no
    mask_mod once it applies the band itself."""

    def __init__(self, rest_mods, band):
        self.rest_mods, self.lo, self.hi = rest_mods, band[0], band[1]

    def mask_torch(self, b, h, q_idx, kv_idx, mask_aux):
        d = q_idx - kv_idx
        in_band = (d >= self.lo) & (d <= self.hi)
        return self.rest_mods.mask_torch(b, h, q_idx, kv_idx, mask_aux).bool() | ~in_band
