"""sm90 backward preprocessing as one CuTe DSL kernel: the per-row statistics the backward reads.

For every query row `s` and head `h` (dense (B, S, H, Dv) tensors; varlen packs (T, H, Dv) and is
run here as one batch of T rows):

    lse2[b, h, s]  = lse[b, h, s] * log2(e), with -inf (a row that sees no key) turned into +inf
    dpsum[b, h, s] = sum_d dO[b, s, h, d] * O[b, s, h, d], accumulated in fp32

written into (B, H, rows) fp32 buffers whose rows past S are padding: +inf for lse2, 0 for dpsum
(bwd_row_stats.row_statistics' contract; it picks `rows`: whole query tiles of the backward variant, 64 or
128 rows, or more for a block-sparse walk; any count works here). One pass over dO and O, against
the ~5 of the torch expression (upcast copies, product, sum, padded copies).

Work split: a CTA takes 64 consecutive rows of one (batch, head), 4 threads per row; each thread
loads every 4th 16-byte vector of its row of dO and of O (Dv / 32 vectors each, all issued before
any is used), so a warp reads 8 rows x 64 contiguous bytes per load, whole 32-byte sectors, and
the lse loads and both stores are consecutive floats. Rows are walked along S within one head so
that the stores coalesce; the loads stay sector-efficient because each row is >= 128 contiguous
bytes. Two butterfly shuffles sum the 4 partial dot products.

CTAs take the (batch, head, tile) slabs last to first, so the rows this pass touches last are the
first pairs the main kernel walks: still in L2 when it starts (NOTES Experiment 128).

Compiled once per (dtype, Dv, zeroed head dim): shapes and strides are symbolic (dO / O: 16-byte aligned base and
strides, unit last stride; lse: any strides), so new sizes and varlen calls reuse the kernel.
The kernel itself is in bwd_prepare_kernel.py, imported only to compile it: this module's host
side loads no CuTe DSL, so a kernel loaded from the disk cache (kernels/disk_cache.py) runs
without it.
"""

from __future__ import annotations

import math

import torch

ROWS_PER_CTA = 64
THREADS_PER_ROW = 4  # a power of two dividing 32: a row's threads share one warp
VEC = 8  # 16-bit elements per 16-byte load
ZERO_VEC = 4  # fp32 elements per 16-byte store (the dQ buffer's zeros)
SUPPORTED_DV = (64, 96, 128, 192, 256)
LOG2E = math.log2(math.e)


def compile_kernel(dtype: torch.dtype, dv: int, arch: str = "sm_90a", dump_dir: str | None = None,
                   d_zero: int = 0):
    """cute.compile the kernel for (dtype, Dv, head dim of the dQ buffer it zeroes or 0) against
    symbolic shapes and strides (no GPU needed).

    Cached per process (kernels/compile_cache.py); dump_dir: also keep the cubin there (always
    compiles, bypassing the cache)."""
    from .bwd_compile import cached_compile

    return cached_compile(("sm90_bwd_prepare", arch, dtype, dv, d_zero),
                          lambda dump, jit=True: _compile(dtype, dv, arch, dump, d_zero, jit), dump_dir)


def _compile(dtype: torch.dtype, dv: int, arch: str, dump_dir: str | None, d_zero: int = 0, jit: bool = True):
    import cutlass.cute as cute
    from cutlass import Float32

    from .bwd_compile import compile_with_stream, cute_dtype
    from .bwd_prepare_kernel import RowStatisticsKernel

    sym, s64 = cute.sym_int, cute.sym_int64
    al = lambda: s64(divisibility=VEC)  # 16-byte strides: every row starts 16-byte aligned
    b, s, h, rows = sym(), sym(), sym(), sym()

    def fake(dt, shape, stride, align):
        return cute.runtime.make_fake_tensor(dt, shape, stride=stride, assumed_align=align)

    cdt = cute_dtype(dtype)
    dout, out = (fake(cdt, (b, s, h, dv), (al(), al(), al(), 1), 16) for _ in range(2))
    lse = fake(Float32, (b, h, s), (s64(), s64(), s64()), 4)  # slices of per-sequence views
    lse2, dpsum = (fake(Float32, (b, h, rows), (s64(), s64(), 1), 4) for _ in range(2))
    dq_acc = None
    if d_zero:
        a4 = lambda: s64(divisibility=ZERO_VEC)
        dq_acc = fake(Float32, (b, s, h, d_zero), (a4(), a4(), a4(), 1), 16)
    args = (dout, out, lse, lse2, dpsum, dq_acc)
    pdl = not arch.startswith("sm_8")  # programmatic dependent launch needs sm_90 or later
    return compile_with_stream(RowStatisticsKernel(cdt, dv, d_zero, pdl), args, arch, dump_dir, jit)


