"""The permuted order of the backward's row statistics (kernels/sm90/bwd_stats_layout.py): a
bijection inside every query tile, each consumer thread's values in whole 16-byte chunks, and the
four threads of a quad reading their k-th chunks from different banks."""

import pytest
import torch

from torch_fa4.kernels.sm90 import bwd_stats_layout as S


@pytest.mark.parametrize("tm", S.TILES)
def test_position_permutes_each_tile(tm):
    rows = torch.arange(3 * tm)
    pos = S.position(rows, tm)
    assert sorted(pos.tolist()) == rows.tolist()
    assert ((pos // tm) == (rows // tm)).all(), "a row left its tile"
    assert [S.position(int(i), tm) for i in rows] == pos.tolist(), "ints and tensors disagree"


@pytest.mark.parametrize("tm", S.TILES)
def test_thread_columns_are_chunks(tm):
    # accumulator columns 8 j + 2 q + e of quad lane q: value 2 (j % 2) + e of chunk j // 2
    for q in range(4):
        for j in range(tm // 8):
            for e in range(2):
                assert S.position(8 * j + 2 * q + e, tm) == S.chunk_offset(q, j // 2, tm) + 2 * (j % 2) + e


@pytest.mark.parametrize("tm", S.TILES)
def test_quad_chunks_on_distinct_banks(tm):
    for k in range(tm // 16):
        groups = {(S.chunk_offset(q, k, tm) * 4 // 16) % 8 for q in range(4)}
        assert len(groups) == 4, (tm, k, groups)


def test_permute_rows_moves_values_to_their_positions():
    x = torch.randn(2, 3, 256)
    y = S.permute_rows(x, 128)
    pos = S.position(torch.arange(256), 128)
    assert torch.equal(y[..., pos], x)
    with pytest.raises(AssertionError):
        S.permute_rows(torch.zeros(100), 64)
