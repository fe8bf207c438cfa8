"""What the GPU tests share: which device this is (their skip markers), spies that prove a kernel (not
the reference) ran, the NaN poisoning of a forward's outputs before each launch, a public call that
may not fall back, fresh random inputs, and the comparison of a directly launched forward against
float64 attention (tests/naive.py).

Imported as `gpu_harness` (pytest puts tests/gpu on sys.path for the test files in it; tests/conftest.py
puts tests/ there for `naive`). Nothing here touches CUDA beyond asking the device's capability.
"""

import warnings

import pytest
import torch

from naive import call_options, naive_varlen

HAS_CUDA = torch.cuda.is_available()
ON_SM90 = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
ON_SM100 = HAS_CUDA and torch.cuda.get_device_capability() == (10, 0)


def gpu_marks(runs_here: bool, reason: str):
    """A test module's pytestmark: marked `gpu`, and skipped (saying `reason`) where not `runs_here`."""
    return [pytest.mark.gpu, pytest.mark.skipif(not runs_here, reason=reason)]


SM90_ONLY = gpu_marks(ON_SM90, "needs a CUDA sm_90 device")
SM100_ONLY = gpu_marks(ON_SM100, "needs a CUDA sm_100 device")


def _direction_and_module(call, direction, module):
    return direction, None if module is None else module.__name__


def dispatch_spy(original, picked: list, entry=_direction_and_module):
    """A stand-in for dispatch.kernel_for that answers as `original` and appends
    entry(call, direction, module) (default: (direction, module name or None for the reference))
    to `picked`."""

    def spy(call, direction, **kw):
        module = original(call, direction, **kw)
        picked.append(entry(call, direction, module))
        return module

    return spy


def record_kernel_picks(monkeypatch, entry=_direction_and_module) -> list:
    """Patch dispatch.kernel_for with a dispatch_spy for the test; returns the list it fills."""
    from torch_fa4 import dispatch

    picked = []
    monkeypatch.setattr(dispatch, "kernel_for", dispatch_spy(dispatch.kernel_for, picked, entry))
    return picked


def poison_forward(monkeypatch, fwd_host, record=None) -> list:
    """Wrap fwd_host.forward for the test: every launch first fills out / lse with NaN (an element
    the kernel does not write then shows) and, given `record`, appends record(call, overrides) to
    the returned list (so a test knows which kernel variant ran, and that one did)."""
    seen = []
    real_forward = fwd_host.forward

    def poisoned_forward(call, out, lse, **overrides):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        if record is not None:
            seen.append(record(call, overrides))
        real_forward(call, out, lse, **overrides)

    monkeypatch.setattr(fwd_host, "forward", poisoned_forward)
    return seen


def default_variant(fwd_host):
    """A poison_forward `record`: the variant fwd_host picks for the call and its overrides."""
    return lambda call, overrides: fwd_host.default_config(call, **overrides)


def public(fn, *args, **kw):
    """Run a public API call; a fallback to the reference is an error, not a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch_fa4:.*falls back")
        out = fn(*args, **kw)
    torch.cuda.synchronize()
    return out


def random_qkv(B, Sq, Sk, H, Hkv, D, dtype=torch.bfloat16):
    """Fresh standard-normal q (B, Sq, H, D) and k, v (B, Sk, Hkv, D) on the GPU."""
    return (torch.randn(B, Sq, H, D, device="cuda", dtype=dtype),
            torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype),
            torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype))


def launch_poisoned(fwd_host, call, **overrides):
    """out, lse of fwd_host.forward(call) launched directly into NaN-filled buffers."""
    out = torch.full(call.out_shape(), float("nan"), dtype=call.q.dtype, device="cuda")
    lse = torch.full(call.lse_shape(), float("nan"), dtype=torch.float32, device="cuda")
    fwd_host.forward(call, out, lse, **overrides)
    torch.cuda.synchronize()
    return out, lse


def check_against_float64(call, out, lse, score_mod=None, mask_mod=None, empty_lse_exact=False):
    """The kernel's out / lse for `call` against float64 attention (tests/naive.py): no NaN, error at
    most twice eager attention's in the inputs' dtype, the same rows with a finite LSE and those
    within 2e-3; with `empty_lse_exact`, the others equal to the oracle's (-inf). Returns
    (error, eager error)."""
    assert not out.isnan().any(), "unwritten or NaN output"
    assert not lse.isnan().any(), "unwritten or NaN lse"
    opts = dict(call_options(call), score_mod=score_mod, mask_mod=mask_mod)
    ref_out, ref_lse = naive_varlen(call.q, call.k, call.v, **opts, device=call.q.device)
    eager_out, _ = naive_varlen(call.q, call.k, call.v, **opts, differentiable=True)  # in the inputs' dtype
    err = (out.double() - ref_out).abs().max().item()
    eager_err = (eager_out.double() - ref_out).abs().max().item()
    assert err <= 2 * eager_err + 1e-4, f"kernel err {err:.3e} vs eager {eager_err:.3e}"
    lse = lse.double()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse -inf pattern differs"
    if empty_lse_exact:
        assert torch.equal(lse[~finite], ref_lse[~finite])
    if finite.any():
        assert (lse[finite] - ref_lse[finite]).abs().max().item() < 2e-3
    return err, eager_err


def rel(x, ref):
    """Relative L2 error of x against ref (x must hold no NaN)."""
    assert not torch.isnan(x).any()
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def leaves(*ts):
    """Detached copies of ts that require grad."""
    return [t.detach().clone().requires_grad_() for t in ts]
