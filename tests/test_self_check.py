"""CPU: the first-use self-check (torch_fa4/self_check.py) with stand-in kernels.

A stand-in kernel family computes with the reference (right) or spoils one output (wrong), so the
check's verdict, its warning, the small problem it builds and the verdicts kept on disk are tested
without a GPU. tests/gpu/test_self_check_gpu.py runs the same checks on the sm_90 kernels.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from _self_check_state import forget_verdicts
from torch_fa4 import reference, self_check
from torch_fa4.call import AttentionCall

BLACKWELL = (10, 0)


class StandIn:
    """A kernel family whose kernels are the reference, spoilt in `wrong` ("forward", "backward",
    "nan", "raise") and, with `noise`, off by that many epsilons (what a right kernel's rounding
    looks like)."""

    __name__ = "stand_in.sm100"

    def __init__(self, wrong=None, noise=0.0, named=True):
        self.wrong, self.noise, self.calls = wrong, noise, []
        if not named:
            self.variant = None

    def variant(self, call, direction, deterministic):
        # the variant depends on the features and on whether queries are long, as real ones do
        return (direction, call.causal, call.softcap > 0, call.head_dim, (call.max_seqlen_q or call.q.shape[-3]) > 512)

    def _spoil(self, t, direction):
        if self.noise:
            t.add_(torch.randn_like(t) * self.noise * torch.finfo(t.dtype).eps * t.float().std().to(t.dtype))
        if self.wrong == direction:
            t[..., :3, :].mul_(1.5)
        if self.wrong == "nan":
            t.view(-1)[0] = float("nan")
        if self.wrong == "raise":
            raise RuntimeError("launch failed")

    def forward(self, call, out, lse):
        self.calls.append(("forward", call))
        o, l = reference.forward(call)
        out.copy_(o)
        lse.copy_(l)
        self._spoil(out, "forward")

    def backward(self, call, dout, out, lse, dq, dk, dv, deterministic):
        self.calls.append(("backward", call))
        for t, g in zip((dq, dk, dv), reference.backward(call, dout, out, lse)):
            t.copy_(g)
        self._spoil(dq, "backward")


@pytest.fixture(autouse=True)
def fresh_verdicts(tmp_path, monkeypatch):
    forget_verdicts(monkeypatch, tmp_path)


def _call(B=3, S=1000, H=4, Hkv=2, D=64, dtype=torch.bfloat16, **kw):
    q = torch.randn(B, S, H, D, dtype=dtype)
    k = torch.randn(B, S, Hkv, D, dtype=dtype)
    return AttentionCall(q=q, k=k, v=torch.randn_like(k), scale=D ** -0.5, **kw)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_a_right_variant_is_checked_once_and_trusted(direction):
    kernel = StandIn(noise=1.0)
    call = _call(causal=True)
    assert self_check.trusted(kernel, kernel, call, direction, False, BLACKWELL)
    assert self_check.checks_run == 1 and [c[0] for c in kernel.calls] == [direction]
    assert self_check.trusted(kernel, kernel, call, direction, False, BLACKWELL)
    assert self_check.checks_run == 1, "a known verdict is not checked again"


@pytest.mark.parametrize("wrong", ["forward", "backward", "nan", "raise"])
def test_a_wrong_variant_is_refused_with_one_warning(wrong):
    kernel = StandIn(wrong=wrong)
    direction = "backward" if wrong == "backward" else "forward"
    call = _call(softcap=20.0)
    with pytest.warns(self_check.SelfCheckWarning) as record:
        assert not self_check.trusted(kernel, kernel, call, direction, False, BLACKWELL)
    message = str(record[0].message)
    assert "sm100" in message and direction in message and "cpu" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not self_check.trusted(kernel, kernel, call, direction, False, BLACKWELL)  # no second warning
    # a variant that differs in a feature is checked on its own, and passes where it is right
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other_direction = "forward" if wrong == "backward" else "backward"
        other = self_check.trusted(kernel, kernel, _call(), other_direction, False, BLACKWELL)
    assert other == (wrong not in ("nan", "raise"))


def test_verified_capability_and_the_setting(monkeypatch):
    kernel = StandIn(wrong="forward")
    assert self_check.trusted(kernel, kernel, _call(), "forward", False, (9, 0))  # verified: not checked
    assert self_check.checks_run == 0
    monkeypatch.setenv(self_check.ENV, "0")
    assert self_check.trusted(kernel, kernel, _call(), "forward", False, BLACKWELL)
    assert self_check.checks_run == 0
    monkeypatch.setenv(self_check.ENV, "1")
    with pytest.warns(self_check.SelfCheckWarning):
        assert not self_check.trusted(kernel, kernel, _call(), "forward", False, (9, 0))


def test_the_small_problem_keeps_the_features_and_the_variant():
    kernel = StandIn()
    cu = torch.tensor([0, 300, 1300, 1400], dtype=torch.int32)
    q = torch.randn(1400, 8, 128, dtype=torch.float16)
    k = torch.randn(1400, 2, 128, dtype=torch.float16)
    v = torch.randn(1400, 2, 64, dtype=torch.float16)
    call = AttentionCall(q=q, k=k, v=v, scale=0.1, causal=True, window_left=100, window_right=0,
                         softcap=5.0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1000, max_seqlen_k=1000,
                         seqused_k=torch.tensor([300, 900, 100], dtype=torch.int32))
    assert self_check.trusted(kernel, kernel, call, "forward", False, BLACKWELL)
    (_, small), = kernel.calls
    assert small.q.dtype == torch.float16 and small.q.shape[1:] == (4, 128) and small.k.shape[1:] == (1, 128)
    assert small.v.shape[-1] == 64 and small.is_varlen and small.batch == 2
    assert (small.causal, small.window_left, small.window_right, small.softcap) == (True, 100, 0, 5.0)
    assert small.max_seqlen_q == 700, "the smallest candidate that keeps queries longer than 512"
    assert small.seqused_k.tolist() == [300, 700]  # of the first and the longest sequence, clipped
    assert not torch.equal(small.q[:10], q[:10]), "fresh inputs"


def test_the_call_shape_is_used_when_no_smaller_one_has_the_variant():
    kernel = StandIn()
    kernel.variant = lambda call, direction, det: (call.batch, call.num_heads)  # needs B 3, H 4
    call = _call(S=200)
    assert self_check.trusted(kernel, kernel, call, "forward", False, BLACKWELL)
    (_, small), = kernel.calls
    assert small.q.shape == call.q.shape and small.k.shape == call.k.shape


def test_a_family_without_variant_names_is_checked_per_feature_set():
    kernel = StandIn(named=False)
    assert self_check.trusted(kernel, kernel, _call(), "forward", False, BLACKWELL)
    assert self_check.trusted(kernel, kernel, _call(B=1, S=64), "forward", False, BLACKWELL)
    assert self_check.checks_run == 1
    assert self_check.trusted(kernel, kernel, _call(causal=True), "forward", False, BLACKWELL)
    assert self_check.checks_run == 2


def test_a_mask_mod_with_a_block_mask_gets_a_block_mask_of_the_small_shape():
    from torch_fa4 import mods
    from torch_fa4.mods.prepare import prepare
    from torch_fa4.mods.registry import lookup

    doc = torch.arange(2048) // 300

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    bm = mods.create_block_mask(mask_mod, None, None, 2048, 2048, device="cpu")
    key, aux = prepare(None, mask_mod)
    call = _call(B=1, S=2048, H=2, Hkv=1, mod_key=key, mods=lookup(key), aux_tensors=tuple(aux),
                 block_mask=tuple(bm.as_tensors()))
    kernel = StandIn()
    assert self_check.trusted(kernel, kernel, call, "forward", False, BLACKWELL)
    (_, small), = kernel.calls
    want = mods.create_block_mask(mask_mod, None, None, small.q.shape[1], small.k.shape[1], device="cpu")
    for got, expected in zip(small.block_mask, want.as_tensors()):
        assert torch.equal(got, expected)


def test_verdicts_persist_across_processes(tmp_path):
    script = textwrap.dedent(f"""
        import sys, warnings, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_self_check import StandIn, _call, BLACKWELL
        from torch_fa4 import self_check
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            wrong, right = StandIn(wrong="forward"), StandIn()
            ok = self_check.trusted(wrong, wrong, _call(softcap=3.0), "forward", False, BLACKWELL)
            good = self_check.trusted(right, right, _call(), "forward", False, BLACKWELL)
        print(ok, good, self_check.checks_run, sum(issubclass(x.category, self_check.SelfCheckWarning) for x in w))
    """)
    env = {**os.environ, "TORCH_FA4_CACHE_DIR": str(tmp_path)}
    env.pop(self_check.ENV, None)
    run = lambda: subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                 check=True).stdout.split()
    assert run() == ["False", "True", "2", "1"]
    assert run() == ["False", "True", "0", "1"], "the second process reads both verdicts from disk"
    assert len(list((tmp_path / "self_check").glob("*.json"))) == 2


@pytest.mark.parametrize("features", [
    dict(D=64), dict(D=96, causal=True), dict(D=128, dtype=torch.float16, window_size=(64, 0)),
    dict(D=128, softcap=10.0, Hkv=1), dict(D=64, varlen=True, causal=True), dict(D=128, seqused=True),
])
def test_dispatch_on_a_faked_blackwell_runs_the_sm100_forward_after_its_check(monkeypatch, features):
    """With compute capability 10.0 faked, a call reaches the sm100 forward, whose variant is first
    checked (a launch on a small problem) and then launched on the call; the sm100 forward is
    stood in by the reference, since nothing launches on a CPU."""
    import torch_fa4
    from torch_fa4 import dispatch
    from torch_fa4.kernels import sm100
    from torch_fa4.kernels.sm100 import pair  # noqa: F401  (sm100.pair, below)

    launches = []

    def stand_in(call, out, lse):
        launches.append(call)
        o, l = reference.forward(call)
        out.copy_(o)
        lse.copy_(l)

    monkeypatch.setattr(dispatch, "on_gpu", lambda call: True)
    monkeypatch.setattr(dispatch, "capability", lambda device: BLACKWELL)
    monkeypatch.setattr(sm100, "forward", stand_in)
    monkeypatch.setattr(sm100.pair, "forward", stand_in)  # (the two-CTA forward takes D=128 non-causal)
    f = dict(features)
    D, dtype, Hkv = f.pop("D"), f.pop("dtype", torch.bfloat16), f.pop("Hkv", 2)
    kw = {}
    if f.pop("varlen", False):
        q = torch.randn(900, 4, D, dtype=dtype)
        k, v = (torch.randn(900, Hkv, D, dtype=dtype) for _ in range(2))
        cu = torch.tensor([0, 200, 900], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=700, max_seqlen_k=700)
    else:
        q = torch.randn(2, 600, 4, D, dtype=dtype)
        k, v = (torch.randn(2, 600, Hkv, D, dtype=dtype) for _ in range(2))
    if f.pop("seqused", False):
        kw["seqused_k"] = torch.tensor([600, 17], dtype=torch.int32)
    out = torch_fa4.attention(q, k, v, **f, **kw)
    assert len(launches) == 2 and self_check.checks_run == 1, "one check, then the call's own launch"
    check, real = launches
    assert real.q is q and check.q is not q and check.q.shape[-1] == D and check.q.dtype == dtype
    assert (check.causal, check.softcap, check.window_left) == (real.causal, real.softcap, real.window_left)
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), **f, **kw)  # float64: the reference
    assert (out.double() - ref).abs().max() < 0.05
    torch_fa4.attention(q, k, v, **f, **kw)
    assert len(launches) == 3 and self_check.checks_run == 1, "a checked variant launches directly"
