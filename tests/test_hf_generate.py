"""generate() with attn_implementation="fa4" against "sdpa", on CPU (torch_fa4's reference path):
a small random-weight Llama, padded batches, greedy decoding, DynamicCache and StaticCache. Tokens
and logits agree step by step, and every decode step hands torch_fa4 the cache's own tensors
(views of its storage: nothing unpadded, packed or copied)."""

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_fa4  # noqa: E402
from _greedy_decoding import assert_same_greedy_decoding  # noqa: E402
from torch_fa4.integrations import transformers as hf  # noqa: E402

hf.register_if_available()

VOCAB = 97
PROMPT = 9
NEW_TOKENS = 6


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.2,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _batch(padding):
    """Three prompts of lengths 9, 5 and 2, padded as asked (token 0 is the pad token)."""
    ids = torch.randint(1, VOCAB, (3, PROMPT))
    mask = torch.ones(3, PROMPT, dtype=torch.long)
    for row, n in ((1, 5), (2, 2)):
        pad = slice(0, PROMPT - n) if padding == "left" else slice(n, PROMPT)
        mask[row, pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _cache(kind, model):
    if kind == "dynamic":
        return transformers.DynamicCache(config=model.config)
    return transformers.StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS + 3)


def _generate(model, impl, ids, mask, cache):
    model.set_attn_implementation(impl)
    # (the cache argument was renamed `cache` in later Transformers 5.x)
    cache_arg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                          **{cache_arg: cache})


def _assert_same_greedy_decoding(ours, ref, tol=1e-4):
    """The two runs decode alike (logits to `tol`, tokens up to a near-tie): see
    tests/_greedy_decoding.py."""
    assert len(ours.logits) == len(ref.logits) == NEW_TOKENS
    assert_same_greedy_decoding(ours.logits, ref.logits, ours.sequences, ref.sequences, tol, "sdpa")


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_generate_matches_sdpa(cache_kind, padding):
    model = _llama()
    ids, mask = _batch(padding)
    ref = _generate(model, "sdpa", ids, mask, _cache(cache_kind, model))
    ours = _generate(model, "fa4", ids, mask, _cache(cache_kind, model))
    _assert_same_greedy_decoding(ours, ref)


@pytest.fixture
def attention_calls(monkeypatch):
    """Every torch_fa4.attention call the integration makes: (q, k, v, keyword arguments)."""
    calls = []
    original = torch_fa4.attention

    def spy(q, k, v, **kwargs):
        calls.append((q, k, v, kwargs))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(torch_fa4, "attention", spy)
    return calls


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_decode_reads_the_cache_in_place(cache_kind, monkeypatch):
    """In each decode step of a left-padded batch, the keys and values reaching torch_fa4 are views
    of the storage the cache holds for that layer at that moment, batch-shaped, with the padding as a
    mask_mod: no step unpads, gathers or copies the cache."""
    model = _llama()
    ids, mask = _batch("left")
    cache = _cache(cache_kind, model)
    seen = []
    original = torch_fa4.attention

    def check_against_cache(q, k, v, **kwargs):
        # (runs inside the layer's attention: the cache already holds this step's keys)
        if q.shape[1] == 1:
            layer_storage = {(_storage(layer.keys), _storage(layer.values)) for layer in cache.layers}
            seen.append(((_storage(k), _storage(v)) in layer_storage, k.shape[0], kwargs))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(torch_fa4, "attention", check_against_cache)
    # The mask builder tells the layers whether a mask holds padding: no layer asks the device.
    from torch_fa4.integrations import transformers_attention

    unknown = []
    memo = transformers_attention._HAS_PADDING
    original_get = memo.get

    def get(*args):
        found = original_get(*args)
        if found is None:
            unknown.append(args)
        return found

    monkeypatch.setattr(memo, "get", get)
    _generate(model, "fa4", ids, mask, cache)
    assert not unknown, "a layer had to read the mask from the device"
    steps = NEW_TOKENS - 1  # the first token comes from the prefill
    assert len(seen) == steps * model.config.num_hidden_layers
    for in_cache, batch, kwargs in seen:
        assert in_cache, "a decode step handed torch_fa4 keys/values that are not the cache's storage"
        assert batch == ids.shape[0]
        assert kwargs.get("cu_seqlens_k") is None and kwargs.get("mask_mod") is not None


