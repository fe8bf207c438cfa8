"""Gradients of tensors captured by a score_mod (torch_fa4/mods/capture_grad.py), on the CPU path:
float64 against autograd through the float64 oracle (tests/naive.py) with the mod applied to the
same tensors, torch.autograd.gradcheck where the captured values survive the mods' fp32 loads, and
the plumbing (eager Function, the op's registered autograd, torch.compile, what gets no gradient)."""

import math

import pytest
import torch
import torch._dynamo

import torch_fa4
from naive import naive_attention, naive_varlen, rel_error
from torch_fa4.mods import lower_torch
from torch_fa4.mods.derivative import load_derivatives
from torch_fa4.mods.prepare import trace_graphs

# The captured values pass through the mods' fp32 loads and fp32 arithmetic (lower_torch.py, as the
# kernels compute), so a float64 gradient agrees with the oracle's to a few fp32 roundings, amplified
# where a gradient is a small difference of large terms.
TOL = 2e-5


@pytest.fixture(autouse=True)
def _private_mod_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "torch_fa4_cache"))


def _leaf(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def _grads_match(out, want, inputs, tol=TOL):
    """dL/d inputs through `out` (torch_fa4) and `want` (the oracle) for one random dL/d out."""
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, dout, allow_unused=True)
    ref = torch.autograd.grad(want, inputs, dout, allow_unused=True)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g is not None and r is not None, i
        assert g.shape == r.shape and g.dtype == inputs[i].dtype
        assert not g.isnan().any(), i
        err = ((g - r).norm() / r.norm().clamp_min(1e-6)).item()  # (a gradient may be exactly 0)
        assert err < tol, (i, err)
    return got


# ---- the mods: each a (torch_fa4 score_mod, oracle score_mod) pair over the same tensors ---------------

def alibi_pair(slopes):
    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return mod, mod  # the oracle gets index grids: the same code runs on them


def _alibi_inputs(B, Sq, Sk, H, D):
    """Leaf float64 q (B, Sq, H, D), k, v (B, Sk, H, D), learnable ALiBi slopes (H,) and their mod."""
    q, k, v = _leaf(B, Sq, H, D), _leaf(B, Sk, H, D), _leaf(B, Sk, H, D)
    slopes = torch.rand(H, dtype=torch.float64).requires_grad_()
    mod, _ = alibi_pair(slopes)
    return q, k, v, slopes, mod


def relative_table_pair(table, radius):
    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(q_idx - kv_idx, -radius, radius) + radius]
    return mod, mod


def per_batch_head_pair(bias):
    # a bias per (batch, head, key): one per (batch, head) alone would shift whole rows, which the
    # softmax ignores (its gradient is 0)
    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, kv_idx]
    return mod, mod


@pytest.mark.parametrize("causal", [False, True])
def test_learnable_alibi_slopes(causal):
    B, S, H, D = 2, 37, 4, 16
    q, k, v, slopes, mod = _alibi_inputs(B, S, S, H, D)
    out = torch_fa4.attention(q, k, v, score_mod=mod, causal=causal)
    want, _ = naive_attention(q, k, v, score_mod=mod, causal=causal, differentiable=True)
    _grads_match(out, want, (q, k, v, slopes))


def test_relative_position_table_with_window_softcap_and_scale():
    """The chain: scale and softcap act before the mod; the table's gradient is dS at the mod's output."""
    B, Sq, Sk, H, D, radius = 2, 35, 41, 3, 16, 5  # q - kv spans [-9, 1] under the window
    q, k, v = _leaf(B, Sq, H, D), _leaf(B, Sk, H, D), _leaf(B, Sk, H, 8)
    table = _leaf(H, 2 * radius + 1)
    mod, ref_mod = relative_table_pair(table, radius)
    kw = dict(scale=0.3, softcap=2.5)
    out = torch_fa4.attention(q, k, v, score_mod=mod, window_size=(7, 3), **kw)
    want, _ = naive_attention(q, k, v, score_mod=ref_mod, window=(7, 3), differentiable=True, **kw)
    _grads_match(out, want, (q, k, v, table))


def test_per_batch_head_bias_through_flex_attention_with_gqa():
    B, S, Hq, Hkv, D = 3, 19, 6, 2, 16
    q, k, v = _leaf(B, Hq, S, D), _leaf(B, Hkv, S, D), _leaf(B, Hkv, S, D)
    bias = _leaf(B, Hq, S)
    mod, ref_mod = per_batch_head_pair(bias)
    out = torch_fa4.flex_attention(q, k, v, score_mod=mod, enable_gqa=True)
    want, _ = naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), score_mod=ref_mod, differentiable=True)
    _grads_match(out, want.transpose(1, 2), (q, k, v, bias))


