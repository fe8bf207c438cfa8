"""Mods end to end through torch_fa4.attention / flex_attention (CPU: the reference path) against
the float64 oracle (tests/naive.py) with the mods written out by hand, and
torch.compile(fullgraph=True) with mods capturing tensors."""

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import torch_fa4
from naive import naive_attention
from torch_fa4 import mods as M

B, S, H, D = 2, 45, 4, 16


@pytest.fixture(autouse=True)
def _private_mod_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "torch_fa4_cache"))


def qkv(dtype=torch.float32, requires_grad=False):
    return [torch.randn(B, S, H, D, dtype=dtype, requires_grad=requires_grad) for _ in range(3)]


def f64_attention(q, k, v, bias=None, keep=None):
    """The float64 oracle on (B, S, H, D) with the mods written out by hand: a bias and a keep mask
    that broadcast to (B, H, S, S)."""
    return naive_attention(q, k, v, score_mod=None if bias is None else (lambda s, *_: s + bias),
                           mask_mod=None if keep is None else (lambda *_: keep))[0]


def idx():
    i = torch.arange(S, dtype=torch.float64)
    return i.view(S, 1), i.view(1, S)


def test_alibi_and_document_mask_user_closures():
    q, k, v = qkv()
    slopes = M.alibi_slopes(H)
    doc = torch.randint(0, 3, (S,)).sort().values

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def doc_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    out = torch.full((B, S, H, D), float("nan"))
    out.copy_(torch_fa4.attention(q, k, v, score_mod=alibi, mask_mod=doc_causal))
    qi, ki = idx()
    bias = slopes.double().view(1, H, 1, 1) * (ki - qi)
    keep = (doc.view(S, 1) == doc.view(1, S)) & (qi >= ki)
    torch.testing.assert_close(out.double(), f64_attention(q, k, v, bias, keep), rtol=1e-5, atol=1e-5)


