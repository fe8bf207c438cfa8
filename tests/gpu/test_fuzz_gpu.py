"""GPU: the randomized differential fuzz (tests/fuzz_space.py) through the public API, on the kernels.

Cases run from seed S upwards (--fuzz-seed S; default: the run's test seed) until DEFAULT_CASES
cases or BUDGET_S seconds, whichever comes first; --fuzz-cases N runs exactly N cases whatever
the time. The GPU space draws the choices that select a compiled kernel (dtype, head dims,
causal, window, softcap, varlen, mods' graphs, block sizes, deterministic) per family of seeds,
so most cases reuse a variant compiled earlier in the run. Every sm_90 forward and backward launch
first fills the outputs it was handed with NaN (an element a kernel leaves unwritten fails) and is
counted; `-s` prints the run's summary (cases, seeds, how many ran on the kernels, fallbacks).
Failures are collected and reported together at the end, each with its replay command.
"""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch

import fuzz_space as F
from gpu_harness import HAS_CUDA, gpu_marks

pytestmark = gpu_marks(HAS_CUDA, "needs a CUDA device")

DEFAULT_CASES = 3000
BUDGET_S = 300.0


@pytest.fixture
def kernel_launches(monkeypatch):
    """Counts of sm_90 forward / backward launches; each launch's outputs are poisoned first."""
    counts = {"forward": 0, "backward": 0}
    if torch.cuda.get_device_capability()[0] != 9:
        return counts
    from torch_fa4.kernels.sm90 import bwd, fwd_host

    real_forward, real_backward = fwd_host.forward, bwd.backward

    def forward(call, out, lse, **kw):
        out.fill_(math.nan)
        lse.fill_(math.nan)
        counts["forward"] += 1
        real_forward(call, out, lse, **kw)

    def backward(call, dout, out, lse, dq, dk, dv, *args, **kw):
        for t in (dq, dk, dv):
            t.fill_(math.nan)
        counts["backward"] += 1
        real_backward(call, dout, out, lse, dq, dk, dv, *args, **kw)

    monkeypatch.setattr(fwd_host, "forward", forward)
    monkeypatch.setattr(bwd, "backward", backward)
    return counts


def test_kernels_match_float64(request, kernel_launches):
    first, count, exact = F.first_seed_and_count(request.config, DEFAULT_CASES)
    budget = math.inf if exact else BUDGET_S
    start = time.monotonic()
    failures, ran, on_kernels, fallbacks = [], 0, {"forward": 0, "backward": 0}, set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(first, first + count):
            if time.monotonic() - start > budget:
                break
            before = dict(kernel_launches)
            report = F.run_seed(seed, F.GPU, "cuda")
            ran += 1
            for direction in on_kernels:
                on_kernels[direction] += kernel_launches[direction] > before[direction]
            fallbacks.update(str(w.message) for w in caught if "falls back" in str(w.message))
            caught.clear()
            if not report.ok:
                failures.append(report)
                if any("CUDA error" in e or "illegal" in e for e in report.errors):
                    break  # the CUDA context is gone: later cases would only repeat it
    summary = (f"{ran} GPU fuzz cases (seeds {first}..{first + ran - 1}) in {time.monotonic() - start:.0f} s on "
               f"{torch.cuda.get_device_name()}; on the kernels: forward {on_kernels['forward']}, backward "
               f"{on_kernels['backward']}; {len(failures)} failed")
    print(summary)
    for reason in sorted(fallbacks):
        print("  ", reason)
    assert not failures, summary + "\n" + F.failure_report(failures, ran, first, request.node.nodeid)
    if torch.cuda.get_device_capability()[0] == 9 and ran >= 50:
        # a fuzz of the kernels must reach them (a silent fallback everywhere would pass the above)
        assert min(on_kernels.values()) >= ran // 4, summary
