"""The sm90 backward's compiled variant: `BwdConfig`, what one compile of bwd_kernel is built for
(the call's flags that change the code and bwd_variant's tile choices; what the kernel derives
from them is a property here), and the shared-memory budget (`smem_bytes`) that decides ring
stages and optional buffers.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

import torch

TILE_M = 64  # queries per kernel step everywhere but the D64 variant (128)
SMEM_LIMIT = 227 * 1024  # dynamic shared memory per CTA on sm_90


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    group: int  # query heads per KV head
    has_right: bool  # a causal / right-window limit
    has_left: bool  # a left-window limit
    softcap: bool
    varlen: bool  # packed rows (cu_seqlens on both sides)
    seqused_k: bool
    deterministic: bool
    mods_key: str  # the score_mod / mask_mod registry key ("" without mods)
    sparse: tuple | None  # block-mask walk: (query steps, key tiles) per block-mask tile
    tile_n: int  # keys per CTA: 128, or 64 (head dims above 128, 64-key block masks)
    tile_m: int  # queries per step: 64, or 128 (D = Dv = 64 on 128-key CTAs)
    persistent: bool  # one CTA per SM taking work tiles from a counter
    fused_dq: bool  # persistent: dq written by the kernel (no conversion pass)
    split_tail: bool  # persistent: the last round's tiles may run as pieces
    mask_key_tail: bool  # dense keys end inside a key tile: mask the tail's keys
    # score_mod slots whose captured tensors' gradients the kernel accumulates into fp32 buffers
    # (bwd_scores.CapturedGrads); () for none
    capture_slots: tuple = ()

    @cached_property
    def _ring(self) -> tuple[int, bool]:
        return ring(self.head_dim, self.head_dim_v, self.tile_n, self.tile_m)

    @property
    def stages(self) -> int:
        """Q / dO ring stages."""
        return self._ring[0]

    @property
    def dq_in_ring(self) -> bool:
        """dQ staged in the consumed Q / dO buffers instead of slabs of its own (D256)."""
        return self._ring[1]

    @property
    def narrow(self) -> bool:
        return self.tile_n == 64

    @property
    def separate_dq_slabs(self) -> bool:
        """The 128-key variants: dQ goes through its own slabs, issued before dK (its epilogue
        under dK, NOTES Experiment 26) and added by a dedicated warp (Experiment 25)."""
        return self.tile_n == 128 and not self.dq_in_ring

    @property
    def split_ring(self) -> bool:
        """Separate Q / dO ring barriers: the 128-query variant without a right limit (NOTES
        Experiments 45, 157: walks with a right limit lose with them)."""
        return self.tile_m == 128 and not self.has_right

    @property
    def descending_walk(self) -> bool:
        """Causal / right-window dense walks from the last query tile down (NOTES Experiment 76)."""
        return self.has_right and not self.deterministic and self.sparse is None

    @property
    def dq_transposed(self) -> bool:
        """dQ^T = K^T dS^T, where each warpgroup's share of dQ^T is 64 head-dim rows: D128 at 64
        queries, D64 at 128 (conflict-free slab stores, NOTES Experiments 79, 82)."""
        return (self.separate_dq_slabs and self.head_dim_v <= 128
                and (self.tile_m == TILE_M and self.head_dim == 128 or self.tile_m == 128 and self.head_dim == 64))

    @property
    def dkdv_share_slots(self) -> bool:
        """The persistent epilogue stages dK and dV in the dS^T slots at once: at 128 queries per
        step, where the slots hold two K tiles and K's swizzle is V's."""
        return self.tile_m == 128 and self.head_dim == self.head_dim_v and self.tile_m >= self.head_dim

    @property
    def own_dv_stage(self) -> bool:
        """The persistent kernel stages dV in a buffer of its own where the dS^T slots cannot take
        dK and dV at once and shared memory has room beside the rest (D128 at 64 queries: 1 KB to
        spare, none with fused_dq's staging tile)."""
        return (self.persistent and not self.dkdv_share_slots
                and smem_bytes(self.head_dim, self.head_dim_v, self.tile_n, self.stages, False, self.tile_m,
                               own_dv_stage=True, fused_dq=self.fused_dq) <= SMEM_LIMIT)


def smem_bytes(d: int, dv: int, tile_n: int, stages: int, dq_in_ring: bool, tile_m: int = TILE_M,
               own_dv_stage: bool = False, fused_dq: bool = False) -> int:
    """Shared memory of bwd_kernel's Storage (16-bit inputs), field by field with its alignments:
    barriers, LSE / dPsum ring (128-byte aligned), then 1024-byte aligned Q / dO ring, K, V,
    dS^T slots, fp32 dQ slabs, fused_dq's staging tile and dV's own staging buffer."""
    tm = tile_m

    def after(offset: int, align: int, size: int) -> int:
        return -(-offset // align) * align + size

    n = 8 * (4 * stages + 1) + 8 * 5 + 4 * 2 + 8 + 4 * 2 + 8 * 4 + 4 * 2  # ring (Q, dO), K / V, mailboxes
    stat = -(-tm // 32) * 32 * stages * 4  # stages of 128-byte multiples (TMA destinations)
    n = after(after(n, 128, stat), 128, stat)
    slabs = 32 * 4 if dq_in_ring else tm * d * 4
    for size in (stages * tm * d * 2, stages * tm * dv * 2, tile_n * d * 2, tile_n * dv * 2,
                 2 * tile_n * tm * 2, slabs):
        n = after(n, 1024, size)
    n = after(n, 1024, tile_m * d * 4) if fused_dq else n
    return after(n, 1024, tile_n * dv * 2) if own_dv_stage else n


def ring(d: int, dv: int, tile_n: int, tile_m: int = TILE_M) -> tuple[int, bool]:
    """(Q / dO ring stages, dQ staged in the ring) for head dims d, dv, `tile_n` keys per CTA and
    `tile_m` queries per step: two stages with separate dQ slabs where shared memory allows
    (D=192: ~210 KB); else two stages with dQ staged in the consumed Q / dO buffers (D=256:
    ~210 KB instead of ~274 KB; needs Dv >= D); else one stage."""
    if smem_bytes(d, dv, tile_n, 2, False, tile_m) <= SMEM_LIMIT:
        return 2, False
    if tile_m == TILE_M and dv >= d and smem_bytes(d, dv, tile_n, 2, True) <= SMEM_LIMIT:
        return 2, True
    return 1, False
