"""sm90 backward kernel against float64 autograd, over the feature matrix.

Each case draws fresh random inputs, computes out/lse with float64 math (tests/naive.py: what a
forward pass would hand to backward), poisons dq/dk/dv with NaN, runs the kernel and compares with the
float64 gradients by relative norm error. Run as a script for a small timing table.
"""

from __future__ import annotations

import math

import pytest
import torch

from _mod_cases import alibi_abs
from bwd_mod_cases import MOD_CASES, _alibi, _documents, _tanh_bias_documents, slopes_and_documents
from _mod_call_fields import mod_call_fields
from gpu_harness import ON_SM90, gpu_marks
from naive import call_options, naive_varlen
from torch_fa4.call import AttentionCall

pytestmark = gpu_marks(ON_SM90, "needs an sm_90 GPU")


def _case(dtype, b, sq, sk, hq, hkv, d, dv, causal=False, left=-1, right=-1, softcap=0.0,
          strided=False, varlen=False, seqused=False, deterministic=False, score_mod=None,
          mask_mod=None, block_size=None, bm_heads=None, expect_sparse=None, expect_tile_m=None,
          expect_dq_warp=None, expect_dq_t=None, lens=None, tuning=None):
    """lens: varlen, these (query lengths, key lengths) instead of random ones. block_size: also hand the kernel a block mask of mask_mod at that (q, kv) tile size, with
    bm_heads heads (None: one for all); expect_sparse: the (steps per block row, CTAs per block
    column) the backward must walk it with, None for the dense walk; expect_tile_m: the queries
    per kernel step the variant must have; expect_dq_warp: whether it must add dQ from the
    dedicated writer warp; tuning: bwd.BwdTuning for the call (None: the default)."""
    from torch_fa4.kernels.sm90 import bwd

    tuning = tuning or bwd.BwdTuning()

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(torch.seed() % (2**31))
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen, dtype=torch.float64)
    scale = 1.0 / math.sqrt(d)
    if varlen:
        lens_q = torch.randint(1, sq + 1, (b,), generator=torch.Generator().manual_seed(torch.seed() % 2**31))
        lens_k = torch.randint(1, sk + 1, (b,), generator=torch.Generator().manual_seed(torch.seed() % 2**31))
        if lens is not None:
            lens_q, lens_k = (torch.tensor(x) for x in lens)
        cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), lens_q.cumsum(0)]).to(torch.int32).to(dev)
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lens_k.cumsum(0)]).to(torch.int32).to(dev)
        q = rnd(int(cu_q[-1]), hq, d).to(dtype)
        k = rnd(int(cu_k[-1]), hkv, d).to(dtype)
        v = rnd(int(cu_k[-1]), hkv, dv).to(dtype)
        do = rnd(int(cu_q[-1]), hq, dv).to(dtype)
        used = None
    else:
        if strided:  # (B, H, S, D) storage seen as (B, S, H, D), as SDPA/flex hand it over
            q = rnd(b, hq, sq, d).to(dtype).transpose(1, 2)
            k = rnd(b, hkv, sk, d).to(dtype).transpose(1, 2)
            v = rnd(b, hkv, sk, dv).to(dtype).transpose(1, 2)
        else:
            q, k, v = rnd(b, sq, hq, d).to(dtype), rnd(b, sk, hkv, d).to(dtype), rnd(b, sk, hkv, dv).to(dtype)
        do = rnd(b, sq, hq, dv).to(dtype)
        used = torch.randint(1, sk + 1, (b,), device=dev, dtype=torch.int32) if seqused else None

    mod_kw = mod_call_fields(score_mod, mask_mod, block_size, sq, sk, bm_heads)
    call = AttentionCall(q=q, k=k, v=v, scale=scale, causal=causal, window_left=left,
                         window_right=right, softcap=softcap, **mod_kw,
                         cu_seqlens_q=cu_q if varlen else None, cu_seqlens_k=cu_k if varlen else None,
                         seqused_k=used, max_seqlen_q=sq, max_seqlen_k=sk)
    assert bwd.unsupported_reason(call, tuning) is None, bwd.unsupported_reason(call, tuning)
    key = bwd.variant_key(call, deterministic)
    if block_size is not None:
        assert key.sparse == expect_sparse
    if expect_tile_m is not None:
        assert key.tile_m == expect_tile_m
    if expect_dq_warp is not None:
        assert key.separate_dq_slabs == expect_dq_warp
    if expect_dq_t is not None:
        assert key.dq_transposed == expect_dq_t

    # float64 forward + autograd: the reference, and the out / lse a forward pass would hand over
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    out64, lse = naive_varlen(q64, k64, v64, **call_options(call), score_mod=score_mod, mask_mod=mask_mod,
                              differentiable=True)
    dq64, dk64, dv64 = torch.autograd.grad(out64, (q64, k64, v64), do.to(torch.float64))
    out = out64.detach().to(dtype).contiguous()
    lse = lse.detach().float().contiguous()
    grads = []
    for _ in range(2 if deterministic else 1):
        dq = torch.full(q.shape, math.nan, dtype=dtype, device=dev)
        dk = torch.full(k.shape, math.nan, dtype=dtype, device=dev)
        dvv = torch.full(v.shape, math.nan, dtype=dtype, device=dev)
        bwd.backward(call, do, out, lse, dq, dk, dvv, deterministic, tuning)
        torch.cuda.synchronize()
        grads.append((dq, dk, dvv))
    dq, dk, dvv = grads[0]
    if deterministic:
        for a, c in zip(grads[0], grads[1]):
            assert torch.equal(a, c), "deterministic mode gave two different results"
    tol = 1.5e-2 if dtype == torch.bfloat16 else 6e-3
    for name, got, ref in (("dq", dq, dq64), ("dk", dk, dk64), ("dv", dvv, dv64)):
        assert not torch.isnan(got).any(), f"{name} has NaN (unwritten or NaN math)"
        err = (got.double() - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err < tol, f"{name}: relative error {err:.3e} >= {tol}"
    return dq, dk, dvv


BF, FP = torch.bfloat16, torch.float16


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [BF, FP])
def test_dense(dtype, d):
    _case(dtype, 2, 256, 384, 2, 2, d, d)


