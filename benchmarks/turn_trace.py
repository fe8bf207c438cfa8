"""Where the forward's consumer warpgroups wait, step by step: SM-clock stamps per key step.

    python benchmarks/turn_trace.py [--rows 128:16384:0,64:16384:0] [--opts '{"early_o_rescale": false}']

For each row (D:S:causal, B = 16384 / S, H = 2048 / D, bf16) the forward is compiled once more
with `turn_trace` (kernels/sm90/fwd.py, TURN_TRACE_EVENTS): the first thread of every consumer
warpgroup stamps the SM's clock at seven points of key steps 1..TURN_TRACE_STEPS of each work
item: step start, K landed, turn taken (the named barrier returned), V landed (after Q K^T's
issue), matmuls issued (turn passed), S landed, P V landed. Printed per row, in cycles, medians
over the steps past the fourth of every item and warpgroup:
- each phase of a step (wait for K, wait for the turn, Q K^T's issue and the wait for V, P V's
  issue, wait for S, softmax up to the P V wait, the rest of the step after P V);
- the step's period, and the turn's hand-over: from the other warpgroup passing the turn to this
  one taking it (near 0 when this one was waiting at the barrier);
- steps 9..14 of one item as a timeline (every warpgroup, cycles from the item's first stamp);
- per SM, the median period of the first, second, ... item it ran (one-shot CTAs one after
  another, or a persistent CTA's loop), and how far apart the warpgroups start a step.
The stamps cost a few instructions per step and move ptxas's schedule a little: read the phases
against each other, not as exact times of the untraced kernel (NOTES "Experiment 94").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fwd_trace import grid_call, num_items, run_traced, write_json  # noqa: E402

_PHASES = (("k_wait", 0, 1), ("turn_wait", 1, 2), ("qk_issue_v_wait", 2, 3), ("pv_issue", 3, 4), ("s_wait", 4, 5),
           ("softmax_to_pv", 5, 6))


def _wrap(x):
    return x & 0xFFFFFFFF  # the 32-bit clock wraps


def _analyse(trace: torch.Tensor, num_wg: int, steps: int, first_step: int = 4) -> dict:
    from torch_fa4.kernels.sm90.fwd import TURN_TRACE_EVENTS

    n_ev = len(TURN_TRACE_EVENTS)
    host = trace.cpu().to(torch.int64)
    t = host[:, :n_ev].reshape(-1, num_wg, steps, n_ev)
    written = (t != 0).all(dim=-1).tolist()  # steps past the walk's end stay zero
    tl = t.tolist()
    phases = {name: [] for name, _, _ in _PHASES}
    phases.update(after_pv=[], period=[], handover=[])
    for item in range(t.shape[0]):
        for wg in range(num_wg):
            other = (wg - 1) % num_wg  # the warpgroup that passes the turn to this one
            for s in range(first_step, steps - 1):
                if not (written[item][wg][s] and written[item][wg][s + 1]):
                    continue
                row = tl[item][wg][s]
                for name, a, b in _PHASES:
                    phases[name].append(_wrap(row[b] - row[a]))
                nxt = tl[item][wg][s + 1]
                phases["after_pv"].append(_wrap(nxt[0] - row[6]))
                phases["period"].append(_wrap(nxt[0] - row[0]))
                # the turn this warpgroup takes at step s was passed by `other` at its step s (wg 0:
                # by the last warpgroup at step s - 1)
                src = s if wg > 0 else s - 1
                if src >= 0 and written[item][other][src]:
                    passed = tl[item][other][src][4]
                    phases["handover"].append(_wrap(row[2] - passed + (1 << 31)) - (1 << 31))
    out = {name: statistics.median(v) for name, v in phases.items() if v}
    out["steps_read"] = len(phases["period"])
    smids = host[:, n_ev].reshape(-1, num_wg, steps).tolist()
    out.update(_by_ordinal(tl, smids, written, num_wg, steps, first_step))
    # one item's timeline: the first item whose steps are all written
    for item in range(t.shape[0]):
        if all(all(w) for w in written[item]):
            base = min(tl[item][wg][0][0] for wg in range(num_wg))
            out["timeline"] = {f"wg{wg}": [[_wrap(x - base) for x in tl[item][wg][s]] for s in range(8, 14)]
                               for wg in range(num_wg)}
            break
    return out


def _by_ordinal(tl, smids, written, num_wg: int, steps: int, first_step: int) -> dict:
    """Per SM, its items in the order they ran (a one-shot grid: the CTAs it hosted one after
    another; persistent: the outer loop): the median period of the n-th item on an SM, and the
    median spacing of the warpgroups' step starts (warpgroup w+1 after w, same step)."""
    per_sm = {}
    for item in range(len(tl)):
        if written[item][0][first_step]:
            per_sm.setdefault(smids[item][0][first_step], []).append((tl[item][0][first_step][0], item))
    by_ord, spacing = {}, {w: [] for w in range(1, num_wg)}
    for items in per_sm.values():
        items.sort()  # (clock of the first step read, item): one SM's clock orders its items
        for n, (_, item) in enumerate(items[:8]):
            periods = [_wrap(tl[item][wg][s + 1][0] - tl[item][wg][s][0])
                       for wg in range(num_wg) for s in range(first_step, steps - 1)
                       if written[item][wg][s] and written[item][wg][s + 1]]
            if periods:
                by_ord.setdefault(n, []).append(statistics.median(periods))
            for s in range(first_step, steps):
                for w in range(1, num_wg):
                    if written[item][w][s] and written[item][w - 1][s]:
                        spacing[w].append(_wrap(tl[item][w][s][0] - tl[item][w - 1][s][0] + (1 << 31)) - (1 << 31))
    return {"period_by_item_on_sm": {n: statistics.median(v) for n, v in sorted(by_ord.items())},
            "wg_spacing": {f"wg{w - 1}->wg{w}": statistics.median(v) for w, v in spacing.items() if v}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128:16384:0,64:16384:0")
    ap.add_argument("--opts", default="{}", help="FwdConfig overrides, JSON")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from torch_fa4.kernels.sm90 import fwd_host
    from torch_fa4.kernels.sm90.fwd import TURN_TRACE_EVENTS, TURN_TRACE_STEPS

    opts = json.loads(args.opts)
    results = []
    for spec in args.rows.split(","):
        call, out, lse = grid_call(spec)
        cfg = fwd_host.default_config(call, **opts)
        rows = num_items(call, cfg) * cfg.num_consumer_wg * TURN_TRACE_STEPS
        trace = torch.zeros(rows, len(TURN_TRACE_EVENTS) + 1, dtype=torch.int32, device="cuda")
        run_traced(call, out, lse, trace, turn_trace=True, **opts)
        row = {"row": spec, "opts": opts, "tile": [cfg.tile_m, cfg.tile_n]}
        row.update(_analyse(trace, cfg.num_consumer_wg, TURN_TRACE_STEPS))
        results.append(row)
        print(json.dumps(row), flush=True)
    write_json(results, args.out)


if __name__ == "__main__":
    main()
