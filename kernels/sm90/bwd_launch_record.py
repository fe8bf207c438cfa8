"""The backward's repeated dense calls: a launch record per shape, so a repeated call only
allocates its buffers and launches its three kernels.

A training loop calls the backward with the same shapes, strides, flags and knobs step after
step, and bwd.backward derives the same things every time: the variant, the launch plan, which
row-statistics and dq-conversion kernels run, the buffers' shapes and the main kernel's scalar
arguments. On the GPU machine that derivation was most of our ~0.24 ms of Python per backward call,
against ~0.47 ms of GPU work at 1k tokens (NOTES Experiment 162): a slow host moment then left the
GPU waiting. `run` keeps one LaunchRecord per everything the derivation reads (shapes and strides
of every tensor, dtype, device, mask flags, scale, softcap, every environment knob bwd reads) and
replays it; only the 16-byte alignment of the tensors' addresses is checked per call.

Dense calls only: no varlen, block mask, mods, seqused_k, deterministic mode or trace (those take
bwd.backward's general path, as does any call the record's derivation finds unusual: a dO that is
not TMA-ready, a row-statistics or conversion pass that would not take the tensors). The launch
sequence is the general path's: zeroed counters, the row-statistics pass (which zeroes the dQ
buffer), the main kernel, the conversion.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from torch_fa4 import env_vars
from torch_fa4.kernels.sm90 import bwd_dq_convert, bwd_prepare

_LOG2E = math.log2(math.e)


class LaunchRecord(NamedTuple):
    main: object  # the compiled main kernel
    row_statistics: object  # the compiled row-statistics pass (zeroing the dQ buffer too)
    convert: Optional[object]  # the compiled dq conversion (None: the kernel writes dq itself)
    stats_shape: tuple  # (2, B, Hq, rows): lse2 and dpsum in one buffer
    dq_acc_shape: tuple  # (B, Sq, Hq, D) fp32
    counter_shape: Optional[tuple]  # the persistent kernel's counters (None: not persistent)
    split_shape: Optional[tuple]  # the split tail's partial dK / dV (None: no split)
    split_counters: int  # the split tail's piece counters, after the counter block
    scalars: tuple  # the main kernel's arguments after its tensors
    scale: float


_NOT_RECORDED = object()  # a call shape whose backward takes the general path every time
_records: dict = {}
_RECORDS_MAX = 4096  # (one per shape; cleared past it, as bwd's other memos)
_env: Optional[env_vars.Snapshot] = None  # every knob the derivation reads (set with the first record)
_tma_view_fn = None  # bwd._tma_view (bwd imports this module: bound with the first record)


def run(call, dout, out, lse, dq, dk, dv, deterministic: bool) -> bool:
    """Launch the backward of `call` from its record and return True, or return False for
    bwd.backward's general path."""
    if call.is_varlen or call.block_mask or call.mods is not None or call.seqused_k is not None or deterministic:
        return False
    q, k, v = call.q, call.k, call.v
    if (q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr() | out.data_ptr() | lse.data_ptr()
            | dq.data_ptr() | dk.data_ptr() | dv.data_ptr()) % 16:
        return False
    memo = (q.dtype, q.device, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), dout.shape,
            dout.stride(), out.shape, out.stride(), lse.shape, lse.stride(), dq.stride(), dk.stride(), dv.stride(),
            dout.dtype, out.dtype, lse.dtype, dq.dtype,
            call.scale, call.causal, call.window_left, call.window_right, call.softcap,
            _env() if _env is not None else None)
    record = _records.get(memo)
    if record is None:
        record = _derive(call, dout, out, lse, dq, dk, dv)
        if _env is not None and memo[-1] is None:  # the first record built the snapshot
            memo = (*memo[:-1], _env())
        if len(_records) >= _RECORDS_MAX:
            _records.clear()
        _records[memo] = record
    if record is _NOT_RECORDED:
        return False
    _launch(record, q, k, v, dout, out, lse, dq, dk, dv)
    return True


