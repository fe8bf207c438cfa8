"""Blackwell (sm_100a) kernels: entry points per docs/INTERNALS.md (forward only, compile-verified:
benchmarks/NOTES.md, section "sm_100"; without a `bwd` module dispatch runs the reference
backward). Importing this package does not load CuTe DSL.
"""

from torch_fa4.kernels.sm100 import fwd_host
from torch_fa4.kernels.sm100.fwd_host import forward, unsupported_reason  # noqa: F401


def variant(call, direction: str, deterministic: bool):
    """The compiled variant that runs `call` (what the first-use self-check verifies)."""
    return fwd_host.default_config(call)
