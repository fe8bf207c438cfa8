"""CPU: attention over paged KV caches (`page_table`): the reference path against float64 on the
used pages gathered into contiguous keys, the argument errors, the forward-only op under opcheck
and torch.compile, the sm90 host's choices (which page sizes load by TMA, the gathered copy for the
others), and compiles of the paged sm90 variants for sm_90a whose SASS loads K / V by TMA without
local memory."""

import itertools
import math

import pytest
import torch

import torch_fa4
from _fwd_host_checks import cpu_launch_error
from naive import naive_attention, naive_varlen, rel_error
from torch_fa4.call import AttentionCall


def paged_cache(used, page_size, hkv, d, dtype=torch.float64, spare_entries=2, full=False):
    """(k_cache, v_cache, page_table, k, v): sequence b's used[b] keys on pages in a random order,
    stale ids (-1, past the cache, of pages no sequence uses) after its last used page, pages no
    sequence uses filled with NaN; k / v: the same keys contiguous, (B, max_pages * page_size, ...)."""
    need = [-(-n // page_size) for n in used]
    max_pages = max(need + [1]) + (0 if full else spare_entries)
    num_pages = sum(need) + 2
    k_cache = torch.randn(num_pages, page_size, hkv, d, dtype=dtype)
    v_cache = torch.randn(num_pages, page_size, hkv, d, dtype=dtype)
    order = torch.randperm(num_pages).tolist()
    unused = order[sum(need):]
    k_cache[unused] = float("nan")
    v_cache[unused] = float("nan")
    stale = [-1, num_pages, unused[0], 1 << 30]
    table = torch.empty(len(used), max_pages, dtype=torch.int32)
    k = torch.zeros(len(used), max_pages * page_size, hkv, d, dtype=dtype)
    v = torch.zeros_like(k)
    taken = 0
    for b in range(len(used)):
        for i in range(max_pages):
            if i < need[b]:
                table[b, i] = page = order[taken]
                taken += 1
                k[b, i * page_size:(i + 1) * page_size] = k_cache[page]
                v[b, i * page_size:(i + 1) * page_size] = v_cache[page]
            else:
                table[b, i] = stale[(b + i) % len(stale)]
    return k_cache, v_cache, table, k, v


def check(out, lse, ref, ref_lse):
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_error(out, ref) < 1e-12
    alive = ref_lse > -math.inf
    assert torch.equal(lse.isinf(), ~alive)
    diff = lse[alive] - ref_lse[alive]
    assert diff.numel() == 0 or diff.abs().max() < 1e-10


def _decay(score, b, h, q_idx, kv_idx):
    return score - 0.03 * (h + 1) * (q_idx - kv_idx).abs()


def _stripes(b, h, q_idx, kv_idx):
    return (kv_idx + b) % 3 != 0


CASES = {
    "plain": (dict(), dict()),
    "causal": (dict(causal=True), dict(causal=True)),
    "window": (dict(window_size=(5, 2)), dict(window=(5, 2))),
    "softcap_causal": (dict(softcap=3.0, causal=True), dict(softcap=3.0, causal=True)),
    "score_mod": (dict(score_mod=_decay, causal=True), dict(score_mod=_decay, causal=True)),
    "mask_mod": (dict(mask_mod=_stripes), dict(mask_mod=_stripes)),
}


@pytest.mark.parametrize("page_size", [1, 3, 8, 16, 64])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("hkv", [1, 2])
def test_reference_against_gathered_keys(page_size, case, hkv):
    used = [0, 1, 37, 64]
    k_cache, v_cache, table, k, v = paged_cache(used, page_size, hkv, 16)
    q = torch.randn(len(used), 3, 4, 16, dtype=torch.float64)
    seqused = torch.tensor(used, dtype=torch.int32)
    ours, theirs = CASES[case]
    out, lse = torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=seqused, return_lse=True,
                                   **ours)
    ref, ref_lse = naive_attention(q, k, v, seqlen_k=used, **theirs)
    check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("page_size", [1, 16])
def test_packed_queries_over_pages(page_size):
    rows, used = [1, 4, 0, 2], [30, 4, 9, 0]
    k_cache, v_cache, table, k, v = paged_cache(used, page_size, 2, 16)
    cu = torch.tensor([0, *itertools.accumulate(rows)], dtype=torch.int32)
    q = torch.randn(sum(rows), 4, 16, dtype=torch.float64)
    seqused = torch.tensor(used, dtype=torch.int32)
    out, lse = torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=seqused, cu_seqlens_q=cu,
                                   causal=True, score_mod=_decay, return_lse=True)
    ref, ref_lse = naive_varlen(q, k, v, cu_seqlens_q=cu, seqused_k=used, causal=True, score_mod=_decay)
    check(out, lse, ref, ref_lse)


