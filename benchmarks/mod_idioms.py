"""Mods written as users write them, against the built-in arguments they mean, in one run.

    python benchmarks/mod_idioms.py [--flash]

B 4, H 16, S 4096, D 128, bf16, forward. Each row times torch_fa4's built-in argument, the same
thing as a mod through `torch_fa4.flex_attention` with a 128 x 128 block mask (as a FlexAttention
user passes it), and FlexAttention compiled (Triton) with the same mods; with --flash also
FlexAttention's FLASH backend (flash-attn-4's kernels). TFLOP/s count the visible part; the last
column is the mod's rate over the built-in's.
"""

from __future__ import annotations

import argparse
import sys

import torch

import torch_fa4

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench import _time_ms  # noqa: E402

B, H, S, D = 4, 16, 4096, 128
WINDOW = 1024


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


ROWS = [  # name, built-in kwargs of torch_fa4.attention, (score_mod, mask_mod), visible fraction
    ("causal", dict(causal=True), (None, causal), 0.5),
    ("sliding window 1024, causal", dict(causal=True, window_size=(WINDOW, 0)), (None, sliding),
     (WINDOW + 0.5) / S),
    ("softcap 30, causal", dict(causal=True, softcap=30.0), (softcap, causal), 0.5),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flash", action="store_true", help="also FlexAttention's FLASH backend")
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    print(f"{torch.cuda.get_device_name()}, B {B} H {H} S {S} D {D} bf16, forward TFLOP/s")
    head = f"{'row':30} {'built-in':>9} {'as mods':>9} {'flex':>9}" + (f" {'flex FLASH':>10}" if args.flash else "")
    print(head + f" {'mods/built-in':>14}")
    for name, builtin, (score_mod, mask_mod), visible in ROWS:
        flops = 4 * B * H * S * S * D * visible
        rate = lambda fn: flops / _time_ms(fn) / 1e9  # noqa: E731
        ours_bm = torch_fa4.create_block_mask(mask_mod, None, None, S, S, device="cuda")
        torch_bm = create_block_mask(mask_mod, None, None, S, S)
        times = [
            rate(lambda: torch_fa4.attention(q, k, v, **builtin)),
            rate(lambda: torch_fa4.flex_attention(qt, kt, vt, score_mod=score_mod, block_mask=ours_bm)),
            rate(lambda: flex(qt, kt, vt, score_mod=score_mod, block_mask=torch_bm)),
        ]
        if args.flash:
            try:
                times.append(rate(lambda: flex(qt, kt, vt, score_mod=score_mod, block_mask=torch_bm,
                                               kernel_options={"BACKEND": "FLASH"})))
            except Exception as e:  # noqa: BLE001  (a peer that cannot run this row)
                print(f"  (flex FLASH: {type(e).__name__}: {str(e)[:80]})")
                times.append(float("nan"))
        cells = " ".join(f"{t:9.1f}" if i < 3 else f"{t:10.1f}" for i, t in enumerate(times))
        print(f"{name:30} {cells} {times[1] / times[0]:14.3f}")


if __name__ == "__main__":
    main()
