"""The portable forward's variant description: everything that changes its generated code, the
compile-cache key (plain Python: no CuTe DSL import, so a cached kernel loads without the DSL).
"""

from dataclasses import dataclass
from typing import Optional

MAX_AUX = 8  # captured tensors per call (kernels.common.mod_lowering.MAX_AUX)


@dataclass(frozen=True)
class PortableFwdConfig:
    dtype_name: str  # "bfloat16" | "float16"
    head_dim: int
    head_dim_v: int
    tile_m: int  # query rows per CTA: 16 per warp and MMA row block
    tile_n: int  # keys per tile
    num_warps: int  # warps along the query rows (each owns tile_m / num_warps rows)
    causal: bool
    has_window: bool
    softcap: bool
    varlen_q: bool
    varlen_k: bool
    has_seqused_k: bool
    # Q's MMA fragments loaded from shared memory once per work item and kept in registers, instead
    # of one k-slice at a time on every key tile (fewer ldmatrix, more registers)
    q_in_regs: bool = False
    # CTAs per SM the register allocation must leave room for (a launch bound: ptxas then uses at
    # most 64K / (threads x this) registers per thread); 1: up to 255 per thread
    min_blocks_per_sm: int = 1
    # conditional O rescale (log2 units, kernels/common/online_softmax.py); None: every tile
    rescale_threshold: Optional[float] = 8.0
    mod_key: str = ""  # a ModSet in torch_fa4.mods.registry, whose graphs are inlined; "": none
    aux_specs: tuple = ()  # (torch dtype name, ndim) of each captured tensor, in ModSet order
    block_sparse: bool = False  # key tiles from a block mask (needs a mask_mod)
    bm_tiles_m: int = 1  # kernel tiles per block-mask tile along queries / keys
    bm_tiles_n: int = 1

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    def smem_bytes(self) -> int:
        """Q, one K and one V tile (2-byte elements); O is staged over Q's buffer."""
        return (self.tile_m * self.head_dim + self.tile_n * (self.head_dim + self.head_dim_v)) * 2