def test_without_seqused_every_page_is_used():
    used = [48, 48]
    k_cache, v_cache, table, k, v = paged_cache(used, 16, 2, 16, full=True)
    q = torch.randn(2, 5, 2, 16, dtype=torch.float64)
    out, lse = torch_fa4.attention(q, k_cache, v_cache, page_table=table, causal=True, return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, causal=True)
    check(out, lse, ref, ref_lse)


def test_a_causal_mask_mod_is_not_folded_into_the_page_size():
    """A mask_mod that is a band runs as `causal` only for one diagonal: with a page table and no
    seqused_k that diagonal is max_pages * page_size keys long, not a page."""
    used = [32, 32]
    k_cache, v_cache, table, k, v = paged_cache(used, 16, 1, 16, full=True)
    q = torch.randn(2, 4, 1, 16, dtype=torch.float64)

    def below(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + 28

    out = torch_fa4.attention(q, k_cache, v_cache, page_table=table, mask_mod=below)
    ref, _ = naive_attention(q, k, v, mask_mod=below)
    assert rel_error(out, ref) < 1e-12


def test_compiled_fullgraph_and_opcheck():
    used = [20, 3]
    k_cache, v_cache, table, k, v = paged_cache(used, 8, 2, 16, dtype=torch.float32)
    q = torch.randn(2, 2, 4, 16)
    seqused = torch.tensor(used, dtype=torch.int32)
    def paged(q, kc, vc, t, s):
        return torch_fa4.attention(q, kc, vc, page_table=t, seqused_k=s, causal=True, score_mod=_decay)

    fn = torch.compile(paged, fullgraph=True)
    out = fn(q, k_cache, v_cache, table, seqused)
    ref, _ = naive_attention(q, k, v, seqlen_k=used, causal=True, score_mod=_decay)
    assert rel_error(out, ref) < 1e-5
    args = (q, k_cache, v_cache, table, [], None, seqused, [], 2, table.shape[1] * 8, 0.25, True, -1, 0, 0.0,
            "", 128, 128)
    torch.library.opcheck(torch.ops.torch_fa4.fwd_paged.default, args)


def test_gradients_are_refused():
    used = [5]
    k_cache, v_cache, table, _, _ = paged_cache(used, 8, 1, 16)
    q = torch.randn(1, 1, 1, 16, dtype=torch.float64, requires_grad=True)
    used = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="forward-only"):
        torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=used)
    with torch.no_grad():  # without autograd recording the call runs
        torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=used)
    # the op itself, reached without the API's check: its backward refuses
    args = (q, k_cache, v_cache, table, [], None, used, [], 1, table.shape[1] * 8, 0.25, False, -1, -1, 0.0,
            "", 128, 128)
    out, _ = torch.ops.torch_fa4.fwd_paged(*args)
    with pytest.raises(NotImplementedError, match="forward-only"):
        out.sum().backward()


def _errors_case():
    used = [10, 20]
    k_cache, v_cache, table, _, _ = paged_cache(used, 8, 2, 16)
    q = torch.randn(2, 1, 4, 16, dtype=torch.float64)
    return q, k_cache, v_cache, table, torch.tensor(used, dtype=torch.int32)


@pytest.mark.parametrize("change, error, words", [
    (lambda a: dict(page_table=a["page_table"].long()), TypeError, "int32"),
    (lambda a: dict(page_table=a["page_table"][0]), TypeError, "2-D"),
    (lambda a: dict(page_table=a["page_table"][:1]), ValueError, "one row per sequence"),
    (lambda a: dict(page_table=a["page_table"].to("meta")), ValueError, "page_table is on"),
    (lambda a: dict(page_table=[[0]]), TypeError, "torch.Tensor"),
    (lambda a: dict(page_table=torch.zeros(4, 2, dtype=torch.int32).t()), ValueError, "contiguous"),
    (lambda a: dict(cu_seqlens_k=torch.tensor([0, 1, 2], dtype=torch.int32),
                    cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), q=a["q"][:, 0]),
     ValueError, "cu_seqlens_k cannot come with page_table"),
    (lambda a: dict(k=a["k"][:, :, :, :8]), ValueError, "head dim"),
    (lambda a: dict(k=a["k"][0]), ValueError, "num_pages, page_size"),
    (lambda a: dict(k=a["k"][:, :0], v=a["v"][:, :0]), ValueError, "page_size 0"),
    (lambda a: dict(seqused_k=torch.tensor([10, 10**6], dtype=torch.int32)), ValueError, "seqused_k"),
    (lambda a: dict(page_table=_with_entry(a["page_table"], 1, 2, -1)), ValueError,
     r"page_table\[1, 2\] = -1"),
    (lambda a: dict(page_table=_with_entry(a["page_table"], 0, 1, a["k"].shape[0])), ValueError,
     "not a page of the cache"),
])
def test_errors(change, error, words):
    q, k, v, table, seqused = _errors_case()
    args = dict(q=q, k=k, v=v, page_table=table, seqused_k=seqused)
    args.update(change(args))
    with pytest.raises(error, match=words):
        torch_fa4.attention(**args)


