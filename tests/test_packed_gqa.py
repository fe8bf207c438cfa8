"""CPU: packed GQA (kernels/host/packed_gqa.py) is the same attention, on views of the same memory."""

import pytest
import torch

from torch_fa4 import reference
from torch_fa4.call import AttentionCall
from torch_fa4.kernels.host import packed_gqa


def _call(B=3, Sk=300, Hq=8, Hkv=2, D=64, **kw):
    q = torch.randn(B, 1, Hq, D, dtype=torch.float64)
    k, v = (torch.randn(B, Sk, Hkv, D, dtype=torch.float64) for _ in range(2))
    return AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, **kw)


@pytest.mark.parametrize("kw", [
    dict(), dict(causal=True, window_right=0), dict(softcap=5.0, Hkv=1),
    dict(causal=True, window_right=0, seqused_k=torch.tensor([300, 0, 7], dtype=torch.int32)),
])
def test_the_packed_call_computes_the_same_attention_in_place(kw):
    call = _call(**kw)
    assert packed_gqa.applies(call)
    want_out, want_lse = reference.forward(call)
    out, lse = torch.full_like(want_out, float("nan")), torch.full_like(want_lse, float("nan"))
    packed_out, packed_lse = packed_gqa.pack_results(out, lse, call.num_heads_kv)
    packed = packed_gqa.pack(call)
    assert packed.q.data_ptr() == call.q.data_ptr() and packed.num_heads == call.num_heads_kv
    assert packed_out.data_ptr() == out.data_ptr() and packed_lse.data_ptr() == lse.data_ptr()
    got_out, got_lse = reference.forward(packed)
    packed_out.copy_(got_out)
    packed_lse.copy_(got_lse)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


@pytest.mark.parametrize("kw, shape", [
    (dict(window_left=16), None), (dict(block_mask=(torch.zeros(1),)), None), (dict(Hkv=8), None),
    (dict(), (3, 2, 8, 64)),
])
def test_calls_that_cannot_be_packed(kw, shape):
    call = _call(**kw)
    if shape is not None:
        call = AttentionCall(q=torch.randn(shape), k=call.k, v=call.v, scale=1.0)
    assert not packed_gqa.applies(call)
