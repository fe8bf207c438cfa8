"""First-call compile time of kernel variants in a fresh process (the issue's <= 3 s target).

Times the CuTe DSL import once, then `compile_fwd` / the backward's `compile_variant` for a few
default variants, each compiled for the first time in this process (the in-process cache is
empty; the opt-in disk cache is not used). Needs no GPU (CUTE_DSL_ARCH=sm_90a on a CPU machine).

    python benchmarks/compile_time.py
"""

import os
import time

import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def main():
    t0 = time.perf_counter()
    import cutlass.cute  # noqa: F401

    print(f"import cutlass.cute: {time.perf_counter() - t0:.2f} s")
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90 import bwd, fwd_host

    def call(D, S, **kw):
        q = torch.empty(1, S, 2, D, dtype=torch.bfloat16)
        return AttentionCall(q=q, k=q, v=q, scale=D ** -0.5, **kw)

    cases = [("fwd D128 causal", call(128, 4096, causal=True)), ("fwd D64 S4k (192x128)", call(64, 4096)),
             ("fwd D256 S4k causal", call(256, 4096, causal=True)), ("fwd D128 softcap window", call(128, 4096, softcap=30.0, window_left=256))]
    for name, c in cases:
        t = time.perf_counter()
        fwd_host.compile_fwd(fwd_host.default_config(c))
        print(f"{name}: {time.perf_counter() - t:.2f} s")
    for name, c in [("bwd D128 causal", call(128, 4096, causal=True)), ("bwd D64", call(64, 4096))]:
        t = time.perf_counter()
        bwd.compile_variant(bwd.variant_key(c, False))
        print(f"{name}: {time.perf_counter() - t:.2f} s")


if __name__ == "__main__":
    main()
