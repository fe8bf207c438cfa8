"""score_mod / mask_mod on a thread's score fragment, as the attention kernels need them.

`mod_fragment` emits a traced graph over a whole fragment, hoisted by dependence (mod_hoisting.py
says what is computed per tile of work, per row, per column and per element); this module adds what
a kernel tile needs around it: tile offsets -> per-sequence q_idx / kv_idx, natural units, index
clamping, and the per-tile values kept in registers across key tiles.

Per-tile values: the nodes of a graph that depend only on b, h and constants (e.g. slope[h], a
global load) are computed when the TileMods is built -- once per (batch, head, query tile), before
the key loop -- and carried as dynamic state, so the loop body reads them from registers.

Clamping: the last query and key tiles stick out past the sequence, where a mod's load
(doc_ids[kv_idx]) could read past its tensor. Those elements never matter (keys past seqlen_k are
masked after the mods, rows past seqlen_q never stored), so indices that feed loads are clamped
into [0, seqlen - 1], where the host check (torch_fa4.mods.index_bounds) proves every index in
range. Indices that feed no load stay as they are (cheaper, and affine for exact int -> float
rewrites).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from torch_fa4.kernels.common.acc_layout import rows_cols
from torch_fa4.kernels.common.dsl_state import DynamicState
from torch_fa4.kernels.common.mod_fragment import (FragmentEmitter, FragmentPositions, emit_mask_mod, emit_score_mod,
                                                   tile_values)


class TileMods(DynamicState):
    """The mods of one (batch, head, query tile), bound to their captured tensors.

    score_graph / mask_graph: compile-time ModGraphs (None when absent); score_aux / mask_aux: tuples
    of global-memory tensors; natural_scale: what a raw kernel score (q.k, or tanh(...) with
    softcap) is multiplied by to get the score in natural units that score_mod expects."""

    _dynamic_fields = ("score_aux", "mask_aux", "batch", "head", "last_q", "last_k", "natural_scale",
                       "score_tile", "mask_tile")

    def __init__(self, score_graph, mask_graph, score_aux, mask_aux, batch: Int32, head: Int32,
                 seqlen_q: Int32, seqlen_k: Int32, natural_scale: Float32, affine_fma: bool = True):
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
        self.affine_fma = affine_fma  # compile-time: FragmentEmitter's option
        # loaded here, once per tile of work: the key loop reads them from registers
        self.score_tile = tile_values(score_graph, batch, head, score_aux)
        self.mask_tile = tile_values(mask_graph, batch, head, mask_aux)

    def _emitter(self, graph, aux, tile_vals, coords, row0, col0):
        pos = FragmentPositions(rows_cols(coords), row0, col0)
        return FragmentEmitter(graph, pos, self.batch, self.head, aux, tile_vals, self.last_q, self.last_k,
                               affine_fma=self.affine_fma)

    def score_mod(self, acc_s: cute.Tensor, coords: cute.Tensor, row0: Int32, col0: Int32):
        """acc_s = score_mod(acc_s * natural_scale, b, h, q_idx, kv_idx): the result is in natural units."""
        s = rows_cols(acc_s)
        em = self._emitter(self.score_graph, self.score_aux, self.score_tile, coords, row0, col0)
        emit_score_mod(em, s, self.natural_scale)

    def mask_mod(self, acc_s: cute.Tensor, coords: cute.Tensor, row0: Int32, col0: Int32):
        """-inf where mask_mod(b, h, q_idx, kv_idx) is False."""
        s = rows_cols(acc_s)
        emit_mask_mod(self._emitter(self.mask_graph, self.mask_aux, self.mask_tile, coords, row0, col0), s)