def _with_entry(table, b, i, value):
    table = table.clone()
    table[b, i] = value
    return table


def test_stale_entries_past_the_used_pages_are_accepted():
    """Entries after a sequence's last used page are never read: any value passes the checks."""
    q, k, v, table, seqused = _errors_case()
    table[:, 3:] = torch.tensor([-7, 1 << 30], dtype=torch.int32).view(2, 1)
    torch_fa4.attention(q, k, v, page_table=table, seqused_k=seqused)


def test_value_checks_are_skipped_under_compile(monkeypatch):
    """Like the varlen offsets' checks, the page-id check reads values: torch.compile skips it (a
    kernel never reads past a sequence's used pages and loads zeros for ids outside the cache; the
    reference gathers only the used pages)."""
    q, k, v, table, seqused = _errors_case()
    from torch_fa4 import checks

    calls = []
    monkeypatch.setattr(checks, "check_varlen_values", lambda *a, **kw: calls.append(a))
    torch_fa4.attention(q, k, v, page_table=table, seqused_k=seqused)
    assert len(calls) == 1
    torch.compile(lambda *a: torch_fa4.attention(*a[:3], page_table=a[3], seqused_k=a[4]),
                  fullgraph=True)(q, k, v, table, seqused)
    assert len(calls) == 1


# ---- the sm90 host: page sizes, tiles, the gathered copy ------------------------------------------

def _paged_call(D, page_size, sq=1, hq=8, hkv=2, max_pages=4, packed=False, **kw):
    q = torch.empty(2, sq, hq, D, dtype=torch.bfloat16)
    if packed:  # (the two sequences' queries packed, cu_seqlens_q)
        q = q.flatten(0, 1)
        kw.update(cu_seqlens_q=torch.tensor([0, sq, 2 * sq], dtype=torch.int32), max_seqlen_q=sq)
    cache = torch.empty(10, page_size, hkv, D, dtype=torch.bfloat16)
    table = torch.zeros(2, max_pages, dtype=torch.int32)
    return AttentionCall(q=q, k=cache, v=cache, scale=D ** -0.5, page_table=table,
                         seqused_k=torch.zeros(2, dtype=torch.int32), **kw)


def test_page_box():
    from torch_fa4.kernels.host.paged_kv import page_box

    assert [page_box(p, 128) for p in (8, 16, 32, 64, 128, 256, 384)] == [8, 16, 32, 64, 128, 128, 128]
    assert [page_box(p, 128) for p in (1, 2, 3, 4, 24, 48, 200)] == [0] * 7
    assert [page_box(p, 80) for p in (16, 40, 64, 160)] == [16, 40, 0, 80]


@pytest.mark.parametrize("D, page_size, tile_n, box", [
    (128, 16, 128, 16), (128, 64, 128, 64), (128, 128, 128, 128), (128, 256, 128, 128), (64, 32, 128, 32),
    (96, 256, 128, 128), (192, 16, 112, 16), (192, 64, 64, 64), (192, 256, 64, 64), (256, 16, 80, 16),
    (256, 128, 64, 64), (128, 1, 128, 0), (128, 24, 128, 0), (256, 24, 80, 0),
])
def test_paged_variant_choice(D, page_size, tile_n, box):
    from torch_fa4.kernels.sm90 import fwd_host

    call = _paged_call(D, page_size)
    assert fwd_host.unsupported_reason(call) is None
    cfg = fwd_host.default_config(call)
    assert (cfg.tile_n, cfg.page_box) == (tile_n, box)
    assert not cfg.kv_multicast


def test_paged_calls_on_other_kernels_are_refused():
    from torch_fa4.kernels.host import fwd_launch

    assert "paged" in fwd_launch.layout_reason(_paged_call(128, 16))
    assert fwd_launch.layout_reason(_paged_call(128, 16), paged_kv=True) is None


