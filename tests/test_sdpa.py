"""SDPA routing on CPU: the registry entry, enable/disable, the routing decision, and torch_fa4's
kernels wired into aten's SDPA flash op (installed on the CPU dispatch key for the test) through the
real dispatcher, autograd formula and torch.compile."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from naive import naive_attention
from torch_fa4 import sdpa


@pytest.fixture
def registry_restored():
    """Whatever a test enables, leave torch's flash provider as it was."""
    import torch.nn.attention as attention

    before = attention.current_flash_attention_impl()
    yield
    if attention.current_flash_attention_impl() != before:
        if before is None:
            attention.restore_flash_attention_impl()
        else:
            attention.activate_flash_attention_impl(before)


def test_registry_lists_torch_fa4_without_activating_it(registry_restored):
    import torch.nn.attention as attention

    sdpa.register()
    assert sdpa.SDPA_IMPL_NAME in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() != sdpa.SDPA_IMPL_NAME
    assert not sdpa.is_enabled()


def test_enable_disable_through_torch_registry(registry_restored):
    import torch.nn.attention as attention

    sdpa.enable()
    assert sdpa.is_enabled() and attention.current_flash_attention_impl() == "torch_fa4"
    sdpa.enable()  # idempotent: re-activation replaces, never stacks, the kernels
    assert sdpa.is_enabled()
    sdpa.disable()
    assert not sdpa.is_enabled() and attention.current_flash_attention_impl() is None
    sdpa.disable()  # disabling twice is harmless
    attention.activate_flash_attention_impl("torch_fa4")  # torch's own switch works as well
    assert sdpa.is_enabled()
    attention.restore_flash_attention_impl()
    assert not sdpa.is_enabled()


def test_enabled_context_restores_state(registry_restored):
    assert not sdpa.is_enabled()
    with sdpa.enabled():
        assert sdpa.is_enabled()
    assert not sdpa.is_enabled()


