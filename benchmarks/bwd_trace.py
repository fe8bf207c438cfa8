"""Where a backward step's time goes: clock stamps inside the sm90 backward kernel, per phase.

    python benchmarks/bwd_trace.py [--rows 128:4096:0,128:4096:1] [--steps 24] [--out trace.json]

For each row (D:S:causal, B = 16384 / S, H = 2048 / D, bf16) the backward is compiled once more
with TORCH_FA4_BWD_TRACE (kernels/sm90/bwd.py): the first thread of each consumer warpgroup of the
CTAs of one (batch, KV head) pair (`--pair`: batch 0 / head 0, whose CTAs start together in the
first wave, or a pair in the middle of the launch order, the default) stamps the SM clock at
bwd_kernel.TRACE_EVENTS of its first `--steps` steps; steps 0-2 are also reported one by one. Printed per event: the median number of cycles since the previous stamped event (steps
after the first two, every key tile, both warpgroups), and the median step. The untraced kernels'
times (ours and flash-attn-4's main backward kernel, from the profiler) give the cycles of a
64-query step that the measured kernel time implies for each, so the two can be compared.
The stamps cost a few instructions each, so the traced step is a little slower than the untraced.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch


def _kernel_ms(fn) -> float:
    """Mean time of the CUDA kernel with the most total time (the main backward kernel), over 10
    calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            times.setdefault(ev.name, []).append(ev.device_time if hasattr(ev, "device_time") else ev.cuda_time)
    name, vals = max(times.items(), key=lambda kv: sum(kv[1]))
    return sum(vals) / len(vals) / 1000.0


def _phases(trace: torch.Tensor, events: tuple, skip: int = 2, wgs=(0, 1)) -> dict:
    """Median cycles per phase over the warpgroups `wgs`; with both, also the median lag of
    warpgroup 1's step start behind warpgroup 0's ("wg1_lag")."""
    t = trace.cpu().to(torch.int64) & 0xFFFFFFFF  # (tiles, 2, steps, events), 32-bit clocks
    tiles, _, steps, _ = t.shape
    out = {e: [] for e in events[1:]}
    step_cycles = []
    lags = []
    for i in range(tiles):
        if len(wgs) == 2:
            for s in range(skip, steps):
                if t[i, 0, s, 0] != 0 and t[i, 1, s, 0] != 0:
                    lag = (int(t[i, 1, s, 0]) - int(t[i, 0, s, 0])) & 0xFFFFFFFF
                    lags.append(lag - (1 << 32) if lag >= 1 << 31 else lag)
        for w in wgs:
            for s in range(skip, steps):
                row = t[i, w, s]
                if row[0] == 0:
                    continue  # the CTA had fewer steps
                prev = int(row[0])
                for e in range(1, len(events)):
                    if row[e] == 0:
                        continue  # not stamped on this path
                    out[events[e]].append((int(row[e]) - prev) & 0xFFFFFFFF)
                    prev = int(row[e])
                if s + 1 < steps and t[i, w, s + 1, 0] != 0:
                    step_cycles.append((int(t[i, w, s + 1, 0]) - int(row[0])) & 0xFFFFFFFF)
    med = {e: statistics.median(v) for e, v in out.items() if v}
    med["step"] = statistics.median(step_cycles) if step_cycles else None
    if lags:
        med["wg1_lag"] = statistics.median(lags)
    return med


def _first_steps(trace: torch.Tensor, events: tuple, count: int = 3) -> list:
    """Each CTA's steps 0 .. count-1 (medians over key tiles and both warpgroups): cycles from the
    step's top to the next step's top, and per event. Under a causal mask step 0 is the diagonal
    tile, so its excess over the later steps is the masked step's cost plus the ring's first fill."""
    t = trace.cpu().to(torch.int64) & 0xFFFFFFFF
    tiles, _, steps, _ = t.shape
    out = []
    for s in range(min(count, steps - 1)):
        cta = [(i, w) for i in range(tiles) for w in (0, 1) if t[i, w, s, 0] != 0 and t[i, w, s + 1, 0] != 0]
        if not cta:
            break
        row = {"step": statistics.median((int(t[i, w, s + 1, 0]) - int(t[i, w, s, 0])) & 0xFFFFFFFF for i, w in cta)}
        deltas = {}
        for i, w in cta:
            prev = int(t[i, w, s, 0])
            for e in range(1, len(events)):
                if t[i, w, s, e] != 0:  # (0: not stamped on this path)
                    deltas.setdefault(events[e], []).append((int(t[i, w, s, e]) - prev) & 0xFFFFFFFF)
                    prev = int(t[i, w, s, e])
        row.update({e: statistics.median(v) for e, v in deltas.items()})
        out.append(row)
    return out