# ---- head dims above 128: the narrow variant (64 keys per CTA, head dim split between the
# consumer warpgroups; D=256 with a one-stage Q/dO ring)

@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("sq,sk", [(300, 300), (200, 333), (333, 130)])
def test_large_head_dims_causal(d, sq, sk):
    _case(BF, 2, sq, sk, 2, 2, d, d, causal=True)


@pytest.mark.parametrize("d,hq,hkv", [(192, 4, 2), (256, 6, 1)])
def test_large_head_dims_gqa(d, hq, hkv):
    _case(BF, 2, 190, 260, hq, hkv, d, d, causal=True)


@pytest.mark.parametrize("d,dv", [(192, 128), (128, 256), (256, 64), (256, 128), (192, 256)])
def test_large_head_dims_dv_differs(d, dv):
    # (256, 128): two stages and dQ slabs in 226 KB of shared memory; (192, 256): dQ staged in the ring
    _case(FP, 1, 160, 200, 2, 2, d, dv)


@pytest.mark.parametrize("dv, ring", [(192, (1, False)), (256, (2, True))])
def test_d256_ring_configurations(dv, ring):
    # D=256 shares 64 keys between the warpgroups; Dv 256 stages dQ in the consumed Q / dO stage
    # (two stages), Dv 192 falls back to one stage with separate dQ slabs: both must be right
    from torch_fa4.kernels.sm90.bwd_config import ring as ring_of
    from torch_fa4.kernels.sm90.bwd_variant import key_tile

    assert ring_of(256, dv, key_tile(256, dv), 64) == ring
    _case(BF, 2, 333, 300, 4, 2, 256, dv, causal=True)
    _case(BF, 1, 200, 520, 2, 2, 256, dv, deterministic=True)


def test_large_head_dims_window_softcap_seqused():
    _case(BF, 2, 300, 280, 2, 1, 256, 256, left=60, right=20, softcap=8.0)
    _case(BF, 3, 150, 300, 2, 2, 192, 192, seqused=True, causal=True)


def test_large_head_dims_deterministic():
    _case(BF, 2, 256, 520, 4, 2, 256, 256, causal=True, deterministic=True)


def test_large_head_dims_varlen():
    _case(BF, 3, 300, 260, 4, 2, 192, 192, varlen=True, causal=True)


def test_large_head_dims_mods():
    slopes = torch.rand(4, device="cuda")
    doc = torch.sort(torch.randint(0, 4, (300,), device="cuda")).values.to(torch.int32)
    score_mod, mask_mod = _tanh_bias_documents(slopes, doc)
    _case(BF, 2, 200, 300, 4, 2, 256, 256, causal=True, score_mod=score_mod, mask_mod=mask_mod)


@pytest.mark.parametrize("sq,sk", [(200, 333), (333, 200), (1, 77), (130, 130)])
def test_causal_odd_lengths(sq, sk):
    _case(BF, 2, sq, sk, 3, 3, 128, 128, causal=True)


# non-causal: every key tile walks every query tile; odd lengths, GQA groups, more key tiles than
# query tiles
@pytest.mark.parametrize("sq,sk,hq,hkv,d", [(333, 700, 4, 2, 128), (517, 900, 3, 1, 64), (200, 1000, 2, 2, 96)])
def test_non_causal_odd_lengths_gqa(sq, sk, hq, hkv, d):
    _case(BF, 2, sq, sk, hq, hkv, d, d)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 1)])
