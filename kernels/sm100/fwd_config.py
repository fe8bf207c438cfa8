"""The sm100 forward's variant key and its memory budgets (plain Python: no CuTe DSL import).

Tensor memory (TMEM) is 128 lanes x 512 columns of 32 bits per SM. A CTA works on `q_tiles`
128-row query tiles at once and keeps, per tile, the score accumulator S (tile_n fp32 columns,
reused in place for the bf16/fp16 probabilities P, which take half of them) and the output
accumulator O (head_dim_v columns): q_tiles * (tile_n + head_dim_v) <= 512. Two tiles (the
ping-pong) fit up to D=128 at tile_n=128 and D=192 at tile_n=64; D=256 takes one tile (384
columns). Shared memory: the Q tiles and a ring of K/V tiles within sm_100's 227 KB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TMEM_COLUMNS = 512
Q_TILE_ROWS = 128  # one UMMA M=128 tile per softmax warpgroup: TMEM lane i holds row i
MAX_Q_TILES = 2  # softmax warpgroups in the CTA (the second one idles with q_tiles = 1)


@dataclass(frozen=True)
class Sm100FwdConfig:
    """Everything that changes the generated code (part of the compile-cache key)."""

    dtype_name: str  # "bfloat16" | "float16"
    head_dim: int
    head_dim_v: int
    tile_n: int  # keys per tile (UMMA N of S = Q K^T, K of O += P V)
    kv_stages: int  # depth of the shared K/V shared-memory ring (K and V tiles alternate in it)
    causal: bool
    has_window: bool
    softcap: bool
    varlen_q: bool
    varlen_k: bool
    has_seqused_k: bool
    # 128-row query tiles per CTA, all sharing each K/V tile: 2 is the ping-pong (one tile's
    # softmax under the other's matmuls); 1 where two do not fit TMEM (D=256) or a block mask's
    # query blocks are 128 rows (the CTA's key tiles come from one block-mask row)
    q_tiles: int = 2
    # FA4's conditional rescale: a row's reference max moves only when the tile max exceeds it by
    # more than this (log2 units: 8 = a factor 256, safe in fp32 and bf16); None: always rescale
    rescale_threshold: Optional[float] = 8.0
    # every k-th exponential on the FMA pipe (a polynomial), the rest on MUFU.EX2; 0: all hardware
    # (fwd_host.default_config picks it per head dim)
    exp2_emulate_every: int = 0
    # the softmax's per-score scale and row sum and the O rescale on packed fp32 pairs (FFMA2 /
    # FADD2 / FMUL2: two operations per instruction slot; kernels/sm100/packed_softmax.py); False: scalar
    packed_f32x2: bool = True
    # registers per thread after setmaxnreg for the softmax, correction and other warpgroups, with two
    # query tiles: 2 * softmax + correction + other <= 512 (512 threads x 128 on entry). One query
    # tile: the softmax takes 240 and its idle twin 24 (fwd.py)
    registers: tuple = (184, 80, 64)
    mod_key: str = ""  # a ModSet in torch_fa4.mods.registry, whose graphs are inlined; "": none
    aux_specs: tuple = ()  # (torch dtype name, ndim) of each captured tensor, in ModSet order
    block_sparse: bool = False  # key tiles from a block mask (needs a mask_mod)
    bm_tiles_m: int = 1  # CTA tiles (q_tiles * 128 rows) per block-mask tile along queries
    bm_tiles_n: int = 1  # key tiles per block-mask tile along keys
    # a cluster of two CTAs shares each matmul (tcgen05 cta_group::2, M = 256): each CTA keeps its
    # own 128-row query tile(s) and half of every K and V tile, and the pair's MMA reads both halves
    # (kernels/sm100/pair). The pair walks one list of key tiles for its 2 * q_tiles * 128 rows
    two_cta: bool = False
    # score buffers (S / P) per query tile in tensor memory: 2 (one query tile only) lets the MMA
    # warp compute the next key tile's S = Q K^T while the softmax works on this one's (D=256:
    # 2 x 128 + 256 = 512 columns); 1: the MMA and the softmax wait on each other every key tile
    s_stages: int = 1

    @property
    def cta_group(self) -> int:
        """CTAs sharing one MMA (1, or 2 with two_cta)."""
        return 2 if self.two_cta else 1

    @property
    def cta_tile_m(self) -> int:
        """Query rows of one work item: one CTA's, or the pair's with two_cta."""
        return Q_TILE_ROWS * self.q_tiles * self.cta_group

    def tmem_columns(self) -> dict:
        """Column offsets of the S buffers (query tile t's at t, or with s_stages = 2 the one query
        tile's two buffers; P lives in the first tile_n/2 columns of its S) and of O_t per query
        tile t, and the columns used."""
        s = tuple(t * self.tile_n for t in range(self.q_tiles * self.s_stages))
        o0 = len(s) * self.tile_n
        o = tuple(o0 + t * self.head_dim_v for t in range(self.q_tiles))
        return {"s": s, "o": o, "used": o0 + self.q_tiles * self.head_dim_v}

    def smem_bytes(self) -> int:
        """Q (q_tiles tiles) plus the K/V ring, in bytes (2-byte elements), without barriers, per CTA
        (with two_cta a CTA holds half of each K / V tile)."""
        q = self.q_tiles * Q_TILE_ROWS * self.head_dim * 2
        kv = self.kv_stages * self.tile_n * max(self.head_dim, self.head_dim_v) * 2 // self.cta_group
        return q + kv


SMEM_LIMIT = 227 * 1024 - 3072  # opt-in maximum per CTA, less room for mbarriers and messages
