"""What a compiled kernel's launch says when handed CPU tensors: the call gets past the arity check
and stops at the device check, whose message lists the bound arguments. The compile tests read
that message to see that the host side binds every argument the kernel expects (a missing or extra
one would be a TypeError instead)."""

import pytest
import torch


def cpu_launch_error(fwd_host, call) -> str:
    """The ValueError text of fwd_host.forward(call) into fresh bf16 / fp32 CPU buffers; skips where
    the kernel callable is not initialised (compiled for another CUTE_DSL_ARCH than this host's)."""
    out = torch.empty(call.out_shape(), dtype=torch.bfloat16)
    lse = torch.empty(call.lse_shape())
    try:
        fwd_host.forward(call, out, lse)
    except ValueError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001
        if "not initialized" in str(e):  # compiled for sm_90a on a host whose CUTE_DSL_ARCH differs
            pytest.skip("kernel callable not initialised here; run with CUTE_DSL_ARCH=sm_90a")
        raise
    pytest.fail("a kernel launch with CPU tensors did not raise")
