"""First call of a kernel variant on the GPU machine, as a user meets it: a fresh process, the
public entry point, compile included (the target: a new variant's first call within 3 s).

Each line is one fresh process that imports torch and the implementation, makes bf16 inputs,
warms the CUDA context with an unrelated op, then times its first call (synchronised) and a second
one. torch_fa4 runs with its disk cache off (TORCH_FA4_KERNEL_CACHE=0) unless --disk, which runs a
process that compiles and stores, then one that loads. flash-attn-4 (a peer, from the GPU kit)
keeps its own disk cache off, its default.

    python benchmarks/first_call.py [--rows 128:4096:1,64:4096:0] [--runs 3] [--bwd] [--disk] [--preimport]

With --preimport our lines also split the first call into compile phases (compile_time.py's:
preprocess, mlir, host-jit; and the disk cache's store and load) and count its MLIR pipelines
(`compiles`: one per kernel compiled), medians over the runs.

A row D:S:causal is B = 16384 / S, H = 2048 / D as in bench.py; --bwd times the first backward
after a forward (the forward's compile excluded). Without --preimport our first call also imports
CuTe DSL (torch_fa4's import does not), which flash-attn-4 pays in its import.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _phase_timers(acc: dict) -> None:
    """compile_time.py's phase split of our compile, plus the disk cache's store and load."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compile_time
    from timers import wrap_timed

    from torch_fa4.kernels import disk_cache

    compile_time._install_phase_timers(acc)
    wrap_timed(disk_cache, "store", "store", acc)
    wrap_timed(disk_cache, "load", "load", acc)
    # how many MLIR pipelines the first call ran (one per kernel it compiled)
    from cutlass.base_dsl import compiler

    run_pipeline = compiler.Compiler.compile

    def counted(*args, **kwargs):
        acc["compiles"] = acc.get("compiles", 0) + 1
        return run_pipeline(*args, **kwargs)

    compiler.Compiler.compile = counted


def child(impl: str, D: int, S: int, causal: bool, bwd: bool, preimport: bool = False) -> None:
    phases: dict = {}  # (torch_fa4 with --preimport: where the first call's seconds went)
    t0 = time.perf_counter()
    import torch

    t_torch = time.perf_counter() - t0
    t0 = time.perf_counter()
    if impl == "torch_fa4":
        import torch_fa4

        if preimport:  # CuTe DSL and our kernel modules now, so the first call times the compile
            import cutlass.cute  # noqa: F401

            import torch_fa4.kernels.sm90.bwd  # noqa: F401
            import torch_fa4.kernels.sm90.fwd  # noqa: F401

        def attend(q, k, v):
            return torch_fa4.attention(q, k, v, causal=causal)

        if preimport:
            _phase_timers(phases)
    else:
        from flash_attn.cute.interface import flash_attn_func

        def attend(q, k, v):
            out = flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out
    t_import = time.perf_counter() - t0
    B, H = 16384 // S, 2048 // D
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=bwd) for _ in range(3))
    (q.float() @ q.float().transpose(-1, -2)).sum().item()  # the CUDA context and cuBLAS, not timed
    times = []
    if bwd:
        out = attend(q, k, v)
        g = torch.randn_like(out)
        torch.cuda.synchronize()
        for _ in range(2):
            t0 = time.perf_counter()
            torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    else:
        with torch.no_grad():
            for _ in range(2):
                t0 = time.perf_counter()
                attend(q, k, v)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
    print(json.dumps(dict(import_torch=t_torch, import_impl=t_import, first=times[0], second=times[1],
                          phases=phases)))


def run_child(impl, spec, bwd, env, preimport=False) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, spec] + (["--bwd"] if bwd else []) + \
        (["--preimport"] if preimport else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{impl} {spec}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(values) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128:4096:1,64:4096:0,256:4096:1")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--disk", action="store_true",
                    help="torch_fa4 only, per run: store in one process, load in the next (cache on)")
    ap.add_argument("--impls", default="torch_fa4,flash-attn-4")
    ap.add_argument("--preimport", action="store_true",
                    help="torch_fa4 imports CuTe DSL and its kernel modules before the timed call "
                         "(reported in its import time), as flash-attn-4's import does")
    ap.add_argument("--child", nargs=2, metavar=("IMPL", "ROW"))
    args = ap.parse_args()
    if args.child:
        impl, spec = args.child
        D, S, causal = (int(x) for x in spec.split(":"))
        child(impl, D, S, bool(causal), args.bwd, args.preimport)
        return
    base = dict(os.environ, TORCH_FA4_KERNEL_CACHE="0")
    base.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", None)
    direction = "bwd" if args.bwd else "fwd"
    print(f"first call ({direction}), seconds, median [min-max] over {args.runs} fresh processes")
    for spec in args.rows.split(","):
        if args.disk:  # each run with an empty cache: the compiling process, then a loading one
            results: dict = {"compile and store": [], "load from disk": []}
            for _ in range(args.runs):
                with tempfile.TemporaryDirectory() as cache:
                    env = dict(os.environ, TORCH_FA4_KERNEL_CACHE="1", TORCH_FA4_CACHE_DIR=cache)
                    for label in results:
                        results[label].append(run_child("torch_fa4", spec, args.bwd, env, args.preimport))
            for label, runs in results.items():
                report(direction, spec, f"torch_fa4 {label}", runs)
            continue
        for impl in args.impls.split(","):
            report(direction, spec, impl, [run_child(impl, spec, args.bwd, base, args.preimport)
                                           for _ in range(args.runs)])


def report(direction: str, spec: str, impl: str, runs: list) -> None:
    first = [r["first"] - r["second"] for r in runs]
    line = (f"{direction} {spec} {impl:12s} first call less a warm call {summary(first)} s; "
            f"import {summary([r['import_impl'] for r in runs])} s; "
            f"warm call {statistics.median(r['second'] for r in runs) * 1e3:.1f} ms")
    names = sorted({name for r in runs for name in r.get("phases", {})})
    if names:  # medians; what the first call spent outside them is the trace and the launch
        line += "; phases " + ", ".join(
            f"{n} {statistics.median(r['phases'].get(n, 0.0) for r in runs):.2f}" for n in names)
    print(line, flush=True)


if __name__ == "__main__":
    main()