def test_tensor_used_as_value_and_index_and_one_table_read_twice():
    """An integer tensor both indexes a table and is a value (it has no gradient: it is an integer);
    a table read at two places sums both reads' gradients; a scalar temperature multiplies."""
    B, S, H, D = 2, 23, 2, 16
    q, k, v = _leaf(B, S, H, D), _leaf(B, S, H, D), _leaf(B, S, H, D)
    doc = torch.randint(0, 4, (S,)).sort().values
    table = _leaf(H, 4)
    temp = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return (score * temp + table[h, doc[q_idx]] - table[h, doc[kv_idx]] * 0.5
                + torch.where(same, doc[kv_idx] * 0.25, -1.0))

    out = torch_fa4.attention(q, k, v, score_mod=mod)
    want, _ = naive_attention(q, k, v, score_mod=mod, differentiable=True)
    _grads_match(out, want, (q, k, v, table, temp))


def test_nonlinear_mod_and_negative_indices():
    """exp / tanh / sigmoid / division / minimum of captured values, a negative index (from the end)."""
    B, S, H, D = 1, 17, 3, 8
    q, k, v = _leaf(B, S, H, D), _leaf(B, S, H, D), _leaf(B, S, H, D)
    gain = (torch.rand(H, dtype=torch.float64) + 0.5).requires_grad_()
    offs = _leaf(H + 1)

    def mod(score, b, h, q_idx, kv_idx):
        x = torch.tanh(score / gain[h]) * gain[h] + torch.sigmoid(offs[h * 0 - 1] * (q_idx - kv_idx))
        return torch.minimum(x, torch.exp(offs[h]) + 1.0)

    out = torch_fa4.attention(q, k, v, score_mod=mod, causal=True)
    want, _ = naive_attention(q, k, v, score_mod=mod, causal=True, differentiable=True)
    # offs[-1]'s gradient is a sum of sigmoid' (q - kv) terms of both signs over the causal rows, often
    # a small difference of large ones: over 300 seeds the fp32 loads and arithmetic left it within
    # 2e-5 of the oracle's in 296 and within 3.5e-4 in all (q, k, v: about 3e-8 in all); a wrong
    # derivative is off by order 1
    _grads_match(out, want, (q, k, v, gain, offs), tol=1e-3)


@pytest.mark.parametrize("layout", ["varlen", "seqused"])
def test_varlen_and_seqused(layout):
    H, D = 2, 16
    slopes = torch.rand(H, dtype=torch.float64).requires_grad_()
    table = _leaf(H, 7)

    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs() + table[h, torch.clamp(kv_idx - q_idx, -3, 3) + 3]

    if layout == "varlen":
        cu_q = torch.tensor([0, 5, 5, 17], dtype=torch.int32)
        cu_k = torch.tensor([0, 9, 12, 25], dtype=torch.int32)
        q, k, v = _leaf(17, H, D), _leaf(25, H, D), _leaf(25, H, D)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    else:
        q, k, v = _leaf(3, 6, H, D), _leaf(3, 11, H, D), _leaf(3, 11, H, D)
        kw = dict(seqused_k=torch.tensor([11, 1, 4], dtype=torch.int32))
    out = torch_fa4.attention(q, k, v, score_mod=mod, causal=True, **kw)
    want, _ = naive_varlen(q, k, v, score_mod=mod, causal=True, differentiable=True, **kw)
    _grads_match(out, want, (q, k, v, slopes, table))


def test_degenerate_shapes_and_fully_masked_rows():
    """One query row, one key, one head; rows that see no key (causal with Sq > Sk) add nothing."""
    for B, Sq, Sk, H in ((1, 1, 1, 1), (2, 1, 9, 1), (1, 7, 3, 2)):
        q, k, v, slopes, mod = _alibi_inputs(B, Sq, Sk, H, 8)
        out = torch_fa4.attention(q, k, v, score_mod=mod, causal=True)
        want, _ = naive_attention(q, k, v, score_mod=mod, causal=True, differentiable=True)
        _grads_match(out, want, (q, k, v, slopes))


