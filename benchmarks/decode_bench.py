"""Decode: one query row per sequence against a long KV cache, torch_fa4 beside its peers.

    python benchmarks/decode_bench.py [--rows 8x4096,8x32768,64x8192]

bf16, Hq 32, Hkv 8, D 128, causal (one row: every key is visible). Each row prints the median
time of each implementation, the K/V bytes it reads per second, and torch_fa4's ratio to the
fastest peer (> 1: faster). Peers: flash-attn-4 (`flash_attn.cute`, when installed), SDPA's
default choice, FlexAttention compiled. The card's copy bandwidth (read + write of 2 GiB) is the
ceiling printed first.
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="8x4096,8x32768,64x8192")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
