"""Checks the forward compile tests make of a kernel family's host module (fwd_host) without a GPU.

- What a compiled kernel's launch says when handed CPU tensors: the call gets past the arity check
  and stops at the device check, whose message lists the bound arguments, so the tests can read
  that the host side binds every argument the kernel expects (a missing or extra one would be a
  TypeError instead).
- That a variant compiles once: other calls of the same variant reuse its kernel.
"""

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


def check_variant_reuse(fwd_host, call, D):
    """fwd_host compiles call's variant once: a different call of the same variant (other shapes,
    GQA; head dim D) maps to the same config and kernel, and adds no compile-cache entry."""
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels import compile_cache

    cfg = fwd_host.default_config(call)
    first = fwd_host.compile_fwd(cfg)
    entries = compile_cache.stats()["entries"]
    cfg2 = fwd_host.default_config(AttentionCall(
        q=torch.empty(3, 100, 8, D, dtype=torch.bfloat16), k=torch.empty(3, 7, 2, D, dtype=torch.bfloat16),
        v=torch.empty(3, 7, 2, D, dtype=torch.bfloat16), scale=0.3))
    assert cfg2 == cfg
    assert fwd_host.compile_fwd(cfg2) is first
    assert compile_cache.stats()["entries"] == entries


def mod_variant_config(fwd_host, call):
    """fwd_host's config for a call with mods, which it must take: the config carries the call's mod
    key, one spec per captured tensor, and block sparsity exactly when the call has a block mask."""
    assert fwd_host.unsupported_reason(call) is None, fwd_host.unsupported_reason(call)
    cfg = fwd_host.default_config(call)
    assert cfg.mod_key == call.mod_key and len(cfg.aux_specs) == len(call.aux_tensors)
    assert cfg.block_sparse == bool(call.block_mask)
    return cfg
