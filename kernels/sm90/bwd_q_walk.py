"""The query tiles one backward CTA (one key tile of one KV head) visits: step -> (head, m_block).

The producer warp (TMA loads) and the consumer warpgroups (matmuls) walk the same sequence, each
computing it on its own from the same values, so they agree without talking to each other. Heads
of the GQA group come one after the other (`h_local` 0 .. group-1, query head
hkv * group + h_local).

- `DenseQWalk`: query tiles [m_lo, m_lo + n_m) for every head: the tiles whose rows can see the
  key tile under causal / window limits (`query_tiles_seeing`, from the lengths that
  `key_tile_sequence` reads; the sm90 and sm100 backwards share both).
- `SparseQWalk`: only the query tiles the block mask lists for this key tile (the transposed lists
  from bwd_sparse.py): per head, first the partial ones (mask_mod must be evaluated), then the
  full ones (mask_mod is true everywhere). A block-mask tile of (ratio_m * tile_m) rows and
  (ratio_n * tile_n) keys covers ratio_m kernel steps and ratio_n CTAs. Heads may list different
  numbers of tiles, so the walk keeps where each head's steps start; a step finds its head by
  comparing against those starts (group is a compile-time constant: unrolled selects, no loop).
  Causal / window / length limits the mask_mod does not know about are still applied element by
  element where a tile crosses them (bwd_kernel), so listing a tile outside them is harmless.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32, const_expr

from torch_fa4.kernels.common.dsl_state import DynamicState


@cute.jit
def key_tile_sequence(mQ: cute.Tensor, mK: cute.Tensor, mCuQ, mCuK, mSeqUsedK, b: Int32,
                      varlen: cutlass.Constexpr[bool]):
    """(q_off, k_off, seqlen_q, seqlen_k, rows_k) of batch b: where its sequences start in packed
    tensors (0 otherwise), their lengths (seqlen_k after seqused_k) and the key rows it holds."""
    q_off = Int32(0)
    k_off = Int32(0)
    if const_expr(varlen):
        q_off = mCuQ[b]
        k_off = mCuK[b]
        seqlen_q = mCuQ[b + 1] - q_off
        seqlen_k = mCuK[b + 1] - k_off
    else:
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
    rows_k = seqlen_k
    if const_expr(mSeqUsedK is not None):
        seqlen_k = mSeqUsedK[b]
    return q_off, k_off, seqlen_q, seqlen_k, rows_k


@cute.jit
def head_slab(t: cute.Tensor, h: Int32, b: Int32, off: Int32, varlen: cutlass.Constexpr[bool]):
    """The (seq, ...) slab of head h, batch b of a (seq, heads, batch) or (seq, dim, heads, batch)
    view; packed sequences (varlen: a unit batch mode) are offset to their first row `off`."""
    bi = 0 if const_expr(varlen) else b
    if const_expr(cute.rank(t) == 4):
        r = t[(None, None, h, bi)]
    else:
        r = t[(None, h, bi)]
    if const_expr(varlen):
        r = cute.domain_offset((off,) + (0,) * (cute.rank(r) - 1), r)
    return r


@cute.jit
def query_tiles_seeing(n0: Int32, n1: Int32, seqlen_q: Int32, diag: Int32, window_left: Int32,
                       window_right: Int32, tile_m: cutlass.Constexpr[int], has_left: cutlass.Constexpr[bool],
                       has_right: cutlass.Constexpr[bool]):
    """(m_lo, n_m): the query tiles [m_lo, m_lo + n_m) with a row that sees a key of [n0, n1)
    (diag = seqlen_k - seqlen_q; has_right / has_left: a causal-or-window bound on that side)."""
    row_lo = Int32(0)
    row_hi = seqlen_q
    if const_expr(has_right):
        row_lo = cutlass.max(n0 - diag - window_right, 0)
    if const_expr(has_left):
        row_hi = cutlass.min(n1 - diag + window_left, seqlen_q)
    m_lo = row_lo // tile_m
    m_hi = (cutlass.max(row_hi, 0) + tile_m - 1) // tile_m
    return m_lo, cutlass.max(m_hi - m_lo, 0)


class DenseQWalk(DynamicState):
    """descending (compile time): each head's query tiles from the last down to m_lo. Under a
    causal mask key tile n's walk starts at its diagonal, so in ascending order the CTAs in flight
    (neighbouring key tiles of a head) each read different Q / dO tiles; walked downwards they all
    start at the head's last query tile and read the same tiles at the same time (L2 hits), the
    shorter walks stopping earlier."""

    _dynamic_fields = ("m_lo", "n_m", "count")

    def __init__(self, m_lo: Int32, n_m: Int32, group: int, descending: bool = False):
        self.m_lo = m_lo
        self.n_m = n_m
        self.count = n_m * group
        self.descending = descending

    # Cursor walk for loops that visit every step in order: (h_local, m_block) carried from one
    # step to the next, no integer division per step.
    def start(self):
        if const_expr(self.descending):
            return Int32(0), self.m_lo + self.n_m - 1
        return Int32(0), self.m_lo

    def at(self, step: Int32, cur_h: Int32, cur_m: Int32):
        return cur_h, cur_m, Boolean(True)

    def advance(self, cur_h: Int32, cur_m: Int32):
        if const_expr(self.descending):
            m = cur_m - 1
            wrap = m < self.m_lo
            return cutlass.select_(wrap, cur_h + 1, cur_h), cutlass.select_(wrap, self.m_lo + self.n_m - 1, m)
        m = cur_m + 1
        wrap = m == self.m_lo + self.n_m
        return cutlass.select_(wrap, cur_h + 1, cur_h), cutlass.select_(wrap, self.m_lo, m)


class SparseQWalk(DynamicState):
    _dynamic_fields = ("starts", "num_partial", "heads", "count", "q_idx", "full_q_idx", "bm_b", "bm_n")

    def __init__(self, q_num: cute.Tensor, q_idx: cute.Tensor, full_q_num: cute.Tensor,
                 full_q_idx: cute.Tensor, b: Int32, hkv: Int32, n_block: Int32, live: Boolean,
                 group: int, ratio_m: int, ratio_n: int):
        """live False (a key tile past the used keys, seqused_k) gives an empty walk. The lists
        cover every row of the k tensor (bwd_sparse checks it), so reading them is in bounds."""
        self.group = group
        self.ratio_m = ratio_m
        self.q_idx = q_idx
        self.full_q_idx = full_q_idx
        # a block mask built with B = None / H = None has size 1 there: it applies to all
        self.bm_b = cutlass.select_(q_num.shape[0] == 1, Int32(0), b)
        self.bm_n = n_block if const_expr(ratio_n == 1) else n_block // ratio_n
        self.starts, self.num_partial, self.heads = [], [], []
        total = Int32(0)
        for g in range(group):
            hb = cutlass.select_(q_num.shape[1] == 1, Int32(0), hkv * group + g)
            n_part = q_num[self.bm_b, hb, self.bm_n]
            n_full = full_q_num[self.bm_b, hb, self.bm_n]
            self.starts.append(total)
            self.num_partial.append(n_part)
            self.heads.append(hb)
            total = total + (n_part + n_full) * ratio_m
        self.count = cutlass.select_(live, total, Int32(0))

    # Cursor interface of DenseQWalk; a sparse step is found from its index alone.
    def start(self):
        return Int32(0), Int32(0)

    def advance(self, cur_h: Int32, cur_m: Int32):
        return cur_h, cur_m

    @cute.jit
    def at(self, step: Int32, cur_h: Int32, cur_m: Int32):
        """(h_local, m_block, partial): partial says whether mask_mod must be evaluated."""
        h_local = Int32(0)
        start = self.starts[0]
        n_part = self.num_partial[0]
        hb = self.heads[0]
        for g in cutlass.range_constexpr(1, self.group):
            later = step >= self.starts[g]  # the last head whose steps start at or before step
            h_local = cutlass.select_(later, Int32(g), h_local)
            start = cutlass.select_(later, self.starts[g], start)
            n_part = cutlass.select_(later, self.num_partial[g], n_part)
            hb = cutlass.select_(later, self.heads[g], hb)
        t = step - start
        blk = t
        sub = Int32(0)
        if const_expr(self.ratio_m > 1):
            blk = t // self.ratio_m
            sub = t - blk * self.ratio_m
        partial = blk < n_part
        m_bm = Int32(0)
        if partial:
            m_bm = self.q_idx[self.bm_b, hb, self.bm_n, blk]
        else:
            m_bm = self.full_q_idx[self.bm_b, hb, self.bm_n, blk - n_part]
        return h_local, m_bm * self.ratio_m + sub, partial