def test_static_cache_without_padding_is_a_dense_call(attention_calls):
    """No padding and a static cache: the keys are the written slots of the cache (a view), with
    neither a mask_mod nor varlen arguments."""
    model = _llama()
    ids = torch.randint(1, VOCAB, (2, PROMPT))
    cache = _cache("static", model)
    _generate(model, "fa4", ids, torch.ones_like(ids), cache)
    decode = [(q, k, kw) for q, k, v, kw in attention_calls if q.shape[1] == 1]
    assert decode
    for q, k, kwargs in decode:
        assert not {"mask_mod", "cu_seqlens_k", "seqused_k"} & {n for n, x in kwargs.items() if x is not None}
        assert k.shape[1] < cache.layers[0].keys.shape[2]  # the written slots only


def test_padding_mask_keeps_decode_packed_gqa():
    """Decode's packed GQA (the query heads of a KV head as rows of one tile) reads each K/V tile
    once per KV head; the padding mask_mod reads only the batch and key, so it keeps that, while a
    mask_mod reading the query position does not."""
    from torch_fa4 import mods
    from torch_fa4.call import AttentionCall
    from torch_fa4.integrations.transformers_attention import key_padding_mask
    from torch_fa4.kernels.host import packed_gqa
    from torch_fa4.mods import registry

    q, k = torch.empty(2, 1, 8, 64), torch.empty(2, 30, 2, 64)

    def call(mask_mod, q=q):
        key, aux = mods.prepare(None, mask_mod)
        return AttentionCall(q=q, k=k, v=k, scale=0.125, causal=True, mod_key=key, mods=registry.lookup(key),
                             aux_tensors=tuple(aux))

    padding = key_padding_mask(torch.ones(2, 30, dtype=torch.bool))
    assert packed_gqa.applies(call(padding))
    assert not packed_gqa.applies(call(mods.causal_mask))  # reads q_idx
    assert not packed_gqa.applies(call(lambda b, h, q_idx, kv_idx: h >= 1))  # reads the head
    assert not packed_gqa.applies(call(padding, q=torch.empty(2, 2, 8, 64)))  # two query rows


@pytest.mark.parametrize("padding", ["left", "none"])
def test_compiled_decode_with_static_cache_matches_sdpa(padding):
    """On a GPU, generate() compiles the decode step of a static cache by itself; here it is made to
    on the CPU (Dynamo with the eager backend: the graph capture is what is checked). The mask the
    compiled step builds covers the whole cache, the same shape every step, with no device read."""
    from transformers.generation.configuration_utils import CompileConfig

    if not hasattr(CompileConfig, "_compile_all_devices"):
        pytest.skip("this Transformers has no way to compile generate() on a CPU")
    model = _llama()
    ids, mask = _batch("left")
    if padding == "none":
        ids, mask = ids.clamp_min(1), torch.ones_like(mask)
    from torch._dynamo.utils import counters

    outs = {}
    for impl in ("sdpa", "fa4"):
        torch._dynamo.reset()
        counters.clear()
        config = CompileConfig(backend="eager", fullgraph=True)  # (a graph break would run eager)
        config._compile_all_devices = True
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=0, cache_implementation="static",
                                    compile_config=config, output_logits=True, return_dict_in_generate=True)
        # one graph for every step: a mask whose shape grew per step would recompile (and on a GPU
        # record a new CUDA graph per step)
        assert counters["stats"]["unique_graphs"] == 1, f"{impl}: {dict(counters['stats'])}"
    _assert_same_greedy_decoding(outs["fa4"], outs["sdpa"])
