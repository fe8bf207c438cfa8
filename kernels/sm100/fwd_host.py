"""Host side of the sm100 forward: pick a kernel variant for a call, compile it once, launch it
(as kernels/sm90/fwd_host.py does for sm90).

Compile-verified only: no Blackwell GPU has run this kernel, so `unsupported_reason` accepts
exactly the variants tests/test_sm100_fwd_compile.py compiles for sm_100a.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from torch_fa4.call import AttentionCall
from torch_fa4.kernels import compile_cache
from torch_fa4.kernels.host import fwd_launch
from torch_fa4.kernels.sm100.fwd_config import SMEM_LIMIT, TMEM_COLUMNS, Sm100FwdConfig

L2_BYTES = 126 * 1024 * 1024  # B200
ARCH = "sm_100a"

# keys per tile and K/V ring depth per head dim, within the tensor- and shared-memory budgets (fwd_config)
_TILES = {64: (128, 4), 96: (128, 3), 128: (128, 3)}
SUPPORTED_HEAD_DIMS = tuple(_TILES)


def unsupported_reason(call: AttentionCall) -> Optional[str]:
    q = call.q
    if q.is_cuda and torch.cuda.get_device_capability(q.device) != (10, 0):
        major, minor = torch.cuda.get_device_capability(q.device)
        return f"sm_{major}{minor} (sm100 kernel compiled and checked for sm_100a only)"
    reason = fwd_launch.operand_reason(
        call, "sm100", SUPPORTED_HEAD_DIMS, "; larger O does not fit TMEM beside two S tiles")
    if reason is not None:
        return reason
    if call.mods is not None or call.mod_key:
        return "score_mod/mask_mod not yet lowered for sm100"
    if call.block_mask:
        return "block_mask not yet supported by the sm100 kernel"
    return fwd_launch.layout_reason(call)


def default_config(call: AttentionCall, **overrides) -> Sm100FwdConfig:
    tile_n, kv_stages = _TILES[call.head_dim]
    cfg = Sm100FwdConfig(tile_n=tile_n, kv_stages=kv_stages, **fwd_launch.call_features(call))
    cfg = replace(cfg, **overrides) if overrides else cfg
    assert cfg.tmem_columns()["used"] <= TMEM_COLUMNS and cfg.smem_bytes() <= SMEM_LIMIT, cfg
    return cfg


def compile_fwd(cfg: Sm100FwdConfig, arch: str = ARCH, dump_dir: Optional[str] = None):
    """Compile (or fetch) the kernel for cfg; dump_dir: also write the cubin and PTX there (always
    compiles, bypassing the cache)."""
    options = fwd_launch.compile_options(arch, dump_dir)

    def build():
        import cutlass.cute as cute

        from torch_fa4.kernels.sm100.fwd import FlashFwdSm100

        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(
            FlashFwdSm100(cfg), *fwd_launch.fake_leading_args(cfg), stream, options=options,
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
    kernel(*args)