def _launch(record: LaunchRecord, q, k, v, dout, out, lse, dq, dk, dv) -> None:
    _tma_view = _tma_view_fn
    device = q.device
    counter = split_ws = split_cnt = None
    if record.split_shape is not None:
        split_ws = torch.empty(record.split_shape, dtype=torch.float32, device=device)
    if record.counter_shape is not None:
        # one zeroed block before the row-statistics pass (the main kernel is its programmatic
        # dependent, with nothing in between): the tile counter(s), then the split tail's
        if split_ws is None:  # (one allocation in its own shape: each view costs host time)
            counter = torch.zeros(record.counter_shape, dtype=torch.int32, device=device)
        else:
            size = math.prod(record.counter_shape)
            counters = torch.zeros(size + record.split_counters, dtype=torch.int32, device=device)
            counter, split_cnt = counters[:size].view(record.counter_shape), counters[size:]
    dq_acc_rows = torch.empty(record.dq_acc_shape, dtype=torch.float32, device=device)
    stats = torch.empty(record.stats_shape, dtype=torch.float32, device=device)
    lse2, dpsum = stats.unbind(0)
    record.row_statistics(bwd_prepare._packed_size_one_strides(dout), bwd_prepare._packed_size_one_strides(out),
                          lse, lse2, dpsum, dq_acc_rows)
    dq_out = _tma_view(dq) if record.convert is None else None
    record.main(_tma_view(q), _tma_view(k), _tma_view(v), _tma_view(dout), lse2, dpsum, dq_acc_rows.transpose(1, 2),
                _tma_view(dk), _tma_view(dv), dq_out, None, None, None, counter, split_ws, split_cnt,
                None, None, None, None, *record.scalars)
    if record.convert is not None:
        record.convert(dq_acc_rows.view(-1), dq.view(-1), record.scale)


def _derive(call, dout, out, lse, dq, dk, dv):
    """The LaunchRecord of this call's shape, or _NOT_RECORDED where the general path must run:
    what bwd.backward would do, derived once."""
    global _env, _tma_view_fn
    from torch_fa4.kernels.sm90 import bwd

    if _env is None:
        _env, _tma_view_fn = env_vars.Snapshot(bwd.RECORD_ENV_KNOBS), bwd._tma_view
    plan = bwd.launch_plan(call, bwd.variant_key(call, False))
    key, tiles = plan.key, plan.key[-3]
    q = call.q
    if (tiles.trace or key[-2] is not None or not _on_gpu(dout) or not bwd._tma_compatible(dout)
            or bwd_prepare.unsupported_reason(dout, out, lse) is not None):
        return _NOT_RECORDED
    tile_m = tiles.tile_m
    dq_acc_shape = (q.shape[0], q.shape[1], call.num_heads, call.head_dim)
    # the pass zeroes the (fresh, contiguous, aligned) dQ buffer: bwd_prepare.dq_zeroing_takes
    if dout.shape[:3] != dq_acc_shape[:3] or call.head_dim % (bwd_prepare.ZERO_VEC * bwd_prepare.THREADS_PER_ROW):
        return _NOT_RECORDED
    convert = None
    if not tiles.fused_dq:
        numel = math.prod(dq_acc_shape)
        if not (dq.is_contiguous() and numel % bwd_dq_convert.VEC == 0 and 0 < numel <= bwd_dq_convert.MAX_ELEMENTS
                and dq.dtype in (torch.float16, torch.bfloat16)):
            return _NOT_RECORDED
        convert = bwd_dq_convert.compile_kernel(dq.dtype, pdl=tiles.pdl, reversed_order=plan.reversed_passes[1])
    elif not (dq.stride(-1) == 1 and all(s % 8 == 0 for s in dq.stride()[:-1])):
        return _NOT_RECORDED
    rows = math.ceil(q.shape[1] / tile_m) * tile_m
    row_statistics = bwd_prepare.compile_kernel(dout.dtype, dout.shape[-1], d_zero=call.head_dim,
                                                stat_tile=tile_m if tiles.permuted_stats else 0,
                                                reversed_order=plan.reversed_passes[0])
    counter_shape = split_shape = None
    split_counters = 0
    if tiles.split_tail:
        values = tiles.tile_n * (call.head_dim + call.head_dim_v) // 256
        split_shape = (max(plan.split_items * plan.ways, 1), values, 256)
    if tiles.persistent:
        counter_shape = ((call.batch, call.num_heads, 2 * math.ceil(q.shape[1] / tile_m) + 3) if tiles.fused_dq
                         else (1, 1, 1))
        split_counters = max(plan.split_items, 1) if split_shape is not None else 0
    right, left = bwd._window(call)
    scalars = (float(call.scale), float(call.scale * _LOG2E), float(call.softcap or 1.0), int(left or 0),
               int(right or 0), int(plan.max_k), plan.cta_group, plan.cta_tail, plan.ctas, plan.split_items,
               plan.ways, *[None] * bwd.MAX_AUX)
    return LaunchRecord(bwd.compile_variant(key), row_statistics, convert, (2, q.shape[0], call.num_heads, rows),
                        dq_acc_shape, counter_shape, split_shape, split_counters, scalars, float(call.scale))


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether the compiled passes can take t (the CPU tests stand emulated kernels in for them)."""
    return t.is_cuda
