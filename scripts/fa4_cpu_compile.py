"""Compile flash-attn-4's sm90 forward for one grid row on this CPU machine, for SASS comparisons
with ours (scripts/loop_stalls.py, tests/sass.py). flash-attn-4 is used as a peer only: its wheel
comes from the GPU kit and nothing of it enters torch_fa4.

    python scripts/fa4_cpu_compile.py OUTDIR [D S CAUSAL [BWD]]     (default 64 16384 0 0)

BWD = 1 also runs its backward, which compiles the backward's kernels beside the forward's.

The call runs under FakeTensorMode with flash-attn-4's architecture override, so no GPU is
touched: its interface compiles the kernel for sm_90a (CUTE_DSL_ARCH) and CuTe DSL keeps the cubin
in OUTDIR. Its `quack` dependency imports triton for an autotuner the forward does not use; a
stub module stands in for it (installed after torch has imported, so torch still sees no triton).
"""

import os
import subprocess
import sys
import types

KIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "gpu-kit")
SITE = "/tmp/fa4_cpu_site"


def _unpack():
    if os.path.isdir(os.path.join(SITE, "flash_attn")):
        return
    os.makedirs(SITE, exist_ok=True)
    for name in sorted(os.listdir(KIT)):
        if name.startswith(("flash_attn_4-", "quack_kernels-")) and name.endswith(".whl"):
            subprocess.run([sys.executable, "-m", "zipfile", "-e", os.path.join(KIT, name), SITE], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", SITE, "einops"], check=True)


def _stub_triton():
    triton = types.ModuleType("triton")
    triton.testing = types.ModuleType("triton.testing")
    triton.runtime = types.ModuleType("triton.runtime")
    triton.runtime.cache = types.ModuleType("triton.runtime.cache")
    triton.runtime.cache.FileCacheManager = type("FileCacheManager", (), {"__init__": lambda self, *a, **k: None})
    triton.runtime.cache.default_cache_dir = lambda: os.path.join(SITE, "triton_cache")
    for mod in (triton, triton.testing, triton.runtime, triton.runtime.cache):
        sys.modules[mod.__name__] = mod


def main():
    out = os.path.abspath(sys.argv[1])
    D, S, causal = (int(x) for x in (sys.argv[2:5] if len(sys.argv) >= 5 else (64, 16384, 0)))
    backward = len(sys.argv) >= 6 and sys.argv[5] == "1"
    os.makedirs(out, exist_ok=True)
    os.environ.update(FLASH_ATTENTION_ARCH="sm_90", FLASH_ATTENTION_NUM_SMS="132", CUTE_DSL_ARCH="sm_90a",
                      CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=out)
    _unpack()
    import torch
    import torch._dynamo  # noqa: F401  (before the stub: torch probes for a real triton)
    import torch._inductor  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode

    _stub_triton()
    sys.path.insert(0, SITE)
    from flash_attn.cute import interface

    with FakeTensorMode():
        q = torch.empty(16384 // S, S, 2048 // D, D, dtype=torch.bfloat16, device="cuda")
        interface.flash_attn_func(q, q, q, causal=bool(causal))
        if backward:
            # its autograd Function's backward call, made directly: autograd itself cannot run on
            # fake CUDA tensors in a CPU build of torch
            lse = torch.empty(q.shape[0], q.shape[2], S, dtype=torch.float32, device="cuda")
            interface._flash_attn_bwd(q, q, q, q, q, lse, D ** -0.5, bool(causal))
    print("\n".join(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".cubin")))


if __name__ == "__main__":
    main()
