"""Where a forward work item's time goes: global-timer stamps per item of the sm90 forward.

    python benchmarks/fwd_trace.py [--rows 256:4096:1,128:16384:0] [--opts '{"persistent": true}'] [--out trace.json]

For each row (D:S:causal, B = 16384 / S, H = 2048 / D, bf16) the forward is compiled once more
with `trace` (kernels/sm90/fwd.py, FWD_TRACE_EVENTS): for every work item the producer warp stamps
the global nanosecond timer when it starts the item and when it has issued Q's load, and the first
thread of consumer warpgroup 0 when Q has landed, when the first S is done, when the last P V is
done and when the epilogue has returned; the SM's id comes with the last stamp. Printed per row:
the median of each phase over all items, and per SM the gap between one item's epilogue and the
next item's start (a one-shot grid: CTA exit and launch; persistent: the outer loop). The
untraced kernel's time (ours and flash-attn-4's, from the profiler) comes first, so the traced
phases can be set against it. The stamps cost a few instructions per item.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bwd_trace import _kernel_ms  # noqa: E402  (main kernel's mean time from the profiler)


def _phases(trace: torch.Tensor) -> dict:
    """Medians (us) of each phase over the items, and the per-SM gaps between items."""
    from torch_fa4.kernels.sm90.fwd import FWD_TRACE_EVENTS, FWD_TRACE_SMID

    t = trace.cpu().to(torch.int64)
    stamps = t[:, :FWD_TRACE_SMID] & 0xFFFFFFFF
    base = int(stamps[:, 0].min())
    rel = (stamps - base) & 0xFFFFFFFF  # ns since the first item started (the timer wraps at 2^32)
    ev = {name: rel[:, i].tolist() for i, name in enumerate(FWD_TRACE_EVENTS)}
    out = {}
    for a, b in zip(FWD_TRACE_EVENTS, FWD_TRACE_EVENTS[1:]):
        out[f"{a}->{b}"] = statistics.median(y - x for x, y in zip(ev[a], ev[b])) / 1e3
    out["item"] = statistics.median(y - x for x, y in zip(ev["item_start"], ev["epilogue_done"])) / 1e3
    per_sm = {}
    for i, sm in enumerate(t[:, FWD_TRACE_SMID].tolist()):
        per_sm.setdefault(sm, []).append((ev["item_start"][i], ev["epilogue_done"][i]))
    gaps = []
    for items in per_sm.values():
        items.sort()
        gaps += [nxt[0] - prev[1] for prev, nxt in zip(items, items[1:])]
    out["gap_between_items"] = statistics.median(gaps) / 1e3 if gaps else 0.0
    out["span_ms"] = max(ev["epilogue_done"]) / 1e6
    out["items"] = t.shape[0]
    out["sms"] = len(per_sm)
    busy = sum(e - s for s, e in zip(ev["item_start"], ev["epilogue_done"]))
    out["busy_share"] = busy / (len(per_sm) * max(ev["epilogue_done"]))  # items' time / SMs x span
    return out


def grid_call(spec: str):
    """The grid row "D:S:causal" (B = 16384 / S, H = 2048 / D, bf16) as (call, out, lse), random inputs."""
    from torch_fa4.call import AttentionCall

    D, S, causal = (int(x) for x in spec.split(":"))
    B, H = 16384 // S, 2048 // D
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call = AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, causal=bool(causal))
    lse = torch.empty(call.lse_shape(), dtype=torch.float32, device="cuda")
    return call, torch.empty_like(q), lse


def num_items(call, cfg) -> int:
    """Work items of a dense call: query tiles x heads x batch."""
    B, S, H = call.q.shape[:3]
    return ((S + cfg.tile_m - 1) // cfg.tile_m) * H * B


def run_traced(call, out, lse, trace: torch.Tensor, **overrides) -> None:
    """One launch of the traced variant into a zeroed `trace`, after a launch that compiles and warms it."""
    from torch_fa4.kernels.sm90 import fwd_host

    fwd_host.forward(call, out, lse, trace=trace, **overrides)
    trace.zero_()
    fwd_host.forward(call, out, lse, trace=trace, **overrides)
    torch.cuda.synchronize()


def write_json(results: list, path) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256:4096:1,256:4096:0,128:16384:0")
    ap.add_argument("--opts", default="{}", help="FwdConfig overrides, JSON (timed and traced alike)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    opts = json.loads(args.opts)
    from torch_fa4.kernels.sm90 import fwd_host
    from torch_fa4.kernels.sm90.fwd import FWD_TRACE_SMID

    results = []
    for spec in args.rows.split(","):
        call, out, lse = grid_call(spec)
        row = {"row": spec, "opts": opts, "ours_ms": _kernel_ms(lambda: fwd_host.forward(call, out, lse, **opts))}
        try:
            from flash_attn.cute.interface import flash_attn_func

            row["fa4_ms"] = _kernel_ms(lambda: flash_attn_func(call.q, call.k, call.v, causal=call.causal))
        except Exception as e:  # the wheel is in the GPU kit only
            row["fa4_ms"] = f"n/a ({type(e).__name__})"
        cfg = fwd_host.default_config(call, **opts)
        trace = torch.zeros(num_items(call, cfg), FWD_TRACE_SMID + 1, dtype=torch.int32, device="cuda")
        run_traced(call, out, lse, trace, **opts)
        row.update(_phases(trace))
        results.append(row)
        print(json.dumps(row), flush=True)
    write_json(results, args.out)


if __name__ == "__main__":
    main()
