"""CPU: the portable backward kernel (kernels/portable/bwd_kernel.py) compiles for every target arch.

A modest matrix of variants is compiled for sm_80, sm_86, sm_89 and sm_120a (no GPU needed) and the
SASS checked: warp-level MMAs (HMMA) fed by ldmatrix (LDSM) and cp.async (LDGSTS), no local memory
inside the key loops (a spill there costs on every query tile; a few outside, once per CTA), and
the fp32 dQ adds present (RED, or plain loads and stores when deterministic). Shared memory per CTA
stays within the smallest target's opt-in limit. The host's pure helpers (window limits,
unsupported_reason) are checked here too.
"""

import dataclasses
import math

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from sass import sass_of, spills  # noqa: E402
from torch_fa4.call import AttentionCall  # noqa: E402

BF, FP = torch.bfloat16, torch.float16

# arch -> opt-in shared memory per block (bytes)
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_120a": 99 * 1024,
              "sm_90a": 227 * 1024}

# (arch, dtype, head dim, features): every head dim on sm_80, the common ones elsewhere
MATRIX = [
    ("sm_80", BF, 64, {}),
    ("sm_80", BF, 64, {"stages": 2}),
    ("sm_80", FP, 128, {"stages": 2, "bounded": True}),
    ("sm_80", BF, 192, {"stages": 2, "deterministic": True}),
    ("sm_80", BF, 128, {"stages": 2, "large_tiles": True, "bounded": True}),
    ("sm_80", FP, 256, {"large_tiles": True, "varlen": True}),
    ("sm_80", FP, 96, {"bounded": True}),
    ("sm_80", BF, 128, {"bounded": True, "softcap": True}),
    ("sm_80", BF, 192, {}),
    ("sm_80", FP, 256, {"bounded": True}),
    ("sm_80", BF, 128, {"deterministic": True, "varlen": True, "seqused_k": True, "bounded": True}),
    ("sm_86", FP, 128, {"bounded": True}),
    ("sm_89", BF, 64, {"varlen": True, "stages": 2}),
    ("sm_120a", BF, 128, {}),
    ("sm_120a", FP, 192, {"deterministic": True}),
    # Hopper's variant: dQ's atomics two columns at a time (red .v2.f32)
    ("sm_90a", BF, 128, {"stages": 2, "large_tiles": True, "dq_pair_adds": True}),
    ("sm_90a", BF, 128, {"stages": 2, "large_tiles": True, "bounded": True, "dq_pair_adds": True}),
    ("sm_90a", BF, 64, {"stages": 2, "large_tiles": True, "bounded": True, "dq_pair_adds": True}),
    ("sm_80", FP, 64, {"stages": 2, "large_tiles": True, "softcap": True}),
]


@pytest.mark.parametrize("arch,dtype,d,features", MATRIX, ids=lambda x: str(x) if not isinstance(x, dict)
                         else "-".join(sorted(x)) or "plain")
