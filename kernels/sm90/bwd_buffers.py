"""The backward's per-call buffers besides its outputs: their shapes, and their allocation.

Shared by bwd.backward's general path and bwd_launch_record's replays (which keep the shapes in
a record), so both allocate what the compiled kernel expects. Host-only: no CuTe DSL.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90.bwd_variant import LaunchPlan


def dq_buffer_shape(call: "AttentionCall") -> tuple:
    """The fp32 dQ buffer in dq's own (B, Sq, Hq, D) layout, unpadded (the kernel's TMA adds drop
    rows past the end); varlen: the (T, Hq, D) rows as one batch. Zeroed by the row-statistics
    pass; a varlen sequence's last query tile adds zeros (P = dS = 0 past its end) to the next
    sequence's first rows."""
    q = call.q
    return ((1, *q.shape[:2]) if call.is_varlen else tuple(q.shape[:3])) + (call.head_dim,)


def dq_buffer(shape: tuple, is_varlen: bool, device) -> tuple:
    """(a dQ buffer of dq_buffer_shape's `shape`, the kernel's (B, Hq, Sq, D) (varlen (Hq, T, D))
    view of it, so that the conversion to dq's dtype is one contiguous pass)."""
    rows = torch.empty(shape, dtype=torch.float32, device=device)
    return rows, (rows[0].transpose(0, 1) if is_varlen else rows.transpose(1, 2))


def persistent_shapes(call: "AttentionCall", plan: "LaunchPlan") -> tuple:
    """(split workspace, tile counter, split counters) of a launch of plan.key: every split
    piece's partial dK / dV (bwd_kernel `split_tail`); the persistent kernel's tile counter, with
    fused_dq after one dQ counter and one queue slot per query tile and the queue's head and tail
    (bwd_dq_fused); one piece counter per split tile. None / 0 where the variant has none."""
    key = plan.key
    split = counter = None
    if key.split_tail:
        values = key.tile_n * (call.head_dim + call.head_dim_v) // 256
        split = (max(plan.split_items * plan.ways, 1), values, 256)
    if key.persistent:
        counter = (1, 1, 1)
        if key.fused_dq:
            counter = (call.batch, call.num_heads, 2 * math.ceil(call.q.shape[1] / key.tile_m) + 3)
    return split, counter, max(plan.split_items, 1) if key.split_tail else 0


def persistent_buffers(shapes: tuple, device) -> tuple:
    """(tile counter, split workspace, split counters) of persistent_shapes' `shapes`, None where
    a shape is. The counters are zeroed in one buffer before the row-statistics pass (the main
    kernel is that pass's programmatic dependent); without split counters, in their own shape
    (each view costs host time on every call)."""
    split_shape, counter_shape, extra = shapes
    split_ws = counter = split_cnt = None
    if split_shape is not None:
        split_ws = torch.empty(split_shape, dtype=torch.float32, device=device)
    if counter_shape is not None:
        if not extra:
            counter = torch.zeros(counter_shape, dtype=torch.int32, device=device)
        else:
            size = math.prod(counter_shape)
            counters = torch.zeros(size + extra, dtype=torch.int32, device=device)
            counter, split_cnt = counters[:size].view(counter_shape), counters[size:]
    return counter, split_ws, split_cnt


def writes_dq_directly(dq: torch.Tensor) -> bool:
    """Whether a fused_dq variant can store into dq: unit last stride, 16-byte strides (the kernel
    stores 16-byte pieces; its base address is checked per call)."""
    return dq.stride(-1) == 1 and all(s % 8 == 0 for s in dq.stride()[:-1])
