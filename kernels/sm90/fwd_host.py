"""Host side of the sm90 forward: pick a kernel variant for a call, compile it once, launch it.

Mods: the ModSet's key and the captured tensors' dtypes and ranks are part of the variant (they
change the inlined code); the captured tensors and a block mask are launch arguments (only the
block mask's tile size relative to the kernel's enters the variant).

Paged KV caches: the variant's key tile loads page by page (`FwdConfig.page_box`,
kernels/host/paged_kv.py) where the page size allows it; D192 / D256 calls whose page size does
not fit their key tile take 64-key tiles; any other page size runs on a gathered contiguous copy
(`forward`). The page table is a launch argument.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch

from torch_fa4.call import AttentionCall
from torch_fa4.kernels import compile_cache
from torch_fa4.kernels.host import fwd_launch, paged_kv
from torch_fa4.kernels.host import split_plan as split_plan_mod, split_scratch
from torch_fa4.kernels.host.block_mask_layout import block_mask_tensors_reason
from torch_fa4.kernels.sm90 import fwd_launch_record
from torch_fa4.kernels.sm90.fwd_config import MAX_AUX, FwdConfig

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
MOD_MAX_POSITION = fwd_launch.MOD_MAX_POSITION
L2_BYTES = 50 * 1024 * 1024

# (tile_m, tile_n) per head dim: 64 query rows per consumer warpgroup; key tiles sized so two
# stages of K and V plus Q fit in 227 KB of shared memory. Long dense D64 / D96 calls take 192-row
# tiles instead (`_tiles`).
_TILES = {64: (128, 128), 96: (128, 128), 128: (128, 128), 192: (128, 112), 256: (128, 80)}

# the softmax options and the grid per head dim. Static persistent grids stop at D=128 but for
# plain D=192 calls (`_tiles`): above that the outer loop made ptxas serialize the wgmmas, and at
# D=256 it measured no gain (NOTES "Experiment 20"); windowed and causal calls take the dynamic
# schedule. early_o_rescale: "Experiment 19"; D64 rescales O after the P V wait instead
# ("Experiment 118") and compiles at ptxas's register-usage level 10 ("Experiment 134").
_DEFAULT_OPTIONS = {
    64: dict(persistent=True, early_o_rescale=False, ptxas_options="--register-usage-level=10"),
    96: dict(persistent=True, early_o_rescale=True),  # (long plain calls: `_early_rescale_pays`)
    128: dict(persistent=True, early_o_rescale=True),
    192: dict(persistent=False),
    # pin_pv_wait: NOTES "Experiment 57" (D64 and D128 lose with it)
    256: dict(rescale_threshold=8.0, persistent=False, pin_pv_wait=True),
}


def unsupported_reason(call: AttentionCall) -> Optional[str]:
    if (reason := fwd_launch.operand_reason(call, "sm90", SUPPORTED_HEAD_DIMS)) is not None:
        return reason
    if (reason := fwd_launch.mods_reason(call, "sm90", MAX_AUX)) is not None:
        return reason
    if fwd_launch.uses_block_mask(call) and (reason := _block_mask_reason(call)) is not None:
        return reason
    if call.page_table is not None and (call.k.shape[0] == 0 or call.page_table.shape[1] == 0):
        return "a paged cache without pages"
    return fwd_launch.layout_reason(call, paged_kv=True)


def _dense(call: AttentionCall) -> bool:
    """No softcap, window or variable lengths (a causal mask and mods allowed)."""
    return call.softcap <= 0 and not call.has_window and not call.is_varlen and call.cu_seqlens_k is None



def _block_tile_n(call: AttentionCall) -> Optional[int]:
    """The kernel's key tile under a block mask: one that divides the block mask's key tile."""
    default = _TILES[call.head_dim][1]
    for tile_n in (default, 128, 64):
        # 128-key tiles fit shared memory up to D=128 (two stages of K and V plus Q)
        if tile_n <= default and call.block_mask_kv % tile_n == 0:
            return tile_n
    return None


def _block_mask_reason(call: AttentionCall) -> Optional[str]:
    if (reason := block_mask_tensors_reason(call)) is not None:
        return reason
    tile_m = _TILES[call.head_dim][0]
    if call.block_mask_q % tile_m != 0:
        return f"block_mask BLOCK_SIZE q={call.block_mask_q} is not a multiple of the kernel's {tile_m}-row tile"
    if _block_tile_n(call) is None:
        return f"block_mask BLOCK_SIZE kv={call.block_mask_kv} is not a multiple of 64"
    return fwd_launch.block_mask_coverage_reason(call)


# D=64 calls past 2048 queries without mods (a score_mod alone is fine, "Experiment 90"), softcap,
# window or varlen run 192 x 128 tiles: three consumer warpgroups at 160 registers (P converted by
# packed pairs), 1.5x the query rows per K/V load (NOTES "Experiment 17"; at S=1k the ragged last
# 192-row tile loses). A third K/V stage pays without causal masking only. Left out: softcap and
# mask_mods spill, block masks' 128-row tiles cannot be split, window and varlen are unmeasured.
_D64_WIDE = dict(tile_m=192, tile_n=128, persistent=False)
_WIDE_MIN_SEQLEN_Q = 2048
# D=96 likewise, with 112-key tiles (128 spill at 160 registers; NOTES "Experiment 138").
_D96_WIDE = dict(tile_m=192, tile_n=112, persistent=False)
# Key loops split by mask (`FwdConfig.split_mask_loops`) up to D=192 ("Experiment 136"); D=256
# past 2048 keys only, the single loop being faster at S=1k (NOTES "Experiment 20").
_D256_SPLIT_MIN_SEQLEN_K = 2048


def _tiles(call: AttentionCall, max_q: int, max_k: int) -> dict:
    """The options that go with the shape over the head dim's (wide tiles, stages, grid, split key
    loops, ...)."""
    if call.head_dim == 192:
        # plain calls persistent; causal ones lost on the static loop (dynamic schedule instead,
        # NOTES "Experiment 136")
        return dict(persistent=_plain(call))
    if call.head_dim == 256:
        return dict(split_mask_loops=max_k > _D256_SPLIT_MIN_SEQLEN_K)
    dense = _dense(call)
    no_mask_mod = call.mods is None or (call.mods.mask_graph is None and not call.block_mask)
    if call.head_dim == call.head_dim_v == 64 and dense and no_mask_mod and max_q > _WIDE_MIN_SEQLEN_Q:
        # the row max as two chains without mods (NOTES "Experiment 148")
        shape = dict(_D64_WIDE, num_stages=2 if call.causal else 3, max_chains=2 if call.mods is None else 1)
        if call.mods is None and not call.causal:
            # hand-built wgmma descriptors at ptxas's register-usage level 0 (NOTES "Experiments
            # 155, 156": levels 0-2 give one loop, 4-10 another; causal rows lost with them)
            shape.update(hand_descriptors=True, ptxas_options="--register-usage-level=0")
        return shape
    if call.head_dim == call.head_dim_v == 96 and dense and call.mods is None and max_q > _WIDE_MIN_SEQLEN_Q:
        if call.page_table is None or paged_kv.page_box(call.page_size, _D96_WIDE["tile_n"]):
            return _D96_WIDE
    return {}


def default_config(call: AttentionCall, **overrides) -> FwdConfig:
    max_q, max_k = fwd_launch.max_seqlens(call)  # (varlen without the maxima given: a device read)
    longest = max(max_q, max_k)
    # the head dim's options, then the tile shape's (its stages, chains, ptxas flags and grid win)
    tile_m, tile_n = _TILES[call.head_dim]
    opts = dict(tile_m=tile_m, tile_n=tile_n, **_DEFAULT_OPTIONS[call.head_dim])
    opts.update(_tiles(call, max_q, max_k))
    # with mods the persistent loop kept too much alive (a mask_mod's loads, a score_mod beside
    # softcap at D=128: ptxas serialized the wgmmas; the CPU compile tests count the waits)
    opts["persistent"] = opts["persistent"] and call.mods is None
    if call.mods is not None:
        opts.update(mod_key=call.mods.key, aux_specs=tuple((str(t.dtype), t.dim()) for t in call.aux_tensors))
    if fwd_launch.uses_block_mask(call):
        opts["tile_n"] = _block_tile_n(call)
        opts.update(block_sparse=True, bm_tiles_m=call.block_mask_q // opts["tile_m"],
                    bm_tiles_n=call.block_mask_kv // opts["tile_n"])
    if call.page_table is not None:
        opts.update(_paged_tiles(call, opts["tile_n"], opts.get("block_sparse", False)))
    if _dynamic_schedule_pays(call, longest):
        opts.update(persistent=True, dynamic_schedule=True)
    if _d128_cond_rescale_pays(call):
        opts["rescale_threshold"] = 8.0
    # (where O has its own shared-memory tile, D <= 128; above it O is staged over Q's buffer)
    if call.head_dim <= 128 and (longest <= _EARLY_Q_MAX_SEQLEN or _block_list_walk(call)):
        opts["early_q_release"] = True
    cfg = FwdConfig(**fwd_launch.call_features(call), **opts)
    cfg = replace(cfg, **overrides) if overrides else cfg
    if cfg.dynamic_schedule and not cfg.persistent:  # an override to one CTA per item
        cfg = replace(cfg, dynamic_schedule=False)
    if "kv_multicast" not in overrides:
        cfg = _with(cfg, kv_multicast=_kv_multicast_pays(call, cfg, max_k))
    if "early_o_rescale" not in overrides:
        cfg = _with(cfg, early_o_rescale=_early_rescale_pays(call, cfg, max_k))
    elif cfg.early_o_rescale and "rescale_threshold" not in overrides:
        cfg = replace(cfg, rescale_threshold=None)  # the early rescale goes with always rescaling
    if "skip_masked_first" not in overrides:
        cfg = _with(cfg, skip_masked_first=_skip_masked_first_pays(call))
    if "split_ways" not in overrides:
        _, ways = split_plan(cfg, call)
        cfg = _with(cfg, split_ways=ways if ways > 1 else 0)
    if "grid3d" not in overrides:
        cfg = _with(cfg, grid3d=_grid3d_fits(cfg, call))
    return cfg


# the key tile of D192 / D256 paged calls whose page size does not fit the default (112 / 80 keys):
# 64-key tiles take every page size 8..64 that divides 64 and every multiple of 64 (block-mask
# variants run it too)
_PAGED_FALLBACK_TILE_N = 64


def _paged_tiles(call: AttentionCall, tile_n: int, block_sparse: bool) -> dict:
    """tile_n and page_box of a paged call; page_box 0 where no key tile fits its page size
    (`forward` runs such calls on a gathered copy)."""
    box = paged_kv.page_box(call.page_size, tile_n)
    if not box and not block_sparse and tile_n > _PAGED_FALLBACK_TILE_N:
        fallback = paged_kv.page_box(call.page_size, _PAGED_FALLBACK_TILE_N)
        if fallback:
            return dict(tile_n=_PAGED_FALLBACK_TILE_N, page_box=fallback)
    return dict(tile_n=tile_n, page_box=box)


def _with(cfg: FwdConfig, **changes) -> FwdConfig:
    """replace(cfg, **changes), or cfg itself where nothing changes (a replace costs tens of
    microseconds, on every forward call without a launch record)."""
    if all(getattr(cfg, name) == value for name, value in changes.items()):
        return cfg
    return replace(cfg, **changes)


_GRID_YZ_MAX = 65535  # CUDA's limit on a grid's y and z sizes (heads, batch)


def _grid3d_fits(cfg: FwdConfig, call: AttentionCall) -> bool:
    """Whether a (query tile, head, batch) grid runs the work items in the scheduler's order: one
    CTA per whole item (no split, no CTA pairs) and one (batch, head) pair per group, as without a
    causal or window mask (fwd_launch.l2_group_bytes). NOTES "Experiment 154"."""
    fits_grid = call.num_heads <= _GRID_YZ_MAX and call.batch <= _GRID_YZ_MAX
    return fits_grid and not (cfg.persistent or cfg.split_ways or cfg.kv_multicast or cfg.causal
                              or cfg.has_window or cfg.varlen_q or cfg.block_sparse)


def _skip_masked_first_pays(call: AttentionCall) -> bool:
    """FwdConfig.skip_masked_first: D192 / D256 calls under causal / window masks, without mods
    (NOTES "Experiment 135"). The 192-row D64 tile has such tiles too, but there the test reshaped
    ptxas's key loops and lost; D128's 128 x 128 tiles have none when Sq = Sk."""
    return call.head_dim in (192, 256) and (call.causal or call.has_window) and call.mods is None


# The split tail (common/split_tail.py) for plain calls whose last round leaves SMs idle: long
# walks on the 128-row tile only (NOTES "Experiment 122": S4k gained nothing, and the 192-row D64
# tile lost to the split code alone). A piece's fixed cost counts as 8 key tiles.
_SPLIT_MIN_KEY_TILES = 64
_SPLIT_PIECE_COST_TILES = 8.0
_SPLIT_MAX_WAYS_ONE_ROUND = 16  # (decode: a single long item, B 1 x Hkv 8, still fills the SMs)


def _plain(call: AttentionCall) -> bool:
    """No causal mask, window, softcap, variable lengths or mods (so no block mask either)."""
    return _dense(call) and call.mods is None and not call.causal


# D96 plain calls of 4096+ keys rescale O after the P V wait (D64's default) instead of early
# (NOTES "Experiment 120"); elsewhere the late rescale lost, was level, or is unmeasured.
_D96_LATE_RESCALE_MIN_SEQLEN_K = 4096


def _early_rescale_pays(call: AttentionCall, cfg: FwdConfig, max_k: int) -> bool:
    """Whether O is rescaled just before P V is issued rather than after the P V wait: only with
    always rescaling (the conditional rescale decides after the tile's softmax)."""
    if cfg.rescale_threshold is not None or not _DEFAULT_OPTIONS[call.head_dim].get("early_o_rescale", False):
        return False
    d96_long = call.head_dim == call.head_dim_v == 96 and max_k >= _D96_LATE_RESCALE_MIN_SEQLEN_K
    return not (d96_long and _plain(call))


def _d128_cond_rescale_pays(call: AttentionCall) -> bool:
    """D=128 plain and causal calls rescale O only when a row's max grows by more than 2^8, not
    early (NOTES "Experiments 96, 130"; D=64 lost with it), and block-list walks of a mask_mod
    (with the early Q release: 330 TFLOP/s on 8 causal documents of 512 against 314 early);
    score_mods keep the early rescale (ALiBi 614 against 610 conditional, a clamped relative bias
    595 against 600), as do unmeasured rows (softcap, windows); both are exact."""
    return (call.head_dim == call.head_dim_v == 128
            and ((call.mods is None and call.softcap <= 0 and not call.has_window) or _block_list_walk(call)))


# CTA pairs multicasting each K / V tile (`FwdConfig.kv_multicast`): the H100 runs these kernels
# at its power limit, so the ring's L2-to-SM traffic costs clock (NOTES "Experiments 99, 137").
# Short walks and the 192-row tiles (less traffic per FLOP; "Experiment 138") keep single CTAs.
# Plain calls only: the pair must walk the same key tiles.
_KV_MULTICAST_HEAD_DIMS = (96, 128, 192, 256)
_KV_MULTICAST_MIN_SEQLEN_K = 4096


def _kv_multicast_pays(call: AttentionCall, cfg: FwdConfig, max_k: int) -> bool:
    # (a pair shares K / V between two query tiles: with one query tile, as in decode, the partner
    # CTA would have no rows)
    return (_plain(call) and call.page_table is None and call.head_dim == call.head_dim_v
            and call.head_dim in _KV_MULTICAST_HEAD_DIMS
            and max_k >= _KV_MULTICAST_MIN_SEQLEN_K and not cfg.dynamic_schedule and cfg.num_consumer_wg == 2
            and fwd_launch.max_seqlens(call)[0] > cfg.tile_m)


# Persistent CTAs taking items from a counter (`FwdConfig.dynamic_schedule`) where items are short
# or unequal: causal walks (NOTES "Experiments 63, 137, 139, 140"), windowed walks ("Experiment
# 73"), and D=256 up to 2048 keys ("Experiment 63").
_DYNAMIC_MAX_D256_SEQLEN = 2048


def _dynamic_schedule_pays(call: AttentionCall, longest: int) -> bool:
    # its persistent loop compiles clean where the static one does (no mods), and at D <= 128
    # for calls whose only mod is a score_mod (CPU compile tests)
    if _block_list_walk(call):
        return True
    if call.mods is not None and not (call.head_dim <= 128 and call.mods.mask_graph is None
                                      and call.softcap <= 0 and not call.has_window and not call.block_mask):
        return False
    if call.has_window or call.causal:
        return True
    return call.head_dim == 256 and longest <= _DYNAMIC_MAX_D256_SEQLEN


def _block_list_walk(call: AttentionCall) -> bool:
    """D=128 calls whose only mod is a mask_mod with its block mask: the walks are the block lists,
    short and unequal (a document mask's query tiles see 1 to doc_len / 128 key tiles), so the
    persistent CTAs take items from the counter as causal walks do, and Q's buffer is released
    after a walk's last Q K^T as for short walks (8 causal documents of 512 at S 4k, H200: 231
    TFLOP/s one CTA per item, 269 on the counter, 312 with causal folded out of the mask
    (mods/block_lists.py), 330 with the early Q release; causal S 512: 347). Its loop compiles
    with a mask_mod's loads (CPU compile tests)."""
    return (fwd_launch.uses_block_mask(call) and call.mods.score_graph is None and _dense(call)
            and call.head_dim == call.head_dim_v == 128 and call.page_table is None
            and call.seqused_k is None)


# Q's buffer freed after the walk's last Q K^T (`FwdConfig.early_q_release`) for short walks,
# whose persistent CTAs start a new item every few key tiles (NOTES "Experiment 65").
_EARLY_Q_MAX_SEQLEN = 2048


def _grid_ctas(cfg: FwdConfig, call: AttentionCall) -> int:
    """max_ctas for this call: about one CTA per SM for a persistent kernel."""
    return fwd_launch.max_ctas(call) if cfg.persistent else fwd_launch.ONE_CTA_PER_ITEM


def _fake_trailing_args(cfg: FwdConfig) -> list:
    """Stand-ins for what `launch` passes after fwd_launch.leading_args."""
    import cutlass
    import cutlass.cute as cute

    from torch_fa4.kernels.common.mod_lowering import fake_aux_tensor

    def int32s(rank: int):
        return fwd_launch.fake_packed(cutlass.Int32, rank)

    block_mask = [int32s(3), int32s(4), int32s(3), int32s(4)] if cfg.block_sparse else [None] * 4
    aux = [fake_aux_tensor(dt, nd) for dt, nd in cfg.aux_specs] + [None] * (MAX_AUX - len(cfg.aux_specs))
    counter = int32s(1) if cfg.dynamic_schedule else None
    split = [None, None]
    if cfg.split_ways:
        ws = cute.runtime.make_fake_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int(), 128),
                                           (cute.sym_int64(), 128, 1), assumed_align=16)
        split = [ws, int32s(1)]
    page_table = fwd_launch.fake_packed(cutlass.Int32, 2) if cfg.page_box else None
    return [*block_mask, *aux, counter, *split, cutlass.Int32(0), page_table]


