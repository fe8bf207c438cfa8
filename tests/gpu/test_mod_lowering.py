"""GPU: the CuTe DSL lowering of mods gives the PyTorch lowering's values on every element --
exactly for masks, to fp32 rounding for scores -- per element and through apply_mods_to_tile."""

import os
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from _mod_cases import cases  # noqa: E402

from torch_fa4.mods.prepare import trace_graphs  # noqa: E402

NAMES = ["alibi_doc_causal", "softcap_window", "bias_bf16_doc2d", "bucketed_chunked", "transcendental_bool_table"]


def _arch():
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}a"


def _reference(mods, aux, score):
    B, H, M, N = score.shape
    dev = score.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    q = torch.arange(M, device=dev).view(1, 1, M, 1)
    k = torch.arange(N, device=dev).view(1, 1, 1, N)
    s = mods.score_torch(score, b, h, q, k, aux[: mods.num_score_aux])
    keep = torch.broadcast_to(mods.mask_torch(b, h, q, k, aux[mods.num_score_aux:]), score.shape)
    return s, keep


def _padded(aux):
    from torch_fa4.kernels.common.mod_lowering import MAX_AUX, kernel_aux_tensors

    return kernel_aux_tensors(aux, MAX_AUX)


@pytest.mark.parametrize("name", NAMES)
def test_probe_matches_torch_lowering(name):
    from torch_fa4.kernels.common import mod_lowering

    score_mod, mask_mod = cases("cuda")[name]
    mods, aux = trace_graphs(score_mod, mask_mod)
    fn = mod_lowering.compile_probe(mods.score_graph, mods.mask_graph, arch=_arch())
    B, H, M, N = 2, 3, 70, 70
    score = torch.randn(B, H, M, N, device="cuda") * 4
    out = torch.full_like(score, float("nan"))
    keep = torch.full(score.shape, -1, dtype=torch.int32, device="cuda")
    fn(score, out, keep, *_padded(aux))
    torch.cuda.synchronize()
    want_s, want_keep = _reference(mods, aux, score)
    assert not out.isnan().any() or want_s.isnan().any()
    assert torch.equal(keep, want_keep.to(torch.int32)), "mask values differ from the PyTorch lowering"
    torch.testing.assert_close(out, want_s, rtol=2e-6 * 8, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("name", ["alibi_doc_causal", "transcendental_bool_table"])
def test_tile_helper_matches_torch_lowering(name):
    from torch_fa4.kernels.common import mod_lowering

    score_mod, mask_mod = cases("cuda")[name]
    mods, aux = trace_graphs(score_mod, mask_mod)
    fn = mod_lowering.compile_tile_probe(mods.score_graph, mods.mask_graph, arch=_arch())
    B, H, M, N = 2, 3, 70, 67  # N not a multiple of the 8-column fragment
    score = torch.randn(B, H, M, N, device="cuda") * 4
    out = torch.full_like(score, float("nan"))
    fn(score, out, torch.empty(1, 1, 1, 1, dtype=torch.int32, device="cuda"), *_padded(aux))
    torch.cuda.synchronize()
    want_s, want_keep = _reference(mods, aux, score)
    want = want_s.masked_fill(~want_keep, float("-inf"))
    assert torch.equal(out == float("-inf"), ~want_keep), "masked positions differ"
    torch.testing.assert_close(out, want, rtol=2e-6 * 8, atol=1e-5, equal_nan=True)
