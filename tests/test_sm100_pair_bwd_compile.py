"""CPU: the sm100 CTA-pair backward's variants compile for sm_100a, and their SASS is a cta_group::2
Blackwell kernel.

There is no Blackwell GPU in this project, so this is the pair backward's verification (as
tests/test_sm100_bwd_compile.py is the 1-CTA backward's). Per variant: every matmul of a step is a
pair UMMA (`UTCHMMA.2CTA`, exactly as many as the leader issues: S^T and dP^T over the head dim, dV
and dK over 128 queries, dQ over the pair's 256 keys) and no 1-CTA one, every TMA load is the
pair form (`UTMALDG.*.2CTA`: seven tiles, the 128-element-wide ones in two boxes), the leader's
commits reach both CTAs (`UTCBAR.2CTA.MULTICAST`), S^T, dP^T, dQ, dK and dV move through tensor
memory (`LDTM`; P^T and dS^T back with two `STTM`), dS reaches the owning CTA's shared memory in
16-byte stores through the cluster window (4 per 32-query chunk), dQ of a thread's half row
leaves in fp32 REDs of four columns, nothing spills to local memory, and the tiles fit tensor
memory (512 columns) and shared memory (227 KB: the kernel asserts its storage while compiling).
One compile per variant (seconds each).
"""

from dataclasses import replace

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from sass import sass_of  # noqa: E402
from test_sm100_bwd_compile import _call  # noqa: E402
from test_sm90_fwd_compile import _alibi, _doc_mask, _mod_call  # noqa: E402

VARIANTS = {
    "d128": dict(D=128),
    "d128_causal": dict(D=128, causal=True),
    "d128_fp16_softcap_causal": dict(D=128, dtype=torch.float16, softcap=15.0, causal=True),
    "d128_gqa_key_tail": dict(D=128, H=8, Hkv=2, S=300),
    "d128_window": dict(D=128, window_left=100, window_right=30),
    "d128_varlen_causal": dict(D=128, varlen=True, causal=True),
    "d128_seqused_gqa": dict(D=128, H=4, Hkv=1, seqused=True),
}

MOD_VARIANTS = {
    "d128_alibi_softcap_causal": lambda: _mod_call(128, score_mod=_alibi(), softcap=20.0, causal=True),
    "d128_document_mask": lambda: _mod_call(128, mask_mod=_doc_mask()),
}


def _expected_umma(cfg) -> int:
    """S^T (D/16 k-blocks), dP^T (Dv/16), dV and dK over 128 queries (8 each), dQ over the pair's
    256 keys (16): one call site each (pair/bwd_kernel.pair_mma_role)."""
    return cfg.head_dim // 16 + cfg.head_dim_v // 16 + 2 * 128 // 16 + 256 // 16


@pytest.mark.parametrize("name", list(VARIANTS))
def test_pair_variant_compiles_to_pair_umma(name, tmp_path):
    _compile_and_check_sass(_call(**VARIANTS[name]), tmp_path)


@pytest.mark.parametrize("name", list(MOD_VARIANTS))
def test_pair_mod_variant_compiles_to_pair_umma(name, tmp_path):
    call = MOD_VARIANTS[name]()
    cfg = _compile_and_check_sass(call, tmp_path)
    assert cfg.mods_key == call.mod_key


