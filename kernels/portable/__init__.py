"""Portable kernels for every NVIDIA GPU since Ampere: warp-level MMA (mma.sync m16n8k16),
ldmatrix and cp.async (forward: fwd.py, fwd_host.py; the backward, when present, in `bwd`, which
dispatch imports itself). They run on sm_80, sm_86, sm_89, sm_120 and are the fallback on
sm_100; on sm_90, where their GPU tests run, `TORCH_FA4_BACKEND=portable` selects them. Neither
this package nor the host modules import CuTe DSL.
"""

from torch_fa4.kernels.host import packed_gqa
from torch_fa4.kernels.portable import fwd_host
from torch_fa4.kernels.portable.fwd_host import unsupported_reason  # noqa: F401


def forward(call, out, lse) -> None:
    if packed_gqa.applies(call):  # decode: a KV head's query heads as rows of one query tile
        out, lse = packed_gqa.pack_results(out, lse, call.num_heads_kv)
        call = packed_gqa.pack(call)
    fwd_host.forward(call, out, lse)


def variant(call, direction: str, deterministic: bool):
    """The compiled variant that runs `call` (what the first-use self-check verifies)."""
    if direction == "forward":
        return fwd_host.default_config(packed_gqa.pack(call) if packed_gqa.applies(call) else call)
    import inspect

    from torch_fa4.kernels.portable import bwd

    named = getattr(bwd, "variant", None)
    if named is None:  # the call's features name the variant (self_check.variant_of's default)
        from torch_fa4.self_check import _features

        return _features(call, direction, deterministic)
    if len(inspect.signature(named).parameters) == 3:  # (call, direction, deterministic)
        return named(call, direction, deterministic)
    return named(call, deterministic)
