"""Attention throughput: torch_fa4 against its peers, one GPU run, one table.

Rows: D in {64, 128, 256} x S in {1k, 4k, 16k} x causal, 16k tokens per row (B = 16384 / S),
H * D = 2048, bf16; extra forward rows at D128 S4k (softcap, window 1024, ALiBi score_mod); backward
rows (autograd through torch_fa4.attention) at D in {64, 128}. Peers: SDPA (cuDNN and flash
backends), FlexAttention compiled, flash-attn-4 (flash_attn.cute, benchmarking only).
FLOPs: fwd = 4 B H Sq Sk D (halved when causal), bwd = 2.5 x fwd. Medians of
triton.testing.do_bench (CUDA events) after warm-up. Writes results.json and a PNG to --out.

    python benchmarks/bench.py --out bench_out [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import traceback

import torch
import torch.nn.functional as F


def _time_ms(fn) -> float:
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=50, rep=200, return_mode="median"))
    except ImportError:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]


def _flops(B, H, S, D, causal, bwd=False):
    f = 4.0 * B * H * S * S * D / (2 if causal else 1)
    return f * (2.5 if bwd else 1.0)


# ------------------------------------------------------------------ forward implementations
def ours_fwd(q, k, v, causal, softcap=0.0, window=(-1, -1), score_mod=None):
    """q, k, v (B, S, H, D)."""
    if score_mod is not None:
        import torch_fa4

        return lambda: torch_fa4.attention(q, k, v, causal=causal, score_mod=score_mod)
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90 import fwd_host

    call = AttentionCall(q=q, k=k, v=v, scale=q.shape[-1] ** -0.5, causal=causal, softcap=softcap,
                         window_left=window[0], window_right=window[1])
    reason = fwd_host.unsupported_reason(call)
    if reason:
        raise RuntimeError(reason)
    out = torch.empty_like(q)
    lse = torch.empty(call.lse_shape(), dtype=torch.float32, device=q.device)
    return lambda: fwd_host.forward(call, out, lse)


def fa4_fwd(q, k, v, causal, softcap=0.0, window=(-1, -1), score_mod=None):
    from flash_attn.cute.interface import flash_attn_func

    kw = dict(causal=causal)
    if softcap:
        kw["softcap"] = softcap
    if window != (-1, -1):
        kw["window_size"] = (None if window[0] < 0 else window[0], None if window[1] < 0 else window[1])
    if score_mod is not None:
        raise RuntimeError("score_mod peer not wired")
    return lambda: flash_attn_func(q, k, v, **kw)


def _sdpa(backend):
    def make(q, k, v, causal, softcap=0.0, window=(-1, -1), score_mod=None):
        if softcap or window != (-1, -1) or score_mod is not None:
            raise RuntimeError("n/a")
        from torch.nn.attention import sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        return fn

    return make


_flex_compiled = None


def flex_fwd(q, k, v, causal, softcap=0.0, window=(-1, -1), score_mod=None):
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    S = q.shape[1]
    conds = []
    if causal:
        conds.append(lambda b, h, i, j: j <= i)
    if window != (-1, -1):
        wl = window[0]
        conds.append(lambda b, h, i, j: (i - j <= wl) & (j <= i))
    mask_mod = None
    if conds:
        def mask_mod(b, h, i, j):
            m = conds[0](b, h, i, j)
            for c in conds[1:]:
                m = m & c(b, h, i, j)
            return m
    bm = create_block_mask(mask_mod, None, None, S, S) if mask_mod else None
    sm = score_mod
    if softcap:
        def sm(s, b, h, i, j):
            return softcap * torch.tanh(s / softcap)
    return lambda: _flex_compiled(qt, kt, vt, score_mod=sm, block_mask=bm)


PEERS = {
    "torch_fa4": ours_fwd,
    "flash-attn-4": fa4_fwd,
    "sdpa-cudnn": None,
    "sdpa-flash": None,
    "flex": flex_fwd,
}


def _peers():
    from torch.nn.attention import SDPBackend

    p = dict(PEERS)
    p["sdpa-cudnn"] = _sdpa(SDPBackend.CUDNN_ATTENTION)
    p["sdpa-flash"] = _sdpa(SDPBackend.FLASH_ATTENTION)
    return p


# ------------------------------------------------------------------ backward implementations
def ours_bwd(q, k, v, causal):
    import torch_fa4

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch_fa4.attention(q, k, v, causal=causal)
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)


def fa4_bwd(q, k, v, causal):
    from flash_attn.cute.interface import flash_attn_func

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attn_func(q, k, v, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)


def sdpa_bwd(backend):
    def make(q, k, v, causal):
        from torch.nn.attention import sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        g = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (qt, kt, vt), g, retain_graph=True)

    return make


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="D128 S4k rows only")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--options-sweep", action="store_true",
                    help="torch_fa4 softmax options (conditional rescale, exp2 emulation, pingpong)")
    ap.add_argument("--peers", default="torch_fa4,flash-attn-4,sdpa-cudnn,sdpa-flash,flex")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    peers = {k: v for k, v in _peers().items() if k in args.peers.split(",")}
    tokens, width = 16384, 2048
    dims = [128] if args.quick else [64, 128, 256]
    seqs = [4096] if args.quick else [1024, 4096, 16384]
    rows = []

    def measure(label, D, S, causal, flops, makers, extra=None):
        B, H = tokens // S, width // D
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        row = {"row": label, "D": D, "S": S, "causal": causal}
        for name, make in makers.items():
            try:
                fn = make(q, k, v, causal, **(extra or {}))
                ms = _time_ms(fn)
                row[name] = flops(B, H, S, D, causal) / ms / 1e9
            except Exception as e:  # a peer that cannot run this row is reported, not fatal
                row[name] = None
                row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        _print_row(row, list(makers))

    if args.options_sweep:
        sweep = {"default": {}, "rescale8": dict(rescale_threshold=8.0), "emu4": dict(exp2_emulate_every=4),
                 "emu2": dict(exp2_emulate_every=2), "rescale8+emu4": dict(rescale_threshold=8.0, exp2_emulate_every=4),
                 "no-pingpong": dict(pingpong=False)}

        def with_opts(opts):
            def make(q, k, v, causal):
                from torch_fa4.call import AttentionCall
                from torch_fa4.kernels.sm90 import fwd_host

                call = AttentionCall(q=q, k=k, v=v, scale=q.shape[-1] ** -0.5, causal=causal)
                out = torch.empty_like(q)
                lse = torch.empty(call.lse_shape(), dtype=torch.float32, device=q.device)
                return lambda: fwd_host.forward(call, out, lse, **opts)
            return make

        print("torch_fa4 fwd options TFLOP/s")
        for D in (64, 128, 256):
            for S in (4096, 16384):
                for causal in (False, True):
                    measure(f"opts D{D} S{S // 1024}k{' causal' if causal else ''}", D, S, causal, _flops,
                            {k: with_opts(v) for k, v in sweep.items()})
    print("fwd TFLOP/s")
    for D in dims:
        for S in seqs:
            for causal in (False, True):
                measure(f"fwd D{D} S{S // 1024}k{' causal' if causal else ''}", D, S, causal, _flops, peers)
    alibi_slopes = None

    def alibi(score, b, h, q_idx, kv_idx):
        return score - alibi_slopes[h] * (q_idx - kv_idx).abs()

    H128 = width // 128
    alibi_slopes = torch.tensor([2 ** (-8 * (i + 1) / H128) for i in range(H128)], device="cuda")
    for label, extra in (("softcap 30", dict(softcap=30.0)), ("window 1024", dict(window=(1024, 0))),
                         ("alibi score_mod", dict(score_mod=alibi))):
        measure(f"fwd D128 S4k {label} causal", 128, 4096, True,
                (lambda B, H, S, D, c, w=extra: _flops(B, H, S, D, c) if "window" not in w
                 else 4.0 * B * H * S * min(S, 1025) * D), peers, extra)
    if not args.no_bwd:
        from torch.nn.attention import SDPBackend

        bpeers = {"torch_fa4": ours_bwd, "flash-attn-4": fa4_bwd,
                  "sdpa-cudnn": sdpa_bwd(SDPBackend.CUDNN_ATTENTION),
                  "sdpa-flash": sdpa_bwd(SDPBackend.FLASH_ATTENTION)}
        bpeers = {k: v for k, v in bpeers.items() if k in peers}
        print("bwd TFLOP/s")
        for D in ([128] if args.quick else [64, 128]):
            for S in seqs:
                for causal in (False, True):
                    measure(f"bwd D{D} S{S // 1024}k{' causal' if causal else ''}", D, S, causal,
                            lambda *a: _flops(*a, bwd=True), bpeers)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    _plot(rows, list(peers), os.path.join(args.out, "bench.png"))


def _print_row(row, names):
    ref = row.get("flash-attn-4")
    cells = []
    for n in names:
        v = row.get(n)
        cells.append(f"{n}={v:6.1f}" if v else f"{n}=   n/a")
    ratio = (row.get("torch_fa4") or 0) / ref if ref else float("nan")
    print(f"{row['row']:<34} " + "  ".join(cells) + f"  ratio_vs_fa4={ratio:.3f}", flush=True)


def _plot(rows, names, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.6), 5))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([r + i * w for r in range(len(rows))], [row.get(n) or 0 for row in rows], w, label=n)
    ax.set_xticks([r + 0.4 for r in range(len(rows))])
    ax.set_xticklabels([row["row"] for row in rows], rotation=75, fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
