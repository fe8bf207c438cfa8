"""What the first-use self-check adds to a first call (torch_fa4/self_check.py).

    python benchmarks/self_check_cost.py

For each row (B, S, H, Hkv, D, causal, bf16; forward and backward through torch_fa4.attention),
the kernels are compiled first (with the check off), then one call is timed with the check forced
and no stored verdict, and one without the check; the difference is the check's cost: its small
problem through the kernel and through the reference, and the search for that problem. A verdict
stored on disk makes later processes pay only for reading it.
"""

from __future__ import annotations

import os
import time

import torch

import torch_fa4
from torch_fa4 import self_check

ROWS = [(2, 1024, 16, 16, 64, True), (2, 4096, 16, 4, 128, True), (1, 8192, 16, 16, 128, False),
        (4, 2048, 8, 8, 256, True)]


def _step(q, k, v, causal):
    out = torch_fa4.attention(q, k, v, causal=causal)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()


def _timed(q, k, v, causal) -> float:
    start = time.perf_counter()
    _step(q, k, v, causal)
    return time.perf_counter() - start


def main() -> None:
    print(f"{torch.cuda.get_device_name()}: first call (forward + backward) with and without the self-check")
    print(f"{'B':>3} {'S':>6} {'H':>3} {'Hkv':>3} {'D':>4} {'causal':>6} | {'plain ms':>9} {'checked ms':>10} {'check ms':>9}")
    for B, S, H, Hkv, D, causal in ROWS:
        q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        os.environ[self_check.ENV] = "0"
        _step(q, k, v, causal)  # compiles the call's variants
        plain = min(_timed(q, k, v, causal) for _ in range(3))
        os.environ[self_check.ENV] = "1"
        checked = []
        for _ in range(3):
            self_check._verdicts.clear()
            checked.append(_timed(q, k, v, causal))
        checked = min(checked)  # (small problems' own variants compiled in the first round)
        print(f"{B:>3} {S:>6} {H:>3} {Hkv:>3} {D:>4} {str(causal):>6} | {plain * 1e3:9.2f} {checked * 1e3:10.2f} "
              f"{(checked - plain) * 1e3:9.2f}")
    os.environ.pop(self_check.ENV, None)


if __name__ == "__main__":
    main()
