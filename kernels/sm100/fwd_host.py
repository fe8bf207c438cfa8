"""Host side of the sm100 forward: pick a kernel variant for a call, compile it once, launch it
(as kernels/sm90/fwd_host.py does for sm90).

Compile-verified only: no Blackwell GPU has run this kernel, so `unsupported_reason` accepts
exactly the variants tests/test_sm100_fwd_compile.py compiles for sm_100a.

Mods and block masks as on sm90: the ModSet's key and the captured tensors' dtypes and ranks are
part of the variant; the captured tensors and the block mask's tensors are launch arguments. A CTA
walks one list of key tiles for all its query rows, so a block mask's query blocks must cover
whole CTA tiles: 256-row blocks keep the two-tile ping-pong, 128-row blocks (FlexAttention's
default) take one query tile per CTA.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from torch_fa4.call import AttentionCall
from torch_fa4.kernels import compile_cache
from torch_fa4.kernels.host import fwd_launch
from torch_fa4.kernels.host.block_mask_layout import block_mask_tensors_reason
from torch_fa4.kernels.sm100.fwd_config import Q_TILE_ROWS, SMEM_LIMIT, TMEM_COLUMNS, Sm100FwdConfig
from torch_fa4.kernels.sm90.fwd_config import MAX_AUX

L2_BYTES = 126 * 1024 * 1024  # B200
ARCH = "sm_100a"

# (keys per tile, K/V ring depth, 128-row query tiles per CTA) per head dim, within tensor memory
# (q_tiles * (tile_n + D) <= 512 columns) and shared memory (fwd_config.SMEM_LIMIT):
#   D<=128: two tiles of 128 keys (D=128 uses all 512 columns);
#   D=192:  two tiles of 64 keys (2 * (64 + 192) = 512), five 24 KB K/V stages beside 96 KB of Q;
#   D=256:  one query tile (128 + 256 = 384 columns), two 64 KB stages beside 64 KB of Q. Where
#           FA4 pairs two CTAs (cta_group 2) instead, the pair family (kernels/sm100/pair) runs
#           the call and this variant is its fallback.
_TILES = {64: (128, 4, 2), 96: (128, 3, 2), 128: (128, 3, 2), 192: (64, 5, 2), 256: (128, 2, 1)}
SUPPORTED_HEAD_DIMS = tuple(_TILES)


def _gathers_per_key(call: AttentionCall) -> bool:
    """A mask_mod that reads captured tensors (doc_ids[kv_idx]): a thread holds a whole 128-key row
    here, so such a mod gathers a value per key beside 128 scores, and at two query tiles' 184
    registers the softmax spilled (hundreds of local loads and stores in the CPU compile tests).
    These calls take one query tile per CTA, whose softmax warpgroup gets 240 registers."""
    mods = call.mods
    return mods is not None and mods.mask_graph is not None and len(call.aux_tensors) > mods.num_score_aux



def _block_tiles(call: AttentionCall) -> Optional[dict]:
    """tile_n, q_tiles and the block-mask ratios under a block mask, or None where its block sizes
    do not cover whole kernel tiles."""
    tile_n, stages, q_tiles = _TILES[call.head_dim]
    q_tiles = 1 if _gathers_per_key(call) else q_tiles
    if call.block_mask_kv % tile_n != 0:
        if call.block_mask_kv % 64 != 0:
            return None
        tile_n = 64  # (fewer columns of S and a smaller ring: every head dim fits)
    if call.block_mask_q % (q_tiles * Q_TILE_ROWS) != 0:
        if call.block_mask_q % Q_TILE_ROWS != 0:
            return None
        q_tiles = 1
    return dict(tile_n=tile_n, kv_stages=stages, q_tiles=q_tiles, block_sparse=True,
                bm_tiles_m=call.block_mask_q // (q_tiles * Q_TILE_ROWS),
                bm_tiles_n=call.block_mask_kv // tile_n)


def _block_mask_reason(call: AttentionCall) -> Optional[str]:
    if (reason := block_mask_tensors_reason(call)) is not None:
        return reason
    if _block_tiles(call) is None:
        return (f"block_mask BLOCK_SIZE ({call.block_mask_q}, {call.block_mask_kv}) is not a multiple of "
                f"({Q_TILE_ROWS}, 64)")
    return fwd_launch.block_mask_coverage_reason(call)


def unsupported_reason(call: AttentionCall) -> Optional[str]:
    q = call.q
    if q.is_cuda and torch.cuda.get_device_capability(q.device) != (10, 0):
        major, minor = torch.cuda.get_device_capability(q.device)
        return f"sm_{major}{minor} (sm100 kernel compiled and checked for sm_100a only)"
    reason = fwd_launch.operand_reason(call, "sm100", SUPPORTED_HEAD_DIMS)
    if reason is not None:
        return reason
    if (reason := fwd_launch.mods_reason(call, "sm100", MAX_AUX)) is not None:
        return reason
    if fwd_launch.uses_block_mask(call) and (reason := _block_mask_reason(call)) is not None:
        return reason
    return fwd_launch.layout_reason(call)


# Exponentials on the FMA pipe (Sm100FwdConfig.exp2_emulate_every). An sm_100 SM issues 16 MUFU.EX2
# per clock against about 8192 dense bf16 matmul FLOP: for a 128 x 128 score tile the 16384
# exponentials take 1024 clocks, its two matmuls 4 * 128 * 128 * D / 8192 = 8 D clocks, so at D=128
# MUFU is as busy as the tensor core and at D=64 twice as busy. Every 5th exponential as a
# polynomial (about 9 FMA-pipe instructions) takes a fifth off MUFU while the instruction slots still
# fit under the matmuls; FA4's own D=128 cubin computes 23 of each 128 (18 %) that way
# (benchmarks/NOTES.md, sm_100 census). D=192 / 256 are matmul-bound (exponentials 2/3 and 1/2 of
# the matmul time): none. Mods add per-score work on the same instruction slots: none either; softcap's
# tanh is a MUFU op per score too, but with the polynomial beside it the 184-register D=128
# softmax spilled (40 local loads / stores): none. Not yet measured on a Blackwell GPU.
_EXP2_EMULATE_EVERY = {64: 5, 96: 5, 128: 5, 192: 0, 256: 0}


def default_config(call: AttentionCall, **overrides) -> Sm100FwdConfig:
    tile_n, kv_stages, q_tiles = _TILES[call.head_dim]
    emulate = _EXP2_EMULATE_EVERY[call.head_dim] if call.mods is None and call.softcap <= 0 else 0
    # the packed pairs beside any other per-score work spilled the 184-register D=128 softmax:
    # softcap's tanh 42-54 local loads / stores (the scale before tanh packed or not), ALiBi 71, a
    # block-sparse causal mask_mod 31 (scalar: 0 for each). Such calls keep the scalar softmax,
    # and so do calls with a causal or key-length mask: CUDA 13's ptxas spilled those 29-49 local
    # loads / stores with the pairs (CUDA 12's: none)
    plain = call.mods is None and call.softcap <= 0
    packed = plain and not call.causal and call.seqused_k is None and call.cu_seqlens_k is None
    opts = dict(tile_n=tile_n, kv_stages=kv_stages, q_tiles=q_tiles, exp2_emulate_every=emulate,
                packed_f32x2=packed)
    if call.mods is not None:
        opts.update(mod_key=call.mods.key, aux_specs=tuple((str(t.dtype), t.dim()) for t in call.aux_tensors))
    if _gathers_per_key(call):
        opts["q_tiles"] = 1
    if fwd_launch.uses_block_mask(call):
        opts.update(_block_tiles(call))
    cfg = Sm100FwdConfig(**fwd_launch.call_features(call), **opts)
    cfg = replace(cfg, **overrides) if overrides else cfg
    assert cfg.tmem_columns()["used"] <= TMEM_COLUMNS and cfg.smem_bytes() <= SMEM_LIMIT, cfg
    return cfg


def _fake_trailing_args(cfg: Sm100FwdConfig) -> list:
    """Stand-ins for what `forward` passes after fwd_launch.leading_args: the block mask, the
    captured tensors."""
    import cutlass

    from torch_fa4.kernels.common.mod_lowering import fake_aux_tensor

    def int32s(rank: int):
        return fwd_launch.fake_packed(cutlass.Int32, rank)

    block_mask = [int32s(3), int32s(4), int32s(3), int32s(4)] if cfg.block_sparse else [None] * 4
    aux = [fake_aux_tensor(dt, nd) for dt, nd in cfg.aux_specs] + [None] * (MAX_AUX - len(cfg.aux_specs))
    return [*block_mask, *aux]


def compile_fwd(cfg: Sm100FwdConfig, arch: str = ARCH, dump_dir: Optional[str] = None):
    """Compile (or fetch) the kernel for cfg; dump_dir: also write the cubin and PTX there (always
    compiles, bypassing the cache)."""
    options = fwd_launch.compile_options(arch, dump_dir)

    def build():
        import cutlass.cute as cute

        from torch_fa4.kernels.sm100.fwd import FlashFwdSm100

        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(
            FlashFwdSm100(cfg), *fwd_launch.fake_leading_args(cfg), *_fake_trailing_args(cfg), stream,
            options=options,
        )

    if dump_dir is not None:
        return build()
    return compile_cache.get_or_compile(("sm100_fwd", arch, cfg), build)


def forward(call: AttentionCall, out: torch.Tensor, lse: torch.Tensor, **overrides) -> None:
    cfg = default_config(call, **overrides)
    kernel = compile_fwd(cfg)
    args = fwd_launch.leading_args(call, out, lse, L2_BYTES, fwd_launch.max_ctas(call), cfg.cta_tile_m)
    if args is None:  # no query rows: nothing to write
        return
    block_mask = [None] * 4
    if cfg.block_sparse:
        block_mask = [t if t.stride(-1) == 1 else t.contiguous() for t in call.block_mask]
    kernel(*args, *block_mask, *fwd_launch.launch_aux(call, len(cfg.aux_specs), MAX_AUX))
