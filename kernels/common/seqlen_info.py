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

    def __init__(
        self,
        batch: Int32,
        seqlen_q_static: Int32,
        seqlen_k_static: Int32,
        cu_seqlens_q: Optional[cute.Tensor] = None,
        cu_seqlens_k: Optional[cute.Tensor] = None,
        seqused_k: Optional[cute.Tensor] = None,
    ):
        self.has_cu_q = cu_seqlens_q is not None
        self.has_cu_k = cu_seqlens_k is not None
        if const_expr(cu_seqlens_q is not None):
            self.offset_q = cu_seqlens_q[batch]
            self.seqlen_q = cu_seqlens_q[batch + 1] - self.offset_q
        else:
            self.offset_q = Int32(0)
            self.seqlen_q = Int32(seqlen_q_static)
        if const_expr(cu_seqlens_k is not None):
            self.offset_k = cu_seqlens_k[batch]
            self.seqlen_k = cu_seqlens_k[batch + 1] - self.offset_k
        else:
            self.offset_k = Int32(0)
            self.seqlen_k = Int32(seqlen_k_static)
        if const_expr(seqused_k is not None):
            self.seqlen_k = seqused_k[batch]

    def q_rows(self, t: cute.Tensor) -> cute.Tensor:
        """Shift a (seq, ...) tensor so row 0 is this batch's first query (identity when dense)."""
        if const_expr(not self.has_cu_q):
            return t
        return cute.domain_offset((self.offset_q,) + (0,) * (cute.rank(t) - 1), t)

    def k_rows(self, t: cute.Tensor) -> cute.Tensor:
        if const_expr(not self.has_cu_k):
            return t
        return cute.domain_offset((self.offset_k,) + (0,) * (cute.rank(t) - 1), t)
