"""sm90 (Hopper) attention backward: dK, dV per KV tile, dQ accumulated in fp32 global memory.

One CTA owns a tile of `tile_n` keys (128; 64 for head dims above 128) of one KV head and walks
every query tile (of every query head of its GQA group) that can see those keys. dK and dV stay
in registers for the whole walk, so GQA needs no reduction across CTAs; dQ contributions of all
KV tiles meet in a float32 buffer.

Grid: one CTA per work tile (key tile, kv head, batch), or (`persistent`) one CTA per SM taking
work tiles from a global counter (NOTES Experiment 55): the next tile's K / V loads overlap this
tile's dK / dV epilogue, and the producer warp hands each tile to the other warps through a
two-slot mailbox (common/tile_mailbox.py). With `split_tail` (common/split_tail.py) the last
`split_items` work tiles run as `split_ways` pieces of consecutive query tiles; the last piece to
finish adds the others' partial dK / dV into its own and runs the ordinary epilogue.

Warp roles (384 threads):
  warpgroup 0  producer: one warp issues TMA for K, V (once) and, per step, Q, dO, LSE, dPsum
               into a two-stage ring guarded by mbarriers (`split_ring`: separate barriers for
               Q + LSE and dO + dPsum); it gives registers away (setmaxnreg).
               With `dq_writer_warp`, its warp 1 issues the dQ TMA adds (see below).
               With `fused_dq` (persistent, 128 queries per step), warp 2 counts each query
               tile's landed adds and warp 3 writes finished tiles into dq (bwd_dq_fused.py).
  warpgroups 1-2 consumers, each owning 64 of the 128 keys:
      S^T  = K Q^T         (wgmma, both operands in shared memory)
      dP^T = V dO^T
      P^T  = exp2(S^T * scale*log2e - LSE*log2e)            masked, softcapped as in forward
      dS^T = P^T * (dP^T - dPsum)    (* (1 - tanh^2) under softcap)
      dV  += P^T dO         (P^T fed from registers: no shared-memory round trip)
      dK  += dS^T Q         (dS^T from registers)
      dQ   = dS K           (dS through shared memory; each warpgroup takes half of the head dim)
  P is computed while dP^T is still on the tensor cores, dS while dV is. Each warpgroup stages
  its dQ half in shared memory and adds it to the fp32 buffer with one TMA reduce-add (in
  KV-tile order under a per-query-tile semaphore when deterministic); dK, dV are written once at
  the end. On the 128-key variants (`dq_under_dk`) dQ is issued before dK, so its epilogue runs
  under dK (NOTES Experiments 24, 26).
  `dq_writer_warp` (the 128-key variants): the consumers only store their dQ half into the slab
  and signal it; producer warp 1 issues the TMA add (and takes the deterministic turns) and hands
  the slab back once the add has read it (two named barriers per warpgroup, bwd_dq.py), so the
  consumers never wait for a TMA read or a semaphore (NOTES Experiment 25).

Narrow variant (tile_n = 64: head dims above 128, or block masks of 64-key columns): dK and dV of
128 keys x 256 dims would need 256 fp32 registers per consumer thread, so both consumer warpgroups
share 64 keys instead. Each computes S^T and dP^T for 32 of the 64 queries, writes P^T and dS^T
to shared memory, and after a barrier computes dV, dK for all 64 keys and half of the head dim (A
from shared memory) and dQ for half of the head dim: 192 fp32 registers per thread at D=256. At
D=256 the dQ halves are staged in the Q and dO buffers of the step just consumed (`dq_in_ring`:
each is exactly one fp32 dQ half), which keeps two ring stages in ~211 KB instead of ~274 KB; the
stage goes back to the producer once the TMA add has read it. bwd_config.ring picks.

128 queries per step (`tile_m = 128`; D = Dv = 64, bwd_variant.query_tile): S^T and dP^T are 64
keys x 128 queries per consumer warpgroup (64 + 64 fp32 registers per thread), dK + dV 32 + 32,
and dQ = dS K splits the query rows between the warpgroups instead of the head dim (each 64 rows
x D, one TMA add per warpgroup). Keeping the fp32 P for dS while dP^T lands and dV runs would need
~224 registers and ptxas would serialize the wgmmas (C7512), so P is formed in fp32 while dP^T
lands, dS from it once dP^T landed, and dV issued only after dS (`p_under_dp`; NOTES Experiments
41, 54).

dQ transposed (`dq_transposed`, BwdConfig.dq_transposed: D128 with 64 queries and D64 with 128):
dQ^T = K^T dS^T, M = the warpgroup's 64 head-dim columns, N = its queries, dS stored (queries,
keys), keys contiguous, by a transposing stmatrix, so that dQ^T reads it K-major with a 128-byte
swizzle. It buys conflict-free slab stores: dQ = dS K leaves each thread 64-bit pairs along a
row, and under the slab's 128-byte swizzle rows r and r ^ 1 of a warp share banks; dQ^T's 32-bit
stores hit 32 banks (NOTES Experiment 79).

Captured gradients (`capture_slots`): the gradients of tensors a score_mod reads (learnable
slopes, bias tables) are added by the consumers into fp32 buffers from the dS they form anyway
(bwd_scores.py says how equal addresses are reduced first); the host takes this path where
bwd.captured_grad_reason allows (not in deterministic mode: atomics add in no fixed order).

Block sparsity: with a block mask (bwd_sparse.py, bwd_q_walk.py) a CTA walks only the query tiles
the transposed block mask lists for its key tile, and evaluates the mask_mod on partial ones only.

Variable length: the `varlen` variant (packed rows, per-sequence row offsets, dK / dV stored from
registers with a row predicate). Its LSE / dPsum rows start each sequence at a tile-aligned
offset (`_stat_row_offset`, bwd_row_stats.varlen_stat_layout): a TMA load of fp32 rows from an
offset that is not a multiple of 4 faults (NOTES Experiment 160).

Math: with s = scale * q.k (softcapped: s = c * tanh(scale * q.k / c)), p = exp(s - lse),
dv = p^T do, dp = do v^T, ds = p * (dp - rowsum(do * o)), dq = scale * ds' k, dk = scale * ds'^T q
where ds' = ds * ds/d(scale*qk) (1 without softcap, 1 - tanh^2 with it).
The kernel adds ds' k to the dQ buffer unscaled: the conversion to the output dtype applies
`scale` (32 multiplies per step off the dQ epilogue, which runs under dK).

The roles are mixins: bwd_producer.py (TMA loads), bwd_consumer.py (a consumer warpgroup's steps,
the dK / dV epilogue), bwd_scores.py (P and dS), bwd_dq.py (dQ into the fp32 buffer).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync

from ..common import mod_lowering as mods_dsl
from ..common.tile_mailbox import init_mailbox, next_item, publish_item, read_item
from ..common.tile_scheduler import grouped_order, split_unit
from . import bwd_layouts as L
from .bwd_config import BwdConfig
from .bwd_consumer import BwdConsumer
from .bwd_dq import BwdDq
from .bwd_dq_fused import COUNT_WARP, CVT_WARP, BwdDqFused
from .bwd_producer import BwdProducer
from .bwd_q_walk import DenseQWalk, SparseQWalk, head_slab, key_tile_sequence, query_tiles_seeing
from .bwd_scores import BwdScores

# Named barriers (0 is __syncthreads): 1 both consumer warpgroups (256 threads); 2, 3 one consumer
# warpgroup (128); 4 + wg, 6 + wg the dQ hand-off of consumer warpgroup wg and the dQ writer warp
# (bwd_dq.py).
# Persistent: the warps that read each work tile from the mailbox (8 consumer warps, the dQ writer)
_TILE_READERS = 9


class WorkTile(NamedTuple):
    """A work tile's sequence bookkeeping (_tile_walk), the same on every thread."""

    n_block: Int32  # key tile
    hkv: Int32
    b: Int32
    q_off: Int32  # varlen: the sequence's first packed row (0 dense)
    k_off: Int32
    seqlen_q: Int32
    seqlen_k: Int32  # keys used (seqused_k)
    rows_k: Int32  # rows of this sequence in the k tensor: dK / dV rows to write
    diag: Int32  # seqlen_k - seqlen_q (bottom-right alignment: key j visible up to row i + diag)
    walk: object  # DenseQWalk / SparseQWalk over its query tiles
    steps: Int32


