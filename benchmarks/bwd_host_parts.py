"""Where the backward's host time goes, piece by piece (GPU machine; measurement only).

Wraps the pieces of one eager backward call (torch_fa4.attention, autograd.grad) with timers and
runs calls back to back with the GPU kept busy (a sleep kernel first, as gpu_time_probe.py), so
the host never waits for the device. Prints each piece's inclusive host time per call (the
wrappers add ~0.3 us each), for torch_fa4 and, as a whole, flash-attn-4.

    python benchmarks/bwd_host_parts.py [--rows 128:1024:1,64:1024:0] [--calls 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
from timers import wrap_timed as _wrap  # noqa: E402


def _install(acc: dict) -> None:
    from torch_fa4 import dispatch, ops
    from torch_fa4.kernels.sm90 import bwd, bwd_dq_convert, bwd_prepare, bwd_variant

    _wrap(ops, "bwd_impl", "ops.bwd_impl (our whole backward below autograd)", acc)
    _wrap(ops, "make_call", "  ops.make_call", acc)
    _wrap(dispatch, "kernel_for", "  dispatch.kernel_for", acc)
    _wrap(dispatch.torch, "empty", "  torch.empty (all callers)", acc)
    _wrap(bwd, "backward", "  bwd.backward", acc)
    _wrap(bwd, "variant_key", "    bwd.variant_key", acc)
    _wrap(bwd, "compile_variant", "    bwd.compile_variant (cache lookup)", acc)
    _wrap(bwd, "row_statistics", "    bwd_row_stats.row_statistics", acc)
    _wrap(bwd_prepare, "row_statistics", "      bwd_prepare.row_statistics", acc)
    _wrap(bwd_prepare, "row_statistics_into", "        row_statistics_into", acc)
    _wrap(bwd, "launch_plan", "    bwd_variant.launch_plan", acc)
    _wrap(bwd_variant, "persistent_ctas", "      bwd_variant.persistent_ctas", acc)
    _wrap(bwd, "_tma_view", "    bwd._tma_view", acc)
    _wrap(bwd_dq_convert, "scaled_narrow", "    bwd_dq_convert.scaled_narrow", acc)
    # the main kernel's launch: the callable compile_variant returns
    original = bwd.compile_variant

    def compile_variant(*args, **kwargs):
        fn = original(*args, **kwargs)

        holder = type("Launch", (), {"run": staticmethod(fn)})
        _wrap(holder, "run", "    main kernel launch (TVM-FFI call)", acc)
        return holder.run

    bwd.compile_variant = compile_variant


def _host_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e8))  # the GPU stays busy while the host enqueues
    t = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    host = (time.perf_counter_ns() - t) / calls / 1e3
    torch.cuda.synchronize()
    return host


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="128:1024:1,64:1024:0")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-gc", action="store_true", help="gc.disable() around the timed calls")
    args = ap.parse_args()
    acc: dict = {}
    for spec in args.rows.split(","):
        D, S, causal = (int(x) for x in spec.split(":"))
        B, H = 16384 // S, 2048 // D
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ours = bench.ours_bwd(q, k, v, bool(causal))
        fa4 = bench.fa4_bwd(q, k, v, bool(causal))
        for fn in (ours, fa4):
            fn()
        if not acc:
            _install(acc)
        ours()
        best = {}
        whole = {"torch_fa4": [], "flash-attn-4": []}
        for _ in range(args.rounds):
            if args.no_gc:
                gc.disable()
            acc.clear()
            whole["torch_fa4"].append(_host_us(ours, args.calls))
            for label, seconds in acc.items():
                best[label] = min(best.get(label, float("inf")), seconds / args.calls * 1e6)
            whole["flash-attn-4"].append(_host_us(fa4, args.calls))
            gc.enable()
        print(f"== bwd D{D} S{S}{' causal' if causal else ''}: host us per call, best of {args.rounds} rounds "
              f"of {args.calls} (timers on for torch_fa4)")
        for name, values in whole.items():
            print(f"  {name:48s} {min(values):7.1f}  [{min(values):.1f}-{max(values):.1f}]")
        for label, us in best.items():
            print(f"  {label:48s} {us:7.1f}")


if __name__ == "__main__":
    main()