def test_empty_sequences_give_zero_gradients():
    slopes = torch.rand(2, dtype=torch.float64).requires_grad_()
    mod, _ = alibi_pair(slopes)
    q, k, v = _leaf(1, 0, 2, 8), _leaf(1, 5, 2, 8), _leaf(1, 5, 2, 8)
    out = torch_fa4.attention(q, k, v, score_mod=mod)
    (g,) = torch.autograd.grad(out.sum(), (slopes,), allow_unused=True)
    assert g is not None and torch.equal(g, torch.zeros_like(slopes))


def test_gradcheck_captured_and_inputs():
    """torch.autograd.gradcheck over q, k, v and two captured tensors. Captured values are loaded in
    fp32 (the kernels' arithmetic), so they and the finite-difference step sit on a 2^-10 grid that
    fp32 holds exactly."""
    B, S, H, D = 1, 6, 2, 8
    grid = 2.0 ** -10
    slopes = (torch.randint(0, 1024, (H,)) * grid).double().requires_grad_()
    table = (torch.randint(-1024, 1024, (H, 5)) * grid).double().requires_grad_()

    def run(q, k, v, slopes, table):
        def mod(score, b, h, q_idx, kv_idx):
            bucket = torch.clamp(q_idx - kv_idx, -2, 2) + 2
            return score - slopes[h] * (q_idx - kv_idx).abs() + table[h, bucket]
        return torch_fa4.attention(q, k, v, score_mod=mod, window_size=(3, 1), softcap=3.0)

    args = (_leaf(B, S, H, D), _leaf(B, S, H, D), _leaf(B, S, H, D), slopes, table)
    assert torch.autograd.gradcheck(run, args, eps=grid, atol=1e-6, rtol=1e-4)


# ---- what gets no gradient ---------------------------------------------------------------------------

def test_mask_mod_captures_and_non_grad_captures_get_none():
    """A float tensor read by the mask_mod gets no gradient (boolean output); the same tensor read by
    the score_mod gets the score_mod's; captures that do not require grad stay without one."""
    B, S, H, D = 1, 13, 2, 8
    q, k, v = _leaf(B, S, H, D), _leaf(B, S, H, D), _leaf(B, S, H, D)
    gate = _leaf(H)  # read by both mods
    fixed = torch.rand(H, dtype=torch.float64)  # no grad
    only_mask = _leaf(S)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + gate[h] * fixed[h]

    def mask_mod(b, h, q_idx, kv_idx):
        return (gate[h] > -10.0) & (only_mask[kv_idx] > -10.0)

    out = torch_fa4.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    want, _ = naive_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, differentiable=True)
    _grads_match(out, want, (q, k, v, gate))
    out = torch_fa4.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    out.sum().backward()
    assert only_mask.grad is None and fixed.grad is None and gate.grad is not None


def _count_calls(monkeypatch, module, name):
    """Replace module.name by a wrapper that records each call (a list, returned)."""
    calls, fn = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_no_grad_captures_keep_the_direct_route_and_the_op_is_not_asked(monkeypatch):
    from torch_fa4 import eager_autograd
    from torch_fa4.mods.registry import lookup

    B, S, H, D = 1, 9, 2, 8
    q, k, v = torch.randn(B, S, H, D), torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    slopes = torch.rand(H)
    mod, _ = alibi_pair(slopes)
    mods, aux = trace_graphs(mod, None)
    rest = (aux, None, None, None, [], S, S, 0.25, False, -1, -1, 0.0, mods.key, 128, 128, False)
    assert eager_autograd.route(q, k, v, rest) == "direct"
    q.requires_grad_()
    out = torch_fa4.attention(q, k, v, score_mod=mod)
    from torch_fa4.mods import capture_grad

    seen = _count_calls(monkeypatch, capture_grad, "captured_grads")
    out.sum().backward()
    assert seen == [] and slopes.grad is None and lookup(mods.key).num_score_aux == 1
    slopes.requires_grad_()
    with torch.no_grad():
        assert eager_autograd.route(q, k, v, ([slopes], *rest[1:])) == "direct"


