"""Host time of a call with mods and a block mask, on a CPU machine: the GPU is faked.

The call is bench.py's document row (8 causal documents at S 4096, H 16, D 128, bf16) through
`torch_fa4.flex_attention` with a block mask, as a user writes it, at B 1 (the host path reads
the batch size only as a number; B 4's 64 MB CPU outputs would time the CPU allocator). Dispatch is told the tensors
sit on a compute capability 9.0 GPU and the sm90 forward's compiled kernel is a no-op, so what is
timed is everything the host does per call up to the launch: tracing key, built-in folding,
block-list re-listing, checks, the launch record. Tensors are CPU tensors (the re-listing's
torch ops run on the CPU: with a cache miss they cost more than on a GPU, so misses show).

    python benchmarks/mods_host_profile.py [--calls 200] [--cprofile 30] [--torch-mask]

--torch-mask: the block mask from torch's own create_block_mask instead of torch_fa4's. Prints
the CPU time of this thread per call (the fastest of --rounds rounds: the machine may be shared),
the Python function calls per call (cProfile's count, which does not depend on the machine), the
same for the call without mods or block mask (`flex_attention(q, k, v)`, the floor), and with
--cprofile N the top N functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from contextlib import contextmanager

import torch


@contextmanager
def faked_hopper():
    """Dispatch sees capability 9.0 with 132 SMs on CPU tensors; compiling a forward variant gives
    a kernel that does nothing. Restores everything on exit."""
    from torch_fa4 import dispatch
    from torch_fa4.kernels.host import fwd_launch
    from torch_fa4.kernels.sm90 import fwd_host

    saved = [(dispatch, "on_gpu"), (dispatch, "capability"), (fwd_launch, "_sm_count_of"),
             (fwd_host, "compile_fwd")]
    saved = [(module, name, getattr(module, name)) for module, name in saved]
    dispatch.on_gpu = lambda call: True
    dispatch.capability = lambda device: (9, 0)
    fwd_launch._sm_count_of = lambda call: 132
    fwd_host.compile_fwd = lambda cfg, *args, **kwargs: (lambda *launch_args: None)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def document_call(torch_mask: bool = False, B: int = 1, H: int = 16, S: int = 4096, D: int = 128, docs: int = 8):
    """A no-argument function running the document row once through torch_fa4.flex_attention."""
    import torch_fa4

    doc_ids = torch.arange(S, dtype=torch.int32) // (S // docs)

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[q_idx] == doc_ids[kv_idx])

    if torch_mask:
        from torch.nn.attention.flex_attention import create_block_mask

        bm = create_block_mask(document_causal, None, None, S, S, device="cpu")
    else:
        bm = torch_fa4.create_block_mask(document_causal, None, None, S, S, device="cpu")
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.bfloat16) for _ in range(3))
    return lambda: torch_fa4.flex_attention(q, k, v, block_mask=bm)


def plain_call(B: int = 1, H: int = 16, S: int = 4096, D: int = 128):
    """The same tensors' call without mods or block mask."""
    import torch_fa4

    q, k, v = (torch.randn(B, H, S, D, dtype=torch.bfloat16) for _ in range(3))
    return lambda: torch_fa4.flex_attention(q, k, v)


def us_per_call(fn, calls: int) -> float:
    """CPU time of this thread per call (other tenants' load does not count)."""
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t0) * 1e6 / calls


def python_calls_per_call(fn, calls: int) -> float:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    return sum(entry[1] for entry in pstats.Stats(prof).stats.values()) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cprofile", type=int, default=0, help="print the top N functions by own time")
    ap.add_argument("--sort", default="tottime", help="pstats order: tottime or cumulative")
    ap.add_argument("--torch-mask", action="store_true", help="torch's create_block_mask (no full blocks)")
    args = ap.parse_args()
    with faked_hopper():
        rows = {"document row, " + ("torch" if args.torch_mask else "torch_fa4") + " block mask":
                document_call(args.torch_mask), "no mods, no block mask": plain_call()}
        for label, fn in rows.items():
            for _ in range(3):
                fn()
            best = min(us_per_call(fn, args.calls) for _ in range(args.rounds))
            print(f"{label}: {best:.1f} us of host CPU time per call, "
                  f"{python_calls_per_call(fn, args.calls):.0f} Python function calls")
        fn = rows[next(iter(rows))]
        if args.cprofile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(args.sort).print_stats(args.cprofile)
            print(buf.getvalue())


if __name__ == "__main__":
    main()
