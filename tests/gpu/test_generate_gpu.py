"""generate() with attn_implementation="fa4" on the GPU, against "sdpa": a small random-weight Llama
in bf16, a left-padded batch, greedy decoding, DynamicCache and StaticCache. The first step's logits
agree to bf16 accuracy; tokens agree except after near-ties; a spy on torch_fa4's dispatcher proves
that prefill and every decode step ran torch_fa4's GPU kernels, not the reference. Continuous
batching ("paged|fa4", where Transformers registers paged implementations) likewise."""

import inspect

import pytest
import torch

from gpu_harness import record_kernel_picks
from torch_fa4 import sdpa

transformers = pytest.importorskip("transformers")

import torch_fa4  # noqa: E402,F401  (registers "fa4")

served = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in sdpa.SUPPORTED_MAJORS
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not served, reason="needs a CUDA sm_90/sm_100 device")]

VOCAB = 1000
PROMPT = 48
NEW_TOKENS = 12


@pytest.fixture
def kernels_used(monkeypatch):
    """(direction, query rows, kernel module name or None for the reference) per dispatch."""
    def entry(call, direction, module):
        rows = call.q.shape[1] if call.q.dim() == 4 else call.q.shape[0]
        return direction, rows, None if module is None else module.__name__

    return record_kernel_picks(monkeypatch, entry)


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=256,
        initializer_range=0.05,
    )
    return transformers.LlamaForCausalLM(cfg).eval().to(device="cuda", dtype=torch.bfloat16)


def _left_padded(lengths):
    ids = torch.zeros(len(lengths), PROMPT, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, PROMPT - n:] = torch.randint(1, VOCAB, (n,))
        mask[row, PROMPT - n:] = 1
    return ids.cuda(), mask.cuda()


def _cache(kind, model):
    if kind == "dynamic":
        return transformers.DynamicCache(config=model.config)
    return transformers.StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS + 8)


def _generate(model, impl, ids, mask, cache, compiled=False):
    """Greedy generation; a static cache on CUDA makes generate() compile the decode step unless
    `compiled` is False."""
    model.set_attn_implementation(impl)
    cache_arg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True, disable_compile=not compiled, **{cache_arg: cache})


def _clear_disagreements(ours, ref):
    """Rows whose first differing token is not a near-tie: the reference's gap between the two
    candidates exceeds twice the two implementations' largest logit difference at that step."""
    start = ref.sequences.shape[1] - len(ref.logits)
    bad = []
    for row in range(ref.sequences.shape[0]):
        differ = (ours.sequences[row, start:] != ref.sequences[row, start:]).nonzero()
        if len(differ):
            step = int(differ[0])
            a, b = ours.logits[step][row].float(), ref.logits[step][row].float()
            mine, theirs = ours.sequences[row, start + step], ref.sequences[row, start + step]
            if b[theirs] - b[mine] > 2 * (a - b).abs().max():
                bad.append(row)
    return bad


@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "static-compiled"])
def test_generate_bf16_matches_sdpa_on_kernels(cache_kind, kernels_used):
    model = _llama()
    ids, mask = _left_padded([48, 40, 33, 17, 9, 48, 25, 1])
    compiled = cache_kind == "static-compiled"
    kind = cache_kind.split("-")[0]
    ref = _generate(model, "sdpa", ids, mask, _cache(kind, model), compiled)
    assert not kernels_used
    ours = _generate(model, "fa4", ids, mask, _cache(kind, model), compiled)

    first, first_ref = ours.logits[0].float(), ref.logits[0].float()
    assert not torch.isnan(first).any()
    assert ((first - first_ref).norm() / first_ref.norm()).item() < 2e-2
    assert _clear_disagreements(ours, ref) == []
    same = (ours.sequences == ref.sequences).all(dim=1)
    assert same.float().mean() >= 0.5, f"{int(same.sum())} of {len(same)} rows generated identical tokens"

    forward = [(rows, name) for direction, rows, name in kernels_used if direction == "forward"]
    decode = [name for rows, name in forward if rows == 1]
    assert all(name is not None for _, name in forward), f"reference ran: {forward}"
    if compiled:  # (replayed graphs do not run the dispatcher again)
        assert decode
    else:
        assert len(decode) == (NEW_TOKENS - 1) * model.config.num_hidden_layers, forward


def test_generate_without_padding_static_cache_on_kernels(kernels_used):
    model = _llama()
    ids = torch.randint(1, VOCAB, (4, PROMPT), device="cuda")
    mask = torch.ones_like(ids)
    ref = _generate(model, "sdpa", ids, mask, _cache("static", model))
    ours = _generate(model, "fa4", ids, mask, _cache("static", model))
    assert _clear_disagreements(ours, ref) == []
    forward = [name for direction, _, name in kernels_used if direction == "forward"]
    assert forward and all(name is not None for name in forward), kernels_used


def test_continuous_batching_on_kernels(kernels_used):
    """generate_batch with "paged|fa4" where this Transformers registers paged implementations by
    name (see torch_fa4/integrations/transformers_paged.py for the versions that do not)."""
    from transformers.generation.continuous_batching import continuous_api

    if "is not supported for continuous batching" in inspect.getsource(
            continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn):
        pytest.skip("this Transformers refuses non-flash implementations in continuous batching")
    model = _llama()
    fields = transformers.generation.configuration_utils.ContinuousBatchingConfig.__dataclass_fields__
    size = {"page_size": 16} if "page_size" in fields else {"block_size": 16}
    cb_config = transformers.generation.configuration_utils.ContinuousBatchingConfig(
        num_blocks=128, max_batch_tokens=256, **size)
    gen_config = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                                               pad_token_id=0)
    prompts = [torch.randint(1, VOCAB, (n,)).tolist() for n in (40, 7, 23, 1, 64, 31)]
    tokens = {}
    for impl in ("paged|sdpa", "paged|fa4"):
        model.set_attn_implementation(impl)
        out = model.generate_batch(inputs=prompts, generation_config=gen_config,
                                   continuous_batching_config=cb_config)
        tokens[impl] = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    first_same = [a[0] == b[0] for a, b in zip(tokens["paged|fa4"], tokens["paged|sdpa"])]
    assert sum(first_same) >= len(prompts) - 1, tokens
    forward = [name for direction, _, name in kernels_used if direction == "forward"]
    assert forward and all(name is not None for name in forward), kernels_used


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_example_script_on_gpu(cache, capsys):
    """examples/generate.py at its GPU defaults: it checks its own token agreement; the timings it
    prints are shown in the test log."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "generate.py")
    spec = importlib.util.spec_from_file_location("example_generate_gpu", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--cache", cache])
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + out)
    assert "fa4:" in out and "sdpa:" in out