def test_only_captured_tensors_require_grad_skips_dq_dk_dv(monkeypatch):
    B, S, H, D = 1, 11, 2, 8
    q, k, v, slopes, mod = _alibi_inputs(B, S, S, H, D)
    want_out, _ = naive_attention(q, k, v, score_mod=mod, differentiable=True)
    want = torch.autograd.grad(want_out.sum(), (slopes,))[0]
    for run in (lambda: torch_fa4.attention(q.detach(), k.detach(), v.detach(), score_mod=mod),
                lambda: torch.compile(_flex_alibi, fullgraph=True, backend="aot_eager")(
                    *(t.detach().transpose(1, 2) for t in (q, k, v)), slopes).transpose(1, 2)):
        torch._dynamo.reset()
        out = run()
        with monkeypatch.context() as patch:
            from torch_fa4 import dispatch
            from torch_fa4.mods import capture_grad

            bwd_calls = _count_calls(patch, dispatch, "backward")
            captured_calls = _count_calls(patch, capture_grad, "captured_grads")
            (got,) = torch.autograd.grad(out.sum(), (slopes,))
        assert bwd_calls == [] and len(captured_calls) == 1
        assert rel_error(got, want) < TOL


# ---- eager Function, registered autograd, torch.compile ---------------------------------------------

def _flex_alibi(q, k, v, slopes):
    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return torch_fa4.flex_attention(q, k, v, score_mod=mod)


def test_eager_function_and_op_autograd_agree():
    """Eager calls run eager_autograd.AttentionFunction; the op's registered autograd (torch.compile,
    functorch, direct op callers) must give the same gradients for captured tensors, bit for bit."""
    B, S, H, D = 2, 10, 2, 8
    q, k, v = _leaf(B, S, H, D), _leaf(B, S, H, D), _leaf(B, S, H, D)
    table = _leaf(H, 5)
    mod, _ = relative_table_pair(table, 2)
    out = torch_fa4.attention(q, k, v, score_mod=mod, causal=True, scale=0.25)
    assert type(out.grad_fn).__name__ == "AttentionFunctionBackward"
    mods, aux = trace_graphs(mod, None)
    op_out, _ = torch.ops.torch_fa4.fwd(q, k, v, aux, None, None, None, [], S, S, 0.25, True, -1, 0, 0.0,
                                        mods.key, 128, 128, False)
    assert type(op_out.grad_fn).__name__ != "AttentionFunctionBackward"
    assert torch.equal(out, op_out)
    dout = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v, table), dout),
                    torch.autograd.grad(op_out, (q, k, v, table), dout)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_training_step(backend):
    torch._dynamo.reset()
    B, S, H, D = 2, 16, 2, 16
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    slopes = torch.rand(H, requires_grad=True)
    table = torch.randn(H, 9, requires_grad=True)

    def step(q, k, v, slopes, table):
        def mod(score, b, h, q_idx, kv_idx):
            bucket = torch.clamp(q_idx - kv_idx, -4, 4) + 4
            return score - slopes[h] * (q_idx - kv_idx).abs() + table[h, bucket]
        return torch_fa4.flex_attention(q, k, v, score_mod=mod).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    args = (q, k, v, slopes, table)
    got = torch.autograd.grad(compiled(*args), args)
    want = torch.autograd.grad(step(*args), args)
    for g, w in zip(got, want):
        assert rel_error(g, w) < 1e-5
    assert torch._dynamo.explain(step)(*args).graph_break_count == 0


def test_deterministic_mode_repeats_bit_for_bit():
    B, S, H, D = 2, 33, 2, 8
    q, k, v = _leaf(B, S, H, D), _leaf(B, S, H, D), _leaf(B, S, H, D)
    table = _leaf(H, 9)
    mod, _ = relative_table_pair(table, 4)
    dout = torch.randn(B, S, H, D, dtype=torch.float64)
    runs = [torch.autograd.grad(torch_fa4.attention(q, k, v, score_mod=mod, deterministic=det), (table,),
                                dout)[0] for det in (True, True, False)]
    assert torch.equal(runs[0], runs[1])
    assert rel_error(runs[2], runs[0]) < 1e-12


def test_low_precision_captured_tensor_gets_its_dtype():
    """A bf16 table on fp32 attention: the gradient is summed in fp32 and returned as bf16."""
    B, S, H, D = 1, 12, 2, 8
    q, k, v = (torch.randn(B, S, H, D) for _ in range(3))
    table = torch.randn(H, 5).bfloat16().requires_grad_()
    mod, _ = relative_table_pair(table, 2)
    (got,) = torch.autograd.grad(torch_fa4.attention(q, k, v, score_mod=mod).sum(), (table,))
    t64 = table.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(
        naive_attention(q.double(), k.double(), v.double(), score_mod=relative_table_pair(t64, 2)[0],
                        differentiable=True)[0].sum(), (t64,))
    assert got.dtype == torch.bfloat16 and rel_error(got, want) < 1e-2


