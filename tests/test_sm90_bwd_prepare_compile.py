"""CPU: the fused row-statistics kernel of the sm90 backward (kernels/sm90/bwd_prepare.py).

Compiles for sm_90a for every Dv and dtype (a few seconds each) and checks in the SASS that each
thread reads its share of dO and O as 16-byte vectors (a silent fall back to narrow loads would
multiply the load instructions), reduces a row over 4 lanes with two shuffles and spills nothing.
The host wrapper (varlen as one batch, size-1 strides, padding rows, buffer shapes) runs here
around a float64 emulation of the compiled kernel's contract; the GPU tests run the real thing.
"""

import math

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from sass import sass_of  # noqa: E402

DVS = (64, 96, 128, 192, 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dv", DVS)
def test_kernel_compiles_to_vector_loads(dv, dtype, tmp_path):
    from torch_fa4.kernels.sm90 import bwd_prepare

    bwd_prepare.compile_kernel(dtype, dv, dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    per_thread = dv // (bwd_prepare.VEC * bwd_prepare.THREADS_PER_ROW)
    assert sass.count("LDG.E.128") == 2 * per_thread, "dO/O are not read as 16-byte vectors"
    assert sass.count("LDG.E ") == 1  # the row's lse, one float
    assert sass.count("SHFL.BFLY") == 2
    assert sass.count("STG.E ") == 4  # (lse2, dpsum) for sequence rows and for padding rows
    assert "LDL" not in sass and "STL" not in sass
    # products summed in fp32: one FFMA per element of the thread's quarter of the row
    assert sass.count("FFMA ") == dv // bwd_prepare.THREADS_PER_ROW


def test_varlen_and_dense_share_one_compiled_kernel(monkeypatch):
    from torch_fa4.kernels.sm90 import bwd_prepare

    fn = bwd_prepare.compile_kernel(torch.bfloat16, 64)
    assert bwd_prepare.compile_kernel(torch.bfloat16, 64) is fn  # cached: no second compile
    keys = []
    monkeypatch.setattr(bwd_prepare, "compile_kernel", lambda dtype, dv, d_zero=0: keys.append((dtype, dv)) or _emulated)
    for lead, lse_shape in (((2, 10), (2, 3, 10)), ((17,), (3, 17))):
        dout = torch.randn(*lead, 3, 64).to(torch.bfloat16)
        bwd_prepare.row_statistics(dout, dout.clone(), torch.randn(lse_shape), 64)
    assert keys == [(torch.bfloat16, 64)] * 2


def _emulated(dout, out, lse, lse2, dpsum, dq_acc=None):
    """The compiled kernel's contract in float64 torch, checking the arguments it would be given
    against the compiled signature (4-d dO/O with 16-byte strides, 3-d lse and outputs, the dQ
    buffer to zero: 4-d rows of dO's (B, S, H))."""
    if dq_acc is not None:
        assert dq_acc.dim() == 4 and dq_acc.shape[:3] == dout.shape[:3] and dq_acc.is_contiguous()
        dq_acc.zero_()
    assert dout.dim() == out.dim() == 4 and lse.dim() == lse2.dim() == dpsum.dim() == 3
    for t in (dout, out):
        assert t.stride(-1) == 1 and all(st % 8 == 0 for st in t.stride()[:-1]), t.stride()
    b, s, h, _ = dout.shape
    assert lse.shape == (b, h, s) and lse2.shape == dpsum.shape and lse2.shape[:2] == (b, h)
    x = lse.double()
    lse2[..., :s] = torch.where(x == -math.inf, math.inf, x * math.log2(math.e))
    dpsum[..., :s] = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    lse2[..., s:] = math.inf
    dpsum[..., s:] = 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dv,d", [(128, 128), (64, 192), (256, 64)])
def test_kernel_zeroing_the_dq_buffer_adds_only_vector_stores(dv, d, dtype, tmp_path):
    from torch_fa4.kernels.sm90 import bwd_prepare

    bwd_prepare.compile_kernel(dtype, dv, dump_dir=str(tmp_path), d_zero=d)
    sass = sass_of(tmp_path)
    per_thread = d // (bwd_prepare.ZERO_VEC * bwd_prepare.THREADS_PER_ROW)
    assert sass.count("STG.E.128") == per_thread, "the dQ row is not zeroed in 16-byte stores"
    assert sass.count("LDG.E.128") == 2 * dv // (bwd_prepare.VEC * bwd_prepare.THREADS_PER_ROW)
    assert sass.count("STG.E ") == 4 and "LDL" not in sass and "STL" not in sass


def test_backward_host_zeroes_the_dq_buffer_in_either_path(monkeypatch):
    """bwd_row_stats.row_statistics zeroes the dQ buffer it is handed: inside the fused pass on CUDA, by
    torch on the CPU path (here)."""
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90 import bwd_row_stats

    dout = torch.randn(2, 70, 3, 64).to(torch.bfloat16)
    call = AttentionCall(q=dout, k=dout, v=dout, scale=1.0)
    dq_acc = torch.full((2, 70, 3, 64), math.nan)
    bwd_row_stats.row_statistics(call, dout, dout.clone(), torch.randn(2, 3, 70), zero_dq=dq_acc)
    assert (dq_acc == 0).all()
    # what the fused pass would be handed: dense fp32 rows matching dO, D a multiple of 16
    from torch_fa4.kernels.sm90 import bwd_prepare

    assert bwd_prepare.dq_zeroing_takes(dq_acc, dout)
    assert not bwd_prepare.dq_zeroing_takes(dq_acc.transpose(1, 2), dout)
    assert not bwd_prepare.dq_zeroing_takes(dq_acc[..., :40], dout)
    assert not bwd_prepare.dq_zeroing_takes(dq_acc[:, :69], dout)


@pytest.mark.parametrize("varlen", [False, True])
def test_host_wrapper_fills_the_padded_layout(varlen, monkeypatch):
    from torch_fa4.kernels.sm90 import bwd_prepare

    monkeypatch.setattr(bwd_prepare, "compile_kernel", lambda dtype, dv, d_zero=0: _emulated)
    h, dv = 3, 96
    if varlen:  # a (T, H, Dv) slice of a wider buffer: non-contiguous rows
        dout = torch.randn(37, h, dv + 8).to(torch.float16)[..., :dv]
        out = torch.randn(37, h, dv).to(torch.float16)
        lse = torch.randn(h, 37)
        rows = (math.ceil(37 / 64) + 1) * 64
    else:  # batch of one with a size-1 dim whose stride is not a multiple of 8
        dout = torch.randn(1, 50, h, dv).to(torch.float16).as_strided((1, 50, h, dv), (3, h * dv, dv, 1))
        out = torch.randn(1, 50, h, dv).to(torch.float16)
        lse = torch.randn(1, h, 50)
        rows = 128
    lse[..., 1, 4] = -math.inf
    lse2, dpsum = bwd_prepare.row_statistics(dout, out, lse, rows)
    assert lse2.shape == dpsum.shape == (*lse.shape[:-1], rows)
    assert lse2.is_contiguous() and dpsum.is_contiguous() and lse2.dtype == dpsum.dtype == torch.float32
    s = lse.shape[-1]
    ref = (dout.double() * out.double()).sum(-1)
    ref = ref.transpose(0, 1) if varlen else ref.transpose(1, 2)
    torch.testing.assert_close(dpsum[..., :s].double(), ref, rtol=1e-6, atol=1e-6)
    assert (dpsum[..., s:] == 0).all() and (lse2[..., s:] == math.inf).all()
    assert lse2[..., 1, 4] == math.inf
    finite = torch.isfinite(lse)
    torch.testing.assert_close(lse2[..., :s][finite].double(), lse[finite].double() * math.log2(math.e))


def test_fused_path_refuses_what_it_cannot_read():
    from torch_fa4.kernels.sm90 import bwd_prepare

    t = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)
    lse = torch.zeros(2, 4, 16)
    # CPU tensors: the torch path runs (bwd_row_stats.row_statistics' CPU tests cover it)
    assert "CUDA" in bwd_prepare.unsupported_reason(t(2, 16, 4, 64), t(2, 16, 4, 64), lse)
    # the layout checks themselves need no device
    assert bwd_prepare._vector_ready(t(2, 16, 4, 64))
    assert bwd_prepare._vector_ready(t(2, 4, 16, 64).transpose(1, 2))  # (B, H, S, D) views
    assert not bwd_prepare._vector_ready(t(2, 16, 4, 68)[..., 2:66])  # 4-byte aligned base
    assert not bwd_prepare._vector_ready(t(1, 1, 1, 1).expand(2, 16, 4, 64))  # autograd's expanded grads
    assert not bwd_prepare._vector_ready(t(2, 16, 4, 128)[..., ::2])
    v = bwd_prepare._packed_size_one_strides(t(1, 16, 1, 64).as_strided((1, 16, 1, 64), (3, 64, 5, 1)))
    assert v.stride() == (1024, 64, 64, 1)