def test_gathered_copy_matches_the_reference():
    """The contiguous copy of the fallback: the same attention, dense and packed queries, pages past
    each sequence's end zeros whatever their table entries name."""
    from torch_fa4 import reference
    from torch_fa4.kernels.host.paged_kv import gathered

    used = [13, 0, 40]
    k_cache, v_cache, table, _, _ = paged_cache(used, 3, 2, 16)
    seqused = torch.tensor(used, dtype=torch.int32)
    q = torch.randn(3, 2, 4, 16, dtype=torch.float64)
    call = AttentionCall(q=q, k=k_cache, v=v_cache, scale=0.25, causal=True, seqused_k=seqused,
                         page_table=table)
    flat = gathered(call)
    assert flat.page_table is None and flat.k.shape == (3, table.shape[1] * 3, 2, 16)
    assert not flat.k.isnan().any() and not flat.v.isnan().any()
    for a, b in zip(reference.forward(call), reference.forward(flat)):
        assert torch.equal(a, b)
    cu = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    packed = AttentionCall(q=q.flatten(0, 1), k=k_cache, v=v_cache, scale=0.25, causal=True,
                           seqused_k=seqused, page_table=table, cu_seqlens_q=cu, max_seqlen_q=2)
    flat = gathered(packed)
    assert flat.cu_seqlens_k.tolist() == [0, flat.max_seqlen_k, 2 * flat.max_seqlen_k, 3 * flat.max_seqlen_k]
    for a, b in zip(reference.forward(packed), reference.forward(flat)):
        assert torch.equal(a, b)


# ---- compiles of the paged sm90 variants ---------------------------------------------------------

cutlass_missing = pytest.mark.skipif(
    not all(__import__("importlib").util.find_spec(m) for m in ("cutlass", "tvm_ffi")),
    reason="needs CuTe DSL and TVM-FFI")


def _packed_decode(D, page_size):
    from torch_fa4.kernels.host import packed_gqa

    return packed_gqa.pack(_paged_call(D, page_size))


def _mods_call(D, page_size, mask_mod=_stripes):
    from torch_fa4 import mods as M
    from torch_fa4.mods import registry

    key, aux = M.prepare(_decay, mask_mod)
    call = _paged_call(D, page_size, sq=64, causal=True)
    call.mod_key, call.mods, call.aux_tensors = key, registry.lookup(key), tuple(aux)
    return call


PAGED_VARIANTS = {
    "d128_decode_page16": lambda: (_packed_decode(128, 16), {}),
    "d128_decode_page256_split": lambda: (_packed_decode(128, 256), dict(split_ways=4)),
    "d64_packed_causal_page64": lambda: (_paged_call(64, 64, sq=5, causal=True, packed=True), {}),
    "d256_page64_tile64": lambda: (_paged_call(256, 64, sq=40, causal=True), {}),
    "d128_mods_page16": lambda: (_mods_call(128, 16), {}),
    # causal calls and score_mod-only ones run the dynamic schedule's persistent loop
    "d128_causal_prefill_page16": lambda: (_paged_call(128, 16, sq=1024, hkv=8, causal=True), {}),
    "d128_score_mod_causal_page256": lambda: (_mods_call(128, 256, mask_mod=None), {}),
    "d96_page32": lambda: (_paged_call(96, 32, sq=300), {}),
}


