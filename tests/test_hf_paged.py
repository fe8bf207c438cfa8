"""Continuous batching (Transformers' generate_batch) with "fa4", end to end on CPU: the tokens of a
small random-weight Llama agree with SDPA's under the same scheduler.

Transformers versions differ in what the attention function is handed (see
torch_fa4/integrations/transformers_paged.py): where it owns the cache write ("paged|<name>"
functions), full-attention layers read the cache through a page table when `torch_fa4.attention`
takes one. The paged signature the tests hold the integration to is

    torch_fa4.attention(q, k_cache, v_cache, page_table=, seqused_k=, cu_seqlens_q=, max_seqlen_q=,
                        causal=, ...)

with k_cache / v_cache (num_pages, page_size, Hkv, D), page_table (B, max_pages) int32, seqused_k
(B,) int32 keys per sequence, q packed (total_q, Hq, D): `paged_reference` below is that function,
written as gather-then-varlen, and stands in for torch_fa4's own during a test.

Later Transformers 5.x refuses, in continuous batching, every attention implementation whose name
lacks "flash" (besides "sdpa" and "paged|eager") before looking at what it does; there the test
lifts that one check (`_allow_any_implementation`) to run "fa4" through the rest of the machinery.
"""

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
cb_api = pytest.importorskip("transformers.generation.continuous_batching.continuous_api")

import torch_fa4  # noqa: E402
from torch_fa4.integrations import transformers as hf  # noqa: E402
from torch_fa4.integrations import transformers_paged  # noqa: E402

hf.register_if_available()

VOCAB = 89
PAGE = 4  # small pages: every sequence spans several