def _op_forward_with_a_captured_table():
    """q, k, v (1, 7, 2, 8) in float64, the fwd op's out and lse under a relative-position table
    score_mod (causal, a window), and the op's arguments after q, k, v."""
    B, S, H, D = 1, 7, 2, 8
    q, k, v = (torch.randn(B, S, H, D, dtype=torch.float64) for _ in range(3))
    table = torch.randn(H, 5, dtype=torch.float64)
    mods, aux = trace_graphs(relative_table_pair(table, 2)[0], None)
    rest = (aux, None, None, None, [], S, S, 0.3, True, -1, 0, 0.0, mods.key, 128, 128, False)
    out, lse = torch.ops.torch_fa4.fwd(q, k, v, *rest)
    return q, k, v, out, lse, rest


def test_opcheck_bwd_captured():
    q, k, v, out, lse, rest = _op_forward_with_a_captured_table()
    torch.library.opcheck(torch.ops.torch_fa4.bwd_captured.default,
                          (torch.randn_like(out), q, k, v, out, lse, *rest, [0]))


def test_bad_slots_are_refused_clearly():
    B, S, H, D = 1, 5, 2, 8
    q, k, v = (torch.randn(B, S, H, D) for _ in range(3))
    doc = torch.zeros(S, dtype=torch.int64)

    def mod(score, b, h, q_idx, kv_idx):
        return score + doc[q_idx]

    def mask(b, h, q_idx, kv_idx):
        return doc[kv_idx] >= 0

    mods, aux = trace_graphs(mod, mask)
    rest = (aux, None, None, None, [], S, S, 0.3, False, -1, -1, 0.0, mods.key, 128, 128, False)
    out, lse = torch.ops.torch_fa4.fwd(q, k, v, *rest)
    with pytest.raises(TypeError, match="only floating tensors have gradients"):
        torch.ops.torch_fa4.bwd_captured(out, q, k, v, out, lse, *rest, [0])
    with pytest.raises(ValueError, match="not read by the score_mod"):
        torch.ops.torch_fa4.bwd_captured(out, q, k, v, out, lse, *rest, [1])


# ---- the load derivatives themselves ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["alibi", "ties", "where", "div_log"])
def test_load_derivatives_match_autograd(name):
    """derivative.load_derivatives against torch autograd through the PyTorch lowering (float64
    loads), element by element, including minimum / maximum ties (autograd splits them evenly)."""
    H, S = 3, 6
    t = torch.rand(H, 4, dtype=torch.float64) + 0.5
    mods = {
        "alibi": lambda s, b, h, q, kv: s - t[h, 0] * (q - kv).abs(),
        "ties": lambda s, b, h, q, kv: (torch.maximum(s * 0.0 + t[h, 1], t[h, 1])
                                        + torch.minimum(t[h, 2], t[h, 3])),
        "where": lambda s, b, h, q, kv: torch.where(q >= kv, s * t[h, 0], t[h, 1] - s),
        "div_log": lambda s, b, h, q, kv: torch.log(t[h, 0] + s.abs()) / t[h, 1] + torch.exp(-t[h, 2]),
    }
    mods_, aux = trace_graphs(mods[name], None)
    derivs = load_derivatives(mods_.score_graph)
    grid = dict(score=torch.randn(1, H, S, S, dtype=torch.float64),
                b=torch.zeros(1, 1, 1, 1, dtype=torch.long), h=torch.arange(H).view(1, H, 1, 1), q_idx=torch.arange(S).view(1, 1, S, 1),
                kv_idx=torch.arange(S).view(1, 1, 1, S))
    if name == "ties":
        t[:, 3] = t[:, 2]
    env = lower_torch.evaluate_nodes(derivs.graph, grid, [t])
    got = torch.zeros_like(t)
    for load in derivs.loads:
        index = [torch.broadcast_to(torch.as_tensor(env[i]), grid["score"].shape) for i in load.index]
        got.index_put_(tuple(index), torch.broadcast_to(torch.as_tensor(env[load.derivative], dtype=t.dtype),
                                                        grid["score"].shape), accumulate=True)
    t64 = t.clone().requires_grad_()
    out = lower_torch.score_torch(mods_.score_graph, grid["score"], grid["b"], grid["h"], grid["q_idx"],
                                  grid["kv_idx"], [t64])
    (want,) = torch.autograd.grad(out.sum(), (t64,))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(window_size=(20, 5)), dict(causal=True), dict(window_size=(9, -1))], ids=str)
