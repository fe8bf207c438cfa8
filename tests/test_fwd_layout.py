"""CPU: which q, k, v layouts the forward kernels' TMA loads take (`fwd_launch.layout_reason`),
and that a refusal names the tensor to blame."""

import pytest
import torch

from torch_fa4.call import AttentionCall
from torch_fa4.kernels.host import fwd_launch


def _reason(q, k, v, **kw):
    return fwd_launch.layout_reason(AttentionCall(q=q, k=k, v=v, scale=0.1, **kw))


def _qkv(b=2, s=64, h=4, d=64):
    return [torch.randn(b, s, h, d).bfloat16() for _ in range(3)]


def test_contiguous_and_sdpa_layouts_are_taken():
    assert _reason(*_qkv()) is None
    # the SDPA layout: (B, H, S, D) storage seen as (B, S, H, D), no copy
    q, k, v = (torch.randn(2, 4, 64, 64).bfloat16().transpose(1, 2) for _ in range(3))
    assert _reason(q, k, v) is None
    # GQA and a head-dim slice of a wider buffer (16-byte aligned strides and base)
    wide = torch.randn(2, 64, 2, 128).bfloat16()
    q, _, _ = _qkv()
    assert _reason(q, wide[..., :64], wide[..., 64:]) is None


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_refusals_name_the_tensor(which):
    index = "qkv".index(which)
    tensors = _qkv()
    t = tensors[index]
    # a head dim that is not the innermost dimension
    tensors[index] = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert _reason(*tensors) == f"{which} last dim not contiguous"
    # a base one element past a 16-byte boundary
    tensors = _qkv()
    flat = torch.randn(t.numel() + 1).bfloat16()
    tensors[index] = flat[1:].view(t.shape)
    assert _reason(*tensors) == f"{which} base or strides not 16-byte aligned (TMA)"
    # a row stride of 68 elements (136 bytes)
    tensors = _qkv()
    tensors[index] = torch.randn(2, 64, 4, 68).bfloat16()[..., :64]
    assert _reason(*tensors) == f"{which} base or strides not 16-byte aligned (TMA)"


def test_varlen_offsets_come_in_pairs():
    q, k, v = (torch.randn(64, 4, 64).bfloat16() for _ in range(3))
    cu = torch.tensor([0, 64], dtype=torch.int32)
    assert _reason(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu) is None
    assert _reason(q, k, v, cu_seqlens_q=cu) == "cu_seqlens_q and cu_seqlens_k must be given together"