def test_gqa_mqa(hq, hkv):
    _case(BF, 2, 190, 260, hq, hkv, 128, 128, causal=True)


def test_strided_inputs():
    _case(FP, 2, 150, 250, 4, 2, 64, 64, strided=True)


@pytest.mark.parametrize("left,right,causal", [(60, 20, False), (100, -1, True), (-1, 40, False)])
def test_window(left, right, causal):
    _case(BF, 2, 300, 280, 2, 1, 128, 128, causal=causal, left=left, right=right)


def test_softcap():
    _case(BF, 2, 200, 260, 2, 2, 128, 128, softcap=8.0, causal=True)


def test_head_dim_v_differs():
    _case(BF, 1, 160, 200, 2, 2, 128, 64)


def test_varlen():
    _case(BF, 3, 300, 260, 4, 2, 128, 128, varlen=True, causal=True)


# The kernel's packed-rows varlen variant (one launch for the batch): (D, causal, window (left, right), softcap, hq, hkv, dtype, max sq, max sk).
# Sequences of 1 .. max rows each, so sequences start at any packed row (their row statistics
# move to tile-aligned offsets, bwd_row_stats.varlen_stat_layout), tiles straddle two sequences, and some
# sequences are shorter than a tile.
_VARLEN_KERNEL_CASES = {
    "d64_causal": (64, True, (-1, -1), 0.0, 4, 2, BF, 300, 260),
    "d64_gqa": (64, False, (-1, -1), 0.0, 4, 1, BF, 517, 300),
    "d96_causal": (96, True, (-1, -1), 0.0, 2, 2, BF, 200, 260),
    "d128_causal_gqa": (128, True, (-1, -1), 0.0, 4, 2, BF, 300, 517),
    "d128_window_softcap_fp16": (128, False, (64, 16), 8.0, 2, 2, FP, 300, 260),
    "d192_causal": (192, True, (-1, -1), 0.0, 2, 1, BF, 300, 260),
    "d256": (256, False, (-1, -1), 0.0, 2, 2, BF, 200, 300),
}


def _refuse_per_sequence(monkeypatch):
    from torch_fa4.kernels.sm90 import bwd

    def refuse(*args, **kwargs):
        raise AssertionError("ran one launch per sequence, not the packed variant")

    monkeypatch.setattr(bwd, "_backward_per_sequence", refuse)


@pytest.mark.parametrize("name", list(_VARLEN_KERNEL_CASES))
def test_varlen_kernel(name, monkeypatch):
    d, causal, (left, right), softcap, hq, hkv, dtype, sq, sk = _VARLEN_KERNEL_CASES[name]
    _refuse_per_sequence(monkeypatch)
    _case(dtype, 5, sq, sk, hq, hkv, d, d, causal=causal, left=left, right=right, softcap=softcap,
          varlen=True)


def test_varlen_kernel_odd_offsets(monkeypatch):
    """Sequences starting at packed rows 17, 317, 446, 702 (none 16-byte aligned as fp32 rows):
    the layout that stopped the packed variant with an illegal instruction (NOTES Experiment 160)."""
    _refuse_per_sequence(monkeypatch)
    lens = ([17, 300, 129, 256, 64], [40, 260, 129, 200, 64])
    _case(BF, 5, 300, 260, 4, 2, 64, 64, causal=True, varlen=True, lens=lens)
    _case(BF, 5, 300, 260, 2, 2, 128, 128, varlen=True, lens=lens)


def test_varlen_kernel_launch_record(monkeypatch):
    """A packed batch with its maxima given runs from a launch record (bwd_launch_record); a second
    batch of the same sizes with other offsets replays that record, with its statistics moved to
    its own sequences' offsets."""
    from torch_fa4.kernels.sm90 import bwd_launch_record

    _refuse_per_sequence(monkeypatch)
    monkeypatch.setattr(bwd_launch_record, "_records", {})
    first = ([17, 300, 129, 256, 64], [40, 260, 129, 200, 64])
    second = ([300, 17, 64, 129, 256], [200, 40, 260, 64, 129])  # the same totals, other offsets
    for lens in (first, second):
        _case(BF, 5, 300, 260, 4, 2, 128, 128, causal=True, varlen=True, lens=lens)
    records = list(bwd_launch_record._records.values())
    assert len(records) == 1 and records[0].stat_tile > 0, records


def test_varlen_deterministic(monkeypatch):
    """Deterministic mode on the packed-rows variant: two runs equal bit for bit, and float64's
    gradients (each sequence's turns count the key tiles before its query tiles)."""
    _refuse_per_sequence(monkeypatch)
    lens = ([17, 300, 129, 256, 64], [40, 260, 129, 200, 64])
    _case(BF, 5, 300, 260, 4, 2, 128, 128, causal=True, varlen=True, deterministic=True, lens=lens)
    _case(BF, 5, 300, 260, 4, 2, 64, 64, left=50, right=10, varlen=True, deterministic=True)


