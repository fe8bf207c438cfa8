"""The two-CTA sm100 forward (kernels/sm100/pair: a cluster of two CTAs per matmul) against float64
attention on fresh random inputs (needs a Blackwell GPU, compute capability 10.0; skipped elsewhere).

The kernel is launched directly (kernels.sm100.pair.fwd_host.forward, no self-check in between),
with outputs poisoned by NaN and the checks of tests/gpu/test_sm100_fwd.py (at most twice
eager attention's in the input dtype). Covers what the pair advertises (D=256 with causal, window,
softcap, varlen, seqused_k; D=128 without masks; both dtypes; GQA) and the lengths where a pair's
second CTA holds few or no valid rows: the self-check runs the pair on such small problems too.
"""

import pytest
import torch

from torch_fa4.call import AttentionCall
from gpu_harness import SM100_ONLY, check_against_float64, launch_poisoned
from test_sm100_fwd import _call

pytestmark = SM100_ONLY


def _pair(call, advertised=True):
    from torch_fa4.kernels.sm100.pair import fwd_host

    if advertised:
        assert fwd_host.unsupported_reason(call) is None, fwd_host.unsupported_reason(call)
    out, lse = launch_poisoned(fwd_host, call)
    check_against_float64(call, out, lse)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_d256(dtype, causal):
    _pair(_call(D=256, dtype=dtype, causal=causal))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_d128(dtype):
    _pair(_call(D=128, dtype=dtype, Sq=1000, Sk=900))


@pytest.mark.parametrize("kw", [
    dict(window_left=100, window_right=20),
    dict(softcap=20.0, causal=True),
    dict(Hkv=1),
])
def test_d256_features(kw):
    _pair(_call(D=256, **kw))


def test_d256_varlen_causal():
    lens = [1, 129, 300, 777]
    total = sum(lens)
    q = torch.randn(total, 4, 256, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, 2, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    call = AttentionCall(q=q, k=k, v=v, scale=256 ** -0.5, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                         max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    _pair(call)


def test_d256_seqused_k():
    used = torch.tensor([700, 5], dtype=torch.int32, device="cuda")
    _pair(_call(D=256, seqused_k=used))


@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("Sq, Sk", [(1, 300), (129, 129), (130, 1), (255, 256), (257, 513)])
def test_partial_pairs(D, Sq, Sk):
    """Lengths that leave the pair's second CTA few or no rows (the calls the dispatcher gives the
    one-CTA kernel, and the self-check's small problems)."""
    _pair(_call(D=D, Sq=Sq, Sk=Sk), advertised=False)
