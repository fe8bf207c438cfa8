"""GPU: gradients of tensors captured by a score_mod with dQ / dK / dV from the sm_90 backward kernel,
in fp16 / bf16, against float64 autograd through the oracle (tests/naive.py) with the same mod; the
error budget is twice eager low precision's (the oracle run in the inputs' dtype). The captured
gradients come from the kernel itself (kernels/sm90/bwd_scores.CapturedGrads: the PyTorch
recomputation, torch_fa4/mods/capture_grad.captured_grads, is made to fail) except in deterministic
mode, which keeps the recomputation. They are fresh buffers the op returns (nothing is written into
a caller's tensor), so there is nothing to poison: each result is checked for NaN instead, and
dQ / dK / dV must come from the kernel (the reference backward is made to fail)."""

import pytest
import torch

import torch_fa4
from gpu_harness import SM90_ONLY
from naive import naive_attention, naive_varlen, rel_error

pytestmark = SM90_ONLY


@pytest.fixture
def kernel_backward_only(monkeypatch):
    """dQ, dK, dV must come from the sm_90 kernel: the reference backward raises."""
    from torch_fa4 import reference

    def refuse(*args, **kwargs):
        raise AssertionError("the reference backward ran: the sm90 kernel refused the call")

    monkeypatch.setattr(reference, "backward", refuse)


@pytest.fixture
def fused(monkeypatch):
    """The captured gradients must come from the kernel: the PyTorch recomputation raises."""
    from torch_fa4.mods import capture_grad

    def refuse(*args, **kwargs):
        raise AssertionError("the PyTorch recomputation ran: the kernel did not take the captured gradients")

    monkeypatch.setattr(capture_grad, "captured_grads", refuse)


def _alibi(slopes, table, bias):
    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return mod


def _relative_table(slopes, table, bias):
    radius = (table.shape[1] - 1) // 2

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(q_idx - kv_idx, -radius, radius) + radius]
    return mod


def _tanh_bias(slopes, table, bias):  # a mod whose derivative in the captured values is not constant
    def mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / 8.0 + bias[b, h, kv_idx]) * 8.0 - slopes[h] * (q_idx - kv_idx).abs()
    return mod


MODS = {"alibi": _alibi, "relative_table": _relative_table, "tanh_bias": _tanh_bias}


def _captured(b, hq, sk, dtype=torch.float32):
    slopes = torch.rand(hq, device="cuda") * 0.1
    table = torch.randn(hq, 2 * 64 + 1, device="cuda")
    bias = torch.randn(b, hq, sk, device="cuda")
    return [t.to(dtype).requires_grad_() for t in (slopes, table, bias)]


def _bf16_leaves(n, *shape):
    return [torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(n)]


def _check(make_mod, q, k, v, captured, used, attention=naive_attention, oracle_kw=None, **kw):
    """torch_fa4 (keywords `kw`) against the float64 oracle (`attention` with `oracle_kw`, by default
    the same), within twice eager low precision's error, for out, dQ, dK, dV and the captured tensors
    at `used` (the ones the mod reads)."""
    out = torch_fa4.attention(q, k, v, score_mod=make_mod(*captured), **kw)
    dout = torch.randn_like(out)
    inputs = (q, k, v, *(captured[i] for i in used))
    got = torch.autograd.grad(out, inputs, dout)

    def oracle(dtype, cap_dtype):
        qkv = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        cap = [t.detach().to(cap_dtype).requires_grad_() for t in captured]
        o, _ = attention(*qkv, score_mod=make_mod(*cap), differentiable=True,
                         **(kw if oracle_kw is None else oracle_kw))
        return o, torch.autograd.grad(o, (*qkv, *(cap[i] for i in used)), dout.to(dtype))

    ref, ref_grads = oracle(torch.float64, torch.float64)
    low, low_grads = oracle(q.dtype, captured[0].dtype)
    assert rel_error(out, ref) <= 2 * rel_error(low, ref)
    names = ("dq", "dk", "dv", *(f"captured {i}" for i in used))
    for name, x, g, r, lg in zip(names, inputs, got, ref_grads, low_grads):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert not torch.isnan(g).any(), f"{name} has NaN"
        assert rel_error(g, r) <= 2 * rel_error(lg, r), (name, rel_error(g, r), rel_error(lg, r))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(MODS))
