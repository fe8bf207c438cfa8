"""The portable backward (kernels/portable/bwd.py) against SDPA's flash backend (FlashAttention-2)
(GPU).

Rows: D 64 / 128 x S 1k / 4k / 16k x causal / not, 16k tokens per batch (B = 16384 / S), 2048 / D
heads, bf16. Ours is timed as dispatch calls it (row statistics, the kernel, the dQ conversion),
with out / lse from torch_fa4.reference's forward; SDPA's as torch.autograd.grad of one forward's
output (its own preprocessing included). TFLOP/s count 2.5 forward matmuls (bench._flops), the
causal half where causal.

    python benchmarks/portable_bwd_bench.py [--d 64 128] [--s 1024 4096 16384] [--deterministic]
        [--stages 1|2] [--small-tiles] [--ab] [--causal 0 1]

--ab: each row timed under every kernel tuning of `TUNINGS` (BwdVariant fields replaced) side by
side, the first being the default variant.
"""

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

# name -> BwdVariant fields replaced (--ab); the default variant first
TUNINGS = {
    "default": {},
    "scalar-red": dict(dq_pair_adds=False),
    "old-warps": dict(sdp_warps_n=2, kv_warps_n=1, dq_warps_n=2, dq_pair_adds=False),
}


def tunings_for(d: int) -> dict:
    """TUNINGS for head dim d: at 64 the earlier 64-query-row step too, and the old variant with it."""
    if d != 64:
        return TUNINGS
    rows64 = dict(tile_m=64, sdp_warps_n=4, kv_warps_n=2, dq_warps_n=2)
    return {**TUNINGS, "old-warps": {**TUNINGS["old-warps"], "tile_m": 64}, "64-rows": rows64}


TOKENS = 16384
WIDTH = 2048  # heads * head dim


def inputs(s, d):
    b, h = TOKENS // s, WIDTH // d
    return [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]


def ours(q, k, v, do, causal, deterministic, stages=None, large_tiles=None, tuning=None):
    from torch_fa4 import reference
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.portable import bwd

    call = AttentionCall(q=q, k=k, v=v, scale=1 / math.sqrt(q.shape[-1]), causal=causal)
    assert bwd.unsupported_reason(call) is None, bwd.unsupported_reason(call)
    out, lse = reference.forward(call)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    return lambda: bwd.backward(call, do, out, lse, dq, dk, dv, deterministic, stages=stages,
                                large_tiles=large_tiles, tuning=tuning)


def sdpa_flash(q, k, v, do, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    g = do.transpose(1, 2)
    return lambda: torch.autograd.grad(out, (qt, kt, vt), g, retain_graph=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--s", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--stages", type=int, default=None, help="Q / dO buffers (default: as many as fit)")
    ap.add_argument("--small-tiles", action="store_true", help="the tiles of the ~99 KB shared-memory GPUs")
    ap.add_argument("--ab", action="store_true", help="every tuning of TUNINGS side by side")
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
          f"bf16, {TOKENS} tokens, H*D={WIDTH}, backward TFLOP/s"
          + (", deterministic" if args.deterministic else ""))
    for d in args.d:
        tunings = tunings_for(d) if args.ab else {"portable": {}}
        print(f"{'D':>4} {'S':>6} {'causal':>6} " + " ".join(f"{n:>10}" for n in tunings)
              + f" {'sdpa-fa2':>9} {'ratio':>6}")
        for s in args.s:
            for causal in (bool(c) for c in args.causal):
                q, k, v, do = inputs(s, d)
                flops = bench._flops(q.shape[0], q.shape[2], s, d, causal, bwd=True)
                times = [bench._time_ms(ours(q, k, v, do, causal, args.deterministic, args.stages,
                                             False if args.small_tiles else None, tuning))
                         for tuning in tunings.values()]
                try:
                    t_ref = bench._time_ms(sdpa_flash(q, k, v, do, causal))
                except RuntimeError:  # no flash backend for this GPU / build
                    t_ref = math.nan
                tf = lambda ms: flops / ms / 1e9  # noqa: E731
                print(f"{d:>4} {s:>6} {str(causal):>6} " + " ".join(f"{tf(t):>10.1f}" for t in times)
                      + f" {tf(t_ref):>9.1f} {t_ref / times[0]:>6.2f}", flush=True)
                del q, k, v, do
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
