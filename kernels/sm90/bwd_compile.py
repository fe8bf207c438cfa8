"""Compiling the sm90 backward: one variant (a BwdConfig) of bwd_kernel against symbolic shapes,
kept by the compile cache (on disk where kernels launch through TVM-FFI). Needs no GPU.
"""

from __future__ import annotations

import functools

import torch

from torch_fa4.kernels.host.fwd_launch import fake_packed
from torch_fa4.kernels.sm90.bwd_config import BwdConfig

MAX_AUX = 8  # captured mod tensors the kernel takes (kernels/common/mod_lowering.MAX_AUX)
MAX_CAPTURE_GRADS = 4  # captured tensors whose gradients the kernel accumulates (BwdConfig.capture_slots)


def cute_dtype(dtype: torch.dtype):
    import cutlass

    return {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[dtype]


@functools.cache
def _use_tvm_ffi() -> bool:
    """Whether the kernels launch through TVM-FFI (the only form the disk cache can store)."""
    import importlib.util

    return importlib.util.find_spec("tvm_ffi") is not None


def compile_with_stream(kernel, args, arch: str, dump_dir: str | None, jit: bool):
    """cute.compile(kernel, *args, fake stream) for the backward's kernels: TVM-FFI launches where
    tvm_ffi is installed (without it kernels still compile for the tests); jit=False: without the
    host JIT engines, only to be exported (compile_cache.get_or_compile)."""
    import cutlass.cute as cute

    from torch_fa4.kernels.compile_cache import extra_options

    tvm = _use_tvm_ffi()
    options = f"--gpu-arch {arch}" + (" --enable-tvm-ffi" if tvm else "") + extra_options(dump_dir)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm)
    return cute.compile(kernel, *args, stream, options=options, no_jit_engine=not jit)


def cached_compile(key, build, dump_dir: str | None = None):
    """compile_cache.get_or_compile of build(None, jit) for the backward's kernels (on disk where
    they use TVM-FFI); dump_dir: build(dump_dir), which also writes the cubin there (always
    compiles, bypassing the cache)."""
    from torch_fa4.kernels import compile_cache

    if dump_dir is not None:
        return build(dump_dir)
    return compile_cache.get_or_compile(key, lambda jit=True: build(None, jit), persist=_use_tvm_ffi())


def compile_variant(config: BwdConfig, arch: str = "sm_90a", dump_dir: str | None = None):
    """Compile one variant against symbolic shapes (no GPU needed); dump_dir: also write the cubin
    there (always compiles, bypassing the cache)."""
    build = lambda dump, jit=True: _compile(config, arch, dump, jit)  # noqa: E731
    return cached_compile(("sm90_bwd", arch, config), build, dump_dir)


def _compile(config: BwdConfig, arch: str, dump_dir: str | None, jit: bool = True):
    from .bwd_kernel import Sm90AttentionBackward

    mods = _mods_of(config)
    kernel = Sm90AttentionBackward(cute_dtype(config.dtype), config, mods)
    return compile_with_stream(kernel, kernel_args(config, mods), arch, dump_dir, jit)


def _mods_of(config: BwdConfig):
    if not config.mods_key:
        return None
    from torch_fa4.mods import registry

    return registry.lookup(config.mods_key)


def kernel_args(config: BwdConfig, mods=None, with_captured_grads: bool = True) -> tuple:
    """Stand-ins for the main kernel's arguments (bwd_kernel.__call__ without the stream): symbolic
    shapes and strides. The sm100 backward takes the same arguments but the captured tensors'
    gradient buffers (with_captured_grads=False)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    d, dv = config.head_dim, config.head_dim_v
    cdt = cute_dtype(config.dtype)
    sym, s64 = cute.sym_int, cute.sym_int64
    al = lambda: s64(divisibility=8)  # TMA: 16-byte aligned strides

    def fake(dt, shape, stride, align=16):
        return cute.runtime.make_fake_tensor(dt, shape, stride=stride, assumed_align=align)

    int32 = functools.partial(fake_packed, Int32)  # unit last stride

    def rows(seq, heads, dim, head_stride=None):  # (B, S, H, D) / varlen (T, H, D), 16-byte strides
        lead = () if config.varlen else (b,)
        return fake(cdt, (*lead, seq, heads, dim), (*(al() for _ in lead), al(), head_stride or al(), 1))

    b, sq, sk, hq, hkv = sym(), sym(), sym(), sym(), sym()
    sq_pad = sym()
    if config.varlen:
        sq, sk = sym(), sym()  # packed rows
    q, k, v, do = rows(sq, hq, d), rows(sk, hkv, d), rows(sk, hkv, dv), rows(sq, hq, dv)
    dk, dvv = rows(sk, hkv, d, d), rows(sk, hkv, dv, dv)  # contiguous
    if config.varlen:
        stat_rows = sym()  # the statistics' own rows (varlen_stat_layout), not the dQ buffer's
        lse, dps = (fake(Float32, (hq, stat_rows), (al(), 1)) for _ in range(2))
        dqa = fake(Float32, (hq, sq, d), (d, al(), 1))  # a (Hq, T, D) view of (T, Hq, D) rows
        bp1 = sym()
        cuq, cuk = (fake(Int32, (bp1,), (1,), 4) for _ in range(2))
        nb = sym()
    else:
        lse, dps = (fake(Float32, (b, hq, sq_pad), (al(), al(), 1)) for _ in range(2))
        # (B, Sq, Hq, D) storage seen as (B, Hq, Sq, D): dq's own layout, so the final conversion
        # to the input dtype is one contiguous pass; TMA drops the adds of rows past Sq
        dqa = fake(Float32, (b, hq, sq, d), (al(), al(), al(), 1))
        cuq = cuk = None
        nb = b
    used = fake(Int32, (nb,), (1,), 4) if config.seqused_k else None
    dq_out = fake(cdt, (b, sq, hq, d), (al(), al(), al(), 1)) if config.fused_dq else None
    sem = int32(3) if config.deterministic or config.persistent else None  # semaphores or the tile counter
    split_ws = split_cnt = None
    if config.split_tail:  # the pieces' partial dK / dV (slots, values, 256 threads) and their counters
        split_ws = fake(Float32, (sym(), sym(), 256), (s64(), 256, 1), 16)
        split_cnt = int32(1)
    lists = [None] * 4
    if config.sparse is not None:  # transposed block mask: counts (B', H', nkv), indices (B', H', nkv, nq)
        lists = [int32(3), int32(4), int32(3), int32(4)]
    aux = []
    if mods is not None:
        from torch_fa4.kernels.common import mod_lowering

        specs = [a for g in (mods.score_graph, mods.mask_graph) if g is not None for a in g.aux]
        aux = [mod_lowering.fake_aux_tensor(a.dtype, a.ndim) for a in specs]
    aux += [None] * (MAX_AUX - len(aux))
    grads = [None] * MAX_CAPTURE_GRADS
    for i, slot in enumerate(config.capture_slots):  # fp32, laid out like the captured tensor
        grads[i] = fake_packed(Float32, max(specs[slot].ndim, 1), align=4)
    scalars = (Float32(1.0), Float32(1.0), Float32(1.0), Int32(0), Int32(0), Int32(1), Int32(1), Int32(1),
               Int32(1), Int32(0), Int32(1))  # scale .. split_ways (bwd_kernel.__call__)
    args = (q, k, v, do, lse, dps, dqa, dk, dvv, dq_out, cuq, cuk, used, sem, split_ws, split_cnt, *lists,
            *scalars, *aux)
    return args + tuple(grads) if with_captured_grads else args