def test_captured_gradient_chunks_agree(monkeypatch, kw):
    """The chunked walk (query blocks x key blocks, blocks outside the band skipped, blocks inside it
    unmasked) gives the one-block answer."""
    from torch_fa4.mods import capture_grad

    B, Sq, Sk, H, D = 1, 61, 70, 2, 8
    q, k, v = _leaf(B, Sq, H, D), _leaf(B, Sk, H, D), _leaf(B, Sk, H, D)
    table = _leaf(H, 9)
    mod, _ = relative_table_pair(table, 4)
    dout = torch.randn(B, Sq, H, D, dtype=torch.float64)

    def grad():
        out = torch_fa4.attention(q, k, v, score_mod=mod, **kw)
        return torch.autograd.grad(out, (table,), dout)[0]

    whole = grad()
    monkeypatch.setattr(capture_grad, "_CHUNK_ELEMENTS", 2 * 16 * 3)
    monkeypatch.setattr(capture_grad, "_KV_CHUNK", 16)
    assert rel_error(grad(), whole) < 1e-12 and not math.isnan(whole.sum().item())


def test_block_mask_folded_causal_and_document_mask():
    """flex_attention with block masks: a causal one (run as `causal`, mods.idioms) and a document
    mask over a captured integer tensor, with a learnable table in the score_mod."""
    B, S, H, D = 2, 40, 2, 8
    q, k, v = _leaf(B, H, S, D), _leaf(B, H, S, D), _leaf(B, H, S, D)
    table = _leaf(H, 9)
    mod, _ = relative_table_pair(table, 4)
    doc = torch.randint(0, 3, (S,)).sort().values

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    for mask in (causal, document):
        bm = torch_fa4.create_block_mask(mask, B, H, S, S, device="cpu", BLOCK_SIZE=16)
        out = torch_fa4.flex_attention(q, k, v, score_mod=mod, block_mask=bm)
        want, _ = naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), score_mod=mod, mask_mod=mask,
                                  differentiable=True)
        _grads_match(out, want.transpose(1, 2), (q, k, v, table))


def test_one_tensor_under_two_names():
    """The same tensor reached twice (two closure variables): both reads' gradients add up."""
    B, S, H, D = 1, 12, 2, 8
    q, k, v = _leaf(B, S, H, D), _leaf(B, S, H, D), _leaf(B, S, H, D)
    slopes = torch.rand(H, dtype=torch.float64).requires_grad_()
    other = slopes

    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs() + other[h] * (kv_idx * 0.1)

    out = torch_fa4.attention(q, k, v, score_mod=mod)
    want, _ = naive_attention(q, k, v, score_mod=mod, differentiable=True)
    _grads_match(out, want, (q, k, v, slopes))


def test_captured_tensor_changed_in_place_before_backward_is_an_error():
    """The gradient needs the values the forward read: a captured tensor updated in place between the
    forward and the backward raises autograd's error (both autograds), never a gradient of other values."""
    B, S, H, D = 1, 8, 2, 8
    q, k, v, slopes, mod = _alibi_inputs(B, S, S, H, D)
    mods, aux = trace_graphs(mod, None)
    eager = torch_fa4.attention(q, k, v, score_mod=mod)
    op_out, _ = torch.ops.torch_fa4.fwd(q, k, v, aux, None, None, None, [], S, S, 0.25, False, -1, -1, 0.0,
                                        mods.key, 128, 128, False)
    with torch.no_grad():
        slopes.add_(0.5)
    for out in (eager, op_out):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(out.sum(), (q, slopes))


class _BiasedAttention(torch.nn.Module):
    """A layer whose score_mod (a bound method) reads its own parameters."""

    def __init__(self, heads):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(heads, 9, dtype=torch.float64))
        self.slopes = torch.nn.Parameter(torch.rand(heads, dtype=torch.float64))

    def score_mod(self, score, b, h, q_idx, kv_idx):
        bucket = torch.clamp(q_idx - kv_idx, -4, 4) + 4
        return score + self.table[h, bucket] - self.slopes[h] * (q_idx - kv_idx).abs()

    def forward(self, q, k, v):
        return torch_fa4.flex_attention(q, k, v, score_mod=self.score_mod)


