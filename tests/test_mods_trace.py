"""Tracing mods into ModGraphs: golden graphs of the built-ins, the op set against float64 math,
rejected mods and their messages, and key stability."""

import functools
import os
import subprocess
import sys
import textwrap

import expecttest
import pytest
import torch

from torch_fa4 import mods as M
from torch_fa4.mods.prepare import prepare, trace_graphs
from torch_fa4.mods.registry import lookup


@pytest.fixture(autouse=True)
def _private_mod_cache(tmp_path_factory, monkeypatch):
    # registrations persist graphs as JSON: keep the random keys of these tests out of ~/.cache
    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "torch_fa4_cache"))


def grid(B, H, Sq, Sk, dtype=torch.int64):
    b = torch.arange(B, dtype=dtype).view(B, 1, 1, 1)
    h = torch.arange(H, dtype=dtype).view(1, H, 1, 1)
    q = torch.arange(Sq, dtype=dtype).view(1, 1, Sq, 1)
    k = torch.arange(Sk, dtype=dtype).view(1, 1, 1, Sk)
    return b, h, q, k


def eval_score(score_mod, score):
    mods, aux = trace_graphs(score_mod, None)
    B, H, Sq, Sk = score.shape
    return mods.score_torch(score, *grid(B, H, Sq, Sk), aux[: mods.num_score_aux])


def eval_mask(mask_mod, B, H, Sq, Sk, index_dtype=torch.int64):
    mods, aux = trace_graphs(None, mask_mod)
    out = mods.mask_torch(*grid(B, H, Sq, Sk, index_dtype), aux)
    assert out.dtype == torch.bool
    return torch.broadcast_to(out, (B, H, Sq, Sk))


def f64_grid(B, H, Sq, Sk):
    b, h, q, k = (t.double() for t in grid(B, H, Sq, Sk))
    return b, h, q, k


