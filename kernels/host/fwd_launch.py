"""What every architecture's forward kernel is compiled against and launched with: the sm90 and
sm100 forward kernels take the same leading arguments (`leading_args`) and differ only in what
follows. No CuTe DSL import at module level: a kernel from the disk cache launches without it.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import replace
from typing import Optional

import torch

from torch_fa4.call import AttentionCall

UNBOUNDED = 1 << 30  # kernels.common.block_range.UNBOUNDED, restated to stay free of cutlass
_LOG2E = 1.0 / math.log(2.0)


def operand_reason(call: AttentionCall, kernel: str, head_dims: tuple, head_dim_note: str = "") -> Optional[str]:
    """Why a forward kernel cannot take these q, k, v dtypes and head dims (None: it can)."""
    q, k, v = call.q, call.k, call.v
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} ({kernel} kernel: float16/bfloat16)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k, v dtypes differ"
    if call.head_dim not in head_dims:
        return f"head_dim {call.head_dim} ({kernel} kernel: {head_dims}{head_dim_note})"
    if call.head_dim_v != call.head_dim:
        return "head_dim_v != head_dim"
    if call.num_heads % call.num_heads_kv != 0:
        return "num_heads not a multiple of num_heads_kv"
    return None


# the mod lowering's fp32 index arithmetic is exact below 2^23 (host/mod_hoisting.py)
MOD_MAX_POSITION = 1 << 23


def mods_reason(call: AttentionCall, kernel: str, max_aux: int) -> Optional[str]:
    """Why a forward kernel cannot take these mods and captured tensors (None: it can)."""
    if call.mod_key and call.mods is None:
        return "mod_key given without its resolved ModSet"
    if len(call.aux_tensors) > max_aux:
        return f"mods capture {len(call.aux_tensors)} tensors ({kernel} kernel: at most {max_aux})"
    if any(t.device != call.q.device for t in call.aux_tensors):
        return "a captured tensor is not on q's device"
    if call.mods is not None and max(max_seqlens(call)) > MOD_MAX_POSITION:
        return f"mods on sequences longer than {MOD_MAX_POSITION} positions"
    return None


def uses_block_mask(call: AttentionCall) -> bool:
    # a block mask only speeds up a mask_mod; without one it is ignored
    return bool(call.block_mask) and call.mods is not None and call.mods.mask_graph is not None


def block_mask_coverage_reason(call: AttentionCall) -> Optional[str]:
    """Why a block mask does not cover the call (None: it does): one built for shorter sequences
    would be read past its end, or would drop keys."""
    num, idx = call.block_mask[0], call.block_mask[1]
    max_q, max_k = max_seqlens(call)
    if num.shape[2] * call.block_mask_q < max_q or idx.shape[3] * call.block_mask_kv < max_k:
        return (f"block_mask covers {num.shape[2] * call.block_mask_q} x {idx.shape[3] * call.block_mask_kv} "
                f"positions, the call needs {max_q} x {max_k}")
    return None


def launch_aux(call: AttentionCall, num_specs: int, max_aux: int) -> list:
    """The captured tensors as a forward kernel takes them (as mod_lowering.kernel_aux_tensors,
    without importing CuTe DSL: a kernel from the disk cache), padded with None to max_aux."""
    aux = []
    for t in call.aux_tensors[:num_specs]:
        if t.dtype == torch.bool:
            t = t.view(torch.uint8)
        if t.dim() == 0:
            t = t.reshape(1)
        if t.stride(-1) != 1:
            t = t.clone(memory_format=torch.contiguous_format)
        aux.append(t)
    return aux + [None] * (max_aux - len(aux))


def call_features(call: AttentionCall) -> dict:
    """The fields of a forward variant (sm90 FwdConfig, sm100 Sm100FwdConfig) that come straight
    from the call."""
    return dict(
        dtype_name=str(call.q.dtype).removeprefix("torch."),
        head_dim=call.head_dim,
        head_dim_v=call.head_dim_v,
        causal=bool(call.causal),
        has_window=call.has_window,
        softcap=call.softcap > 0,
        varlen_q=call.cu_seqlens_q is not None,
        varlen_k=call.cu_seqlens_k is not None,
        has_seqused_k=call.seqused_k is not None,
    )


def layout_reason(call: AttentionCall, paged_kv: bool = False) -> Optional[str]:
    """Why the TMA loads of a forward kernel cannot read these tensors (None: they can).
    paged_kv: whether the kernel loads K / V through a page table (packed queries then come
    without cu_seqlens_k)."""
    if call.page_table is not None:
        if not paged_kv:
            return "paged KV caches (page_table)"
        if call.page_table.shape[1] > 0 and call.page_table.stride(1) != 1:
            return "page_table rows not contiguous"
    elif call.is_varlen != (call.cu_seqlens_k is not None):
        return "cu_seqlens_q and cu_seqlens_k must be given together"
    q, k, v = call.q, call.k, call.v
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    # (on every call: all three at once first, the one to blame only on a refusal)
    if (qs[-1] == ks[-1] == vs[-1] == 1 and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16
            and not any(s % 8 for s in (*qs[:-1], *ks[:-1], *vs[:-1]))):
        return None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            return f"{name} last dim not contiguous"
        if t.data_ptr() % 16 != 0 or any(s % 8 != 0 for s in t.stride()[:-1]):
            return f"{name} base or strides not 16-byte aligned (TMA)"
    return None


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


ONE_CTA_PER_ITEM = (1 << 31) - 1  # as max_ctas: a kernel compiled persistent runs one CTA per item


# The dynamic schedule's item counter (FwdConfig.dynamic_schedule): zero at launch, counted up by
# the launch's CTAs. A fresh zero-filled tensor per launch costs the host an allocation and a fill
# launch on every call; instead each (device, stream, thread) keeps a buffer of zeroed counters,
# hands each launch the next one, and zeroes the whole buffer in one fill once all are used:
# launches on a stream run in order, so that fill runs after every launch that counted in the
# buffer, and before any that counts in it next. A stream being captured into a CUDA graph gets a
# fresh counter (the graph keeps it and its fill). (Threads have their own buffers: two threads
# launching on one stream must not be handed one counter.)
COUNTER_SLOTS = 1024
_MAX_COUNTER_POOLS = 64  # a bound for programs that meet ever-new streams or threads
_counter_pools: dict = {}


class CounterPool:
    """`slots` int32 counters on `device`, zero until handed out by `take`."""

    def __init__(self, device: torch.device, slots: int):
        self.buffer = torch.zeros(slots, dtype=torch.int32, device=device)
        self.views = self.buffer.split(1)
        self.taken = 0

    def take(self) -> torch.Tensor:
        """A zero counter (1,) for one launch on the pool's stream."""
        if self.taken == len(self.views):  # every counter used: zeroed in stream order
            self.buffer.zero_()
            self.taken = 0
        self.taken += 1
        return self.views[self.taken - 1]


