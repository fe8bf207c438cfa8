"""CPU: every advertised sm100 forward variant compiles for sm_100a, and its SASS is a Blackwell kernel.

There is no Blackwell GPU in this project, so this is the sm100 forward's verification: CuTe DSL
produces real sm_100a cubins on a CPU machine, and nvdisasm (nvidia-cuda-nvdisasm) shows what they
contain. Per variant: every matmul became a tcgen05 UMMA (`UTCHMMA`, exactly as many as the kernel
issues), scores and O move through tensor memory (`LDTM`/`STTM`), Q/K/V arrive by TMA (`UTMALDG`),
registers are rebalanced between warp roles (`USETMAXREG`), nothing spills to local memory, and
the tiles fit tensor memory (512 columns) and shared memory (227 KB: the kernel asserts its whole
shared storage while compiling). Mod variants (score_mod / mask_mod with captured tensors, block
masks) compile from mods traced on CPU tensors, as in tests/test_sm90_fwd_compile.py.
One compile per variant (ten to thirty seconds each).
"""

from dataclasses import replace

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from _fwd_host_checks import check_variant_reuse, mod_variant_config  # noqa: E402
from sass import sass_of  # noqa: E402
from test_sm90_fwd_compile import _alibi, _doc_mask, _mod_call  # noqa: E402
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
    "d128_seqused": (dict(D=128), dict(has_seqused_k=True, packed_f32x2=False)),  # (as for such a call)
    "d64_emulated_exp2_always_rescale": (dict(D=64), dict(exp2_emulate_every=4, rescale_threshold=None)),
    "d96_scalar_softmax": (dict(D=96), dict(packed_f32x2=False, exp2_emulate_every=3)),
    # D=192: two query tiles of 64-key tiles; D=256: one query tile (fwd_host._TILES)
    "d192_causal": (dict(D=192, causal=True), {}),
    "d256_causal_varlen": (dict(D=256, causal=True), dict(varlen_q=True, varlen_k=True)),
}

# name -> builder of an AttentionCall with mods (built lazily: tracing needs the mods package)
MOD_VARIANTS = {
    "d128_alibi_softcap_causal": lambda: _mod_call(128, score_mod=_alibi(), softcap=20.0, causal=True),
    # a mask_mod gathering doc ids per key: one query tile per CTA (fwd_host._gathers_per_key)
    "d128_document_mask": lambda: _mod_call(128, mask_mod=_doc_mask()),
    # FlexAttention's 128 x 128 blocks: one query tile per CTA
    "d64_document_block_mask": lambda: _mod_call(64, mask_mod=_doc_mask(), block_size=128),
    # 256-row blocks and a mask_mod without captured tensors keep the two-tile ping-pong
    "d128_causal_mod_block_256": lambda: _mod_call(128, mask_mod=_causal_mod(), block_size=(256, 128)),
}


def _causal_mod():
    from torch_fa4 import mods as M

    return M.causal_mask