class TestBuiltinGraphs(expecttest.TestCase):
    """The traced form of every built-in, as readable text (EXPECTTEST_ACCEPT=1 regenerates)."""

    def graph(self, score_mod=None, mask_mod=None):
        mods, _ = trace_graphs(score_mod, mask_mod)
        return (mods.score_graph or mods.mask_graph).text()

    def test_causal(self):
        self.assertExpectedInline(self.graph(mask_mod=M.causal_mask), """\
mask_mod(b, h, q_idx, kv_idx)
  %0: int = b
  %1: int = h
  %2: int = q_idx
  %3: int = kv_idx
  %4: bool = ge(%2, %3)
  return %4
""")

    def test_sliding_window(self):
        self.assertExpectedInline(self.graph(mask_mod=M.sliding_window_mask(64, 0)), """\
mask_mod(b, h, q_idx, kv_idx)
  %0: int = b
  %1: int = h
  %2: int = q_idx
  %3: int = kv_idx
  %4: int = sub(%2, %3)
  %5: int = 64
  %6: bool = le(%4, %5)
  %7: int = sub(%3, %2)
  %8: int = 0
  %9: bool = le(%7, %8)
  %10: bool = and(%6, %9)
  return %10
""")

    def test_sliding_window_left_unbounded(self):
        self.assertExpectedInline(self.graph(mask_mod=M.sliding_window_mask(None, 8)), """\
mask_mod(b, h, q_idx, kv_idx)
  %0: int = b
  %1: int = h
  %2: int = q_idx
  %3: int = kv_idx
  %4: int = sub(%3, %2)
  %5: int = 8
  %6: bool = le(%4, %5)
  return %6
""")

    def test_document_1d(self):
        self.assertExpectedInline(self.graph(mask_mod=M.document_mask(torch.zeros(8, dtype=torch.int32))), """\
mask_mod(b, h, q_idx, kv_idx) with aux0: int32[1d]
  %0: int = b
  %1: int = h
  %2: int = q_idx
  %3: int = kv_idx
  %4: int = aux0[%2]
  %5: int = aux0[%3]
  %6: bool = eq(%4, %5)
  return %6
""")

    def test_document_2d(self):
        self.assertExpectedInline(self.graph(mask_mod=M.document_mask(torch.zeros(2, 8, dtype=torch.int64))), """\
mask_mod(b, h, q_idx, kv_idx) with aux0: int64[2d]
  %0: int = b
  %1: int = h
  %2: int = q_idx
  %3: int = kv_idx
  %4: int = aux0[%0, %2]
  %5: int = aux0[%0, %3]
  %6: bool = eq(%4, %5)
  return %6
""")

    def test_prefix_lm(self):
        self.assertExpectedInline(self.graph(mask_mod=M.prefix_lm_mask(16)), """\
mask_mod(b, h, q_idx, kv_idx)
  %0: int = b
  %1: int = h
  %2: int = q_idx
  %3: int = kv_idx
  %4: bool = le(%3, %2)
  %5: int = 16
  %6: bool = lt(%3, %5)
  %7: bool = or(%4, %6)
  return %7
""")

    def test_prefix_lm_per_batch(self):
        self.assertExpectedInline(self.graph(mask_mod=M.prefix_lm_mask(torch.tensor([3, 5]))), """\
mask_mod(b, h, q_idx, kv_idx) with aux0: int64[1d]
  %0: int = b
  %1: int = h
  %2: int = q_idx
  %3: int = kv_idx
  %4: bool = le(%3, %2)
  %5: int = aux0[%0]
  %6: bool = lt(%3, %5)
  %7: bool = or(%4, %6)
  return %7
""")

    def test_chunked(self):
        self.assertExpectedInline(self.graph(mask_mod=M.chunked_mask(128)), """\
mask_mod(b, h, q_idx, kv_idx)
  %0: int = b
  %1: int = h
  %2: int = q_idx
  %3: int = kv_idx
  %4: int = 128
  %5: int = floordiv(%2, %4)
  %6: int = floordiv(%3, %4)
  %7: bool = eq(%5, %6)
  return %7
""")

    def test_and_or(self):
        m = M.or_masks(M.and_masks(M.causal_mask, M.chunked_mask(4)), M.prefix_lm_mask(2))
        self.assertExpectedInline(self.graph(mask_mod=m), """\
mask_mod(b, h, q_idx, kv_idx)
  %0: int = b
  %1: int = h
  %2: int = q_idx
  %3: int = kv_idx
  %4: bool = ge(%2, %3)
  %5: int = 4
  %6: int = floordiv(%2, %5)
  %7: int = floordiv(%3, %5)
  %8: bool = eq(%6, %7)
  %9: bool = and(%4, %8)
  %10: bool = le(%3, %2)
  %11: int = 2
  %12: bool = lt(%3, %11)
  %13: bool = or(%10, %12)
  %14: bool = or(%9, %13)
  return %14
""")

    def test_alibi(self):
        self.assertExpectedInline(self.graph(score_mod=M.alibi(M.alibi_slopes(4))), """\
score_mod(score, b, h, q_idx, kv_idx) with aux0: float32[1d]
  %0: float = score
  %1: int = b
  %2: int = h
  %3: int = q_idx
  %4: int = kv_idx
  %5: float = aux0[%2]
  %6: int = sub(%4, %3)
  %7: float = to_float(%6)
  %8: float = mul(%5, %7)
  %9: float = add(%0, %8)
  return %9
""")

    def test_softcap(self):
        self.assertExpectedInline(self.graph(score_mod=M.softcap_score(30.0)), """\
score_mod(score, b, h, q_idx, kv_idx)
  %0: float = score
  %1: int = b
  %2: int = h
  %3: int = q_idx
  %4: int = kv_idx
  %5: float = 30.0
  %6: float = div(%0, %5)
  %7: float = tanh(%6)
  %8: float = mul(%5, %7)
  return %8
""")

    def test_relative_bias(self):
        self.assertExpectedInline(self.graph(score_mod=M.relative_bias(torch.zeros(2, 4, 4))), """\
score_mod(score, b, h, q_idx, kv_idx) with aux0: float32[3d]
  %0: float = score
  %1: int = b
  %2: int = h
  %3: int = q_idx
  %4: int = kv_idx
  %5: float = aux0[%2, %3, %4]
  %6: float = add(%0, %5)
  return %6
""")


# ---- built-ins and user mods against hand-written float64 math --------------------------------------

B, H, SQ, SK = 2, 3, 37, 53


