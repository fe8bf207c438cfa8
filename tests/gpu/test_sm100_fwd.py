"""sm100 forward kernel against float64 attention on fresh random inputs (needs a Blackwell GPU,
compute capability 10.0; skipped elsewhere).

The kernel is launched directly (kernels.sm100.fwd_host.forward, no self-check in between). Every
test draws new inputs, poisons out/lse with NaN before the launch, and requires the kernel's error
to be at most twice that of eager attention in the input dtype (both against float64). Covers
every feature the sm100 forward advertises: head dims 64-256 (two query tiles per CTA and one),
causal, window, softcap, GQA, varlen, seqused_k, score_mod, mask_mod, block masks of 128- and
256-row blocks, the exponent split and the packed softmax on and off, and degenerate lengths.
"""

import pytest
import torch

from _mod_call_fields import mod_call_fields
from gpu_harness import SM100_ONLY, check_against_float64, launch_poisoned
from torch_fa4 import mods as M
from torch_fa4.call import AttentionCall

pytestmark = SM100_ONLY


def _check(call: AttentionCall, score_mod=None, mask_mod=None, **overrides):
    from torch_fa4.kernels.sm100 import fwd_host

    assert fwd_host.unsupported_reason(call) is None, fwd_host.unsupported_reason(call)
    out, lse = launch_poisoned(fwd_host, call, **overrides)
    check_against_float64(call, out, lse, score_mod, mask_mod)


def _inputs(B, Sq, Sk, H, Hkv, D, dtype):
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype) for _ in range(2))
    return q, k, v


def _call(B=2, Sq=777, Sk=777, H=4, Hkv=2, D=128, dtype=torch.bfloat16, **kw):
    q, k, v = _inputs(B, Sq, Sk, H, Hkv, D, dtype)
    return AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, **kw)


def _mod_call(score_mod=None, mask_mod=None, block=None, B=2, S=640, H=4, Hkv=2, D=128, **kw):
    q, k, v = _inputs(B, S, S, H, Hkv, D, torch.bfloat16)
    return AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, **mod_call_fields(score_mod, mask_mod, block, S, S),
                         **kw)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 96, 128, 192, 256])
def test_dense(D, dtype, causal):
    _check(_call(D=D, dtype=dtype, causal=causal))


@pytest.mark.parametrize("Sq, Sk", [(1, 1), (1, 300), (300, 1), (127, 129), (255, 257), (257, 255),
                                    (129, 700)])
@pytest.mark.parametrize("D", [64, 256])
def test_degenerate_and_tile_edge_lengths(D, Sq, Sk):
    _check(_call(B=1, Sq=Sq, Sk=Sk, H=1, Hkv=1, D=D, causal=True))
    _check(_call(B=1, Sq=Sq, Sk=Sk, H=2, Hkv=1, D=D))


@pytest.mark.parametrize("D", [64, 128, 192, 256])
def test_window_softcap_gqa(D):
    _check(_call(D=D, H=8, Hkv=1, window_left=100, window_right=30))
    _check(_call(D=D, softcap=20.0, causal=True))


@pytest.mark.parametrize("D", [64, 128, 256])
def test_varlen_and_seqused(D):
    cu = torch.tensor([0, 1, 300, 813, 1000], dtype=torch.int32, device="cuda")
    q = torch.randn(1000, 4, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1000, 2, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    _check(AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                         max_seqlen_q=513, max_seqlen_k=513))
    _check(_call(D=D, seqused_k=torch.tensor([777, 40], dtype=torch.int32, device="cuda")))


@pytest.mark.parametrize("overrides", [dict(packed_f32x2=False), dict(exp2_emulate_every=0),
                                       dict(exp2_emulate_every=3, rescale_threshold=None)])
def test_softmax_options(overrides):
    _check(_call(D=64, Sq=1500, Sk=1500), **overrides)
    _check(_call(D=128, causal=True), **overrides)


@pytest.mark.parametrize("D", [64, 128, 192, 256])
def test_score_mod(D):
    slopes = M.alibi_slopes(4, device="cuda")
    _check(_mod_call(score_mod=M.alibi(slopes), D=D, causal=True), score_mod=M.alibi(slopes))


@pytest.mark.parametrize("D", [64, 128, 256])
def test_mask_mod(D):
    doc = torch.randint(0, 4, (640,), device="cuda").sort().values
    _check(_mod_call(mask_mod=M.document_mask(doc), D=D), mask_mod=M.document_mask(doc))


def _doc_causal(S=640):
    doc = torch.randint(0, 4, (S,), device="cuda").sort().values
    return M.and_masks(M.document_mask(doc), M.causal_mask)


@pytest.mark.parametrize("block", [128, (256, 128), (128, 64), (512, 256)])
@pytest.mark.parametrize("D", [64, 128, 192])
def test_block_mask(D, block):
    mask = _doc_causal()
    _check(_mod_call(mask_mod=mask, block=block, D=D), mask_mod=mask)


def test_block_mask_without_captured_tensors_keeps_two_query_tiles():
    def stripes(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx % 4 != 3)

    slopes = M.alibi_slopes(4, device="cuda")
    call = _mod_call(score_mod=M.alibi(slopes), mask_mod=stripes, block=(256, 128))
    _check(call, score_mod=M.alibi(slopes), mask_mod=stripes)
