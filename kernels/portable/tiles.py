"""Tile shapes of the portable forward per architecture (shared-memory budget) and head dim.

A CTA holds Q (tile_m x D), one K and one V tile (tile_n x D each), 2-byte elements: (tile_m +
2 tile_n) D 2 bytes. Each warp owns 16 rows per MMA row block; its accumulators are O (rows x D)
and S (rows x tile_n) in fp32 registers, so a warp's rows times (D + tile_n) bounds the register
file (255 per thread): 32 rows per warp while S + O stay within 128 fp32 columns (D <= 96 with
64-key tiles), 16 rows per warp above. (32 rows of S 32 x 128 + O 32 x 64 at D=64, or of O 32 x 128
+ S 32 x 64 at D=128, spilled the row statistics to local memory: CPU compile tests check SASS.)
The exception, measured: D=128 on the large-memory parts takes 32 rows per warp despite its spills.

Budgets: the largest dynamic shared memory one CTA may take (the opt-in maximum). sm_90 runs the
sm_80 row (its own budget, 227 KB, is larger; the row is what the kernel is tested with there).
"""

from __future__ import annotations

from typing import NamedTuple


class TileRow(NamedTuple):
    tile_m: int
    tile_n: int
    num_warps: int
    # Q's fragments kept in registers across the key loop (PortableFwdConfig.q_in_regs) where that
    # compiles without spills: D=96 (32 rows per warp) and D=256 spilled with it
    q_in_regs: bool

SMEM_BUDGET = {
    "sm_80": 163 * 1024,  # A100: 164 KB per SM, 163 KB per CTA
    "sm_86": 99 * 1024,  # A10, RTX 3090: 100 KB per SM, 99 KB per CTA
    "sm_89": 99 * 1024,  # L4, L40, RTX 4090: as sm_86
    "sm_120a": 99 * 1024,  # RTX 5090-class: as sm_86
}

# the tile row per head dim, with the reason for each
_LARGE_SMEM = {  # sm_80 (and sm_90, sm_100)
    64: TileRow(128, 64, 4, True),  # 32 KB; 32 rows per warp, S + O 32 x 128 in registers
    96: TileRow(128, 64, 4, False),  # 48 KB; S + O 32 x 160 per warp
    # 64 KB; 32 rows per warp, Q read from shared memory: it spills 12-18 registers in the key loop,
    # yet on the H200 ran 1.20-1.23x the 8-warp row of 16 rows (each warp reads all of K and V by
    # ldmatrix, so 4 warps read half the bytes per flop, and two CTAs fit an SM)
    128: TileRow(128, 64, 4, False),
    192: TileRow(128, 64, 8, True),  # 96 KB; 16 rows per warp (O 16 x 192)
    256: TileRow(128, 64, 8, False),  # 128 KB; 16 rows per warp (O 16 x 256)
}
_SMALL_SMEM = {  # sm_86, sm_89, sm_120a: 99 KB
    64: TileRow(128, 64, 4, True),  # 32 KB
    96: TileRow(128, 64, 4, False),  # 48 KB
    128: TileRow(128, 64, 8, True),  # 64 KB
    192: TileRow(128, 64, 8, True),  # 96 KB: just fits
    256: TileRow(64, 64, 4, False),  # 96 KB: 128 query rows (128 KB) do not fit; 16 rows per warp
}

TABLES = {"sm_80": _LARGE_SMEM, "sm_86": _SMALL_SMEM, "sm_89": _SMALL_SMEM, "sm_120a": _SMALL_SMEM}
HEAD_DIMS = tuple(_LARGE_SMEM)


def arch_of(capability: tuple[int, int]) -> str:
    """The compile target for a CUDA compute capability: sm_80 code runs on every later part, but
    8.6 / 8.9 / 12.x get their own targets (their own tile rows); 9.x and 10.x run the sm_80 row,
    compiled for their own architecture."""
    major, minor = capability
    if major == 8:
        return {6: "sm_86", 7: "sm_86", 9: "sm_89"}.get(minor, "sm_80")
    if major in (9, 10, 11, 12):  # (the "a" targets: CuTe DSL compiles for those)
        return f"sm_{major}{minor}a"
    return "sm_80"


def table_of(arch: str) -> dict:
    if arch.startswith("sm_12"):  # consumer Blackwell: every 12.x part has 99 KB per CTA
        return _SMALL_SMEM
    return TABLES.get(arch, _LARGE_SMEM)


def tile_row(arch: str, head_dim: int) -> TileRow:
    return table_of(arch)[head_dim]


def tile_shape(arch: str, head_dim: int) -> tuple[int, int, int]:
    """(tile_m, tile_n, num_warps) for head dim `head_dim` on `arch`."""
    return tuple(tile_row(arch, head_dim)[:3])


def smem_budget(arch: str) -> int:
    if arch.startswith("sm_12"):
        return SMEM_BUDGET["sm_120a"]
    return SMEM_BUDGET.get(arch, SMEM_BUDGET["sm_80"])
