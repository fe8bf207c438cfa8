"""The sm100 backward's tiles and memory budgets (plain Python: no CuTe DSL import).

The variant key is the sm90 backward's `BwdConfig` (kernels/sm90/bwd_config.py: the call's flags
that change the code), read here for this kernel: 128 keys per CTA, 128 queries per step, and the
Q / dO ring depth that shared memory allows. Tensor memory holds S^T (128 columns), dP^T (128),
dV (Dv) and dK (D) at once, dQ over S^T's columns: 256 + D + Dv <= 512, so D, Dv <= 128.

`ctas = 2` reads the same key for the CTA-pair backward (kernels/sm100/pair/bwd_kernel.py:
cta_group::2 MMAs with M = 256 keys over two CTAs of 128 keys each). Per CTA its tensor memory
holds the same four accumulators, now halves of M = 256 MMAs: S^T (128 columns), dP^T (128), dV
(Dv), dK (D); P^T and dS^T (16-bit, the A operands of dV and dK) pack over S^T's and dP^T's first
64 columns; the pair's dQ (M = 128 queries, 64 per CTA, the M = 64 half-row layout: lanes 0-63
hold D columns [0, D/2), lanes 64-127 [D/2, D)) takes D / 2 columns over S^T's last 64. Budgets
(columns of 512): D = Dv = 128: 128 + 128 + 128 + 128 = 512 (dQ's 64 inside S^T's): fits.
D = 192 (Dv = 128 or 192) needs 128 + 128 + 192 + Dv >= 576 and D = Dv = 256 needs 768: neither
fits with 128 keys per CTA (they need 64-key halves, M = 128 pair MMAs whose accumulators take
half the columns, and a serial schedule for shared memory): the pair backward takes D = Dv = 128.
Shared memory per CTA: K, V (its 128 keys), K^T's half (D / 2 x the pair's 256 keys: dQ's B),
per ring stage Q and dO twice (as S^T's / dP^T's B: 64 queries x D; as dK's / dV's B: D / 2 x 128
queries) and dS (64 queries x 256 keys: dQ's A): 192 KB at D = 128 with one stage (two: 256 KB).
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


PAIR_TILE_N = 2 * TILE_N  # keys per CTA pair (M of the cta_group::2 MMAs)
PAIR_HEAD_DIMS = ((128, 128),)  # (D, Dv) whose accumulators fit 512 columns (docstring)


def pair_smem_bytes(d: int, dv: int, stages: int) -> int:
    """One CTA of the pair: K, V, K^T's half, the Q / dO ring (each tile twice, in halves) and dS."""
    return 2 * (TILE_N * (d + dv) + TILE_N * d + stages * TILE_M * (d + dv) + TILE_N * TILE_M)


def pair_ring_stages(d: int, dv: int) -> int:
    for stages in range(MAX_STAGES, 0, -1):
        if pair_smem_bytes(d, dv, stages) <= SMEM_LIMIT:
            return stages
    raise ValueError(f"head dims {d}, {dv} do not fit shared memory")


@dataclass(frozen=True)
class Sm100BwdLayout:
    head_dim: int
    head_dim_v: int
    stages: int
    ctas: int = 1  # 2: the CTA-pair backward (module docstring)

    @classmethod
    def of(cls, config, ctas: int = 1) -> "Sm100BwdLayout":
        d, dv = config.head_dim, config.head_dim_v
        if ctas == 2:
            if (d, dv) not in PAIR_HEAD_DIMS:
                raise ValueError(f"head dims {d}, {dv}: the CTA-pair backward takes {PAIR_HEAD_DIMS}")
            return cls(d, dv, pair_ring_stages(d, dv), 2)
        return cls(d, dv, ring_stages(d, dv))

    def columns(self) -> dict:
        """First TMEM column of S^T (and P^T's 16-bit pairs; 1 CTA: dQ), dP^T (pair: and dS^T's
        16-bit pairs), dV and dK; the pair's dQ over S^T's second half."""
        cols = {"s": 0, "dp": TILE_M, "dv": 2 * TILE_M, "dk": 2 * TILE_M + self.head_dim_v}
        cols["dq"] = TILE_M // 2 if self.ctas == 2 else 0
        return cols

    @property
    def tmem_columns(self) -> int:
        return 2 * TILE_M + self.head_dim + self.head_dim_v