def test_causal_and_windows_match_f64():
    b, h, q, k = f64_grid(B, H, SQ, SK)
    assert torch.equal(eval_mask(M.causal_mask, B, H, SQ, SK), torch.broadcast_to(q >= k, (B, H, SQ, SK)))
    for left, right in ((5, 0), (None, 3), (7, None), (0, 0), (None, None)):
        want = torch.ones(B, H, SQ, SK, dtype=torch.bool)
        if left is not None:
            want &= q - k <= left
        if right is not None:
            want &= k - q <= right
        assert torch.equal(eval_mask(M.sliding_window_mask(left, right), B, H, SQ, SK), want), (left, right)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_document_prefix_chunked_match_f64(index_dtype):
    lengths = torch.randint(1, 20, (6,))
    doc = M.document_ids_from_lengths(lengths)[:SQ]
    doc = torch.cat([doc, torch.full((SQ - doc.numel(),), 99, dtype=doc.dtype)]) if doc.numel() < SQ else doc
    want = doc.view(-1, 1) == doc.view(1, -1)
    got = eval_mask(M.document_mask(doc), 1, 1, SQ, SQ, index_dtype)[0, 0]
    assert torch.equal(got, want)
    doc2 = torch.randint(0, 3, (B, SQ)).sort(dim=1).values
    got2 = eval_mask(M.document_mask(doc2), B, 1, SQ, SQ, index_dtype)[:, 0]
    assert torch.equal(got2, doc2[:, :, None] == doc2[:, None, :])

    b, h, q, k = f64_grid(B, H, SQ, SK)
    p = int(torch.randint(0, SK, ()))
    assert torch.equal(eval_mask(M.prefix_lm_mask(p), B, H, SQ, SK, index_dtype),
                       torch.broadcast_to((k <= q) | (k < p), (B, H, SQ, SK)))
    pb = torch.randint(0, SK, (B,))
    assert torch.equal(eval_mask(M.prefix_lm_mask(pb), B, H, SQ, SK, index_dtype),
                       torch.broadcast_to((k <= q) | (k < pb.double().view(B, 1, 1, 1)), (B, H, SQ, SK)))
    c = int(torch.randint(1, 16, ()))
    assert torch.equal(eval_mask(M.chunked_mask(c), B, H, SQ, SK, index_dtype),
                       torch.broadcast_to(torch.floor(q / c) == torch.floor(k / c), (B, H, SQ, SK)))
    both = M.and_masks(M.causal_mask, M.chunked_mask(c))
    assert torch.equal(eval_mask(both, B, H, SQ, SK), torch.broadcast_to((q >= k) & (torch.floor(q / c) == torch.floor(k / c)), (B, H, SQ, SK)))
    either = M.or_masks(M.sliding_window_mask(2, 0), M.prefix_lm_mask(p))
    assert torch.equal(eval_mask(either, B, H, SQ, SK),
                       torch.broadcast_to(((q - k <= 2) & (k <= q)) | (k <= q) | (k < p), (B, H, SQ, SK)))


def test_alibi_softcap_bias_match_f64():
    score = torch.randn(B, H, SQ, SK) * 4
    b, h, q, k = f64_grid(B, H, SQ, SK)
    slopes = M.alibi_slopes(H)
    want = score.double() + slopes.double().view(1, H, 1, 1) * (k - q)
    torch.testing.assert_close(eval_score(M.alibi(slopes), score).double(), want, rtol=1e-6, atol=1e-5)
    cap = 2.5
    want = cap * torch.tanh(score.double() / cap)
    torch.testing.assert_close(eval_score(M.softcap_score(cap), score).double(), want, rtol=1e-6, atol=1e-6)
    bias = torch.randn(H, SQ, SK, dtype=torch.bfloat16)
    want = score.double() + bias.double()[None]
    torch.testing.assert_close(eval_score(M.relative_bias(bias), score).double(), want, rtol=1e-6, atol=1e-5)


def test_alibi_slopes_standard_values():
    # 8 heads: 2^-1 ... 2^-8; 6 heads: the 4-head sequence then odd terms of the 8-head one
    torch.testing.assert_close(M.alibi_slopes(8).double(), torch.tensor([2.0 ** -(i + 1) for i in range(8)], dtype=torch.float64))
    want6 = [2.0 ** (-2 * (i + 1)) for i in range(4)] + [2.0 ** -1, 2.0 ** -3]
    torch.testing.assert_close(M.alibi_slopes(6).double(), torch.tensor(want6, dtype=torch.float64))


