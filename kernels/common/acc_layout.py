"""Views of a Hopper wgmma accumulator fragment.

A thread's fp32 accumulator for an m64nNk16 wgmma has shape ((2, 2, N/8), MMA_M, MMA_N): mode 0.0
picks one of two adjacent columns, mode 0.1 one of two rows 8 apart, mode 0.2 the 8-column group.
Softmax and masking want the same registers as (rows, cols); the P @ V matmul wants them as an A
operand, ((2, 2, 2), MMA_M, K/16). These helpers only rearrange the layout: no data moves.
"""

import cutlass.cute as cute


def rows_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) -> ((2, M), (2, V, N)): rows first, then columns."""
    s, d = acc_layout.shape, acc_layout.stride
    return cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])),
    )


def rows_cols(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, rows_cols_layout(acc.layout))


def a_operand_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) -> ((2, 2, 2), M, (V/2, N)): an S tile read as the A operand of P @ V.

    Two consecutive 8-column groups form one k16 slice of the second matmul, so V must be even
    (the key tile is a multiple of 16)."""
    s, d = acc_layout.shape, acc_layout.stride
    assert s[0][2] % 2 == 0, "key tile must be a multiple of 16"
    return cute.make_layout(
        ((s[0][0], s[0][1], 2), s[1], (s[0][2] // 2, s[2])),
        stride=((d[0][0], d[0][1], d[0][2]), d[1], (2 * d[0][2], d[2])),
    )


def a_operand(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, a_operand_layout(acc.layout))
