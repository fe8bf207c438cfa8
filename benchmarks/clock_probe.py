"""SM clock and board power while a forward runs: is a peer faster per cycle, or at a higher clock?

H100 SXM runs tensor-heavy kernels against its power limit, so the SM clock under load depends on
the energy each kernel spends per unit of work. bench.py's TFLOP/s mix both effects. This script
runs each implementation back to back for a few seconds per turn (turns alternate between the
implementations, so drift in temperature hits both), samples `nvidia-smi` every 50 ms meanwhile,
and prints per implementation: TFLOP/s, median SM clock and power over its turns, and TFLOP/s per
GHz (work per cycle, clock taken out).

    python benchmarks/clock_probe.py [--rows 64:16384:0,128:16384:0] [--turns 3] [--seconds 2]
        [--variant NAME='{"rescale_threshold": 8.0}' ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

import bench


def _sampler():
    return subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
         "-lms", "50"],
        stdout=subprocess.PIPE, text=True)


def _run_for(fn, seconds: float) -> tuple:
    """Launch fn back to back for about `seconds`; returns (wall start, wall end, ms per call)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.time()
    a.record()
    n = 0
    while time.time() - t0 < seconds:
        for _ in range(20):
            fn()
        n += 20
        torch.cuda.synchronize()
    b.record()
    torch.cuda.synchronize()
    return t0, time.time(), a.elapsed_time(b) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64:16384:0,128:16384:0,128:4096:0",
                    help="D:S:causal,... or 'grid' (bench.py's 18 forward rows)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=JSON: also torch_fa4 with these FwdConfig overrides")
    args = ap.parse_args()
    impls = {"torch_fa4": bench.ours_fwd, "flash-attn-4": bench.fa4_fwd}
    for spec in args.variant:
        name, opts = spec.split("=", 1)
        impls[name] = (lambda o: lambda q, k, v, c: bench.ours_fwd(q, k, v, c, cfg_opts=o))(json.loads(opts))
    proc = _sampler()
    samples = []  # (wall time, clock MHz, watts, deg C)
    import threading

    def read():
        for line in proc.stdout:
            try:
                c, p, t = (float(x) for x in line.split(","))
            except ValueError:
                continue
            samples.append((time.time(), c, p, t))

    threading.Thread(target=read, daemon=True).start()
    results = []
    rows = ([f"{D}:{S}:{int(c)}" for D, S, c in bench._GRID] if args.rows == "grid" else args.rows.split(","))
    for spec in rows:
        D, S, c = (int(x) for x in spec.split(":"))
        B, H = 16384 // S, 2048 // D
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fns = {name: make(q, k, v, bool(c)) for name, make in impls.items()}
        for fn in fns.values():
            bench._time_ms(fn)  # compile and warm
        windows = {name: [] for name in fns}
        for turn in range(args.turns):
            order = list(fns.items())
            order = order[turn % len(order):] + order[:turn % len(order)]  # (as bench.py's rounds)
            for name, fn in order:
                windows[name].append(_run_for(fn, args.seconds))
        time.sleep(0.2)
        flops = bench._flops(B, H, S, D, bool(c))
        for name, ws in windows.items():
            ms = sorted(w[2] for w in ws)[len(ws) // 2]
            # samples inside each turn, skipping its first 0.3 s (the clock settling)
            inside = [s for s in samples for w in ws if w[0] + 0.3 <= s[0] <= w[1]]
            clocks = sorted(s[1] for s in inside)
            power = sorted(s[2] for s in inside)
            temp = sorted(s[3] for s in inside)
            mid = len(clocks) // 2
            tflops = flops / ms * 1e-9
            row = dict(D=D, S=S, causal=bool(c), impl=name, tflops=tflops, ms=ms, samples=len(clocks),
                       clock_mhz=clocks[mid] if clocks else None, power_w=power[mid] if power else None,
                       temp_c=temp[mid] if temp else None)
            row["tflops_per_ghz"] = tflops / (row["clock_mhz"] / 1000) if clocks else None
            results.append(row)
            print(f"D{D} S{S // 1024}k{' causal' if c else ''}  {name:13s} {tflops:6.1f} TFLOP/s  "
                  f"clock {row['clock_mhz']} MHz  power {row['power_w']} W  temp {row['temp_c']} C  "
                  f"{row['tflops_per_ghz'] or 0:6.1f} TFLOP/s per GHz  ({len(clocks)} samples)", flush=True)
    proc.terminate()
    names = list(impls)
    if "flash-attn-4" in names:  # each row's ratios to flash-attn-4
        for i in range(0, len(results), len(names)):
            row = {r["impl"]: r["tflops"] for r in results[i:i + len(names)]}
            r0 = results[i]
            ratios = "  ".join(f"{n} {row[n] / row['flash-attn-4']:.3f}" for n in names if n != "flash-attn-4")
            print(f"D{r0['D']} S{r0['S'] // 1024}k{' causal' if r0['causal'] else ''}: {ratios}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
