"""Where a call's device time goes: per-kernel time of torch_fa4 and flash-attn-4, side by side.

Runs each implementation of a row (the forward or the backward through autograd, as in bench.py)
under torch.profiler and prints every kernel's mean device time per call, so fixed costs (row
statistics, dQ accumulator zeroing and conversion, memsets) show up next to the main kernel.

    python benchmarks/profile_kernels.py [--bwd] [--rows D:S:causal,...] [--impl torch_fa4]
    python benchmarks/profile_kernels.py --bwd --timeline [--rows ...]

--timeline times calls the way bench.py's do_bench does (an L2 flush, then the call, each call
alone) and prints, per kernel of a call in launch order, its mean start after the flush ends and
its mean duration: idle gaps inside a call (the GPU waiting for the host, or for a dependent
launch) show up as starts later than the previous kernel's end.

Under Nsight Compute (stall reasons of one main-kernel launch, clocks left alone):
    ncu --clock-control none -k regex:Sm90AttentionBackward --launch-skip 3 --launch-count 1 \
        --section WarpStateStats python benchmarks/profile_kernels.py --bwd --rows 128:4096:0 --impl torch_fa4 --iters 1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the same peer wrappers as the benchmark)


def _profile(fn, iters: int):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_kernel = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t > 0 and evt.key:
            per_kernel[evt.key] = per_kernel.get(evt.key, 0.0) + t / iters
    return per_kernel


def _timeline(fn, iters: int):
    """Per call (an L2 flush of 256 MB, then fn, as triton's do_bench): the call's kernels in
    launch order as (name, start after the flush's end, duration) in us, averaged over iters."""
    import json
    import tempfile

    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset")), key=lambda e: e["ts"])
    calls, current = [], None
    for e in kernels:
        if "vectorized_elementwise_kernel" in e["name"] and e["dur"] > 30:  # the flush (zero_)
            current = (e["ts"] + e["dur"], [])
            calls.append(current)
        elif current is not None:
            current[1].append((e["name"], e["ts"] - current[0], e["dur"]))
    calls = [c for _, c in calls if c]
    n = min(len(c) for c in calls)
    rows = []
    for i in range(n):
        rows.append((calls[0][i][0], sum(c[i][1] for c in calls) / len(calls),
                     sum(c[i][2] for c in calls) / len(calls)))
    spans = sorted(c[-1][1] + c[-1][2] for c in calls)
    return rows, spans


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bwd", action="store_true", help="profile the backward (autograd.grad) instead")
    ap.add_argument("--rows", default="64:1024:0,64:4096:1,128:1024:0,128:4096:0,128:4096:1")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--impl", default="torch_fa4,flash-attn-4", help="which of them (e.g. one, under ncu)")
    ap.add_argument("--timeline", action="store_true", help="each call after an L2 flush, as do_bench")
    args = ap.parse_args()
    makers = {"torch_fa4": bench.ours_bwd if args.bwd else bench.ours_fwd,
              "flash-attn-4": bench.fa4_bwd if args.bwd else bench.fa4_fwd}
    makers = {k: v for k, v in makers.items() if k in args.impl.split(",")}
    for spec in args.rows.split(","):
        D, S, causal = (int(x) for x in spec.split(":"))
        B, H = 16384 // S, 2048 // D
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        print(f"== {'bwd' if args.bwd else 'fwd'} D{D} S{S} {'causal' if causal else ''}")
        for name, make in makers.items():
            if args.timeline:
                rows, spans = _timeline(make(q, k, v, bool(causal)), args.iters)
                print(f"  {name}: flush end -> last kernel end, us: median {spans[len(spans) // 2]:.1f} "
                      f"[{spans[0]:.1f}-{spans[-1]:.1f}]")
                for kname, start, dur in rows:
                    print(f"    start {start:8.1f}  dur {dur:8.1f}  {kname[:90]}")
                continue
            per_kernel = _profile(make(q, k, v, bool(causal)), args.iters)
            total = sum(per_kernel.values())
            print(f"  {name}: {total / 1000:.3f} ms of kernels per call")
            for key, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
                print(f"    {us:9.1f} us  {key[:110]}")


if __name__ == "__main__":
    main()