# ---- host side ------------------------------------------------------------------------------------

def _vector_ready(t: torch.Tensor) -> bool:
    """16-byte loads along the last dim: unit last stride, 16-byte base, 8-element strides."""
    strides = t.stride()
    if strides[-1] != 1 or t.data_ptr() % 16:
        return False
    for n, st in zip(t.shape, strides[:-1]):  # a plain loop: this runs several times per call
        if n > 1 and (st <= 0 or st % VEC):
            return False
    return True


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
    if max(lse.shape[:-1]) > 65535:  # (B, H) or (H,): the grid's z, y
        return "batch or heads beyond the grid's y/z limit (65535)"
    return None


def row_statistics(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, rows: int, dq_acc=None):
    """lse2 and dpsum stacked in one (2, B, H, rows) dense or (2, H, rows) varlen contiguous fp32
    buffer (`lse2, dpsum = row_statistics(...)` unpacks it), from dout/out (B, S, H, Dv) or
    (T, H, Dv) and lse (B, H, S) or (H, T). Call when unsupported_reason is None.
    dq_acc: a dense (B, S, H, D) fp32 buffer to zero in the same pass (see dq_zeroing_takes)."""
    # one allocation for both (each costs the host time per call); the second half starts B*H*rows
    # floats in, 16-byte aligned for the backward's TMA with bwd_row_stats.row_statistics' rows (whole tiles)
    stats = torch.empty((2, *lse.shape[:-1], rows), dtype=torch.float32, device=dout.device)
    row_statistics_into(dout, out, lse, stats[0], stats[1], dq_acc)
    return stats


def row_statistics_into(dout, out, lse, lse2: torch.Tensor, dpsum: torch.Tensor, dq_acc=None) -> None:
    """Like row_statistics, into given contiguous fp32 buffers of shape (*lse.shape[:-1], rows),
    rows >= S; every element is written (padding included). dq_acc, if given, must satisfy
    dq_zeroing_takes (the caller checks it once)."""
    for t in (lse2, dpsum):
        assert t.dtype == torch.float32 and t.shape[:-1] == lse.shape[:-1] and t.stride(-1) == 1, t.shape
        assert t.shape[-1] >= lse.shape[-1], "fewer rows than the sequence"
    d_zero = 0 if dq_acc is None else dq_acc.shape[-1]
    fn = compile_kernel(dout.dtype, dout.shape[-1], d_zero=d_zero)
    launch(fn, dout, out, lse, lse2, dpsum, dq_acc)


def launch(fn, dout, out, lse, lse2, dpsum, dq_acc=None) -> None:
    """One launch of a compiled pass `fn` (row_statistics_into's, or a backward launch record's):
    the packed rows of a varlen call as one batch of T rows, size-1 dims given compiled strides."""
    if dout.dim() == 3:
        dout, out, lse, lse2, dpsum = (t.unsqueeze(0) for t in (dout, out, lse, lse2, dpsum))
    fn(_packed_size_one_strides(dout), _packed_size_one_strides(out), lse, lse2, dpsum, dq_acc)


def dq_zeroing_takes(dq_acc: torch.Tensor, dout: torch.Tensor) -> bool:
    """Whether the pass can zero this dQ buffer: dense (B, S, H, D) fp32 rows matching dO's,
    contiguous, D a multiple of 16, 16-byte aligned."""
    if dout.dim() == 3:  # varlen: the packed rows are one batch of T rows
        dout = dout.unsqueeze(0)
    return (dout.dim() == 4 and dq_acc.dtype == torch.float32 and dq_acc.shape[:3] == dout.shape[:3]
            and dq_acc.is_contiguous() and dq_acc.shape[-1] % (ZERO_VEC * THREADS_PER_ROW) == 0
            and dq_acc.data_ptr() % 16 == 0)