def compile_fwd(cfg: FwdConfig, arch: str = "sm_90a", dump_dir: Optional[str] = None):
    """Compile (or fetch) the kernel for cfg; dump_dir: also write the cubin and PTX there (always
    compiles, bypassing the cache)."""
    options = fwd_launch.compile_options(arch, dump_dir, cfg.ptxas_options)

    def build(jit: bool = True):  # jit=False: only to be exported (compile_cache.get_or_compile)
        import cutlass.cute as cute

        from torch_fa4.kernels.sm90.fwd import FlashFwdSm90

        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(FlashFwdSm90(cfg), *fwd_launch.fake_leading_args(cfg), *_fake_trailing_args(cfg),
                            stream, options=options, no_jit_engine=not jit)

    if dump_dir is not None:
        return build()
    return compile_cache.get_or_compile(("sm90_fwd", arch, cfg), build, persist=True)


def forward(call: AttentionCall, out: torch.Tensor, lse: torch.Tensor, **overrides) -> None:
    """overrides: FwdConfig fields to compile and launch instead of the defaults (tests, probes)."""
    if not overrides and fwd_launch_record.run(call, out, lse):
        return  # a repeated call shape, launched from its record (fwd_launch_record)
    cfg = default_config(call, **overrides)
    if call.page_table is not None and not cfg.page_box:  # a page size no key tile loads
        return forward(paged_kv.gathered(call), out, lse, **overrides)
    kernel = compile_fwd(cfg)
    args = fwd_launch.leading_args(call, out, lse, L2_BYTES, _grid_ctas(cfg, call), cfg.tile_m)
    if args is None:  # no query rows: nothing to write
        return
    launch(kernel, cfg, call, args, split_spec(cfg, call))