def test_module_parameters_train_eager_and_compiled():
    torch._dynamo.reset()
    layer = _BiasedAttention(2)
    q, k, v = _leaf(1, 2, 12, 8), _leaf(1, 2, 12, 8), _leaf(1, 2, 12, 8)
    layer(q, k, v).square().sum().backward()
    eager = [p.grad.clone() for p in layer.parameters()]
    want_out, _ = naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), score_mod=layer.score_mod,
                                  differentiable=True)
    want = torch.autograd.grad(want_out.transpose(1, 2).square().sum(), list(layer.parameters()))
    layer.zero_grad()
    torch.compile(layer, fullgraph=True, backend="aot_eager")(q, k, v).square().sum().backward()
    for p, e, w in zip(layer.parameters(), eager, want):
        assert torch.equal(p.grad, e) and rel_error(e, w) < TOL


def test_opcheck_bwd_and_captured():
    q, k, v, out, lse, rest = _op_forward_with_a_captured_table()
    (table,) = rest[0]  # the captured table, as the op takes it
    dout = torch.randn_like(out)
    # (only test_autograd_registration: the other checks run the op's body under modes in which the
    # reference backward of a score_mod cannot run (its torch.func vjp meets the modes' wrapper
    # tensors; the bwd op with a score_mod fails them alike). The fake kernel's outputs are compared
    # with the real ones below; test_torch_compile_fullgraph_training_step traces the op.)
    torch.library.opcheck(torch.ops.torch_fa4.bwd_and_captured.default, (dout, q, k, v, out, lse, *rest, [0]),
                          test_utils=("test_autograd_registration",))
    dq, dk, dv, (dtable,) = torch.ops.torch_fa4.bwd_and_captured(dout, q, k, v, out, lse, *rest, [0])
    want = torch.ops.torch_fa4.bwd(dout, q, k, v, out, lse, *rest)
    for g, w in zip((dq, dk, dv), want):
        assert torch.equal(g, w)
    assert torch.equal(dtable, torch.ops.torch_fa4.bwd_captured(dout, q, k, v, out, lse, *rest, [0])[0])
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in (dout, q, k, v, out, lse)]
        fq, fk, fv, (ftable,) = torch.ops.torch_fa4.bwd_and_captured(*fake, [mode.from_tensor(table)],
                                                                     *rest[1:], [0])
    for f, real in zip((fq, fk, fv, ftable), (dq, dk, dv, dtable)):
        assert f.shape == real.shape and f.dtype == real.dtype and f.stride() == real.stride()


# ---- the sm90 backward's fused path: which calls take it (faked Hopper, the kernel a stand-in) -------

@pytest.fixture
def faked_hopper(monkeypatch):
    """Compute capability 9.0 on CPU tensors: the sm90 forward and backward are stand-ins (the
    reference; the PyTorch recomputation for the captured gradients, into the kernel's buffers).
    Returns the backward's launches: (captured slots or None, deterministic) each."""
    from torch_fa4 import dispatch, reference
    from torch_fa4.kernels import sm90
    from torch_fa4.kernels.sm90 import bwd as sm90_bwd
    from torch_fa4.mods import capture_grad

    monkeypatch.setattr(dispatch, "on_gpu", lambda call: True)
    monkeypatch.setattr(dispatch, "capability", lambda device: (9, 0))

    def forward(call, out, lse):
        o, l = reference.forward(call)
        out.copy_(o)
        lse.copy_(l)

    recompute = capture_grad.captured_grads
    launches = []

    def backward(call, dout, out, lse, dq, dk, dv, deterministic, tuning=None, capture=None):
        launches.append((tuple(capture[0]) if capture else None, deterministic))
        for o, g in zip((dq, dk, dv), reference.backward(call, dout, out, lse)):
            o.copy_(g)
        if capture:
            slots, buffers = capture
            assert all(b.dtype == torch.float32 and b.is_contiguous() and not b.any() for b in buffers)
            for b, g in zip(buffers, recompute(call, dout, out, lse, slots, deterministic)):
                b.copy_(g.reshape(b.shape))

    monkeypatch.setattr(sm90, "forward", forward)
    monkeypatch.setattr(sm90_bwd, "backward", backward)
    return launches


def _bf16_alibi_call(learn_q=True, **kw):
    B, S, H, D = 2, 70, 2, 64
    q, k, v = (torch.randn(B, S, H, D).to(torch.bfloat16).requires_grad_(learn_q) for _ in range(3))
    slopes = (torch.rand(H) * 0.1).requires_grad_()
    mod, _ = alibi_pair(slopes)
    out = torch_fa4.attention(q, k, v, score_mod=mod, causal=True, **kw)
    want_out, _ = naive_attention(q, k, v, score_mod=alibi_pair(slopes.detach().double().requires_grad_())[0],
                                  causal=True)
    assert rel_error(out.double(), want_out) < 1e-2
    return out, (q, k, v, slopes) if learn_q else (slopes,)


