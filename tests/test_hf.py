"""attn_implementation="fa4" in Transformers, on CPU (torch_fa4's exact reference path): tiny Llama-,
Mistral- and Gemma2-style models built from configs give eager's logits with padded batches, a KV
cache, static caches, packed sequences, and through generate(); unsupported features raise errors
naming them; registration is lazy."""

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _greedy_decoding import assert_same_greedy_decoding  # noqa: E402
from torch_fa4.integrations import transformers as hf  # noqa: E402
from torch_fa4.integrations.transformers_mask import unserved_mask_feature  # noqa: E402

hf.register_if_available()

VOCAB = 101


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.2,
    )
    return transformers.LlamaForCausalLM(cfg)


def _mistral():
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, sliding_window=5, initializer_range=0.2,
    )
    return transformers.MistralForCausalLM(cfg)


def _gemma2():
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4,
        query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=30.0,
        initializer_range=0.2,
    )
    return transformers.Gemma2ForCausalLM(cfg)


MODELS = {"llama": _llama, "mistral": _mistral, "gemma2": _gemma2}


def _build(name, impl="eager"):
    model = MODELS[name]().eval()
    model.set_attn_implementation(impl)
    return model


def _logits(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits


def _padding_mask(b, s, kind):
    mask = torch.ones(b, s, dtype=torch.long)
    if kind == "left":
        mask[1, :4] = 0
        mask[2, :s - 2] = 0
    elif kind == "right":
        mask[1, s - 3:] = 0
        mask[2, 2:] = 0
    return mask


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_logits_match_eager(name, padding):
    model = _build(name)
    ids = torch.randint(0, VOCAB, (3, 11))
    mask = _padding_mask(3, 11, padding)
    ref = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    out = _logits(model, "fa4", input_ids=ids, attention_mask=mask)
    assert model.config._attn_implementation == "fa4"
    valid = mask.bool()  # padded query rows carry no meaning in either implementation
    assert not torch.isnan(out[valid]).any()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_bf16_logits_match_eager(name):
    model = _build(name).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (3, 9))
    mask = _padding_mask(3, 9, "left")
    ref = _logits(model, "eager", input_ids=ids, attention_mask=mask).float()
    out = _logits(model, "fa4", input_ids=ids, attention_mask=mask).float()
    valid = mask.bool()
    assert not torch.isnan(out[valid]).any()
    err = (out[valid] - ref[valid]).norm() / ref[valid].norm()
    assert err < 2e-2, err


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_and_decode_against_cache(name):
    """Queries shorter than the cached keys: causal must be bottom-right aligned (Sq = 3, then 1)."""
    model = _build(name)
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :2] = 0  # left padding in the first chunk
    results = {}
    for impl in ("eager", "fa4"):
        model.set_attn_implementation(impl)
        cache = transformers.DynamicCache(config=model.config)
        chunks = []
        with torch.no_grad():
            for lo, hi in ((0, 8), (8, 11), (11, 12)):
                out = model(input_ids=ids[:, lo:hi], attention_mask=mask[:, :hi], past_key_values=cache, use_cache=True)
                chunks.append(out.logits)
        results[impl] = torch.cat(chunks, dim=1)
    valid = mask.bool()
    torch.testing.assert_close(results["fa4"][valid], results["eager"][valid], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_generate_matches_eager(name):
    model = _build(name)
    ids = torch.randint(0, VOCAB, (3, 7))
    mask = _padding_mask(3, 7, "left")
    outs = {}
    for impl in ("eager", "fa4"):
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                    output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    _assert_same_greedy_decoding(outs["fa4"], outs["eager"])


def _assert_same_greedy_decoding(ours, eager, tol=1e-4):
    """The two runs decode alike (scores to `tol`, tokens up to a near-tie): see
    tests/_greedy_decoding.py."""
    assert_same_greedy_decoding(ours.scores, eager.scores, ours.sequences, eager.sequences, tol, "eager")


def test_generate_with_static_cache_matches_eager():
    """A static cache's unwritten slots must not be attended to."""
    model = _build("llama")
    # Token 0 is the pad token and no attention mask is passed, so generate() would read a drawn 0
    # as padding (a right-padded last prompt token's row is zero under flash-attention's convention,
    # see transformers_attention, while eager attends it): draw real tokens only, this test is about
    # the cache.
    ids = torch.randint(1, VOCAB, (2, 6))
    outs = {}
    for impl in ("eager", "fa4"):
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, cache_implementation="static",
                                    output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    _assert_same_greedy_decoding(outs["fa4"], outs["eager"])


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_sequences_from_position_ids(name):
    """Several documents per row (position_ids restart, no cache): no attention across documents,
    exactly when eager's masks make it so."""
    model = _build(name)
    ids = torch.randint(0, VOCAB, (2, 12))
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]])
    ref = _logits(model, "eager", input_ids=ids, position_ids=position_ids, use_cache=False)
    out = _logits(model, "fa4", input_ids=ids, position_ids=position_ids, use_cache=False)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    alone = _logits(model, "fa4", input_ids=ids[:1, 5:8], position_ids=position_ids[:1, 5:8], use_cache=False)
    torch.testing.assert_close(out[:1, 5:8], alone, rtol=1e-4, atol=1e-4)
    # With a cache Transformers does not separate documents: neither does fa4.
    ref_cached = _logits(model, "eager", input_ids=ids, position_ids=position_ids, use_cache=True)
    out_cached = _logits(model, "fa4", input_ids=ids, position_ids=position_ids, use_cache=True)
    torch.testing.assert_close(out_cached, ref_cached, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_training_step_gradients_match_eager(name):
    model = _build(name)
    model.train()
    ids = torch.randint(0, VOCAB, (3, 9))
    mask = _padding_mask(3, 9, "right")
    labels = ids.masked_fill(mask == 0, -100)
    grads = {}
    for impl in ("eager", "fa4"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["fa4"].keys() == grads["eager"].keys() and grads["fa4"]
    for n in grads["eager"]:
        assert not torch.isnan(grads["fa4"][n]).any(), n
        torch.testing.assert_close(grads["fa4"][n], grads["eager"][n], rtol=1e-3, atol=1e-5, msg=n)


def test_bidirectional_encoder_with_padding_matches_eager():
    """An encoder (is_causal=False): padding only hides keys; every row matches eager, pads included."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=96, initializer_range=0.2)
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, VOCAB, (3, 10))
    mask = _padding_mask(3, 10, "right")
    states = {}
    for impl in ("eager", "fa4"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            states[impl] = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not torch.isnan(states["fa4"]).any()
    torch.testing.assert_close(states["fa4"], states["eager"], rtol=1e-4, atol=1e-4)


def test_from_config_accepts_fa4():
    model = transformers.LlamaForCausalLM._from_config(_llama().config, attn_implementation="fa4")
    assert model.config._attn_implementation == "fa4"
    cfg = transformers.AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    auto = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="fa4")
    assert auto.config._attn_implementation == "fa4"
    with torch.no_grad():
        assert not torch.isnan(auto(input_ids=torch.randint(0, VOCAB, (1, 5))).logits).any()


# ---------------------------------------------------------------------------------------------
# What fa4 refuses, by name
# ---------------------------------------------------------------------------------------------


def test_attention_dropout_in_training_is_refused():
    model = _build("llama")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    model.set_attn_implementation("fa4")
    with pytest.raises(NotImplementedError, match="dropout"):
        model(input_ids=torch.randint(0, VOCAB, (1, 5)))


def test_dense_4d_mask_is_refused():
    from torch_fa4.integrations.transformers_attention import fa4_attention_forward

    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(NotImplementedError, match="4-D attention mask"):
        fa4_attention_forward(torch.nn.Module(), q, q, q, torch.zeros(1, 1, 4, 4))
    with pytest.raises(NotImplementedError, match="sinks"):
        fa4_attention_forward(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(2))


def test_mask_functions_are_inspected():
    mu = pytest.importorskip("transformers.masking_utils")
    assert unserved_mask_feature(mu.causal_mask_function) is None
    assert unserved_mask_feature(mu.sliding_window_causal_mask_function(4)) is None
    assert unserved_mask_feature(mu.and_masks(mu.causal_mask_function, mu.padding_mask_function(torch.ones(1, 3, dtype=torch.bool)))) is None
    assert "chunked" in unserved_mask_feature(mu.chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long)))
    assert "widens" in unserved_mask_feature(mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function))
    assert "custom" in unserved_mask_feature(mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: q >= 0))


def test_mask_overlay_raises_when_building_masks():
    from torch_fa4.integrations.transformers_mask import fa4_mask
    mu = pytest.importorskip("transformers.masking_utils")
    with pytest.raises(NotImplementedError, match="fa4"):
        fa4_mask(1, 4, 4, mask_function=mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv < 2))


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_registration_is_lazy_and_order_independent():
    after = _run(
        "import sys; import torch_fa4; from torch_fa4.integrations import transformers as hf; "
        "hf.register_if_available(); print('transformers' in sys.modules); "
        "from transformers import AttentionInterface; from transformers.masking_utils import AttentionMaskInterface; "
        "print('fa4' in AttentionInterface._global_mapping, 'fa4' in AttentionMaskInterface._global_mapping)"
    )
    assert after == ["False", "True", "True"]
    before = _run(
        "import transformers.modeling_utils; import torch_fa4; "
        "from torch_fa4.integrations import transformers as hf; hf.register_if_available(); "
        "print(hf.is_registered()); import transformers; "
        "model = transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(vocab_size=8, hidden_size=16, "
        "intermediate_size=16, num_hidden_layers=1, num_attention_heads=1, head_dim=16), attn_implementation='fa4'); "
        "from transformers.masking_utils import AttentionMaskInterface; "
        "print(model.config._attn_implementation, 'fa4' in AttentionMaskInterface._global_mapping, hf.is_registered())"
    )
    assert before == ["True", "fa4", "True", "True"]