def test_per_head_bias_table_and_grad():
    q, k, v = qkv(requires_grad=True)
    table = torch.randn(H, 9)

    def bucketed(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(q_idx - kv_idx + 4, min=0, max=8)]

    out = torch_fa4.attention(q, k, v, score_mod=bucketed)
    qi, ki = idx()
    bucket = (qi - ki + 4).clamp(0, 8).long()
    bias = table.double()[torch.arange(H).view(H, 1, 1), bucket.view(1, S, S)].unsqueeze(0)
    torch.testing.assert_close(out.double(), f64_attention(q, k, v, bias), rtol=1e-5, atol=1e-5)
    # gradients flow through the score_mod (its derivative is 1 here)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = naive_attention(q64, k64, v64, score_mod=lambda s, *_: s + bias, differentiable=True)
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_builtins_through_flex_attention_and_block_mask():
    q, k, v = (t.transpose(1, 2) for t in qkv())  # (B, H, S, D)
    doc = torch.randint(0, 3, (S,)).sort().values
    mask = M.and_masks(M.document_mask(doc), M.sliding_window_mask(10, 0))
    block_mask = M.create_block_mask(mask, None, None, S, S, device="cpu", BLOCK_SIZE=16)
    out = torch_fa4.flex_attention(q, k, v, score_mod=M.softcap_score(5.0), block_mask=block_mask)
    qi, ki = idx()
    keep = (doc.view(S, 1) == doc.view(1, S)) & (qi - ki <= 10) & (ki <= qi)
    want, _ = naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), softcap=5.0, mask_mod=lambda *_: keep)
    torch.testing.assert_close(out.double(), want.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_torch_flex_block_mask_accepted():
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    q, k, v = (t.transpose(1, 2) for t in qkv())
    doc = torch.randint(0, 3, (S,)).sort().values

    def doc_mask(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    tbm = torch_create_block_mask(doc_mask, None, None, S, S, device="cpu", BLOCK_SIZE=16)
    out = torch_fa4.flex_attention(q, k, v, block_mask=tbm)
    keep = doc.view(S, 1) == doc.view(1, S)
    want = f64_attention(*(t.transpose(1, 2) for t in (q, k, v)), keep=keep)
    torch.testing.assert_close(out.double(), want.transpose(1, 2), rtol=1e-5, atol=1e-5)


# ---- torch.compile -----------------------------------------------------------------------------------

SLOPES = torch.rand(H)


def _outer_score_mod(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)  # captures a module-level tensor


def _make_doc_mask(doc):
    def doc_mask(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    return doc_mask


def _check_compiled(fn, args_list):
    cnt = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(fn, fullgraph=True, backend=cnt)
    for args in args_list:
        got = compiled(*args)
        want = fn(*args)
        assert torch.equal(got, want)
    assert cnt.frame_count == 1, "new captured-tensor values recompiled"
    assert torch._dynamo.explain(fn)(*args_list[0]).graph_break_count == 0


def test_compile_closures_created_inside():
    q, k, v = qkv()

    def fwd(q, k, v, doc, slopes):
        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        def doc_mask(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        return torch_fa4.attention(q, k, v, score_mod=alibi, mask_mod=doc_mask)

    docs = [torch.randint(0, 3, (S,)).sort().values for _ in range(3)]
    _check_compiled(fwd, [(q, k, v, d, torch.rand(H)) for d in docs])


def test_compile_closures_created_outside():
    q, k, v = qkv()

    def fwd(q, k, v, mask_mod):
        return torch_fa4.attention(q, k, v, score_mod=_outer_score_mod, mask_mod=mask_mod)

    masks = [_make_doc_mask(torch.randint(0, 3, (S,)).sort().values) for _ in range(3)]
    _check_compiled(fwd, [(q, k, v, m) for m in masks])


def test_compile_builtins_and_flex_attention():
    q, k, v = (t.transpose(1, 2) for t in qkv())

    def fwd(q, k, v, doc, slopes):
        mask = M.and_masks(M.document_mask(doc), M.causal_mask)
        return torch_fa4.flex_attention(q, k, v, score_mod=M.alibi(slopes), mask_mod=mask)

    _check_compiled(fwd, [(q, k, v, torch.randint(0, 4, (S,)).sort().values, torch.rand(H)) for _ in range(3)])


def test_compile_module_with_buffers():
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("slopes", M.alibi_slopes(H))

        def score_mod(self, score, b, h, q_idx, kv_idx):
            return score + self.slopes[h] * (kv_idx - q_idx)

        def forward(self, q, k, v, doc):
            return torch_fa4.attention(q, k, v, score_mod=self.score_mod, mask_mod=M.document_mask(doc))

    m = Attn()
    q, k, v = qkv()
    _check_compiled(m, [(q, k, v, torch.randint(0, 3, (S,)).sort().values) for _ in range(2)])


class _BiasedAttention(torch.nn.Module):
    """FlexAttention's idiom: the mods are defined inside forward and read the module's buffers."""

    def __init__(self, flex: bool):
        super().__init__()
        self.flex = flex
        self.register_buffer("slopes", torch.rand(H))

    def forward(self, q, k, v, doc):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + self.slopes[h] * (kv_idx - q_idx)

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        if self.flex:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return torch_fa4.flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod).transpose(1, 2)
        return torch_fa4.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)


@pytest.mark.parametrize("flex", [False, True], ids=["attention", "flex_attention"])
def test_compile_mods_defined_in_forward_read_module_buffers(flex):
    m = _BiasedAttention(flex)
    q, k, v = qkv()
    docs = [torch.randint(0, 3, (S,)).sort().values for _ in range(3)]
    cnt = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(m, fullgraph=True, backend=cnt)
    for doc in docs:
        m.slopes.copy_(torch.rand(H))  # new buffer values: the same graph, the new values used
        got = compiled(q, k, v, doc)
        assert torch.equal(got, m(q, k, v, doc))  # eager agrees
        i, j = idx()
        bias = (m.slopes.double().view(H, 1, 1) * (j - i)).unsqueeze(0)
        keep = ((doc.view(S, 1) == doc.view(1, S)) & (i >= j)).view(1, 1, S, S)
        torch.testing.assert_close(got.double(), f64_attention(q, k, v, bias, keep), rtol=1e-5, atol=1e-5)
    assert cnt.frame_count == 1, "new captured-tensor values recompiled"
    assert torch._dynamo.explain(m)(q, k, v, docs[0]).graph_break_count == 0


@pytest.mark.parametrize("builder", ["torch_fa4", "torch"])
def test_compile_block_mask_created_inside(builder):
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    q, k, v = (t.transpose(1, 2) for t in qkv())

    def fwd(q, k, v, doc):
        def doc_mask(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]

        if builder == "torch":
            block_mask = torch_create_block_mask(doc_mask, None, None, S, S, device="cpu", BLOCK_SIZE=16)
        else:
            block_mask = torch_fa4.create_block_mask(doc_mask, None, None, S, S, device="cpu", BLOCK_SIZE=16)
        return torch_fa4.flex_attention(q, k, v, block_mask=block_mask)

    compiled = torch.compile(fwd, fullgraph=True, backend="eager")
    for _ in range(2):
        doc = torch.randint(0, 3, (S,)).sort().values
        keep = (doc.view(S, 1) == doc.view(1, S)).view(1, 1, S, S)
        want = f64_attention(*(t.transpose(1, 2) for t in (q, k, v)), keep=keep).transpose(1, 2)
        torch.testing.assert_close(compiled(q, k, v, doc).double(), want, rtol=1e-5, atol=1e-5)


def test_compile_changed_constant_recompiles_with_new_key():
    q, k, v = qkv()

    def fwd(q, k, v, window, cap):
        return torch_fa4.attention(q, k, v, score_mod=M.softcap_score(cap), mask_mod=M.sliding_window_mask(window, 0))

    compiled = torch.compile(fwd, fullgraph=True, backend="eager")
    # each window size / cap must give its own mods, never a stale key
    for w, cap in ((3, 0.5), (9, 0.5), (20, 0.5), (20, 2.0), (3, 0.5)):
        assert torch.equal(compiled(q, k, v, w, cap), fwd(q, k, v, w, cap))
