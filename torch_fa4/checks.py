"""Argument checks for the public API: every rule in one place, every error naming the argument.

Checks read only shapes, dtypes, devices and strides, so they cost nothing on the GPU and trace
cleanly under torch.compile. Value checks of varlen offsets (which need a device read) run only
in eager mode; see `check_varlen_values`.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from .tensor_memo import TensorMemo

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8


def _fail(exc, msg):
    raise exc(f"torch_fa4: {msg}")


def check_qkv(q, k, v, *, varlen_q: bool, varlen_k: bool, paged: bool = False) -> None:
    """paged: k / v are paged caches (num_pages, page_size, Hkv, D) read through a page table."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            _fail(TypeError, f"{name} has dtype {t.dtype}; supported: float16, bfloat16 (GPU kernels), float32, float64 (reference)")
    if not (q.dtype == k.dtype == v.dtype):
        _fail(TypeError, f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        _fail(ValueError, f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    want_q, want_k = (3 if varlen_q else 4), (3 if varlen_k else 4)
    layout_q = "(total_q, H, D) with cu_seqlens_q" if varlen_q else "(B, S, H, D)"
    layout_k = "(total_k, H_kv, D) with cu_seqlens_k" if varlen_k else "(B, S_k, H_kv, D)"
    if paged:
        layout_k = "(num_pages, page_size, H_kv, D) with page_table"
    if q.dim() != want_q:
        _fail(ValueError, f"q must be {want_q}-D {layout_q}, got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != want_k:
            _fail(ValueError, f"{name} must be {want_k}-D {layout_k}, got shape {tuple(t.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-1] > 0 and t.stride(-1) != 1:
            _fail(ValueError, f"{name}'s last dimension (head dim) must be contiguous (stride 1), got stride {t.stride(-1)}; call .contiguous()")
    d, dv = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d:
        _fail(ValueError, f"q and k must have the same head dim, got {d} and {k.shape[-1]}")
    for name, dim in (("q/k", d), ("v", dv)):
        if dim == 0 or dim > MAX_HEAD_DIM or dim % HEAD_DIM_MULTIPLE:
            _fail(ValueError, f"head dim of {name} is {dim}; supported: a multiple of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM} (kernels: 64, 96, 128, 192, 256)")
    if k.shape[:-1] != v.shape[:-1]:
        _fail(ValueError, f"k and v must agree on all but the head dim, got {tuple(k.shape)} and {tuple(v.shape)}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv:
        _fail(ValueError, f"number of query heads ({hq}) must be a multiple of the number of KV heads ({hkv}) for GQA/MQA")
    if not varlen_q and not varlen_k and not paged and q.shape[0] != k.shape[0]:
        _fail(ValueError, f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")


def check_offsets(name: str, t: Optional[torch.Tensor], device: torch.device, length: Optional[int] = None) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32 or t.dim() != 1:
        _fail(TypeError, f"{name} must be a 1-D int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if t.device != device:
        _fail(ValueError, f"{name} is on {t.device} but q is on {device}")
    if length is not None and t.numel() != length:
        _fail(ValueError, f"{name} must have {length} entries, got {t.numel()}")


def check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, paged: bool = False) -> None:
    """Check the varlen tensors' shapes (paged: k is a paged cache, its batch is the page table's)."""
    if cu_seqlens_k is not None and cu_seqlens_q is None:
        _fail(ValueError, "cu_seqlens_k needs cu_seqlens_q (varlen keys come with varlen queries)")
    check_offsets("cu_seqlens_q", cu_seqlens_q, q.device)
    if cu_seqlens_q is not None and cu_seqlens_q.numel() < 1:
        _fail(ValueError, "cu_seqlens_q must have at least one entry (B + 1 offsets)")
    batch = cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else q.shape[0]
    check_offsets("cu_seqlens_k", cu_seqlens_k, q.device, batch + 1)
    if cu_seqlens_q is not None and cu_seqlens_k is None and not paged and k.shape[0] != batch:
        _fail(ValueError, f"with cu_seqlens_q and dense k, k's batch ({k.shape[0]}) must equal len(cu_seqlens_q) - 1 ({batch})")
    check_offsets("seqused_k", seqused_k, q.device, batch)


def check_page_table(q, k, page_table, cu_seqlens_q, cu_seqlens_k, requires_grad: bool) -> None:
    """A page table's type, shape and device, and what may not come with it (shapes only).
    requires_grad: whether autograd would record the call (paged attention is forward-only)."""
    if not isinstance(page_table, torch.Tensor):
        _fail(TypeError, f"page_table must be a torch.Tensor, got {type(page_table).__name__}")
    if page_table.dtype != torch.int32 or page_table.dim() != 2:
        _fail(TypeError, f"page_table must be a 2-D (B, max_pages) int32 tensor, got {page_table.dtype} "
                         f"of shape {tuple(page_table.shape)}")
    if page_table.device != q.device:
        _fail(ValueError, f"page_table is on {page_table.device} but q is on {q.device}")
    if cu_seqlens_k is not None:
        _fail(ValueError, "cu_seqlens_k cannot come with page_table: a paged cache's keys are found through "
                          "the page table (give each sequence's length in seqused_k)")
    batch = cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else q.shape[0]
    if page_table.shape[0] != batch:
        _fail(ValueError, f"page_table must have one row per sequence ({batch}), "
                          f"got shape {tuple(page_table.shape)}")
    if page_table.shape[1] > 0 and page_table.stride(1) != 1:
        _fail(ValueError, f"page_table's rows must be contiguous (stride 1), got strides "
                          f"{page_table.stride()}; call .contiguous()")
    if k.shape[1] == 0:
        _fail(ValueError, f"k_cache's pages hold no keys (page_size 0): shape {tuple(k.shape)}")
    if requires_grad:
        _fail(NotImplementedError, "attention over a paged KV cache (page_table) is forward-only, but q, "
                                   "k_cache or v_cache requires grad; run it under torch.no_grad() / "
                                   "inference_mode, or detach them")


# Varlen arguments whose values passed check_varlen_values: a model hands the same cu_seqlens to
# every layer, and reading them is a device sync that leaves the GPU idle, so each set of tensors is
# read once while it lives unmodified.
_PASSED = TensorMemo(capacity=64)


def check_max_seqlen(max_seqlen_q, max_seqlen_k) -> None:
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is None or isinstance(value, torch.SymInt):
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            _fail(TypeError, f"{name} must be an int or None, got {type(value).__name__}")
        if value < 0:
            _fail(ValueError, f"{name} must be >= 0, got {value}")


def check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q=None, max_seqlen_k=None,
                        page_table=None) -> None:
    """Value checks that read the offsets; called in eager mode only (a device read, once per
    unmodified set of tensors). A given max_seqlen must cover the longest sequence: the kernels
    size their grids by it, so a smaller one would leave rows unwritten. With a page table, the
    ids of the pages each sequence uses (the first ceil(seqused_k / page_size) of its row) must
    name pages of the cache; the entries after them are never read and may hold anything."""
    tensors = (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)
    if all(t is None for t in tensors):
        return
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # a CUDA graph's capture cannot read values; the replays run on whatever they hold
    sizes = (q.shape[0], k.shape[0], k.shape[-3], max_seqlen_q, max_seqlen_k)
    if _PASSED.get(tensors, sizes):
        return  # the same live tensors, unmodified since they passed
    _check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, page_table)
    _PASSED.put(tensors, sizes, True)


def _check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                         page_table=None) -> None:
    if cu_seqlens_q is not None:
        _check_cumulative("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q)
    if cu_seqlens_k is not None:
        _check_cumulative("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k)
    if page_table is not None:
        _check_pages(k, seqused_k, page_table)
    elif seqused_k is not None:
        if cu_seqlens_k is not None:
            cap = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        else:
            cap = torch.full_like(seqused_k, k.shape[-3])
        if bool(((seqused_k < 0) | (seqused_k > cap)).any()):
            _fail(ValueError, "seqused_k entries must lie in [0, the number of keys of their batch]")


def _check_pages(k, seqused_k, page_table) -> None:
    """seqused_k within the page table's capacity and the used pages' ids within the cache, in one
    device read."""
    num_pages, page_size = k.shape[0], k.shape[1]
    max_pages = page_table.shape[1]
    cap = max_pages * page_size
    if seqused_k is None:
        used_pages = torch.full((page_table.shape[0], 1), max_pages, device=page_table.device)
        bad_used = torch.zeros((), dtype=torch.bool, device=page_table.device)
    else:
        used_pages = ((seqused_k.long() + page_size - 1) // page_size).view(-1, 1)
        bad_used = ((seqused_k < 0) | (seqused_k > cap)).any()
    in_use = torch.arange(max_pages, device=page_table.device).view(1, -1) < used_pages
    bad_ids = (in_use & ((page_table < 0) | (page_table >= num_pages))).any()
    used_wrong, ids_wrong = torch.stack([bad_used, bad_ids]).tolist()
    if used_wrong:
        _fail(ValueError, f"seqused_k entries must lie in [0, max_pages * page_size = {cap}] (page_table has "
                          f"{max_pages} pages per sequence of {page_size} keys)")
    if ids_wrong:
        rows, cols = torch.nonzero(in_use & ((page_table < 0) | (page_table >= num_pages)), as_tuple=True)
        b, i = int(rows[0]), int(cols[0])
        _fail(ValueError, f"page_table[{b}, {i}] = {int(page_table[b, i])} is not a page of the cache "
                          f"(k_cache has {num_pages} pages); every page a sequence uses must be in "
                          f"[0, {num_pages})")


def _check_cumulative(name, cu, total, max_name, max_seqlen) -> None:
    vals = cu.tolist()
    if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])):
        _fail(ValueError, f"{name} must start at 0 and never decrease, got {vals[:8]}{'...' if len(vals) > 8 else ''}")
    if vals[-1] != total:
        _fail(ValueError, f"{name}[-1] is {vals[-1]} but the tensor holds {total} tokens")
    longest = max((b - a for a, b in zip(vals, vals[1:])), default=0)
    if max_seqlen is not None and max_seqlen < longest:
        _fail(ValueError, f"{max_name} is {max_seqlen} but the longest sequence in {name} has {longest} tokens "
                          f"(pass at least {longest}, or None to have it computed)")


def check_scalars(scale, softcap, window_size) -> tuple[int, int]:
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        _fail(ValueError, f"scale must be a finite number or None, got {scale!r}")
    if not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        _fail(ValueError, f"softcap must be a finite number >= 0 (0 disables it), got {softcap!r}")
    if window_size is None:
        window_size = (None, None)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        _fail(ValueError, f"window_size must be a pair (left, right), got {window_size!r}")
    out = []
    for side, w in zip(("left", "right"), window_size):
        if w is None or w == -1:
            out.append(-1)
        elif isinstance(w, int) and not isinstance(w, bool) and w >= 0:
            out.append(w)
        else:
            _fail(ValueError, f"window_size {side} must be None, -1 (unbounded) or an int >= 0, got {w!r}")
    return out[0], out[1]
