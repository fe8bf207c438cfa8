"""GPU time per call with the host kept ahead: implementations side by side, low noise.

    python benchmarks/gpu_time_probe.py --backward --rows 128:1024:1,64:4096:1 \
        [--variant 'NAME={"FwdConfig field": value}'] [--rounds 5] [--out probe.json]

bench.py times each call alone (triton's do_bench: an L2 flush, then events around one call), so
whatever the host spends before the call's first kernel counts too; a backward at 1k tokens
takes ~0.3-0.7 ms of Python against ~0.55 ms of GPU work, and a slow host moment then shows up as
a slow kernel (NOTES Experiment 162). clock_probe.py runs seconds of back-to-back calls to read the
power-limited clock. This probe measures what the GPU itself takes: a sleep kernel is queued
first, so the host enqueues N calls while the GPU is still busy, and events around the N calls
then time the GPU work alone. Rounds rotate the implementations; each row prints the median
TFLOP/s of the rounds, its ratio to flash-attn-4 (else to torch_fa4's defaults) and the
[min-max] spread (0.1-0.5% here, against 2-5% for bench.py's rows).

Rows are D:S:causal (B = 16384 / S, H = 2048 / D, bf16, as the grid), or D:S:causal:MOD with a
score_mod named as in bench._named_score_mods ("alibi", "alibi-kv-q", "relative") or "document" (the
grid's block-sparse document mask, causal rows, FlexAttention compiled as a peer; "document-kept":
the same with causal kept inside the mask_mod rather than folded out as the API does); forward only,
and implementations that take no mods, flash-attn-4 here, sit such rows out. Variants (forward
only): torch_fa4 with FwdConfig overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def _time_ms(fn, calls: int) -> float:
    """GPU milliseconds per call of `calls` calls enqueued behind a sleep kernel."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e8))  # ~50 ms at ~2 GHz: the host runs ahead of the GPU
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def probe_row(D, S, causal, impls, backward, rounds, mod=None):
    B, H = 16384 // S, 2048 // D
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = bench._flops(B, H, S, D, causal, bwd=backward)
    if mod is None:
        fns = {name: make(q, k, v, causal) for name, make in impls.items()}
    else:
        if mod in ("document", "document-kept"):
            mask_mod, doc_flops = bench.document_mask(S)
            mods, flops = dict(mask_mod=mask_mod), doc_flops(B, H, S, D)
            if mod == "document":
                impls = {**impls, "flex": bench.flex_fwd}
            else:  # torch_fa4 with the whole mask as its mask_mod, causal not folded out of it
                mods["fold"] = False
        else:
            mods = dict(score_mod=bench._named_score_mods(H)[mod])
        fns = {}
        for name, make in impls.items():
            try:
                fns[name] = make(q, k, v, causal, **mods)
            except RuntimeError:  # (a peer without mods)
                pass
    for fn in fns.values():  # compile and warm
        for _ in range(3):
            fn()
    calls = max(4, 40 * 1024 // S)
    rates = {name: [] for name in fns}
    for rnd in range(rounds):
        for name, fn in bench.rotated(list(fns.items()), rnd):
            rates[name].append(flops / _time_ms(fn, calls) * 1e-9)
    median = {name: sorted(r)[len(r) // 2] for name, r in rates.items()}
    # ratios to flash-attn-4, or to torch_fa4's defaults on rows flash-attn-4 sits out
    ref_name = "flash-attn-4" if "flash-attn-4" in median else "torch_fa4"
    ref = median.get(ref_name)
    label = f"D{D} S{S // 1024}k{' causal' if causal else ''}{f' {mod}' if mod else ''}"
    print(f"{'bwd' if backward else 'fwd'} {label} (ratio to {ref_name}): " + "  ".join(
        f"{name} {median[name]:.1f}{f' ({median[name] / ref:.3f})' if ref else ''} [{min(r):.0f}-{max(r):.0f}]"
        for name, r in rates.items()), flush=True)
    return [dict(D=D, S=S, causal=causal, mod=mod, backward=backward, impl=name, tflops=median[name], rounds=r)
            for name, r in rates.items()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128:1024:1,64:4096:1", help="D:S:causal[:MOD],...")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=JSON: torch_fa4's forward with these FwdConfig overrides")
    ap.add_argument("--no-peer", action="store_true", help="leave flash-attn-4 out")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    impls = {"torch_fa4": bench.ours_bwd if args.backward else bench.ours_fwd}
    if not args.no_peer:
        impls["flash-attn-4"] = bench.fa4_bwd if args.backward else bench.fa4_fwd
    impls.update(bench.variant_makers(args.variant, args.backward, ap.error))
    results = []
    for spec in args.rows.split(","):
        D, S, c, *mod = spec.split(":")
        if mod and args.backward:
            ap.error("score_mod rows are forward only")
        results += probe_row(int(D), int(S), bool(int(c)), impls, args.backward, args.rounds, *mod)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
