"""CPU: a mod's captured-tensor indices are bounded on the host before anything runs.

- Out-of-range mods (a document-id table shorter than the sequence, a relative-bias table too
  narrow for the offsets, a per-head table with too few heads) raise the same ModIndexError on
  the reference path and on the kernel path's host checks (dispatch with a stub kernel that must
  never be launched), naming the mod, the tensor, the dimension, the index range and the size.
- In-range mods (ALiBi, bias tables with negative offsets, document masks, gathers through an
  index tensor) are unaffected and match float64 attention.
- Negative indices wrap as in PyTorch: the PyTorch lowering and the rule the CuTe DSL lowering
  follows (torch_fa4.mods.index_sign) agree, and the CuTe lowering compiles with the wrap.
- Verdicts are memoised per shapes and per value version of index tensors.
"""

import glob
import re
import types

import pytest
import torch

from _out_of_range_mods import out_of_range_mods
from naive import naive_attention

import torch_fa4
from torch_fa4 import dispatch, ops
from torch_fa4 import mods as M
from torch_fa4.mods import index_bounds, index_sign, lower_torch
from torch_fa4.mods.prepare import trace_graphs


@pytest.fixture(autouse=True)
def _private_mod_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "torch_fa4_cache"))


@pytest.fixture
def stub_kernel(monkeypatch):
    """The kernel path on a CPU: dispatch picks a stub 'kernel' for every call; `launches` lists
    the directions it was asked to run (none may follow a failed host check)."""
    launches = []
    stub = types.SimpleNamespace(
        forward=lambda call, out, lse: launches.append("forward"),
        backward=lambda call, dout, out, lse, dq, dk, dv, deterministic: launches.append("backward"),
    )
    monkeypatch.setattr(dispatch, "kernel_for", lambda call, direction, warn=True: stub)
    return launches


# ---- the table: q, k, v (2, 1000, 8, 64) bf16 ----------------------------------------------

B, S, H, D = 2, 1000, 8, 64


# The error message's parts for each of out_of_range_mods. Names: other mods with the same graph (a
# library document_mask, ...) may be listed beside them (test_error_names_...).
_MESSAGE_PARTS = {
    "doc_short": ["mask_mod ", "'doc_mask'", "captured tensor #0 ", "'doc'", "shape (100,)", "dimension 0",
                  "[0, 999]", "outside [-100, 99]"],
    "rel_bias_narrow": ["score_mod ", "'rel_bias'", "captured tensor #0 ", "'tab'", "shape (8, 50)",
                        "dimension 1", "[-999, 999]", "outside [-50, 49]"],
    "heads_short": ["score_mod ", "'head_bias'", "captured tensor #0 ", "'sl'", "shape (4,)", "dimension 0",
                    "[0, 7]", "outside [-4, 3]"],
}


def _table_rows():
    """name -> (score_mod, mask_mod, causal, the message's parts)."""
    return {name: (*mods, _MESSAGE_PARTS[name]) for name, mods in out_of_range_mods().items()}


def _qkv(b=B, s=S, h=H, d=D, dtype=torch.bfloat16):
    return [torch.randn(b, s, h, d, dtype=dtype) for _ in range(3)]


def _raised(fn) -> str:
    with pytest.raises(index_bounds.ModIndexError) as info:
        fn()
    assert isinstance(info.value, IndexError)
    return str(info.value)


@pytest.mark.parametrize("row", sorted(_table_rows()))
def test_out_of_range_mods_raise_the_same_error_on_both_paths(row, monkeypatch):
    score_mod, mask_mod, causal, parts = _table_rows()[row]
    q, k, v = _qkv()

    def run():
        torch_fa4.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, causal=causal)

    on_reference = _raised(run)
    for part in parts + ["Sq=1000, Sk=1000", "H=8"]:
        assert part in on_reference, (part, on_reference)

    launches = []
    stub = types.SimpleNamespace(forward=lambda *a: launches.append("forward"),
                                 backward=lambda *a: launches.append("backward"))
    monkeypatch.setattr(dispatch, "kernel_for", lambda call, direction, warn=True: stub)
    assert _raised(run) == on_reference
    assert launches == [], "a kernel was launched after a failed index check"

    # the seam itself, as a kernel's host side reaches it, forward and backward
    key, aux = M.prepare(score_mod, mask_mod)
    call = ops.make_call(q, k, v, aux, None, None, None, [], S, S, D ** -0.5, causal, -1, 0 if causal else -1,
                         0.0, key, 128, 128)
    assert _raised(lambda: index_bounds.check_call(call)) == on_reference
    assert _raised(lambda: dispatch.backward(call, q, q, torch.empty(B, H, S), False)) == on_reference
    assert launches == []


