"""The sm100 backward's tiles and memory budgets (plain Python: no CuTe DSL import).

The variant key is the sm90 backward's `BwdConfig` (kernels/sm90/bwd_config.py: the call's flags
that change the code), read here for this kernel: 128 keys per CTA, 128 queries per step, and the
Q / dO ring depth that shared memory allows. Tensor memory holds S^T (128 columns), dP^T (128),
dV (Dv) and dK (D) at once, dQ over S^T's columns: 256 + D + Dv <= 512, so D, Dv <= 128.

`ctas = 2` reads the same key for the CTA-pair backward (kernels/sm100/pair/bwd_kernel.py:
cta_group::2 MMAs whose M spans the keys of two CTAs). TMEM budgets per CTA (columns of 512):

- D, Dv <= 128 (`keys` = 128 per CTA, pair MMAs of M = 256): S^T (128 columns), dP^T (128), dV
  (Dv), dK (D), halves of the pair's accumulators in the 1-CTA layout (lane = key); P^T and dS^T,
  the 16-bit A operands of dV and dK, pack over S^T's and dP^T's first 64 columns; the pair's dQ
  (M = 128 queries, 64 per CTA in the half-row layout: lanes 0-63 hold D columns [0, D/2), lanes
  64-127 [D/2, D)) takes D / 2 columns over S^T's last 64. D = Dv = 128: 128 + 128 + 128 + 128 =
  512. Only D = Dv = 128 is taken (smaller head dims have no reason to pair: the 1-CTA kernel
  fits them).
- D = 192 (Dv 128 or 192): 128 keys per CTA would need 128 + 128 + 192 + Dv >= 576 columns, so
  each CTA takes 64 keys (`keys` = 64, pair MMAs of M = 128): every accumulator is in the
  half-row layout and takes half its width: S^T 64, dP^T 64, dV Dv / 2, dK D / 2, dQ D / 2 (its
  own columns: 64 + 64 + 96 + 96 + 96 = 416 at Dv = 192, 384 at Dv = 128). P^T and dS^T go to
  shared memory (the dV / dK A operands of an M = 128 pair MMA).
- D = Dv = 256 (64 keys per CTA) fits TMEM the same way: 64 + 64 + 128 + 128 + 128 = 512.

Shared memory per CTA: K, V (its keys), K^T's half (D / 2 x the pair's keys: dQ's B), per ring
stage Q and dO twice (as S^T's / dP^T's B: 64 queries x D; as dK's / dV's B: D / 2 x 128
queries), dS (64 queries x the pair's keys: dQ's A) and with 64 keys per CTA the P^T and dS^T
tiles: 192 KB at D = 128, 216 KB at D = Dv = 192, one stage each; at D = Dv = 256 that would be
272 KB, so dS, P^T and dS^T (48 KB) live over the step's query-split Q and dO halves (64 KB,
dead once S^T and dP^T are computed: pair_aliases): 224 KB.
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
# the CTA pair's (with mods): its MMA warp addresses seven operand tiles (the 1-CTA kernel's five
# and the K^T / Q^T halves): at 96 the D = 192 ALiBi + document mask variant spilled 36 descriptor
# values in the MMA loop (pair/bwd_kernel.py)
PAIR_REGISTERS = (240, 152, 112)
# D = Dv = 256 (with or without mods): the MMA warp holds 56 UMMAs' descriptors; at an even 168
# it spilled three 64-bit values (reloaded twice per step). The compute warps' 32-query chunks
# and the dQ warps' 128-column half rows fit under these
PAIR_REGISTERS_D256 = (152, 176, 184)


def pair_registers(d: int, mods: bool):
    """setmaxnreg counts (compute, dQ, other warps) of the CTA-pair backward, None: an even split."""
    if d == 256:
        return PAIR_REGISTERS_D256
    return PAIR_REGISTERS if mods else None


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


PAIR_TILE_N = 2 * TILE_N  # keys per CTA pair at D <= 128 (M of the cta_group::2 MMAs)
PAIR_HEAD_DIMS = ((128, 128), (192, 128), (192, 192), (256, 256))  # (D, Dv) the pair takes (docstring)


def pair_keys(d: int, dv: int) -> int:
    """Keys per CTA of the pair: 128 where the 1-CTA layout's accumulators fit, else 64."""
    return TILE_N if max(d, dv) <= 128 else TILE_N // 2


def pair_smem_bytes(d: int, dv: int, stages: int, aliased: bool = False) -> int:
    """One CTA of the pair: K, V, K^T's half, the Q / dO ring (each tile twice, in halves), dS for
    dQ and (64 keys per CTA) the P^T and dS^T tiles; aliased: those three over the one stage's
    query-split Q and dO halves (pair_aliases)."""
    keys = pair_keys(d, dv)
    p_ds = 2 * keys * TILE_M if keys < TILE_N else 0
    step = keys * TILE_M + p_ds  # dS, P^T, dS^T
    if aliased:
        assert stages == 1 and step <= _HALF_M * (d + dv), (d, dv)
        step = 0
    return 2 * (keys * (d + dv) + keys * d + stages * TILE_M * (d + dv) + step)


_HALF_M = TILE_M // 2


def pair_aliases(d: int, dv: int) -> bool:
    """Whether dS, P^T and dS^T share shared memory with the step's Q and dO halves that S^T and
    dP^T read (D = Dv = 256: 272 KB otherwise). Safe with one ring stage: those MMAs completed
    before the compute warps write (the S^T / dP^T commit), and the slot's next load waits for the
    step's last MMA (the ring release)."""
    return pair_smem_bytes(d, dv, 1) > SMEM_LIMIT


def pair_ring_stages(d: int, dv: int) -> int:
    if pair_aliases(d, dv):
        if pair_smem_bytes(d, dv, 1, aliased=True) <= SMEM_LIMIT:
            return 1
        raise ValueError(f"head dims {d}, {dv} do not fit shared memory")
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

    @property
    def keys(self) -> int:
        """Keys per CTA (the pair: bwd_config.pair_keys)."""
        return pair_keys(self.head_dim, self.head_dim_v) if self.ctas == 2 else TILE_N

    def columns(self) -> dict:
        """First TMEM column of S^T (and P^T's 16-bit pairs; 1 CTA: dQ), dP^T (pair: and dS^T's
        16-bit pairs), dV, dK and the pair's dQ (over S^T's second half with 128 keys per CTA)."""
        if self.ctas == 2 and self.keys < TILE_N:  # the half-row layout: half the widths
            s, dp, dv = 0, TILE_M // 2, TILE_M
            return {"s": s, "dp": dp, "dv": dv, "dk": dv + self.head_dim_v // 2,
                    "dq": dv + self.head_dim_v // 2 + self.head_dim // 2}
        cols = {"s": 0, "dp": TILE_M, "dv": 2 * TILE_M, "dk": 2 * TILE_M + self.head_dim_v}
        cols["dq"] = TILE_M // 2 if self.ctas == 2 else 0
        return cols

    @property
    def tmem_columns(self) -> int:
        if self.ctas == 2 and self.keys < TILE_N:
            return self.columns()["dq"] + self.head_dim // 2
        return 2 * TILE_M + self.head_dim + self.head_dim_v
