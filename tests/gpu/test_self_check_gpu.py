"""GPU: the first-use self-check on the sm_90 kernels, with sm_90 declared unverified.

Through the public API: a right variant is checked once (forward and backward) and then runs on
its kernel; a deliberately wrong kernel is caught, the call still returns the right answer, and
the verdict is read back by a new process, which then runs no check.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import torch_fa4
from _self_check_state import forget_verdicts
from gpu_harness import SM90_ONLY
from naive import naive_attention, rel_error
from torch_fa4 import self_check

pytestmark = SM90_ONLY


@pytest.fixture(autouse=True)
def unverified(tmp_path, monkeypatch):
    forget_verdicts(monkeypatch, tmp_path)
    monkeypatch.setattr(self_check, "VERIFIED", frozenset())


def _inputs(B=2, S=777, H=8, Hkv=2, D=128):
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def _check_against_float64(q, k, v, **kw):
    """Forward and backward of torch_fa4.attention against float64: each within twice the error
    of eager attention in bf16 (naive_attention run in the inputs' dtype)."""
    out = torch_fa4.attention(q, k, v, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_kw = dict(causal=kw.get("causal", False), softcap=kw.get("softcap", 0.0), differentiable=True)
    leaves = lambda dtype: [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves(torch.float64)
    ref, _ = naive_attention(q64, k64, v64, **ref_kw)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    qb, kb, vb = leaves(torch.bfloat16)
    low, _ = naive_attention(qb, kb, vb, **ref_kw)
    low_grads = torch.autograd.grad(low, (qb, kb, vb), dout)
    assert rel_error(out, ref) <= 2 * rel_error(low, ref)
    for g, r, lg in zip(grads, ref_grads, low_grads):
        assert rel_error(g, r) <= 2 * rel_error(lg, r)


def _corrupt_forward_with_softcap(monkeypatch):
    from torch_fa4.kernels.sm90 import fwd_host

    real = fwd_host.forward

    def wrong(call, out, lse, **kw):
        real(call, out, lse, **kw)
        if call.softcap:
            out.mul_(1.25)

    monkeypatch.setattr(fwd_host, "forward", wrong)


def test_right_variants_are_checked_once_then_run_on_their_kernels():
    q, k, v = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", self_check.SelfCheckWarning)
        _check_against_float64(q, k, v, causal=True)
        assert self_check.checks_run == 2  # the forward's variant and the backward's
        _check_against_float64(q, k, v, causal=True)
    assert self_check.checks_run == 2
    assert all(self_check._verdicts.values()) and len(self_check._verdicts) == 2


def test_a_wrong_forward_is_caught_and_the_call_is_still_right(monkeypatch):
    _corrupt_forward_with_softcap(monkeypatch)
    q, k, v = _inputs()
    with pytest.warns(self_check.SelfCheckWarning, match="sm90 forward variant .* gave wrong results"):
        _check_against_float64(q, k, v, softcap=20.0)
    _check_against_float64(q, k, v, softcap=20.0)  # later calls: the reference, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error", self_check.SelfCheckWarning)
        _check_against_float64(q, k, v)  # without softcap: another variant, which passes


def test_a_wrong_backward_is_caught_and_the_gradients_are_still_right(monkeypatch):
    from torch_fa4.kernels.sm90 import bwd

    real = bwd.backward

    def wrong(call, dout, out, lse, dq, dk, dv, deterministic, **kw):
        real(call, dout, out, lse, dq, dk, dv, deterministic, **kw)
        dk[:, :5].zero_()

    monkeypatch.setattr(bwd, "backward", wrong)
    q, k, v = _inputs(S=300, D=64)
    with pytest.warns(self_check.SelfCheckWarning, match="sm90 backward variant"):
        _check_against_float64(q, k, v, causal=True)


def test_the_verdict_persists_across_processes(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time, warnings, torch
        sys.path[:0] = [{os.path.dirname(__file__)!r}, {os.path.dirname(os.path.dirname(__file__))!r}]
        import pytest
        import torch_fa4
        from torch_fa4 import self_check
        from naive import naive_attention, rel_error
        import test_self_check_gpu as t
        self_check.VERIFIED = frozenset()
        mp = pytest.MonkeyPatch()
        t._corrupt_forward_with_softcap(mp)
        q, k, v = (x.detach() for x in t._inputs())
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = torch_fa4.attention(q, k, v, softcap=20.0)
        ref, _ = naive_attention(q.double(), k.double(), v.double(), softcap=20.0)
        warned = sum(issubclass(x.category, self_check.SelfCheckWarning) for x in w)
        print(self_check.checks_run, warned, rel_error(out, ref) < 1e-2)
    """)
    env = {**os.environ, "TORCH_FA4_CACHE_DIR": str(tmp_path)}
    env.pop(self_check.ENV, None)
    run = lambda: subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                 check=True).stdout.split()[-3:]
    assert run() == ["1", "1", "True"]
    assert run() == ["0", "1", "True"], "the second process takes the stored verdict and checks nothing"
