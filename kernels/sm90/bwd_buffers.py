"""The backward's per-call buffers besides its outputs: their shapes, and the counters' zeroing.

Shared by bwd.backward's general path and bwd_launch_record's replays (which keep the shapes in
a record), so both allocate what the compiled kernel expects. Host-only: no CuTe DSL.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90.bwd_config import BwdConfig


def split_workspace_shape(call: "AttentionCall", tiles: BwdConfig, split_items: int, ways: int) -> tuple:
    """Every split piece's partial dK / dV, stored before it is read (bwd_kernel `split_tail`)."""
    values = tiles.tile_n * (call.head_dim + call.head_dim_v) // 256
    return (max(split_items * ways, 1), values, 256)


def counter_shape(call: "AttentionCall", tiles: BwdConfig) -> tuple:
    """The persistent kernel's tile counter, and with fused_dq before it one dQ counter and one
    queue slot per query tile, then the queue's head and tail (bwd_dq_fused)."""
    if not tiles.fused_dq:
        return (1, 1, 1)
    return (call.batch, call.num_heads, 2 * math.ceil(call.q.shape[1] / tiles.tile_m) + 3)


def split_counters(tiles: BwdConfig, split_items: int) -> int:
    """The split tail's piece counters, one per split tile, after counter_shape's block."""
    return max(split_items, 1) if tiles.split_tail else 0


def zeroed_counters(shape: tuple, extra: int, device) -> tuple:
    """(counter of `shape`, `extra` split counters or None), zeroed in one buffer before the
    row-statistics pass: the main kernel launches as that pass's programmatic dependent, with
    nothing in between. (Without split counters, one allocation in its own shape: each view costs
    host time on every call.)"""
    if not extra:
        return torch.zeros(shape, dtype=torch.int32, device=device), None
    size = math.prod(shape)
    counters = torch.zeros(size + extra, dtype=torch.int32, device=device)
    return counters[:size].view(shape), counters[size:]


def writes_dq_directly(dq: torch.Tensor) -> bool:
    """Whether a fused_dq variant can store into dq: unit last stride, 16-byte strides (the kernel
    stores 16-byte pieces; its base address is checked per call)."""
    return dq.stride(-1) == 1 and all(s % 8 == 0 for s in dq.stride()[:-1])
