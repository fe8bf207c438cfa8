"""The portable kernels with score_mod / mask_mod against FlexAttention compiled (Triton), and the
portable forward's first compile against the sm90 forward's.

Mod rows (GPU): D128, S 4096, causal, B 4, H 16, bf16, each timed for the portable kernel (its
host entry, the mods traced once outside the timing, as benchmarks/bench.py times ours) and for
torch.compile(flex_attention) with the same score_mod / mask_mod (and a block mask for masks):

    alibi     score - slope[h] * (q_idx - kv_idx), slopes a captured (H,) fp32 tensor
    softcap   30 * tanh(score / 30) as a score_mod
    window    mask_mod q_idx - kv_idx <= 1024 (with causal: a sliding window)
    document  mask_mod doc[q_idx] == doc[kv_idx], 8 documents of 512 tokens (captured int32 ids)

Ours runs as a user calls it: torch_fa4.flex_attention with the portable backend forced
(TORCH_FA4_BACKEND=portable), its own block mask of the causal mask ANDed with the row's mask, host
time included; a call the portable kernel refuses is an error, never timed as the reference. Both
sides run the same causal call and mods, so the ratio (Flex's time / ours) is the comparison;
TFLOP/s count the dense causal FLOPs for both (4 B H S^2 D / 2; 2.5x that for --bwd).

--flex-mma-sync: Triton compiles FlexAttention with the warp-level MMA (mma.sync, Triton's
DISABLE_MMA_V3) instead of Hopper's warpgroup MMA, in private Inductor / Triton caches: on an
H100 / H200 that is the code FlexAttention runs on the Ampere, Ada and consumer-Blackwell GPUs this
kernel is for. The header says which MMA Flex's kernels use (read from their PTX).

--compile (CPU or GPU; CUTE_DSL_ARCH picks the target where there is no GPU, default sm_90a): each
variant's first compile in its own fresh process (CuTe DSL imported first, the disk cache off):
the sm90 forward's default variant for D128 S4k causal, then the portable forward's and the
portable backward's for the same call.

    python benchmarks/portable_mod_bench.py [--bwd] [--rows alibi,softcap,window,document] [--flex-mma-sync]
    python benchmarks/portable_mod_bench.py --compile [--runs 3]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ["TORCH_FA4_BACKEND"] = "portable"  # (read per call: ours runs the portable kernels)

B, S, H, D = 4, 4096, 16, 128
ROWS = ("alibi", "softcap", "window", "document")
WINDOW = 1024
DOC_LEN = 512  # 8 documents at S 4096


def mods_of(row: str, device="cuda"):
    """(score_mod, mask_mod) of a row; captured tensors live on `device`."""
    if row == "alibi":
        slopes = torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)], device=device)

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx)

        return alibi, None
    if row == "softcap":
        def softcap(score, b, h, q_idx, kv_idx):
            return 30.0 * torch.tanh(score / 30.0)

        return softcap, None
    if row == "window":
        def window(b, h, q_idx, kv_idx):
            return q_idx - kv_idx <= WINDOW

        return None, window
    doc = torch.arange(S, device=device, dtype=torch.int32) // DOC_LEN

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return None, document


def _causal_and(mask_mod):
    def causal_and(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        return keep & mask_mod(b, h, q_idx, kv_idx) if mask_mod is not None else keep
    return causal_and


def ours(q, k, v, do, score_mod, mask_mod, bwd: bool):
    import torch_fa4

    bm = torch_fa4.create_block_mask(_causal_and(mask_mod), None, None, S, S, device=q.device)
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(bwd) for t in (q, k, v))

    def fwd():
        return torch_fa4.flex_attention(qt, kt, vt, score_mod=score_mod, block_mask=bm)
    with warnings.catch_warnings():  # a fallback (to the reference) is an error here, not a row
        warnings.filterwarnings("error", message="torch_fa4: portable")
        out = fwd()
        if bwd:
            g = do.transpose(1, 2)
            torch.autograd.grad(out, (qt, kt, vt), g, retain_graph=True)
    if not bwd:
        return fwd
    return lambda: torch.autograd.grad(out, (qt, kt, vt), g, retain_graph=True)


def flex(q, k, v, do, score_mod, mask_mod, bwd: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    bm = create_block_mask(_causal_and(mask_mod), None, None, S, S)
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(bwd) for t in (q, k, v))
    if not bwd:
        return lambda: compiled(qt, kt, vt, score_mod=score_mod, block_mask=bm)
    out = compiled(qt, kt, vt, score_mod=score_mod, block_mask=bm)
    g = do.transpose(1, 2)
    return lambda: torch.autograd.grad(out, (qt, kt, vt), g, retain_graph=True)


def run_rows(rows, bwd: bool):
    import bench

    print(f"{torch.cuda.get_device_name()}, bf16, B {B} H {H} S {S} D {D} causal, "
          f"{'backward' if bwd else 'forward'} (TFLOP/s: dense causal FLOPs); torch_fa4 forced to the "
          f"portable kernels")
    print(f"{'row':>9} {'portable':>9} {'flex':>9} {'flex ms / ours ms':>18}")
    flops = 4.0 * B * H * S * S * D / 2 * (2.5 if bwd else 1.0)
    for row in rows:
        q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        score_mod, mask_mod = mods_of(row)
        times = {}
        for name, make in (("portable", ours), ("flex", flex)):
            try:
                fn = make(q, k, v, do, score_mod, mask_mod, bwd)
                fn()
                torch.cuda.synchronize()
                times[name] = bench._time_ms(fn)
            except Exception as e:  # noqa: BLE001  (a side without a kernel for the row: say why)
                times[name] = math.nan
                print(f"  {row} {name}: {type(e).__name__}: {str(e)[:160]}")
        tf = {n: flops / t / 1e9 for n, t in times.items()}
        ratio = times["flex"] / times["portable"]
        print(f"{row:>9} {tf['portable']:>9.1f} {tf['flex']:>9.1f} {ratio:>17.2f}x", flush=True)
    print(f"Flex's kernels: {_flex_mma()}")


def _flex_mma() -> str:
    """Which MMA the Triton kernels compiled so far use, from their PTX in Triton's cache."""
    import glob

    root = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    ptx = [open(p).read() for p in glob.glob(os.path.join(root, "**", "*.ptx"), recursive=True)]
    wgmma = sum("wgmma.mma_async" in t for t in ptx)
    sync = sum("mma.sync" in t for t in ptx)
    return f"{wgmma} of {len(ptx)} PTX files use wgmma, {sync} mma.sync ({root})"