def _sdpa_run(q, k, v, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    out.backward(torch.ones_like(out) * 0.5 + torch.arange(out.shape[-1], dtype=out.dtype) / 7)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_enabling_changes_nothing_on_cpu(registry_restored, dtype):
    q = torch.randn(2, 4, 9, 16, dtype=dtype)
    k = torch.randn(2, 2, 9, 16, dtype=dtype)
    v = torch.randn(2, 2, 9, 16, dtype=dtype)
    cases = [dict(is_causal=True, enable_gqa=True), dict(scale=0.3, enable_gqa=True), dict(dropout_p=0.0, enable_gqa=True)]
    before = [_sdpa_run(q, k, v, **kw) for kw in cases]
    with sdpa.enabled():
        after = [_sdpa_run(q, k, v, **kw) for kw in cases]
    for b, a in zip(before, after):
        for x, y in zip(b, a):
            assert not torch.isnan(y).any()
            assert torch.equal(x, y)  # bitwise: the CPU path is untouched


def test_env_var_opt_in_only():
    code = "import torch.nn.attention as a; from torch_fa4 import sdpa; sdpa.setup_on_import(); " \
           "print(a.current_flash_attention_impl(), 'torch_fa4' in a.list_flash_attention_impls())"
    env = {k: v for k, v in os.environ.items() if k != sdpa.ENV_VAR}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert plain.stdout.split() == ["None", "True"]
    opted = subprocess.run([sys.executable, "-c", code], env={**env, sdpa.ENV_VAR: "1"}, capture_output=True,
                           text=True, check=True)
    assert opted.stdout.split() == ["torch_fa4", "True"]
    assert sdpa.env_requests_enable({sdpa.ENV_VAR: "true"}) and not sdpa.env_requests_enable({sdpa.ENV_VAR: "0"})


# ---------------------------------------------------------------------------------------------
# Routing decision
# ---------------------------------------------------------------------------------------------


def _bhsd(b=2, h=4, s=32, d=64, dtype=torch.bfloat16):
    return torch.randn(b, s, h, d, dtype=dtype).transpose(1, 2)  # SDPA's usual view of (B, S, H, D)


def test_input_reason_accepts_what_the_kernels_take():
    assert sdpa.input_reason(_bhsd(), _bhsd(), _bhsd()) is None
    assert sdpa.input_reason(_bhsd(h=8), _bhsd(h=2), _bhsd(h=2)) is None  # GQA
    assert sdpa.input_reason(_bhsd(dtype=torch.float16, d=128), _bhsd(dtype=torch.float16, s=7, d=128),
                             _bhsd(dtype=torch.float16, s=7, d=128)) is None  # Sq != Sk
    assert sdpa.input_reason(_bhsd(d=256), _bhsd(d=256), _bhsd(d=256)) is None


@pytest.mark.parametrize("case,expect", [
    ("dropout", "dropout"),
    ("debug_mask", "return_debug_mask"),
    ("fp32", "dtype"),
    ("mixed_dtype", "dtype"),
    ("head_dim_odd", "head dim"),
    ("head_dim_big", "head dim"),
    ("gqa_ratio", "multiple"),
    ("strided_head_dim", "contiguous"),
    ("three_d", "4-D"),
])
def test_input_reason_rejects(case, expect):
    q, k, v = _bhsd(), _bhsd(), _bhsd()
    kw = {}
    if case == "dropout":
        kw["dropout_p"] = 0.1
    elif case == "debug_mask":
        kw["return_debug_mask"] = True
    elif case == "fp32":
        q, k, v = (t.float() for t in (q, k, v))
    elif case == "mixed_dtype":
        k = k.half()
    elif case == "head_dim_odd":
        q, k, v = _bhsd(d=60), _bhsd(d=60), _bhsd(d=60)
    elif case == "head_dim_big":
        q, k, v = _bhsd(d=264), _bhsd(d=264), _bhsd(d=264)
    elif case == "gqa_ratio":
        q, k, v = _bhsd(h=6), _bhsd(h=4), _bhsd(h=4)
    elif case == "strided_head_dim":
        q = torch.randn(2, 4, 32, 128, dtype=torch.bfloat16)[..., ::2]
    elif case == "three_d":
        q, k, v = (t[0] for t in (q, k, v))
    reason = sdpa.input_reason(q, k, v, **kw)
    assert reason is not None and expect in reason


@pytest.mark.parametrize("cap,served", [((9, 0), True), ((10, 0), True), ((8, 0), False), ((8, 9), False),
                                        ((12, 0), False), ((7, 5), False)])
def test_arch_reason(cap, served):
    assert (sdpa.arch_reason(cap) is None) == served


def test_cpu_tensors_are_never_routed():
    q = _bhsd()
    assert "not CUDA" in sdpa.device_reason(q, q, q)
    assert sdpa.forward_reason(q, q, q) is not None
    lse = torch.zeros(2, 4, 32)
    assert sdpa.backward_reason(q, q, q, q, q, lse) is not None


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_kernel_question_reaches_the_dispatcher(direction):
    """The AttentionCall built for the dispatcher's question matches the op's signature; on CPU the
    answer is always "no kernel" (the reference would run), so SDPA would keep PyTorch's kernel."""
    q = _bhsd()
    reason = sdpa._kernel_reason(q, q, q, None, True, direction)
    assert reason is not None and direction in reason


# ---------------------------------------------------------------------------------------------
# torch_fa4's halves through aten's dispatcher and autograd formula (on the CPU key, test only)
# ---------------------------------------------------------------------------------------------


def _fa4_forward_on_cpu(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    assert dropout_p == 0.0 and not return_debug_mask
    return sdpa.fa4_sdpa_forward(query, key, value, is_causal, scale)


def _fa4_backward_on_cpu(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                         dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    return sdpa.fa4_sdpa_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale)


@contextlib.contextmanager
def _fa4_on_cpu_key():
    installed = sdpa.install_kernels("CPU", forward=_fa4_forward_on_cpu, backward=_fa4_backward_on_cpu)
    try:
        yield
    finally:
        installed.remove()


def _math_reference(q, k, v, grad, *, causal, scale):
    """float64 out and grads via the naive oracle and autograd."""
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(q64, k64, v64, causal=causal, scale=scale, differentiable=True)
    out.backward(grad.double().transpose(1, 2))
    return out.detach().transpose(1, 2), lse, q64.grad.transpose(1, 2), k64.grad.transpose(1, 2), v64.grad.transpose(1, 2)


LAYOUTS = {
    # SDPA inputs as models make them: views of (B, S, H, D) memory, or plain (B, H, S, D) tensors.
    "bshd_view": lambda b, h, s, d: torch.randn(b, s, h, d, dtype=torch.float64).transpose(1, 2),
    "bhsd_contiguous": lambda b, h, s, d: torch.randn(b, h, s, d, dtype=torch.float64),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal,scale,hkv,sk", [(False, None, 4, 11), (True, None, 2, 9), (True, 0.2, 1, 9),
                                                 (False, 0.5, 2, 5)])
def test_aten_sdpa_flash_op_runs_torch_fa4_halves(layout, causal, scale, hkv, sk):
    b, h, sq, d = 2, 4, 9, 16
    make = LAYOUTS[layout]
    q, k, v = make(b, h, sq, d), make(b, hkv, sk, d), make(b, hkv, sk, d)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grad = torch.randn(b, h, sq, d, dtype=torch.float64)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _math_reference(q, k, v, grad, causal=causal, scale=scale)
    with _fa4_on_cpu_key():
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
        # The strides aten's kernel and meta function give: torch.compile relies on them.
        assert out.stride() == torch.empty_like(q).stride()
        assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
        assert (res[4], res[5]) == (sq, sk)
        out.backward(grad)
    torch.testing.assert_close(out.detach(), ref_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-6, atol=1e-6)
    for t, ref in ((q, ref_dq), (k, ref_dk), (v, ref_dv)):
        assert t.grad.stride() == torch.empty_like(t).stride()
        torch.testing.assert_close(t.grad, ref, rtol=1e-6, atol=1e-6)  # LSE is float32 (aten)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_aten_sdpa_flash_op_compiles_with_torch_fa4_halves(layout):
    """Inductor calls the op as an extern kernel and checks its output strides against the meta
    function's: torch_fa4's halves must honour them, forward and backward."""
    b, h, hkv, s, d = 2, 4, 2, 12, 16
    make = LAYOUTS[layout]
    q, k, v = make(b, h, s, d), make(b, hkv, s, d), make(b, hkv, s, d)

    def attend(q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=0.3)[0] * 2.0

    grad = torch.randn(b, h, s, d, dtype=torch.float64)
    ref_out, _, ref_dq, ref_dk, ref_dv = _math_reference(q, k, v, grad * 2.0, causal=True, scale=0.3)
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="inductor", fullgraph=True)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with _fa4_on_cpu_key():
        out = compiled(q, k, v)
        out.backward(grad)
    torch.testing.assert_close(out.detach(), ref_out * 2.0, rtol=1e-9, atol=1e-9)
    for t, ref in ((q, ref_dq), (k, ref_dk), (v, ref_dv)):
        torch.testing.assert_close(t.grad, ref, rtol=1e-6, atol=1e-6)  # LSE is float32 (aten)


def test_flash_is_moved_just_ahead_of_cudnn():
    # SDPBackend values: math 0, flash 1, efficient 2, cudnn 3 (PyTorch's cuDNN-first order on Hopper)
    assert sdpa.flash_before_cudnn([3, 1, 2, 0], flash=1, cudnn=3) == [1, 3, 2, 0]
    assert sdpa.flash_before_cudnn([2, 3, 0, 1], flash=1, cudnn=3) == [2, 1, 3, 0]
    assert sdpa.flash_before_cudnn([1, 2, 0, 3], flash=1, cudnn=3) is None  # already first: unchanged
    assert sdpa.flash_before_cudnn([1, 2, 0], flash=1, cudnn=3) is None  # no cuDNN in the order
