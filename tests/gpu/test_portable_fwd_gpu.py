"""The portable (warp-MMA) forward against float64 attention on fresh random inputs, on any CUDA GPU.

Every call goes through torch_fa4.attention / flex_attention with TORCH_FA4_BACKEND=portable, so
dispatch routes it to torch_fa4.kernels.portable; a wrapper around the kernel's host entry poisons
out / lse with NaN before the launch and records the variant, so each test also proves the portable
kernel (not the reference) ran. The bound is twice the error of eager attention in the input dtype
(both against tests/naive.py in float64); the LSE within 2e-3; rows with no visible key exactly
zero with LSE -inf.
"""

import pytest
import torch

from gpu_harness import (HAS_CUDA, causal_documents_call, check_mods_against_naive, compare_to_float64,
                         default_variant, gpu_marks, poison_forward)
from gpu_harness import public as _public, random_qkv as _qkv
from naive import naive_attention, naive_varlen

pytestmark = gpu_marks(HAS_CUDA, "needs a CUDA device")


@pytest.fixture
def portable(monkeypatch):
    """TORCH_FA4_BACKEND=portable; returns the list of variants the portable forward ran."""
    from torch_fa4.kernels.portable import fwd_host

    monkeypatch.setenv("TORCH_FA4_BACKEND", "portable")
    return poison_forward(monkeypatch, fwd_host, default_variant(fwd_host))


def _compare(out, lse, ref_out, ref_lse, eager_out):
    compare_to_float64(out, lse, ref_out, ref_lse, eager_out, empty_lse_exact=True)


def _dense(portable, B, Sq, Sk, H, Hkv, D, dtype=torch.bfloat16, causal=False, window=(-1, -1), softcap=0.0):
    import torch_fa4

    q, k, v = _qkv(B, Sq, Sk, H, Hkv, D, dtype)
    wl, wr = window
    out, lse = _public(torch_fa4.attention, q, k, v, causal=causal, softcap=softcap,
                       window_size=(None if wl < 0 else wl, None if wr < 0 else wr), return_lse=True)
    assert len(portable) == 1, "the portable forward did not run"
    kw = dict(scale=D ** -0.5, causal=causal, window=window, softcap=softcap)
    ref_out, ref_lse = naive_varlen(q, k, v, **kw)
    eager, _ = naive_varlen(q, k, v, **kw, differentiable=True)
    _compare(out, lse, ref_out, ref_lse, eager)
    if out.numel():
        # rows with nothing visible are exactly zero
        empty = (~torch.isfinite(ref_lse.cpu())).transpose(1, 2)
        assert (out.cpu()[empty] == 0).all()
    return portable[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 96, 128, 192, 256])
def test_head_dims(portable, dtype, D):
    _dense(portable, 2, 300, 300, 4, 4, D, dtype)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Sq,Sk", [(333, 333), (100, 700), (700, 100), (1, 513), (257, 1)])
def test_causal_bottom_right(portable, D, Sq, Sk):
    _dense(portable, 2, Sq, Sk, 3, 3, D, causal=True)


@pytest.mark.parametrize("S", [63, 64, 65, 127, 128, 129])
def test_tile_edges(portable, S):
    cfg = _dense(portable, 1, S, S, 2, 2, 128, causal=S % 2 == 1)
    assert cfg.tile_n == 64 and cfg.tile_m == 128


@pytest.mark.parametrize("H,Hkv", [(8, 2), (6, 1), (1, 1)])
def test_gqa_mqa(portable, H, Hkv):
    _dense(portable, 2, 257, 300, H, Hkv, 128, causal=True)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("window", [(64, 0), (100, 37), (-1, 50), (0, 0)])
def test_window(portable, D, window):
    _dense(portable, 2, 400, 450, 4, 2, D, window=window)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_softcap(portable, D):
    _dense(portable, 2, 300, 280, 4, 4, D, causal=True, softcap=15.0)


def test_long_rows_grow_the_max(portable):
    """Scores that grow along the keys move the running max (the conditional O rescale)."""
    import torch_fa4

    B, S, H, D = 1, 2048, 2, 64
    q, k, v = _qkv(B, S, S, H, H, D)
    k = k + torch.linspace(0, 6, S, device="cuda")[None, :, None, None].to(k.dtype)
    out, lse = _public(torch_fa4.attention, q, k, v, return_lse=True)
    ref_out, ref_lse = naive_attention(q, k, v, scale=D ** -0.5)
    eager, _ = naive_attention(q, k, v, scale=D ** -0.5, differentiable=True)
    _compare(out, lse, ref_out, ref_lse, eager)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_varlen(portable, causal, D):
    import torch_fa4

    lens_q = [0, 1, 130, 67, 300]
    lens_k = [5, 0, 129, 200, 300]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    H, Hkv = 4, 2
    q = torch.randn(sum(lens_q), H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = _public(torch_fa4.attention, q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                       max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), return_lse=True)
    assert len(portable) == 1 and portable[0].varlen_q
    kw = dict(cu_seqlens_q=cu_q.cpu(), cu_seqlens_k=cu_k.cpu(), scale=D ** -0.5, causal=causal)
    ref_out, ref_lse = naive_varlen(q, k, v, **kw)
    eager, _ = naive_varlen(q, k, v, **kw, differentiable=True)
    _compare(out, lse, ref_out, ref_lse, eager)


