"""Generation speed with torch_fa4 in Transformers: attn_implementation="fa4" against "sdpa".

A Llama with random weights (built from a config: no download) generates greedily from a batch of
left-padded prompts with each implementation. The script prints tokens per second (generated tokens
over the time of prefill + decode) and checks that both generate the same tokens. On a CUDA GPU the
model is bigger and runs in bf16 (torch_fa4's kernels on an H100 / H200); on a CPU it is small and
runs in fp32 (torch_fa4's exact reference).

    python examples/generate.py [--batch 8] [--prompt 512] [--new-tokens 128] [--cache static]
"""

import argparse
import time

import torch
import transformers

import torch_fa4  # noqa: F401  (makes attn_implementation="fa4" available)

CUDA = torch.cuda.is_available()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8 if CUDA else 2)
    parser.add_argument("--prompt", type=int, default=512 if CUDA else 12, help="longest prompt (tokens)")
    parser.add_argument("--new-tokens", type=int, default=128 if CUDA else 6)
    parser.add_argument("--layers", type=int, default=8 if CUDA else 2)
    parser.add_argument("--heads", type=int, default=16 if CUDA else 4,
                        help="query heads (a quarter of them KV heads)")
    parser.add_argument("--head-dim", type=int, default=128 if CUDA else 16)
    parser.add_argument("--cache", choices=["dynamic", "static"], default="dynamic")
    return parser.parse_args(argv)


def build_model(args):
    hidden = args.heads * args.head_dim
    config = transformers.LlamaConfig(
        vocab_size=32000 if CUDA else 256, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 4), head_dim=args.head_dim,
        max_position_embeddings=args.prompt + args.new_tokens, initializer_range=0.1,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    return model.to(device="cuda" if CUDA else "cpu", dtype=torch.bfloat16 if CUDA else torch.float32)


def padded_prompts(args, vocab_size, device):
    """`batch` random prompts, the longest `prompt` tokens and the others shorter, left-padded."""
    lengths = [max(1, args.prompt - row * args.prompt // (2 * args.batch)) for row in range(args.batch)]
    input_ids = torch.zeros(args.batch, args.prompt, dtype=torch.long)
    attention_mask = torch.zeros(args.batch, args.prompt, dtype=torch.long)
    for row, n in enumerate(lengths):
        input_ids[row, args.prompt - n:] = torch.randint(1, vocab_size, (n,))
        attention_mask[row, args.prompt - n:] = 1
    return dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))


def timed_generate(model, implementation, inputs, args, repeats=2):
    """The generation and its best time of `repeats`, after a short warm-up."""
    model.set_attn_implementation(implementation)
    options = dict(**inputs, do_sample=False, pad_token_id=0, cache_implementation=args.cache,
                   output_logits=True, return_dict_in_generate=True)
    model.generate(**options, max_new_tokens=2)  # warm-up (torch_fa4 compiles a kernel on its first use)
    best = float("inf")
    for _ in range(repeats):
        if CUDA:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(**options, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
        if CUDA:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return out, best


def first_differences(ours, ref):
    """Per row, the first generated position where the two differ (None where they never do)."""
    prompt = ref.sequences.shape[1] - len(ref.logits)
    differ = ours.sequences[:, prompt:] != ref.sequences[:, prompt:]
    return [int(row.nonzero()[0]) if row.any() else None for row in differ]


def disagreements(ours, ref):
    """Rows whose tokens differ, other than by a near-tie: at the first step where a row's tokens
    differ, the gap between the two candidates' reference logits must lie within the two
    implementations' own logit difference there (rounding can then pick either)."""
    prompt = ref.sequences.shape[1] - len(ref.logits)
    bad = []
    for row, step in enumerate(first_differences(ours, ref)):
        if step is not None:
            a, b = ours.logits[step][row].float(), ref.logits[step][row].float()
            mine, theirs = ours.sequences[row, prompt + step], ref.sequences[row, prompt + step]
            if b[theirs] - b[mine] > 2 * (a - b).abs().max():
                bad.append(row)
    return bad


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(0)
    model = build_model(args)
    inputs = padded_prompts(args, model.config.vocab_size, model.device)
    print(f"Llama, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {model.dtype} on "
          f"{model.device}; batch {args.batch}, prompts up to {args.prompt} tokens, "
          f"{args.new_tokens} new tokens, {args.cache} cache")
    results = {}
    for implementation in ("fa4", "sdpa"):
        results[implementation], seconds = timed_generate(model, implementation, inputs, args)
        tokens_per_second = args.batch * args.new_tokens / seconds
        print(f"{implementation:>5}: {tokens_per_second:10.1f} tokens/s ({seconds:.3f} s)")
    ours, ref = results["fa4"], results["sdpa"]
    first = first_differences(ours, ref)
    print(f"rows generating identical tokens: {first.count(None)}/{len(first)}")
    if first.count(None) < len(first):  # bf16: a random model's flat logits have near-ties
        print(f"tokens agreeing before each row's first difference (a near-tie): {first}")
    bad = disagreements(ours, ref)
    assert not bad, f"rows {bad}: fa4 and sdpa chose different tokens without a near-tie"


if __name__ == "__main__":
    main()