def test_user_mods_closures_over_tensors_match_f64():
    slopes = torch.rand(H)
    doc = torch.randint(0, 4, (SQ,)).sort().values
    head_bias = torch.randn(H, 7)

    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * torch.abs(q_idx - kv_idx)

    def doc_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def bucket_bias(score, b, h, q_idx, kv_idx):
        bucket = torch.clamp(q_idx - kv_idx, min=0, max=6)
        return torch.where(q_idx >= kv_idx, score + head_bias[h, bucket], score * 0.5)

    score = torch.randn(B, H, SQ, SQ)
    b, h, q, k = f64_grid(B, H, SQ, SQ)
    want = score.double() - slopes.double().view(1, H, 1, 1) * (q - k).abs()
    torch.testing.assert_close(eval_score(alibi_mod, score).double(), want, rtol=1e-6, atol=1e-5)
    want_m = (doc.view(-1, 1) == doc.view(1, -1)) & (q[0, 0] >= k[0, 0])
    assert torch.equal(eval_mask(doc_causal, 1, 1, SQ, SQ)[0, 0], want_m)
    bucket = (q - k).clamp(0, 6).long()
    hb = head_bias.double()[torch.arange(H).view(1, H, 1, 1), bucket]
    want = torch.where(q >= k, score.double() + hb, score.double() * 0.5)
    torch.testing.assert_close(eval_score(bucket_bias, score).double(), want, rtol=1e-6, atol=1e-5)


def test_full_op_set_matches_f64():
    table = torch.randn(5, 4)
    idx = torch.randint(0, 5, (SQ,), dtype=torch.int32)

    def everything(score, b, h, q_idx, kv_idx):
        i = (q_idx * 7 - kv_idx * 3) // 5 % 11 - 5   # negative operands: floor semantics
        x = torch.exp(score * 0.25) + torch.log(torch.abs(score) + 1) - torch.sigmoid(-score) * 2
        x = torch.tanh(x) + torch.minimum(score, x) - torch.maximum(score / 3, -x) + i
        y = torch.where(~(q_idx > kv_idx) | (h == 1), x, -x / (1 + score * score))
        return y + table[idx[q_idx], h] + (q_idx != kv_idx).float() + (kv_idx < 3) * 0.5

    score = torch.randn(B, H, SQ, SQ) * 3
    s = score.double()
    b, h, q, k = f64_grid(B, H, SQ, SQ)
    i = torch.floor(torch.remainder(torch.floor((q * 7 - k * 3) / 5), 11)) - 5
    x = torch.exp(s * 0.25) + torch.log(s.abs() + 1) - torch.sigmoid(-s) * 2
    x = torch.tanh(x) + torch.minimum(s, x) - torch.maximum(s / 3, -x) + i
    y = torch.where(~(q > k) | (h == 1), x, -x / (1 + s * s))
    t = table.double()[idx.long().view(1, 1, -1, 1), torch.arange(H).view(1, H, 1, 1)]
    want = y + t + (q != k).double() + (k < 3).double() * 0.5
    torch.testing.assert_close(eval_score(everything, score).double(), want, rtol=1e-5, atol=1e-5)


def test_torch_lowering_covers_the_op_set():
    from torch_fa4.mods import lower_torch
    from torch_fa4.mods.graph import OPS

    assert set(lower_torch._OPS) == set(OPS)


def test_score_derivative_matches_autograd_f64():
    bias = torch.randn(H)

    def mod(score, b, h, q_idx, kv_idx):
        x = torch.where(q_idx >= kv_idx, score * bias[h], torch.tanh(score) + torch.exp(score / 4))
        return torch.maximum(x, score * 0.5) / (1 + torch.sigmoid(score)) + torch.log(score * score + 1)

    from torch_fa4.mods import lower_torch

    mods, aux = trace_graphs(mod, None)
    score = torch.randn(B, H, SQ, SQ) * 2
    got = lower_torch.score_torch(mods.score_grad_graph, score, *grid(B, H, SQ, SQ), aux)
    s = score.double().requires_grad_()
    b, h, q, k = f64_grid(B, H, SQ, SQ)
    x = torch.where(q >= k, s * bias.double().view(1, H, 1, 1), torch.tanh(s) + torch.exp(s / 4))
    y = torch.maximum(x, s * 0.5) / (1 + torch.sigmoid(s)) + torch.log(s * s + 1)
    (want,) = torch.autograd.grad(y.sum(), s)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    # ALiBi-like mods have derivative exactly 1 (backward kernels skip the multiply)
    alibi_mods, _ = trace_graphs(M.alibi(M.alibi_slopes(H)), None)
    g = alibi_mods.score_grad_graph
    assert g.nodes[g.output].op == "const" and g.nodes[g.output].attr == 1.0


