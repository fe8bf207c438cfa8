"""GPU: attention over paged KV caches (`page_table`) on the sm_90 forward, against float64.

Every case draws fresh inputs: a cache whose pages are handed to the sequences in a random order,
pages no sequence uses filled with NaN, and page-table entries past each sequence's last used page
holding stale ids (-1, ids past the cache, ids of NaN pages), so a read of anything but the used
pages shows. The oracle is tests/naive.py on the used pages gathered into contiguous keys; outputs
are NaN-poisoned before every launch, and a spy on the kernel's host entry says which variant ran:
page sizes the kernel loads by TMA (multiples of 8 dividing the key tile, or multiples of it) must
run paged, the others on the gathered contiguous copy.
"""

import itertools
import math

import pytest
import torch

import torch_fa4
from gpu_harness import SM90_ONLY, capture_graph, poison_forward
from naive import naive_attention, naive_varlen, rel_error

pytestmark = SM90_ONLY

DT = torch.bfloat16


@pytest.fixture
def launches(monkeypatch):
    """Each sm90 forward launch: (paged, page_box, split_ways) of its variant, and the shape of the
    q it ran on; out / lse are poisoned with NaN at the kernel's host entry, and every gather of a
    paged cache is counted."""
    from torch_fa4.kernels.host import paged_kv
    from torch_fa4.kernels.sm90 import fwd_host

    seen = {"launches": [], "gathers": 0, "q_shapes": []}
    real_launch, real_gathered = fwd_host.launch, paged_kv.gathered

    def launch(kernel, cfg, call, leading, split):
        seen["launches"].append((call.page_table is not None, cfg.page_box, cfg.split_ways))
        seen["q_shapes"].append(tuple(call.q.shape))
        real_launch(kernel, cfg, call, leading, split)

    def gathered(call):
        seen["gathers"] += 1
        return real_gathered(call)

    poison_forward(monkeypatch, fwd_host)
    monkeypatch.setattr(fwd_host, "launch", launch)
    monkeypatch.setattr(paged_kv, "gathered", gathered)
    return seen