def _by_step(trace: torch.Tensor, buckets: int = 8) -> list:
    """Median step cycles (top to the next step's top, both warpgroups, every traced key tile)
    by the step's index in its walk, in `buckets` equal ranges of the traced steps: whether
    steps late in a walk (under a descending causal walk: the query tiles near the diagonal)
    cost more than the first ones."""
    t = trace.cpu().to(torch.int64) & 0xFFFFFFFF
    tiles, _, steps, _ = t.shape
    width = max(1, (steps - 1) // buckets)
    out = []
    for lo in range(0, steps - 1, width):
        v = [(int(t[i, w, s + 1, 0]) - int(t[i, w, s, 0])) & 0xFFFFFFFF
             for i in range(tiles) for w in (0, 1) for s in range(lo, min(lo + width, steps - 1))
             if t[i, w, s, 0] != 0 and t[i, w, s + 1, 0] != 0]
        if v:
            out.append((lo, statistics.median(v), len(v)))
    return out


def _clock_ghz(trace: torch.Tensor, ctas: torch.Tensor, pair: int) -> float | None:
    """SM cycles per nanosecond over the traced pair's key tiles: the cycles from step 0's top to
    the last stamped step's top, against the global timer from the tile's start to its end
    (which also holds the prologue, the last step and the epilogue, so this reads a little low).
    Says whether two traced runs ran at different clocks."""
    t = trace.cpu().to(torch.int64) & 0xFFFFFFFF
    c = ctas.cpu().to(torch.int64) & 0xFFFFFFFF
    rates = []
    for i in range(t.shape[0]):
        tops = [int(x) for x in t[i, 0, :, 0] if x != 0]
        if len(tops) < 8:
            continue
        cycles = (tops[-1] - tops[0]) & 0xFFFFFFFF
        ns = (int(c[i, pair, 1]) - int(c[i, pair, 0])) & 0xFFFFFFFF
        if ns > 0:
            rates.append(cycles / ns * len(tops) / (len(tops) - 1))
    return statistics.median(rates) if rates else None


def _schedule(ctas: torch.Tensor, causal: bool) -> dict:
    """The grid's schedule from every CTA's (start, end, SM) stamps, (key tiles, pairs, 3): the
    kernel's span, the SMs' busy share, the idle gaps between consecutive CTAs on an SM and at the
    end (tail), and (under a causal mask, where CTA lengths differ) the least-squares fit of a
    CTA's duration against its key tiles' distance from the last one: slope = time per key tile,
    intercept = the per-CTA fixed cost (prologue, first loads, epilogue). Times in microseconds."""
    c = ctas.cpu().to(torch.int64) & 0xFFFFFFFF
    tiles, pairs, _ = c.shape
    t0 = int(c[..., 0].min())
    start = ((c[..., 0] - t0) & 0xFFFFFFFF).double() / 1000
    end = ((c[..., 1] - t0) & 0xFFFFFFFF).double() / 1000
    sm = c[..., 2]
    span = float(end.max())
    dur = end - start
    gaps, tails = [], []
    for s in sm.unique().tolist():
        sel = sm == s
        order = torch.argsort(start[sel])
        st, en = start[sel][order], end[sel][order]
        gaps += (st[1:] - en[:-1]).tolist()
        tails.append(span - float(en.max()))
    out = dict(span_us=span, busy=float(dur.sum()) / (span * len(tails)), sms=len(tails),
               gap_us_median=statistics.median(gaps) if gaps else None,
               gap_us_mean=sum(gaps) / len(gaps) if gaps else None,
               tail_us_mean=sum(tails) / len(tails))
    if causal:
        x = (tiles - torch.arange(tiles, dtype=torch.float64)).repeat_interleave(pairs)
        y = dur.reshape(-1)
        xm, ym = x.mean(), y.mean()
        slope = float(((x - xm) * (y - ym)).sum() / ((x - xm) ** 2).sum())
        out.update(per_tile_us=slope, per_cta_us=float(ym - slope * xm))
    else:
        out.update(cta_us_median=float(dur.median()))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128:4096:0,128:4096:1,128:16384:0,64:4096:0")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default=None)
    ap.add_argument("--per-wg", action="store_true", help="also each consumer warpgroup's phases")
    ap.add_argument("--pair", default="middle", choices=("first", "middle"),
                    help="trace the CTAs of batch 0, KV head 0 (they run in the first wave, which "
                         "starts all at once) or of a pair in the middle of the launch order")
    args = ap.parse_args()

    import torch_fa4
    from torch_fa4.kernels.sm90 import bwd
    from torch_fa4.kernels.sm90.bwd_kernel import TRACE_EVENTS

    results = []
    for spec in args.rows.split(","):
        D, S, causal = (int(x) for x in spec.split(":"))
        causal = bool(causal)
        B, H = 16384 // S, 2048 // D
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = torch_fa4.attention(q, k, v, causal=causal)
        g = torch.randn_like(out)
        ours = lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)  # noqa: E731
        ours_ms = _kernel_ms(ours)
        os.environ[bwd.TRACE_ENV] = str(args.steps)
        b_t, h_t = (0, 0) if args.pair == "first" else (B // 2, H // 2 if B == 1 else 0)
        os.environ[bwd.TRACE_PAIR_ENV] = f"{b_t}:{h_t}"
        try:
            ours()
            torch.cuda.synchronize()
            steps_part = bwd.LAST_TRACE[:, :2, :args.steps * len(TRACE_EVENTS)].contiguous()
            trace = steps_part.view(bwd.LAST_TRACE.shape[0], 2, args.steps, len(TRACE_EVENTS))
            schedule = _schedule(bwd.LAST_TRACE[:, 2:, :3], causal)
            phases = _phases(trace, TRACE_EVENTS)
            first = _first_steps(trace, TRACE_EVENTS)
            per_wg = [_phases(trace, TRACE_EVENTS, wgs=(w,)) for w in (0, 1)] if args.per_wg else []
            by_step = _by_step(trace)
            ghz = _clock_ghz(trace, bwd.LAST_TRACE[:, 2:, :3], b_t * H + h_t)
        finally:
            os.environ.pop(bwd.TRACE_ENV)
            os.environ.pop(bwd.TRACE_PAIR_ENV)
        fa_ms = None
        try:
            from flash_attn.cute.interface import flash_attn_func

            qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
            of = flash_attn_func(qf, kf, vf, causal=causal)
            of = of[0] if isinstance(of, tuple) else of
            fa = lambda: torch.autograd.grad(of, (qf, kf, vf), g, retain_graph=True)  # noqa: E731
            fa_ms = _kernel_ms(fa)
        except Exception as exc:  # flash-attn-4 missing: our numbers alone
            print(f"flash-attn-4: {exc!r}")
        row = dict(D=D, S=S, causal=causal, ours_kernel_ms=ours_ms, fa4_kernel_ms=fa_ms, phases=phases,
                   first_steps=first, schedule=schedule, by_step=by_step, traced_ghz=ghz)
        if phases.get("step"):
            # cycles per 64-query step implied by each kernel's time, scaled by our traced step
            row["fa4_step_equiv"] = phases["step"] * fa_ms / ours_ms if fa_ms else None
        results.append(row)
        print(f"D{D} S{S}{' causal' if causal else ''}: kernel ours {ours_ms:.3f} ms, "
              f"flash-attn-4 {fa_ms if fa_ms is None else round(fa_ms, 3)} ms; traced step {phases.get('step')} cycles; "
              f"steps 0-2 {[int(r['step']) for r in first]}")
        print("   schedule: " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in schedule.items()))
        print(f"   traced clock {ghz if ghz is None else round(ghz, 3)} cycles/ns; step cycles by step index "
              "(first index, median, count): " + "  ".join(f"{lo}:{int(m)}({n})" for lo, m, n in by_step))
        for n, r in enumerate(first):
            print(f"   step {n}: " + "  ".join(f"{e}={int(c)}" for e, c in r.items() if e != "step"))
        print("   " + "  ".join(f"{e}={int(c)}" for e, c in phases.items() if e != "step"))
        for w, ph in enumerate(per_wg):
            print(f"   wg{w}: " + "  ".join(f"{e}={int(c)}" for e, c in ph.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
