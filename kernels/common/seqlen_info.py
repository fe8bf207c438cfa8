"""Per-batch sequence offsets and lengths, dense or variable-length (cu_seqlens, seqused_k).

Dense: every batch has the static lengths and offset 0 along the sequence mode.
Varlen: batch b's tokens are rows [cu[b], cu[b+1]) of the packed tensor. seqused_k, when given,
caps the keys used (KV cache), with or without cu_seqlens_k.
"""

from typing import Optional

import cutlass.cute as cute
from cutlass import Int32, const_expr

from torch_fa4.kernels.common.dsl_state import DynamicState


class SeqlenInfo(DynamicState):
    _dynamic_fields = ("offset_q", "seqlen_q", "offset_k", "seqlen_k")

    def __init__(self, batch: Int32, seqlen_q_static: Int32, seqlen_k_static: Int32,
                 cu_seqlens_q: Optional[cute.Tensor] = None, cu_seqlens_k: Optional[cute.Tensor] = None,
                 seqused_k: Optional[cute.Tensor] = None):
        self.has_cu_q = cu_seqlens_q is not None
        self.has_cu_k = cu_seqlens_k is not None
        self.offset_q, self.seqlen_q = _span(cu_seqlens_q, batch, seqlen_q_static)
        self.offset_k, self.seqlen_k = _span(cu_seqlens_k, batch, seqlen_k_static)
        if const_expr(seqused_k is not None):
            self.seqlen_k = seqused_k[batch]

    def q_rows(self, t: cute.Tensor) -> cute.Tensor:
        """Shift a (seq, ...) tensor so row 0 is this batch's first query (identity when dense)."""
        return _shifted(t, self.offset_q) if const_expr(self.has_cu_q) else t

    def k_rows(self, t: cute.Tensor) -> cute.Tensor:
        return _shifted(t, self.offset_k) if const_expr(self.has_cu_k) else t


def _span(cu_seqlens: Optional[cute.Tensor], batch: Int32, seqlen_static: Int32):
    """(offset, length) of the batch's rows: packed from cu_seqlens, else 0 and the static length."""
    if const_expr(cu_seqlens is None):
        return Int32(0), Int32(seqlen_static)
    offset = cu_seqlens[batch]
    return offset, cu_seqlens[batch + 1] - offset


def _shifted(t: cute.Tensor, rows: Int32) -> cute.Tensor:
    return cute.domain_offset((rows,) + (0,) * (cute.rank(t) - 1), t)
