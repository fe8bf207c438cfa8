"""Which variant of the portable backward kernel a call compiles: its static choices and tiles.

Tiles are chosen so that one CTA fits the smallest shared memory of the targets (sm_86/89/120:
~99 KB per block; sm_80 has 163 KB) up to head dim 192 (256 needs sm_80's or Hopper's), and its
dK, dV accumulators fit the register file without spilling (8 warps, 16-row warp slabs of the
m16n8k16 MMA).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)


@dataclass(frozen=True)
class BwdVariant:
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    tile_m: int  # query rows per step
    tile_n: int  # keys per CTA
    num_warps: int
    sdp_warps_n: int  # warps side by side along the keys of S / dP (the rest stack along queries)
    kv_warps_n: int  # ... along the head dim of dK / dV
    dq_warps_n: int  # ... along the head dim of dQ
    bounded: bool  # causal and/or a sliding window: per-element key limits
    softcap: bool
    deterministic: bool
    varlen: bool
    seqused_k: bool
    stages: int = 1  # Q / dO buffers (2: the next query tile loads while this one computes)
    mods_key: str = ""  # score_mod / mask_mod inlined (torch_fa4.mods registry key)
    sparse: bool = False  # a block mask's tile map prunes the walk (bwd_sparse.py)
    # dQ's fp32 adds two adjacent columns per instruction (red.global.add.v2.f32: sm_90 and later):
    # half the atomic instructions, and each fills whole 32-byte sectors
    dq_pair_adds: bool = False
    # lse2 / dpsum read under the dP product instead of before S's, so that they hold no registers
    # through it: set where ptxas otherwise spilled inside the loops (make_variant)
    late_row_stats: bool = False
    # the query tiles the key limits cut in a masked loop, the rest in an unmasked copy of it (False:
    # one loop, every tile masked). H200: +4-12% where causal, +4% at D64 without; nothing at D128
    # without (only the key end cuts there), where the second loop would double the first compile
    split_walk: bool = True

    def smem_bytes(self) -> int:
        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        return 2 * (self.stages * tm * (d + dv) + tn * (d + dv) + 2 * tm * tn)


def warps_n(m: int, n: int, warps: int) -> int:
    """Warps side by side along N of an (M, N) product computed by `warps` warps of m16n8k16 MMAs:
    the arrangement that reads the fewest operand bytes by ldmatrix. Each warp reads its M / wm rows
    of A and N / wn rows of B over the whole K extent, so shared-memory traffic is proportional to
    M / wm + N / wn (at D=128 the old arrangement read 786 KB per step against ~4000 clocks of MMA
    work; this one 590 KB, +15-17% speed on the H200). A warp's N extent is a multiple of 16 where
    one is (the tiled MMA's permutation); ties keep fewer along N."""
    fits = [wn for wn in (1, 2, 4, 8) if warps % wn == 0 and m % (16 * (warps // wn)) == 0]
    assert fits, f"no warp arrangement for a {m}-row product"
    even = [wn for wn in fits if n % (16 * wn) == 0] or fits[:1]  # (N = 96 over 4 warps: 24 columns)
    return min(even, key=lambda wn: (m // (warps // wn) + n // wn, wn))


def tiles(head_dim: int, head_dim_v: int, mods: bool = False, large: bool = False,
          softcap: bool = False) -> dict:
    """(tile_m, tile_n, warps and their arrangement) for the larger of the two head dims: 8 warps,
    so that each thread's share of dK + dV stays within ~128 fp32 registers. Inlined mods take
    registers of their own: head dim 64 then gets the 64-key tile too (128 keys spill).

    large: twice the keys per CTA above head dim 64, for GPUs with more than ~128 KB of shared
    memory per block (sm_80, Hopper): each key tile adds its dQ share to the fp32 buffer by
    atomics, so wider key tiles halve that traffic, the backward's largest memory stream. At head
    dim 64, twice the query rows per step instead (128 x 128): per flop, fewer operand bytes read
    by ldmatrix and half the barriers."""
    d = max(head_dim, head_dim_v)
    if large and d <= 64 and not mods and not softcap:
        # S, dP: 64 + 64 fp32 per thread, dK + dV 64: fits without spilling (softcap's per-element
        # derivative, held from S to dS, spilled 43 registers on sm_80)
        tm, tn = 128, 128
    elif (large and 64 < d <= 128 and not mods) or (d <= 64 and not mods):
        tm, tn = 64, 128
    elif large and d > 128:
        tm, tn = 64, 64
    elif d <= 128:
        tm, tn = 64, 64
    else:
        tm, tn = 64, 32
    warps = 8
    return dict(tile_m=tm, tile_n=tn, num_warps=warps,
                sdp_warps_n=warps_n(tm, tn, warps),  # S, dP: (queries, keys), K = head dim
                kv_warps_n=min(warps_n(tn, head_dim, warps), warps_n(tn, head_dim_v, warps)),  # (keys, D)
                dq_warps_n=warps_n(tm, head_dim, warps))  # dQ: (queries, D), K = keys


def smem_limit(capability: tuple) -> int:
    """Opt-in shared memory per block of a compute capability (bytes)."""
    return {(8, 0): 163 * 1024, (8, 7): 163 * 1024, (9, 0): 227 * 1024}.get(
        tuple(capability), 227 * 1024 if capability[0] == 10 else 99 * 1024)


def make_variant(dtype, head_dim: int, head_dim_v: int, *, bounded: bool = False, softcap: bool = False,
                 deterministic: bool = False, varlen: bool = False, seqused_k: bool = False,
                 stages: int = 1, mods_key: str = "", large_tiles: bool = False,
                 dq_pair_adds: bool = False) -> BwdVariant:
    # the paired atomics' 64 x 128 variants at head dims 96 / 128 (dK + dV: 128 fp32 per thread)
    # spilled 4-5 registers in their loops with the statistics read early; elsewhere reading them
    # late spilled instead (sm_80, head dims 64 and 256)
    late = dq_pair_adds and large_tiles and 64 < max(head_dim, head_dim_v) <= 128 and not mods_key
    split = bounded or max(head_dim, head_dim_v) <= 64
    return BwdVariant(dtype, head_dim, head_dim_v, late_row_stats=late, split_walk=split,
                      **tiles(head_dim, head_dim_v, bool(mods_key), large_tiles, softcap),
                      bounded=bounded, softcap=softcap, deterministic=deterministic, varlen=varlen,
                      seqused_k=seqused_k, stages=stages, mods_key=mods_key, dq_pair_adds=dq_pair_adds)


def most_stages(variant: BwdVariant, limit: int, most: int = 2) -> BwdVariant:
    """variant with the most Q / dO buffers (up to `most`) that fit `limit` bytes of shared memory."""
    for stages in range(most, 1, -1):
        v = dataclasses.replace(variant, stages=stages)
        if v.smem_bytes() <= limit:
            return v
    return dataclasses.replace(variant, stages=1)
