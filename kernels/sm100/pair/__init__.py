"""Blackwell (sm_100a) kernels in which a cluster of two CTAs shares each matmul (tcgen05
cta_group::2): entry points per docs/INTERNALS.md, compile-verified only. The forward is this
package's `forward` (kernels/sm100/pair/fwd_host.py); a backward, where there is one, is `bwd`.

The dispatcher tries this family before the one-CTA sm100 family, which takes every call refused
here: `QUIET_REFUSALS` tells it not to warn about those refusals. Importing this package does not
load CuTe DSL.
"""

from torch_fa4.kernels.sm100.pair import fwd_host
from torch_fa4.kernels.sm100.pair.fwd_host import forward, unsupported_reason  # noqa: F401

# a refusal here is no fallback to anything slower: the next family (kernels/sm100) runs the call
QUIET_REFUSALS = True


def variant(call, direction: str, deterministic: bool):
    """The compiled variant that runs `call` (what the first-use self-check verifies)."""
    if direction == "backward":
        from torch_fa4.kernels.sm100.pair import bwd

        return bwd.variant_key(call, deterministic)
    return fwd_host.default_config(call)
