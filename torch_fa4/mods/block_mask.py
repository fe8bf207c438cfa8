"""Block sparsity: classify each (q tile, kv tile) of a mask_mod as empty, partial or full.

`create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)` returns a reusable `BlockMask` in FlexAttention's
layout (int32): `kv_num_blocks (B, H, nq)` / `kv_indices (B, H, nq, nkv)` list the *partial* tiles
of each q tile (the kernel applies the mask there), `full_kv_num_blocks` / `full_kv_indices` the
*full* ones (no mask needed); tiles in neither are empty and skipped. Indices are ascending, the
valid ones first; the rest of each row is padding (0).

Built-ins whose visibility is a simple function of tile bounds (causal, sliding window, prefix-LM
with an int prefix, chunked) are classified analytically from the tile bounds, with no grid.
Anything else is evaluated with the PyTorch lowering of its traced graph on the mask's device, a
band of q tiles and kv tiles at a time so memory stays bounded for long sequences.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from torch_fa4.mods import index_bounds, library
from torch_fa4.tensor_memo import TensorMemo

_GRID_BUDGET = 1 << 24  # mask elements evaluated at once (bool): ~16 MiB plus index temporaries


@dataclass
class BlockMask:
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    BLOCK_SIZE: tuple[int, int]
    mask_mod: Callable
    seq_lengths: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    @property
    def B(self) -> int:
        return self.kv_num_blocks.shape[0]

    @property
    def H(self) -> int:
        return self.kv_num_blocks.shape[1]

    @property
    def Q_LEN(self) -> int:
        return self.seq_lengths[0]

    @property
    def KV_LEN(self) -> int:
        return self.seq_lengths[1]

    def as_tensors(self) -> list[torch.Tensor]:
        return [self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices]

    def to(self, device) -> "BlockMask":
        return BlockMask(*[x.to(device) for x in self.as_tensors()], self.BLOCK_SIZE, self.mask_mod, self.seq_lengths)

    def tile_classes(self) -> torch.Tensor:
        """(B, H, nq, nkv) int8: 0 empty, 1 partial, 2 full (for inspection and tests)."""
        B, H, nq, nkv = self.kv_indices.shape
        out = torch.zeros(B, H, nq, nkv + 1, dtype=torch.int8, device=self.kv_indices.device)
        cols = torch.arange(nkv, device=out.device)
        for num, idx, cls in ((self.kv_num_blocks, self.kv_indices, 1), (self.full_kv_num_blocks, self.full_kv_indices, 2)):
            valid = cols < num[..., None].long()
            target = torch.where(valid, idx.long(), torch.full_like(idx.long(), nkv))  # padding -> spare column
            out.scatter_(-1, target, torch.where(valid, cls, 0).to(torch.int8))
        return out[..., :nkv]

    def sparsity(self) -> float:
        """Percentage of tiles skipped."""
        return 100.0 * float((self.tile_classes() == 0).float().mean())

    def __repr__(self) -> str:
        return (f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, "
                f"sparsity={self.sparsity():.1f}%, mask_mod={_short_name(self.mask_mod)})")


def _short_name(fn) -> str:
    """A one-line name for a mod: partials show their arguments, tensors only as dtype[shape]."""
    if isinstance(fn, torch.Tensor):
        return f"{str(fn.dtype).replace('torch.', '')}{list(fn.shape)}"
    if isinstance(fn, (tuple, list)):
        return ", ".join(_short_name(x) for x in fn)
    if isinstance(fn, functools.partial):
        args = [_short_name(a) for a in fn.args] + [f"{k}={_short_name(v)}" for k, v in fn.keywords.items()]
        return f"{_short_name(fn.func).lstrip('_')}({', '.join(args)})"
    return getattr(fn, "__name__", repr(fn))


def _tile_bounds(length: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    n = -(-length // block)
    lo = torch.arange(n, device=device, dtype=torch.int64) * block
    hi = torch.clamp(lo + block, max=length) - 1  # inclusive: the last tile may be short
    return lo, hi


# ---- analytic classification: (any visible, all visible) per tile from tile bounds ---------------

def _analytic(mask_mod: Callable) -> Optional[Callable]:
    if mask_mod is library.causal_mask:
        return lambda q0, q1, k0, k1: (k0 <= q1, k1 <= q0)
    if isinstance(mask_mod, functools.partial) and not mask_mod.args:
        fn, kw = mask_mod.func, mask_mod.keywords
        if fn is library._sliding_window:
            return functools.partial(_band, lo=-kw.get("right") if kw.get("right") is not None else None,
                                     hi=kw.get("left"))
        if fn is library._prefix_lm:
            p = kw["prefix"]
            # visible iff kv <= q or kv < p. any: some kv in the tile is <= max q or < p.
            # all: every kv satisfies one: the largest kv (k1) is < p, or k1 <= the smallest q.
            return lambda q0, q1, k0, k1: ((k0 <= q1) | (k0 < p), (k1 < p) | (k1 <= q0))
        if fn is library._chunked:
            c = kw["chunk"]
            return lambda q0, q1, k0, k1: (
                (k0 // c <= q1 // c) & (q0 // c <= k1 // c),
                (q0 // c == q1 // c) & (k0 // c == k1 // c) & (q0 // c == k0 // c),
            )
    return None


def _band(q0, q1, k0, k1, lo=None, hi=None):
    """Visible iff lo <= q - kv <= hi (None: unbounded); q - kv over a tile spans [q0-k1, q1-k0]."""
    dmin, dmax = q0 - k1, q1 - k0
    any_, all_ = torch.ones_like(dmin, dtype=torch.bool), torch.ones_like(dmin, dtype=torch.bool)
    if lo is not None:
        any_ &= dmax >= lo
        all_ &= dmin >= lo
    if hi is not None:
        any_ &= dmin <= hi
        all_ &= dmax <= hi
    return any_, all_


# ---- grid evaluation -----------------------------------------------------------------------------

def _evaluate_tiles(mods, mask_aux, B, H, Q_LEN, KV_LEN, bq, bkv, device):
    """(any, all) of shape (B, H, nq, nkv) from the mask evaluated on the index grid, in bands."""
    nq, nkv = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    any_ = torch.zeros(B, H, nq, nkv, dtype=torch.bool, device=device)
    all_ = torch.zeros_like(any_)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    per_tile_pair = B * H * bq * bkv
    kv_tiles = max(1, min(nkv, _GRID_BUDGET // max(1, per_tile_pair)))
    q_tiles = max(1, min(nq, _GRID_BUDGET // max(1, per_tile_pair * kv_tiles)))
    for qt0 in range(0, nq, q_tiles):
        qt1 = min(nq, qt0 + q_tiles)
        q = torch.arange(qt0 * bq, qt1 * bq, device=device)
        q_ok = q < Q_LEN
        q_idx = torch.clamp(q, max=Q_LEN - 1).view(1, 1, -1, 1)
        for kt0 in range(0, nkv, kv_tiles):
            kt1 = min(nkv, kt0 + kv_tiles)
            k = torch.arange(kt0 * bkv, kt1 * bkv, device=device)
            k_ok = k < KV_LEN
            kv_idx = torch.clamp(k, max=KV_LEN - 1).view(1, 1, 1, -1)
            m = mods.mask_torch(b, h, q_idx, kv_idx, mask_aux)
            m = torch.broadcast_to(m, (B, H, q.numel(), k.numel()))
            inside = (q_ok.view(-1, 1) & k_ok.view(1, -1)).view(1, 1, q.numel(), k.numel())
            # padding past the lengths counts as invisible for "any" and as visible for "all"
            vis_any = (m & inside).view(B, H, qt1 - qt0, bq, kt1 - kt0, bkv)
            vis_all = (m | ~inside).view(B, H, qt1 - qt0, bq, kt1 - kt0, bkv)
            any_[:, :, qt0:qt1, kt0:kt1] = vis_any.any(dim=5).any(dim=3)
            all_[:, :, qt0:qt1, kt0:kt1] = vis_all.all(dim=5).all(dim=3)
    return any_, all_


def _compress(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, nq, nkv) bool -> (count (B,H,nq), ascending indices first then padding 0) int32."""
    nkv = flags.shape[-1]
    count = flags.sum(dim=-1, dtype=torch.int32)
    cols = torch.arange(nkv, device=flags.device)
    # sort key: selected tiles first in ascending order, the rest after
    order = torch.where(flags, cols, cols + nkv).argsort(dim=-1, stable=True)
    idx = torch.where(cols < count[..., None], order, torch.zeros_like(order))
    return count, idx.to(torch.int32)


