"""CPU: every advertised sm100 forward variant compiles for sm_100a, and its SASS is a Blackwell kernel.

There is no Blackwell GPU in this project, so this is the sm100 forward's verification: CuTe DSL
produces real sm_100a cubins on a CPU machine, and nvdisasm (nvidia-cuda-nvdisasm) shows what they
contain. Per variant: every matmul became a tcgen05 UMMA (`UTCHMMA`, exactly as many as the kernel
issues), scores and O move through tensor memory (`LDTM`/`STTM`), Q/K/V arrive by TMA (`UTMALDG`),
registers are rebalanced between warp roles (`USETMAXREG`), nothing spills to local memory.
One compile per variant (a few seconds each).
"""

from dataclasses import replace

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from sass import sass_of  # noqa: E402
from torch_fa4.call import AttentionCall  # noqa: E402


def _call(D, dtype=torch.bfloat16, **kw):
    q = torch.empty(1, 8, 2, D, dtype=dtype)  # shapes are symbolic in the kernel: any will do
    return AttentionCall(q=q, k=q, v=q, scale=D ** -0.5, **kw)


# the priority list of the brief: dense D=64/96/128 both dtypes, causal, window, softcap, varlen,
# seqused_k, and the softmax options (FA4 defaults: conditional rescale on, exp2 all hardware)
VARIANTS = {
    "d64": (dict(D=64), {}),
    "d96": (dict(D=96), {}),
    "d128": (dict(D=128), {}),
    "d128_fp16_causal": (dict(D=128, dtype=torch.float16, causal=True), {}),
    "d64_causal": (dict(D=64, causal=True), {}),
    "d128_window": (dict(D=128, window_left=64, window_right=0), {}),
    "d128_softcap_causal": (dict(D=128, softcap=10.0, causal=True), {}),
    "d64_varlen_causal": (dict(D=64, causal=True), dict(varlen_q=True, varlen_k=True)),
    "d128_seqused": (dict(D=128), dict(has_seqused_k=True)),
    "d64_emulated_exp2_always_rescale": (dict(D=64), dict(exp2_emulate_every=4, rescale_threshold=None)),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_compiles_to_umma(name, tmp_path):
    from torch_fa4.kernels.sm100 import fwd_host

    call_kw, cfg_kw = VARIANTS[name]
    call = _call(**call_kw)
    assert fwd_host.unsupported_reason(call) is None, "the test compiles only advertised variants"
    cfg = fwd_host.default_config(call)
    if cfg_kw:
        cfg = replace(cfg, **cfg_kw)
    fwd_host.compile_fwd(cfg, arch="sm_100a", dump_dir=str(tmp_path))  # bypasses the cache
    sass = sass_of(tmp_path, "*.sm_100a.cubin")
    # S = Q K^T: 4 issue sites x D/16 k-blocks; O += P V: 4 sites x tile_n/16 (see fwd.mma_role)
    expected_umma = 4 * (cfg.head_dim // 16) + 4 * (cfg.tile_n // 16)
    assert sass.count("UTCHMMA") == expected_umma, "matmuls did not all become tcgen05 UMMAs"
    assert "HGMMA" not in sass
    assert "LDTM" in sass and "STTM" in sass, "S/P/O do not move through tensor memory"
    assert "UTMALDG" in sass, "no TMA loads"
    assert "USETMAXREG" in sass, "no register reallocation between warp roles"
    # a few scalars computed before the warp-role split (and read by every role) may be spilled
    # once and reloaded per role (causal / varlen: 1-3 stores, ~15-20 loads); a spilled score row
    # or O chunk would show up as hundreds
    spills = sass.count("LDL") + sass.count("STL")
    assert spills <= 24, f"{spills} local-memory spill instructions"
    if cfg.exp2_emulate_every:
        assert sass.count("MUFU.EX2") < 2 * 128, "emulated exp2 did not move work off MUFU"


def test_unsupported_reason_accepts_only_compiled_variants():
    from torch_fa4.kernels.sm100 import fwd_host
    from torch_fa4.kernels.sm100.fwd_config import TMEM_COLUMNS

    for D in fwd_host.SUPPORTED_HEAD_DIMS:
        assert fwd_host.unsupported_reason(_call(D)) is None
        assert fwd_host.default_config(_call(D)).tmem_columns()["used"] <= TMEM_COLUMNS
    assert "head_dim 256" in fwd_host.unsupported_reason(_call(256))
    assert "head_dim 192" in fwd_host.unsupported_reason(_call(192))
    assert "dtype" in fwd_host.unsupported_reason(_call(128, dtype=torch.float32))
    q = torch.empty(1, 8, 2, 128, dtype=torch.bfloat16)
    assert "mod" in fwd_host.unsupported_reason(AttentionCall(q=q, k=q, v=q, scale=0.1, mod_key="x"))
    strided = torch.empty(1, 8, 2, 136, dtype=torch.bfloat16)[..., 1:129]
    assert "aligned" in fwd_host.unsupported_reason(AttentionCall(q=strided, k=q, v=q, scale=0.1))


def test_compile_cache_reuses_variants():
    from torch_fa4.kernels import compile_cache
    from torch_fa4.kernels.sm100 import fwd_host

    cfg = fwd_host.default_config(_call(64))
    first = fwd_host.compile_fwd(cfg)
    entries = compile_cache.stats()["entries"]
    # a different call of the same variant (other shapes, GQA) maps to the same key and kernel
    cfg2 = fwd_host.default_config(AttentionCall(
        q=torch.empty(3, 100, 8, 64, dtype=torch.bfloat16), k=torch.empty(3, 7, 2, 64, dtype=torch.bfloat16),
        v=torch.empty(3, 7, 2, 64, dtype=torch.bfloat16), scale=0.3))
    assert cfg2 == cfg
    assert fwd_host.compile_fwd(cfg2) is first
    assert compile_cache.stats()["entries"] == entries
