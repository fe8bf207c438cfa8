"""The sm100 forward's variant key and its tensor-memory budget (plain Python: no CuTe DSL import).

Tensor memory (TMEM) is 128 lanes x 512 columns of 32 bits per SM. A CTA works on two 128-row query
tiles at once and keeps, per tile, the score accumulator S (tile_n fp32 columns, reused in place for
the bf16/fp16 probabilities P, which take half of them) and the output accumulator O (head_dim_v
columns). All four must fit: 2 * tile_n + 2 * head_dim_v <= 512. That is what limits the head dims
this kernel takes (D=128 at tile_n=128 uses every column; D=192 needs tile_n=64; D=256 does not fit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TMEM_COLUMNS = 512
Q_TILE_ROWS = 128  # one UMMA M=128 tile per softmax warpgroup: TMEM lane i holds row i
Q_TILES_PER_CTA = 2  # ping-pong: two query tiles per CTA share every K/V tile


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
    rescale_threshold: Optional[float] = 8.0  # FA4 conditional rescale (log2 units); None: always
    exp2_emulate_every: int = 0  # every k-th exponential on the FMA pipe; 0: all hardware ex2

    @property
    def cta_tile_m(self) -> int:
        return Q_TILE_ROWS * Q_TILES_PER_CTA

    def tmem_columns(self) -> dict:
        """Column offsets of S0, S1, O0, O1 (P_t lives in the first tile_n/2 columns of S_t)."""
        o0 = 2 * self.tile_n
        return {"s": (0, self.tile_n), "o": (o0, o0 + self.head_dim_v), "used": o0 + 2 * self.head_dim_v}

    def smem_bytes(self) -> int:
        """Q (two tiles) plus the K/V ring, in bytes (2-byte elements), without barriers."""
        q = Q_TILES_PER_CTA * Q_TILE_ROWS * self.head_dim * 2
        kv = self.kv_stages * self.tile_n * max(self.head_dim, self.head_dim_v) * 2
        return q + kv


SMEM_LIMIT = 227 * 1024 - 2048  # opt-in maximum per CTA, less room for mbarriers and scratch
