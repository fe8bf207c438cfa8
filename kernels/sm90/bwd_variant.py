"""Which compiled sm90 backward variant runs a call (`variant_key`: a BwdConfig) and how it is
launched (`launch_plan`: the split tail, the CTA order, the persistent grid). Shapes, strides,
scale, softcap value, window sizes, captured tensors, block-mask lists and the split plan are
runtime arguments: new sizes or values never recompile.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, NamedTuple

from torch_fa4.kernels.host import fwd_launch, shape_memo
from torch_fa4.kernels.sm90.bwd_config import SMEM_LIMIT, TILE_M, BwdConfig, smem_bytes

if TYPE_CHECKING:
    from torch_fa4.call import AttentionCall

# Queries per kernel step at D = Dv = 64 on 128-key CTAs (NOTES Experiments 18, 41, 54). Block
# masks whose query tile is not a multiple of 128 keep 64.
D64_TILE_M = 128
# The persistent kernel writes dq itself up to this many queries; past it the conversion pass is
# faster (NOTES Experiments 127, 158, 159).
FUSED_DQ_MAX_SEQLEN_Q = 4096
# The split tail (common/split_tail.py): the 128-query variant only (at D128 the split code alone
# cost as much as the split gained, NOTES Experiment 141). A piece's fixed cost (K / V load,
# pipeline fill, merge) counts as SPLIT_PIECE_COST_STEPS steps.
SPLIT_PIECE_COST_STEPS = 4.0
SPLIT_MIN_STEPS = 4
SPLIT_MAX_WAYS = 8
# The last T (kv head, batch) pairs start as one group under a mask (bwd_kernel._cta_coords): T
# pairs' query-side bytes fit a 16 MB share of L2, at most 16 (NOTES Experiment 53).
CTA_TAIL_L2_BYTES = 16 << 20
CTA_TAIL_MAX = 16


@dataclasses.dataclass(frozen=True)
class BwdTuning:
    """Non-default launch choices for tests: `persistent_ctas` caps the persistent grid;
    `varlen_kernel=False` runs packed varlen batches as one dense launch per sequence."""

    persistent_ctas: int | None = None
    varlen_kernel: bool = True


DEFAULT_TUNING = BwdTuning()


def window(call: "AttentionCall") -> tuple[int | None, int | None]:
    """Effective (right, left) key limits relative to the diagonal; None = unbounded."""
    right = call.window_right if call.window_right >= 0 else None
    if call.causal:
        right = 0 if right is None else min(right, 0)
    left = call.window_left if call.window_left >= 0 else None
    return right, left


def query_tile(d: int, dv: int, tile_n: int) -> int:
    """Queries per kernel step for head dims d, dv with `tile_n` keys per CTA."""
    return D64_TILE_M if tile_n == 128 and max(d, dv) <= 64 else TILE_M


def key_tile(d: int, dv: int) -> int:
    """Keys per CTA: dK and dV of a key tile live in fp32 registers for the whole walk; 128 keys
    fit up to D=128 (two warpgroups of 64 keys), beyond that the narrow variant shares 64."""
    return 128 if max(d, dv) <= 128 else 64


def _long_queries(call: "AttentionCall") -> bool:
    return not call.is_varlen and call.q.shape[1] > FUSED_DQ_MAX_SEQLEN_Q


def _first_rows_reach(call: "AttentionCall"):
    """What _fused_dq_applies reads of the call's shape (variant_key's memo): how far (down to
    -129, enough for every tile_m) the first row's right limit lies left of key 0 (None: no right
    limit), or False when there are no keys."""
    if call.k.shape[1] == 0:
        return False
    right, _ = window(call)
    if right is None:
        return None
    return max(-129, min(0, call.k.shape[1] - call.q.shape[1] + right))


def _fused_dq_applies(call: "AttentionCall", tile_n: int, stages: int, tile_m: int) -> bool:
    """Whether the persistent variant writes dq itself: the 128-query variant up to
    FUSED_DQ_MAX_SEQLEN_Q queries, where its staging tile fits shared memory and every query tile
    is walked by some key tile (or nobody writes its rows): no seqused_k, and under a right limit
    the first tile's last row reaches key 0."""
    if _long_queries(call) or tile_m != 128 or call.seqused_k is not None:
        return False
    if smem_bytes(call.head_dim, call.head_dim_v, tile_n, stages, False, tile_m, fused_dq=True) > SMEM_LIMIT:
        return False
    reach = _first_rows_reach(call)
    return reach is not False and (reach is None or tile_m - 1 + reach >= 0)


