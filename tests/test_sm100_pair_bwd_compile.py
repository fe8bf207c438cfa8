"""CPU: the sm100 CTA-pair backward's variants compile for sm_100a, and their SASS is a cta_group::2
Blackwell kernel.

There is no Blackwell GPU in this project, so this is the pair backward's verification (as
tests/test_sm100_bwd_compile.py is the 1-CTA backward's). Per variant: every matmul of a step is a
pair UMMA (`UTCHMMA.2CTA`, exactly as many as the leader issues: S^T and dP^T over the head dim, dV
and dK over 128 queries, dQ over the pair's keys: 256 at D = 128, 128 above) and no 1-CTA
one, every TMA load is the pair form (`UTMALDG.*.2CTA`), the leader's commits reach both CTAs
(`UTCBAR.2CTA.MULTICAST`), S^T, dP^T, dQ, dK and dV move through tensor memory (`LDTM`: whole
rows at D = 128, half rows at D = 192 / 256), P^T and dS^T go back to tensor memory (two `STTM`,
D = 128) or to shared memory (16-byte stores, D = 192 / 256), dS reaches the owning CTA's shared memory in
16-byte stores through the cluster window (4 per 32-query chunk), dQ of a thread's half row
leaves in fp32 REDs of four columns, dK / dV in 16-byte stores, nothing spills to local memory,
and the tiles fit tensor memory (512 columns) and shared memory (227 KB: the kernel asserts its
storage while compiling). One compile per variant (seconds each).
"""

from dataclasses import replace

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from sass import sass_of  # noqa: E402
from test_sm100_bwd_compile import _call, mma_loop  # noqa: E402
from test_sm90_fwd_compile import _alibi, _doc_mask, _mod_call  # noqa: E402

VARIANTS = {
    "d128": dict(D=128),
    "d128_causal": dict(D=128, causal=True),
    "d128_fp16_softcap_causal": dict(D=128, dtype=torch.float16, softcap=15.0, causal=True),
    "d128_gqa_key_tail": dict(D=128, H=8, Hkv=2, S=300),
    "d128_window": dict(D=128, window_left=100, window_right=30),
    "d128_varlen_causal": dict(D=128, varlen=True, causal=True),
    "d128_seqused_gqa": dict(D=128, H=4, Hkv=1, seqused=True),
    "d192": dict(D=192),
    "d192_causal_gqa": dict(D=192, H=4, Hkv=2, causal=True),
    "d192_dv128_varlen_causal": dict(D=192, Dv=128, varlen=True, causal=True),
    "d192_fp16_softcap_window_key_tail": dict(D=192, dtype=torch.float16, softcap=15.0, window_left=100,
                                              window_right=0, S=300),
    "d192_seqused": dict(D=192, seqused=True),
    "d256": dict(D=256),
    "d256_causal_varlen": dict(D=256, varlen=True, causal=True),
    "d256_fp16_softcap_gqa_key_tail": dict(D=256, dtype=torch.float16, softcap=10.0, H=4, Hkv=1, S=200),
}

MOD_VARIANTS = {
    "d128_alibi_softcap_causal": lambda: _mod_call(128, score_mod=_alibi(), softcap=20.0, causal=True),
    "d128_document_mask": lambda: _mod_call(128, mask_mod=_doc_mask()),
    "d192_alibi_document_mask": lambda: _mod_call(192, score_mod=_alibi(), mask_mod=_doc_mask()),
    "d256_alibi_causal": lambda: _mod_call(256, score_mod=_alibi(), causal=True),
}


# instructions per pair UMMA in the MMA warp's step loop: ~5 (CUDA 13's ptxas) to ~15 (CUDA 12's, fewer
# registers with mods); the per-lane loops around each UMMA make it 20-23
PAIR_MMA_LOOP_PER_UMMA = 16


def _expected_umma(cfg) -> int:
    """S^T (D/16 k-blocks), dP^T (Dv/16), dV and dK over 128 queries (8 each), dQ over the pair's
    keys (cfg.tile_n / 16): one call site each (pair/bwd_kernel.pair_mma_role)."""
    return cfg.head_dim // 16 + cfg.head_dim_v // 16 + 2 * 128 // 16 + cfg.tile_n // 16


@pytest.mark.parametrize("name", list(VARIANTS))
def test_pair_variant_compiles_to_pair_umma(name, tmp_path):
    _compile_and_check_sass(_call(**VARIANTS[name]), tmp_path)


@pytest.mark.parametrize("name", list(MOD_VARIANTS))
def test_pair_mod_variant_compiles_to_pair_umma(name, tmp_path):
    call = MOD_VARIANTS[name]()
    cfg = _compile_and_check_sass(call, tmp_path)
    assert cfg.mods_key == call.mod_key


