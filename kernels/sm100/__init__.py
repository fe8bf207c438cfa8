"""Blackwell (sm_100a) kernels: entry points per docs/INTERNALS.md.

The forward lives in fwd.py (kernel), fwd_softmax.py (row-per-thread softmax on top of
kernels/common), fwd_config.py (variant key, tensor-memory budget) and fwd_host.py (variant choice,
compile cache, launch). Compile-verified only: see benchmarks/NOTES.md, section "sm_100".
There is no sm100 backward yet (dispatch finds no `bwd` module and runs the reference).
Importing this package does not load CuTe DSL; fwd_host does, on the first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

    from torch_fa4.call import AttentionCall


def unsupported_reason(call: "AttentionCall") -> Optional[str]:
    from torch_fa4.kernels.sm100 import fwd_host

    return fwd_host.unsupported_reason(call)


def forward(call: "AttentionCall", out: "torch.Tensor", lse: "torch.Tensor") -> None:
    from torch_fa4.kernels.sm100 import fwd_host

    fwd_host.forward(call, out, lse)
