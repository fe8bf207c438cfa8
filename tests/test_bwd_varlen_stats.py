"""CPU: the varlen backward's row-statistics layout (bwd_row_stats.varlen_stat_layout).

The packed-rows backward loads each query tile's LSE / dPsum by TMA from the sequence's own
offset. Those offsets are whole query tiles (a load whose first fp32 element is not 16-byte
aligned stops the kernel, NOTES Experiment 160), and the tiles a sequence loads must not reach
into the next sequence's rows. The torch path of bwd_row_stats.row_statistics builds the same layout the
GPU path does, so these checks run on the CPU.
"""

import math

import pytest
import torch

from torch_fa4.call import AttentionCall
from torch_fa4.kernels.sm90 import bwd_row_stats as bwd


def _varlen_call(lens, heads, d=64):
    cu = torch.tensor([0] + list(lens)).cumsum(0).to(torch.int32)
    q = torch.empty(int(cu[-1]), heads, d, dtype=torch.bfloat16)
    return AttentionCall(q=q, k=q, v=q, scale=d**-0.5, cu_seqlens_q=cu, cu_seqlens_k=cu)


@pytest.mark.parametrize("tile_m", [64, 128])
@pytest.mark.parametrize("lens", [[17, 300, 129, 256, 64], [1, 1, 1], [128, 128], [300]])
def test_each_sequence_starts_on_a_whole_tile_and_keeps_to_its_rows(lens, tile_m):
    heads, dv = 3, 64
    call = _varlen_call(lens, heads, dv)
    total = call.q.shape[0]
    dout = torch.randn(total, heads, dv, dtype=torch.bfloat16)
    out = torch.randn(total, heads, dv, dtype=torch.bfloat16)
    lse = torch.randn(heads, total)
    lse[1, 0] = -math.inf  # a row with no visible key: +inf, so that P = 0 there
    lse2, dpsum, rows = bwd.row_statistics(call, dout, out, lse, tile_m=tile_m)

    expect_lse2 = torch.where(torch.isneginf(lse), math.inf, lse * math.log2(math.e))
    expect_dpsum = (dout.float() * out.float()).sum(-1).transpose(0, 1)
    offsets = bwd.stat_row_offsets(call.cu_seqlens_q, tile_m).tolist()
    cu = call.cu_seqlens_q.tolist()
    owned = torch.zeros(lse2.shape[-1], dtype=torch.bool)
    for b, (first, start, end) in enumerate(zip(offsets, cu, cu[1:])):
        assert first % tile_m == 0, (b, first)
        loaded_end = first + math.ceil((end - start) / tile_m) * tile_m  # the kernel's last tile
        assert loaded_end <= lse2.shape[-1], "a tile past the buffer"
        if b + 1 < len(offsets):
            assert loaded_end <= offsets[b + 1], f"sequence {b}'s tiles reach into sequence {b + 1}'s rows"
        torch.testing.assert_close(lse2[:, first : first + end - start], expect_lse2[:, start:end])
        torch.testing.assert_close(dpsum[:, first : first + end - start], expect_dpsum[:, start:end])
        owned[first : first + end - start] = True
    assert (lse2[:, ~owned] == math.inf).all() and (dpsum[:, ~owned] == 0).all()
    assert lse2.is_contiguous() and dpsum.is_contiguous() and lse2.shape[-1] % 4 == 0  # TMA strides
    assert rows >= total  # the dQ buffer's rows: the packed rows, in their own order


def test_offsets_formula():
    # (cu[b] + b * tile) // tile * tile: 17 -> 64 (17 + 64 = 81), 317 -> 384 (317 + 128 = 445)
    cu = torch.tensor([0, 17, 317, 446, 500], dtype=torch.int32)
    assert bwd.stat_row_offsets(cu, 64).tolist() == [0, 64, 384, 576]


def test_sources_are_kept_per_unmodified_offsets_tensor():
    cu = torch.tensor([0, 17, 317, 446], dtype=torch.int32)
    src = bwd.stat_sources(cu, 446, 64)
    assert bwd.stat_sources(cu, 446, 64) is src  # the same live tensor, unmodified: no recomputation
    assert bwd.stat_sources(cu, 446, 128) is not src  # another tile: its own layout
    assert bwd.stat_row_offsets(cu, 64).tolist() == [0, 64, 384]
    # sequence 1 starts at row 64; rows 17-63 hold no packed row: they read padding row 446
    assert src[64].item() == 17 and src[16].item() == 16 and src[17].item() == 446
    cu[1] = 20  # in place: recomputed from the new offsets
    moved = bwd.stat_sources(cu, 446, 64)
    offsets = bwd.stat_row_offsets(cu, 64).tolist()
    assert moved[offsets[1]].item() == 20 and moved[19].item() == 19
    assert src[64].item() == 17  # (the first result still describes the old offsets)