def paged_cache(used, page_size, hkv, d, max_pages=None, full=False):
    """(k_cache, v_cache, page_table, k, v): a cache of pages of `page_size` keys, sequence b
    holding used[b] keys on pages in a random order, and the same keys contiguous, (B, S, Hkv, D)
    with S = max_pages * page_size (rows past used[b] are zeros there: the oracle masks them)."""
    B = len(used)
    need = [-(-n // page_size) for n in used]
    if max_pages is None:
        max_pages = max(need + [1]) + (0 if full else 2)  # spare entries for stale ids
    spare = 3  # pages no sequence uses: NaN
    num_pages = sum(need) + spare
    k_cache = torch.randn(num_pages, page_size, hkv, d, device="cuda", dtype=DT)
    v_cache = torch.randn(num_pages, page_size, hkv, d, device="cuda", dtype=DT)
    order = torch.randperm(num_pages).tolist()
    unused = order[sum(need):]
    k_cache[unused] = float("nan")
    v_cache[unused] = float("nan")
    stale = [-1, num_pages, 1 << 30, unused[0], -(1 << 31)]
    table = torch.empty(B, max_pages, dtype=torch.int32)
    k = torch.zeros(B, max_pages * page_size, hkv, d, device="cuda", dtype=DT)
    v = torch.zeros_like(k)
    taken = 0
    for b, n in enumerate(used):
        for i in range(max_pages):
            if i < need[b]:
                page = order[taken]
                taken += 1
                table[b, i] = page
                k[b, i * page_size:(i + 1) * page_size] = k_cache[page]
                v[b, i * page_size:(i + 1) * page_size] = v_cache[page]
            else:
                table[b, i] = stale[(b + i) % len(stale)]
    return k_cache, v_cache, table.cuda(), k, v


def check(out, lse, q, k, v, used, varlen=None, **kw):
    """out / lse against float64 on the contiguous keys, within twice the error of eager bf16."""
    if varlen is not None:
        ref, ref_lse = naive_varlen(q, k, v, cu_seqlens_q=varlen, seqused_k=used, device="cuda", **kw)
        low, _ = naive_varlen(q, k, v, cu_seqlens_q=varlen, seqused_k=used, device="cuda",
                              score_dtype=DT, **kw)
    else:
        ref, ref_lse = naive_attention(q, k, v, seqlen_k=used, device="cuda", **kw)
        low, _ = naive_attention(q, k, v, seqlen_k=used, device="cuda", score_dtype=DT, **kw)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    if ref.abs().max() > 0:
        assert rel_error(out, ref) <= 2 * max(rel_error(low, ref), 2 ** -9)
    else:
        assert (out == 0).all()
    dead = (ref_lse == -math.inf).to(lse.device)
    assert (lse[dead] == -math.inf).all()
    diff = (lse.double() - ref_lse.to(lse.device))[~dead]
    assert diff.numel() == 0 or diff.abs().max() < 1e-2


def ran_paged(launches):
    assert launches["gathers"] == 0, "the kernel ran on a gathered copy, not from the pages"
    assert launches["launches"] and all(paged and box > 0 for paged, box, _ in launches["launches"])


def decode_step(used, page_size, hkv, group, d):
    """One causal query row per sequence (`group` query heads per KV head) over a fresh paged cache
    holding used[b] keys of sequence b, through the public API, against float64."""
    k_cache, v_cache, table, k, v = paged_cache(used, page_size, hkv, d)
    q = torch.randn(len(used), 1, hkv * group, d, device="cuda", dtype=DT)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    out, lse = torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=seqused, causal=True,
                                   return_lse=True)
    check(out, lse, q, k, v, used, causal=True)


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode(launches, page_size, group):
    """One query row per sequence (packed GQA where Hq > Hkv), empty, short, ragged and full caches."""
    hkv, d = 2, 128
    used = [0, 700, 1, 2 * 256, 333]
    decode_step(used, page_size, hkv, group, d)
    if page_size == 1:
        assert launches["gathers"] == 1 and all(not paged for paged, _, _ in launches["launches"])
    else:
        ran_paged(launches)
    if group > 1:  # the query heads of each KV head ran as rows of one tile
        assert launches["q_shapes"] == [(len(used), group, hkv, d)]


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("sq", [3, 17, 130])
@pytest.mark.parametrize("causal", [False, True])
def test_query_rows(launches, page_size, sq, causal):
    """A few query rows per sequence (speculative decoding, chunked prefill) on GQA, causal
    bottom-right aligned against each sequence's own length."""
    hkv, group, d = 2, 4, 128
    used = [sq, 1000, 0, 4 * 128 + 7]
    k_cache, v_cache, table, k, v = paged_cache(used, page_size, hkv, d)
    q = torch.randn(len(used), sq, hkv * group, d, device="cuda", dtype=DT)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    out, lse = torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=seqused, causal=causal,
                                   return_lse=True)
    check(out, lse, q, k, v, used, causal=causal)
    ran_paged(launches)


def test_full_caches_without_seqused(launches):
    """No seqused_k: every sequence holds max_pages * page_size keys."""
    used = [4 * 64] * 3
    k_cache, v_cache, table, k, v = paged_cache(used, 64, 4, 128, full=True)
    q = torch.randn(3, 5, 8, 128, device="cuda", dtype=DT)
    out, lse = torch_fa4.attention(q, k_cache, v_cache, page_table=table, causal=True, return_lse=True)
    check(out, lse, q, k, v, used, causal=True)
    ran_paged(launches)


@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_packed_queries(launches, page_size):
    """Packed queries (cu_seqlens_q) over a paged cache: continuous batching's decode rows and
    prefill chunks in one call."""
    hkv, group, d = 2, 4, 128
    rows = [1, 5, 0, 130, 1]
    used = [900, 5, 77, 130 + 200, 1]
    k_cache, v_cache, table, k, v = paged_cache(used, page_size, hkv, d)
    cu = torch.tensor([0, *itertools.accumulate(rows)], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(rows), hkv * group, d, device="cuda", dtype=DT)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    out, lse = torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=seqused, cu_seqlens_q=cu,
                                   max_seqlen_q=max(rows), causal=True, return_lse=True)
    check(out, lse, q, k, v, used, varlen=cu, causal=True)
    ran_paged(launches)