def _split_tail_applies(call: "AttentionCall", tile_m: int) -> bool:
    """Whether a persistent call may run the variant with the split tail's code (launch_plan
    drops it where nothing splits): the 128-query variant, every work tile walking the same
    query tiles."""
    limits = call.causal or call.window_left >= 0 or call.window_right >= 0 or call.softcap > 0
    return tile_m == 128 and not (limits or call.mods is not None or call.seqused_k is not None
                                  or call.block_mask)


_variant_memo: dict = {}


def variant_key(call: "AttentionCall", deterministic: bool) -> BwdConfig:
    """The compiled variant that runs `call`. Memoized on what it reads, except for calls with a
    block mask (its tile ratios and walk depend on the mask tensors' shapes)."""
    if call.block_mask:
        return _variant_key(call, deterministic)
    memo = (call.q.dtype, call.head_dim, call.head_dim_v, call.num_heads // call.num_heads_kv,
            call.causal or call.window_right >= 0, call.window_left >= 0, call.softcap > 0,
            call.is_varlen, call.seqused_k is not None, bool(deterministic),
            call.mods.key if call.mods is not None else "",
            _first_rows_reach(call), _long_queries(call),
            None if call.is_varlen else call.k.shape[1] % 128)  # the key tail
    key = _variant_memo.get(memo)
    if key is None:
        key = _variant_memo[memo] = _variant_key(call, deterministic)
    return key


def _variant_key(call: "AttentionCall", deterministic: bool) -> BwdConfig:
    from .bwd_sparse import ratios, sparse_walk_reason

    right, left = window(call)
    d, dv = call.head_dim, call.head_dim_v
    tile_n = key_tile(d, dv)
    tile_m = query_tile(d, dv, tile_n)
    # the block-mask tile relative to the kernel's enters the variant; the lists are arguments
    sparse = None
    if sparse_walk_reason(call, deterministic, tile_n, tile_m) is None:
        sparse = ratios(call, tile_n, tile_m)
    elif tile_m != TILE_M and sparse_walk_reason(call, deterministic, tile_n, TILE_M) is None:
        # a block mask whose query tile is not a multiple of 128: 64 queries per step walk it
        tile_m = TILE_M
        sparse = ratios(call, tile_n, tile_m)
    elif tile_n == 128 and sparse_walk_reason(call, deterministic, 64) is None:
        # a block mask of 64-key columns: the 64-key (narrow) variant walks it
        tile_n, tile_m = 64, TILE_M
        sparse = ratios(call, 64)
    config = BwdConfig(
        dtype=call.q.dtype, head_dim=d, head_dim_v=dv, group=call.num_heads // call.num_heads_kv,
        has_right=right is not None, has_left=left is not None, softcap=call.softcap > 0,
        varlen=call.is_varlen, seqused_k=call.seqused_k is not None, deterministic=bool(deterministic),
        mods_key=call.mods.key if call.mods is not None else "", sparse=sparse,
        tile_n=tile_n, tile_m=tile_m, persistent=False, fused_dq=False, split_tail=False,
        # dense keys ending inside a key tile (varlen and seqused_k calls mask their keys anyway)
        mask_key_tail=not call.is_varlen and call.seqused_k is None and call.k.shape[1] % tile_n != 0,
    )
    # persistent on the dense 128-key variants with the dQ writer warp (NOTES Experiment 56)
    if config.separate_dq_slabs and not deterministic and not call.is_varlen and sparse is None:
        config = dataclasses.replace(
            config, persistent=True, fused_dq=_fused_dq_applies(call, tile_n, config.stages, tile_m),
            split_tail=_split_tail_applies(call, tile_m))
    return config