def _compile_and_check_sass(cfg, tmp_path) -> str:
    from torch_fa4.kernels.sm100 import fwd_host
    from torch_fa4.kernels.sm100.fwd_config import SMEM_LIMIT, TMEM_COLUMNS

    assert cfg.tmem_columns()["used"] <= TMEM_COLUMNS and cfg.smem_bytes() <= SMEM_LIMIT
    fwd_host.compile_fwd(cfg, arch="sm_100a", dump_dir=str(tmp_path))  # bypasses the cache
    sass = sass_of(tmp_path, "*.sm_100a.cubin")
    # S = Q K^T and O += P V: two call sites each per query tile (the walk's first key tile and
    # the loop; fwd.mma_role), D/16 and tile_n/16 k-blocks each
    expected_umma = 2 * cfg.q_tiles * (cfg.head_dim // 16 + cfg.tile_n // 16)
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
    return sass


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_compiles_to_umma(name, tmp_path):
    from torch_fa4.kernels.sm100 import fwd_host

    call_kw, cfg_kw = VARIANTS[name]
    call = _call(**call_kw)
    assert fwd_host.unsupported_reason(call) is None, "the test compiles only advertised variants"
    cfg = fwd_host.default_config(call)
    if cfg_kw:
        cfg = replace(cfg, **cfg_kw)
    sass = _compile_and_check_sass(cfg, tmp_path)
    if cfg.exp2_emulate_every:
        assert sass.count("MUFU.EX2") < 2 * 128, "emulated exp2 did not move work off MUFU"
    # the softmax's scale and row sum and the O rescale on packed fp32 pairs, or not at all
    packed = all(op in sass for op in ("FFMA2", "FADD2", "FMUL2"))
    assert packed == cfg.packed_f32x2


@pytest.mark.parametrize("name", list(MOD_VARIANTS))
def test_mod_variant_compiles_to_umma(name, tmp_path):
    from torch_fa4.kernels.sm100 import fwd_host

    cfg = mod_variant_config(fwd_host, MOD_VARIANTS[name]())
    sass = _compile_and_check_sass(cfg, tmp_path)
    if cfg.aux_specs or cfg.block_sparse:
        # captured tensors (slopes, document ids) and block-mask indices are read with global loads
        assert "LDG" in sass, "no global loads: captured tensors not read"


def test_mod_and_block_mask_variants_choose_their_tiles():
    """Which CTA shape each mod / block-mask call gets (fwd_host): the CTA's query rows must lie in
    one block-mask row, and a gathering mask_mod takes one query tile."""
    from torch_fa4.kernels.sm100 import fwd_host

    plain = fwd_host.default_config(_mod_call(128, score_mod=_alibi()))
    assert (plain.q_tiles, plain.block_sparse) == (2, False)
    assert fwd_host.default_config(_mod_call(128, mask_mod=_doc_mask())).q_tiles == 1
    b128 = fwd_host.default_config(_mod_call(64, mask_mod=_causal_mod(), block_size=128))
    assert (b128.q_tiles, b128.bm_tiles_m, b128.bm_tiles_n, b128.tile_n) == (1, 1, 1, 128)
    b256 = fwd_host.default_config(_mod_call(64, mask_mod=_causal_mod(), block_size=(256, 128)))
    assert (b256.q_tiles, b256.bm_tiles_m) == (2, 1)
    b512 = fwd_host.default_config(_mod_call(64, mask_mod=_causal_mod(), block_size=(512, 64), S=512))
    assert (b512.q_tiles, b512.bm_tiles_m, b512.tile_n, b512.bm_tiles_n) == (2, 2, 64, 1)
    d192 = fwd_host.default_config(_mod_call(192, mask_mod=_causal_mod(), block_size=(128, 256)))
    assert (d192.q_tiles, d192.tile_n, d192.bm_tiles_n) == (1, 64, 4)
    # blocks that do not cover whole kernel tiles are refused, naming the block size
    odd = _mod_call(64, mask_mod=_causal_mod(), block_size=(64, 128))
    assert "BLOCK_SIZE" in fwd_host.unsupported_reason(odd)
    odd_kv = _mod_call(64, mask_mod=_causal_mod(), block_size=(128, 32))
    assert "BLOCK_SIZE" in fwd_host.unsupported_reason(odd_kv)


def test_unsupported_reason_accepts_only_compiled_variants():
    from torch_fa4.kernels.sm100 import fwd_host
    from torch_fa4.kernels.sm100.fwd_config import TMEM_COLUMNS

    from torch_fa4.kernels.sm100.fwd_config import SMEM_LIMIT

    assert fwd_host.SUPPORTED_HEAD_DIMS == (64, 96, 128, 192, 256)
    for D in fwd_host.SUPPORTED_HEAD_DIMS:
        assert fwd_host.unsupported_reason(_call(D)) is None
        cfg = fwd_host.default_config(_call(D))
        assert cfg.tmem_columns()["used"] <= TMEM_COLUMNS and cfg.smem_bytes() <= SMEM_LIMIT
    assert "head_dim 160" in fwd_host.unsupported_reason(_call(160))
    assert "dtype" in fwd_host.unsupported_reason(_call(128, dtype=torch.float32))
    q = torch.empty(1, 8, 2, 128, dtype=torch.bfloat16)
    assert "ModSet" in fwd_host.unsupported_reason(AttentionCall(q=q, k=q, v=q, scale=0.1, mod_key="x"))
    v = torch.empty(1, 8, 2, 64, dtype=torch.bfloat16)
    assert "head_dim_v" in fwd_host.unsupported_reason(AttentionCall(q=q, k=q, v=v, scale=0.1))
    strided = torch.empty(1, 8, 2, 136, dtype=torch.bfloat16)[..., 1:129]
    assert "aligned" in fwd_host.unsupported_reason(AttentionCall(q=strided, k=q, v=q, scale=0.1))


def test_compile_cache_reuses_variants():
    from torch_fa4.kernels.sm100 import fwd_host

    check_variant_reuse(fwd_host, _call(64), 64)


def test_a_variant_past_shared_memory_does_not_compile(tmp_path):
    """The shared-memory check cannot pass vacuously: one K/V stage more than D=192's five needs
    250 KB, and the kernel refuses while tracing (before any cubin exists)."""
    from torch_fa4.kernels.sm100 import fwd_host
    from torch_fa4.kernels.sm100.fwd_config import SMEM_LIMIT

    cfg = replace(fwd_host.default_config(_call(192)), kv_stages=6)
    assert cfg.smem_bytes() > SMEM_LIMIT
    with pytest.raises(Exception, match="bytes of shared memory"):
        fwd_host.compile_fwd(cfg, arch="sm_100a", dump_dir=str(tmp_path))
