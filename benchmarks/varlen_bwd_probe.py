"""Which packed varlen batches the backward's packed-rows variant runs (GPU, a diagnostic).

The packed-rows variant (bwd.VARLEN_KERNEL_ENV=1) stopped with an illegal instruction in every
case tests/gpu/test_sm90_bwd.py::test_varlen_kernel tried (NOTES Experiments 80, 85). A fault
leaves the CUDA context unusable, so each case runs in its own process: it computes the
gradients the default way (one dense launch per sequence) and then with the packed variant, and
prints the largest difference, or how the process ended.

    python benchmarks/varlen_bwd_probe.py                     # the built-in cases
    python benchmarks/varlen_bwd_probe.py --sanitize NAME     # one case under compute-sanitizer
    python benchmarks/varlen_bwd_probe.py --time              # packed vs per-sequence backward, ms

--time: the backward alone (torch.autograd.grad of one forward's output, repeated) of batches of
equal and of mixed lengths, D128, 16 query and 16 key heads, bf16: the packed-rows launch
against one dense launch per sequence (VARLEN_KERNEL_ENV=0), each the median of 20 CUDA-event
timings after 3 warm-up calls, the two interleaved.
"""

import argparse
import json
import os
import subprocess
import sys

# name -> (query lengths, key lengths, head dim, causal, q heads, kv heads, extra environment)
CASES = {
    "one_tile": ([128], [128], 64, False, 2, 2, {}),
    "one_short": ([100], [100], 64, False, 2, 2, {}),
    "two_tiles": ([128, 128], [128, 128], 64, False, 2, 2, {}),
    "one_tile_d128": ([128], [128], 128, False, 2, 2, {}),
    "one_tile_no_pdl": ([128], [128], 64, False, 2, 2, {"TORCH_FA4_BWD_PDL": "0"}),
    "five_causal": ([300, 17, 129, 256, 64], [260, 40, 129, 200, 64], 64, True, 4, 2, {}),
    "one_causal": ([128], [128], 64, True, 2, 2, {}),
    "one_gqa": ([128], [128], 64, False, 4, 2, {}),
    "q_longer": ([300], [260], 64, False, 2, 2, {}),
    "k_longer": ([17], [40], 64, False, 2, 2, {}),
    "five_equal": ([300, 17, 129, 256, 64], [300, 17, 129, 256, 64], 64, False, 2, 2, {}),
    "five": ([300, 17, 129, 256, 64], [260, 40, 129, 200, 64], 64, False, 2, 2, {}),
    "two_long": ([300, 300], [300, 300], 64, False, 2, 2, {}),
    "one_long": ([300], [300], 64, False, 2, 2, {}),
    "empty_tiles": ([300, 17], [300, 17], 64, False, 2, 2, {}),
    "empty_first": ([17, 300], [17, 300], 64, False, 2, 2, {}),
    "five_full": ([300] * 5, [300] * 5, 64, False, 2, 2, {}),
    "short_k_only": ([300, 300], [300, 17], 64, False, 2, 2, {}),
}


def child(name: str) -> None:
    import torch

    import torch_fa4
    from torch_fa4.kernels.sm90 import bwd

    lens_q, lens_k, d, causal, hq, hkv, _ = CASES[name]
    torch.manual_seed(0)
    dev = "cuda"
    cu_q = torch.tensor([0] + lens_q, device=dev).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=dev).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), hkv, d, device=dev, dtype=torch.bfloat16)
    dout = torch.randn_like(q)

    def grads(packed: bool):
        os.environ[bwd.VARLEN_KERNEL_ENV] = "1" if packed else "0"
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = torch_fa4.attention(*leaves, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                  max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
        out.backward(dout)
        torch.cuda.synchronize()
        return [t.grad for t in leaves]

    ref = grads(False)
    got = grads(True)
    err = [float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref)]
    print("RESULT", json.dumps({"case": name, "max_abs_diff_dq_dk_dv": err,
                                "nan": any(bool(g.isnan().any()) for g in got)}), flush=True)


def time_backward() -> None:
    import statistics

    import torch

    import torch_fa4
    from torch_fa4.kernels.sm90 import bwd

    g = torch.Generator().manual_seed(0)
    batches = {"64 x 256": [256] * 64, "16 x 1024": [1024] * 16, "4 x 4096": [4096] * 4,
               "mixed 48, 17-2000": torch.randint(17, 2001, (48,), generator=g).tolist()}
    for label, lens in batches.items():
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        q, k, v, dout = (torch.randn(sum(lens), 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = torch_fa4.attention(*leaves, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                  max_seqlen_q=max(lens), max_seqlen_k=max(lens))
        times = {"packed": [], "per sequence": []}
        for i in range(23):
            for mode, env in (("packed", "1"), ("per sequence", "0")):
                os.environ[bwd.VARLEN_KERNEL_ENV] = env
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.autograd.grad(out, leaves, dout, retain_graph=True)
                end.record()
                end.synchronize()
                if i >= 3:
                    times[mode].append(start.elapsed_time(end))
        med = {m: statistics.median(t) for m, t in times.items()}
        print(f"{label}: packed {med['packed']:.3f} ms, per sequence {med['per sequence']:.3f} ms "
              f"({med['per sequence'] / med['packed']:.2f}x)", flush=True)


def run(name: str, sanitize: bool) -> None:
    env = dict(os.environ, **CASES[name][6])
    cmd = [sys.executable, __file__, "--child", name]
    if sanitize:
        env["CUTE_DSL_ARCH"] = "sm_90a"  # the DSL's device query fails under the sanitizer
        cmd = ["compute-sanitizer", "--tool", "memcheck", "--report-api-errors", "no",
               "--show-backtrace", "device"] + cmd
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        lines = (p.stdout + p.stderr).splitlines()
        result = [x for x in lines if x.startswith("RESULT")]
        print(f"== {name}: exit {p.returncode}", *(result or lines[-25:]), sep="\n", flush=True)
    except subprocess.TimeoutExpired:
        print(f"== {name}: timed out (a hang)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sanitize", help="run this one case under compute-sanitizer memcheck")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--time", action="store_true", help="packed vs per-sequence backward times")
    args = parser.parse_args()
    if args.time:
        time_backward()
    elif args.child:
        child(args.child)
    elif args.sanitize:
        run(args.sanitize, True)
    else:
        for name in args.cases.split(","):
            run(name, False)


if __name__ == "__main__":
    main()
