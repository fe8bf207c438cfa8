"""Blackwell (sm_100a) kernels: entry points per docs/INTERNALS.md, compile-verified (no Blackwell
GPU has run them: benchmarks/NOTES.md, section "sm_100"). The forward is this package's
`forward`; the backward is `bwd.backward` (kernels/sm100/bwd.py), which refuses what it has not
compiled (mods, block masks, head dims above 128): those calls run on the next kernel family.
Importing this package does not load CuTe DSL.
"""

from torch_fa4.kernels.sm100 import fwd_host
from torch_fa4.kernels.sm100.fwd_host import forward, unsupported_reason  # noqa: F401


def variant(call, direction: str, deterministic: bool):
    """The compiled variant that runs `call` (what the first-use self-check verifies)."""
    if direction == "backward":
        from torch_fa4.kernels.sm100 import bwd

        return bwd.variant_key(call, deterministic)
    return fwd_host.default_config(call)
