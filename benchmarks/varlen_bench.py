"""Packed variable-length batches against flash-attn-4's varlen interface (GPU).

Rows: batches of equal lengths and of mixed ones (the kind a packing data collator makes), D64 and
D128, 2048 / D query and key heads, bf16, causal; forward and backward (torch.autograd.grad of
one forward's output, repeated). Each implementation is timed `--rounds` times in turn with
bench.py's timer (triton do_bench, median), the row keeping the upper median; TFLOP/s count the
causal half of each sequence's S^2 (bench._flops per sequence).

    python benchmarks/varlen_bench.py --rounds 3 --out results/varlen.json [--fwd-only] [--general]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def batches():
    g = torch.Generator().manual_seed(0)
    return {"64x256": [256] * 64, "16x1024": [1024] * 16, "4x4096": [4096] * 4,
            "mixed48": torch.randint(17, 2001, (48,), generator=g).tolist()}


def make_inputs(lens, d):
    heads = 2048 // d
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lens), heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return q, k, v, cu, max(lens)


def ours(q, k, v, cu, max_len, backward):
    import torch_fa4

    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len)
    if not backward:
        return lambda: torch_fa4.attention(q, k, v, **kw)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = torch_fa4.attention(*leaves, **kw)
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, g, retain_graph=True)


def ours_general(q, k, v, cu, max_len, backward):
    """ours with the backward's launch records bypassed (bwd.backward's general path every call):
    the comparison for the packed batches' records (--general)."""
    fn = ours(q, k, v, cu, max_len, backward)
    if not backward:
        return fn
    from torch_fa4.kernels.sm90 import bwd_launch_record

    def call():
        real, bwd_launch_record.run = bwd_launch_record.run, lambda *a: False
        try:
            return fn()
        finally:
            bwd_launch_record.run = real

    return call


def fa4(q, k, v, cu, max_len, backward):
    from flash_attn.cute.interface import flash_attn_varlen_func

    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len, causal=True)
    if not backward:
        return lambda: flash_attn_varlen_func(q, k, v, **kw)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, **kw)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, g, retain_graph=True)


def profile(label: str, d: int) -> None:
    """The CUDA kernels of one call of each row of `label` at head dim d, torch_fa4 and
    flash-attn-4, and the same batch as a dense (B, S, H, D) call of ours (equal lengths only)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    lens = batches()[label]
    q, k, v, cu, max_len = make_inputs(lens, d)
    makers = {"ours varlen": lambda bw: ours(q, k, v, cu, max_len, bw),
              "fa4 varlen": lambda bw: fa4(q, k, v, cu, max_len, bw)}
    if len(set(lens)) == 1:
        dense = [t.view(len(lens), lens[0], *t.shape[1:]) for t in (q, k, v)]

        def ours_dense(bw):
            import torch_fa4

            if not bw:
                return lambda: torch_fa4.attention(*dense, causal=True)
            leaves = [t.detach().requires_grad_() for t in dense]
            out = torch_fa4.attention(*leaves, causal=True)
            g = torch.randn_like(out)
            return lambda: torch.autograd.grad(out, leaves, g, retain_graph=True)

        makers["ours dense"] = ours_dense
    for backward in (False, True):
        for name, make in makers.items():
            fn = make(backward)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            print(f"== D{d} {label} {'bwd' if backward else 'fwd'}: {name} (5 calls)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


def host_times(label: str, d: int) -> None:
    """Host time per call (the GPU kept busy by a sleep kernel, so no call waits for it) of each
    implementation, forward and backward, and a cProfile of our backward's host path."""
    import cProfile
    import pstats
    import time

    lens = batches()[label]
    q, k, v, cu, max_len = make_inputs(lens, d)
    for backward in (False, True):
        for name, make in (("ours", ours), ("ours general path", ours_general), ("flash-attn-4", fa4)):
            fn = make(q, k, v, cu, max_len, backward)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the calls
            t = time.perf_counter()
            for _ in range(20):
                fn()
            host_ms = (time.perf_counter() - t) / 20 * 1e3
            torch.cuda.synchronize()
            print(f"host D{d} {label} {'bwd' if backward else 'fwd'} {name}: {host_ms:.3f} ms per call", flush=True)
    for backward in (False, True):
        fn = ours(q, k, v, cu, max_len, backward)
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"== cProfile, 20 {'backward' if backward else 'forward'} calls of ours")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--profile", default=None, metavar="BATCH:D",
                    help="instead: the kernels one call of each implementation runs, e.g. 16x1024:128")
    ap.add_argument("--host", default=None, metavar="BATCH:D", help="instead: host time per call, e.g. 16x1024:128")
    ap.add_argument("--fwd-only", action="store_true", help="forward rows only")
    ap.add_argument("--general", action="store_true",
                    help="also ours with the backward's launch records bypassed ('torch_fa4 general')")
    args = ap.parse_args()
    if args.host:
        label, d = args.host.split(":")
        host_times(label, int(d))
        return
    if args.profile:
        label, d = args.profile.split(":")
        profile(label, int(d))
        return
    peers = {"torch_fa4": ours, "flash-attn-4": fa4}
    if args.general:
        peers["torch_fa4 general"] = ours_general
    rows = []
    print(f"{'row':<22} {'torch_fa4':>10} {'flash-attn-4':>13} {'ratio':>6}  (TFLOP/s)"
          + ("  general / ratio" if args.general else ""))
    for d in (64, 128):
        for label, lens in batches().items():
            q, k, v, cu, max_len = make_inputs(lens, d)
            heads = q.shape[1]
            for backward in (False,) if args.fwd_only else (False, True):
                flops = sum(bench._flops(1, heads, n, d, True, backward) for n in lens)
                fns = {name: make(q, k, v, cu, max_len, backward) for name, make in peers.items()}
                times = {name: [] for name in fns}
                for rnd in range(args.rounds):
                    for name in bench.rotated(list(fns), rnd):
                        times[name].append(bench._time_ms(fns[name]))
                # the lower median time: the rate bench.py keeps (its upper median TFLOP/s)
                best_ms = {name: -bench.upper_median([-t for t in ts]) for name, ts in times.items()}
                tflops = {name: flops / (ms * 1e-3) / 1e12 for name, ms in best_ms.items()}
                row = dict(row=f"D{d} {label} {'bwd' if backward else 'fwd'}", tflops=tflops,
                           ms=times, ratio=tflops["torch_fa4"] / tflops["flash-attn-4"])
                rows.append(row)
                extra = ""
                if args.general:
                    extra = f"  {tflops['torch_fa4 general']:.0f} / {tflops['torch_fa4 general'] / tflops['flash-attn-4']:.3f}"
                print(f"{row['row']:<22} {tflops['torch_fa4']:>10.0f} {tflops['flash-attn-4']:>13.0f} "
                      f"{row['ratio']:>6.3f}{extra}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rounds=args.rounds, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
