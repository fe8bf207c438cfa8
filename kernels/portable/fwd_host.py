"""Host side of the portable forward: which calls it takes, the variant for a call on a device,
compile once, launch.

The variant depends on the call's features (kernels/host/fwd_launch.call_features, the mods, the
block mask) and the device's architecture, which picks the tile shape (tiles.py). Mods: the
ModSet's key and the captured tensors' dtypes and ranks are part of the variant; the captured
tensors and a block mask are launch arguments.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Optional

import torch

from torch_fa4.call import AttentionCall
from torch_fa4.kernels import compile_cache
from torch_fa4.kernels.host import fwd_launch
from torch_fa4.kernels.host.block_mask_layout import block_mask_tensors_reason
from torch_fa4.kernels.portable import tiles
from torch_fa4.kernels.portable.fwd_config import MAX_AUX, PortableFwdConfig

SUPPORTED_HEAD_DIMS = tiles.HEAD_DIMS
L2_BYTES = 40 * 1024 * 1024  # A100's L2 (the L2 grouping of causal / window items)


@functools.lru_cache(maxsize=None)
def _arch_of_index(index: int) -> str:
    return tiles.arch_of(torch.cuda.get_device_capability(index))


def device_arch(device: torch.device) -> str:
    """The compile target of a CUDA device (sm_80 where there is no CUDA device: CPU tests)."""
    if device.type != "cuda":
        return "sm_80"
    return _arch_of_index(device.index if device.index is not None else torch.cuda.current_device())


def unsupported_reason(call: AttentionCall) -> Optional[str]:
    if (reason := fwd_launch.operand_reason(call, "portable", SUPPORTED_HEAD_DIMS)) is not None:
        return reason
    if (reason := fwd_launch.mods_reason(call, "portable", MAX_AUX)) is not None:
        return reason
    if fwd_launch.uses_block_mask(call) and (reason := _block_mask_reason(call)) is not None:
        return reason
    # (16-byte aligned rows: the cp.async loads' requirement, as the TMA's of the other kernels)
    return fwd_launch.layout_reason(call)



def _block_mask_reason(call: AttentionCall) -> Optional[str]:
    if (reason := block_mask_tensors_reason(call)) is not None:
        return reason
    tile_m, tile_n, _ = tiles.tile_shape(device_arch(call.q.device), call.head_dim)
    if call.block_mask_q % tile_m != 0:
        return (f"block_mask BLOCK_SIZE q={call.block_mask_q} is not a multiple of the kernel's "
                f"{tile_m}-row tile")
    if call.block_mask_kv % tile_n != 0:
        return (f"block_mask BLOCK_SIZE kv={call.block_mask_kv} is not a multiple of the kernel's "
                f"{tile_n}-key tile")
    return fwd_launch.block_mask_coverage_reason(call)


def default_config(call: AttentionCall, arch: Optional[str] = None, **overrides) -> PortableFwdConfig:
    """The variant that runs `call` on `arch` (default: the call's device's)."""
    arch = arch or device_arch(call.q.device)
    tile_m, tile_n, num_warps, q_in_regs = tiles.tile_row(arch, call.head_dim)
    opts = dict(tile_m=tile_m, tile_n=tile_n, num_warps=num_warps, q_in_regs=q_in_regs)
    if call.mods is not None:
        opts.update(mod_key=call.mods.key, aux_specs=tuple((str(t.dtype), t.dim()) for t in call.aux_tensors))
    if fwd_launch.uses_block_mask(call):
        opts.update(block_sparse=True, bm_tiles_m=call.block_mask_q // tile_m,
                    bm_tiles_n=call.block_mask_kv // tile_n)
    cfg = PortableFwdConfig(**fwd_launch.call_features(call), **opts)
    return replace(cfg, **overrides) if overrides else cfg


def _fake_trailing_args(cfg: PortableFwdConfig) -> list:
    """Stand-ins for what `forward` passes after fwd_launch.leading_args."""
    import cutlass

    from torch_fa4.kernels.common.mod_lowering import fake_aux_tensor

    def int32s(rank: int):
        return fwd_launch.fake_packed(cutlass.Int32, rank)

    block_mask = [int32s(3), int32s(4), int32s(3), int32s(4)] if cfg.block_sparse else [None] * 4
    aux = [fake_aux_tensor(dt, nd) for dt, nd in cfg.aux_specs] + [None] * (MAX_AUX - len(cfg.aux_specs))
    return [*block_mask, *aux]


def compile_fwd(cfg: PortableFwdConfig, arch: str, dump_dir: Optional[str] = None):
    """Compile (or fetch) the kernel for cfg on arch; dump_dir: also write the cubin and PTX there
    (always compiles, bypassing the cache)."""
    options = fwd_launch.compile_options(arch, dump_dir)

    def build(jit: bool = True):  # jit=False: only to be exported (compile_cache.get_or_compile)
        import cutlass.cute as cute

        from torch_fa4.kernels.portable.fwd import FlashFwdPortable

        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        fake_args = [*fwd_launch.fake_leading_args(cfg), *_fake_trailing_args(cfg), stream]
        return cute.compile(FlashFwdPortable(cfg), *fake_args, options=options, no_jit_engine=not jit)

    if dump_dir is not None:
        return build()
    return compile_cache.get_or_compile(("portable_fwd", arch, cfg), build, persist=True)


def forward(call: AttentionCall, out: torch.Tensor, lse: torch.Tensor, **overrides) -> None:
    """overrides: PortableFwdConfig fields to compile and launch instead of the defaults (tests)."""
    arch = device_arch(call.q.device)
    cfg = default_config(call, arch, **overrides)
    kernel = compile_fwd(cfg, arch)
    args = fwd_launch.leading_args(call, out, lse, L2_BYTES, fwd_launch.ONE_CTA_PER_ITEM, cfg.tile_m)
    if args is None:  # no query rows: nothing to write
        return
    block_mask = [None] * 4
    if cfg.block_sparse:
        block_mask = [t if t.stride(-1) == 1 else t.contiguous() for t in call.block_mask]
    kernel(*args, *block_mask, *fwd_launch.launch_aux(call, len(cfg.aux_specs), MAX_AUX))

