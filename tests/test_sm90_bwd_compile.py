"""CPU: every sm90 backward variant compiles for sm_90a, and its SASS is the intended machine code.

CuTe DSL writes real cubins without a GPU; nvdisasm (nvidia-cuda-nvdisasm) shows that the five
matmuls became warpgroup MMAs (HGMMA), that dQ leaves through TMA reductions, that registers are
handed from the producer to the consumers (setmaxnreg) and that nothing large spilled.
One compile per variant, a few seconds each.
"""

import glob
import os
import shutil
import subprocess

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from torch_fa4.call import AttentionCall  # noqa: E402


def _nvdisasm():
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia

        for root in nvidia.__path__:
            hits = glob.glob(os.path.join(root, "*", "bin", "nvdisasm"))
            if hits:
                return hits[0]
    except ImportError:
        pass
    return None


def _call(d=128, dv=None, hq=2, hkv=2, dtype=torch.bfloat16, varlen=False, seqused=False, **kw):
    # Shapes are symbolic in the compiled kernel: any small tensors describe the variant.
    dv = dv or d
    lead = (16,) if varlen else (1, 16)
    q = torch.empty(*lead, hq, d, dtype=dtype)
    k = torch.empty(*lead, hkv, d, dtype=dtype)
    v = torch.empty(*lead, hkv, dv, dtype=dtype)
    cu = torch.tensor([0, 16], dtype=torch.int32) if varlen else None
    used = torch.tensor([16], dtype=torch.int32) if seqused else None
    return AttentionCall(q=q, k=k, v=v, scale=d**-0.5, cu_seqlens_q=cu, cu_seqlens_k=cu,
                         seqused_k=used, max_seqlen_q=16, max_seqlen_k=16, **kw)


VARIANTS = {
    "d64": (dict(d=64), False),
    "d128": (dict(d=128), False),
    "d96_causal": (dict(d=96, causal=True), False),
    "d128_fp16_causal": (dict(d=128, dtype=torch.float16, causal=True), False),
    "d128_dv64": (dict(d=128, dv=64), False),
    "d64_gqa_window": (dict(d=64, hq=4, hkv=1, window_left=64, window_right=16), False),
    "d128_softcap_causal": (dict(d=128, softcap=10.0, causal=True), False),
    "d128_varlen_causal_gqa": (dict(d=128, hq=4, hkv=2, varlen=True, causal=True), False),
    "d64_seqused": (dict(d=64, seqused=True), False),
    "d128_causal_deterministic": (dict(d=128, causal=True), True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_backward_variant_compiles_to_hgmma(name, tmp_path):
    from torch_fa4.kernels.sm90 import bwd

    call_kw, deterministic = VARIANTS[name]
    call = _call(**call_kw)
    assert bwd.unsupported_reason(call) is None
    bwd.compile_variant(bwd.variant_key(call, deterministic), dump_dir=str(tmp_path))
    cubins = glob.glob(str(tmp_path / "*.cubin"))
    assert cubins, "no cubin written"
    exe = _nvdisasm()
    if exe is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    sass = subprocess.run([exe, "-c", cubins[0]], capture_output=True, text=True, check=True).stdout
    hgmma = sass.count("HGMMA.")
    # S, dP and dQ: (K extent / 16) each; dK, dV: tile_m / 16 = 4 each.
    d, dv = call.head_dim, call.head_dim_v
    assert hgmma == d // 16 + dv // 16 + 128 // 16 + 4 + 4, f"{hgmma} HGMMA instructions"
    assert "UTMAREDG" in sass, "dQ is not reduced through TMA"
    assert "ADD.F32" not in sass.replace("UTMAREDG", ""), "per-element dQ atomics are back"
    assert "USETMAXREG" in sass or "SETMAXNREG" in sass.upper(), "no register reallocation"
    spills = sass.count("LDL") + sass.count("STL")
    # a few loop scalars spill (d128: ~20 instructions, varlen ~45); an accumulator spilling shows
    # up as hundreds
    assert spills <= 64, f"{spills} local-memory spill instructions"


def test_unsupported_calls_are_rejected():
    from torch_fa4.kernels.sm90 import bwd

    assert "head dims" in bwd.unsupported_reason(_call(d=256))
    assert "fp16/bf16" in bwd.unsupported_reason(_call(d=64, dtype=torch.float32))
    odd = _call(d=64)
    odd.q = torch.empty(1, 16, 2, 68, dtype=torch.bfloat16)[..., :64]  # strides not 16-byte multiples
    assert bwd.unsupported_reason(odd) is not None


def test_variants_differ_only_where_code_differs():
    from torch_fa4.kernels.sm90 import bwd

    a = bwd.variant_key(_call(d=128, causal=True), False)
    b = bwd.variant_key(_call(d=128, causal=True, softcap=0.0), False)
    assert a == b
    # window sizes and softcap values are runtime arguments: no new variant per value
    w1 = bwd.variant_key(_call(d=128, window_left=10, window_right=3), False)
    w2 = bwd.variant_key(_call(d=128, window_left=99, window_right=0), False)
    assert w1 == w2
    assert bwd.variant_key(_call(d=128), True) != bwd.variant_key(_call(d=128), False)
