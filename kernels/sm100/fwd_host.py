"""Host side of the sm100 forward: pick a kernel variant for a call, compile it once, launch it.

Mirrors kernels/sm90/fwd_host.py: symbolic shapes and strides (fake tensors) so one compiled kernel
serves every batch size, sequence length, head count and stride pattern of its variant, and the
TVM-FFI calling convention takes torch tensors directly on the current stream.

Compile-verified only: no Blackwell GPU has ever run this kernel. `unsupported_reason` therefore
accepts exactly the variants tests/test_sm100_fwd_compile.py compiles for sm_100a.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch

from torch_fa4.call import AttentionCall
from torch_fa4.kernels import compile_cache
from torch_fa4.kernels.sm100.fwd_config import SMEM_LIMIT, TMEM_COLUMNS, Sm100FwdConfig

UNBOUNDED = 1 << 30  # kernels.common.block_range.UNBOUNDED (kept import-free of cutlass)
L2_BYTES = 126 * 1024 * 1024  # B200
ARCH = "sm_100a"

# keys per tile and K/V ring depth per head dim: S0 + S1 + O0 + O1 = 2 * tile_n + 2 * D columns of
# tensor memory must fit in 512 (fwd_config); Q (two tiles) + the ring in shared memory
_TILES = {64: (128, 4), 96: (128, 3), 128: (128, 3)}
SUPPORTED_HEAD_DIMS = tuple(_TILES)


def unsupported_reason(call: AttentionCall) -> Optional[str]:
    q, k, v = call.q, call.k, call.v
    if q.is_cuda and torch.cuda.get_device_capability(q.device) != (10, 0):
        major, minor = torch.cuda.get_device_capability(q.device)
        return f"sm_{major}{minor} (sm100 kernel compiled and checked for sm_100a only)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (sm100 kernel: float16/bfloat16)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k, v dtypes differ"
    if call.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {call.head_dim} (sm100 kernel: {SUPPORTED_HEAD_DIMS}; larger O does not fit TMEM beside two S tiles)"
    if call.head_dim_v != call.head_dim:
        return "head_dim_v != head_dim"
    if call.num_heads % call.num_heads_kv != 0:
        return "num_heads not a multiple of num_heads_kv"
    if call.mods is not None or call.mod_key:
        return "score_mod/mask_mod not yet lowered for sm100"
    if call.block_mask:
        return "block_mask not yet supported by the sm100 kernel"
    if call.is_varlen != (call.cu_seqlens_k is not None):
        return "cu_seqlens_q and cu_seqlens_k must be given together"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            return f"{name} last dim not contiguous"
        # TMA: 16-byte aligned base and strides
        if t.data_ptr() % 16 != 0 or any(s % 8 != 0 for s in t.stride()[:-1]):
            return f"{name} base or strides not 16-byte aligned (TMA)"
    return None


def default_config(call: AttentionCall, **overrides) -> Sm100FwdConfig:
    tile_n, kv_stages = _TILES[call.head_dim]
    cfg = Sm100FwdConfig(
        dtype_name=str(call.q.dtype).removeprefix("torch."),
        head_dim=call.head_dim,
        head_dim_v=call.head_dim_v,
        tile_n=tile_n,
        kv_stages=kv_stages,
        causal=bool(call.causal),
        has_window=call.has_window,
        softcap=call.softcap > 0,
        varlen_q=call.cu_seqlens_q is not None,
        varlen_k=call.cu_seqlens_k is not None,
        has_seqused_k=call.seqused_k is not None,
    )
    cfg = replace(cfg, **overrides) if overrides else cfg
    assert cfg.tmem_columns()["used"] <= TMEM_COLUMNS and cfg.smem_bytes() <= SMEM_LIMIT, cfg
    return cfg


def _fake_tensors(cfg: Sm100FwdConfig):
    import cutlass
    import cutlass.cute as cute

    dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[cfg.dtype_name]

    def fake(dt, rank, last, align=16):
        shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (last,)
        stride = tuple(cute.sym_int64(divisibility=8 if dt.width == 16 else 1) for _ in range(rank - 1)) + (1,)
        return cute.runtime.make_fake_tensor(dt, shape, stride, assumed_align=align)

    q = fake(dtype, 3 if cfg.varlen_q else 4, cfg.head_dim)
    o = fake(dtype, 3 if cfg.varlen_q else 4, cfg.head_dim_v)
    k = fake(dtype, 3 if cfg.varlen_k else 4, cfg.head_dim)
    v = fake(dtype, 3 if cfg.varlen_k else 4, cfg.head_dim_v)
    lse_rank = 2 if cfg.varlen_q else 3
    lse = cute.runtime.make_fake_tensor(
        cutlass.Float32, tuple(cute.sym_int() for _ in range(lse_rank)),
        tuple(cute.sym_int64() for _ in range(lse_rank - 1)) + (1,), assumed_align=4)

    def vec():
        return cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4)

    cu_q = vec() if cfg.varlen_q else None
    cu_k = vec() if cfg.varlen_k else None
    used_k = vec() if cfg.has_seqused_k else None
    return q, k, v, o, lse, cu_q, cu_k, used_k


def compile_fwd(cfg: Sm100FwdConfig, arch: str = ARCH, dump_dir: Optional[str] = None):
    """Compile (or fetch) the kernel for cfg; returns the TVM-FFI callable.

    dump_dir: also write the cubin (and PTX) there (always compiles, bypassing the cache)."""
    options = f"--enable-tvm-ffi --gpu-arch {arch}"
    if dump_dir is not None:
        options += f" --keep-cubin --keep-ptx --dump-dir {dump_dir}"

    def build():
        import cutlass
        import cutlass.cute as cute

        from torch_fa4.kernels.sm100.fwd import FlashFwdSm100

        q, k, v, o, lse, cu_q, cu_k, used_k = _fake_tensors(cfg)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(
            FlashFwdSm100(cfg), q, k, v, o, lse, cu_q, cu_k, used_k,
            cutlass.Float32(1.0), cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0),
            cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1), stream,
            options=options,
        )

    if dump_dir is not None:
        return build()
    return compile_cache.get_or_compile(("sm100_fwd", arch, cfg), build)


def _heads_per_group(call: AttentionCall, seqlen_k: int) -> int:
    """(batch, head) pairs whose K and V fit in about half of L2 (see common.tile_scheduler)."""
    kv_bytes = max(seqlen_k, 1) * (call.head_dim + call.head_dim_v) * call.q.element_size()
    total = call.batch * call.num_heads
    return max(1, min(total, (L2_BYTES // 2) // kv_bytes))


def forward(call: AttentionCall, out: torch.Tensor, lse: torch.Tensor, **overrides) -> None:
    cfg = default_config(call, **overrides)
    kernel = compile_fwd(cfg)
    if call.is_varlen:
        max_q = call.max_seqlen_q or int((call.cu_seqlens_q[1:] - call.cu_seqlens_q[:-1]).max())
        max_k = call.max_seqlen_k or call.k.shape[0]
    else:
        max_q, max_k = call.q.shape[1], call.k.shape[1]
    log2e = 1.0 / math.log(2.0)
    if call.softcap > 0:
        score_scale, scale_log2 = call.scale / call.softcap, call.softcap * log2e
    else:
        score_scale, scale_log2 = call.scale, call.scale * log2e
    wl = call.window_left if call.window_left >= 0 else UNBOUNDED
    wr = call.window_right if call.window_right >= 0 else UNBOUNDED
    if max_q == 0 or call.batch == 0:
        return
    kernel(
        call.q, call.k, call.v, out, lse,
        call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k,
        score_scale, scale_log2, wl, wr,
        call.batch, max_q, _heads_per_group(call, max_k),
    )