def create_block_mask(
    mask_mod: Callable,
    B: Optional[int],
    H: Optional[int],
    Q_LEN: int,
    KV_LEN: int,
    device="cuda",
    BLOCK_SIZE=128,
) -> BlockMask:
    """FlexAttention's create_block_mask for torch_fa4: a reusable tile map of `mask_mod`.

    B / H None broadcast over batch / heads (size 1), as in FlexAttention. BLOCK_SIZE is an int or
    (q, kv) pair: the tile size the kernels iterate with (128 for both forward kernels).
    """
    from torch_fa4.mods.prepare import trace_graphs

    bq, bkv = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if bq <= 0 or bkv <= 0 or Q_LEN <= 0 or KV_LEN <= 0:
        raise ValueError("create_block_mask: lengths and BLOCK_SIZE must be positive")
    Bn, Hn = (1 if B is None else int(B)), (1 if H is None else int(H))
    device = torch.device(device)
    mods, aux = trace_graphs(None, mask_mod)  # validates the mask_mod (bool result, supported ops)
    index_bounds.check(mods, aux, (Bn, Hn, int(Q_LEN), int(KV_LEN)))  # its tensor reads stay in range
    analytic = _analytic(mask_mod)
    if analytic is not None:
        q0, q1 = _tile_bounds(Q_LEN, bq, device)
        k0, k1 = _tile_bounds(KV_LEN, bkv, device)
        any_, all_ = analytic(q0.view(-1, 1), q1.view(-1, 1), k0.view(1, -1), k1.view(1, -1))
        shape = (Bn, Hn, q0.numel(), k0.numel())
        any_, all_ = torch.broadcast_to(any_, shape), torch.broadcast_to(all_, shape)
    else:
        any_, all_ = _evaluate_tiles(mods, aux, Bn, Hn, Q_LEN, KV_LEN, bq, bkv, device)
    kv_num, kv_idx = _compress(any_ & ~all_)  # partial tiles
    full_num, full_idx = _compress(any_ & all_)
    return BlockMask(kv_num, kv_idx, full_num, full_idx, (bq, bkv), mask_mod, (int(Q_LEN), int(KV_LEN)))


