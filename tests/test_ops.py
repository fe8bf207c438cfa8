"""The torch.library ops: opcheck, gradients against float64 autograd, torch.compile, import hygiene."""

import subprocess
import sys

import pytest
import torch

import torch_fa4
from naive import naive_attention, rel_error


def _fwd_args(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, cu_q=None, cu_k=None, seqused=None,
              max_q=0, max_k=0):
    return (q, k, v, [], cu_q, cu_k, seqused, [], max_q, max_k, 0.125, causal, window[0], window[1],
            softcap, "", 128, 128, False)


def _leaf(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


OPCHECK_CASES = {
    "dense": lambda: _fwd_args(_leaf(2, 7, 4, 16), _leaf(2, 9, 2, 16), _leaf(2, 9, 2, 8), causal=True),
    "window_softcap": lambda: _fwd_args(_leaf(1, 6, 2, 16), _leaf(1, 6, 2, 16), _leaf(1, 6, 2, 16),
                                        window=(2, 1), softcap=2.0),
    "varlen": lambda: _fwd_args(_leaf(9, 2, 16), _leaf(11, 1, 16), _leaf(11, 1, 16),
                                cu_q=torch.tensor([0, 4, 9], dtype=torch.int32),
                                cu_k=torch.tensor([0, 6, 11], dtype=torch.int32), max_q=5, max_k=6),
    "seqused": lambda: _fwd_args(_leaf(2, 3, 2, 16), _leaf(2, 8, 2, 16), _leaf(2, 8, 2, 16),
                                 seqused=torch.tensor([8, 2], dtype=torch.int32)),
    # (B, S, H, D) views of (B, H, S, D) memory, SDPA's layout, with Dv != D
    "bhsd_views": lambda: _fwd_args(*(_bhsd_leaf(2, h, s, d) for h, s, d in ((4, 7, 16), (2, 9, 16), (2, 9, 8))),
                                    causal=True),
}


def _bhsd_leaf(b, h, s, d):
    return torch.randn(b, h, s, d, dtype=torch.float64).transpose(1, 2).requires_grad_()


def test_output_is_laid_out_like_q():
    """SDPA's (B, H, S, D) memory in, an output of that memory order out: no copy for its callers."""
    q, k, v = (_bhsd_leaf(2, h, s, d) for h, s, d in ((4, 7, 16), (2, 9, 16), (2, 9, 8)))
    out = torch_fa4.attention(q, k, v, causal=True)
    assert out.shape == (2, 7, 4, 8) and out.transpose(1, 2).is_contiguous()
    args = _fwd_args(q.detach(), k.detach(), v.detach(), causal=True)
    out, lse = torch.ops.torch_fa4.fwd(*args)
    grads = torch.ops.torch_fa4.bwd(torch.randn_like(out), *args[:3], out, lse, *args[3:])
    assert all(g.shape == t.shape and g.is_contiguous() for g, t in zip(grads, (q, k, v)))
    dense = torch.randn(2, 7, 4, 16, dtype=torch.float64)
    assert torch_fa4.attention(dense, dense, dense).is_contiguous()


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck_fwd(case):
    torch.library.opcheck(torch.ops.torch_fa4.fwd.default, OPCHECK_CASES[case]())


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck_bwd(case):
    args = OPCHECK_CASES[case]()
    q, k, v = (a.detach() for a in args[:3])
    out, lse = torch.ops.torch_fa4.fwd(q, k, v, *args[3:])
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.torch_fa4.bwd.default, (dout, q, k, v, out, lse, *args[3:]))


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(causal=True), dict(window_size=(3, 2)), dict(softcap=1.5, causal=True), dict(scale=0.7)],
    ids=str,
)
def test_gradients_match_float64_autograd(kw):
    q, k, v = _leaf(2, 11, 4, 16), _leaf(2, 13, 2, 16), _leaf(2, 13, 2, 24)
    out = torch_fa4.attention(q, k, v, **kw)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref_out, _ = naive_attention(q, k, v, scale=kw.get("scale"), causal=kw.get("causal", False),
                                 window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                                 differentiable=True)
    want = torch.autograd.grad(ref_out, (q, k, v), grad)
    for g, w in zip(got, want):
        assert rel_error(g, w) < 1e-10


