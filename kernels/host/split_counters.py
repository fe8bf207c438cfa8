"""Zeroed piece counters for the forward's split-tail launches, one buffer per device and stream.

A split launch's pieces count themselves in int32 counters that are zero at launch, and the last
piece of each item sets its counter back to zero (common/split_tail.py): a launch leaves the
buffer as it found it. Launches on one stream run one after another, so they share one buffer
(a decode step then neither allocates nor fills counters); each stream has its own. A stream that
is being captured into a CUDA graph gets a fresh zeroed buffer, which the graph keeps: its replays
may run on any stream, beside eager launches.
"""

from __future__ import annotations

import torch

_MIN_COUNTERS = 1024
_buffers: dict[tuple[int, int], torch.Tensor] = {}  # (device index, stream handle) -> zeroed int32


def zeroed(count: int, device: torch.device) -> torch.Tensor:
    """At least `count` int32 counters, zero now and after every launch that uses them."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():  # (CPU: argument checks)
        return torch.zeros(count, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device)
    key = (stream.device_index, stream.cuda_stream)
    found = _buffers.get(key)
    if found is None or found.numel() < count:
        size = max(_MIN_COUNTERS, 1 << (count - 1).bit_length())
        found = _buffers[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return found
