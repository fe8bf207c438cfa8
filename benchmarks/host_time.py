"""Host time per call against device time: is a row measuring the GPU or the CPU that feeds it?

For each row and implementation (the same wrappers as bench.py) this prints
  device: bench.py's timing (do_bench median, CUDA events around back-to-back calls),
  host:   CPU time to enqueue one call (calls back to back, no synchronisation in between; the
          implementations take turns for --rounds rounds and each keeps its fastest),
  kernels: the sum of the call's kernel times (torch.profiler),
so a row whose host time exceeds its kernel time is bound by the host. With --cprofile it also
prints where torch_fa4's host time goes (cProfile, top functions by own time).

    python benchmarks/host_time.py [--rows 128:1024:0,128:4096:1:document] [--bwd] [--fwd] [--cprofile N]

A row D:S:causal:document is the grid's block-sparse document-mask row (forward only): torch_fa4's
launch (bench.ours_fwd, mods traced once outside the timed call), the public
`torch_fa4.flex_attention` with a torch_fa4 block mask ("torch_fa4 api") and with torch's own
("torch_fa4 api, torch mask": the mods table's call, host time included), and FlexAttention
compiled. The public calls are also run under torch.cuda's sync debug mode: a repeated call must
not synchronise with the device.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
import profile_kernels  # noqa: E402


def launch_fwd(q, k, v, causal):
    """fwd_host.forward alone: the sm90 host path below the public API (bench.ours_fwd, the
    "torch_fa4" column, is the public torch_fa4.attention)."""
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90 import fwd_host

    call = AttentionCall(q=q, k=k, v=v, scale=q.shape[-1] ** -0.5, causal=causal,
                         window_right=0 if causal else -1)
    out = torch.empty_like(q)
    lse = torch.empty(call.lse_shape(), dtype=torch.float32, device=q.device)
    return lambda: fwd_host.forward(call, out, lse)


def op_autograd_bwd(q, k, v, causal):
    """The backward through the torch_fa4::fwd op's own autograd (register_autograd), which
    torch.compile uses; eager torch_fa4.attention goes through eager_autograd instead."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    S, D = q.shape[1], q.shape[-1]
    out, _ = torch.ops.torch_fa4.fwd(q, k, v, [], None, None, None, [], S, S, D ** -0.5, causal, -1,
                                     0 if causal else -1, 0.0, "", 128, 128, False)
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)


def api_document_calls(q, k, v, mask_mod, causal: bool) -> dict:
    """The document row through torch_fa4.flex_attention, as users call it: with a torch_fa4 block
    mask and with torch's (the mask ANDed with causal as bench.ours_fwd does, so the same variant)."""
    import torch_fa4
    from torch.nn.attention.flex_attention import create_block_mask
    from torch_fa4 import mods

    mask = mods.and_masks(mask_mod, mods.causal_mask) if causal else mask_mod
    S = q.shape[1]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    ours = mods.create_block_mask(mask, None, None, S, S, device=q.device)
    theirs = create_block_mask(mask, None, None, S, S, device=q.device)
    return {"torch_fa4 api": lambda: torch_fa4.flex_attention(qt, kt, vt, block_mask=ours),
            "torch_fa4 api, torch mask": lambda: torch_fa4.flex_attention(qt, kt, vt, block_mask=theirs)}


def synchronisation(fn) -> str:
    """Whether a repeated call of fn synchronises with the device (torch.cuda's sync debug mode)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "no device synchronisation in a repeated call"
    except RuntimeError as e:
        return f"a repeated call synchronises with the device: {str(e)[:200]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def host_ms(fn, calls: int = 50) -> float:
    """Mean CPU time to enqueue one call, calls back to back."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / calls


def cprofile_top(fn, calls: int, top: int = 30) -> str:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128:1024:0,128:1024:1,64:1024:0,64:1024:1")
    ap.add_argument("--fwd", action="store_true")
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--cprofile", type=int, default=0, help="cProfile this many torch_fa4 calls per row")
    ap.add_argument("--rounds", type=int, default=5, help="host timings per implementation (the minimum is kept)")
    args = ap.parse_args()
    directions = [d for d, on in (("fwd", args.fwd), ("bwd", args.bwd)) if on] or ["fwd", "bwd"]
    makers = {
        "fwd": {"torch_fa4": bench.ours_fwd, "torch_fa4 launch": launch_fwd, "flash-attn-4": bench.fa4_fwd},
        "bwd": {"torch_fa4": bench.ours_bwd, "torch_fa4 op": op_autograd_bwd, "flash-attn-4": bench.fa4_bwd},
    }
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for direction in directions:
        for spec in args.rows.split(","):
            D, S, causal, *mod = spec.split(":")
            D, S, causal = int(D), int(S), int(causal)
            B, H = 16384 // S, 2048 // D
            q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            print(f"== {direction} D{D} S{S}{' causal' if causal else ''} {' '.join(mod)} (B={B}, H={H})")
            flops = bench._flops(B, H, S, D, bool(causal), bwd=direction == "bwd")
            if mod == ["document"] and direction == "fwd":
                mask_mod, doc_flops = bench.document_mask(S)
                flops = doc_flops(B, H, S, D)
                fns = {name: make(q, k, v, bool(causal), mask_mod=mask_mod)
                       for name, make in (("torch_fa4", bench.ours_fwd), ("flex", bench.flex_fwd))}
                fns.update(api_document_calls(q, k, v, mask_mod, bool(causal)))
            elif mod:
                ap.error(f"row {spec}: the only mod row is a forward D:S:causal:document")
            else:
                fns = {name: make(q, k, v, bool(causal)) for name, make in makers[direction].items()}
            # the host's speed drifts (other tenants, clocks): implementations take turns, and the
            # fastest of the rounds is kept as each one's host cost
            host = {name: min(host_ms(fn) for _ in range(args.rounds)) for name, fn in fns.items()}
            for name, fn in fns.items():
                if name.startswith("torch_fa4 api"):
                    print(f"  {name}: {synchronisation(fn)}")
            for name, fn in fns.items():
                device = bench._time_ms(fn)
                kernels = sum(profile_kernels._profile(fn, 10).values()) / 1e3
                print(f"  {name:14s} device {device:.3f} ms ({flops / device / 1e9:.0f} TFLOP/s)  "
                      f"host {host[name]:.3f} ms  kernels {kernels:.3f} ms")
                if args.cprofile and name.startswith("torch_fa4"):
                    print(cprofile_top(fn, args.cprofile))


if __name__ == "__main__":
    main()