def as_block_mask(block_mask) -> BlockMask:
    """Accept a torch_fa4 BlockMask or torch's own flex_attention BlockMask."""
    if isinstance(block_mask, BlockMask):
        return block_mask
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    if isinstance(block_mask, TorchBlockMask):
        bq, bkv = block_mask.BLOCK_SIZE
        return BlockMask(*_torch_lists(block_mask), (int(bq), int(bkv)), block_mask.mask_mod,
                         tuple(int(x) for x in block_mask.seq_lengths))
    raise TypeError(f"torch_fa4: block_mask must be a BlockMask from create_block_mask, got {type(block_mask).__name__}")


# torch BlockMask lists -> their int32 form, with zero full lists where torch made none. Kept per
# source tensors (ids, versions, data pointers: torch_fa4.tensor_memo), so that a repeated call
# hands the same tensors on: the mods' memos (call_memo.py, block_lists.py) are keyed by the
# tensors' identities, and fresh zeros on every call would miss them. Only what was made here is
# kept (None where a list is used as given: the memo holds no caller's tensor).
_TORCH_LISTS = TensorMemo(capacity=64)


def _torch_lists(block_mask) -> tuple:
    lists = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
             block_mask.full_kv_indices)
    kept = not torch.compiler.is_compiling()  # (traced: the conversion is part of the graph)
    if kept and (made := _TORCH_LISTS.get(lists)) is not None:
        return tuple(given if own is None else own for given, own in zip(lists, made))
    kv_num, kv_idx, full_num, full_idx = lists
    if full_num is None:  # torch built it without full blocks: every visited tile is partial
        full_num, full_idx = torch.zeros_like(kv_num), torch.zeros_like(kv_idx)
    converted = tuple(t.to(torch.int32) for t in (kv_num, kv_idx, full_num, full_idx))
    if kept:
        _TORCH_LISTS.put(lists, (), tuple(None if c is g else c for c, g in zip(converted, lists)))
    return converted