def test_hopper_takes_captured_gradients_in_the_kernel(faked_hopper, monkeypatch):
    from torch_fa4.mods import capture_grad

    recomputed = _count_calls(monkeypatch, capture_grad, "captured_grads")
    out, inputs = _bf16_alibi_call()
    got = torch.autograd.grad(out.float().sum(), inputs, retain_graph=True)
    assert faked_hopper == [((0,), False)] and recomputed == []  # one kernel run, no recomputation
    # what the PyTorch path computes
    monkeypatch.setattr(capture_grad, "fused_backward", lambda *args: None)
    want = torch.autograd.grad(out.float().sum(), inputs)
    assert faked_hopper[1:] == [(None, False)] and len(recomputed) == 1
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_hopper_captured_gradient_alone_and_compiled(faked_hopper, monkeypatch):
    """Only the captured tensor wants a gradient (the bwd_captured op: the kernel still runs, its
    dQ / dK / dV dropped); under torch.compile the bwd_and_captured op reaches the kernel too."""
    out, (slopes,) = _bf16_alibi_call(learn_q=False)
    torch.autograd.grad(out.float().sum(), (slopes,))
    assert faked_hopper == [((0,), False)]
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 2, 70, 64).to(torch.bfloat16).requires_grad_() for _ in range(3))
    slopes = torch.rand(2).requires_grad_()
    loss = torch.compile(_flex_alibi, fullgraph=True, backend="aot_eager")(q, k, v, slopes).float().sum()
    torch.autograd.grad(loss, (q, k, v, slopes))
    assert faked_hopper[1:] == [((0,), False)]


def test_hopper_deterministic_and_other_families_keep_the_pytorch_path(faked_hopper, monkeypatch):
    from torch_fa4 import dispatch
    from torch_fa4.kernels.sm90 import bwd as sm90_bwd
    from torch_fa4.mods import capture_grad

    recomputed = _count_calls(monkeypatch, capture_grad, "captured_grads")
    out, inputs = _bf16_alibi_call(deterministic=True)
    torch.autograd.grad(out.float().sum(), inputs)
    assert faked_hopper == [(None, True)] and len(recomputed) == 1
    # a family without captured_grad_reason: no fused path
    out, inputs = _bf16_alibi_call()
    kernel_for = dispatch.kernel_for
    monkeypatch.setattr(dispatch, "kernel_for", lambda call, direction, **kw: (
        type("Family", (), {"backward": staticmethod(sm90_bwd.backward)}) if direction == "backward"
        else kernel_for(call, direction, **kw)))
    torch.autograd.grad(out.float().sum(), inputs)
    assert faked_hopper[1:] == [(None, False)] and len(recomputed) == 2


def test_sm90_captured_grad_reason():
    """Which calls the sm90 kernel accumulates captured gradients for."""
    import dataclasses

    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90.bwd import captured_grad_reason
    from torch_fa4.mods.registry import lookup

    B, S, H, D = 1, 64, 2, 64
    q, k, v = (torch.empty(B, S, H, D, dtype=torch.bfloat16) for _ in range(3))
    slopes, doc = torch.rand(H), torch.zeros(S, dtype=torch.int32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * doc[kv_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mods, aux = trace_graphs(score_mod, mask_mod)
    call = AttentionCall(q=q, k=k, v=v, scale=0.1, mod_key=mods.key, mods=lookup(mods.key),
                         aux_tensors=tuple(aux))
    s, d = [i for i, t in enumerate(aux) if t is slopes] + [i for i, t in enumerate(aux) if t is doc]
    assert captured_grad_reason(call, (s,), False) is None
    assert "deterministic" in captured_grad_reason(call, (s,), True)
    assert "not a floating" in captured_grad_reason(call, (d,), False)
    assert "not a floating" in captured_grad_reason(call, (2,), False)  # the mask_mod's: no gradient
    assert "1 to 4" in captured_grad_reason(call, (s,) * 5, False)
    fp32 = dataclasses.replace(call, q=q.float(), k=k.float(), v=v.float())
    assert "fp16/bf16" in captured_grad_reason(fp32, (s,), False)