def test_captured_gradients_dense(name, dtype, kernel_backward_only, fused):
    b, sq, sk, hq, hkv, d = 2, 777, 1030, 4, 2, 128
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    used = {"alibi": [0], "relative_table": [1], "tanh_bias": [0, 2]}[name]
    _check(MODS[name], q, k, v, _captured(b, hq, sk), used, causal=True)


@pytest.mark.parametrize("kw", [dict(window_size=(200, 50)), dict(softcap=20.0, scale=0.1), dict()], ids=str)
def test_captured_gradients_window_softcap_d64(kw, kernel_backward_only, fused):
    b, s, hq, d = 2, 513, 6, 64
    q, k, v = _bf16_leaves(3, b, s, hq, d)
    oracle_kw = {("window" if key == "window_size" else key): value for key, value in kw.items()}
    _check(_tanh_bias, q, k, v, _captured(b, hq, s), [0, 2], oracle_kw=oracle_kw, **kw)


def test_captured_gradients_varlen(kernel_backward_only, fused):
    hq, d = 4, 64
    lens_q, lens_k = [300, 1, 517], [250, 64, 600]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    layout = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    _check(_tanh_bias, q, k, v, _captured(3, hq, max(lens_k)), [0, 2], attention=naive_varlen,
           oracle_kw=layout, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), **layout)


def test_low_precision_captured_tensor(kernel_backward_only, fused):
    """A bf16 bias table: its gradient is summed in fp32 and returned in bf16."""
    b, s, hq, d = 2, 640, 4, 128
    q, k, v = _bf16_leaves(3, b, s, hq, d)
    _check(_relative_table, q, k, v, _captured(b, hq, s, torch.bfloat16), [1], causal=True)


def test_only_captured_tensor_requires_grad_and_deterministic_repeats():
    b, s, hq, d = 2, 1000, 4, 128
    q, k, v = (torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    captured = _captured(b, hq, s)
    mod = _relative_table(*captured)
    dout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    runs = [torch.autograd.grad(torch_fa4.attention(q, k, v, score_mod=mod, causal=True, deterministic=True),
                                (captured[1],), dout)[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and not torch.isnan(runs[0]).any()


def test_compiled_training_step_matches_eager(fused):
    torch._dynamo.reset()
    b, s, hq, d = 2, 700, 4, 128
    q, k, v = _bf16_leaves(3, b, hq, s, d)
    captured = _captured(b, hq, s)

    def step(q, k, v, slopes, table, bias):
        mod = _tanh_bias(slopes, table, bias)
        return torch_fa4.flex_attention(q, k, v, score_mod=mod).float().square().sum()

    args = (q, k, v, *captured)
    got = torch.autograd.grad(torch.compile(step, fullgraph=True)(*args), (q, k, v, captured[0], captured[2]))
    want = torch.autograd.grad(step(*args), (q, k, v, captured[0], captured[2]))
    for g, w in zip(got, want):
        assert not torch.isnan(g).any() and rel_error(g, w) < 1e-2


# ---- the kernel's address classes (bwd_scores: per tile, per query, per key, diagonal, per element) ----

def _per_query_bias(slopes, table, bias):  # bias[b, h, q_idx] (sq <= sk here): the lanes of one query
    def mod(score, b, h, q_idx, kv_idx):
        return score * (1.0 + 0.1 * bias[b, h, q_idx])
    return mod


def _diagonal_table(slopes, table, bias):  # table[h, q - kv + Sk - 1] (Sq = 300): a diagonal, no clamp
    offset = table.shape[1] - 300

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + offset]
    return mod


def _wrapped_diagonal(slopes, table, bias):  # a function of q - kv that is not affine
    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h, (q_idx - kv_idx) % 129]
    return mod


def _temperature(slopes, table, bias):  # slopes 0-d here: one value for every element
    def mod(score, b, h, q_idx, kv_idx):
        return score * slopes
    return mod


def _gathered_bucket(slopes, table, bias):  # table[h, bucket[kv_idx]]: an index through a load
    bucket = (torch.arange(4096, device=table.device) * 7) % table.shape[1]

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h, bucket[kv_idx]] * table[h, bucket[q_idx]]
    return mod


CLASSES = {"per_query": (_per_query_bias, [2]), "diagonal": (_diagonal_table, [1]),
           "wrapped_diagonal": (_wrapped_diagonal, [1]),
           "temperature": (_temperature, [0]), "gathered": (_gathered_bucket, [1]),
           "alibi": (_alibi, [0]), "relative_table": (_relative_table, [1]),
           "tanh_bias": (_tanh_bias, [0, 2])}