def test_varlen_per_sequence(monkeypatch):
    """One dense launch per sequence (BwdTuning(varlen_kernel=False)), the way calls with one side
    packed run."""
    from torch_fa4.kernels.sm90 import bwd

    seen = []
    per_sequence = bwd._backward_per_sequence
    monkeypatch.setattr(bwd, "_backward_per_sequence", lambda *a: seen.append(1) or per_sequence(*a))
    _case(BF, 3, 300, 260, 4, 2, 128, 128, varlen=True, causal=True, tuning=bwd.BwdTuning(varlen_kernel=False))
    assert seen, "the packed variant ran"


def test_seqused_k():
    _case(BF, 3, 150, 300, 2, 2, 64, 64, seqused=True)


def test_deterministic():
    _case(BF, 2, 256, 520, 4, 2, 128, 128, causal=True, deterministic=True)


@pytest.mark.parametrize("make_mods,causal", MOD_CASES)
def test_mods(make_mods, causal):
    slopes, doc = slopes_and_documents()
    score_mod, mask_mod = make_mods(slopes, doc)
    _case(BF, 2, 200, 300, 4, 2, 128, 128, causal=causal, score_mod=score_mod, mask_mod=mask_mod)


def _sequence_index(slopes, doc):  # mods reading b, the sequence's index in a varlen batch
    period = torch.randint(2, 6, (8,), device="cuda", dtype=torch.int32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx) * (b + 1) * 0.25

    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_idx % period[b]) != 1) | (kv_idx == 0)

    return score_mod, mask_mod


@pytest.mark.parametrize("make_mods,causal,d", [
    (_alibi, True, 128), (_tanh_bias_documents, False, 128), (_sequence_index, True, 128),
    (_sequence_index, False, 64),
])
def test_mods_varlen(make_mods, causal, d, monkeypatch):
    """Mods on packed varlen batches (the packed-rows variant): positions within each sequence,
    b its index, as the forward does."""
    _refuse_per_sequence(monkeypatch)
    slopes = torch.rand(4, device="cuda")
    doc = torch.sort(torch.randint(0, 4, (300,), device="cuda")).values.to(torch.int32)
    score_mod, mask_mod = make_mods(slopes, doc)
    _case(BF, 5, 300, 260, 4, 2, d, d, causal=causal, varlen=True, score_mod=score_mod, mask_mod=mask_mod)


@pytest.mark.parametrize("d,causal", [(128, False), (64, True)])
def test_alibi_abs(d, causal):
    # D64: 128 queries per step (the emitter's rows then span both warpgroups' query halves)
    slopes = torch.rand(4, device="cuda")
    score_mod = alibi_abs(slopes)  # abs: exact fp32 |q - kv| per offset in the fragment emitter
    _case(BF, 2, 333, 300, 4, 2, d, d, causal=causal, score_mod=score_mod)


# ---- block-sparse walk: the block mask decides which query tiles each KV tile visits

def _doc_ids(n, docs=4):
    return torch.sort(torch.randint(0, docs, (n,), device="cuda")).values.to(torch.int32)


@pytest.mark.parametrize("block,expect", [((128, 128), (2, 1)), ((64, 128), (1, 1)), ((256, 256), (4, 2))])
def test_block_sparse_document(block, expect):
    # 128x128 block mask over 64-row kernel steps: two steps per block row
    doc = _doc_ids(400)
    _, mask_mod = _documents(None, doc)
    _case(BF, 2, 330, 400, 4, 2, 128, 128, mask_mod=mask_mod, block_size=block, expect_sparse=expect)


def test_block_sparse_document_causal_gqa_fp16():
    doc = _doc_ids(300, docs=3)
    _, mask_mod = _documents(None, doc)
    # D64 walks 128-query steps by default (bwd.query_tile): one step per 128-row block-mask tile
    _case(FP, 2, 200, 300, 6, 2, 64, 64, causal=True, mask_mod=mask_mod, block_size=128, expect_sparse=(1, 1),
          expect_tile_m=128)


@pytest.mark.parametrize("d", [64, 128])
def test_block_sparse_causal_sliding_window(d):
    from torch_fa4.mods.library import sliding_window_mask

    # top-left aligned causal window of 200 keys, given only through the mask_mod + block mask
    # 64-query steps (two per 128-row block-mask tile) at D128, 128-query steps at D64
    _case(BF, 2, 700, 700, 2, 2, d, d, mask_mod=sliding_window_mask(200, 0), block_size=128,
          expect_sparse=(2, 1) if d == 128 else (1, 1))