class Sm90AttentionBackward(BwdProducer, BwdConsumer, BwdScores, BwdDq, BwdDqFused):
    threads = 384
    producer_regs = 24
    consumer_regs = 240

    def __init__(self, dtype, config: BwdConfig, mods=None):
        """dtype: the cutlass input dtype; config: the variant (bwd_config.py), whose fields and
        properties read as the kernel's own (__getattr__); mods: the torch_fa4.mods.registry.ModSet
        of config.mods_key (None without mods), its graphs inlined."""
        c = self.config = config
        self.dtype = dtype
        self.d, self.dv = c.head_dim, c.head_dim_v
        assert c.tile_m in (64, 128)
        assert c.tile_m == 64 or (c.tile_n == 128 and max(c.head_dim, c.head_dim_v) <= 64 and not c.dq_in_ring)
        self.dq_split_rows = c.tile_m == 128
        assert not c.dq_in_ring or (c.head_dim_v >= c.head_dim and c.stages == 2)
        # Keys past seqlen_k are masked where the tensor holds more rows than the sequence uses
        # (varlen: the next sequence; seqused_k: the unused cache) and where dense keys end inside
        # a key tile (docs/INTERNALS.md: the zero-filled tail's P is unbounded, its dS overflows).
        self.mask_k = c.varlen or c.seqused_k or c.mask_key_tail
        self.score_graph = mods.score_graph if mods is not None else None
        self.mask_graph = mods.mask_graph if mods is not None else None
        # d score_mod / d score, traced from the score graph (None when it is 1 everywhere)
        self.grad_graph = None
        if self.score_graph is not None and not mods_dsl.mod_graph_is_identity_grad(mods.score_grad_graph):
            self.grad_graph = mods.score_grad_graph
        self.num_score_aux = mods.num_score_aux if mods is not None else 0
        # gradients of captured tensors (capture_slots): the loads to differentiate, planned
        # (bwd_scores.captured_loads), and the graph holding their indices and derivatives
        self.captured = ()
        self.capture_graph = None
        if c.capture_slots:
            from .bwd_scores import captured_loads

            assert self.score_graph is not None, "captured gradients need a score_mod"
            self.captured = captured_loads(mods.load_derivatives, c.capture_slots)
            self.capture_graph = mods.load_derivatives.graph
        self.num_aux = self.num_score_aux + (mods.num_mask_aux if mods is not None else 0)
        # P and dS in one pass once S^T and dP^T both landed, when dS needs more than P: tanh'
        # (softcap) or score_mod' at the unmodified score; and at 128 queries, where P is formed
        # in fp32 while dP^T is in flight and dV issued after dS otherwise (`p_under_dp`, module
        # docstring).
        self.one_pass = c.softcap or self.score_graph is not None
        self.p_under_dp = c.tile_m == 128 and not self.one_pass
        self.one_pass = self.one_pass or c.tile_m == 128
        # The 128-key variants issue dQ before dK and leave the dQ adds to a dedicated warp
        # (module docstring); dQ staged in the ring (narrow) keeps the leader warps' adds, which
        # also hand the stage back to the producer.
        self.dq_under_dk = self.dq_writer_warp = c.separate_dq_slabs
        # With dq_under_dk nothing runs between issuing S^T / dP^T and waiting for them, so the
        # per-query LSE / dPsum loads from shared memory would sit on that path (short-scoreboard
        # stalls at the first exp2): load them into registers before the step's wgmmas instead
        # (64-query wide two-pass path only). dP^T's accumulator then starts at -dPsum, so dS =
        # P * (dP - dPsum) is one multiply per element (`fold_dpsum`, NOTES Experiment 31).
        self.prefetch_stats = self.fold_dpsum = self.dq_under_dk and c.tile_m == 64 and not self.one_pass
        # Block-sparse walk: a block-mask tile is ratio_m query steps by ratio_n key tiles.
        self.sparse = c.sparse is not None
        self.ratio_m, self.ratio_n = c.sparse if c.sparse is not None else (1, 1)
        assert not self.sparse or self.mask_graph is not None, "a block mask needs its mask_mod"
        # the deterministic dQ order counts every earlier key tile; a sparse walk skips some
        assert not (self.sparse and c.deterministic), "deterministic mode walks densely"
        # Walks with a length / causal / window limit but no mask_mod: the steps that cross a
        # limit and those that do not in separate loops, each with one P / dS body
        # (bwd_consumer._masked_and_unmasked_steps, NOTES Experiment 124).
        self.split_mask_loops = (not self.sparse and self.mask_graph is None
                                 and (c.varlen or self.mask_k or c.has_right or c.has_left))
        assert not c.split_ring or (c.tile_m == 128 and not self.prefetch_stats and not c.dq_in_ring)
        # 128 queries: the dS^T stmatrix goes before dV's issue, so the stores drain while dV's
        # HGMMAs issue and the fence and barrier after them find them done (NOTES Experiment 54).
        self.dv_after_ds = c.tile_m == 128
        # dK / dV leave through shared memory and TMA stores (see __call__)
        self.stage_dkdv = not c.varlen and not c.narrow
        assert not c.persistent or (self.stage_dkdv and self.dq_writer_warp and not c.deterministic
                                    and not self.sparse and not c.dq_in_ring), "persistent: dense 128-key paths"
        assert not c.split_tail or (c.persistent and not self.sparse and not c.deterministic)
        assert not c.fused_dq or (c.persistent and not c.varlen), "fused_dq: the persistent dense kernel"

    def __getattr__(self, name):
        if name == "config":  # (not set yet)
            raise AttributeError(name)
        return getattr(self.config, name)

    # ------------------------------------------------------------------ host side (jit)
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,  # (B, S, H, D) or (T, H, D)
        mLSE2: cute.Tensor,  # (B, Hq, Sq_pad) or (Hq, Tq_pad): lse * log2(e), +inf for empty rows
        mDpsum: cute.Tensor,  # same shape: rowsum(dO * O)
        mdQacc: cute.Tensor,  # (B, Hq, Sq, D) (any strides) or (Hq, Tq_pad, D) fp32, zeroed
        mdK: cute.Tensor, mdV: cute.Tensor,  # shapes of k, v, contiguous
        mdQ: cute.Tensor | None,  # fused_dq: dq (B, Sq, Hq, D) in the input dtype, written here
        mCuQ: cute.Tensor | None, mCuK: cute.Tensor | None, mSeqUsedK: cute.Tensor | None,
        # int32, zeroed: (B, Hq, n_m_blocks) semaphores (deterministic), (B, Hq, 2 n_m_blocks + 3)
        # dQ counters, queue and tile counter (fused_dq, bwd_dq_fused.py), or the tile counter
        # alone (persistent); the tile counter is the first row's last element
        mSem: cute.Tensor | None,
        # split_tail: (split tiles * ways, values, 256) fp32 workspace of the pieces' partial dK /
        # dV (bwd_consumer), and (split tiles,) int32 piece counters, zeroed; else None
        mSplitWs: cute.Tensor | None, mSplitCnt: cute.Tensor | None,
        # transposed block mask (sparse only, else None), int32: (B', H', n_kv_blocks) counts and
        # (B', H', n_kv_blocks, n_q_blocks) query-block indices, partial then full (bwd_sparse.py)
        mQNum: cute.Tensor | None, mQIdx: cute.Tensor | None,
        mFullQNum: cute.Tensor | None, mFullQIdx: cute.Tensor | None,
        scale: Float32, scale_log2: Float32, softcap_val: Float32,
        window_left: Int32, window_right: Int32,
        max_seqlen_k: Int32,
        cta_group: Int32,  # CTA order: groups of this many (kv head, batch) pairs (_cta_coords)
        cta_tail: Int32,  # ... except the last this many pairs, one group (_cta_coords)
        num_ctas: Int32,  # persistent: the grid (one CTA per SM, at most one per tile); else unused
        split_items: Int32,  # split_tail: the last this many work tiles run as pieces (0: none)
        split_ways: Int32,  # ... of this many pieces each
        aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7,  # captured mod tensors, None when unused
        # capture_slots: fp32 gradient buffers shaped like those slots' tensors, contiguous,
        # zeroed (the kernel adds into them); None when unused
        grad0, grad1, grad2, grad3,
        stream,
    ):
        aux = (aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7)[: self.num_aux]
        capture_bufs = (grad0, grad1, grad2, grad3)[: len(self.capture_slots)]
        score_aux, mask_aux = aux[: self.num_score_aux], aux[self.num_score_aux :]
        # Kernel views: sequence first, head dim second (the (M|N, K) order wgmma and TMA tile).
        # Packed sequences get a unit batch mode, so indexing is the dense path's; batches are
        # then row offsets (domain_offset) into the packed rows.
        unit = cute.make_layout(1, stride=0)

        def view(t, varlen_modes, dense_modes):
            if const_expr(self.varlen):
                return cute.make_tensor(t.iterator, cute.append(cute.select(t.layout, varlen_modes), unit))
            return cute.make_tensor(t.iterator, cute.select(t.layout, dense_modes))

        # (S, D, H, B) / varlen (T, D, H, 1)
        mQ, mK, mV, mdO, mdK, mdV = [view(t, [0, 2, 1], [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        if const_expr(self.fused_dq):
            mdQ = view(mdQ, None, [1, 3, 2, 0])
        mLSE2, mDpsum = [view(t, [1, 0], [2, 1, 0]) for t in (mLSE2, mDpsum)]  # (S, H, B) / (T, H, 1)
        mdQacc = view(mdQacc, [1, 2, 0], [2, 3, 1, 0])  # (S, D, H, B) / (T, D, H, 1)

        tm, tn, d, dv, dt = self.tile_m, self.tile_n, self.d, self.dv, self.dtype
        # Shared-memory tiles. Q and dO are read K-major (S, dP) and transposed (dK, dV, full
        # head dim per warpgroup); K is read K-major (S) and transposed with the head dim split
        # between the two warpgroups (dQ), so its swizzle atom may not exceed d / 2.
        # (Narrow: dK / dV split the head dim between the warpgroups, so Q and dO are read
        # transposed in halves too.)
        split = 2 if const_expr(self.narrow) else 1
        sQ_layout = L.smem_layout(dt, tm, d, self.stages, d // split)
        sdO_layout = L.smem_layout(dt, tm, dv, self.stages, dv // split)
        # (dQ split by query rows: each warpgroup reads K transposed in full, any swizzle atom.)
        sK_layout = L.smem_layout(dt, tn, d, None, d if const_expr(self.dq_split_rows) else d // 2)
        sV_layout = L.smem_layout(dt, tn, dv, None, dv)
        # dS^T as (keys, queries), queries contiguous: the accumulator's adjacent columns land in
        # one 32-bit store, and dQ = dS K reads it as an MN-major A operand. Double-buffered
        # (narrow: slot 0 holds P^T, slot 1 dS^T, both read K-major as the A of dV / dK).
        sdS_layout = L.smem_layout(dt, tn, tm, 2, tm)
        if const_expr(self.dq_transposed):
            # dQ^T: dS as (queries, keys), keys contiguous (128-byte swizzle), read K-major as
            # dQ^T's B operand and written by transposing stmatrix.
            sdS_layout = L.smem_layout(dt, tm, tn, 2, tn)
        # dQ staging, one fp32 slab per consumer warpgroup, reduced into the fp32 global buffer
        # by one TMA add per slab (no per-element atomics): (tile_m, d/2) when the warpgroups
        # split the head dim, (tile_m/2, d) when they split the query rows (tile_m = 128).
        sdQ_layout = L.smem_layout(Float32, *self._dq_slab(), None, self._dq_slab()[1])
        tma_dQ, tdQ = cpasync.make_tiled_tma_atom(cpasync.CopyReduceBulkTensorTileS2GOp(), mdQacc, sdQ_layout,
                                                  self._dq_slab())
        load = functools.partial(cpasync.make_tiled_tma_atom, cpasync.CopyBulkTensorTileG2SOp())
        # fused_dq: a finished query tile of the fp32 buffer, loaded whole into a plain row-major
        # staging tile for the converter warps (their 16-byte reads are conflict-free)
        fused = None
        if const_expr(self.fused_dq):
            tma_cvt, tCvt = load(mdQacc, cute.make_layout((tm, d), stride=(d, 1)), (tm, d))
            fused = (tma_cvt, tCvt, mdQ)

        tma_Q, tQ = load(mQ, cute.select(sQ_layout, mode=[0, 1]), (tm, d))
        tma_dO, tdO = load(mdO, cute.select(sdO_layout, mode=[0, 1]), (tm, dv))
        tma_K, tK = load(mK, sK_layout, (tn, d))
        tma_V, tV = load(mV, sV_layout, (tn, dv))
        # dK / dV leave through the K / V buffers (free once the walk is over) and one TMA store
        # each, not direct stores of the accumulators (NOTES Experiment 37). Varlen keeps the
        # direct stores (a whole tile would overwrite the next sequence's first rows), and so do
        # the 64-key variants (their head-dim split does not partition the K buffer's layout).
        tma_dK = tma_dV = None
        if const_expr(self.stage_dkdv):
            tma_dK, mdK = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mdK, sK_layout, (tn, d))
            tma_dV, mdV = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mdV, sV_layout, (tn, dv))
        tma_LSE, tLSE = load(mLSE2, cute.make_layout(tm), (tm,))
        tma_Dp, tDp = load(mDpsum, cute.make_layout(tm), (tm,))

        K_MAJ, MN_MAJ = OperandMajorMode.K, OperandMajorMode.MN
        if const_expr(self.narrow):
            # S^T / dP^T: the 64 keys by 32 queries per warpgroup; dK / dV: all 64 keys by half
            # the head dim per warpgroup, A (P^T, dS^T) from shared memory.
            mma_SdP = L.make_mma(dt, K_MAJ, K_MAJ, (1, 2, 1), (64, tm // 2))
            mma_dK = L.make_mma(dt, K_MAJ, MN_MAJ, (1, 2, 1), (64, d // 2))
            mma_dV = L.make_mma(dt, K_MAJ, MN_MAJ, (1, 2, 1), (64, dv // 2))
        else:
            # S^T / dP^T: 2 warpgroups stacked along the keys.
            mma_SdP = L.make_mma(dt, K_MAJ, K_MAJ, (2, 1, 1), (64, tm))
            # dK / dV: A (P^T, dS^T) from registers, B = Q / dO transposed (MN-major).
            mma_dK = L.make_mma(dt, K_MAJ, MN_MAJ, (2, 1, 1), (64, d), a_in_registers=True)
            mma_dV = L.make_mma(dt, K_MAJ, MN_MAJ, (2, 1, 1), (64, dv), a_in_registers=True)
        if const_expr(self.dq_split_rows and self.dq_transposed):
            # dQ^T = K^T dS^T: the whole head dim (M) by 64 of the 128 queries (N) per warpgroup
            mma_dQ = L.make_mma(dt, MN_MAJ, K_MAJ, (1, 2, 1), (64, tm // 2))
        elif const_expr(self.dq_split_rows):
            # dQ = dS K: 64 query rows per warpgroup, the whole head dim.
            mma_dQ = L.make_mma(dt, MN_MAJ, MN_MAJ, (2, 1, 1), (64, d))
        elif const_expr(self.dq_transposed):
            # dQ^T = K^T dS^T: half of the head dim (M) per warpgroup, all tile_m queries (N);
            # A = K read transposed (head dim contiguous), B = dS as (queries, keys), K-major.
            mma_dQ = L.make_mma(dt, MN_MAJ, K_MAJ, (2, 1, 1), (64, tm))
        else:
            # dQ = dS K: one 64-row tile, head dim split between the warpgroups.
            mma_dQ = L.make_mma(dt, MN_MAJ, MN_MAJ, (1, 2, 1), (64, d // 2))

        sdQ_elems = 32 if const_expr(self.dq_in_ring) else 2 * cute.cosize(sdQ_layout)  # 32: unused

        class Fields:
            bar_qdo: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            bar_kv: cute.struct.MemRange[cutlass.Int64, 1]
            bar_do: cute.struct.MemRange[cutlass.Int64, self.stages * 2]  # split_ring only
            # persistent only (inside the barriers' 128-byte-aligned block at two stages):
            bar_sched: cute.struct.MemRange[cutlass.Int64, 4]  # tile mailbox: full[2], empty[2]
            bar_kv_empty: cute.struct.MemRange[cutlass.Int64, 1]  # K / V read by both warpgroups
            sched_tile: cute.struct.MemRange[Int32, 2]
            # fused_dq only: the converter's staging-load barrier and the tile it took, the
            # counting warp's mailbox (full[2], empty[2]) and slots
            bar_cvt: cute.struct.MemRange[cutlass.Int64, 1]
            cvt_job: cute.struct.MemRange[Int32, 2]
            bar_cnt: cute.struct.MemRange[cutlass.Int64, 4]
            cnt_slots: cute.struct.MemRange[Int32, 2]
            split_flag: cute.struct.MemRange[Int32, 2]  # split_tail: the piece counter handed round
            # LSE / dPsum stages of tile_m fp32 each: 128-byte multiples, as TMA destinations need
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, tm * self.stages], 128]
            sDp: cute.struct.Align[cute.struct.MemRange[Float32, tm * self.stages], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, sdQ_elems], 1024]

        # the optional buffers exist only where used: D64's fused_dq staging tile fills shared
        # memory to the byte (bwd_config.smem_bytes)
        if const_expr(self.fused_dq):  # the converter warps' fp32 staging tile
            Fields.__annotations__["sCvt"] = cute.struct.Align[cute.struct.MemRange[Float32, tm * d], 1024]
        if const_expr(self.own_dv_stage):  # dV's own staging buffer
            Fields.__annotations__["sdV_out"] = cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
        Storage = cute.struct(Fields)

        batch = mCuK.shape[0] - 1 if const_expr(self.varlen) else mK.shape[3]
        grid = (cute.ceil_div(max_seqlen_k, tn), mK.shape[2], batch)  # (key tile, kv head, batch)
        if const_expr(self.persistent):
            grid = (num_ctas, 1, 1)
        self.kernel(
            (tQ, tK, tV, tdO, tLSE, tDp, tdQ, mdK, mdV),
            (tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dp, tma_dQ, tma_dK, tma_dV),
            mCuQ, mCuK, mSeqUsedK, mSem, (mSplitWs, mSplitCnt, split_items, split_ways),
            (mQNum, mQIdx, mFullQNum, mFullQIdx) if const_expr(self.sparse) else None,
            (sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout),
            (mma_SdP, mma_dK, mma_dV, mma_dQ), (scale, scale_log2, softcap_val, window_left, window_right),
            cta_group, cta_tail, num_ctas, score_aux, mask_aux, fused, capture_bufs, Storage,
        ).launch(grid=grid, block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1, use_pdl=True)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, gmem, tmas, mCuQ, mCuK, mSeqUsedK, mSem, split, q_lists, layouts, mmas, scalars,
               cta_group: Int32, cta_tail: Int32, num_ctas: Int32, score_aux, mask_aux, fused, capture_bufs,
               Storage: cutlass.Constexpr):
        """gmem: the TMA views of Q, K, V, dO, LSE2, dPsum and the dQ buffer, then dK, dV; tmas:
        their atoms; scalars: scale, scale_log2, softcap_val, window_left, window_right."""
        tm = self.tile_m
        sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout = layouts
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if const_expr(not self.persistent):  # (the persistent roles take their tiles in turn)
            n_block, hkv, b = self._cta_coords(cta_group, cta_tail)

        if warp_idx == 0:
            for atom in tmas[:7]:  # (dK, dV: stores, issued once)
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = st.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = st.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = st.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        if const_expr(self.dq_in_ring):
            # fp32 (tile_m, d/2) slabs over each stage of the Q buffer (warpgroup 0) and of the dO
            # buffer (warpgroup 1), with a stride-0 mode standing for the other half of the head
            # dim: a (tile_m, d) accumulator partition then lands each warpgroup in its own slab.
            def ring_slabs(mem, stage_elems):
                lay = cute.append(sdQ_layout.outer, cute.make_layout(2, stride=0))
                lay = cute.append(lay, cute.make_layout(self.stages, stride=stage_elems // 2))
                return mem.get_tensor(lay, swizzle=sdQ_layout.inner, dtype=Float32)

            sdQ = (ring_slabs(st.sQ, self.tile_m * self.d), ring_slabs(st.sdO, self.tile_m * self.dv))
        else:
            sdQ_staged = cute.append(sdQ_layout.outer, cute.make_layout(2, stride=cute.cosize(sdQ_layout)))
            sdQ = st.sdQ.get_tensor(sdQ_staged, swizzle=sdQ_layout.inner)  # (slab rows, cols, wg)
        stat_layout = cute.make_layout((tm, self.stages), stride=(1, tm))
        sLSE, sDp = st.sLSE.get_tensor(stat_layout), st.sDp.get_tensor(stat_layout)

        bytes_q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1])) + tm * 4
        bytes_do = cute.size_in_bytes(self.dtype, cute.select(sdO_layout, mode=[0, 1])) + tm * 4
        bytes_kv = cute.size_in_bytes(self.dtype, sK_layout) + cute.size_in_bytes(self.dtype, sV_layout)

        def ring(barriers, tx_count):  # consumed by the 8 consumer warps
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=barriers.data_ptr(), num_stages=self.stages, tx_count=tx_count,
                defer_sync=True,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8))

        # the stage ring: Q, dO, LSE, dPsum behind one barrier; with split_ring `pipe` holds Q + LSE
        # and `pipe_do` dO + dPsum (same stages, same states)
        if const_expr(self.split_ring):
            pipe, pipe_do = ring(st.bar_qdo, bytes_q), ring(st.bar_do, bytes_do)
        else:
            pipe, pipe_do = ring(st.bar_qdo, bytes_q + bytes_do), None
        bar_kv = st.bar_kv.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(bar_kv, 1)
                if const_expr(self.persistent):
                    init_mailbox(st.bar_sched.data_ptr(), _TILE_READERS)
                    cute.arch.mbarrier_init(st.bar_kv_empty.data_ptr(), 2)  # one per consumer warpgroup
                if const_expr(self.fused_dq):
                    cute.arch.mbarrier_init(st.bar_cvt.data_ptr(), 1)  # the staging load
                    init_mailbox(st.bar_cnt.data_ptr(), 1)  # read by the counting warp
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        # Programmatic dependent launch (`use_pdl`): this grid may start while the row-statistics
        # pass that precedes it still runs. Everything up to here (shared memory, barriers) and the
        # producer's K / V loads overlap its tail; every other global access (LSE / dPsum loads,
        # dQ adds into the buffer that pass zeroes) waits for it. The dQ conversion after this
        # kernel may be scheduled once all of its CTAs are running (it waits for the grid too).
        cute.arch.griddepcontrol_launch_dependents()
        if warp_idx != 0:
            cute.arch.griddepcontrol_wait()

        # what the roles share (kernel's arguments, shared memory, the ring)
        cta = SimpleNamespace(gmem=gmem, tmas=tmas, seqs=(mCuQ, mCuK, mSeqUsedK), mSem=mSem, q_lists=q_lists,
                              smem=(sQ, sK, sV, sdO, sdS, sdQ, sLSE, sDp), mmas=mmas, scalars=scalars,
                              ring=(pipe, pipe_do, bar_kv, bytes_kv), score_aux=score_aux, mask_aux=mask_aux,
                              capture_bufs=capture_bufs)
        if const_expr(not self.persistent):
            tile = self._tile_walk(cta, n_block, hkv, b)
            if warp_idx < 4:
                # ================= producer warpgroup
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    self._produce(cta, tile)
                if const_expr(self.dq_writer_warp):
                    if warp_idx == 1:
                        self._write_dq(cta, tile)
            else:
                # ================= consumer warpgroups
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self._consume(cta, tile, tidx - 128)
        else:
            self._persistent_roles(cta, warp_idx, tidx, num_ctas, cta_group, cta_tail, st, split, sK_layout,
                                   sV_layout, fused)

    # ------------------------------------------------------------------ persistent
    @cute.jit
    def _persistent_roles(self, cta, warp_idx, tidx, num_ctas, cta_group, cta_tail, st, split, sK_layout,
                          sV_layout, fused):
        """The persistent kernel's three roles, each a loop over the work tiles this CTA takes.
        Every role computes a tile's walk itself (the same on every thread), so the producer,
        the consumers and the dQ writer agree on its steps; K / V barrier phases count only the
        tiles with steps (an empty tile loads nothing and stores zeros)."""
        mQ, mK, mSem = cta.gmem[0], cta.gmem[1], cta.mSem
        n_blocks = cute.ceil_div(mK.shape[0], self.tile_n)
        heads, batches = mK.shape[2], mK.shape[3]
        total = n_blocks * heads * batches  # work items (with a split tail, pieces count one each)
        split_items, split_ways = Int32(0), Int32(1)
        if const_expr(self.split_tail):
            split_items, split_ways = split[2], split[3]
            total = total + split_items * (split_ways - 1)
        tiles = (n_blocks, heads, batches, cta_group, cta_tail, split_items, split_ways)
        bar_sched = st.bar_sched.data_ptr()
        bar_kv_empty = st.bar_kv_empty.data_ptr()
        sTile = st.sched_tile.get_tensor(cute.make_layout(2))
        # the tile counter: the semaphore argument's first row's last element (bwd_buffers.persistent_shapes)
        counter = mSem.iterator + cute.crd2idx((0, 0, mSem.shape[2] - 1), mSem.layout)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                t = Int32(cute.arch.block_idx()[0])  # the first tile: this CTA's own
                i = Int32(0)
                kv_iter = Int32(0)
                while t < total:
                    publish_item(bar_sched, sTile, i, t)
                    tile, _, _ = self._work_item(cta, t, tiles)
                    state = self._produce(cta, tile, state, kv_iter, bar_kv_empty)
                    if tile.steps > 0:
                        kv_iter += 1
                    t = next_item(counter, num_ctas)
                    i += 1
                publish_item(bar_sched, sTile, i, t)  # past the last tile: the others stop
            cnt_bar = st.bar_cnt.data_ptr()
            cnt_slots = st.cnt_slots.get_tensor(cute.make_layout(2))
            if warp_idx == 1:
                i = Int32(0)
                passed = Int32(0)  # fused_dq: query tiles handed to the counting warp
                t = read_item(bar_sched, sTile, i)
                while t < total:
                    tile, _, _ = self._work_item(cta, t, tiles)
                    if const_expr(self.fused_dq):
                        n_m = (mSem.shape[2] - 3) // 2
                        passed = self._write_dq(cta, tile, (mSem.shape[1], n_m, cnt_bar, cnt_slots, passed))
                    else:
                        self._write_dq(cta, tile)
                    i += 1
                    t = read_item(bar_sched, sTile, i)
                if const_expr(self.fused_dq):
                    publish_item(cnt_bar, cnt_slots, passed, Int32(-1))  # the counting warp stops
            if const_expr(self.fused_dq):
                window_left, window_right = cta.scalars[3], cta.scalars[4]
                if warp_idx == COUNT_WARP:
                    self._count_dq_tiles(mSem, cnt_bar, cnt_slots, mQ.shape[0], mK.shape[0], window_left, window_right)
                if warp_idx == CVT_WARP:
                    tma_cvt, tCvt, mdQ = fused
                    sCvt = st.sCvt.get_tensor(cute.make_layout((self.tile_m, self.d), stride=(self.d, 1)))
                    self._convert_dq_tiles(tCvt, mdQ, mSem, tma_cvt, sCvt, st.cvt_job.get_tensor(cute.make_layout(2)),
                                           st.bar_cvt.data_ptr(), Int32(0), cta.scalars[0],
                                           tidx - 32 * CVT_WARP)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            sdS = cta.smem[4]
            # dK / dV staged in the dS^T slots: both at once where K and V share one layout (the
            # second slot takes dV in sK's layout, and tma_dV expects sV's) and both fit
            # (BwdConfig.dkdv_share_slots), else one after the other, each in its own layout, or dV
            # in its own buffer (own_dv_stage). K's swizzle follows the dQ operand: 128 bytes at 128
            # queries (dq_split_rows), 64 bytes otherwise, while V's is 128 at D64: the 64-query D64
            # variant staged at once gave a scrambled dV on an H100 (NOTES Exp. 56).
            assert cute.cosize(sdS.layout) >= max(cute.cosize(sK_layout), cute.cosize(sV_layout))
            both = self.dkdv_share_slots or self.own_dv_stage
            if const_expr(self.own_dv_stage):
                s_out = (st.sdS.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
                         st.sdV_out.get_tensor(sV_layout.outer, swizzle=sV_layout.inner))
            elif const_expr(self.dkdv_share_slots):
                assert cute.cosize(sdS.layout) >= 2 * cute.cosize(sK_layout)
                two = cute.append(sK_layout.outer, cute.make_layout(2, stride=cute.cosize(sK_layout)))
                s_pair = st.sdS.get_tensor(two, swizzle=sK_layout.inner)
                s_out = (s_pair[None, None, 0], s_pair[None, None, 1])
            else:
                s_out = (st.sdS.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
                         st.sdS.get_tensor(sV_layout.outer, swizzle=sV_layout.inner))
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            i = Int32(0)
            kv_iter = Int32(0)
            t = read_item(bar_sched, sTile, i)
            split_flag = st.split_flag.get_tensor(cute.make_layout(2))
            while t < total:
                tile, piece, split_index = self._work_item(cta, t, tiles)
                # a piece's end (bwd_consumer): workspace, counters, the shared flag, its place
                piece_end = None
                if const_expr(self.split_tail):
                    piece_end = (split[0], split[1], split_flag, piece, split_index, split_ways)
                state = self._consume(cta, tile, tidx - 128, state, kv_iter, bar_kv_empty, s_out, both,
                                      piece_end)
                if tile.steps > 0:
                    kv_iter += 1
                i += 1
                t = read_item(bar_sched, sTile, i)

    # ------------------------------------------------------------------ helpers
    @cute.jit
    def _tile_walk(self, cta, n_block, hkv, b, piece=None, ways=None) -> WorkTile:
        """Work tile (n_block, hkv, b)'s bookkeeping, the same on every thread. split_tail:
        `piece` >= 0 of `ways` walks its share of the tile's query tiles (consecutive ones; -1:
        the whole tile)."""
        tm, tn = self.tile_m, self.tile_n
        mQ, mK = cta.gmem[0], cta.gmem[1]
        mCuQ, mCuK, mSeqUsedK = cta.seqs
        window_left, window_right = cta.scalars[3], cta.scalars[4]
        q_off, k_off, seqlen_q, seqlen_k, rows_k = key_tile_sequence(mQ, mK, mCuQ, mCuK, mSeqUsedK, b,
                                                                     self.varlen)
        diag = seqlen_k - seqlen_q
        n0 = n_block * tn
        n1 = cutlass.min(n0 + tn, seqlen_k)
        m_lo, n_m = query_tiles_seeing(n0, n1, seqlen_q, diag, window_left, window_right, tm,
                                       self.has_left, self.has_right)
        if n0 >= seqlen_k:
            n_m = Int32(0)
        if const_expr(self.split_tail):
            if piece >= 0:
                first = n_m * piece // ways
                m_lo = m_lo + first
                n_m = n_m * (piece + 1) // ways - first
        if const_expr(self.sparse):
            walk = SparseQWalk(*cta.q_lists, b, hkv, n_block, n0 < seqlen_k, self.group,
                               self.ratio_m, self.ratio_n)
        else:
            walk = DenseQWalk(m_lo, n_m, self.group, self.descending_walk)
        return WorkTile(n_block, hkv, b, q_off, k_off, seqlen_q, seqlen_k, rows_k, diag, walk, walk.count)

    @cute.jit
    def _work_item(self, cta, t, tiles):
        """(WorkTile, piece, split index) of persistent work item t: items below the split tail
        are whole tiles (piece -1); the tail's items are the last `split_items` tiles' pieces,
        piece-fastest (tiles = _persistent_roles' bookkeeping tuple)."""
        n_blocks, heads, batches, cta_group, cta_tail, split_items, ways = tiles
        item = t
        piece = Int32(-1)
        split_index = Int32(0)
        if const_expr(self.split_tail):
            item, piece, split_index = split_unit(t, n_blocks * heads * batches, split_items, ways)
        n_block, hkv, b = self._tile_coords(item, n_blocks, heads, batches, cta_group, cta_tail)
        return self._tile_walk(cta, n_block, hkv, b, piece, ways), piece, split_index

    @cute.jit
    def _cta_coords(self, cta_group, cta_tail):
        """(key tile, kv head, batch) of this CTA. The hardware starts CTAs in linear order (x
        fastest). With cta_group = G that order runs over groups of G (kv head, batch) pairs, key
        tiles outermost within a group: under a causal mask the first key tiles walk the most
        query tiles, so each group's longest CTAs start first (no long CTA left for the tail),
        while the group's CTAs still run together and share the query tiles they load.
        G = 1 is the plain order (one pair's key tiles in a row). The last cta_tail pairs form
        one group of their own whatever G is: only their longest CTAs need to start early, and
        grouping only them keeps the other pairs' CTAs together in L2 (1: no tail group)."""
        bx, by, bz = cute.arch.block_idx()
        n_blocks, heads, batches = cute.arch.grid_dim()
        return self._tile_coords(bx + n_blocks * (by + heads * bz), n_blocks, heads, batches,
                                 cta_group, cta_tail)

    @cute.jit
    def _tile_coords(self, lin, n_blocks, heads, batches, cta_group, cta_tail):
        """(key tile, kv head, batch) of work tile `lin` in the order _cta_coords describes (the
        persistent kernel walks the same order through its tile counter): common.tile_scheduler
        .grouped_order, which orders the forward's work items too."""
        pairs = heads * batches
        n_block, pair = grouped_order(lin, n_blocks, pairs, cta_group, cutlass.max(cta_tail, 1))
        return n_block, pair % heads, pair // heads

    @cute.jit
    def _stat_row_offset(self, q_off, b):
        """Where sequence b's LSE / dPsum rows start. Dense: 0. Varlen: its first row q_off moved
        down to a whole query tile, b tiles further on (the host's copy of this formula:
        bwd_row_stats.stat_row_offsets): a TMA load of fp32 rows must start 16-byte aligned."""
        off = q_off
        if const_expr(self.varlen):
            off = (q_off + b * self.tile_m) // self.tile_m * self.tile_m
        return off

    @cute.jit
    def _head_slice(self, t: cute.Tensor, h, b, off):
        """The (seq, ...) slab of head h, batch b; for varlen, offset to the batch's first row."""
        return head_slab(t, h, b, off, self.varlen)