@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (64, torch.float16)],
                         ids=["d128_bf16", "d64_fp16"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_fused_address_classes(name, d, dtype, kernel_backward_only, fused):
    """Every way bwd_scores groups equal addresses, at D128 (64 queries per step) and D64 (128),
    GQA, causal, lengths that end inside tiles. Eight heads: a per-head gradient (ALiBi's slopes)
    is then eight sums, so that eager low precision's error on it, the budget, is not one lucky
    draw of four (its ratio to the kernel's ranged 0.2-1.4 over seeds at four heads)."""
    b, sq, sk, hq, hkv = 2, 300, 333, 8, 2
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    make_mod, used = CLASSES[name]
    captured = _captured(b, hq, sk)
    if name == "temperature":
        captured[0] = (torch.rand((), device="cuda") + 0.5).requires_grad_()
    if name == "diagonal":
        captured[1] = torch.randn(hq, sq + sk - 1, device="cuda", requires_grad=True)
    _check(make_mod, q, k, v, captured, used, causal=True)


@pytest.mark.parametrize("kw", [dict(window_size=(100, 30), softcap=15.0), dict(scale=0.2)], ids=str)
def test_fused_relative_table_window_softcap_gqa(kw, kernel_backward_only, fused):
    b, s, hq, hkv, d = 2, 700, 8, 2, 128
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    oracle_kw = {("window" if key == "window_size" else key): value for key, value in kw.items()}
    _check(_relative_table, q, k, v, _captured(b, hq, s), [1], oracle_kw=oracle_kw, **kw)


def test_fused_per_key_bias_gqa_through_flex(kernel_backward_only, fused):
    """bias[b, h, kv_idx] through flex_attention's (B, H, S, D) layout with GQA."""
    b, s, hq, hkv, d = 2, 520, 8, 2, 128
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    bias = torch.randn(b, hq, s, device="cuda", requires_grad=True)

    def mod(score, b_, h, q_idx, kv_idx):
        return score + bias[b_, h, kv_idx]

    out = torch_fa4.flex_attention(q, k, v, score_mod=mod, enable_gqa=True)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, bias), dout)

    def oracle(dtype):
        qkv = [t.detach().transpose(1, 2).to(dtype).requires_grad_() for t in (q, k, v)]
        cap = bias.detach().to(torch.float64 if dtype == torch.float64 else bias.dtype).requires_grad_()

        def m(score, b_, h, q_idx, kv_idx):
            return score + cap[b_, h, kv_idx]
        o, _ = naive_attention(*qkv, score_mod=m, differentiable=True)
        return torch.autograd.grad(o, (*qkv, cap), dout.transpose(1, 2).to(dtype))

    ref, low = oracle(torch.float64), oracle(torch.bfloat16)
    got = [g.transpose(1, 2) if i < 3 else g for i, g in enumerate(got)]
    for name, g, r, lg in zip(("dq", "dk", "dv", "bias"), got, ref, low):
        assert not torch.isnan(g).any(), name
        assert rel_error(g, r) <= 2 * rel_error(lg, r), (name, rel_error(g, r), rel_error(lg, r))


def test_fused_relative_table_under_document_block_mask(kernel_backward_only, fused):
    """A block mask's sparse walk: partial tiles (mask_mod evaluated) and full tiles both add."""
    b, s, hq, d = 2, 700, 4, 128
    doc = torch.sort(torch.randint(0, 4, (s,), device="cuda")).values

    def mask_mod(b_, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    block_mask = torch_fa4.create_block_mask(mask_mod, None, None, s, s, device="cuda")
    q, k, v = _bf16_leaves(3, b, s, hq, d)
    _check(_relative_table, q, k, v, _captured(b, hq, s), [1], oracle_kw=dict(mask_mod=mask_mod),
           block_mask=block_mask)


@pytest.mark.parametrize("name", ["relative_table", "tanh_bias"])
def test_fused_narrow_variant_d256(name, kernel_backward_only, fused):
    """Head dim 256: the 64-key variant whose warpgroups split the queries (bwd_kernel's narrow)."""
    b, sq, sk, hq, hkv, d = 1, 200, 260, 4, 2, 256
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    make_mod, used = CLASSES[name]
    _check(make_mod, q, k, v, _captured(b, hq, sk), used, causal=True)
