"""First-call compile time of kernel variants in a fresh process (the <= 3 s target, NOTES Experiment 27).

Times the CuTe DSL import once, then `compile_fwd` / the backward's `compile_variant` for a few
default variants, each compiled for the first time in this process (the in-process cache is
empty; the disk cache is turned off). Needs no GPU (CUTE_DSL_ARCH=sm_90a on a CPU machine).

    python benchmarks/compile_time.py              # one process
    python benchmarks/compile_time.py --phases     # + where each variant's time goes
    python benchmarks/compile_time.py --runs 5     # 5 fresh processes: median [min-max] per line
    python benchmarks/compile_time.py --disk       # with the disk cache: a process that compiles
                                                   # and stores, then one that loads
    python benchmarks/compile_time.py --row 128:4096:1 --variants '{"one_loop": {"split_mask_loops": false}}'
                                                   # one process, each variant compiled --repeat times

--phases splits each variant's time (by wrapping CuTe DSL internals, measurement only):
  preprocess  the DSL's AST rewrite of each @cute.jit function, once per function per process
  mlir        the MLIR pass pipeline: CuTe lowering, NVVM (LLVM -> PTX) and ptxas, one native call
  host-jit    the host launch wrapper: MCJIT engine, its symbol lookup, the TVM-FFI re-link
  trace       the rest: running the kernels' Python to build the MLIR module (and argument setup)
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("TORCH_FA4_KERNEL_CACHE", "0")  # --disk sets it for its child processes

_PHASES = ("preprocess", "mlir", "host-jit")


def _install_phase_timers(acc: dict) -> None:
    from cutlass._mlir import execution_engine
    from cutlass.base_dsl import compiler, dsl
    from cutlass.cutlass_dsl import tvm_ffi_provider

    from timers import wrap_timed

    def wrap(owner, name, phase):
        wrap_timed(owner, name, phase, acc)

    wrap(dsl.BaseDSL, "run_preprocessor", "preprocess")
    wrap(compiler.Compiler, "compile", "mlir")
    wrap(compiler.Compiler, "jit", "host-jit")
    wrap(execution_engine.ExecutionEngine, "lookup", "host-jit")
    for obj in vars(tvm_ffi_provider).values():
        if isinstance(obj, type) and "_create_tvm_ffi_function" in vars(obj):
            wrap(obj, "_create_tvm_ffi_function", "host-jit")


def run_once(phases: bool) -> None:
    if os.environ["TORCH_FA4_KERNEL_CACHE"] == "0":  # (loading from disk imports no CuTe DSL)
        t0 = time.perf_counter()
        import cutlass.cute  # noqa: F401

        print(f"import cutlass.cute: {time.perf_counter() - t0:.2f} s")
    acc: dict = {}
    if phases:
        _install_phase_timers(acc)
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90 import bwd, fwd_host

    def call(D, S, **kw):
        q = torch.empty(1, S, 2, D, dtype=torch.bfloat16)
        return AttentionCall(q=q, k=q, v=q, scale=D ** -0.5, **kw)

    fwd = lambda c: fwd_host.compile_fwd(fwd_host.default_config(c))  # noqa: E731
    back = lambda c: bwd.compile_variant(bwd.variant_key(c, False))  # noqa: E731
    cases = [("fwd D128 causal", fwd, call(128, 4096, causal=True)),
             ("fwd D64 S4k (192x128)", fwd, call(64, 4096)),
             ("fwd D256 S4k causal", fwd, call(256, 4096, causal=True)),
             ("fwd D128 softcap window", fwd, call(128, 4096, softcap=30.0, window_left=256)),
             ("bwd D128 causal", back, call(128, 4096, causal=True)),
             ("bwd D64", back, call(64, 4096))]
    for name, compile_fn, c in cases:
        acc.clear()
        t = time.perf_counter()
        compile_fn(c)
        total = time.perf_counter() - t
        line = f"{name}: {total:.2f} s"
        if phases:
            parts = {p: acc.get(p, 0.0) for p in _PHASES}
            parts["trace"] = total - sum(parts.values())
            line += " (" + ", ".join(f"{p} {v:.2f}" for p, v in parts.items()) + ")"
        print(line, flush=True)


def run_variants(row: str, variants: dict, repeat: int) -> None:
    """One process: the row's default forward variant and FwdConfig overrides of it, each compiled
    `repeat` times (the in-process cache cleared before each), after one warm-up compile that pays
    the per-process costs (preprocess, first pass-manager setup). Wall and CPU seconds, min and
    median: a variant's compile without the process-to-process noise."""
    import dataclasses

    import cutlass.cute  # noqa: F401

    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels import compile_cache
    from torch_fa4.kernels.sm90 import fwd_host

    D, S, causal = (int(x) for x in row.split(":"))
    q = torch.empty(16384 // S, S, 2048 // D, D, dtype=torch.bfloat16)
    base = fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=D ** -0.5, causal=bool(causal)))
    fwd_host.compile_fwd(base)
    times: dict = {}
    for _ in range(repeat):
        for name, overrides in {"default": {}, **variants}.items():
            compile_cache.clear()
            t, c = time.perf_counter(), time.process_time()
            fwd_host.compile_fwd(dataclasses.replace(base, **overrides))
            times.setdefault(name, []).append((time.perf_counter() - t, time.process_time() - c))
    for name, ts in times.items():
        wall, cpu = [x[0] for x in ts], [x[1] for x in ts]
        print(f"fwd {row} {name}: wall min {min(wall):.2f} median {statistics.median(wall):.2f} s, "
              f"cpu min {min(cpu):.2f} median {statistics.median(cpu):.2f} s", flush=True)


def run_many(runs: int, phases: bool) -> None:
    """Each run in a fresh process; per line and number: median [min-max]."""
    outputs = []
    for _ in range(runs):
        cmd = [sys.executable, __file__] + (["--phases"] if phases else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        outputs.append([line for line in out.splitlines() if ": " in line and " s" in line])
    number = re.compile(r"\d+\.\d+")
    for lines in zip(*outputs):
        values = [[float(x) for x in number.findall(line)] for line in lines]
        cols = []
        for col in zip(*values):
            cols.append(f"{statistics.median(col):.2f} [{min(col):.2f}-{max(col):.2f}]")
        it = iter(cols)
        print(number.sub(lambda m: next(it), lines[0]))


def run_disk() -> None:
    """Two fresh processes sharing an empty disk cache: compile + store, then load."""
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCH_FA4_KERNEL_CACHE="1", TORCH_FA4_CACHE_DIR=cache)
        for label in ("compile and store", "load from disk"):
            t = time.perf_counter()
            out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, check=True).stdout
            print(f"== {label} (process total {time.perf_counter() - t:.1f} s)")
            print("\n".join(line for line in out.splitlines() if ": " in line and " s" in line))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", action="store_true", help="split each variant's time by phase")
    parser.add_argument("--runs", type=int, default=1, help="fresh processes; prints median [min-max]")
    parser.add_argument("--disk", action="store_true", help="compile and store, then load in a new process")
    parser.add_argument("--row", default=None, metavar="D:S:CAUSAL",
                        help="instead: this forward row's default and --variants, --repeat times each")
    parser.add_argument("--variants", default="{}", help='JSON {name: FwdConfig overrides}')
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.row:
        import json

        run_variants(args.row, json.loads(args.variants), args.repeat)
    elif args.disk:
        run_disk()
    elif args.runs > 1:
        run_many(args.runs, args.phases)
    else:
        run_once(args.phases)


if __name__ == "__main__":
    main()
