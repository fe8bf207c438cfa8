"""Decode: one query row per sequence against a long KV cache, torch_fa4 beside its peers.

    python benchmarks/decode_bench.py [--rows 8x4096,8x32768,64x8192] [--pages 16,256] [--host [--cprofile N]]

bf16, Hq 32, Hkv 8, D 128, causal (one row: every key is visible). Each row prints the median
time of each implementation, the K/V bytes it reads per second, and torch_fa4's ratio to the
fastest peer (> 1: faster). Peers: flash-attn-4 (`flash_attn.cute`, when installed), SDPA's
default choice, FlexAttention compiled. The card's copy bandwidth (read + write of 2 GiB) is the
ceiling printed first.

Paged KV caches (`--pages`, empty for none): the same rows with the cache in pages of each size,
handed to the sequences in a random order (seqused_k = the cache length), torch_fa4 beside its
contiguous cache with the same seqused_k (the ratio: paged time / contiguous time), the same
call with packed queries (cu_seqlens_q, one per sequence: continuous batching's layout) and
flash-attn-4's paged call (`flash_attn_varlen_func(..., page_table=...)`, when installed).
FlexAttention's paged decoding needs its own cache manager and block mask conversion, so it is
not timed here.

`--host`: for each row and implementation (the paged ones included), the host's time to enqueue
one call (calls back to back, no synchronisation), the device time and the sum of the call's
kernel times, so a row bound by the host shows it; `--cprofile N` adds where torch_fa4's host
time goes (cProfile over N calls, top functions by own time).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import torch_fa4

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench import _time_ms  # noqa: E402

HQ, HKV, D = 32, 8, 128


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (_time_ms(lambda: dst.copy_(src)) * 1e-3)


def peers(q, k, v) -> dict:
    found = {"torch_fa4": lambda: torch_fa4.attention(q, k, v, causal=True)}
    try:
        from flash_attn.cute.interface import flash_attn_func

        found["flash-attn-4"] = lambda: flash_attn_func(q, k, v, causal=True)
    except ImportError:
        pass
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    found["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    found["flex"] = lambda: flex(qt, kt, vt, enable_gqa=True)
    return found


def paged_cache(k, v, page_size):
    """k, v (B, S, Hkv, D) as caches of pages in a random order, and the page table."""
    B, S = k.shape[:2]
    pages = B * S // page_size
    order = torch.randperm(pages, device=k.device)
    k_cache, v_cache = (t.new_empty(pages, page_size, *t.shape[2:]) for t in (k, v))
    k_cache[order] = k.reshape(pages, page_size, *k.shape[2:])
    v_cache[order] = v.reshape(pages, page_size, *v.shape[2:])
    return k_cache, v_cache, order.view(B, S // page_size).int()


def paged_peers(q, k, v, page_sizes) -> dict:
    B, S = k.shape[:2]
    seqused = torch.full((B,), S, dtype=torch.int32, device=q.device)
    found = {"contiguous": lambda: torch_fa4.attention(q, k, v, causal=True, seqused_k=seqused)}
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    for size in page_sizes:
        k_cache, v_cache, table = paged_cache(k, v, size)
        found[f"paged {size}"] = (lambda kc=k_cache, vc=v_cache, t=table: torch_fa4.attention(
            q, kc, vc, page_table=t, seqused_k=seqused, causal=True))
        if q.shape[1] == 1:  # continuous batching's layout: packed queries, one per sequence
            packed, cu = q.view(B, *q.shape[2:]), torch.arange(B + 1, dtype=torch.int32, device=q.device)
            found[f"paged {size} packed q"] = (lambda kc=k_cache, vc=v_cache, t=table: torch_fa4.attention(
                packed, kc, vc, page_table=t, seqused_k=seqused, cu_seqlens_q=cu, max_seqlen_q=1, causal=True))
        if flash_attn_varlen_func is not None:
            found[f"fa4 paged {size}"] = (lambda kc=k_cache, vc=v_cache, t=table: flash_attn_varlen_func(
                q, kc, vc, page_table=t, seqused_k=seqused, causal=True))
    return found


def paged_rows(rows: str, page_sizes: list, query_rows: int = 1) -> None:
    print(f"paged caches (pages of {', '.join(map(str, page_sizes))} keys, random order), {query_rows} query "
          "row(s) per sequence; us (K/V TB/s)")
    names = None
    for row in rows.split(","):
        B, S = (int(x) for x in row.split("x"))
        q = torch.randn(B, query_rows, HQ, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        found = paged_peers(q, k, v, page_sizes)
        times = {}
        for n, fn in found.items():
            try:
                times[n] = _time_ms(fn) * 1e3
            except Exception as e:  # a peer that refuses the call (its message printed once)
                print(f"  {n}: {type(e).__name__}: {str(e)[:120]}")
                times[n] = float("nan")
        if names is None:
            names = list(found)
            ratios = [f"{n} / contiguous" for n in names if n.startswith("paged")]
            heads = [f"{n:>20}" for n in names + ratios]
            print(f"{'B x cache':>12} " + " ".join(heads))
        kv_bytes = 2 * B * S * HKV * D * 2
        cells = " ".join(f"{times[n]:9.1f} ({kv_bytes / times[n] / 1e6:5.2f} TB/s)" for n in names)
        ratio = " ".join(f"{times[n] / times['contiguous']:20.3f}" for n in names if n.startswith("paged"))
        print(f"{row:>12} {cells} {ratio}")


def host_rows(rows: str, page_sizes: list, cprofile: int) -> None:
    import host_time
    import profile_kernels

    print("host time per call (calls back to back) against device time and the call's kernels; ms")
    for row in rows.split(","):
        B, S = (int(x) for x in row.split("x"))
        q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        found = {**peers(q, k, v), **paged_peers(q, k, v, page_sizes)}
        found.pop("flex", None)  # (compiled: its host path is torch.compile's guards, not a peer's)
        host = {n: min(host_time.host_ms(fn) for _ in range(3)) for n, fn in found.items()}
        device = {n: _time_ms(fn) for n, fn in found.items()}  # (before the profiler: it slows launches)
        print(f"== {row}")
        for n, fn in found.items():
            kernels = sum(profile_kernels._profile(fn, 10).values()) / 1e3
            print(f"  {n:22s} device {device[n]:.4f}  host {host[n]:.4f}  kernels {kernels:.4f}")
            if cprofile and not n.startswith(("sdpa", "fa4", "flash")):
                print(host_time.cprofile_top(fn, cprofile, top=25))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="8x4096,8x32768,64x8192")
    parser.add_argument("--pages", default="16,256", help="page sizes of the paged rows ('' for none)")
    parser.add_argument("--paged-only", action="store_true", help="only the paged rows")
    parser.add_argument("--query-rows", type=int, default=1,
                        help="query rows per sequence of the paged rows (chunked prefill: e.g. 512)")
    parser.add_argument("--host", action="store_true", help="host time per call against device time")
    parser.add_argument("--cprofile", type=int, default=0, help="with --host: cProfile this many calls")
    args = parser.parse_args()
    page_sizes = [int(p) for p in args.pages.split(",") if p]
    if args.host:
        host_rows(args.rows, page_sizes, args.cprofile)
        return
    if args.paged_only:
        paged_rows(args.rows, page_sizes, args.query_rows)
        return
    ceiling = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {ceiling / 1e12:.2f} TB/s (read + write)")
    print(f"bf16, Hq {HQ}, Hkv {HKV}, D {D}, one query row, causal; us (K/V TB/s)")
    names = None
    for row in args.rows.split(","):
        B, S = (int(x) for x in row.split("x"))
        q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        found = peers(q, k, v)
        if names is None:
            names = list(found)
            print(f"{'B x cache':>12} " + " ".join(f"{n:>18}" for n in names) + f" {'vs fastest peer':>16}")
        kv_bytes = 2 * B * S * HKV * D * 2
        times = {n: _time_ms(fn) * 1e3 for n, fn in found.items()}
        cells = " ".join(f"{times[n]:8.1f} ({kv_bytes / times[n] / 1e6:5.2f} TB/s)" for n in names)
        fastest_peer = min(t for n, t in times.items() if n != "torch_fa4")
        print(f"{row:>12} {cells} {fastest_peer / times['torch_fa4']:16.3f}")
    if page_sizes:
        paged_rows(args.rows, page_sizes, args.query_rows)


if __name__ == "__main__":
    main()
