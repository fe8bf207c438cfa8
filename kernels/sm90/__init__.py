"""Hopper (sm_90a) kernels: entry points per docs/INTERNALS.md.

The forward lives in fwd.py (kernel), fwd_config.py (its variant key) and fwd_host.py (variant
choice, compile cache, launch); the backward in bwd.py. Importing this package loads CuTe DSL; dispatch imports it on the first CUDA call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

    from torch_fa4.call import AttentionCall


def unsupported_reason(call: "AttentionCall") -> Optional[str]:
    from torch_fa4.kernels.sm90 import fwd_host

    return fwd_host.unsupported_reason(call)


def forward(call: "AttentionCall", out: "torch.Tensor", lse: "torch.Tensor") -> None:
    from torch_fa4.kernels.sm90 import fwd_host

    fwd_host.forward(call, out, lse)


def backward(call: "AttentionCall", dout, out, lse, dq, dk, dv, deterministic: bool) -> None:
    from torch_fa4.kernels.sm90 import bwd

    bwd.backward(call, dout, out, lse, dq, dk, dv, deterministic)
