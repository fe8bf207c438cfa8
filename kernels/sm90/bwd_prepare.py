"""sm90 backward preprocessing as one CuTe DSL kernel: the per-row statistics the backward reads.

For every query row `s` and head `h` (dense (B, S, H, Dv) tensors; varlen packs (T, H, Dv) and is
run here as one batch of T rows):

    lse2[b, h, s]  = lse[b, h, s] * log2(e), with -inf (a row that sees no key) turned into +inf
    dpsum[b, h, s] = sum_d dO[b, s, h, d] * O[b, s, h, d], accumulated in fp32

written into (B, H, rows) fp32 buffers whose rows past S are padding: +inf for lse2, 0 for dpsum
(bwd.row_statistics' contract; it picks `rows`: whole query tiles of the backward variant, 64 or
128 rows, or more for a block-sparse walk; any count works here). One pass over dO and O, against
the ~5 of the torch expression (upcast copies, product, sum, padded copies).

Work split: a CTA takes 64 consecutive rows of one (batch, head), 4 threads per row; each thread
loads every 4th 16-byte vector of its row of dO and of O (Dv / 32 vectors each, all issued before
any is used), so a warp reads 8 rows x 64 contiguous bytes per load, whole 32-byte sectors, and
the lse loads and both stores are consecutive floats. Rows are walked along S within one head so
that the stores coalesce; the loads stay sector-efficient because each row is >= 128 contiguous
bytes. Two butterfly shuffles sum the 4 partial dot products.

With `stat_tile` (bwd `permuted_stats`) each tile of that many rows is stored in
bwd_stats_layout's permuted order, which the main kernel reads as 16-byte vectors.

Compiled once per (dtype, Dv, stat_tile): shapes and strides are symbolic (dO / O: 16-byte aligned base and
strides, unit last stride; lse: any strides), so new sizes and varlen calls reuse the kernel.
Importing this module loads CuTe DSL; bwd.row_statistics imports it only for CUDA tensors.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, const_expr

from . import bwd_stats_layout as stats_layout

ROWS_PER_CTA = 64
THREADS_PER_ROW = 4  # a power of two dividing 32: a row's threads share one warp
VEC = 8  # 16-bit elements per 16-byte load
ZERO_VEC = 4  # fp32 elements per 16-byte store (the dQ buffer's zeros)
SUPPORTED_DV = (64, 96, 128, 192, 256)
LOG2E = math.log2(math.e)
_SHUFFLE_STEPS = THREADS_PER_ROW.bit_length() - 1  # butterfly steps over a row's threads


class RowStatisticsKernel:
    """fn(dout, out, lse, lse2, dpsum, dq_acc): dout/out (B, S, H, Dv), lse (B, H, S), lse2/dpsum
    (B, H, rows) with rows >= S (written in full, padding included); dq_acc (B, S, H, d_zero) fp32
    is zeroed on the way (None when d_zero = 0)."""

    threads = ROWS_PER_CTA * THREADS_PER_ROW

    def __init__(self, dtype, dv: int, d_zero: int = 0, stat_tile: int = 0, reversed_order: bool = False):
        if dv % (VEC * THREADS_PER_ROW):
            raise ValueError(f"Dv={dv} is not a multiple of {VEC * THREADS_PER_ROW}")
        if d_zero % (ZERO_VEC * THREADS_PER_ROW):
            raise ValueError(f"D={d_zero} is not a multiple of {ZERO_VEC * THREADS_PER_ROW}")
        self.dtype = dtype
        self.dv = dv
        self.vecs_per_thread = dv // (VEC * THREADS_PER_ROW)
        self.d_zero = d_zero
        self.zero_vecs_per_thread = d_zero // (ZERO_VEC * THREADS_PER_ROW)
        # > 0: lse2 / dpsum rows stored in bwd_stats_layout's permuted order within tiles of this
        # many rows (the backward variant's queries per step)
        self.stat_tile = stat_tile
        # CTAs take the (batch, head, tile) slabs last to first, so the rows this pass touches
        # last (its dQ zeros, dO, the statistics) are the first pairs the main kernel walks: still
        # in L2 when it starts (bwd.PASS_ORDER_ENV)
        self.reversed_order = reversed_order

    @cute.jit
    def __call__(self, dout: cute.Tensor, out: cute.Tensor, lse: cute.Tensor, lse2: cute.Tensor,
                 dpsum: cute.Tensor, dq_acc, stream):
        batch, heads, rows = lse2.shape
        grid = ((rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, heads, batch)
        self.kernel(dout, out, lse, lse2, dpsum, dq_acc).launch(grid=grid, block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, dout: cute.Tensor, out: cute.Tensor, lse: cute.Tensor, lse2: cute.Tensor,
               dpsum: cute.Tensor, dq_acc):
        # The main backward kernel (launched with programmatic dependent launch) may start its
        # prologue now; it waits for this grid before it reads anything this one writes.
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        tile, h, b = cute.arch.block_idx()
        if const_expr(self.reversed_order):
            n_tiles, n_heads, n_batch = cute.arch.grid_dim()
            tile, h, b = n_tiles - 1 - tile, n_heads - 1 - h, n_batch - 1 - b
        seqlen = dout.shape[1]
        rows = lse2.shape[2]
        row = tile * ROWS_PER_CTA + tidx // THREADS_PER_ROW
        part = tidx % THREADS_PER_ROW

        acc = Float32(0.0)
        x = Float32(0.0)
        if row < seqlen:
            x = lse[b, h, row]  # issued first, so its latency overlaps the row loads
            # (VEC, Dv / VEC): column j is the j-th 16-byte vector of the row
            do_vecs = cute.logical_divide(dout[b, row, h, None], cute.make_layout(VEC))
            o_vecs = cute.logical_divide(out[b, row, h, None], cute.make_layout(VEC))
            r_do = cute.make_rmem_tensor((VEC, self.vecs_per_thread), self.dtype)
            r_o = cute.make_rmem_tensor((VEC, self.vecs_per_thread), self.dtype)
            # all loads first: up to 2 x 8 x 16 bytes in flight per thread hide DRAM latency
            for j in cutlass.range_constexpr(self.vecs_per_thread):
                cute.autovec_copy(do_vecs[None, part + j * THREADS_PER_ROW], r_do[None, j])
                cute.autovec_copy(o_vecs[None, part + j * THREADS_PER_ROW], r_o[None, j])
            if const_expr(self.d_zero > 0):
                # the backward's dQ buffer row, zeroed while the loads are in flight (a separate
                # fill pass cost one more launch and ~30 us at 16k tokens x 2048 on an H200)
                z_vecs = cute.logical_divide(dq_acc[b, row, h, None], cute.make_layout(ZERO_VEC))
                zero = cute.make_rmem_tensor((ZERO_VEC,), Float32)
                zero.fill(0.0)
                for j in cutlass.range_constexpr(self.zero_vecs_per_thread):
                    cute.autovec_copy(zero, z_vecs[None, part + j * THREADS_PER_ROW])
            prod = r_do.load().to(Float32) * r_o.load().to(Float32)
            acc = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        # outside the branch: every lane of the warp takes part in the shuffles
        for i in cutlass.range_constexpr(_SHUFFLE_STEPS):
            acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=THREADS_PER_ROW >> (i + 1))

        at = row
        if const_expr(self.stat_tile > 0):
            at = stats_layout.position(row, self.stat_tile)
        if part == 0:
            if row < seqlen:
                # same fp32 product as the torch path (lse * log2 e), +inf where no key is seen
                lse2[b, h, at] = cutlass.select_(x == -Float32.inf, Float32.inf, x * Float32(LOG2E))
                dpsum[b, h, at] = acc
            elif row < rows:
                lse2[b, h, at] = Float32.inf
                dpsum[b, h, at] = Float32(0.0)


def compile_kernel(dtype: torch.dtype, dv: int, arch: str = "sm_90a", dump_dir: str | None = None,
                   d_zero: int = 0, stat_tile: int = 0, reversed_order: bool = False):
    """cute.compile the kernel for (dtype, Dv, head dim of the dQ buffer it zeroes or 0) against
    symbolic shapes and strides (no GPU needed).

    Cached per process (kernels/compile_cache.py); dump_dir: also keep the cubin there (always
    compiles, bypassing the cache)."""
    from torch_fa4.kernels import compile_cache

    if dump_dir is not None:
        return _compile(dtype, dv, arch, dump_dir, d_zero, stat_tile, reversed_order)
    return compile_cache.get_or_compile(("sm90_bwd_prepare", arch, dtype, dv, d_zero, stat_tile, reversed_order),
                                        lambda: _compile(dtype, dv, arch, None, d_zero, stat_tile, reversed_order))


def _compile(dtype: torch.dtype, dv: int, arch: str, dump_dir: str | None, d_zero: int = 0,
             stat_tile: int = 0, reversed_order: bool = False):
    from .bwd import _cute_dtype, compile_stream_and_options

    sym, s64 = cute.sym_int, cute.sym_int64
    al = lambda: s64(divisibility=VEC)  # 16-byte strides: every row starts 16-byte aligned
    b, s, h, rows = sym(), sym(), sym(), sym()

    def fake(dt, shape, stride, align):
        return cute.runtime.make_fake_tensor(dt, shape, stride=stride, assumed_align=align)

    cdt = _cute_dtype(dtype)
    dout = fake(cdt, (b, s, h, dv), (al(), al(), al(), 1), 16)
    out = fake(cdt, (b, s, h, dv), (al(), al(), al(), 1), 16)
    lse = fake(Float32, (b, h, s), (s64(), s64(), s64()), 4)  # slices of per-sequence views
    lse2 = fake(Float32, (b, h, rows), (s64(), s64(), 1), 4)
    dpsum = fake(Float32, (b, h, rows), (s64(), s64(), 1), 4)
    dq_acc = None
    if d_zero:
        a4 = lambda: s64(divisibility=ZERO_VEC)
        dq_acc = fake(Float32, (b, s, h, d_zero), (a4(), a4(), a4(), 1), 16)
    stream, options = compile_stream_and_options(arch, dump_dir)
    return cute.compile(RowStatisticsKernel(cdt, dv, d_zero, stat_tile, reversed_order), dout, out, lse, lse2, dpsum, dq_acc, stream,
                        options=options)


# ---- host side ------------------------------------------------------------------------------------

def _vector_ready(t: torch.Tensor) -> bool:
    """16-byte loads along the last dim: unit last stride, 16-byte base, 8-element strides."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(st > 0 and st % VEC == 0 for n, st in zip(t.shape[:-1], t.stride()[:-1]) if n > 1)