def schedule_counter(device: torch.device) -> torch.Tensor:
    """A zeroed int32 (1,) item counter for one dynamic-schedule launch on the current stream."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device)
    key = (stream.device_index, stream.cuda_stream, threading.get_ident())
    pool = _counter_pools.get(key)
    if pool is None:
        if len(_counter_pools) >= _MAX_COUNTER_POOLS:
            _counter_pools.clear()
        pool = _counter_pools[key] = CounterPool(device, COUNTER_SLOTS)
    return pool.take()


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (looked up once per device)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _sm_count_of(call: AttentionCall) -> int:
    if call.q.device.type != "cuda":  # argument-list checks on a CPU machine: nothing launches
        return 1
    return sm_count(call.q.device)


def max_ctas(call: AttentionCall) -> int:
    """CTAs a persistent forward launches: one per SM (the kernels run one CTA per SM)."""
    return _sm_count_of(call)


def max_seqlens(call: AttentionCall) -> tuple[int, int]:
    """(most queries, most keys) of a sequence; a paged cache's keys: max_pages * page_size."""
    if call.is_varlen:
        max_q = call.max_seqlen_q or int((call.cu_seqlens_q[1:] - call.cu_seqlens_q[:-1]).max())
        max_k = call.kv_len if call.page_table is not None else call.max_seqlen_k or call.k.shape[0]
        return max_q, max_k
    return call.q.shape[1], call.kv_len


def l2_group_bytes(call: AttentionCall, l2_bytes: int) -> int:
    """The L2 size the (batch, head) grouping of a call's work items assumes (`heads_per_l2_group`
    fills half of it). The CTAs in flight read the K and V of every head in their group, so
    causal and windowed walks are grouped so a group's K and V take a sixth of L2 (NOTES
    "Experiments 71, 72"); other calls get one pair per group, every query tile of a head before
    the next head."""
    if call.causal or call.has_window:
        return l2_bytes // 3
    return 1  # (as if L2 held one byte: heads_per_l2_group's floor of one pair per group)