def launch(kernel, cfg: FwdConfig, call: AttentionCall, leading: Sequence, split: Optional[tuple]) -> None:
    """Launch a forward kernel (general path and launch records): `leading` from
    fwd_launch.leading_args, `split` from `split_spec`, a zeroed item counter for each launch
    (fwd_launch.schedule_counter)."""
    device = call.q.device
    block_mask = [None] * 4
    if cfg.block_sparse:
        block_mask = [t if t.stride(-1) == 1 else t.contiguous() for t in call.block_mask]
    counter = fwd_launch.schedule_counter(device) if cfg.dynamic_schedule else None
    kernel(*leading, *block_mask, *fwd_launch.launch_aux(call, len(cfg.aux_specs), MAX_AUX), counter, *split_buffers(split, device),
           call.page_table)


def split_plan(cfg: FwdConfig, call: AttentionCall) -> tuple:
    """(split items, ways) for this call's grid (host/split_plan.choose); (0, 1) where splitting
    would not shorten the last round. Plain calls only (every item walks the same key tiles)."""
    if not _plain(call) or cfg.dynamic_schedule or cfg.block_sparse:
        return 0, 1
    max_q, max_k = fwd_launch.max_seqlens(call)
    tiles = -(-max_k // cfg.tile_n)
    pair = 2 if cfg.kv_multicast else 1  # (a pair's CTAs take adjacent query tiles: an even count)
    num_m_blocks = -(-max_q // cfg.tile_m)
    items = (num_m_blocks + num_m_blocks % pair) * call.num_heads * call.batch
    ctas = fwd_launch.max_ctas(call)
    # a grid that fills the SMs splits only long tails; one that leaves SMs idle (decode) splits
    # wherever the pieces' fixed cost pays
    if cfg.num_consumer_wg != 2 or (tiles < _SPLIT_MIN_KEY_TILES and items >= ctas):
        return 0, 1
    return split_plan_mod.choose(items, ctas, tiles, pair=pair, piece_cost_tiles=_SPLIT_PIECE_COST_TILES,
                                 single_round=True, max_ways=_SPLIT_MAX_WAYS_ONE_ROUND if items < ctas else 8)


def split_spec(cfg: FwdConfig, call: AttentionCall) -> Optional[tuple]:
    """(workspace shape, counter slots, split items) of a split-tail variant, None without one."""
    if not cfg.split_ways:
        return None
    items, ways = split_plan(cfg, call)  # (the plan does not read cfg.split_ways)
    if ways != cfg.split_ways:  # a variant compiled for another split (an override): none
        items = 0
    slots = max(items * cfg.num_consumer_wg, 1)
    return (slots * cfg.split_ways, split_plan_mod.state_values(call.head_dim_v), 128), slots, items


def split_buffers(spec: Optional[tuple], device: torch.device) -> list:
    """The split tail's launch arguments from `split_spec`: every piece's state (written before it
    is read) and the piece counters (zero, and left zero by the launch), kept per stream
    (host/split_scratch.py)."""
    if spec is None:
        return [None, None, 0]
    ws_shape, slots, items = spec
    return [*split_scratch.buffers(ws_shape, slots, device), items]