def _decay(score, b, h, q_idx, kv_idx):
    return score - 0.03 * (h + 1) * (q_idx - kv_idx).abs()


def _stripes(b, h, q_idx, kv_idx):
    return (kv_idx + b) % 3 != 0


@pytest.mark.parametrize("feature", ["window", "softcap", "score_mod", "mask_mod"])
@pytest.mark.parametrize("page_size", [16, 128])
def test_features(launches, feature, page_size):
    """Windows, softcap and mods see logical positions: kv_idx is the key's place in its sequence."""
    hkv, group, d, sq = 2, 2, 128, 9
    used = [600, 9, 300]
    k_cache, v_cache, table, k, v = paged_cache(used, page_size, hkv, d)
    q = torch.randn(len(used), sq, hkv * group, d, device="cuda", dtype=DT)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    kw = {"window": dict(window_size=(100, 0), causal=True), "softcap": dict(softcap=20.0, causal=True),
          "score_mod": dict(score_mod=_decay, causal=True), "mask_mod": dict(mask_mod=_stripes)}[feature]
    out, lse = torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=seqused, return_lse=True,
                                   **kw)
    oracle = {"window": dict(window=(100, 0), causal=True), "softcap": dict(softcap=20.0, causal=True),
              "score_mod": dict(score_mod=_decay, causal=True), "mask_mod": dict(mask_mod=_stripes)}[feature]
    check(out, lse, q, k, v, used, **oracle)
    ran_paged(launches)


@pytest.mark.parametrize("d", [64, 96, 192, 256])
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_head_dims(launches, d, page_size):
    """Every head dim; D192 / D256 take 64-key tiles where their own do not fit the page size."""
    used = [500, 64, 1]
    k_cache, v_cache, table, k, v = paged_cache(used, page_size, 2, d)
    q = torch.randn(len(used), 4, 4, d, device="cuda", dtype=DT)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    out, lse = torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=seqused, causal=True,
                                   return_lse=True)
    check(out, lse, q, k, v, used, causal=True)
    ran_paged(launches)


@pytest.mark.parametrize("page_size", [16, 256])
def test_split_decode(launches, page_size):
    """Few long sequences: the keys split across SMs, each piece loading its own pages."""
    hkv, group, d = 4, 8, 128
    decode_step([20000, 32768 - 5], page_size, hkv, group, d)
    ran_paged(launches)
    if group > 1:  # (one query head per KV head keeps the causal mask, whose calls are not split)
        assert launches["launches"][-1][2] > 1, "few long items: the keys are split across SMs"


@pytest.mark.parametrize("page_size", [1, 3, 24, 40])
def test_gathered_page_sizes(launches, page_size):
    """Page sizes no key tile loads by TMA run on a gathered contiguous copy, dense and packed q."""
    used = [100, 0, 61]
    k_cache, v_cache, table, k, v = paged_cache(used, page_size, 2, 128)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    q = torch.randn(len(used), 3, 8, 128, device="cuda", dtype=DT)
    out, lse = torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=seqused, causal=True,
                                   return_lse=True)
    check(out, lse, q, k, v, used, causal=True)
    cu = torch.tensor([0, 3, 6, 9], dtype=torch.int32, device="cuda")
    out, lse = torch_fa4.attention(q.flatten(0, 1), k_cache, v_cache, page_table=table, seqused_k=seqused,
                                   cu_seqlens_q=cu, causal=True, return_lse=True)
    check(out, lse, q.flatten(0, 1), k, v, used, varlen=cu, causal=True)
    assert launches["gathers"] == 2 and all(not paged for paged, _, _ in launches["launches"])


