"""Compiling one portable backward variant (bwd_config.BwdVariant) against symbolic shapes, for any
target arch from sm_80 on (no GPU needed); kept by the compile cache.

The compiled signature: q, k, v, dO, dK, dV as (B, S, H, D) rows (varlen: one batch of packed
rows), 16-byte aligned with 8-element strides and a unit last stride; lse2 and dpsum (B, H, rows)
fp32; the fp32 dQ buffer (B, Sq, Hq, D); cu_seqlens / seqused_k int32 where the variant has them;
the deterministic counters (B, Hq, query tiles) int32; then the scalars (bwd_kernel.__call__).
"""

from __future__ import annotations

from torch_fa4.kernels.portable.bwd_config import BwdVariant
from torch_fa4.kernels.sm90.bwd_compile import MAX_AUX, cached_compile, compile_with_stream, cute_dtype


def compile_variant(variant: BwdVariant, arch: str = "sm_80", dump_dir: str | None = None):
    build = lambda dump, jit=True: _compile(variant, arch, dump, jit)  # noqa: E731
    return cached_compile(("portable_bwd", arch, variant), build, dump_dir)


def _mods(variant: BwdVariant):
    if not variant.mods_key:
        return None
    from torch_fa4.mods import registry

    return registry.lookup(variant.mods_key)


def kernel_object(variant: BwdVariant):
    from .bwd_kernel import PortableBackwardKernel

    return PortableBackwardKernel(
        cute_dtype(variant.dtype), variant.head_dim, variant.head_dim_v, variant.tile_m, variant.tile_n,
        variant.num_warps, variant.bounded, variant.softcap, variant.deterministic, variant.varlen,
        variant.seqused_k, sdp_warps_n=variant.sdp_warps_n, kv_warps_n=variant.kv_warps_n,
        dq_warps_n=variant.dq_warps_n, stages=variant.stages,
        mods=_mods(variant), sparse=variant.sparse, dq_pair_adds=variant.dq_pair_adds,
        late_row_stats=variant.late_row_stats, split_walk=variant.split_walk)


def _compile(variant: BwdVariant, arch: str, dump_dir: str | None, jit: bool = True):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    sym, s64 = cute.sym_int, cute.sym_int64
    al = lambda: s64(divisibility=8)  # noqa: E731  (16-byte strides of 16-bit rows)
    al4 = lambda: s64(divisibility=4)  # noqa: E731  (16-byte strides of fp32 rows)

    def fake(dt, shape, stride, align=16):
        return cute.runtime.make_fake_tensor(dt, shape, stride=stride, assumed_align=align)

    cdt = cute_dtype(variant.dtype)
    d, dv = variant.head_dim, variant.head_dim_v
    b, sq, sk, hq, hkv, rows, nb, nm = (sym() for _ in range(8))

    def seq(s, h, dim, dt=cdt, st=al):
        return fake(dt, (b, s, h, dim), (st(), st(), st(), 1))

    q, k, v, do = seq(sq, hq, d), seq(sk, hkv, d), seq(sk, hkv, dv), seq(sq, hq, dv)
    dk, dvv = seq(sk, hkv, d), seq(sk, hkv, dv)
    lse2, dpsum = (fake(Float32, (b, hq, rows), (s64(), s64(), 1), 4) for _ in range(2))
    dq_acc = seq(sq, hq, d, Float32, al4)
    cu_q = cu_k = None
    if variant.varlen:
        cu_q, cu_k = (fake(Int32, (sym(),), (1,), 4) for _ in range(2))
    used = fake(Int32, (sym(),), (1,), 4) if variant.seqused_k else None
    sem = fake(Int32, (nb, hq, nm), (s64(), s64(), 1), 4) if variant.deterministic else None
    scalars = (Float32(1.0), Float32(1.0), Float32(1.0), Int32(0), Int32(0), Int32(1), Int32(1))
    aux = []
    mods = _mods(variant)
    if mods is not None:
        from torch_fa4.kernels.common import mod_lowering

        specs = [a for g in (mods.score_graph, mods.mask_graph) if g is not None for a in g.aux]
        aux = [mod_lowering.fake_aux_tensor(a.dtype, a.ndim) for a in specs]
    aux += [None] * (MAX_AUX - len(aux))
    visit = None
    if variant.sparse:  # (B, Hq, key tiles, query tiles), batch / head broadcast by stride 0
        visit = fake(cutlass.Uint8, (b, hq, sym(), sym()), (s64(), s64(), s64(), 1), 1)
    args = (q, k, v, do, lse2, dpsum, dq_acc, dk, dvv, cu_q, cu_k, used, sem, visit, *scalars, *aux)
    return compile_with_stream(kernel_object(variant), args, arch, dump_dir, jit)