# ---- rejected mods ------------------------------------------------------------------------------------

def _rejects(score_mod=None, mask_mod=None, match=None):
    with pytest.raises(M.ModTraceError, match=match) as info:
        prepare(score_mod, mask_mod)
    return str(info.value)


def test_unsupported_op_named_and_supported_listed():
    msg = _rejects(score_mod=lambda s, b, h, q, k: torch.sin(s), match="torch.sin")
    assert "Supported:" in msg and "torch.where" in msg
    assert "Tensor.cumsum" in _rejects(score_mod=lambda s, b, h, q, k: s.cumsum(0))
    assert "pow" in _rejects(score_mod=lambda s, b, h, q, k: s ** 2)


def test_python_control_flow_rejected():
    def branchy(score, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return score
        return score * 2
    assert "control flow" in _rejects(score_mod=branchy)


def test_mask_must_return_bool_and_score_one_value():
    assert "boolean" in _rejects(mask_mod=lambda b, h, q, k: q - k)
    t = torch.ones(4)
    assert "same shape as score" in _rejects(score_mod=lambda s, b, h, q, k: (s, s))
    assert "got a tensor" in _rejects(score_mod=lambda s, b, h, q, k: t)
    assert "number per score element" in _rejects(score_mod=lambda s, b, h, q, k: q > k)


def test_bad_tensor_use_rejected():
    table = torch.ones(3, 4)
    assert "indexed with 1 index" in _rejects(score_mod=lambda s, b, h, q, k: s + table[h])
    assert "integer values" in _rejects(score_mod=lambda s, b, h, q, k: s + table[h, s])
    assert "not captured" in _rejects(mask_mod=lambda b, h, q, k: torch.arange(10)[q] > 0)
    assert "boolean values only" in _rejects(mask_mod=lambda b, h, q, k: (q & k) > 0)
    assert "integer values only" in _rejects(score_mod=lambda s, b, h, q, k: s // 2)


# ---- keys ---------------------------------------------------------------------------------------------

def _doc_closure(ids):
    def m(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    return m


def test_key_stable_across_closures_values_and_graph_changes():
    k1, aux1 = prepare(None, _doc_closure(torch.tensor([0, 0, 1])))
    k2, aux2 = prepare(None, _doc_closure(torch.tensor([5, 6, 7, 8, 9])))  # new values and size
    assert k1 == k2 and aux1[0] is not aux2[0]
    k3, _ = prepare(None, _doc_closure(torch.tensor([0, 1], dtype=torch.int32)))  # dtype changes the code
    k4, _ = prepare(None, _doc_closure(torch.zeros(2, 3, dtype=torch.int64)[0]))  # same dtype/rank
    assert k3 != k1 and k4 == k1
    assert prepare(None, M.sliding_window_mask(4))[0] == prepare(None, M.sliding_window_mask(4))[0]
    assert prepare(None, M.sliding_window_mask(4))[0] != prepare(None, M.sliding_window_mask(5))[0]
    # the same graph written differently maps to the same key (the key hashes the graph, not the code)
    assert prepare(None, lambda b, h, q, k: q >= k)[0] == prepare(None, M.causal_mask)[0]
    assert prepare(M.softcap_score(2.0), None)[0] != prepare(M.softcap_score(3.0), None)[0]
    assert prepare(None, None) == ("", [])


def test_tracing_is_cached_per_code_and_constants(monkeypatch):
    import importlib

    prep = importlib.import_module("torch_fa4.mods.prepare")  # the module (the package re-exports the function)

    calls = []
    real = prep.trace_mod
    monkeypatch.setattr(prep, "trace_mod", lambda *a: calls.append(1) or real(*a))
    marker = torch.randn(1).item()  # a constant no other test uses: a fresh cache entry

    def make(t):
        return lambda b, h, q, k: t[q] > marker

    for _ in range(3):
        prepare(None, make(torch.randn(5)))
    assert len(calls) == 1


def test_key_stable_across_processes_and_lookup_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(tmp_path))
    doc = torch.tensor([0, 0, 1, 1])
    key, _ = prepare(M.alibi(M.alibi_slopes(4)), M.document_mask(doc))
    # Force a persisted copy (this process may have registered the key before the env change).
    from torch_fa4.mods import registry
    registry._persist(lookup(key))
    code = textwrap.dedent(f"""
        import torch
        from torch_fa4 import mods as M
        from torch_fa4.mods.registry import lookup
        m = lookup({key!r})   # never traced in this process: read back from the cache dir
        assert m.mask_graph is not None and m.num_score_aux == 1
        print(M.prepare(M.alibi(M.alibi_slopes(4)), M.document_mask(torch.tensor([3, 4])))[0])
    """)
    env = dict(os.environ, TORCH_FA4_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == key


def test_unknown_key_error_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(tmp_path))
    with pytest.raises(KeyError, match="unknown mod key"):
        lookup("mods_000000000000000000000000")


CONFIG = {"slopes": torch.rand(H), "scale": 0.5}


class Holder:
    def __init__(self):
        self.table = torch.randn(H, SQ)
        self.shift = 2


def test_captures_through_globals_dicts_objects_partials_and_methods():
    holder = Holder()

    def from_global_dict(score, b, h, q_idx, kv_idx):
        return score * CONFIG["scale"] + CONFIG["slopes"][h]

    def from_object(score, b, h, q_idx, kv_idx):
        return score + holder.table[h, (q_idx + holder.shift) % SQ]

    def with_kw(score, b, h, q_idx, kv_idx, table=None):
        return score - table[h, kv_idx % SQ]

    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("bias", torch.randn(H))

        def mod(self, score, b, h, q_idx, kv_idx):
            return score + self.bias[h]

    module = Biased()
    score = torch.randn(B, H, SQ, SQ)
    b, h, q, k = grid(B, H, SQ, SQ)
    cases = [
        (from_global_dict, score * 0.5 + CONFIG["slopes"][h]),
        (from_object, score + holder.table[h, (q + 2) % SQ]),
        (functools.partial(with_kw, table=holder.table), score - holder.table[h, k % SQ]),
        (module.mod, score + module.bias[h]),
    ]
    for mod, want in cases:
        torch.testing.assert_close(eval_score(mod, score), want, rtol=1e-6, atol=1e-6)
    # the captured tensors come back in the ModSet's order, ready to be op inputs
    key, aux = prepare(from_object, None)
    assert len(aux) == 1 and aux[0] is holder.table


def test_unsupported_capture_is_reported():
    class WithProperty:
        def __init__(self):
            self._t = torch.ones(H)

        @property
        def t(self):
            return self._t

    obj = WithProperty()
    assert "properties" in _rejects(score_mod=lambda s, b, h, q, k: s + obj.t[h])


def test_constant_mark_matches_torch_decorator():
    # prepare._assume_constant_result sets by hand what torch.compiler.assume_constant_result sets
    # (without importing Dynamo): if torch changes how it marks a function, this fails
    import importlib

    prep = importlib.import_module("torch_fa4.mods.prepare")

    def mine():
        return 0

    def theirs():
        return 0

    mine._dynamo_marked_constant = True  # what the helper does while Dynamo is not loaded
    torch.compiler.assume_constant_result(theirs)
    assert vars(theirs) == vars(mine)
    assert prep._key_for_descs._dynamo_marked_constant is True


def test_kernel_imports_do_not_load_dynamo():
    # the kernels' mod lowering imports torch_fa4.mods (its __init__ runs): that must stay free of
    # torch._dynamo, whose import costs ~2 s of every process's first kernel compile
    import os
    import subprocess
    import sys

    import torch_fa4

    root = os.path.dirname(os.path.dirname(torch_fa4.__file__))  # this checkout's torch_fa4
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    code = ("import sys, torch, torch_fa4, torch_fa4.mods; from torch_fa4.mods import graph, registry, prepare; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
