"""GPU: the CuTe DSL lowering of mods against float64, on fresh random inputs with poisoned outputs.

- per element and per fragment (tests/_mod_probes.py: the tile probe runs the hoisted
  emission the attention kernels use): exactly for masks, to fp32 rounding for scores;
- the sm90 forward kernel with mods built to exercise each hoisting level -- tile-constant,
  row-only, column-only, element -- plus exact int -> float rewrites and floor division of
  negative values, against float64 attention.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from _mod_cases import cases  # noqa: E402
from _mod_probes import PROBE_SCALE, compile_probe  # noqa: E402
from gpu_harness import (HAS_CUDA, ON_SM90 as cuda_sm90, check_mods_against_naive, gpu_marks,  # noqa: E402
                         poison_forward, public)

from torch_fa4.mods.prepare import trace_graphs  # noqa: E402

pytestmark = gpu_marks(HAS_CUDA, "needs CUDA")

NAMES = ["alibi_doc_causal", "softcap_window", "bias_bf16_doc2d", "bucketed_chunked", "transcendental_bool_table"]


def hoisting_cases(device, H=3, S=70):
    """name -> (score_mod, mask_mod): each mixes the hoisting levels in its own way; captured
    tensors are fresh random values on `device`."""
    head_bias = torch.randn(H, device=device)
    temperature = torch.rand(H, device=device) * 2 + 0.3
    row_table = torch.randn(S, device=device, dtype=torch.bfloat16)
    col_weight = torch.rand(S, device=device) + 0.5
    slopes = torch.rand(H, device=device)
    flags = torch.rand(S, device=device) > 0.4
    shift = torch.randint(-5, 6, (H,), device=device, dtype=torch.int16)

    def tile_only(score, b, h, q_idx, kv_idx):  # loads and arithmetic once per tile; a hoisted divisor
        return score / temperature[h] + head_bias[h] * (b + 1)

    def row_only(score, b, h, q_idx, kv_idx):  # floor division of negative values; a per-row divisor
        return score / (q_idx % 4 + 1.5) + row_table[q_idx] + ((q_idx - 40) // 7 % 3) * 0.5

    def col_only(score, b, h, q_idx, kv_idx):  # a column load, a bool converted to float
        return score * col_weight[kv_idx] + (kv_idx % 5 == 0) * 0.25

    def element(score, b, h, q_idx, kv_idx):  # exact fp32 rewrites (affine, abs, a tile term) and //
        bias = slopes[h] * torch.abs(q_idx - kv_idx) - 0.125 * (kv_idx - q_idx + shift[h])
        return score - bias + ((kv_idx - q_idx - 3) // 4) * 0.0625

    def mask_mixed(b, h, q_idx, kv_idx):
        return (flags[kv_idx] | (q_idx % 3 == 1) | (h == 2)) & (q_idx - kv_idx >= -20)

    return {
        "tile_only": (tile_only, None),
        "row_only": (row_only, mask_mixed),
        "col_only": (col_only, None),
        "element": (element, mask_mixed),
    }


def _arch():
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}a"


def _grids(B, H, M, N, dev):
    return (torch.arange(B, device=dev).view(B, 1, 1, 1), torch.arange(H, device=dev).view(1, H, 1, 1),
            torch.arange(M, device=dev).view(1, 1, M, 1), torch.arange(N, device=dev).view(1, 1, 1, N))


def _reference64(mods, aux, score):
    """score_mod in float64 (captured float tensors promoted too) and the mask, on index grids."""
    b, h, q, k = _grids(*score.shape, score.device)
    aux64 = [a.double() if a.is_floating_point() else a for a in aux]
    s = mods.score_torch(score.double(), b, h, q, k, aux64[: mods.num_score_aux]).double()
    s = torch.broadcast_to(s, score.shape)
    if mods.mask_graph is None:
        return s, torch.ones(score.shape, dtype=torch.bool, device=score.device)
    keep = torch.broadcast_to(mods.mask_torch(b, h, q, k, aux[mods.num_score_aux:]), score.shape)
    return s, keep


def _padded(aux):
    from torch_fa4.kernels.common.mod_lowering import MAX_AUX, kernel_aux_tensors

    return kernel_aux_tensors(aux, MAX_AUX)


def _all_cases(device):
    out = dict(cases(device))
    out.update(hoisting_cases(device))
    return out


def _assert_scores_close(out, want, keep=None):
    assert not out.isnan().any() or want.isnan().any(), "NaN (or unwritten output) where float64 has none"
    if keep is not None:
        want = want.masked_fill(~keep, float("-inf"))
    # fp32 evaluation of the mod vs float64: a few ulp of the largest intermediate
    torch.testing.assert_close(out.double(), want, rtol=3e-5, atol=3e-5, equal_nan=True)


@pytest.mark.parametrize("name", NAMES)
def test_probe_matches_float64(name):
    score_mod, mask_mod = _all_cases("cuda")[name]
    mods, aux = trace_graphs(score_mod, mask_mod)
    fn = compile_probe(mods.score_graph, mods.mask_graph, arch=_arch())
    B, H, M, N = 2, 3, 70, 70
    score = torch.randn(B, H, M, N, device="cuda") * 4
    out = torch.full_like(score, float("nan"))
    keep = torch.full(score.shape, -1, dtype=torch.int32, device="cuda")
    fn(score, out, keep, *_padded(aux))
    torch.cuda.synchronize()
    want_s, want_keep = _reference64(mods, aux, score)
    assert torch.equal(keep, want_keep.to(torch.int32)), "mask values differ from the PyTorch lowering"
    _assert_scores_close(out, want_s)


@pytest.mark.parametrize("name", NAMES + ["tile_only", "row_only", "col_only", "element"])
def test_tile_probe_matches_float64(name):
    """The hoisted fragment emission: every element of a (B, H, 70, 67) grid, fragments of two rows
    and eight keys sticking out past both ends, scores scaled by PROBE_SCALE on the way in."""
    score_mod, mask_mod = _all_cases("cuda")[name]
    mods, aux = trace_graphs(score_mod, mask_mod)
    fn = compile_probe(mods.score_graph, mods.mask_graph, arch=_arch(), tile=True)
    B, H, M, N = 2, 3, 70, 67
    score = torch.randn(B, H, M, N, device="cuda") * 4
    out = torch.full_like(score, float("nan"))
    fn(score, out, torch.empty(1, 1, 1, 1, dtype=torch.int32, device="cuda"), *_padded(aux))
    torch.cuda.synchronize()
    want_s, want_keep = _reference64(mods, aux, score * PROBE_SCALE)
    assert torch.equal(out == float("-inf"), ~want_keep | (want_s == float("-inf"))), "masked positions differ"
    _assert_scores_close(out, want_s, want_keep)


# ---- the sm90 forward kernel with hoisted mods, against float64 attention --------------------------

@pytest.fixture
def poisoned_sm90_forward(monkeypatch):
    """Every sm90 forward launch first fills out / lse with NaN, and is recorded (so a test knows the
    kernel, not the reference, ran)."""
    from torch_fa4.kernels.sm90 import fwd_host

    return poison_forward(monkeypatch, fwd_host, lambda call, overrides: call.mod_key)


@pytest.mark.skipif(not cuda_sm90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["tile_only", "row_only", "col_only", "element"])
def test_sm90_forward_with_hoisted_mods(poisoned_sm90_forward, name, causal):
    import torch_fa4

    B, S, H, D = 2, 333, 4, 128  # 333: the last query and key tiles stick out
    mods_gpu = hoisting_cases("cuda", H=H, S=S)[name]
    # the same captured values on the CPU for the float64 oracle
    mods_cpu = _on_cpu(mods_gpu)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = public(torch_fa4.attention, q, k, v, causal=causal, score_mod=mods_gpu[0], mask_mod=mods_gpu[1],
                      return_lse=True)
    assert len(poisoned_sm90_forward) == 1 and poisoned_sm90_forward[0], "the sm90 kernel did not run"
    check_mods_against_naive(out, lse, q, k, v, mods_gpu, mods_cpu, causal=causal)


def _on_cpu(mods):
    """The same mods with their captured tensors copied to the CPU (closure cells rebound)."""
    import types

    def move(fn):
        if fn is None:
            return None
        cells = tuple(types.CellType(c.cell_contents.cpu() if isinstance(c.cell_contents, torch.Tensor)
                                     else c.cell_contents) for c in (fn.__closure__ or ()))
        return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells or None)

    return move(mods[0]), move(mods[1])
