"""examples/generate.py runs on CPU at a tiny size: both implementations time a generation and agree
on every token; its agreement check flags a token chosen against a clear margin."""

import importlib.util
import os

import pytest
import torch

pytest.importorskip("transformers")

_PATH = os.path.join(os.path.dirname(__file__), "..", "examples", "generate.py")
TINY = ["--batch", "2", "--prompt", "6", "--new-tokens", "3", "--layers", "1", "--heads", "2",
        "--head-dim", "16"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("example_generate", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.CUDA:
        pytest.skip("the CPU sizes are the point here; tests/gpu/test_generate_gpu.py covers the GPU")
    return module


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_example_runs_and_agrees(example, capsys, cache):
    example.main(TINY + ["--cache", cache])
    out = capsys.readouterr().out
    for implementation in ("fa4", "sdpa"):
        assert f"{implementation}:" in out and "tokens/s" in out
    assert "rows generating identical tokens: 2/2" in out


def test_agreement_check_flags_a_clear_disagreement(example):
    args = example.parse_args(TINY)
    torch.manual_seed(0)
    model = example.build_model(args)
    inputs = example.padded_prompts(args, model.config.vocab_size, model.device)
    ref, _ = example.timed_generate(model, "sdpa", inputs, args)
    assert example.disagreements(ref, ref) == []
    ours = type(ref)(**{k: v for k, v in ref.items()})
    ours.sequences = ref.sequences.clone()
    prompt = ref.sequences.shape[1] - len(ref.logits)
    worst = ref.logits[0][1].argmin()  # the token the reference scored lowest at the first step
    ours.sequences[1, prompt] = worst
    assert example.disagreements(ours, ref) == [1]