def test_compiles_to_warp_mma(arch, dtype, d, features, tmp_path):
    from torch_fa4.kernels.portable.bwd_compile import compile_variant
    from torch_fa4.kernels.portable.bwd_config import make_variant

    variant = make_variant(dtype, d, d, **features)
    assert variant.smem_bytes() <= SMEM_LIMIT[arch]
    compile_variant(variant, arch=arch, dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    assert "HMMA" in sass, "no warp-level MMA"
    assert "LDSM" in sass, "operands not loaded by ldmatrix"
    assert "LDGSTS" in sass, "tiles not loaded by cp.async"
    total, in_loops = spills(sass)
    # none where it costs per query tile; a few in the prologue / epilogue (the sm_80 softcap
    # variant at head dim 64 with 128 keys: 11) cost once per CTA
    assert in_loops == 0, f"{in_loops} local-memory (spill) instructions inside the key loop"
    assert total <= 16, f"{total} local-memory (spill) instructions"
    if features.get("deterministic"):
        assert "ADD.F32" not in sass, "atomic dQ adds in the deterministic variant"
    else:
        assert "RED.E.ADD.F32" in sass or "REDG.E.ADD.F32" in sass, "no dQ atomic adds"
    if features.get("dq_pair_adds"):
        assert "ADD.F32x2" in sass, "dQ atomics not paired"


def test_variants_fit_shared_memory():
    # head dims up to 192 fit every target; 256 fits sm_80 (and Hopper), the others refuse it
    from torch_fa4.kernels.portable.bwd_config import SUPPORTED_HEAD_DIMS, make_variant, smem_limit

    for d in SUPPORTED_HEAD_DIMS:
        for dv in SUPPORTED_HEAD_DIMS:
            need = make_variant(BF, d, dv).smem_bytes()
            assert need <= smem_limit((8, 0)) == SMEM_LIMIT["sm_80"]
            assert make_variant(BF, d, dv, large_tiles=True, stages=2).smem_bytes() <= smem_limit((9, 0))
            assert make_variant(BF, d, dv, large_tiles=True).smem_bytes() <= smem_limit((8, 0))
            if max(d, dv) <= 192:
                assert need <= smem_limit((8, 6)) == SMEM_LIMIT["sm_86"]
            assert smem_limit((12, 0)) == SMEM_LIMIT["sm_120a"] and smem_limit((9, 0)) >= need
    assert make_variant(BF, 256, 256).smem_bytes() > smem_limit((8, 9))


def _call(**kw):
    q = torch.zeros(1, 8, 2, kw.pop("d", 64), dtype=kw.pop("dtype", BF))
    k = torch.zeros(1, 8, kw.pop("hkv", 2), q.shape[-1], dtype=q.dtype)
    return AttentionCall(q=q, k=k, v=k.clone(), scale=1 / math.sqrt(q.shape[-1]), **kw)


def test_window_limits():
    from torch_fa4.kernels.portable.bwd import UNBOUNDED, _window

    assert _window(_call()) == (False, UNBOUNDED, UNBOUNDED)
    assert _window(_call(causal=True)) == (True, UNBOUNDED, 0)
    assert _window(_call(causal=True, window_left=5, window_right=0)) == (True, 5, 0)
    assert _window(_call(window_left=3, window_right=7)) == (True, 3, 7)
    assert _window(_call(window_left=-1, window_right=0)) == (True, UNBOUNDED, 0)


def test_unsupported_reasons_name_the_problem():
    from torch_fa4.kernels.portable.bwd import unsupported_reason

    assert unsupported_reason(_call()) is None
    assert unsupported_reason(_call(causal=True, softcap=5.0, window_left=3)) is None
    assert "float32" in unsupported_reason(_call(dtype=torch.float32))
    assert "head dims" in unsupported_reason(_call(d=80))
    assert "multiple" in unsupported_reason(_call(hkv=3))
    assert "score_mod" in unsupported_reason(_call(mod_key="k"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_120a"])
def test_row_statistics_pass_compiles_without_hopper_instructions(arch, tmp_path):
    # the portable backward reuses the sm90 backward's row-statistics kernel; compiled for these
    # targets it must leave out programmatic dependent launch (griddepcontrol: sm_90+) on sm_8x
    from torch_fa4.kernels.sm90 import bwd_prepare

    bwd_prepare.compile_kernel(BF, 128, arch=arch, dump_dir=str(tmp_path), d_zero=128)
    sass = sass_of(tmp_path)
    assert "LDG.E.128" in sass and "LDL" not in sass


@pytest.mark.parametrize("arch,name", [("sm_80", "transcendental_bool_table"),
                                       ("sm_120a", "bias_bf16_doc2d")])
def test_mods_compile(arch, name, tmp_path):
    # score_mod, its derivative and mask_mod inlined per element, captured tensors read from global
    from _mod_cases import cases

    from torch_fa4.kernels.portable.bwd_compile import compile_variant
    from torch_fa4.kernels.portable.bwd_config import make_variant
    from torch_fa4.mods.prepare import prepare

    key, _ = prepare(*cases()[name])
    compile_variant(make_variant(BF, 64, 64, mods_key=key, stages=2), arch=arch, dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    assert "HMMA" in sass and "LDL" not in sass and "STL" not in sass


@pytest.mark.parametrize("varlen", [False, True])
def test_row_statistics_fallback_layout(varlen):
    # the torch path (taken where the row-statistics kernel refuses, here: CPU tensors) gives the
    # layout the kernel reads: (B, Hq, S) or one batch of packed rows (1, Hq, T), +inf for rows
    # that see no key, and a zeroed dQ buffer
    from torch_fa4.kernels.portable.bwd import LOG2E, _row_statistics

    lead = (7,) if varlen else (2, 5)
    dout, out = torch.randn(*lead, 3, 64).to(BF), torch.randn(*lead, 3, 64).to(BF)
    lse = torch.randn(3, 7) if varlen else torch.randn(2, 3, 5)
    lse[..., 1] = -math.inf
    dq_shape = ((1,) if varlen else ()) + lead + (3, 64)
    lse2, dpsum, dq_acc = _row_statistics(dout, out, lse, dq_shape)
    want_dpsum = (dout.float() * out.float()).sum(-1).transpose(-1, -2)
    want_lse2 = torch.where(lse == -math.inf, math.inf, lse * LOG2E)
    if varlen:
        want_dpsum, want_lse2 = want_dpsum[None], want_lse2[None]
    assert torch.equal(lse2, want_lse2) and torch.allclose(dpsum, want_dpsum)
    assert lse2.is_contiguous() and dpsum.is_contiguous()
    assert dq_acc.shape == dq_shape and dq_acc.dtype == torch.float32 and not dq_acc.any()


def test_empty_calls_zero_the_gradients():
    # no query or no key: nothing to launch, every gradient 0 (never the NaN they were poisoned with)
    from torch_fa4.kernels.portable.bwd import backward

    for sq, sk in ((0, 5), (5, 0)):
        call = _call()
        q, k = torch.zeros(1, sq, 2, 64, dtype=BF), torch.zeros(1, sk, 2, 64, dtype=BF)
        call = AttentionCall(q=q, k=k, v=k.clone(), scale=0.125)
        grads = [torch.full_like(t, math.nan) for t in (q, k, k)]
        backward(call, torch.zeros_like(q), torch.zeros_like(q), torch.zeros(1, 2, sq), *grads, False)
        assert all(not g.isnan().any() and not g.any() for g in grads)


def test_rows_ready_keeps_aligned_views_and_copies_others():
    from torch_fa4.kernels.portable.bwd import _rows_ready

    t = torch.zeros(2, 16, 4, 64, dtype=BF)
    assert _rows_ready(t) is t
    sdpa = torch.zeros(2, 4, 16, 64, dtype=BF).transpose(1, 2)  # (B, H, S, D) storage: 8-element strides
    assert _rows_ready(sdpa).data_ptr() == sdpa.data_ptr()
    odd = torch.zeros(2, 16, 4, 65, dtype=BF)[..., :64]  # rows 65 elements apart: not 16-byte strides
    ready = _rows_ready(odd)
    assert ready.is_contiguous() and torch.equal(ready, odd)
    one = torch.zeros(1, 16, 1, 64, dtype=BF)
    assert all(s % 8 == 0 for s in _rows_ready(one).stride()[:-1])


@pytest.mark.parametrize("tiles", [(64, 128), (64, 64), (64, 32)])
@pytest.mark.parametrize("block", [(128, 128), (64, 64), (32, 96)])
def test_block_mask_tile_map_never_skips_a_visible_element(tiles, block):
    # every (key tile, query tile) with a visible element is visited; an empty one (every block
    # under it empty) is skipped
    from torch_fa4 import mods as M
    from torch_fa4.kernels.portable.bwd_sparse import tile_visits, walk_reason
    from torch_fa4.mods.prepare import prepare
    from torch_fa4.mods.registry import lookup

    sq, sk, tm, tn = 300, 260, *tiles
    mask = M.and_masks(M.causal_mask, M.sliding_window_mask(70, 0))
    bm = M.create_block_mask(mask, None, None, sq, sk, device="cpu", BLOCK_SIZE=block)
    key, aux = prepare(None, mask)
    q = torch.zeros(2, sq, 3, 64, dtype=BF)
    k = torch.zeros(2, sk, 3, 64, dtype=BF)
    call = AttentionCall(q=q, k=k, v=k, scale=0.125, mod_key=key, mods=lookup(key), aux_tensors=aux,
                         block_mask=tuple(bm.as_tensors()), block_mask_q=bm.BLOCK_SIZE[0],
                         block_mask_kv=bm.BLOCK_SIZE[1])
    assert walk_reason(call, False) is None and walk_reason(call, True) is not None
    visits = tile_visits(call, tm, tn)
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    visible = (j <= i) & (j >= i - 70)
    n_tiles, m_tiles = -(-sk // tn), -(-sq // tm)
    assert visits.shape == (2, 3, n_tiles, m_tiles)
    blocks = torch.zeros(-(-sq // block[0]), -(-sk // block[1]), dtype=torch.bool)
    for a in range(blocks.shape[0]):
        for c in range(blocks.shape[1]):
            blocks[a, c] = visible[a * block[0]:(a + 1) * block[0], c * block[1]:(c + 1) * block[1]].any()
    for n in range(n_tiles):
        for m in range(m_tiles):
            rows, cols = slice(m * tm, (m + 1) * tm), slice(n * tn, (n + 1) * tn)
            under = blocks[m * tm // block[0]:((m + 1) * tm - 1) // block[0] + 1,
                           n * tn // block[1]:((n + 1) * tn - 1) // block[1] + 1]
            assert bool(visits[0, 0, n, m]) == bool(under.any())
            if visible[rows, cols].any():
                assert visits[1, 2, n, m]
    assert not visits.all(), "a window this narrow leaves empty steps"


def test_sparse_variant_compiles(tmp_path):
    from torch_fa4 import mods as M
    from torch_fa4.kernels.portable.bwd_compile import compile_variant
    from torch_fa4.kernels.portable.bwd_config import make_variant
    from torch_fa4.mods.prepare import prepare

    key, _ = prepare(None, M.sliding_window_mask(70, 0))
    variant = make_variant(BF, 128, 128, mods_key=key, large_tiles=True, stages=2)
    variant = dataclasses.replace(variant, sparse=True)
    compile_variant(variant, arch="sm_80", dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    assert "HMMA" in sass and "LDL" not in sass and "STL" not in sass