def _compile_and_check_sass(call, tmp_path):
    from torch_fa4.kernels.sm100.bwd_config import (Sm100BwdLayout, pair_aliases, pair_keys, pair_registers,
                                                    pair_smem_bytes)
    from torch_fa4.kernels.sm100.pair import bwd
    from torch_fa4.kernels.sm100.tmem import TMEM_COLUMNS

    assert bwd.unsupported_reason(call) is None, "the test compiles only advertised variants"
    cfg = bwd.variant_key(call, False)
    keys = pair_keys(cfg.head_dim, cfg.head_dim_v)
    assert cfg.tile_n == 2 * keys and cfg.sparse is None and not cfg.deterministic and bwd.is_pair(cfg)
    narrow = keys == 64  # the half-row layout: half the columns per thread, P^T / dS^T in shared memory
    lay = Sm100BwdLayout.of(cfg, ctas=2)
    assert lay.tmem_columns <= TMEM_COLUMNS
    aliased = pair_aliases(cfg.head_dim, cfg.head_dim_v)
    assert pair_smem_bytes(cfg.head_dim, cfg.head_dim_v, lay.stages, aliased) <= 227 * 1024
    bwd.compile_variant(cfg, arch="sm_100a", dump_dir=str(tmp_path))  # bypasses the cache
    sass = sass_of(tmp_path, "*.sm_100a.cubin")
    umma = sass.count("UTCHMMA")
    assert umma == sass.count("UTCHMMA.2CTA") == _expected_umma(cfg), "not every matmul is a pair UMMA"
    # the leader's step loop holds every UMMA at a few instructions each: no per-UMMA loop over the
    # lanes (ptxas's form when it cannot see the MMA warp's branch as warp-uniform: ~20 each)
    loop_umma, loop_length = mma_loop(sass)
    assert loop_umma == umma
    assert loop_length <= PAIR_MMA_LOOP_PER_UMMA * umma, f"MMA loop: {loop_length} instructions"
    assert "HGMMA" not in sass
    tma = [line for line in sass.splitlines() if "UTMALDG" in line]
    # K, V, Q, dO (64-element boxes of D: two or three each), K^T, Q^T, dO^T halves (one or more)
    boxes = 2 * (cfg.head_dim + cfg.head_dim_v) // 64
    assert len(tma) >= boxes + 3 and all(".2CTA " in line for line in tma), tma
    # the leader's commits (S^T / dP^T ready, dQ ready, a ring slot free, the walk done) reach both CTAs
    assert sass.count("UTCBAR.2CTA.MULTICAST") == 4 and sass.count("UTCBAR") == 4
    # S^T and dP^T chunks, the half row of dQ, dK, dV out of TMEM; P^T and dS^T back in
    width = 2 if narrow else 1  # a thread's share of a dK / dV row
    assert (sass.count("LDTM") ==
            2 + cfg.head_dim // 2 // 32 + cfg.head_dim // width // 32 + cfg.head_dim_v // width // 32)
    assert sass.count("STTM") == (0 if narrow else 2)
    # dS to the CTA owning its queries: 16-byte stores through the cluster window; narrow: P^T and
    # dS^T to this CTA's tiles, 16 bytes each
    assert sass.count("ST.E.128") == 4 and sass.count("STS.128") == (8 if narrow else 0)
    assert sass.count("STG.E.128") == (cfg.head_dim + cfg.head_dim_v) // width // 8
    spills = sass.count("LDL") + sass.count("STL")
    assert spills == 0, f"{spills} local-memory spill instructions"
    assert sass.count("REDG.E.ADD.F32x4") == cfg.head_dim // 2 // 4
    assert "ATOMG.E.ADD" not in sass
    exps = sass.count("MUFU.EX2")
    assert 32 <= exps <= 64, f"{exps} exp2: more than one per query and mask path"
    assert ("MUFU.TANH" in sass) == cfg.softcap
    # registers rebalanced between the warp roles with mods or at D = 256 (bwd_config.pair_registers)
    assert sass.count("USETMAXREG") == (3 if pair_registers(cfg.head_dim, bool(cfg.mods_key)) else 0)
    return cfg


def test_pair_takes_d128_d192_d256_and_no_block_masks():
    """Other head dims, block masks: refused (the 1-CTA sm100 or the portable backward takes them)."""
    from torch_fa4.kernels.sm100.pair import bwd

    for kw in (dict(D=128), dict(D=192), dict(D=192, Dv=128), dict(D=256)):
        assert bwd.unsupported_reason(_call(**kw)) is None, kw
    for kw in (dict(D=64), dict(D=96), dict(D=128, Dv=64), dict(D=128, Dv=192), dict(D=256, Dv=128)):
        reason = bwd.unsupported_reason(_call(**kw))
        assert reason is not None and ("head dims" in reason or "(D, Dv)" in reason), (kw, reason)
    blocked = _mod_call(128, mask_mod=_doc_mask(), block_size=128)
    assert "block mask" in bwd.unsupported_reason(blocked)


def test_deterministic_runs_the_single_cta_variant():
    """Deterministic dQ (which unsupported_reason cannot see) is the 1-CTA kernel's key at D = 128
    and the portable backward's above: compiled and self-checked as those kernels."""
    from torch_fa4.kernels.portable import bwd as portable
    from torch_fa4.kernels.sm100 import bwd as single
    from torch_fa4.kernels.sm100.pair import bwd

    call = _call(D=128, causal=True)
    assert bwd.variant_key(call, True) == single.variant_key(call, True)
    wide = _call(D=192, causal=True)
    assert bwd.variant_key(wide, True) == ("portable", portable.variant(wide, True))
    assert bwd.is_pair(bwd.variant_key(wide, False))
    pair_key = bwd.variant_key(call, False)
    assert bwd.is_pair(pair_key) and not bwd.is_pair(single.variant_key(call, False))
    assert pair_key != single.variant_key(call, False)


def test_key_tail_is_per_pair():
    """Keys past the sequence inside a pair (a CTA's multiple that is not the pair's) are masked."""
    from torch_fa4.kernels.sm100.pair import bwd

    assert bwd.variant_key(_call(D=128, S=384), False).mask_key_tail
    assert not bwd.variant_key(_call(D=128, S=512), False).mask_key_tail
    assert bwd.variant_key(_call(D=192, S=192), False).mask_key_tail
    assert not bwd.variant_key(_call(D=192, S=256), False).mask_key_tail


def test_pair_tmem_columns():
    """D = Dv = 128: S^T, dP^T, dV, dK take all 512 columns; dQ's half rows sit in S^T's second
    half, clear of P^T's packed columns; dS^T packs over dP^T's first half."""
    from torch_fa4.kernels.sm100.bwd_config import TILE_M, Sm100BwdLayout, pair_aliases
    from torch_fa4.kernels.sm100.pair import bwd

    lay = Sm100BwdLayout.of(bwd.variant_key(_call(D=128), False), ctas=2)
    cols = lay.columns()
    assert lay.tmem_columns == 512 and lay.stages == 1
    assert cols["s"] + TILE_M // 2 <= cols["dq"] and cols["dq"] + lay.head_dim // 2 <= cols["dp"]
    with pytest.raises(ValueError):
        Sm100BwdLayout.of(replace(bwd.variant_key(_call(D=128), False), head_dim=64, head_dim_v=64), ctas=2)
    # D = 192: 64 keys per CTA, every accumulator half its width in its own columns
    lay = Sm100BwdLayout.of(bwd.variant_key(_call(D=192), False), ctas=2)
    cols = lay.columns()
    assert lay.keys == 64 and lay.stages == 1
    assert [cols[k] for k in ("s", "dp", "dv", "dk", "dq")] == [0, 64, 128, 224, 320]
    assert lay.tmem_columns == 416
    # D = 256: all 512 columns; dS, P^T and dS^T over the Q / dO halves to fit shared memory
    lay = Sm100BwdLayout.of(bwd.variant_key(_call(D=256), False), ctas=2)
    assert lay.keys == 64 and lay.tmem_columns == 512
    assert pair_aliases(256, 256) and not pair_aliases(192, 192)


def test_backward_routes_each_variant_to_its_kernel(monkeypatch):
    """pair.bwd.backward: a pair key runs the pair kernel through the 1-CTA backward's passes;
    deterministic D = 128 the 1-CTA entry point, deterministic D = 192 / 256 the portable backward
    (stand-ins record the calls: no GPU here)."""
    from torch_fa4.kernels.portable import bwd as portable
    from torch_fa4.kernels.sm100 import bwd as single
    from torch_fa4.kernels.sm100.pair import bwd

    seen = []
    monkeypatch.setattr(single, "backward", lambda call, *a: seen.append(("single", call.head_dim, a[-1])))
    monkeypatch.setattr(portable, "backward", lambda call, *a: seen.append(("portable", call.head_dim, a[-1])))
    monkeypatch.setattr(bwd, "compile_variant", lambda key: ("compiled", key))
    monkeypatch.setattr(single, "run_variant",
                        lambda call, key, fn, *a: seen.append(("pair", call.head_dim, fn == ("compiled", key))))
    grads = (None,) * 6
    for D, deterministic in ((128, False), (128, True), (192, False), (192, True), (256, True)):
        bwd.backward(_call(D=D, causal=True), *grads, deterministic)
    assert seen == [("pair", 128, True), ("single", 128, True), ("pair", 192, True), ("portable", 192, True),
                    ("portable", 256, True)]
