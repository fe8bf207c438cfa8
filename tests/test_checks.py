"""Bad input gets a clear error that names the argument and the rule."""

import pytest
import torch

import torch_fa4


def qkv(B=1, S=8, H=2, D=64, Hkv=None, dtype=torch.float32):
    Hkv = Hkv or H
    return torch.randn(B, S, H, D, dtype=dtype), torch.randn(B, S, Hkv, D, dtype=dtype), torch.randn(B, S, Hkv, D, dtype=dtype)


def test_dtype_errors():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q has dtype torch.int64"):
        torch_fa4.attention(q.long(), k, v)
    with pytest.raises(TypeError, match="share one dtype"):
        torch_fa4.attention(q, k.double(), v)


def test_rank_and_layout_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must be 4-D \(B, S, H, D\)"):
        torch_fa4.attention(q[0], k, v)
    with pytest.raises(ValueError, match="k must be 3-D"):
        torch_fa4.attention(q[0], k, v, cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32),
                            cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="last dimension .* must be contiguous"):
        torch_fa4.attention(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v)


def test_head_dim_and_head_count_errors():
    q, k, v = qkv(D=72)
    torch_fa4.attention(q, k, v)  # a multiple of 8 up to 256 is fine
    q, k, v = qkv(D=36)
    with pytest.raises(ValueError, match="head dim of q/k is 36"):
        torch_fa4.attention(q, k, v)
    q, k, v = qkv(D=264)
    with pytest.raises(ValueError, match="up to 256"):
        torch_fa4.attention(q, k, v)
    q, k, v = qkv(H=6, Hkv=4)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of the number of KV heads \(4\)"):
        torch_fa4.attention(q, k, v)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="same head dim"):
        torch_fa4.attention(q, k[..., :32], v)


def test_varlen_errors():
    q, k, v = (torch.randn(10, 2, 64) for _ in range(3))
    with pytest.raises(TypeError, match="cu_seqlens_q must be a 1-D int32"):
        torch_fa4.attention(q, k, v, cu_seqlens_q=torch.tensor([0, 10]), cu_seqlens_k=torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k must have 3 entries"):
        torch_fa4.attention(q, k, v, cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
                            cu_seqlens_k=torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] is 9 but the tensor holds 10"):
        torch_fa4.attention(q, k, v, cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32),
                            cu_seqlens_k=torch.tensor([0, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="never decrease"):
        torch_fa4.attention(q, k, v, cu_seqlens_q=torch.tensor([0, 6, 4, 10], dtype=torch.int32),
                            cu_seqlens_k=torch.tensor([0, 4, 5, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k needs cu_seqlens_q"):
        torch_fa4.attention(q[None], k, v, cu_seqlens_k=torch.tensor([0, 10], dtype=torch.int32))
    q4, k4, v4 = qkv(B=2)
    with pytest.raises(ValueError, match="seqused_k entries"):
        torch_fa4.attention(q4, k4, v4, seqused_k=torch.tensor([3, 9], dtype=torch.int32))


def test_varlen_values_are_read_once_per_unmodified_tensor(monkeypatch):
    """The offsets' values are read (a device sync on the GPU) once per live, unmodified set of
    tensors: the second call with the same cu_seqlens reads nothing, an in-place change or a new
    tensor is read again, and a bad value is still caught."""
    from torch_fa4 import checks

    reads = []
    real = checks._check_varlen_values
    monkeypatch.setattr(checks, "_check_varlen_values", lambda *a: reads.append(1) or real(*a))
    q, k, v = (torch.randn(10, 2, 64) for _ in range(3))
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 10], dtype=torch.int32)
    torch_fa4.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch_fa4.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert len(reads) == 1
    cu_q[1] = 6  # in place: read again (and valid)
    torch_fa4.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert len(reads) == 2
    cu_k[1] = 11  # in place and now decreasing: caught
    with pytest.raises(ValueError, match="never decrease"):
        torch_fa4.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    fresh = torch.tensor([0, 4, 10], dtype=torch.int32)  # equal values, another tensor: read
    torch_fa4.attention(q, k, v, cu_seqlens_q=fresh, cu_seqlens_k=torch.tensor([0, 5, 10], dtype=torch.int32))
    assert len(reads) == 4


def test_scalar_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="softcap must be"):
        torch_fa4.attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="window_size left"):
        torch_fa4.attention(q, k, v, window_size=(-3, 2))
    with pytest.raises(ValueError, match="scale must be a finite"):
        torch_fa4.attention(q, k, v, scale=float("nan"))


def test_device_mismatch_error():
    q, k, v = qkv()
    meta = torch.empty_like(k, device="meta")
    with pytest.raises(ValueError, match="one device"):
        torch_fa4.attention(q, meta, v)


def test_max_seqlen_smaller_than_the_longest_sequence_is_refused():
    q = torch.randn(12, 2, 32)
    cu = torch.tensor([0, 3, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q is 8 but the longest sequence in cu_seqlens_q has 9"):
        torch_fa4.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=9)
    with pytest.raises(ValueError, match="max_seqlen_k is 3 but the longest sequence in cu_seqlens_k has 9"):
        torch_fa4.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9, max_seqlen_k=3)
    out = torch_fa4.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9, max_seqlen_k=20)
    assert torch.equal(out, torch_fa4.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu))