def test_wrapping_row_of_the_table_matches_the_wrap_rule():
    """tab[h, kv_idx - q_idx] with tab (8, 2000): indices -999..999 are in range, negatives read
    tab[h, i + 2000] (PyTorch), on the reference and in the float64 oracle spelled out."""
    q, k, v = _qkv(b=1, s=200, h=8, d=32, dtype=torch.float32)
    tab = torch.randn(8, 400)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + tab[h, kv_idx - q_idx]

    def spelled_out(score, b, h, q_idx, kv_idx):
        i = kv_idx - q_idx
        return score + tab.double()[h, torch.where(i < 0, i + tab.shape[1], i)]

    for causal in (False, True):
        out = torch_fa4.attention(q, k, v, score_mod=rel_bias, causal=causal)
        want, _ = naive_attention(q, k, v, causal=causal, score_mod=spelled_out)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


# ---- in-range mods --------------------------------------------------------------------------------

def test_in_range_mods_are_unaffected_and_read_no_values(monkeypatch):
    """ALiBi, relative-bias tables (negative offsets under causal: q_idx - kv_idx in [-(S-1), S-1]
    fits a table of S columns), a document mask: no error, float64 results, and no tensor's
    values read for the check (none of them indexes with a tensor's values)."""
    reads = []
    real = index_bounds._read_range
    monkeypatch.setattr(index_bounds, "_read_range", lambda t: reads.append(t) or real(t))
    b, s, h, d = 2, 70, 4, 16
    q, k, v = _qkv(b, s, h, d, torch.float32)
    slopes = M.alibi_slopes(h)
    tab = torch.randn(h, s)
    offsets = torch.randn(h, 2 * s - 1)
    doc = torch.randint(0, 3, (s,)).sort().values

    def rel_causal(score, b, h, q_idx, kv_idx):
        return score + tab[h, q_idx - kv_idx]

    def rel_shifted(score, b, h, q_idx, kv_idx):
        return score + offsets[h, q_idx - kv_idx + s - 1]

    for score_mod, mask_mod, causal in ((M.alibi(slopes), None, True), (rel_causal, None, True),
                                        (rel_shifted, M.document_mask(doc), False),
                                        (None, M.document_mask(doc), True)):
        out = torch_fa4.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, causal=causal)
        want, _ = naive_attention(q, k, v, causal=causal, score_mod=score_mod, mask_mod=mask_mod)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert reads == []


def test_gather_through_an_index_tensor_uses_its_values_once_per_version(monkeypatch):
    reads = []
    real = index_bounds._read_range
    monkeypatch.setattr(index_bounds, "_read_range", lambda t: reads.append(1) or real(t))
    s, h = 40, 2
    q, k, v = _qkv(1, s, h, 16, torch.float32)
    table = torch.randn(h, 10)
    bucket = torch.arange(s) // 4  # values 0..9

    def bucketed(score, b, h, q_idx, kv_idx):
        return score + table[h, bucket[q_idx]] - table[h, bucket[kv_idx]]

    want, _ = naive_attention(q, k, v, score_mod=bucketed)
    for _ in range(3):
        out = torch_fa4.attention(q, k, v, score_mod=bucketed)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert len(reads) == 1, "the index tensor's values were read more than once while unmodified"

    bucket[7] = 10  # in place: a new version, out of range for table
    message = _raised(lambda: torch_fa4.attention(q, k, v, score_mod=bucketed))
    assert "captured tensor #1 'table'" in message and "[0, 10]" in message and "[-10, 9]" in message
    assert len(reads) == 2
    bucket[7] = -10  # wraps to table[h, 0]: allowed
    torch_fa4.attention(q, k, v, score_mod=bucketed)
    bucket[7] = -11
    assert "[-11, 9]" in _raised(lambda: torch_fa4.attention(q, k, v, score_mod=bucketed))


