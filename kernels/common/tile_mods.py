"""score_mod / mask_mod on a thread's score fragment, as the attention kernels need them.

`mod_lowering` inlines a traced graph per element; this module adds what a kernel tile needs around
it: tile offsets -> per-sequence q_idx / kv_idx, natural units, and index clamping.

Clamping: the last query tile and the last key tile stick out past the sequence (rows >= seqlen_q,
keys >= seqlen_k). A mod indexing a captured tensor with such an index (doc_ids[kv_idx]) would read
past the tensor, possibly into unmapped memory. Those elements never matter (keys past seqlen_k
are masked to -inf by the kernel's length mask after the mods; rows past seqlen_q are never
stored), so the indices given to the mods are clamped into [0, seqlen - 1]: every load stays
inside a tensor sized for the sequence, and no visible element changes. (`b` and `h` are always
in range.)
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from torch_fa4.kernels.common.acc_layout import rows_cols
from torch_fa4.kernels.common.dsl_state import DynamicState
from torch_fa4.kernels.common.mod_lowering import mask_mod_value, score_mod_value


class TileMods(DynamicState):
    """The mods of one (batch, head, query tile), bound to their captured tensors.

    score_graph / mask_graph: compile-time ModGraphs (None when absent); score_aux / mask_aux: tuples
    of global-memory tensors; natural_scale: what a raw kernel score (q.k, or tanh(...) with
    softcap) is multiplied by to get the score in natural units that score_mod expects.
    A DynamicState so that it can be used inside dynamic `if`s and loops (kernels/common/dsl_state)."""

    _dynamic_fields = ("score_aux", "mask_aux", "batch", "head", "last_q", "last_k", "natural_scale")

    def __init__(self, score_graph, mask_graph, score_aux, mask_aux, batch: Int32, head: Int32,
                 seqlen_q: Int32, seqlen_k: Int32, natural_scale: Float32):
        self.score_graph = score_graph
        self.mask_graph = mask_graph
        self.score_aux = score_aux
        self.mask_aux = mask_aux
        self.batch = batch
        self.head = head
        # >= 0 even for an empty sequence (a block mask may still list tiles for it; all masked)
        self.last_q = cutlass.max(seqlen_q - 1, 0)
        self.last_k = cutlass.max(seqlen_k - 1, 0)
        self.natural_scale = natural_scale

    @cute.jit
    def _q_idx(self, row0: Int32, row):
        return cutlass.min(row0 + row, self.last_q)

    @cute.jit
    def _kv_idx(self, col0: Int32, col):
        return cutlass.min(col0 + col, self.last_k)

    @cute.jit
    def score_mod(self, acc_s: cute.Tensor, coords: cute.Tensor, row0: Int32, col0: Int32):
        """acc_s = score_mod(acc_s * natural_scale, b, h, q_idx, kv_idx): the result is in natural units."""
        s = rows_cols(acc_s)
        c = rows_cols(coords)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            q_idx = self._q_idx(row0, c[r, 0][0])
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                kv_idx = self._kv_idx(col0, c[r, j][1])
                s[r, j] = score_mod_value(self.score_graph, s[r, j] * self.natural_scale, self.batch,
                                          self.head, q_idx, kv_idx, self.score_aux)

    @cute.jit
    def mask_mod(self, acc_s: cute.Tensor, coords: cute.Tensor, row0: Int32, col0: Int32):
        """-inf where mask_mod(b, h, q_idx, kv_idx) is False."""
        s = rows_cols(acc_s)
        c = rows_cols(coords)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            q_idx = self._q_idx(row0, c[r, 0][0])
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                kv_idx = self._kv_idx(col0, c[r, j][1])
                keep = mask_mod_value(self.mask_graph, self.batch, self.head, q_idx, kv_idx, self.mask_aux)
                s[r, j] = cutlass.select_(keep, s[r, j], -Float32.inf)

    @property
    def has_score_mod(self) -> bool:
        return self.score_graph is not None

    @property
    def has_mask_mod(self) -> bool:
        return self.mask_graph is not None