def paged_reference(attention):
    """The paged signature, over `attention` (torch_fa4's varlen call): gather each sequence's pages,
    then attend. Checks the layouts the signature promises."""

    def paged(q, k, v, *, page_table=None, seqused_k=None, cu_seqlens_q=None, max_seqlen_q=None, **options):
        if page_table is None:
            return attention(q, k, v, seqused_k=seqused_k, cu_seqlens_q=cu_seqlens_q,
                             max_seqlen_q=max_seqlen_q, **options)
        batch = page_table.shape[0]
        assert k.dim() == 4 and v.dim() == 4 and k.shape[:3] == v.shape[:3], (k.shape, v.shape)
        assert page_table.dtype == torch.int32 and page_table.dim() == 2
        assert seqused_k.dtype == torch.int32 and seqused_k.shape == (batch,)
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (batch + 1,) and q.dim() == 3
        page = k.shape[1]
        lengths = seqused_k.tolist()
        assert all(n <= page_table.shape[1] * page for n in lengths)
        gathered = []
        for cache in (k, v):
            pages = [page_table[b, :-(-n // page)].long() for b, n in enumerate(lengths)]  # the used pages
            gathered.append(torch.cat([cache[p].flatten(0, 1)[:n] for p, n in zip(pages, lengths)]))
        cu_k = torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))
        return attention(q, *gathered, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_k,
                         max_seqlen_q=max_seqlen_q, **options)

    return paged


@pytest.fixture
def paged_calls(monkeypatch):
    """torch_fa4.attention with the paged signature (paged_reference over the real one); the list
    collects the page tables it was handed."""
    calls = []
    paged = paged_reference(torch_fa4.attention)

    def attention(q, k, v, *, page_table=None, **kwargs):
        if page_table is not None:
            calls.append(page_table)
        return paged(q, k, v, page_table=page_table, **kwargs)

    monkeypatch.setattr(torch_fa4, "attention", attention)
    return calls


@pytest.fixture
def _allow_any_implementation(monkeypatch):
    """Where Transformers refuses non-"flash" names in continuous batching (see module doc)."""
    source = inspect.getsource(cb_api.ContinuousBatchingManager.switch_to_cb_friendly_attn)
    if "is not supported for continuous batching" in source:
        monkeypatch.setattr(cb_api.ContinuousBatchingManager, "switch_to_cb_friendly_attn",
                            lambda self, model, *args, **kwargs: None)


def _paged_prefix_protocol() -> bool:
    """Whether this Transformers registers "paged|<name>" functions that own the cache update."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    return not transformers_paged._update_takes_kwargs(PagedAttentionCache)


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.2,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _cb_config():
    fields = transformers.generation.configuration_utils.ContinuousBatchingConfig.__dataclass_fields__
    size = {"page_size": PAGE} if "page_size" in fields else {"block_size": PAGE}
    return transformers.generation.configuration_utils.ContinuousBatchingConfig(
        num_blocks=64, max_batch_tokens=32, **size)


def _generate_batch(model, impl, prompts):
    model.set_attn_implementation(impl)
    config = transformers.GenerationConfig(max_new_tokens=7, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(inputs=prompts, generation_config=config,
                               continuous_batching_config=_cb_config())
    return [out[key].generated_tokens for key in sorted(out, key=lambda k: int(k.split("_")[-1]))]


def _implementations():
    if _paged_prefix_protocol():
        return "paged|fa4", "paged|sdpa"
    return "fa4", "sdpa"


@pytest.mark.parametrize("page_table_api", [True, False], ids=["page_table", "gathered"])
def test_generate_batch_matches_sdpa(page_table_api, request, _allow_any_implementation):
    paged_calls = request.getfixturevalue("paged_calls") if page_table_api else None
    model = _llama()
    prompts = [torch.randint(1, VOCAB, (n,)).tolist() for n in (11, 3, 6, 1)]
    ours, reference = _implementations()
    expected = _generate_batch(model, reference, prompts)
    got = _generate_batch(model, ours, prompts)
    assert got == expected
    if page_table_api and _paged_prefix_protocol():
        assert paged_calls, "no attention call read the cache through a page table"


def test_paged_without_cache_is_refused():
    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(ValueError, match="PagedAttentionCache"):
        transformers_paged.fa4_paged_attention_forward(torch.nn.Module(), q, q[:, :2], q[:, :2], None)


def test_pages_from_read_index():
    """Full-attention groups place token t of a request at page_table[t // page] * page + t % page."""
    page = 4
    tables = [[5, 2, 7], [3], [0, 6]]
    lengths = [10, 2, 5]
    read = torch.tensor([tables[b][t // page] * page + t % page
                         for b, n in enumerate(lengths) for t in range(n)])
    cu_k = torch.tensor([0, 10, 12, 17], dtype=torch.int32)
    pages = transformers_paged._pages_from_read_index(read, cu_k, max(lengths), page)
    assert pages.dtype == torch.int32 and pages.shape == (3, 3)
    for b, table in enumerate(tables):
        assert pages[b, :len(table)].tolist() == table


@pytest.mark.parametrize("page_table_api", [True, False], ids=["page_table", "gathered"])
def test_decode_fast_path_writes_then_reads_pages(page_table_api, request):
    """The decode fast path's arguments (one new token per sequence, the raw page cache and its block
    table): the new K/V land after each sequence's cached tokens and nowhere else (an empty sequence
    padding the batch writes nothing), and the output is attention over the sequence's keys, new one
    included."""
    if page_table_api:
        request.getfixturevalue("paged_calls")
    page, hq, hkv, d = 4, 4, 2, 16
    lengths = [5, 1, 9, 0]  # cached tokens + the new one; the last sequence pads the batch
    k_cache, v_cache = torch.randn(2, 10, page, hkv, d).unbind(0)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    block_table = torch.tensor([[7, 2, -1], [4, -1, -1], [0, 9, 3], [-1, -1, -1]], dtype=torch.int32)
    q, k_new, v_new = torch.randn(1, hq, 4, d), torch.randn(1, hkv, 4, d), torch.randn(1, hkv, 4, d)
    cu_q = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 15, 15], dtype=torch.int32)
    out, _ = transformers_paged.fa4_paged_attention_forward(
        torch.nn.Module(), q, k_new, v_new, None, scaling=0.25, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
        max_length_q=1, max_length_k=1, k_cache=k_cache, v_cache=v_cache, block_table=block_table)
    assert out.shape == (1, 4, hq, d)
    assert not out[0, 3].any()  # the padding row
    for b, n in enumerate(lengths[:3]):
        pos = n - 1
        slot = (int(block_table[b, pos // page]), pos % page)
        torch.testing.assert_close(k_cache[slot], k_new[0, :, b])
        torch.testing.assert_close(v_cache[slot], v_new[0, :, b])
        k_before[slot], v_before[slot] = k_new[0, :, b], v_new[0, :, b]
        pages = block_table[b, :-(-n // page)].long()
        keys, values = (c[pages].flatten(0, 1)[:n] for c in (k_cache, v_cache))
        keys, values = (t.repeat_interleave(hq // hkv, dim=1) for t in (keys, values))
        scores = torch.einsum("hd,khd->hk", q[0, :, b].double(), keys.double()) * 0.25
        want = torch.einsum("hk,khd->hd", scores.softmax(-1), values.double())
        torch.testing.assert_close(out[0, b].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)  # nothing else written