def test_gradcheck_varlen_and_seqused():
    q, k, v = _leaf(9, 2, 8), _leaf(11, 1, 8), _leaf(11, 1, 8)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 6, 11], dtype=torch.int32)
    assert torch.autograd.gradcheck(
        lambda q, k, v: torch_fa4.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, softcap=2.0),
        (q, k, v),
    )
    q, k, v = _leaf(2, 3, 2, 8), _leaf(2, 6, 2, 8), _leaf(2, 6, 2, 8)
    used = torch.tensor([6, 2], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda q, k, v: torch_fa4.attention(q, k, v, seqused_k=used), (q, k, v))


@pytest.mark.parametrize("kw", [dict(causal=True, softcap=2.0), dict(window_size=(3, 1), deterministic=True)], ids=str)
def test_eager_function_matches_op_autograd(kw):
    """Eager calls record autograd through eager_autograd.AttentionFunction; the op's own autograd
    (register_autograd, used by torch.compile and direct op callers) must give the same results."""
    from torch_fa4 import eager_autograd

    q, k, v = _leaf(2, 9, 4, 16), _leaf(2, 12, 2, 16), _leaf(2, 12, 2, 16)
    out = torch_fa4.attention(q, k, v, **kw)
    assert type(out.grad_fn).__name__ == "AttentionFunctionBackward"
    left, right = kw.get("window_size", (-1, -1))
    if kw.get("causal"):
        right = 0
    op_out, _ = torch.ops.torch_fa4.fwd(q, k, v, [], None, None, None, [], 9, 12, 0.25, kw.get("causal", False),
                                        left, right, kw.get("softcap", 0.0), "", 128, 128,
                                        kw.get("deterministic", False))
    assert type(op_out.grad_fn).__name__ != "AttentionFunctionBackward"
    assert torch.equal(out, op_out)
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(op_out, (q, k, v), grad)):
        assert torch.equal(g, w)
    # no autograd to record: the op is called directly
    with torch.no_grad():
        assert torch_fa4.attention(q, k, v, **kw).grad_fn is None
    rest = ([], None, None, None, [], 9, 12, 0.25, False, -1, -1, 0.0, "", 128, 128, False)
    assert eager_autograd.route(q.detach(), k.detach(), v.detach(), rest) != "function"
    # the lse output carries no gradient
    _, lse = torch_fa4.attention(q, k, v, return_lse=True, **kw)
    assert not lse.requires_grad


