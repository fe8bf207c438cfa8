"""The sm90 forward's variant description: everything that changes its generated code, the
compile-cache key (no CuTe DSL import: a kernel from the disk cache loads without the DSL).
"""

from dataclasses import dataclass
from typing import Optional

MAX_AUX = 8  # captured tensors per call (kernels.common.mod_lowering.MAX_AUX)


@dataclass(frozen=True)
class FwdConfig:
    dtype_name: str  # "bfloat16" | "float16"
    head_dim: int
    head_dim_v: int
    tile_m: int
    tile_n: int
    causal: bool
    has_window: bool
    softcap: bool
    varlen_q: bool
    varlen_k: bool
    has_seqused_k: bool
    num_stages: int = 2  # depth of the K and V rings
    persistent: bool = False  # about one CTA per SM looping over work items (else one CTA per item)
    dynamic_schedule: bool = False  # persistent CTAs take items from a counter (common/tile_mailbox.py)
    rescale_threshold: Optional[float] = None  # conditional rescale (log2 units); None: always
    max_chains: int = 1  # the row max as independent FMNMX chains (same result, another schedule)
    # O is rescaled by the previous tile's factors just before P_{t-1} V_{t-1} is issued, instead
    # of after it lands (off the path from the P V wait to the next issue); always-rescale only
    early_o_rescale: bool = False
    # the K slot of a key tile is released after that tile's softmax, under a predicate computed
    # from the row sums (always true), instead of right after S lands: ptxas keeps the P V wait
    # below that release, so the softmax stays under P V (fwd_consumer._release_after_softmax)
    pin_pv_wait: bool = False
    # Q's buffer is released as soon as the walk's last S = Q K^T lands, not after the item's
    # last P V, so the next item's Q loads under this one's tail (only where O has its own tile)
    early_q_release: bool = False
    # under causal / window masks, a consumer warpgroup whose 64 rows see no key of the walk's
    # first (rightmost) tile skips that tile's Q K^T and softmax, its P set to zero
    skip_masked_first: bool = False
    # separate key loops for the masked tiles at either end of the walk and the unmasked ones
    # between them; one loop with a run-time mask branch otherwise
    split_mask_loops: bool = True
    ptxas_options: str = ""  # extra ptxas flags (they change the schedule, never the results)
    # CTA pairs (a 2-CTA cluster) on adjacent query tiles of one head: each CTA loads half of every
    # K and V tile and the TMA multicasts it into both. The pair walks the same key tiles in step
    kv_multicast: bool = False
    split_ways: int = 0  # the grid's last items split along the keys (common/split_tail.py; 0: none)
    # a (query tile, head, batch) grid whose indices are the work item, instead of a flat grid
    # decoded by the tile scheduler (integer divisions before the first load)
    grid3d: bool = False
    # the key loop's matmuls issued from descriptors built once per CTA (common/wgmma_desc.py),
    # instead of cute.gemm's per-matmul lowering; 128-byte rows only (head dim 64)
    hand_descriptors: bool = False
    mod_key: str = ""  # a ModSet in torch_fa4.mods.registry, whose graphs are inlined; "": none
    aux_specs: tuple = ()  # (torch dtype name, ndim) of each captured tensor, in ModSet order
    block_sparse: bool = False  # key tiles from a block mask (needs a mask_mod)
    bm_tiles_m: int = 1  # kernel tiles per block-mask tile along queries / keys
    bm_tiles_n: int = 1
    # paged K / V caches (kernels/host/paged_kv.py): rows per TMA box of a K / V tile, each box
    # from the page the page table names; the page size where it divides tile_n, else tile_n
    # (pages of whole tiles). 0: contiguous K / V
    page_box: int = 0

    @property
    def num_consumer_wg(self) -> int:
        return self.tile_m // 64
