"""The backward's repeated calls: a launch record per shape, so a repeated call only allocates
its buffers and launches its kernels.

bwd.backward derives the same things on every call of a shape: the variant, the launch plan, the
row-statistics and dq-conversion kernels, the buffers' shapes and the main kernel's scalars (most
of its host time, NOTES Experiment 162). `run` keeps one LaunchRecord per everything that
derivation reads (shapes and strides of every tensor, dtypes, device, mask flags, scale, softcap)
and replays it; only the tensors' 16-byte alignment is checked per call.

Dense calls and packed varlen batches (both sides packed, max_seqlen_q given; keyed on the
offsets' shapes and the given maxima, each call moving its row statistics to its own sequences'
offsets). Block masks, mods, seqused_k, deterministic mode, per-sequence launches and anything the
derivation finds unusual take bwd.backward's general path. The launch sequence is the general
path's: zeroed counters, the row-statistics pass (zeroing the dQ buffer), the main kernel, the
conversion.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from torch_fa4.kernels.host import shape_memo
from torch_fa4.kernels.sm90 import bwd_buffers, bwd_dq_convert, bwd_prepare


class LaunchRecord(NamedTuple):
    main: object  # the compiled main kernel
    row_statistics: object  # the compiled row-statistics pass (zeroing the dQ buffer too)
    convert: Optional[object]  # the compiled dq conversion (None: the kernel writes dq itself)
    stats_shape: tuple  # (2, B, Hq, rows) / varlen (2, Hq, rows): lse2 and dpsum in one buffer
    dq_acc_shape: tuple  # (B, Sq, Hq, D) / varlen (1, T, Hq, D) fp32
    persistent_shapes: tuple  # bwd_buffers.persistent_shapes
    scalars: tuple  # the main kernel's arguments after its tensors
    scale: float
    stat_tile: int  # varlen: the query tile the statistics' per-sequence offsets align to (else 0)


_NOT_RECORDED = shape_memo.NOT_RECORDED
_records = shape_memo.table()
_tma_view = bwd_prepare._packed_size_one_strides  # (bwd._tma_view)


def run(call, dout, out, lse, dq, dk, dv, deterministic: bool, tuning) -> bool:
    """Launch the backward of `call` from its record and return True, or return False for
    bwd.backward's general path. `tuning`: bwd_variant.BwdTuning (part of the record's key)."""
    if call.block_mask or call.mods is not None or call.seqused_k is not None or deterministic:
        return False
    packed = None
    if call.is_varlen:
        cu_q, cu_k = call.cu_seqlens_q, call.cu_seqlens_k
        if cu_k is None or not call.max_seqlen_q:
            return False  # per-sequence launches, or a longest sequence read from the offsets
        packed = (cu_q.shape, cu_q.dtype, cu_q.stride(), cu_k.shape, cu_k.dtype, cu_k.stride(),
                  call.max_seqlen_q, call.max_seqlen_k)
    q, k, v = call.q, call.k, call.v
    if (q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr() | out.data_ptr() | lse.data_ptr()
            | dq.data_ptr() | dk.data_ptr() | dv.data_ptr()) % 16:
        return False
    memo = (q.dtype, q.device, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), dout.shape,
            dout.stride(), out.shape, out.stride(), lse.shape, lse.stride(), dq.stride(), dk.stride(), dv.stride(),
            dout.dtype, out.dtype, lse.dtype, dq.dtype,
            call.scale, call.causal, call.window_left, call.window_right, call.softcap, packed, tuning)
    record = shape_memo.lookup(_records, memo, lambda: _derive(call, dout, out, lse, dq, dk, dv, tuning))
    if record is _NOT_RECORDED:
        return False
    _launch(record, call, dout, out, lse, dq, dk, dv)
    return True


def _launch(record: LaunchRecord, call, dout, out, lse, dq, dk, dv) -> None:
    device = call.q.device
    cu_q = cu_k = None
    counter, split_ws, split_cnt = bwd_buffers.persistent_buffers(record.persistent_shapes, device)
    dq_acc_rows, dq_acc = bwd_buffers.dq_buffer(record.dq_acc_shape, call.is_varlen, device)
    stats = torch.empty(record.stats_shape, dtype=torch.float32, device=device)
    lse2, dpsum = stats.unbind(0)
    bwd_prepare.launch(record.row_statistics, dout, out, lse, lse2, dpsum, dq_acc_rows)
    if record.stat_tile:  # a packed batch: its statistics at its sequences' offsets, the dQ buffer (Hq, T, D)
        from torch_fa4.kernels.sm90.bwd_row_stats import varlen_stat_layout

        lse2, dpsum = varlen_stat_layout(call, stats, record.stat_tile)
        cu_q, cu_k = call.cu_seqlens_q, call.cu_seqlens_k
    dq_out = _tma_view(dq) if record.convert is None else None
    record.main(_tma_view(call.q), _tma_view(call.k), _tma_view(call.v), _tma_view(dout), lse2, dpsum, dq_acc,
                _tma_view(dk), _tma_view(dv), dq_out, cu_q, cu_k, None, counter, split_ws, split_cnt,
                None, None, None, None, *record.scalars)
    if record.convert is not None:
        record.convert(dq_acc_rows.view(-1), dq.view(-1), record.scale)


def _derive(call, dout, out, lse, dq, dk, dv, tuning):
    """The LaunchRecord of this call's shape (what bwd.backward would do, with its own functions
    and checks), or _NOT_RECORDED where the general path must run."""
    from torch_fa4.kernels.sm90 import bwd
    from torch_fa4.kernels.sm90.bwd_row_stats import stat_rows

    if bwd.runs_per_sequence(call, False, tuning):
        return _NOT_RECORDED
    plan = bwd.launch_plan(call, bwd.variant_key(call, False), tuning)
    key = plan.key
    if (key.sparse is not None or not _on_gpu(dout) or not bwd.tma_compatible(dout)
            or bwd_prepare.unsupported_reason(dout, out, lse) is not None):
        return _NOT_RECORDED
    if call.is_varlen and not all(cu.dtype == torch.int32 and cu.is_contiguous()
                                  for cu in (call.cu_seqlens_q, call.cu_seqlens_k)):
        return _NOT_RECORDED  # (the general path converts them per call)
    # the dQ buffer every call allocates (bwd.backward's), once here for the passes' checks
    dq_acc_shape = bwd_buffers.dq_buffer_shape(call)
    dq_acc = torch.empty(dq_acc_shape, dtype=torch.float32, device=call.q.device)
    if not bwd_prepare.dq_zeroing_takes(dq_acc, dout):
        return _NOT_RECORDED
    convert = None
    if not key.fused_dq:
        if not bwd_dq_convert.takes(dq_acc, dq):
            return _NOT_RECORDED
        convert = bwd_dq_convert.compile_kernel(dq.dtype)
    elif not bwd_buffers.writes_dq_directly(dq):
        return _NOT_RECORDED
    tile_m = key.tile_m
    row_statistics = bwd_prepare.compile_kernel(dout.dtype, dout.shape[-1], d_zero=call.head_dim)
    scalars = (*bwd.main_scalars(call, plan), *[None] * (bwd.MAX_AUX + bwd.MAX_CAPTURE_GRADS))  # (no mods)
    stats_shape = (2, *lse.shape[:-1], stat_rows(call, tile_m))
    return LaunchRecord(bwd.compile_variant(key), row_statistics, convert, stats_shape, dq_acc_shape,
                        bwd_buffers.persistent_shapes(call, plan), scalars, float(call.scale),
                        tile_m if call.is_varlen else 0)


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether the compiled passes can take t (the CPU tests stand emulated kernels in for them)."""
    return t.is_cuda
