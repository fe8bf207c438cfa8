"""Hopper (sm_90a) kernels: entry points per docs/INTERNALS.md (forward: fwd_host.py; backward:
bwd.py, which dispatch imports itself). Neither this package nor the host modules import CuTe DSL:
the kernel modules load it when a variant compiles, and a kernel from the disk cache launches
without it.
"""

from torch_fa4.kernels.host import packed_gqa
from torch_fa4.kernels.sm90 import fwd_host  # (on every forward call's path: bound once)
from torch_fa4.kernels.sm90.fwd_host import unsupported_reason  # noqa: F401


def forward(call, out, lse) -> None:
    if packed_gqa.single_rows(call):  # decode steps of packed queries over a paged cache
        dense, dense_out, dense_lse = packed_gqa.as_dense(call, out, lse)
        forward(dense, dense_out, dense_lse)
        lse.copy_(dense_lse.view(call.batch, call.num_heads).t())
        return
    if packed_gqa.applies(call):  # decode: each K/V tile read once per KV head
        out, lse = packed_gqa.pack_results(out, lse, call.num_heads_kv)
        call = packed_gqa.pack(call)
    fwd_host.forward(call, out, lse)


def variant(call, direction: str, deterministic: bool):
    """The compiled variant that runs `call` (what the first-use self-check verifies)."""
    if direction == "forward":
        if packed_gqa.single_rows(call):
            call = packed_gqa.as_dense(call, call.q, call.q)[0]
        return fwd_host.default_config(packed_gqa.pack(call) if packed_gqa.applies(call) else call)
    from torch_fa4.kernels.sm90 import bwd

    key = bwd.variant_key(call, deterministic)
    if bwd.runs_per_sequence(call, deterministic):
        return ("per_sequence", key)
    return bwd.launch_plan(call, key).key