def runs_per_sequence(call: "AttentionCall", deterministic: bool, tuning: BwdTuning = DEFAULT_TUNING) -> bool:
    """Whether a call with cu_seqlens runs one dense launch per sequence: with only one side
    packed (or tuning.varlen_kernel off)."""
    if not (call.is_varlen or call.cu_seqlens_k is not None):
        return False
    packed = call.is_varlen and call.cu_seqlens_k is not None
    return not (packed and tuning.varlen_kernel)


def split_plan(tiles: int, ctas: int, steps: int) -> tuple[int, int]:
    """(split tiles, ways) for `tiles` work tiles of `steps` steps each on `ctas` persistent CTAs
    (host.split_plan.choose)."""
    from torch_fa4.kernels.host import split_plan as plan

    return plan.choose(tiles, ctas, steps, min_tiles=SPLIT_MIN_STEPS, max_ways=SPLIT_MAX_WAYS,
                       piece_cost_tiles=SPLIT_PIECE_COST_STEPS)


def cta_tail(call: "AttentionCall", pairs: int) -> int:
    """The last T (kv head, batch) pairs that start as one group: under a mask the plain order
    leaves the last pairs' longest CTAs for the end; without one every CTA walks as far (T = 1)."""
    if not (call.causal or call.window_right >= 0 or call.window_left >= 0):
        return 1
    group = call.num_heads // call.num_heads_kv
    pair_bytes = call.q.shape[1] * group * (call.head_dim * (2 + 4) + call.head_dim_v * 2)
    return max(1, min(CTA_TAIL_L2_BYTES // max(pair_bytes, 1), CTA_TAIL_MAX, pairs))


def persistent_ctas(tiles: int, device, cap: int | None = None) -> int:
    """The persistent kernel's grid: one CTA per multiprocessor of `device`, at most one per work
    tile, at most `cap` (off CUDA, the host tests' emulated kernel: one per tile)."""
    n = fwd_launch.sm_count(device) if device.type == "cuda" else tiles
    return max(1, min(tiles, n, cap or n))


class LaunchPlan(NamedTuple):
    """What a launch of a variant takes besides its tensors."""

    key: BwdConfig  # the variant to run (variant_key's, without the split tail where nothing splits)
    split_items: int  # split tail: the tiles that run as pieces, and how many pieces each
    ways: int
    cta_tail: int
    ctas: int  # the persistent grid (1 otherwise)
    max_q: int  # the longest sequences (varlen: given, or read from cu_seqlens)
    max_k: int


_plan_memo = shape_memo.table()  # (one entry per shape and variant)


def launch_plan(call: "AttentionCall", key: BwdConfig, tuning: BwdTuning = DEFAULT_TUNING) -> LaunchPlan:
    """The LaunchPlan of `call` on variant `key`, memoized for dense calls without a block mask
    (varlen maxima and block-mask walks depend on tensor contents)."""
    if call.is_varlen or call.block_mask:
        return _launch_plan(call, key, tuning)
    memo = (key, call.q.shape, call.k.shape, call.q.device, tuning)
    return shape_memo.lookup(_plan_memo, memo, lambda: _launch_plan(call, key, tuning))


def _launch_plan(call: "AttentionCall", key: BwdConfig, tuning: BwdTuning) -> LaunchPlan:
    max_q, max_k = fwd_launch.max_seqlens(call)
    pairs = call.k.shape[-2] * call.batch  # (kv head, batch) pairs: the CTA order's unit
    n_tiles = math.ceil(max_k / key.tile_n) * pairs
    ctas = persistent_ctas(n_tiles, call.q.device, tuning.persistent_ctas) if key.persistent else 1
    split_items, ways = 0, 1
    if key.split_tail:
        steps = math.ceil(call.q.shape[1] / key.tile_m) * (call.num_heads // call.num_heads_kv)
        split_items, ways = split_plan(n_tiles, ctas, steps)
        if not split_items:  # no split: the variant without its code
            key = dataclasses.replace(key, split_tail=False)
    return LaunchPlan(key, split_items, ways, cta_tail(call, pairs), ctas, max_q, max_k)