def test_block_sparse_kv_tiles_without_queries_get_zero_gradients():
    doc = _doc_ids(520, docs=2)

    # keys from 256 on are visible to no query (KV tiles 2..4 walk nothing); per-head pattern
    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx < 256) & ((q_idx // 64 + h) % 3 != 0)

    dq, dk, dv = _case(BF, 2, 300, 520, 4, 2, 128, 128, mask_mod=mask_mod, block_size=(128, 256),
                       bm_heads=4, expect_sparse=(2, 2))
    assert (dk[:, 256:] == 0).all() and (dv[:, 256:] == 0).all()


@pytest.mark.parametrize("d", [192, 256])
def test_block_sparse_large_head_dims(d):
    # narrow variant: 64-key CTAs, two per 128-key block-mask column
    doc = _doc_ids(400)
    _, mask_mod = _documents(None, doc)
    _case(BF, 2, 330, 400, 4, 2, d, d, mask_mod=mask_mod, block_size=128, expect_sparse=(2, 2))


@pytest.mark.parametrize("d", [64, 128])
def test_block_sparse_64_key_columns(d):
    # a 64x64 block mask: the 64-key (narrow) variant walks it instead of the dense walk
    doc = _doc_ids(300)
    _, mask_mod = _documents(None, doc)
    _case(BF, 2, 250, 300, 4, 2, d, d, causal=True, mask_mod=mask_mod, block_size=64, expect_sparse=(1, 1))


def test_block_mask_of_incompatible_tiles_walks_densely():
    doc = _doc_ids(300)
    _, mask_mod = _documents(None, doc)
    _case(BF, 1, 250, 300, 2, 2, 128, 128, mask_mod=mask_mod, block_size=(96, 96), expect_sparse=None)


def test_flex_attention_block_mask_reaches_the_backward(monkeypatch):
    import torch_fa4
    from torch_fa4.kernels.sm90 import bwd_sparse
    from torch_fa4.mods import create_block_mask
    from torch_fa4.mods.library import document_mask

    calls = []
    real = bwd_sparse.transposed_lists
    monkeypatch.setattr(bwd_sparse, "transposed_lists", lambda call: calls.append(1) or real(call))
    b, h, s, d = 2, 4, 384, 128
    doc = _doc_ids(s, docs=3)
    bm = create_block_mask(document_mask(doc), None, None, s, s, device="cuda")
    # bf16 values, so the float64 run sees exactly the kernel's inputs
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda").to(torch.bfloat16) for _ in range(4))
    grads = []
    for dtype in (torch.bfloat16, torch.float64):  # float64 runs the exact reference
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = torch_fa4.flex_attention(*xs, block_mask=bm)
        grads.append(torch.autograd.grad(out, xs, do.to(dtype)))
    assert calls, "the backward did not walk the block mask"
    for name, got, ref in zip(("dq", "dk", "dv"), *grads):
        assert not torch.isnan(got).any()
        err = (got.double() - ref).norm() / ref.norm()
        assert err < 1.5e-2, f"{name}: relative error {err:.3e}"


@pytest.mark.parametrize("ctas", [1, 3, None])
def test_persistent_tiles_per_cta(ctas):
    # the persistent kernel (the dense 128-key variants) with its grid capped at 1 or 3 CTAs (every
    # CTA walks many tiles: ring state, K / V phases and the tile mailbox carried over tiles, tiles
    # with no steps among them), and uncapped (one CTA per SM)
    from torch_fa4.kernels.sm90 import bwd

    tuning = bwd.BwdTuning(persistent_ctas=ctas)
    _case(BF, 2, 300, 517, 4, 2, 64, 64, causal=True, expect_tile_m=128, tuning=tuning)
    _case(BF, 2, 517, 300, 2, 2, 64, 64, expect_tile_m=128, tuning=tuning)
    _case(BF, 3, 300, 517, 4, 2, 128, 128, seqused=True, tuning=tuning)  # key tiles past seqused: no steps
    _case(BF, 2, 300, 517, 4, 2, 128, 128, causal=True, left=100, tuning=tuning)
    _case(FP, 2, 300, 517, 2, 2, 128, 128, tuning=tuning)
    _case(BF, 2, 300, 517, 2, 2, 96, 96, causal=True, tuning=tuning)
    _case(BF, 2, 700, 900, 4, 2, 128, 128, causal=True, expect_dq_t=True, tuning=tuning)


def test_split_tail(monkeypatch):
    # the last round's tiles as pieces of consecutive query tiles (bwd_kernel `split_tail`, the
    # 128-query D64 variant) on a grid capped at 5 CTAs: 2 pieces of the first call's last 2
    # tiles (3 would need a second round); the partial dK / dV of every piece summed by the last
    from torch_fa4.kernels.sm90 import bwd, bwd_variant

    tuning = bwd.BwdTuning(persistent_ctas=5)
    plans = []
    plan = bwd_variant.split_plan
    monkeypatch.setattr(bwd_variant, "split_plan", lambda *a: plans.append(plan(*a)) or plans[-1])
    _case(BF, 2, 700, 900, 4, 2, 64, 64, expect_tile_m=128, tuning=tuning)  # 32 tiles, 12 steps each (GQA 2)
    assert plans[-1] == (2, 2)
    _case(BF, 2, 200, 900, 4, 2, 64, 64, expect_tile_m=128, tuning=tuning)  # 2 query tiles per head
    assert plans[-1] == (0, 1)
    planned = len(plans)
    _case(FP, 2, 700, 900, 4, 2, 128, 128, strided=True, tuning=tuning)  # 64 queries per step
    _case(BF, 1, 700, 1000, 2, 2, 96, 96, tuning=tuning)
    assert len(plans) == planned  # (the split code costs D128 its gain: not taken)


def test_persistent_many_tiles_at_full_grid():
    # more work tiles (8 key tiles x 64 pairs) than multiprocessors: each CTA takes several from
    # the counter
    _case(BF, 4, 1024, 1024, 16, 16, 64, 64, causal=True, expect_tile_m=128)
    _case(BF, 2, 1024, 1024, 32, 16, 128, 128)


def test_tm128_ring_barriers():
    # separate ring barriers for Q + LSE and dO + dPsum without a right limit, one barrier for the
    # whole stage under causal / right-window limits
    _case(BF, 2, 300, 517, 4, 2, 64, 64, causal=True, expect_tile_m=128)
    _case(BF, 2, 517, 300, 2, 2, 64, 64, expect_tile_m=128)
    _case(BF, 3, 300, 517, 4, 2, 64, 64, seqused=True, expect_tile_m=128)
    _case(BF, 2, 300, 517, 2, 2, 64, 64, softcap=8.0, causal=True, expect_tile_m=128)
    _case(BF, 2, 300, 517, 4, 2, 64, 64, causal=True, deterministic=True, expect_tile_m=128)
    _case(BF, 2, 300, 517, 4, 2, 64, 64, left=200, right=30, expect_tile_m=128)


def test_tm128_fused_dq():
    # the D64 persistent variant writes dq itself up to 4096 queries: dense causal, plain (split
    # tail on a grid of 5 CTAs: 12 work tiles, a last round of 2), windowed and GQA walks
    from torch_fa4.kernels.sm90 import bwd

    _case(BF, 2, 300, 517, 4, 2, 64, 64, causal=True, expect_tile_m=128)
    _case(BF, 2, 2048, 300, 2, 2, 64, 64, expect_tile_m=128, tuning=bwd.BwdTuning(persistent_ctas=5))
    _case(BF, 2, 300, 300, 6, 2, 64, 64, left=100, right=0, expect_tile_m=128)


def test_long_d64_call_takes_the_conversion_pass():
    # past bwd_variant.FUSED_DQ_MAX_SEQLEN_Q queries the conversion pass
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90 import bwd, bwd_variant

    sq = bwd_variant.FUSED_DQ_MAX_SEQLEN_Q + 100
    q = torch.empty(1, sq, 2, 64, device="cuda", dtype=BF)
    assert not bwd.variant_key(AttentionCall(q=q, k=q, v=q, scale=0.125, causal=True), False).fused_dq
    _case(BF, 1, sq, sq, 2, 1, 64, 64, causal=True, expect_tile_m=128)


# ---- dQ^T (bwd_kernel `dq_transposed`): D128 at 64 queries per step and D64 at 128 compute
# dQ^T = K^T dS^T and store it transposed

@pytest.mark.parametrize("d,tile_m", [(128, 64), (64, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,hq,hkv", [(300, 517, 6, 2), (517, 300, 2, 2), (1, 77, 2, 1), (333, 130, 4, 2)])
def test_dq_transposed(causal, sq, sk, hq, hkv, d, tile_m):
    _case(BF, 2, sq, sk, hq, hkv, d, d, causal=causal, expect_tile_m=tile_m, expect_dq_t=True)


def test_dq_transposed_features():
    _case(FP, 2, 300, 517, 4, 2, 128, 128, strided=True, expect_dq_t=True)
    _case(BF, 3, 300, 517, 4, 2, 128, 128, seqused=True, expect_dq_t=True)
    _case(BF, 2, 300, 517, 2, 2, 128, 128, softcap=8.0, causal=True, expect_dq_t=True)
    _case(BF, 2, 300, 517, 2, 2, 128, 128, left=100, right=20, expect_dq_t=True)
    _case(BF, 2, 300, 517, 4, 2, 128, 128, causal=True, deterministic=True, expect_dq_t=True)
    _case(BF, 3, 300, 517, 4, 2, 128, 128, varlen=True)
    _case(FP, 2, 517, 300, 2, 2, 64, 64, softcap=8.0, expect_tile_m=128, expect_dq_t=True)


# ---- 128 queries per step at D64 (P in fp32 while dP^T lands, dS after it, dV after the dS^T
# stores)

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(300, 517), (517, 300), (256, 384), (1, 77), (130, 130)])
def test_tm128_d64(causal, sq, sk):
    _case(BF, 2, sq, sk, 2, 2, 64, 64, causal=causal, expect_tile_m=128)


@pytest.mark.parametrize("hq,hkv,causal", [(4, 2, True), (6, 1, False), (8, 1, True)])
def test_tm128_gqa(hq, hkv, causal):
    _case(BF, 2, 300, 517, hq, hkv, 64, 64, causal=causal, expect_tile_m=128)


def test_tm128_fp16_strided():
    _case(FP, 2, 300, 517, 4, 2, 64, 64, strided=True, expect_tile_m=128)


@pytest.mark.parametrize("left,right,causal", [(60, 20, False), (100, -1, True), (-1, 40, False)])
def test_tm128_window(left, right, causal):
    _case(BF, 2, 300, 517, 4, 2, 64, 64, causal=causal, left=left, right=right, expect_tile_m=128)


def test_tm128_softcap_seqused():
    _case(BF, 2, 300, 517, 2, 2, 64, 64, softcap=8.0, causal=True, expect_tile_m=128)
    _case(BF, 3, 300, 517, 4, 2, 64, 64, seqused=True, expect_tile_m=128)


def test_tm128_deterministic():
    _case(BF, 2, 300, 517, 4, 2, 64, 64, causal=True, deterministic=True, expect_tile_m=128)
    _case(BF, 1, 517, 300, 2, 2, 64, 64, left=90, right=10, deterministic=True, expect_tile_m=128)


def test_tm128_varlen():
    _case(BF, 3, 300, 517, 4, 2, 64, 64, varlen=True, causal=True, expect_tile_m=128)


@pytest.mark.parametrize("make_mods,causal", [(_alibi, True), (_tanh_bias_documents, False)])
def test_tm128_mods(make_mods, causal):
    slopes = torch.rand(4, device="cuda")
    doc = torch.sort(torch.randint(0, 4, (517,), device="cuda")).values.to(torch.int32)
    score_mod, mask_mod = make_mods(slopes, doc)
    _case(BF, 2, 300, 517, 4, 2, 64, 64, causal=causal, score_mod=score_mod, mask_mod=mask_mod,
          expect_tile_m=128)


@pytest.mark.parametrize("block,expect,tile_m", [
    ((128, 128), (1, 1), 128), ((256, 128), (2, 1), 128),
    ((64, 128), (1, 1), 64),  # 64-row block-mask tiles: the 64-query variant walks them
])
def test_tm128_block_sparse(block, expect, tile_m):
    doc = _doc_ids(517)
    _, mask_mod = _documents(None, doc)
    _case(BF, 2, 300, 517, 4, 2, 64, 64, causal=True, mask_mod=mask_mod, block_size=block,
          expect_sparse=expect, expect_tile_m=tile_m)


# ---- the dQ TMA adds from the dedicated writer warp (128 keys per CTA) or the consumer leader
# warps (64 keys per CTA)

@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (96, True), (128, False), (128, True), (192, True)])
def test_dq_writer_warp(d, causal):
    _case(BF, 2, 300, 517, 2, 2, d, d, causal=causal, expect_dq_warp=d <= 128)
    _case(BF, 2, 1, 77, 2, 2, d, d, causal=causal, expect_dq_warp=d <= 128)  # one step per CTA


def test_dq_writer_warp_gqa_softcap():
    _case(BF, 2, 300, 517, 6, 2, 128, 128, causal=True, expect_dq_warp=True)
    _case(FP, 2, 333, 200, 8, 1, 64, 64, expect_dq_warp=True)
    _case(BF, 2, 200, 260, 2, 2, 128, 128, softcap=8.0, causal=True, expect_dq_warp=True)


def test_dq_writer_warp_empty_walks():
    # key tiles that no query sees (window; keys past seqused_k): the writer and the consumers
    # must both skip the slab hand-off
    _case(BF, 2, 300, 517, 2, 1, 128, 128, left=60, right=20, expect_dq_warp=True)
    _case(BF, 3, 150, 600, 2, 2, 128, 128, seqused=True, expect_dq_warp=True)


def test_dq_writer_warp_deterministic():
    _case(BF, 2, 256, 520, 4, 2, 128, 128, causal=True, deterministic=True, expect_dq_warp=True)
    _case(BF, 1, 517, 300, 2, 2, 64, 64, left=90, right=10, deterministic=True, expect_dq_warp=True)


def _bench():  # pragma: no cover - manual timing on the device machine
    import triton.testing

    from torch_fa4.kernels.sm90 import bwd

    rows = []
    for d, s, causal in ((128, 4096, False), (128, 4096, True), (64, 4096, False), (192, 4096, True),
                         (256, 4096, False), (256, 4096, True)):
        b, h = 16384 // s, 2048 // d
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out = torch.randn_like(q)
        lse = torch.randn(b, h, s, device="cuda", dtype=torch.float32) + 5
        call = AttentionCall(q=q, k=k, v=v, scale=d**-0.5, causal=causal)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ms = triton.testing.do_bench(lambda: bwd.backward(call, do, out, lse, dq, dk, dv, False), return_mode="median")
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        rows.append(f"D{d} S{s} causal={causal}: {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s")
        try:
            from flash_attn.cute.interface import _flash_attn_bwd  # noqa: F401
            import flash_attn.cute as fa

            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            o = fa.flash_attn_func(qq, kk, vv, causal=causal)
            o = o[0] if isinstance(o, tuple) else o
            ms_fa = triton.testing.do_bench(lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True), return_mode="median")
            rows.append(f"   flash-attn-4 fwd-graph bwd: {ms_fa:.3f} ms  {flops / ms_fa / 1e9:.0f} TFLOP/s")
        except Exception as e:  # the peer is optional
            rows.append(f"   flash-attn-4 unavailable: {type(e).__name__}: {e}"[:200])
    rows += _bench_block_sparse()
    print("\n".join(rows))