def test_repeated_calls_follow_the_table(launches):
    """A decode loop: the same shapes (a launch record) with a new page table and lengths each step."""
    hkv, d, page_size = 2, 128, 16
    used = [100, 37]
    k_cache, v_cache, table, k, v = paged_cache(used, page_size, hkv, d, max_pages=16)
    q = torch.randn(2, 1, 8, d, device="cuda", dtype=DT)
    for step in range(3):
        seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
        out, lse = torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=seqused,
                                       return_lse=True)
        check(out, lse, q, k, v, used)
        used = [n + 20 for n in used]
        k_cache, v_cache, table, k, v = paged_cache(used, page_size, hkv, d, max_pages=16)
    ran_paged(launches)


def test_compiled(launches):
    """torch.compile(fullgraph=True) runs the paged op (its value checks skipped)."""
    used = [300, 2]
    k_cache, v_cache, table, k, v = paged_cache(used, 64, 2, 128)
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=DT)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    fn = torch.compile(lambda *a: torch_fa4.attention(*a[:3], page_table=a[3], seqused_k=a[4], causal=True,
                                                      return_lse=True), fullgraph=True)
    out, lse = fn(q, k_cache, v_cache, table, seqused)
    check(out, lse, q, k, v, used, causal=True)
    ran_paged(launches)


@pytest.mark.parametrize("page_size", [16, 256, 24])
def test_cuda_graph_replays_follow_the_table(launches, page_size):
    """A serving engine's decode step captured once in a CUDA graph and replayed with new contents
    of the same page table, lengths and cache (in place), the gathered sizes included."""
    hkv, group, d, max_pages = 2, 4, 128, 12
    q = torch.randn(3, 1, hkv * group, d, device="cuda", dtype=DT)
    shape = (3 * max_pages + 3, page_size, hkv, d)
    k_cache = torch.zeros(shape, device="cuda", dtype=DT)
    v_cache = torch.zeros_like(k_cache)
    table = torch.zeros(3, max_pages, dtype=torch.int32, device="cuda")
    seqused = torch.zeros(3, dtype=torch.int32, device="cuda")

    def step():
        return torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=seqused, causal=True)

    def refill(used):
        kc, vc, t, k, v = paged_cache(used, page_size, hkv, d, max_pages=max_pages)
        k_cache[:kc.shape[0]].copy_(kc)
        v_cache[:vc.shape[0]].copy_(vc)
        table.copy_(t)
        seqused.copy_(torch.tensor(used, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        return k, v

    refill([5, 0, 40])
    graph, out = capture_graph(step)
    for used in ([page_size * 3 + 1, 7, 1], [page_size * max_pages, 0, page_size * 2]):
        k, v = refill(used)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = naive_attention(q, k, v, seqlen_k=used, causal=True, device="cuda")
        low, _ = naive_attention(q, k, v, seqlen_k=used, causal=True, device="cuda", score_dtype=DT)
        assert rel_error(out, ref) <= 2 * max(rel_error(low, ref), 2 ** -9)


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("group", [1, 4])
def test_packed_decode_rows(launches, page_size, group):
    """Continuous batching's decode step: packed queries, one per sequence, over a paged cache. It
    runs as the dense decode (query heads packed as rows, keys split across SMs), its LSE in the
    packed layout."""
    hkv, d = 2, 128
    used = [0, 20000, 5, 9000]
    k_cache, v_cache, table, k, v = paged_cache(used, page_size, hkv, d)
    B = len(used)
    q = torch.randn(B, hkv * group, d, device="cuda", dtype=DT)
    cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    out, lse = torch_fa4.attention(q, k_cache, v_cache, page_table=table, seqused_k=seqused, cu_seqlens_q=cu,
                                   causal=True, return_lse=True)
    check(out, lse, q, k, v, used, varlen=cu, causal=True)
    ran_paged(launches)
    want = (B, group, hkv, d) if group > 1 else (B, 1, hkv, d)
    assert launches["q_shapes"] == [want]
    if group > 1:  # (one query head per KV head keeps the causal mask, whose calls are not split)
        assert launches["launches"][-1][2] > 1, "few long items: the keys are split across SMs"
