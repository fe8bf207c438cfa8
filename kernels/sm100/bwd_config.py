"""The sm100 backward's tiles and memory budgets (plain Python: no CuTe DSL import).

The variant key is the sm90 backward's `BwdConfig` (kernels/sm90/bwd_config.py: the call's flags
that change the code), read here for this kernel: 128 keys per CTA, 128 queries per step, and the
Q / dO ring depth that shared memory allows. Tensor memory holds S^T (128 columns), dP^T (128),
dV (Dv) and dK (D) at once, dQ over S^T's columns: 256 + D + Dv <= 512, so D, Dv <= 128.
"""

from __future__ import annotations

from dataclasses import dataclass

TILE_N = 128  # keys per CTA (TMEM lanes of S^T, dP^T, dV, dK)
TILE_M = 128  # queries per step (TMEM lanes of dQ)
MAX_STAGES = 2
SMEM_LIMIT = 227 * 1024 - 2048  # per CTA, less room for barriers and the LSE / dPsum buffers

DQ_WARP0 = 4
MMA_WARP = 8
LOAD_WARP = 9
NUM_THREADS = 384  # warps 10-11 idle: three whole warpgroups
# registers per thread after setmaxnreg for the compute, dQ and other (MMA, load, idle) warpgroups:
# at most 3 * 168 (384 threads share 64K). The compute warps hold a 32-query chunk of S^T and dP^T
# beside the mods' per-query / per-key values; the dQ warps a whole dQ row (D fp32)
REGISTERS = (240, 160, 96)


def smem_bytes(d: int, dv: int, stages: int) -> int:
    """K, V, the Q / dO ring and the dS^T tile (16-bit elements)."""
    return 2 * (TILE_N * (d + dv) + stages * TILE_M * (d + dv) + TILE_N * TILE_M)


def ring_stages(d: int, dv: int) -> int:
    """Q / dO ring depth: two stages where they fit (every D <= 128: 224 KB of tiles at D = 128,
    226 KB with the statistics and barriers), else one."""
    for stages in range(MAX_STAGES, 0, -1):
        if smem_bytes(d, dv, stages) <= SMEM_LIMIT:
            return stages
    raise ValueError(f"head dims {d}, {dv} do not fit shared memory")


@dataclass(frozen=True)
class Sm100BwdLayout:
    head_dim: int
    head_dim_v: int
    stages: int

    @classmethod
    def of(cls, config) -> "Sm100BwdLayout":
        return cls(config.head_dim, config.head_dim_v, ring_stages(config.head_dim, config.head_dim_v))

    def columns(self) -> dict:
        """First TMEM column of S^T (and dQ, and P^T's 16-bit pairs), dP^T, dV and dK."""
        return {"s": 0, "dp": TILE_M, "dv": 2 * TILE_M, "dk": 2 * TILE_M + self.head_dim_v}

    @property
    def tmem_columns(self) -> int:
        return 2 * TILE_M + self.head_dim + self.head_dim_v