def _bench_block_sparse():  # pragma: no cover - manual timing
    """Document mask (8 documents, D128, S 8k): block-mask walk vs mask_mod on every tile."""
    import triton.testing

    from torch_fa4.kernels.sm90 import bwd
    from torch_fa4.mods import create_block_mask
    from torch_fa4.mods.library import document_mask
    from torch_fa4.mods.prepare import prepare
    from torch_fa4.mods.registry import lookup

    b, s, h, d = 2, 8192, 16, 128
    doc = (torch.arange(s, device="cuda") // (s // 8)).to(torch.int32)
    mask_mod = document_mask(doc)
    key, aux = prepare(None, mask_mod)
    bm = create_block_mask(mask_mod, None, None, s, s, device="cuda")
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out = torch.randn_like(q)
    lse = torch.randn(b, h, s, device="cuda", dtype=torch.float32) + 5
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    rows = []
    for name, extra in (("mask_mod everywhere", {}), ("block-sparse walk", dict(
            block_mask=tuple(bm.as_tensors()), block_mask_q=128, block_mask_kv=128))):
        call = AttentionCall(q=q, k=k, v=v, scale=d**-0.5, mod_key=key, mods=lookup(key), aux_tensors=aux, **extra)
        ms = triton.testing.do_bench(lambda: bwd.backward(call, do, out, lse, dq, dk, dv, False), return_mode="median")
        rows.append(f"D{d} S{s} 8 documents, {name}: {ms:.3f} ms")
    return rows


if __name__ == "__main__":
    _bench()


_DISK_CACHE_SCRIPT = r"""
import sys, torch
sys.path.append(sys.argv[2])  # tests/
from naive import naive_attention
from torch_fa4.call import AttentionCall
from torch_fa4.kernels import compile_cache
from torch_fa4.kernels.sm90 import bwd
torch.manual_seed(int(sys.argv[1]))
B, S, H, D = 2, 300, 4, 128
q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
out64, lse = naive_attention(q64, k64, v64, scale=D ** -0.5, causal=True, differentiable=True)
refs = torch.autograd.grad(out64, (q64, k64, v64), do.double())
call = AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, causal=True)
grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
bwd.backward(call, do, out64.detach().to(q.dtype), lse.detach().float(), *grads, False)
torch.cuda.synchronize()
# each gradient's largest error relative to its largest value (NaN anywhere: inf)
worst = max(float((g.double() - r).abs().max() / r.abs().max()) if not g.isnan().any() else float("inf")
            for g, r in zip(grads, refs))
print("RESULT", worst, compile_cache.stats()["from_disk"], "cutlass" in sys.modules)
"""


def test_disk_cache_across_processes(tmp_path):
    """The disk cache (on by default) with the backward's three kernels (row statistics with the
    dQ buffer's zeros, the main kernel, the dq conversion: D128): a second process loads them,
    never imports CuTe DSL, and its dq, dk, dv on fresh inputs match float64 autograd as the first
    process's do."""
    import os

    from _fresh_process import result_fields

    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TORCH_FA4_CACHE_DIR=str(tmp_path))
    env.pop("TORCH_FA4_KERNEL_CACHE", None)
    results = []
    for seed in torch.randint(0, 2**31, (2,)).tolist():
        worst, from_disk, dsl = result_fields(_DISK_CACHE_SCRIPT, env, str(seed), tests_dir)
        results.append((float(worst), int(from_disk), dsl == "True"))
    assert results[0][1:] == (0, True), results
    assert results[1][1:] == (3, False), results
    for worst, _, _ in results:
        assert worst < 2e-2, results  # bf16 rounding is ~4e-3 of the largest value; a wrong kernel is O(1)
