"""GPU: captured-tensor indices of mods on the sm_90 kernels.

- Mods that would read out of range (a document-id table shorter than the sequence, a bias table
  too narrow for q_idx - kv_idx, a per-head table with too few heads) raise ModIndexError before
  any kernel is picked or launched, with the same message as on the CPU.
- Negative indices wrap as in PyTorch inside the kernels: tab[h, kv_idx - q_idx] (a score_mod) and
  band[kv_idx - q_idx] (a mask_mod) against float64 attention, forward and backward.
"""

import math

import pytest
import torch

import torch_fa4
from gpu_harness import (HAS_CUDA, ON_SM90 as cuda_sm90, check_training_step, gpu_marks, public_training_step,
                         record_kernel_picks)
from _out_of_range_mods import out_of_range_mods
from naive import naive_attention
from torch_fa4.mods import ModIndexError

pytestmark = gpu_marks(HAS_CUDA, "needs CUDA")


@pytest.fixture
def picked(monkeypatch):
    return record_kernel_picks(monkeypatch)


_OUT_OF_RANGE = {  # each row's index range and its tensor's, as the error message states them
    "doc_short": "[0, 999], outside [-100, 99]",
    "rel_bias_narrow": "[-999, 999], outside [-50, 49]",
    "heads_short": "[0, 7], outside [-4, 3]",
}


def _message(device, row):
    score_mod, mask_mod, causal = out_of_range_mods(device)[row]
    q, k, v = (torch.randn(2, 1000, 8, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ModIndexError) as info:
        torch_fa4.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, causal=causal)
    return str(info.value)


@pytest.mark.parametrize("row", ["doc_short", "rel_bias_narrow", "heads_short"])
def test_out_of_range_mods_raise_before_launch(picked, row):
    on_gpu = _message("cuda", row)
    torch.cuda.synchronize()  # nothing was launched that could have faulted
    assert picked == [], "a backend was picked after a failed index check"
    assert _OUT_OF_RANGE[row] in on_gpu
    assert on_gpu == _message("cpu", row)


@pytest.mark.skipif(not cuda_sm90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_negative_indices_wrap_in_the_kernels(picked, causal):
    B, S, H, D = 2, 333, 4, 128  # 333: the last query and key tiles stick out
    tab = torch.randn(H, 2 * S, device="cuda")  # kv_idx - q_idx in [-332, 332]: negatives wrap
    band = torch.rand(2 * S, device="cuda") > 0.3
    band[0] = True  # every row keeps its diagonal

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + tab[h, kv_idx - q_idx]

    def banded(b, h, q_idx, kv_idx):
        return band[kv_idx - q_idx]

    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, grad, ours = public_training_step(q, k, v, causal=causal, score_mod=rel_bias, mask_mod=banded)
    assert ("forward", "torch_fa4.kernels.sm90") in picked
    assert ("backward", "torch_fa4.kernels.sm90.bwd") in picked

    def rel_bias64(score, b, h, q_idx, kv_idx):
        return score + tab.double()[h, kv_idx - q_idx]

    check_training_step(
        out, grad, ours, q, k, v,
        lambda q, k, v: naive_attention(q, k, v, score_mod=rel_bias, mask_mod=banded, causal=causal,
                                        differentiable=True),
        lambda q, k, v: naive_attention(q, k, v, score_mod=rel_bias64, mask_mod=banded, causal=causal,
                                        differentiable=True))


@pytest.mark.skipif(not cuda_sm90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("d", [64, 128])
def test_padded_tile_reads_stay_inside_tables(picked, d):
    """A score_mod whose derivative reads a table (score * scl[q_idx] * scl[kv_idx]) on sequences
    that end inside a tile: the tables are views of buffers whose entries past the sequence are NaN,
    so any read past them would poison dS (the factor multiplies dS even where P is 0)."""
    B, S, H = 2, 333, 4
    buf = torch.full((2 * S,), math.nan, device="cuda")
    buf[:S] = torch.rand(S, device="cuda") + 0.5
    scl = buf[:S]

    def scaled(score, b, h, q_idx, kv_idx):
        return score * scl[q_idx] * scl[kv_idx]

    q, k, v = (torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, grad, ours = public_training_step(q, k, v, causal=True, score_mod=scaled)
    assert ("backward", "torch_fa4.kernels.sm90.bwd") in picked

    def scaled64(score, b, h, q_idx, kv_idx):
        return score * scl.double()[q_idx] * scl.double()[kv_idx]

    true_mask = lambda b, h, i, j: torch.ones((), dtype=torch.bool, device="cuda")  # noqa: E731
    check_training_step(
        out, grad, ours, q, k, v,
        lambda q, k, v: naive_attention(q, k, v, score_mod=scaled, mask_mod=true_mask, causal=True,
                                        differentiable=True),
        lambda q, k, v: naive_attention(q, k, v, score_mod=scaled64, mask_mod=true_mask, causal=True,
                                        differentiable=True))
