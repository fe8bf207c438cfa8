"""SM clock and board power while a forward (or backward) runs: is a peer faster per cycle, or at a
higher clock?

H100 SXM runs tensor-heavy kernels against its power limit, so the SM clock under load depends on
the energy each kernel spends per unit of work. bench.py's TFLOP/s mix both effects. This script
runs each implementation back to back for a few seconds per turn (turns alternate between the
implementations, so drift in temperature hits both), samples `nvidia-smi` every 50 ms meanwhile,
and prints per implementation: TFLOP/s, median SM clock and power over its turns, and TFLOP/s per
GHz (work per cycle, clock taken out).

    python benchmarks/clock_probe.py [--rows 64:16384:0,128:16384:0] [--turns 3] [--seconds 2]
        [--variant NAME='{"rescale_threshold": 8.0}' ...] [--backward]

A variant's JSON takes FwdConfig overrides (forward only).

--backward times dQ, dK, dV of one forward (bench.py's backward peers; `--rows grid` is then
bench.py's 12 backward rows, D64 and D128) and counts 2.5 x the forward's FLOPs, as bench.py does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time

import torch

import bench


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


class _Sampler:
    """`nvidia-smi` every 50 ms in the background: (wall time, SM clock MHz, watts, deg C)."""

    def __init__(self):
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
             "-lms", "50"],
            stdout=subprocess.PIPE, text=True)
        self.samples = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                c, p, t = (float(x) for x in line.split(","))
            except ValueError:  # a header or a field nvidia-smi could not read
                continue
            self.samples.append((time.time(), c, p, t))

    def within(self, windows) -> list:
        """Samples inside the (start, end, ...) windows, skipping each one's first 0.3 s (the clock
        settling after the switch of kernel)."""
        return [s for s in self.samples for w in windows if w[0] + 0.3 <= s[0] <= w[1]]

    def stop(self):
        self.proc.terminate()


def _probe_row(D, S, causal, impls, sampler, turns, seconds, backward=False) -> list:
    """One row: every implementation `turns` times for `seconds`, turns rotating (as bench.py's
    rounds); returns a result dict per implementation that ran."""
    B, H = 16384 // S, 2048 // D
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fns = {}
    for name, make in impls.items():
        try:
            fns[name] = make(q, k, v, causal)
            bench._time_ms(fns[name])  # compile and warm
        except Exception as e:  # a peer that cannot run this row is reported, not fatal
            print(f"D{D} S{S // 1024}k{' causal' if causal else ''}  {name}: {type(e).__name__}: {str(e)[:120]}")
            fns.pop(name, None)
    windows = {name: [] for name in fns}
    for turn in range(turns):
        for name, fn in bench.rotated(list(fns.items()), turn):
            windows[name].append(_run_for(fn, seconds))
    time.sleep(0.2)  # the last turn's samples
    results = []
    for name, ws in windows.items():
        inside = sampler.within(ws)
        tflops = bench._flops(B, H, S, D, causal, bwd=backward) / bench.upper_median(w[2] for w in ws) * 1e-9
        clock = bench.upper_median(s[1] for s in inside)
        row = dict(D=D, S=S, causal=causal, backward=backward, impl=name, tflops=tflops, samples=len(inside),
                   clock_mhz=clock, power_w=bench.upper_median(s[2] for s in inside),
                   temp_c=bench.upper_median(s[3] for s in inside),
                   tflops_per_ghz=tflops / (clock / 1000) if clock else None)
        results.append(row)
        print(f"D{D} S{S // 1024}k{' causal' if causal else ''}  {name:13s} {tflops:6.1f} TFLOP/s  "
              f"clock {clock} MHz  power {row['power_w']} W  temp {row['temp_c']} C  "
              f"{row['tflops_per_ghz'] or 0:6.1f} TFLOP/s per GHz  ({len(inside)} samples)", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64:16384:0,128:16384:0,128:4096:0",
                    help="D:S:causal,... or 'grid' (bench.py's 18 forward rows, or its 12 backward rows)")
    ap.add_argument("--backward", action="store_true", help="time the backward instead of the forward")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=JSON: also torch_fa4's forward with these FwdConfig overrides")
    args = ap.parse_args()
    impls = ({"torch_fa4": bench.ours_bwd, "flash-attn-4": bench.fa4_bwd} if args.backward
             else {"torch_fa4": bench.ours_fwd, "flash-attn-4": bench.fa4_fwd})
    impls.update(bench.variant_makers(args.variant, args.backward, ap.error))
    grid = bench._BWD_GRID if args.backward else bench._GRID
    rows = (list(grid) if args.rows == "grid"
            else [tuple(int(x) for x in spec.split(":")) for spec in args.rows.split(",")])
    sampler = _Sampler()
    results, ratios = [], []
    for D, S, c in rows:
        row = _probe_row(D, S, bool(c), impls, sampler, args.turns, args.seconds, args.backward)
        results += row
        rates = {r["impl"]: r["tflops"] for r in row}
        if "flash-attn-4" in rates:
            ratios.append(f"D{D} S{S // 1024}k{' causal' if c else ''}: " + "  ".join(
                f"{n} {t / rates['flash-attn-4']:.3f}" for n, t in rates.items() if n != "flash-attn-4"))
    sampler.stop()
    print("\n".join(ratios))  # each row's ratios to flash-attn-4
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