def test_repeated_calls_reuse_the_verdict(monkeypatch):
    checked = []
    real = index_bounds._check_graph
    monkeypatch.setattr(index_bounds, "_check_graph", lambda *a: checked.append(1) or real(*a))
    tab = torch.randn(4, 64)

    def rel(score, b, h, q_idx, kv_idx):
        return score + tab[h, kv_idx - q_idx]

    q, k, v = _qkv(1, 32, 4, 16, torch.float32)
    for _ in range(3):
        torch_fa4.attention(q, k, v, score_mod=rel)
    assert len(checked) == 1
    q2, k2, v2 = _qkv(1, 48, 4, 16, torch.float32)  # new lengths: checked again
    torch_fa4.attention(q2, k2, v2, score_mod=rel)
    assert len(checked) == 2
    tab.data = torch.randn(4, 40)  # a captured tensor of a new shape, same object
    assert "outside [-40, 39]" in _raised(lambda: torch_fa4.attention(q2, k2, v2, score_mod=rel))


def test_error_names_the_mod_and_tensor_as_written():
    """The function and the captured variable as the user wrote them (a closure, a partial's
    keyword, an nn.Module method's attribute); mods that trace to one graph share a key, and the
    message then lists every name seen for it rather than guess."""
    q, k, v = _qkv(1, 16, 6, 16, torch.float32)

    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("per_head", torch.randn(3))

        def mod(self, score, b, h, q_idx, kv_idx):
            return score * 0.987654 + self.per_head[h]

    def message(fn):
        return _raised(lambda: torch_fa4.attention(q, k, v, score_mod=fn))

    assert "score_mod 'Biased.mod' indexes captured tensor #0 'self.per_head' (shape (3,))" in message(Biased().mod)
    weights = torch.randn(3)

    def same_graph(score, b, h, q_idx, kv_idx):
        return score * 0.987654 + weights[h]

    got = message(same_graph)
    assert "score_mod (one of 'Biased.mod', 'same_graph', which trace to the same graph)" in got
    assert "captured tensor #0 (one of 'self.per_head', 'weights')" in got
    got = message(M.alibi(torch.randn(3)))  # (a user's own ALiBi closure may share its graph)
    assert "'_alibi'" in got and "'slopes'" in got


# ---- what cannot be bounded -------------------------------------------------------------------------