def _compile_and_check_sass(call, tmp_path):
    from torch_fa4.kernels.sm100.bwd_config import PAIR_TILE_N, Sm100BwdLayout, pair_smem_bytes
    from torch_fa4.kernels.sm100.pair import bwd
    from torch_fa4.kernels.sm100.tmem import TMEM_COLUMNS

    assert bwd.unsupported_reason(call) is None, "the test compiles only advertised variants"
    cfg = bwd.variant_key(call, False)
    assert cfg.tile_n == PAIR_TILE_N and cfg.sparse is None and not cfg.deterministic
    lay = Sm100BwdLayout.of(cfg, ctas=2)
    assert lay.tmem_columns <= TMEM_COLUMNS
    assert pair_smem_bytes(cfg.head_dim, cfg.head_dim_v, lay.stages) <= 227 * 1024
    bwd.compile_variant(cfg, arch="sm_100a", dump_dir=str(tmp_path))  # bypasses the cache
    sass = sass_of(tmp_path, "*.sm_100a.cubin")
    umma = sass.count("UTCHMMA")
    assert umma == sass.count("UTCHMMA.2CTA") == _expected_umma(cfg), "not every matmul is a pair UMMA"
    assert "HGMMA" not in sass
    tma = [line for line in sass.splitlines() if "UTMALDG" in line]
    # K, V, Q, dO (128 elements of D wide: two boxes each), K^T, Q^T, dO^T halves (one box each)
    assert len(tma) == 4 * 2 + 3 and all(".2CTA " in line for line in tma), tma
    # the leader's commits (S^T / dP^T ready, dQ ready, a ring slot free, the walk done) reach both CTAs
    assert sass.count("UTCBAR.2CTA.MULTICAST") == 4 and sass.count("UTCBAR") == 4
    # S^T and dP^T chunks, the half row of dQ, dK, dV out of TMEM; P^T and dS^T back in
    assert sass.count("LDTM") == 2 + cfg.head_dim // 2 // 32 + cfg.head_dim // 32 + cfg.head_dim_v // 32
    assert sass.count("STTM") == 2
    # dS to the CTA owning its queries: 16-byte stores through the cluster window, no local ones
    assert sass.count("ST.E.128") == 4 and "STS.128" not in sass
    spills = sass.count("LDL") + sass.count("STL")
    assert spills <= (16 if cfg.mods_key else 0), f"{spills} local-memory spill instructions"
    assert sass.count("REDG.E.ADD.F32x4") == cfg.head_dim // 2 // 4
    assert "ATOMG.E.ADD" not in sass
    exps = sass.count("MUFU.EX2")
    assert 32 <= exps <= 64, f"{exps} exp2: more than one per query and mask path"
    assert ("MUFU.TANH" in sass) == cfg.softcap
    assert sass.count("USETMAXREG") == (3 if cfg.mods_key else 0)
    return cfg


def test_pair_takes_d128_only_and_no_block_masks():
    """Other head dims, block masks: refused (the 1-CTA sm100 backward takes them)."""
    from torch_fa4.kernels.sm100.pair import bwd

    assert bwd.unsupported_reason(_call(D=128)) is None
    for kw in (dict(D=64), dict(D=96), dict(D=128, Dv=64), dict(D=192), dict(D=256)):
        reason = bwd.unsupported_reason(_call(**kw))
        assert reason is not None and ("head dims" in reason or "(D, Dv)" in reason), (kw, reason)
    blocked = _mod_call(128, mask_mod=_doc_mask(), block_size=128)
    assert "block mask" in bwd.unsupported_reason(blocked)


def test_deterministic_runs_the_single_cta_variant():
    """Deterministic dQ (which unsupported_reason cannot see) is the 1-CTA kernel's key: compiled
    and self-checked as that kernel."""
    from torch_fa4.kernels.sm100 import bwd as single
    from torch_fa4.kernels.sm100.pair import bwd

    call = _call(D=128, causal=True)
    assert bwd.variant_key(call, True) == single.variant_key(call, True)
    pair_key = bwd.variant_key(call, False)
    assert bwd.is_pair(pair_key) and not bwd.is_pair(single.variant_key(call, False))
    assert pair_key != single.variant_key(call, False)


def test_key_tail_is_per_pair():
    """Keys past the sequence inside a pair (a 128-key multiple that is not a 256-key one) are masked."""
    from torch_fa4.kernels.sm100.pair import bwd

    assert bwd.variant_key(_call(D=128, S=384), False).mask_key_tail
    assert not bwd.variant_key(_call(D=128, S=512), False).mask_key_tail


def test_pair_tmem_columns():
    """D = Dv = 128: S^T, dP^T, dV, dK take all 512 columns; dQ's half rows sit in S^T's second
    half, clear of P^T's packed columns; dS^T packs over dP^T's first half."""
    from torch_fa4.kernels.sm100.bwd_config import TILE_M, Sm100BwdLayout
    from torch_fa4.kernels.sm100.pair import bwd

    lay = Sm100BwdLayout.of(bwd.variant_key(_call(D=128), False), ctas=2)
    cols = lay.columns()
    assert lay.tmem_columns == 512 and lay.stages == 1
    assert cols["s"] + TILE_M // 2 <= cols["dq"] and cols["dq"] + lay.head_dim // 2 <= cols["dp"]
    with pytest.raises(ValueError):
        Sm100BwdLayout.of(replace(bwd.variant_key(_call(D=128), False), head_dim=64, head_dim_v=64), ctas=2)