def _packed_size_one_strides(t: torch.Tensor) -> torch.Tensor:
    """The same view, size-1 dims given a stride that meets the compiled divisibility (their stride
    never addresses anything)."""
    if 1 not in t.shape[:-1]:  # the usual case, on every call's path: nothing to change
        return t
    strides = list(t.stride())
    for i in range(t.dim() - 2, -1, -1):
        if t.shape[i] == 1:
            strides[i] = max(VEC, strides[i + 1] * t.shape[i + 1])
    return t.as_strided(t.shape, strides) if strides != list(t.stride()) else t


def unsupported_reason(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> str | None:
    """None when the fused kernel takes these tensors; otherwise why the torch path runs."""
    if not (dout.is_cuda and out.is_cuda and lse.is_cuda):
        return "not CUDA tensors"
    if dout.dtype not in (torch.float16, torch.bfloat16) or out.dtype != dout.dtype:
        return f"dout/out dtypes {dout.dtype}/{out.dtype} (fused path: fp16/bf16, equal)"
    if lse.dtype != torch.float32:
        return f"lse dtype {lse.dtype} (fused path: float32)"
    if dout.shape != out.shape or dout.shape[-1] not in SUPPORTED_DV or dout.dim() not in (3, 4):
        return f"dout {tuple(dout.shape)} / out {tuple(out.shape)} (fused path: equal, Dv in {SUPPORTED_DV})"
    want = (dout.shape[1], dout.shape[0]) if dout.dim() == 3 else (dout.shape[0], dout.shape[2], dout.shape[1])
    if tuple(lse.shape) != want:
        return f"lse {tuple(lse.shape)} does not match dout {tuple(dout.shape)}"
    for name, t in (("dout", dout), ("out", out)):
        if not _vector_ready(t):
            return f"{name} cannot be read in 16-byte vectors (strides {t.stride()})"
    if dout.numel() == 0:
        return "empty"
    if dout.dim() == 4 and max(dout.shape[0], dout.shape[2]) > 65535:
        return "batch or heads beyond the grid's y/z limit (65535)"
    if dout.dim() == 3 and dout.shape[1] > 65535:
        return "heads beyond the grid's y limit (65535)"
    return None


def row_statistics(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, rows: int, dq_acc=None,
                   stat_tile: int = 0, reversed_order: bool = False):
    """(lse2, dpsum), each (B, H, rows) dense or (H, rows) varlen, contiguous fp32, from dout/out
    (B, S, H, Dv) or (T, H, Dv) and lse (B, H, S) or (H, T). Call when unsupported_reason is None.
    dq_acc: a dense (B, S, H, D) fp32 buffer to zero in the same pass (see dq_zeroing_takes)."""
    # one allocation for both (each costs the host time per call); the second half starts B*H*rows
    # floats in, 16-byte aligned for the backward's TMA with bwd.row_statistics' rows (whole tiles)
    lse2, dpsum = torch.empty((2, *lse.shape[:-1], rows), dtype=torch.float32, device=dout.device)
    row_statistics_into(dout, out, lse, lse2, dpsum, dq_acc, stat_tile, reversed_order)
    return lse2, dpsum


def row_statistics_into(dout, out, lse, lse2: torch.Tensor, dpsum: torch.Tensor, dq_acc=None,
                        stat_tile: int = 0, reversed_order: bool = False) -> None:
    """Like row_statistics, into given contiguous fp32 buffers of shape (*lse.shape[:-1], rows),
    rows >= S; every element is written (padding included). dq_acc, if given, must satisfy
    dq_zeroing_takes (the caller checks it once)."""
    for t in (lse2, dpsum):
        assert t.dtype == torch.float32 and t.shape[:-1] == lse.shape[:-1] and t.stride(-1) == 1, t.shape
        assert t.shape[-1] >= lse.shape[-1], "fewer rows than the sequence"
    if dout.dim() == 3:  # varlen: the packed rows are one batch of T rows
        dout, out, lse, lse2, dpsum = (t.unsqueeze(0) for t in (dout, out, lse, lse2, dpsum))
    assert not stat_tile or lse2.shape[-1] % stat_tile == 0, "permuted rows come in whole tiles"
    d_zero = 0 if dq_acc is None else dq_acc.shape[-1]
    fn = compile_kernel(dout.dtype, dout.shape[-1], d_zero=d_zero, stat_tile=stat_tile, reversed_order=reversed_order)
    fn(_packed_size_one_strides(dout), _packed_size_one_strides(out), lse, lse2, dpsum, dq_acc)


def dq_zeroing_takes(dq_acc: torch.Tensor, dout: torch.Tensor) -> bool:
    """Whether the pass can zero this dQ buffer: dense (B, S, H, D) fp32 rows matching dO's,
    contiguous, D a multiple of 16, 16-byte aligned."""
    return (dout.dim() == 4 and dq_acc.dtype == torch.float32 and dq_acc.shape[:3] == dout.shape[:3]
            and dq_acc.is_contiguous() and dq_acc.shape[-1] % (ZERO_VEC * THREADS_PER_ROW) == 0
            and dq_acc.data_ptr() % 16 == 0)