def test_unboundable_indices_are_refused():
    q, k, v = _qkv(1, 40, 2, 16, torch.float32)
    tab = torch.randn(2, 100)

    def by_zero(score, b, h, q_idx, kv_idx):
        return score + tab[h, q_idx // (kv_idx - 3)]

    def overflow(score, b, h, q_idx, kv_idx):
        return score + tab[h, (q_idx * 100000 * 100000) % 7]

    def modulo(score, b, h, q_idx, kv_idx):  # % by a positive constant: bounded whatever its left side
        return score + tab[h, (q_idx * 7 - kv_idx * 1000) % 100]

    message = _raised(lambda: torch_fa4.attention(q, k, v, score_mod=by_zero))
    assert "cannot be bounded" in message and "by a value in [-3, 36], which may be 0" in message
    assert "may leave int32" in _raised(lambda: torch_fa4.attention(q, k, v, score_mod=overflow))
    out = torch_fa4.attention(q, k, v, score_mod=modulo)
    want, _ = naive_attention(q, k, v, score_mod=modulo)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_interval_rules_are_sound():
    """Each integer rule contains every value the op can take on random small intervals (floor
    semantics for // and %, as both lowerings)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        lo_a, lo_b = (int(x) for x in torch.randint(-20, 20, (2,), generator=gen))
        a = (lo_a, lo_a + int(torch.randint(0, 15, (1,), generator=gen)))
        b = (lo_b, lo_b + int(torch.randint(0, 15, (1,), generator=gen)))
        for op, rule in index_bounds._RULES.items():
            if op == "where":
                continue
            unary = op in ("neg", "abs")
            if op in ("floordiv", "mod") and b[0] <= 0 <= b[1]:
                with pytest.raises(index_bounds._Unbounded):
                    rule(a, b)
                continue
            got = rule(a) if unary else rule(a, b)
            fn = lower_torch._OPS[op]
            values = [fn(x) for x in range(a[0], a[1] + 1)] if unary else \
                [fn(x, y) for x in range(a[0], a[1] + 1) for y in range(b[0], b[1] + 1)]
            assert got[0] <= min(values) and max(values) <= got[1], (op, a, b, got)
            if op not in ("mod",):  # exact for the monotone rules
                assert got == (min(values), max(values)), (op, a, b, got)


# ---- other entry points ------------------------------------------------------------------------------

def test_backward_and_block_mask_builder_check_too(stub_kernel):
    doc = torch.zeros(30, dtype=torch.int32)

    def doc_mask(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    message = _raised(lambda: M.create_block_mask(doc_mask, 1, 1, 64, 64, device="cpu"))
    assert "'doc_mask'" in message and "[0, 63]" in message and "outside [-30, 29]" in message
    q, k, v = _qkv(1, 64, 2, 16, torch.float32)
    key, aux = M.prepare(None, doc_mask)
    call = ops.make_call(q, k, v, aux, None, None, None, [], 64, 64, 0.25, False, -1, -1, 0.0, key, 128, 128)
    assert "[0, 63]" in _raised(lambda: dispatch.backward(call, q, q, torch.empty(1, 2, 64), False))
    assert stub_kernel == []


def test_varlen_bounds_come_from_max_seqlen():
    """Packed sequences: q_idx / kv_idx are positions within a sequence, bounded by max_seqlen_q /
    max_seqlen_k, so a table sized for the longest sequence passes and a shorter one does not."""
    lengths = [5, 17, 9]
    cu = torch.tensor([0, 5, 22, 31], dtype=torch.int32)
    q, k, v = (torch.randn(31, 2, 16) for _ in range(3))
    for size, ok in ((17, True), (16, False)):
        pos = torch.randn(size)

        def by_position(score, b, h, q_idx, kv_idx):
            return score + pos[kv_idx]

        def run():
            return torch_fa4.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                                       max_seqlen_k=max(lengths), score_mod=by_position)

        if ok:
            run()
        else:
            assert "[0, 16]" in _raised(run) and "Sq=17, Sk=17" in _raised(run)


def test_compiled_call_checks_at_run_time():
    doc = torch.zeros(16, dtype=torch.int32)

    def doc_mask(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    @torch.compile(fullgraph=True, backend="eager")
    def fn(q, k, v):
        return torch_fa4.attention(q, k, v, mask_mod=doc_mask)

    fn(*_qkv(1, 16, 2, 16, torch.float32))
    assert "outside [-16, 15]" in _raised(lambda: fn(*_qkv(1, 24, 2, 16, torch.float32)))


# ---- negative indices: the PyTorch lowering and the kernels' wrap rule ----------------------------

def _graph(score_mod):
    mods, aux = trace_graphs(score_mod, None)
    return mods.score_graph, aux


def test_which_indices_the_kernels_wrap():
    slopes, tab, doc = torch.randn(4), torch.randn(4, 64), torch.arange(64)
    small = torch.arange(64, dtype=torch.uint8)
    keep, wrap, shift = index_sign.KEEP, index_sign.WRAP, index_sign.SHIFT
    cases = {
        "alibi": (M.alibi(slopes), {}),
        "clamped": (lambda s, b, h, q, kv: s + tab[h, torch.clamp(q - kv + 4, min=0, max=8)], {}),
        "nonneg_arith": (lambda s, b, h, q, kv: s + tab[(b * 4 + h) % 4, q // 2 + kv % 3 + abs(q - kv) // 64], {}),
        "uint8_values": (lambda s, b, h, q, kv: s + tab[h, small[q]], {}),
        "difference": (lambda s, b, h, q, kv: s + tab[h, kv - q], (keep, wrap)),
        "negative_const": (lambda s, b, h, q, kv: s + tab[-1, kv], (shift, keep)),
        "signed_values": (lambda s, b, h, q, kv: s + tab[h, doc[q]], (keep, wrap)),
    }
    for name, (fn, want) in cases.items():
        g, _ = _graph(fn)
        wraps = index_sign.index_wraps(g)
        if want == {}:
            assert wraps == {}, name
        else:
            assert list(wraps.values()).count(want) == 1, (name, wraps)


def _evaluate_like_the_kernels(graph, inputs, aux):
    """The graph with loads done as the CuTe DSL lowering does them: wrap only where index_wraps
    says, then read at indices that must all be >= 0 (a kernel has no negative indexing)."""
    wraps = index_sign.index_wraps(graph)
    env = []
    for i, n in enumerate(graph.nodes):
        if n.op == "input":
            env.append(inputs[n.attr])
        elif n.op == "const":
            env.append(n.attr)
        elif n.op == "load":
            t = aux[n.attr]
            idx = []
            for d, a in enumerate(n.args):
                x = torch.as_tensor(env[a])
                how = wraps.get(i, (index_sign.KEEP,) * len(n.args))[d]
                if how == index_sign.WRAP:
                    x = torch.where(x < 0, x + t.shape[d], x)
                elif how == index_sign.SHIFT:
                    x = x + t.shape[d]
                assert bool((x >= 0).all()), f"a negative index reached load %{i} without a wrap"
                idx.append(x)
            env.append(t[tuple(idx)].float() if t.is_floating_point() else t[tuple(idx)])
        else:
            env.append(lower_torch._OPS[n.op](*(env[a] for a in n.args)))
    return env[graph.output]


def test_negative_indices_agree_between_the_lowerings():
    Bn, Hn, Sq, Sk = 2, 3, 23, 31
    tab = torch.randn(Hn, 64)
    shifts = torch.randint(-8, 8, (Hn,), dtype=torch.int16)
    doc = torch.randint(-5, 5, (Sq,))
    mods = [
        lambda s, b, h, q, kv: s + tab[h, kv - q],
        lambda s, b, h, q, kv: s + tab[-1, kv] - tab[h - 3, (q - kv) // 3],
        lambda s, b, h, q, kv: s + tab[h, q % 7 - 7 + shifts[h]],
        lambda s, b, h, q, kv: s * tab[h, doc[q] - kv % 4],
    ]
    grids = dict(score=torch.randn(Bn, Hn, Sq, Sk), b=torch.arange(Bn).view(-1, 1, 1, 1),
                 h=torch.arange(Hn).view(1, -1, 1, 1), q_idx=torch.arange(Sq).view(1, 1, -1, 1),
                 kv_idx=torch.arange(Sk).view(1, 1, 1, -1))
    for fn in mods:
        mod_set, aux = trace_graphs(fn, None)
        g = mod_set.score_graph
        assert index_sign.index_wraps(g), "each case has an index that may be negative"
        index_bounds.check(mod_set, aux, (Bn, Hn, Sq, Sk))  # in range: the premise of both lowerings
        want = lower_torch.evaluate(g, grids, aux)
        got = _evaluate_like_the_kernels(g, grids, aux)
        assert torch.equal(torch.broadcast_to(got, want.shape), want)


def test_cute_lowering_wraps_negative_indices_only(tmp_path):
    """sm_90a compile of the per-element lowering: a difference index gets the wrap (a sign test
    and a conditional add of the size), a sum of positions does not."""
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    from _mod_probes import compile_probe

    tab = torch.randn(3, 200)

    def difference(score, b, h, q_idx, kv_idx):
        return score + tab[h, kv_idx - q_idx] + tab[-1, kv_idx]

    def total(score, b, h, q_idx, kv_idx):
        return score + tab[h, kv_idx + q_idx] + tab[2, kv_idx]

    def sign_tests(fn, name):
        g, _ = _graph(fn)
        d = tmp_path / name
        d.mkdir()
        compile_probe(g, None, arch="sm_90a", dump_dir=str(d))
        ptx = open(glob.glob(str(d / "*.ptx"))[0]).read()
        assert len(re.findall(r"\bld\.global", ptx)) == 3  # the score and two table reads
        # i < 0 ? i + size : i as emitted: a select, or the sign mask (i >> 31) & size added
        return len(re.findall(r"\bselp\.b32|\bshr\.s32\s+%r\d+,\s*%r\d+,\s*31;", ptx))

    assert sign_tests(difference, "difference") >= sign_tests(total, "total") + 1
