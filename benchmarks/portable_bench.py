"""Forward throughput of the portable (warp-MMA) kernels against SDPA's flash backend
(FlashAttention-2) and cuDNN, side by side, on the GPU at hand.

Rows: D in {64, 128, 256} x S in {1k, 4k, 16k} x causal, 16k tokens per row (B = 16384 / S),
H * D = 2048, bf16. TFLOP/s = 4 B H S^2 D (halved when causal) / time; medians of
triton.testing.do_bench (CUDA events) after warm-up. The portable kernels run through
torch_fa4.attention with TORCH_FA4_BACKEND=portable (dispatch included, as a user runs them); a
row the kernel would hand to the reference is reported as such, never timed as the kernel.

    python benchmarks/portable_bench.py [--quick] [--tune [--tune-d 128]] [--json out.json]

--quick: D64 / D128 at S4k, causal and not.
--tune: instead, the tile candidates of `_CANDIDATES` (PortableFwdConfig overrides, launched
through the kernel's host entry) at S4k, for choosing the rows of kernels/portable/tiles.py.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
import torch.nn.functional as F

_GRID = [(D, S, c) for D in (64, 128, 256) for S in (1024, 4096, 16384) for c in (False, True)]
_QUICK = [(D, 4096, c) for D in (64, 128) for c in (False, True)]
_TOKENS = 16384
_HIDDEN = 2048  # H * D


# per head dim: overrides of PortableFwdConfig to time against the default row (--tune)
_CANDIDATES = {
    # D64: the row (4 warps of 32 rows, 64 keys) against 64-row CTAs, 8 warps of 16 rows, and
    # 128-key tiles (fewer online-softmax rounds per key; 8 warps keep S 16 x 128 in registers)
    64: [dict(), dict(tile_m=64), dict(num_warps=8, tile_m=128), dict(num_warps=8, tile_n=128),
         dict(num_warps=8, tile_n=128, q_in_regs=False), dict(tile_n=128, q_in_regs=False)],
    # the row (4 warps of 32 rows, 64 keys: spills 12-18 registers in the key loop) against 8 warps
    # of 16 rows (one CTA per SM, each warp reading all of K and V), 32-key tiles (no spills) and
    # 64 x 64 with 4 warps of 16 rows (several CTAs per SM)
    128: [dict(), dict(num_warps=8, q_in_regs=True), dict(tile_n=32), dict(tile_m=64, q_in_regs=True)],
    256: [dict(), dict(tile_m=64, num_warps=4), dict(tile_n=32)],
}


def _tune(warmup, rep, head_dims):
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.portable import fwd_host

    print(f"{'D':>4} {'causal':>6} {'TFLOP/s':>8}  overrides (S 4096, B 4, H*D 2048)")
    for D, candidates in _CANDIDATES.items():
        if D not in head_dims:
            continue
        for causal in (False, True):
            S, B, H = 4096, 4, _HIDDEN // D
            q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            call = AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, causal=causal)
            out = torch.empty_like(q)
            lse = torch.empty(call.lse_shape(), dtype=torch.float32, device="cuda")
            for overrides in candidates:
                try:
                    fwd_host.forward(call, out, lse, **overrides)
                    torch.cuda.synchronize()
                    ms = _time_ms(lambda: fwd_host.forward(call, out, lse, **overrides), warmup, rep)
                    tflops = _flops(B, H, S, D, causal) / ms / 1e9
                    print(f"{D:>4} {str(causal):>6} {tflops:>8.1f}  {overrides}", flush=True)
                except Exception as e:  # noqa: BLE001  (a candidate that does not fit this GPU)
                    problem = f"{type(e).__name__}: {str(e)[:120]}"
                    print(f"{D:>4} {str(causal):>6} {'-':>8}  {overrides}: {problem}")


def _flops(B, H, S, D, causal):
    return 4.0 * B * H * S * S * D / (2 if causal else 1)


def _time_ms(fn, warmup, rep) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):  # (B, S, H, D) -> SDPA's (B, H, S, D) views
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal)
    return run


def _portable(q, k, v, causal):
    import torch_fa4

    return torch_fa4.attention(q, k, v, causal=causal)


def _portable_runs(q, k, v, causal) -> bool:
    """Whether dispatch hands this call to the portable forward (not the reference)."""
    from torch_fa4 import dispatch
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels import portable

    call = AttentionCall(q=q, k=k, v=v, scale=q.shape[-1] ** -0.5, causal=causal)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dispatch.kernel_for(call, "forward") is portable


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--tune-d", type=int, nargs="+", default=list(_CANDIDATES),
                        help="--tune: these head dims")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    os.environ["TORCH_FA4_BACKEND"] = "portable"
    from torch.nn.attention import SDPBackend

    warmup, rep = (25, 100) if args.quick or args.tune else (50, 200)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name} (compute capability {props.major}.{props.minor}, "
          f"{props.multi_processor_count} SMs), "
          f"torch {torch.__version__}; bf16, {_TOKENS} tokens per row, H*D = {_HIDDEN}; forward TFLOP/s")
    if args.tune:
        _tune(warmup, rep, args.tune_d)
        return
    peers = {"sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION), "cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION)}
    header = f"{'D':>4} {'S':>6} {'causal':>6} | {'portable':>9} {'sdpa-flash':>10} {'cudnn':>8} | " \
             f"{'vs flash':>8} {'vs cudnn':>8}"
    print(header)
    print("-" * len(header))
    rows = []
    for D, S, causal in (_QUICK if args.quick else _GRID):
        B, H = _TOKENS // S, _HIDDEN // D
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = _flops(B, H, S, D, causal)
        row = dict(D=D, S=S, causal=causal)
        impls = dict(peers)
        if _portable_runs(q, k, v, causal):
            impls["portable"] = _portable
        for name, fn in impls.items():
            try:
                fn(q, k, v, causal)  # compile / warm up outside the timing
                torch.cuda.synchronize()
                row[name] = flops / _time_ms(lambda: fn(q, k, v, causal), warmup, rep) / 1e9
            except Exception as e:  # noqa: BLE001  (a peer without a kernel for the row)
                row[name] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)

        def cell(name, width):
            value = row.get(name)
            return f"{value:>{width}.1f}" if value is not None else f"{'-':>{width}}"

        def ratio(peer):
            if row.get("portable") is None or not row.get(peer):
                return f"{'-':>8}"
            return f"{row['portable'] / row[peer]:>7.2f}x"

        print(f"{D:>4} {S:>6} {str(causal):>6} | {cell('portable', 9)} {cell('sdpa-flash', 10)} "
              f"{cell('cudnn', 8)} | {ratio('sdpa-flash')} {ratio('cudnn')}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            capability = f"{props.major}.{props.minor}"
            json.dump(dict(device=props.name, capability=capability, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
