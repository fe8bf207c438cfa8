"""Probe kernels for the CuTe DSL lowering of mods: the lowered mods on every element of a
(B, H, M, N) grid, per element (`mod_lowering`) or per register fragment (`mod_fragment`, the
hoisted emission the attention kernels use). The CPU tests compile them for sm_90a and read the
PTX / SASS; the GPU tests compare their values with float64.

Captured tensors go in as the kernels take them: the host @cute.jit takes them as separate optional
arguments (TVM-FFI rejects one tuple of tensors of different ranks), the @cute.kernel as tuples.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from torch_fa4.kernels.common.mod_fragment import (FragmentEmitter, FragmentPositions, emit_mask_mod, emit_score_mod,
                                                   tile_values)
from torch_fa4.kernels.common.mod_lowering import (INT, MAX_AUX, as_kind, fake_aux_tensor, mask_mod_value,
                                                   score_mod_value)

PROBE_SCALE = 0.5  # a power of two: score * PROBE_SCALE is exact, so references can form it too


class ModProbeKernel:
    """Evaluates score_mod and mask_mod for every (b, h, q_idx, kv_idx) of a grid, one element per
    thread: out[b,h,q,kv] = score_mod(score[b,h,q,kv], b, h, q, kv) and keep[...] = mask_mod(...)."""

    threads = 128

    def __init__(self, score_graph, mask_graph):
        self.score_graph = score_graph
        self.mask_graph = mask_graph
        self.num_score_aux = len(score_graph.aux) if score_graph is not None else 0
        self.num_aux = self.num_score_aux + (len(mask_graph.aux) if mask_graph is not None else 0)
        assert self.num_aux <= MAX_AUX

    @cute.jit
    def __call__(self, score: cute.Tensor, out: cute.Tensor, keep: cute.Tensor,
                 aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7, stream):
        aux = (aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7)[: self.num_aux]
        self.launch(score, out, keep, aux[: self.num_score_aux], aux[self.num_score_aux:], stream)

    def launch(self, score, out, keep, score_aux, mask_aux, stream):
        B, H, M, N = score.shape
        grid = ((M * N + self.threads - 1) // self.threads, H, B)
        self.kernel(score, out, keep, score_aux, mask_aux).launch(grid=grid, block=(self.threads, 1, 1),
                                                                   stream=stream)

    @cute.kernel
    def kernel(self, score: cute.Tensor, out: cute.Tensor, keep: cute.Tensor, score_aux, mask_aux):
        tidx, _, _ = cute.arch.thread_idx()
        bx, h, b = cute.arch.block_idx()
        M, N = score.shape[2], score.shape[3]
        idx = bx * self.threads + tidx
        if idx < M * N:
            q_idx = idx // N
            kv_idx = idx - q_idx * N
            s = score[b, h, q_idx, kv_idx]
            if cutlass.const_expr(self.score_graph is not None):
                s = score_mod_value(self.score_graph, s, b, h, q_idx, kv_idx, score_aux)
            out[b, h, q_idx, kv_idx] = s
            if cutlass.const_expr(self.mask_graph is not None):
                k = mask_mod_value(self.mask_graph, b, h, q_idx, kv_idx, mask_aux)
                keep[b, h, q_idx, kv_idx] = as_kind(cutlass.select_(k, Int32(1), Int32(0)), INT)


class ModTileProbeKernel(ModProbeKernel):
    """Like ModProbeKernel, but through `mod_fragment`: each thread holds a (2, 8) register fragment
    (two query rows, eight keys), applies both mods to the scores scaled by PROBE_SCALE (masked
    entries become -inf) and writes them back: out = mods(score * PROBE_SCALE); `keep` is unused.
    Exercises every hoisting level (tile values, rows, columns, elements) and the fused score fma."""

    rows, cols = 2, 8

    def launch(self, score, out, keep, score_aux, mask_aux, stream):
        B, H, M, N = score.shape
        segments = ((M + self.rows - 1) // self.rows) * ((N + self.cols - 1) // self.cols)
        grid = ((segments + self.threads - 1) // self.threads, H, B)
        self.tile_kernel(score, out, score_aux, mask_aux).launch(grid=grid, block=(self.threads, 1, 1),
                                                                  stream=stream)

    @cute.kernel
    def tile_kernel(self, score: cute.Tensor, out: cute.Tensor, score_aux, mask_aux):
        tidx, _, _ = cute.arch.thread_idx()
        bx, h, b = cute.arch.block_idx()
        M, N = score.shape[2], score.shape[3]
        per_row = (N + self.cols - 1) // self.cols
        seg = bx * self.threads + tidx
        if seg < ((M + self.rows - 1) // self.rows) * per_row:
            row0 = (seg // per_row) * self.rows
            col0 = (seg - (seg // per_row) * per_row) * self.cols
            frag = cute.make_rmem_tensor((self.rows, self.cols), Float32)
            coords = cute.make_identity_tensor((self.rows, self.cols))
            for r in cutlass.range_constexpr(self.rows):
                for j in cutlass.range_constexpr(self.cols):
                    frag[r, j] = score[b, h, cutlass.min(row0 + r, M - 1), cutlass.min(col0 + j, N - 1)]
            scale, last_q, last_k = Float32(PROBE_SCALE), M - 1, N - 1
            # one FragmentPositions for both mods: positions emitted for the score_mod are reused
            pos = FragmentPositions(coords, row0, col0)
            if cutlass.const_expr(self.score_graph is not None):
                em = FragmentEmitter(self.score_graph, pos, b, h, score_aux,
                                     tile_values(self.score_graph, b, h, score_aux), last_q, last_k)
                emit_score_mod(em, frag, scale)
            if cutlass.const_expr(self.mask_graph is not None):
                em = FragmentEmitter(self.mask_graph, pos, b, h, mask_aux,
                                     tile_values(self.mask_graph, b, h, mask_aux), last_q, last_k)
                emit_mask_mod(em, frag)
            for r in cutlass.range_constexpr(self.rows):
                for j in cutlass.range_constexpr(self.cols):
                    if row0 + r < M and col0 + j < N:
                        out[b, h, row0 + r, col0 + j] = frag[r, j]


def compile_probe(score_graph, mask_graph, arch: str = "sm_90a", dump_dir=None, tile: bool = False):
    """cute.compile ModProbeKernel (ModTileProbeKernel with tile=True) against fake tensors: shapes
    stay symbolic. Call the result as fn(score, out, keep, *aux) with aux padded by None to MAX_AUX
    entries (mod_lowering.kernel_aux_tensors)."""
    from torch_fa4.kernels.host.fwd_launch import compile_options

    def fake(dt):
        return cute.runtime.make_fake_tensor(dt, tuple(cute.sym_int() for _ in range(4)),
                                             tuple(cute.sym_int64() for _ in range(3)) + (1,), assumed_align=4)

    probe = (ModTileProbeKernel if tile else ModProbeKernel)(score_graph, mask_graph)
    specs = [a for g in (score_graph, mask_graph) if g is not None for a in g.aux]
    aux = [fake_aux_tensor(a.dtype, a.ndim) for a in specs] + [None] * (MAX_AUX - len(specs))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(probe, fake(Float32), fake(Float32), fake(Int32), *aux, stream,
                        options=compile_options(arch, dump_dir))