def _record_ops():
    """A TorchDispatchMode that records the name of every op it sees (in `.ops`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    return RecordOps()


def test_eager_backward_shows_the_op_to_dispatch_modes():
    """The eager backward skips the bwd op's entry only when nothing could see it: under a
    TorchDispatchMode the op itself runs (and the mode records it)."""
    q, k, v = _leaf(1, 5, 2, 16), _leaf(1, 5, 2, 16), _leaf(1, 5, 2, 16)
    out = torch_fa4.attention(q, k, v)
    grad = torch.randn_like(out)
    want = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    with _record_ops() as mode:
        got = torch.autograd.grad(out, (q, k, v), grad)
    assert any(name.startswith("torch_fa4.bwd") for name in mode.ops), mode.ops[:5]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_eager_inference_skips_only_an_unobserved_op_entry():
    """Eager calls with nothing to record run the fwd op's body directly (eager_autograd.route);
    the result equals the op's, and a dispatch mode, the meta device or an input that requires grad
    still go through the op."""
    from torch_fa4 import eager_autograd

    q, k, v = torch.randn(2, 9, 4, 16), torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16)
    rest = ([], None, None, None, [], 9, 12, 0.25, True, -1, 0, 0.0, "", 128, 128, False)
    assert eager_autograd.route(q, k, v, rest) == "direct"
    op_out, op_lse = torch.ops.torch_fa4.fwd(q, k, v, *rest)
    out, lse = torch_fa4.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, op_out) and torch.equal(lse, op_lse)
    with _record_ops() as mode:
        assert eager_autograd.route(q, k, v, rest) != "direct"
        seen = torch_fa4.attention(q, k, v, causal=True)
    assert any(name.startswith("torch_fa4.fwd") for name in mode.ops), mode.ops[:5]
    assert torch.equal(seen, out)
    meta = [t.to("meta") for t in (q, k, v)]
    assert eager_autograd.route(*meta, rest) != "direct"
    assert torch_fa4.attention(*meta, causal=True).shape == out.shape  # the op's fake kernel
    bias = torch.randn(4, requires_grad=True)
    assert eager_autograd.route(q, k, v, ([bias], *rest[1:])) != "direct"
    with torch.no_grad():
        assert eager_autograd.route(q, k, v, ([bias], *rest[1:])) == "direct"
    # the API's one routing question: direct here, the Function once q records autograd
    assert eager_autograd.route(q, k, v, rest) == "direct"
    assert eager_autograd.route(q.requires_grad_(), k, v, rest) == "function"
    assert eager_autograd.route(q.detach(), k, v, ([bias], *rest[1:])) == "function"  # bias's gradient
    # varlen offsets are among the op's tensors: a meta one sends the call to the op's fake kernel
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    assert eager_autograd.route(q.detach(), k, v, (rest[0], cu, cu, *rest[3:])) == "direct"
    assert eager_autograd.route(q.detach(), k, v, (rest[0], cu, cu.to("meta"), *rest[3:])) == "op"


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    def block(q, k, v):
        return torch_fa4.attention(q, k, v, causal=True, window_size=(8, None), softcap=5.0) * 2

    q, k, v = torch.randn(2, 24, 4, 32), torch.randn(2, 24, 2, 32), torch.randn(2, 24, 2, 32)
    compiled = torch.compile(block, fullgraph=True, backend="inductor")
    assert rel_error(compiled(q, k, v), block(q, k, v)) < 1e-6
    explanation = torch._dynamo.explain(block)(q, k, v)
    assert explanation.graph_break_count == 0


def test_torch_compile_training_step():
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 16, 2, 32, requires_grad=True) for _ in range(3))

    def step(q, k, v):
        return torch_fa4.attention(q, k, v, causal=True).square().sum()

    loss = torch.compile(step, fullgraph=True)(q, k, v)
    got = torch.autograd.grad(loss, (q, k, v))
    want = torch.autograd.grad(step(q, k, v), (q, k, v))
    for g, w in zip(got, want):
        assert rel_error(g, w) < 1e-5


def test_import_does_not_load_cutedsl_or_cuda():
    code = (
        "import sys, torch, torch_fa4; "
        "torch_fa4.attention(torch.randn(1,4,1,64), torch.randn(1,4,1,64), torch.randn(1,4,1,64)); "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'cutlass']; "
        "assert not bad, bad; "
        "assert not torch.cuda.is_initialized(); print('clean')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "clean" in res.stdout, res.stderr


def test_kernels_get_a_nonnegative_scale():
    """fwd_launch.nonnegative_scale: plain calls with a negative scale reach the kernels as -q with
    -scale (the same scores; the kernels' row max needs scale >= 0); softcap and score_mod calls,
    whose softmax runs on already scaled scores, and calls with scale >= 0 pass unchanged."""
    from torch_fa4 import mods as M
    from torch_fa4.kernels.host import fwd_launch
    from torch_fa4.call import AttentionCall
    from torch_fa4.mods import registry

    q, k = torch.randn(1, 5, 2, 8, dtype=torch.float64), torch.randn(1, 7, 2, 8, dtype=torch.float64)
    call = AttentionCall(q=q, k=k, v=k, scale=-0.3)
    flipped = fwd_launch.nonnegative_scale(call)
    assert flipped.scale == 0.3 and torch.equal(flipped.q, -q)
    scores = lambda c: torch.einsum("bqhd,bkhd->bhqk", c.q, c.k) * c.scale  # noqa: E731
    assert torch.equal(scores(flipped), scores(call))
    for same in (AttentionCall(q=q, k=k, v=k, scale=0.3), AttentionCall(q=q, k=k, v=k, scale=0.0),
                 AttentionCall(q=q, k=k, v=k, scale=-0.3, softcap=5.0)):
        assert fwd_launch.nonnegative_scale(same) is same
    key, aux = M.prepare(lambda s, b, h, i, j: s * 2, None)
    scored = AttentionCall(q=q, k=k, v=k, scale=-0.3, mod_key=key, mods=registry.lookup(key), aux_tensors=tuple(aux))
    assert fwd_launch.nonnegative_scale(scored) is scored
    key, aux = M.prepare(None, M.causal_mask)
    masked = AttentionCall(q=q, k=k, v=k, scale=-0.3, mod_key=key, mods=registry.lookup(key), aux_tensors=tuple(aux))
    assert fwd_launch.nonnegative_scale(masked).scale == 0.3