@cutlass_missing
@pytest.mark.parametrize("name", list(PAGED_VARIANTS))
def test_paged_variant_compiles_to_tma_page_loads(name, tmp_path, monkeypatch):
    from sass import sass_of
    from torch_fa4.kernels.sm90 import fwd_host

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    call, overrides = PAGED_VARIANTS[name]()
    assert fwd_host.unsupported_reason(call) is None, fwd_host.unsupported_reason(call)
    cfg = fwd_host.default_config(call, **overrides)
    assert cfg.page_box
    if name.startswith(("d128_decode", "d128_causal", "d128_score_mod")):
        assert cfg.persistent and cfg.dynamic_schedule == ("causal" in name)
    fwd_host.compile_fwd(cfg, dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    assert "HGMMA" in sass
    loads = sass.count("UTMALDG")
    # a K / V tile is tile_n / page_box boxes, each (D / 64) TMA loads of 64 columns
    assert loads >= 2 * (cfg.tile_n // cfg.page_box), f"{loads} TMA loads"
    assert "LDL" not in sass and "STL" not in sass, "local memory in a paged variant"
    assert "SHFL" in sass or cfg.page_box == cfg.tile_n, "page ids not handed from lane to lane"


@cutlass_missing
def test_paged_launch_arguments_match_the_compiled_signature(monkeypatch):
    """forward() passes the page table where the compiled paged kernel expects it: with CPU tensors
    the launch gets past the arity check and stops at the device check, which lists the bound
    arguments."""
    from torch_fa4.kernels.sm90 import fwd_host

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    call = _paged_call(128, 16, sq=4, causal=True)
    call.q = torch.randn(2, 4, 8, 128).bfloat16()
    call.k = call.v = torch.randn(10, 16, 2, 128).bfloat16()
    text = cpu_launch_error(fwd_host, call)
    assert "device_type=cuda" in text, text
    assert "mPageTable: Tensor([n" in text, text


def test_single_row_packed_queries_run_as_the_dense_decode():
    """Continuous batching's decode step (packed queries, one per sequence, over a paged cache) is
    the dense one-row call on views of the same q and out; its LSE comes back transposed."""
    from torch_fa4 import reference
    from torch_fa4.kernels.host import packed_gqa

    used = [9, 0, 30]
    k_cache, v_cache, table, _, _ = paged_cache(used, 8, 2, 16)
    q = torch.randn(3, 4, 16, dtype=torch.float64)
    cu = torch.arange(4, dtype=torch.int32)
    call = AttentionCall(q=q, k=k_cache, v=v_cache, scale=0.25, causal=True, page_table=table, cu_seqlens_q=cu,
                         max_seqlen_q=1, seqused_k=torch.tensor(used, dtype=torch.int32))
    assert packed_gqa.single_rows(call)
    want_out, want_lse = reference.forward(call)
    out, lse = torch.full_like(want_out, float("nan")), torch.full_like(want_lse, float("nan"))
    dense, dense_out, dense_lse = packed_gqa.as_dense(call, out, lse)
    assert dense_lse.dtype == lse.dtype
    assert dense.q.shape == (3, 1, 4, 16) and dense.q.data_ptr() == q.data_ptr() and not dense.is_varlen
    assert dense_out.data_ptr() == out.data_ptr() and dense_lse.shape == (3, 4, 1)
    got_out, got_lse = reference.forward(dense)
    dense_out.copy_(got_out)
    assert torch.equal(out, want_out) and torch.equal(got_lse.view(3, 4).t(), want_lse)
    assert packed_gqa.applies(dense)  # and on to the packed GQA rows
    for other in (dict(max_seqlen_q=2), dict(page_table=None), dict(cu_seqlens_q=torch.tensor([0, 1, 1, 3],
                                                                                               dtype=torch.int32))):
        changed = AttentionCall(**{**call.__dict__, **other})
        if "cu_seqlens_q" in other:
            changed.max_seqlen_q = 2
        assert not packed_gqa.single_rows(changed)


@pytest.mark.parametrize("hq", [2, 8])
def test_sm90_entry_plumbs_single_row_packed_queries(monkeypatch, hq):
    """The sm90 forward's entry on a one-row packed call: the dense call, packed GQA on top where
    Hq > Hkv, the kernel's out / lse views of the call's buffers and the LSE copied back. The kernel
    is stood in for by the reference writing into the views it is handed."""
    from torch_fa4 import reference
    from torch_fa4.kernels import sm90
    from torch_fa4.kernels.sm90 import fwd_host

    seen = []

    def kernel(call, out, lse, **kw):
        seen.append(tuple(call.q.shape))
        o, l = reference.forward(call)
        out.copy_(o)
        lse.copy_(l)

    monkeypatch.setattr(fwd_host, "forward", kernel)
    used = [17, 0, 40, 3]
    k_cache, v_cache, table, _, _ = paged_cache(used, 8, 2, 16)
    q = torch.randn(4, hq, 16, dtype=torch.float64)
    call = AttentionCall(q=q, k=k_cache, v=v_cache, scale=0.25, causal=True, page_table=table,
                         cu_seqlens_q=torch.arange(5, dtype=torch.int32), max_seqlen_q=1,
                         seqused_k=torch.tensor(used, dtype=torch.int32))
    want_out, want_lse = reference.forward(call)
    out, lse = torch.full_like(want_out, float("nan")), torch.full_like(want_lse, float("nan"))
    sm90.forward(call, out, lse)
    assert seen == [(4, hq // 2, 2, 16) if hq > 2 else (4, 1, 2, 16)]
    assert torch.allclose(out, want_out, rtol=0, atol=1e-12) and torch.equal(lse.isinf(), want_lse.isinf())
    assert torch.allclose(lse[~lse.isinf()], want_lse[~want_lse.isinf()], rtol=0, atol=1e-12)
