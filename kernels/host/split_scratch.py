"""Scratch memory of the forward's split-tail launches, kept per device and stream.

A split launch's pieces store their states in a workspace that the same launch reads back, and
count themselves in int32 counters that are zero at launch; the last piece of each item sets its
counter back to zero (common/split_tail.py), so a launch leaves the counters as it found them.
Launches on one stream run one after another, so they can share both: a decode step then neither
allocates nor fills anything for its split. Each stream has its own. A stream that is being
captured into a CUDA graph gets fresh buffers, which the graph keeps: its replays may run on any
stream, beside eager launches.
"""

from __future__ import annotations

import torch

_MIN_COUNTERS = 1024
_MAX_WORKSPACES = 64  # a bound for programs that meet ever-new shapes, not an eviction policy
_counters: dict[tuple[int, int], torch.Tensor] = {}  # (device index, stream handle) -> zeroed int32
_workspaces: dict[tuple, torch.Tensor] = {}  # (device index, stream handle, shape) -> float32


def _stream_key(device: torch.device):
    """(device index, stream handle) of the current stream, or None where buffers are not kept (a
    CPU tensor's argument checks, a stream being captured)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    stream = torch.cuda.current_stream(device)
    return stream.device_index, stream.cuda_stream


def counters(count: int, device: torch.device, stream_key) -> torch.Tensor:
    """At least `count` int32 counters, zero now and after every launch that uses them."""
    if stream_key is None:
        return torch.zeros(count, dtype=torch.int32, device=device)
    found = _counters.get(stream_key)
    if found is None or found.numel() < count:
        size = max(_MIN_COUNTERS, 1 << (count - 1).bit_length())
        found = _counters[stream_key] = torch.zeros(size, dtype=torch.int32, device=device)
    return found


def workspace(shape: tuple, device: torch.device, stream_key) -> torch.Tensor:
    """A float32 tensor of `shape` for the pieces' states (written before it is read)."""
    if stream_key is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    key = (*stream_key, shape)
    found = _workspaces.get(key)
    if found is None:
        if len(_workspaces) >= _MAX_WORKSPACES:
            _workspaces.clear()
        found = _workspaces[key] = torch.empty(shape, dtype=torch.float32, device=device)
    return found


def buffers(shape: tuple, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace of `shape`, at least `count` zeroed counters) for one launch on the current stream."""
    key = _stream_key(device)
    return workspace(shape, device, key), counters(count, device, key)