def _use_flex_mma_sync() -> None:
    """Triton's warp-level MMA for FlexAttention, compiled afresh (private caches: a kernel cached
    with Hopper's MMA must not be reused)."""
    import tempfile

    os.environ["DISABLE_MMA_V3"] = "1"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-mma-sync-")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-mma-sync-")


def compile_one(which: str) -> None:
    """In this (fresh) process: import CuTe DSL, then time one first compile."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass.cute  # noqa: F401

    from torch_fa4.call import AttentionCall

    q = torch.empty(B, S, H, D, dtype=torch.bfloat16)
    call = AttentionCall(q=q, k=q, v=q, scale=D ** -0.5, causal=True)
    arch = os.environ["CUTE_DSL_ARCH"]
    t = time.perf_counter()
    if which == "sm90-fwd":
        from torch_fa4.kernels.sm90 import fwd_host

        fwd_host.compile_fwd(fwd_host.default_config(call))
    elif which == "portable-fwd":
        from torch_fa4.kernels.portable import fwd_host

        fwd_host.compile_fwd(fwd_host.default_config(call, arch), arch)
    else:
        from torch_fa4.kernels.portable.bwd_compile import compile_variant
        from torch_fa4.kernels.portable.bwd_config import make_variant

        compile_variant(make_variant(torch.bfloat16, D, D, bounded=True, stages=2, large_tiles=True,
                                     dq_pair_adds=arch.startswith("sm_9")), arch=arch)
    print(f"{which}: {time.perf_counter() - t:.2f} s")


def run_compiles(runs: int) -> None:
    env = dict(os.environ, TORCH_FA4_KERNEL_CACHE="0")
    if "CUTE_DSL_ARCH" not in env and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        env["CUTE_DSL_ARCH"] = f"sm_{major}{minor}" + ("a" if major >= 9 else "")
    env.setdefault("CUTE_DSL_ARCH", "sm_90a")
    print(f"first compile in a fresh process, D{D} S{S} causal, {env['CUTE_DSL_ARCH']}, median [min-max] "
          f"of {runs}")
    for which in ("sm90-fwd", "portable-fwd", "portable-bwd"):
        secs = []
        for _ in range(runs):
            out = subprocess.run([sys.executable, __file__, "--compile-one", which], env=env,
                                 capture_output=True, text=True, check=True).stdout
            secs.append(float(out.strip().splitlines()[-1].split(": ")[1].split()[0]))
        print(f"{which:>13}: {statistics.median(secs):.2f} s [{min(secs):.2f}-{max(secs):.2f}]", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--bwd", action="store_true", help="time the backward (after one forward)")
    ap.add_argument("--compile", action="store_true", help="first-compile times instead")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--compile-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--flex-mma-sync", action="store_true",
                    help="Flex compiled with the warp-level MMA (the code it runs on pre-Hopper GPUs)")
    args = ap.parse_args()
    if args.flex_mma_sync:
        _use_flex_mma_sync()
    if args.compile_one:
        compile_one(args.compile_one)
    elif args.compile:
        run_compiles(args.runs)
    else:
        run_rows([r for r in args.rows.split(",") if r], args.bwd)


if __name__ == "__main__":
    main()
