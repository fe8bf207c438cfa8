"""Blackwell (sm_100a) kernels: entry points per docs/INTERNALS.md (forward only, compile-verified:
benchmarks/NOTES.md, section "sm_100"; without a `bwd` module dispatch runs the reference
backward). Importing this package does not load CuTe DSL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

    from torch_fa4.call import AttentionCall


def unsupported_reason(call: "AttentionCall") -> Optional[str]:
    from torch_fa4.kernels.sm100 import fwd_host

    return fwd_host.unsupported_reason(call)


def forward(call: "AttentionCall", out: "torch.Tensor", lse: "torch.Tensor") -> None:
    from torch_fa4.kernels.sm100 import fwd_host

    fwd_host.forward(call, out, lse)


def variant(call: "AttentionCall", direction: str, deterministic: bool):
    """The compiled variant that runs `call` (what the first-use self-check verifies)."""
    from torch_fa4.kernels.sm100 import fwd_host

    return fwd_host.default_config(call)