def heads_per_l2_group(call: AttentionCall, seqlen_k: int, l2_bytes: int) -> int:
    """(batch, head) pairs whose K and V fit in about half of `l2_bytes` (see common.tile_scheduler)."""
    kv_bytes = max(seqlen_k, 1) * (call.head_dim + call.head_dim_v) * call.q.element_size()
    total = call.batch * call.num_heads
    return max(1, min(total, (l2_bytes // 2) // kv_bytes))


# The tail group of a causal call (common.tile_scheduler): as many of the last pairs as hold
# TAIL_FILL times every SM's share of the longest walk, so the longest items of the last pairs
# start while every SM still has work; at most TAIL_MAX_BYTES of their K and V, since the tail's
# CTAs read every tail pair's K and V at once.
TAIL_FILL = 1.0
TAIL_MAX_BYTES = 32 << 20


def tail_pairs(call: AttentionCall, seqlen_q: int, seqlen_k: int, tile_m: int, heads_per_group: int,
               num_sms: int) -> int:
    """The last (batch, head) pairs that run as one group (0: none). Only causal walks without a
    left window differ enough in length to need it."""
    pairs = call.batch * call.num_heads
    if not call.causal or call.window_left >= 0 or seqlen_q <= 0:
        return 0
    # a pair's work in units of its longest walk: query tile m sees the keys up to its last row
    full = seqlen_q // tile_m  # tiles whose rows all lie inside the sequence
    partial = -(-seqlen_q // tile_m) - full
    pair_work = (tile_m * full * (full + 1) / 2 + partial * seqlen_q) / seqlen_q
    kv_bytes = max(seqlen_k, 1) * (call.head_dim + call.head_dim_v) * call.q.element_size()
    tail = min(pairs, math.ceil(TAIL_FILL * num_sms / pair_work), max(1, TAIL_MAX_BYTES // kv_bytes))
    # no larger than an ordinary group: the plain order already ends with such a group
    return tail if tail > heads_per_group else 0


def nonnegative_scale(call: AttentionCall) -> AttentionCall:
    """The same call with a scale >= 0 where the kernels' softmax needs one.

    The forward kernels take each row's max of the raw scores q.k and multiply it by the scale
    (one multiply per row, not per score); with a negative scale that is the row's minimum, and
    large logits then overflow. q.k * scale = (-q).k * (-scale) exactly (negating bf16 / fp16 is
    exact), so such calls run on -q, a copy made only for them. Softcap and score_mod calls are
    not affected: their softmax runs on scores already multiplied by the scale. The backward needs
    no change: it recomputes P from the saved LSE, with no row max."""
    if call.scale >= 0 or call.softcap > 0 or (call.mods is not None and call.mods.score_graph is not None):
        return call
    return replace(call, q=-call.q, scale=-call.scale)


def leading_args(call: AttentionCall, out, lse, l2_bytes: int, max_ctas: int, tile_m: int) -> Optional[list]:
    """The arguments every forward kernel starts with, or None when the call has no query rows.

    max_ctas: the most CTAs a persistent kernel launches (ONE_CTA_PER_ITEM: one-shot grid). With
    softcap the kernel computes softcap * tanh(s * scale / softcap): the score is scaled by
    scale / softcap first and the softmax (log2 domain) by softcap * log2(e)."""
    call = nonnegative_scale(call)
    max_q, max_k = max_seqlens(call)
    if max_q == 0 or call.batch == 0:
        return None
    if call.softcap > 0:
        score_scale, scale_log2 = call.scale / call.softcap, call.softcap * _LOG2E
    else:
        score_scale, scale_log2 = call.scale, call.scale * _LOG2E
    wl = call.window_left if call.window_left >= 0 else UNBOUNDED
    wr = call.window_right if call.window_right >= 0 else UNBOUNDED
    group = heads_per_l2_group(call, max_k, l2_group_bytes(call, l2_bytes))
    tail = tail_pairs(call, max_q, max_k, tile_m, group, _sm_count_of(call))
    return [
        call.q, call.k, call.v, out, lse,
        call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k,
        score_scale, scale_log2, wl, wr,
        call.batch, max_q, group, tail, max_ctas,
    ]


def fake_packed(dtype, rank: int, align: int = 4):
    """A stand-in tensor of `rank` symbolic dims with a unit last stride."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(dtype, tuple(cute.sym_int() for _ in range(rank)),
                                         tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,), assumed_align=align)


def fake_leading_args(cfg) -> list:
    """Stand-ins for `leading_args` to compile against: symbolic shapes and strides, so one
    compiled kernel serves every batch, length, head count and stride pattern of its variant
    (`cfg`: an architecture's forward config)."""
    import cutlass
    import cutlass.cute as cute

    dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[cfg.dtype_name]

    def fake(rank, last):
        shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (last,)
        # 16-byte aligned bases and strides: TMA's requirement, checked by unsupported_reason
        stride = tuple(cute.sym_int64(divisibility=8) for _ in range(rank - 1)) + (1,)
        return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=16)

    def offsets(given: bool):
        return fake_packed(cutlass.Int32, 1) if given else None

    q = fake(3 if cfg.varlen_q else 4, cfg.head_dim)
    o = fake(3 if cfg.varlen_q else 4, cfg.head_dim_v)
    k = fake(3 if cfg.varlen_k else 4, cfg.head_dim)
    v = fake(3 if cfg.varlen_k else 4, cfg.head_dim_v)
    lse = fake_packed(cutlass.Float32, 2 if cfg.varlen_q else 3)
    scalars = [cutlass.Float32(1.0), cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0),
               cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(0), cutlass.Int32(1)]
    return [q, k, v, o, lse, offsets(cfg.varlen_q), offsets(cfg.varlen_k), offsets(cfg.has_seqused_k), *scalars]


def compile_options(arch: str, dump_dir: Optional[str], ptxas_options: str = "") -> str:
    from torch_fa4.kernels.compile_cache import extra_options

    return f"--enable-tvm-ffi --gpu-arch {arch}" + extra_options(dump_dir, ptxas_options)