@pytest.mark.parametrize("varlen", [False, True])
def test_seqused_k(portable, varlen):
    import torch_fa4

    D, H = 128, 4
    used = torch.tensor([0, 1, 77, 200], dtype=torch.int32, device="cuda")
    if varlen:
        lens_q, lens_k = [10, 64, 100, 129], [50, 64, 100, 256]
        cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = torch.randn(sum(lens_q), H, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(sum(lens_k), H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        used = torch.minimum(used, torch.tensor(lens_k, dtype=torch.int32, device="cuda"))
        extra = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
        ref_extra = dict(cu_seqlens_q=cu_q.cpu(), cu_seqlens_k=cu_k.cpu())
    else:
        q, k, v = _qkv(4, 150, 256, H, H, D)
        extra, ref_extra = {}, {}
    out, lse = _public(torch_fa4.attention, q, k, v, seqused_k=used, return_lse=True, **extra)
    assert len(portable) == 1 and portable[0].has_seqused_k
    kw = dict(seqused_k=used.cpu(), scale=D ** -0.5, **ref_extra)
    ref_out, ref_lse = naive_varlen(q, k, v, **kw)
    eager, _ = naive_varlen(q, k, v, **kw, differentiable=True)
    _compare(out, lse, ref_out, ref_lse, eager)


def test_strided_views(portable):
    """q, k, v as views into one packed (B, S, 3, H, D) tensor: non-contiguous rows."""
    import torch_fa4

    B, S, H, D = 2, 200, 4, 64
    qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    out, lse = _public(torch_fa4.attention, q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = naive_attention(q, k, v, scale=D ** -0.5, causal=True)
    eager, _ = naive_attention(q, k, v, scale=D ** -0.5, causal=True, differentiable=True)
    _compare(out, lse, ref_out, ref_lse, eager)


# ---- score_mod / mask_mod / block sparsity -------------------------------------------------------------

def _check_mods(out, lse, q, k, v, mods_gpu, mods_cpu, **kw):
    check_mods_against_naive(out, lse, q, k, v, mods_gpu, mods_cpu, empty_lse_exact=True, **kw)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_alibi_score_mod(portable, D, causal):
    import torch_fa4
    from torch_fa4 import mods as M

    B, S, H = 2, 333, 4
    q, k, v = _qkv(B, S, S, H, H, D)
    slopes = M.alibi_slopes(H).cuda()
    out, lse = _public(torch_fa4.attention, q, k, v, causal=causal, score_mod=M.alibi(slopes),
                       return_lse=True)
    assert len(portable) == 1 and portable[0].mod_key
    _check_mods(out, lse, q, k, v, (M.alibi(slopes), None), (M.alibi(slopes.cpu()), None),
                scale=D ** -0.5, causal=causal)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("block_mask", [False, True])
def test_document_mask(portable, D, block_mask):
    out, lse, q, k, v, mask, cpu_mask = causal_documents_call(D, block_mask)
    assert len(portable) == 1 and portable[0].block_sparse == block_mask
    _check_mods(out, lse, q, k, v, (None, mask), (None, cpu_mask), scale=D ** -0.5)


def test_dispatch_reaches_the_portable_kernel(portable):
    """BACKEND=portable routes a plain call (no warnings) to the portable forward on this GPU."""
    from torch_fa4 import dispatch
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels import portable as pkg

    q, k, v = _qkv(1, 64, 64, 2, 2, 64)
    call = AttentionCall(q=q, k=k, v=v, scale=0.125)
    assert dispatch.kernel_for(call, "forward") is pkg


@pytest.mark.parametrize("H,Hkv", [(8, 1), (32, 8), (4, 4)])
def test_decode_one_query_row(portable, H, Hkv):
    """One query row (decode; GQA packs a KV head's query heads as rows of one tile)."""
    _dense(portable, 3, 1, 1000, H, Hkv, 128, causal=True)


def _tile_rows():
    from torch_fa4.kernels.portable import tiles

    rows = {(D, tuple(row)) for arch in tiles.TABLES for D, row in tiles.table_of(arch).items()}
    return sorted(rows)


@pytest.mark.parametrize("D,row", _tile_rows(), ids=lambda x: str(x))
def test_every_architectures_tile_rows(D, row):
    """The tile rows of the other architectures (sm_86 / sm_89 / sm_120's 99 KB table), run here
    through the kernel's host entry with the row as overrides: causal, GQA, ragged lengths."""
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.portable import fwd_host, tiles

    overrides = dict(zip(tiles.TileRow._fields, row))
    q, k, v = _qkv(2, 333, 400, 4, 2, D)
    call = AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, causal=True)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(call.lse_shape(), float("nan"), dtype=torch.float32, device="cuda")
    fwd_host.forward(call, out, lse, **overrides)
    torch.cuda.synchronize()
    kw = dict(scale=D ** -0.5, causal=True)
    ref_out, ref_lse = naive_attention(q, k, v, **kw)
    eager, _ = naive_attention(q, k, v, **kw, differentiable=True)
    _compare(out, lse, ref_out, ref_lse, eager)
