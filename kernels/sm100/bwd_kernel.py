"""FlashAttention backward for Blackwell (sm_100a) in CuTe DSL: tcgen05 MMAs with S^T, dP^T, dV, dK
and dQ in tensor memory. Compile-verified only (no Blackwell GPU has run it).

One CTA owns a tile of 128 keys of one KV head and batch and walks every 128-row query tile of
every query head of its GQA group that can see those keys (kernels/sm90/bwd_q_walk.DenseQWalk, as
the sm90 backward; with a block mask SparseQWalk: only the query tiles its transposed lists name).
dV and dK accumulate in tensor memory over the whole walk; dQ of each step is added into an fp32
buffer in global memory by atomics.

Per step (query tile of 128 rows, keys along TMEM lanes: thread i of a warpgroup owns key i):

    S^T  = K Q^T          (SS UMMA, M = keys, N = queries, into TMEM)
    dP^T = V dO^T         (SS UMMA)
    P^T  = exp2(S^T * scale log2 e - LSE2),  dS^T = P^T (dP^T - dPsum)   (compute warps, registers)
    dV  += P^T dO         (TS UMMA: P^T written back as 16-bit over S^T's first columns)
    dK  += dS^T Q         (SS UMMA: dS^T written to shared memory, (keys, queries) K-major)
    dQ   = dS K           (SS UMMA reading the same dS buffer MN-major, into S^T's columns)

The 16-bit operands are read both K-major and MN-major from one shared-memory buffer each: the
sm100 canonical layouts of a (rows, cols) tile K-major and of its transpose MN-major (128-, 64-byte
swizzle atoms) are the same map from (row, col) to bytes, so Q serves S^T (B, K-major) and dK (B,
MN-major), dO serves dP^T and dV, K serves S^T (A) and dQ (B, MN-major), dS^T serves dK (A,
K-major) and dQ (A, MN-major) without copies.

Warp roles (384 threads):
    warps 0-3   compute     per step: LSE / dPsum of the query tile into shared memory, S^T and
                            dP^T chunk by chunk (32 queries) from TMEM, masks / softcap
                            (kernels/sm90/bwd_scores.BwdScores: the sm90 backward's element code),
                            P^T -> TMEM, dS^T -> shared memory; after the walk dV, dK (times the
                            softmax scale) from TMEM to global memory (row predicate per key)
    warps 4-7   dQ          per step: dQ (thread i: query row i) from TMEM to registers, TMEM
                            handed back, then fp32 atomic adds into the dQ buffer (deterministic:
                            in key-tile order, one semaphore per query tile as on sm90)
    warp 8      MMA         issues every tcgen05.mma, owns the TMEM allocation
    warp 9      load        TMA: K and V once, then Q and dO per step into a ring
    warps 10-11 idle
With mods the compute warps take registers from the others (setmaxnreg, bwd_config.REGISTERS).

Tensor memory (columns): S^T | dP^T | dV | dK = 128 + 128 + Dv + D <= 512 for D <= 128; dQ
(128 query lanes x D) reuses S^T's columns: the MMA warp issues dQ after dV (which reads P^T
there) and the next S^T only once the dQ warps have read dQ out (tcgen05 MMAs of one thread run
in issue order).

Handshakes (mbarrier pipelines):
    kv (1 stage), q (Q and dO, `stages`):  TMA -> MMA              (PipelineTmaUmma)
    s:   MMA -> compute "S^T, dP^T ready"; compute -> MMA "P^T, dS^T written"  (PipelineUmmaAsync)
    dq:  MMA -> dQ warps "dQ ready"; dQ warps -> MMA "dQ read out"          (PipelineUmmaAsync)
    acc: MMA -> compute "the walk's last MMA done" (the dK / dV epilogue)
The dS^T buffer is rewritten at step i+1 only after S^T_{i+1} landed, whose commit follows dK_i
and dQ_i (a tcgen05.commit tracks every earlier MMA of its thread).

Math and conventions are the sm90 backward's (kernels/sm90/bwd_kernel.py): the kernel adds the
unscaled dS K; the conversion pass applies the softmax scale to dQ. The element-wise step (softcap,
score_mod and its traced derivative, the causal / window / length masks, mask_mod on a block mask's
partial tiles) is sm90's BwdScores on a one-row fragment of 32 queries. D and Dv (64 / 96 / 128)
may differ: S^T and dK run over D, dP^T and dV over Dv.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass import pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cute.nvgpu.tcgen05.copy import Ld32x32bOp, Repetition, St32x32bOp

from torch_fa4.kernels.common.convert import convert_pairs
from torch_fa4.kernels.sm100.bwd_config import (DQ_WARP0, LOAD_WARP, MMA_WARP, NUM_THREADS, REGISTERS, TILE_M,
                                                TILE_N, Sm100BwdLayout)
from torch_fa4.kernels.sm100.bwd_stores import SWIZZLE_128B, red_add_f32x4, st_shared_v4, swizzle_128b
from torch_fa4.kernels.sm100.tmem import (TMEM_COLUMNS, fence_after_sync, fence_before_sync, setup_tmem,
                                          tmem_copy)
from torch_fa4.kernels.sm100.umma_batch import Umma, umma_batch
from torch_fa4.kernels.common import mod_lowering as mods_dsl
from torch_fa4.kernels.sm90.bwd_q_walk import (DenseQWalk, SparseQWalk, head_slab, key_tile_sequence,
                                               query_tiles_seeing)
from torch_fa4.kernels.sm90.bwd_scores import BwdScores

SMEM_BYTES = 227 * 1024
_CHUNK = 32  # TMEM columns per tcgen05.ld/st (32 queries of S^T / dP^T, 32 columns of dQ / dK / dV)
_P_COLS = _CHUNK // 2  # 16-bit P^T of a 32-query chunk packs into 16 columns
# named barriers (0 is __syncthreads): the compute warpgroup's statistics hand-off, the dQ
# warpgroup's deterministic turn
_BAR_STATS = 1
_BAR_DQ_TURN = 2


class _Tile(NamedTuple):
    """The CTA's key tile and its sequence bookkeeping, the same on every thread."""

    n_block: Int32
    hkv: Int32
    b: Int32
    q_off: Int32  # varlen: the sequence's first packed row (0 dense)
    k_off: Int32
    seqlen_q: Int32
    seqlen_k: Int32  # keys used (seqused_k)
    rows_k: Int32  # rows of this sequence in the k tensor: dK / dV rows to write
    diag: Int32  # seqlen_k - seqlen_q
    stat_off: Int32  # where the sequence's LSE / dPsum rows start
    walk: object  # DenseQWalk / SparseQWalk over the query tiles


class Sm100AttentionBackward(BwdScores):
    def __init__(self, dtype, config, mods=None):
        """dtype: the cutlass input dtype; config: the variant (kernels/sm90/bwd_config.BwdConfig,
        its sm100 reading: bwd_config.Sm100BwdLayout); mods: the torch_fa4.mods.registry.ModSet of
        config.mods_key (None without mods), its graphs inlined as on sm90."""
        c = self.config = config
        self.dtype = dtype
        self.d, self.dv = c.head_dim, c.head_dim_v
        self.lay = self._layout(c)
        self.tile_m, self.tile_n = TILE_M, TILE_N
        # keys an MMA's M spans (this CTA's; the CTA-pair subclass: the pair's), and the dQ columns
        # one dQ thread holds (a whole row; the pair: half)
        self.mma_keys = TILE_N
        self.dq_cols = self.d
        self.group = c.group
        self.varlen, self.softcap, self.deterministic = c.varlen, c.softcap, c.deterministic
        self.has_right, self.has_left = c.has_right, c.has_left
        # keys past seqlen_k (zero-filled tail, the next sequence, the unused cache) are masked
        self.mask_k = c.varlen or c.seqused_k or c.mask_key_tail
        # score_mod / mask_mod and their derivative, as the sm90 backward reads them (BwdScores)
        (self.score_graph, self.mask_graph, self.grad_graph, self.num_score_aux,
         self.num_aux) = mods_dsl.backward_mods(mods)
        self.captured = ()  # (no captured-tensor gradients here: the PyTorch path computes them)
        # block-sparse walk: a block-mask tile is ratio_m query steps by ratio_n key tiles
        self.sparse = c.sparse is not None
        self.ratio_m, self.ratio_n = c.sparse if c.sparse is not None else (1, 1)
        assert not self.sparse or self.mask_graph is not None, "a block mask needs its mask_mod"
        assert not (self.sparse and c.deterministic), "deterministic mode walks densely"
        # registers moved to the compute warps (bwd_config.REGISTERS) where mods add per-score work:
        # at an even 168 per thread the ALiBi + document block mask variant spilled 27 local loads /
        # stores, rebalanced 12 (per-step scalars). Without mods 168 suffice, and rebalancing
        # would spill one pre-split scalar (4 local loads / stores)
        self.rebalance = mods is not None
        assert self.lay.tmem_columns <= TMEM_COLUMNS

    def _layout(self, config) -> Sm100BwdLayout:
        """Tiles and TMEM columns of this kernel (the CTA-pair subclass: its own)."""
        return Sm100BwdLayout.of(config)

    # ------------------------------------------------------------------ host side (jit)
    def _mmas(self):
        dt, one = self.dtype, tcgen05.CtaGroup.ONE
        K_MAJ, MN_MAJ = OperandMajorMode.K, OperandMajorMode.MN
        make = sm100_utils.make_trivial_tiled_mma
        sdp = make(dt, dt, K_MAJ, K_MAJ, Float32, one, (TILE_N, TILE_M))  # S^T, dP^T: (keys, queries)
        dv = make(dt, dt, K_MAJ, MN_MAJ, Float32, one, (TILE_N, self.dv), tcgen05.OperandSource.TMEM)
        dk = make(dt, dt, K_MAJ, MN_MAJ, Float32, one, (TILE_N, self.d))
        dq = make(dt, dt, MN_MAJ, MN_MAJ, Float32, one, (TILE_M, self.d))
        return sdp, dv, dk, dq

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,  # (B, S, H, D) or (T, H, D)
        mLSE2: cute.Tensor,  # (B, Hq, Sq_pad) or (Hq, rows): lse * log2(e), +inf for empty rows
        mDpsum: cute.Tensor,  # same shape: rowsum(dO * O)
        mdQacc: cute.Tensor,  # (B, Hq, Sq, D) (any strides) or (Hq, Tq, D) fp32, zeroed
        mdK: cute.Tensor, mdV: cute.Tensor,  # shapes of k, v
        mdQ, mCuQ, mCuK, mSeqUsedK,
        mSem,  # deterministic: (B, Hq, n_m_blocks) int32 semaphores, zeroed; else None
        mSplitWs, mSplitCnt, mQNum, mQIdx, mFullQNum, mFullQIdx,  # (sm90's arguments; None here)
        scale: Float32, scale_log2: Float32, softcap_val: Float32,
        window_left: Int32, window_right: Int32, max_seqlen_k: Int32,
        cta_group: Int32, cta_tail: Int32, num_ctas: Int32, split_items: Int32, split_ways: Int32,
        aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7,
        stream,
    ):
        aux = (aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7)[: self.num_aux]
        score_aux, mask_aux = aux[: self.num_score_aux], aux[self.num_score_aux:]
        q_lists = (mQNum, mQIdx, mFullQNum, mFullQIdx) if const_expr(self.sparse) else None
        mQ, mK, mV, mdO, mdK, mdV, mLSE2, mDpsum, mdQacc = self._gmem_views(
            mQ, mK, mV, mdO, mdK, mdV, mLSE2, mDpsum, mdQacc)

        dt, d, dv, stages = self.dtype, self.d, self.dv, self.lay.stages
        sdp_mma, dv_mma, dk_mma, dq_mma = self._mmas()
        sdp_tiler = (TILE_N, TILE_M, d)
        sdp_v_tiler = (TILE_N, TILE_M, dv)
        make_a, make_b = sm100_utils.make_smem_layout_a, sm100_utils.make_smem_layout_b
        # each buffer, as the operand that loads it (TMA) and as its transposed reading
        sK_layout = make_a(sdp_mma, sdp_tiler, dt, 1)  # S^T's A: (keys, D) K-major
        sKt_layout = make_b(dq_mma, (TILE_M, d, TILE_N), dt, 1)  # dQ's B: (D, keys) MN-major
        sV_layout = make_a(sdp_mma, sdp_v_tiler, dt, 1)
        sQ_layout = make_b(sdp_mma, sdp_tiler, dt, stages)  # S^T's B: (queries, D) K-major
        sQt_layout = make_b(dk_mma, (TILE_N, d, TILE_M), dt, stages)  # dK's B: (D, queries) MN-major
        sdO_layout = make_b(sdp_mma, sdp_v_tiler, dt, stages)
        sdOt_layout = make_b(dv_mma, (TILE_N, dv, TILE_M), dt, stages)  # dV's B
        sdS_layout = make_a(dk_mma, (TILE_N, d, TILE_M), dt, 1)  # dK's A: dS^T (keys, queries) K-major
        sdSt_layout = make_a(dq_mma, (TILE_M, d, TILE_N), dt, 1)  # dQ's A: dS (queries, keys) MN-major
        tP_layout = make_a(dv_mma, (TILE_N, dv, TILE_M), dt, 1)  # dV's A: P^T in TMEM

        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (sdp_mma.thr_id.shape,)).shape
        load_op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        first = lambda layout: cute.select(layout, mode=[0, 1, 2])  # noqa: E731
        tma_a, tma_b = cute.nvgpu.make_tiled_tma_atom_A, cute.nvgpu.make_tiled_tma_atom_B
        tma_K, tK = tma_a(load_op, mK, first(sK_layout), sdp_tiler, sdp_mma, cluster)
        tma_V, tV = tma_a(load_op, mV, first(sV_layout), sdp_v_tiler, sdp_mma, cluster)
        tma_Q, tQ = tma_b(load_op, mQ, first(sQ_layout), sdp_tiler, sdp_mma, cluster)
        tma_dO, tdO = tma_b(load_op, mdO, first(sdO_layout), sdp_v_tiler, sdp_mma, cluster)
        bytes_kv = cute.size_in_bytes(dt, first(sK_layout)) + cute.size_in_bytes(dt, first(sV_layout))
        bytes_qdo = cute.size_in_bytes(dt, first(sQ_layout)) + cute.size_in_bytes(dt, first(sdO_layout))

        @cute.struct
        class Storage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_s: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dq: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_acc: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_base: Int32
            # the step's LSE2 / dPsum per query, double-buffered (compute warps)
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, 2 * TILE_M], 128]
            sDp: cute.struct.Align[cute.struct.MemRange[Float32, 2 * TILE_M], 128]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_layout)], 1024]

        # the dS^T stores apply this swizzle by hand (bwd_stores.swizzle_128b)
        assert str(sdS_layout.inner).startswith(SWIZZLE_128B), sdS_layout.inner
        assert Storage.size_in_bytes() <= SMEM_BYTES, f"{Storage.size_in_bytes()} bytes of shared memory"
        batch = mCuK.shape[0] - 1 if const_expr(self.varlen) else mK.shape[3]
        grid = (cute.ceil_div(max_seqlen_k, TILE_N), mK.shape[2], batch)  # (key tile, kv head, batch)
        self.kernel(
            (tQ, tK, tV, tdO, mLSE2, mDpsum, mdQacc, mdK, mdV),
            (tma_Q, tma_K, tma_V, tma_dO), mCuQ, mCuK, mSeqUsedK, mSem,
            (sK_layout, sKt_layout, sV_layout, sQ_layout, sQt_layout, sdO_layout, sdOt_layout, sdS_layout,
             sdSt_layout, tP_layout),
            (sdp_mma, dv_mma, dk_mma, dq_mma), (scale, scale_log2, softcap_val, window_left, window_right),
            bytes_kv, bytes_qdo, Storage, q_lists, score_aux, mask_aux,
        ).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

    def _gmem_views(self, mQ, mK, mV, mdO, mdK, mdV, mLSE2, mDpsum, mdQacc):
        """The kernel's views, sequence first, batch last (varlen: a unit batch): Q, K, V, dO, dK,
        dV (S, D, H, B) / (T, D, H, 1), LSE2, dPsum (S, H, B) / (T, H, 1), the dQ buffer
        (S, D, H, B) / (T, D, H, 1)."""
        unit = cute.make_layout(1, stride=0)

        def view(t, varlen_modes, dense_modes):
            if const_expr(self.varlen):
                return cute.make_tensor(t.iterator, cute.append(cute.select(t.layout, varlen_modes), unit))
            return cute.make_tensor(t.iterator, cute.select(t.layout, dense_modes))

        rows = [view(t, [0, 2, 1], [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        stats = [view(t, [1, 0], [2, 1, 0]) for t in (mLSE2, mDpsum)]
        return (*rows, *stats, view(mdQacc, [1, 2, 0], [2, 3, 1, 0]))

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, gmem, tmas, mCuQ, mCuK, mSeqUsedK, mSem, layouts, mmas, scalars,
               bytes_kv: cutlass.Constexpr[int], bytes_qdo: cutlass.Constexpr[int],
               Storage: cutlass.Constexpr, q_lists, score_aux, mask_aux):
        (sK_layout, sKt_layout, sV_layout, sQ_layout, sQt_layout, sdO_layout, sdOt_layout, sdS_layout,
         sdSt_layout, tP_layout) = layouts
        sdp_mma, dv_mma, dk_mma, dq_mma = mmas
        n_block, hkv, b = cute.arch.block_idx()
        tile = self._tile(gmem, mCuQ, mCuK, mSeqUsedK, q_lists, n_block, hkv, b, scalars)
        # a key tile past the sequence's rows (varlen grids are sized for the longest): the whole
        # CTA leaves before any barrier
        if n_block * TILE_N < tile.rows_k:
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tidx, _, _ = cute.arch.thread_idx()
            steps = tile.walk.count
            if warp_idx == LOAD_WARP:
                for atom in tmas:
                    cpasync.prefetch_descriptor(atom)

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(Storage)
            pipe_kv, pipe_q, pipe_s, pipe_dq, pipe_acc = self._pipelines(storage, bytes_kv, bytes_qdo)

            tmem = setup_tmem(storage.tmem_base, warp_idx == MMA_WARP)

            def smem_view(buf, layout):
                return cute.make_tensor(cute.recast_ptr(buf.iterator, layout.inner), layout.outer)

            sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
            sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
            sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
            smem_ops = (sK, smem_view(sK, sKt_layout), sV, sQ, smem_view(sQ, sQt_layout), sdO,
                        smem_view(sdO, sdOt_layout), sdS, smem_view(sdS, sdSt_layout))
            stats = (storage.sLSE.get_tensor(cute.make_layout((TILE_M, 2))),
                     storage.sDp.get_tensor(cute.make_layout((TILE_M, 2))))
            cols = self.lay.columns()
            acc = self._tmem_tensors(tmem, cols, mmas)

            regs_compute, regs_dq, regs_other = REGISTERS
            if warp_idx < DQ_WARP0:
                if const_expr(self.rebalance):
                    cute.arch.setmaxregister_increase(regs_compute)
                self.compute_role(acc, sdS, stats, pipe_s, pipe_acc, gmem, tile, scalars,
                                  (score_aux, mask_aux), tidx % 128)
            elif warp_idx < MMA_WARP:
                if const_expr(self.rebalance):
                    cute.arch.setmaxregister_decrease(regs_dq)
                self.dq_role(acc, pipe_dq, gmem, mSem, tile, scalars, tidx % 128)
            else:
                if const_expr(self.rebalance):
                    cute.arch.setmaxregister_decrease(regs_other)
                if warp_idx == MMA_WARP:
                    self.mma_role(mmas, smem_ops, tmem, tP_layout, acc, cols, pipe_kv, pipe_q, pipe_s,
                                  pipe_dq, pipe_acc, steps)
                elif warp_idx == LOAD_WARP:
                    self.load_role(gmem, tmas, mmas, sK, sV, sQ, sdO, pipe_kv, pipe_q, tile)

            # every TMEM reader / writer is done: give the columns back
            cute.arch.sync_threads()
            if warp_idx == MMA_WARP:
                cute.arch.dealloc_tmem(tmem, TMEM_COLUMNS)

    def _pipelines(self, storage, bytes_kv, bytes_qdo, cluster=None, ctas=1):
        """The kv, q, s, dq and acc pipelines over Storage's barriers (module docstring); the CTA
        pair's span its cluster (`cluster`: its CTA layout), and the compute and dQ warpgroups of
        its `ctas` CTAs arrive on the leader's s / dq barriers."""
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        wg = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128)
        arrivals = pipeline.CooperativeGroup(pipeline.Agent.Thread, ctas * 128)
        pipe_kv = pipeline.PipelineTmaUmma.create(
            num_stages=1, producer_group=one, consumer_group=one, tx_count=bytes_kv,
            barrier_storage=storage.mbar_kv.data_ptr(), cta_layout_vmnk=cluster, defer_sync=True)
        pipe_q = pipeline.PipelineTmaUmma.create(
            num_stages=self.lay.stages, producer_group=one, consumer_group=one, tx_count=bytes_qdo,
            barrier_storage=storage.mbar_q.data_ptr(), cta_layout_vmnk=cluster, defer_sync=True)
        pipe_s, pipe_dq, pipe_acc = (
            pipeline.PipelineUmmaAsync.create(num_stages=1, producer_group=one, consumer_group=group,
                                              barrier_storage=bar.data_ptr(), cta_layout_vmnk=cluster,
                                              defer_sync=True)
            for bar, group in ((storage.mbar_s, arrivals), (storage.mbar_dq, arrivals),
                               (storage.mbar_acc, wg)))
        return pipe_kv, pipe_q, pipe_s, pipe_dq, pipe_acc

    @cute.jit
    def _tile(self, gmem, mCuQ, mCuK, mSeqUsedK, q_lists, n_block, hkv, b, scalars) -> _Tile:
        """The key tile's sequence bookkeeping and its walk over query tiles (as the sm90
        backward's _tile_walk: query rows that see any key of [n0, n1))."""
        mQ, mK = gmem[0], gmem[1]
        window_left, window_right = scalars[3], scalars[4]
        q_off, k_off, seqlen_q, seqlen_k, rows_k = key_tile_sequence(mQ, mK, mCuQ, mCuK, mSeqUsedK, b,
                                                                     self.varlen)
        diag = seqlen_k - seqlen_q
        n0 = self._first_key(n_block)
        n1 = cutlass.min(n0 + self.mma_keys, seqlen_k)
        m_lo, n_m = query_tiles_seeing(n0, n1, seqlen_q, diag, window_left, window_right, TILE_M,
                                       self.has_left, self.has_right)
        if n0 >= seqlen_k:
            n_m = Int32(0)
        stat_off = q_off
        if const_expr(self.varlen):  # bwd_row_stats.stat_row_offsets
            stat_off = (q_off + b * TILE_M) // TILE_M * TILE_M
        if const_expr(self.sparse):
            walk = SparseQWalk(*q_lists, b, hkv, n_block, n0 < seqlen_k, self.group, self.ratio_m,
                               self.ratio_n)
        else:
            walk = DenseQWalk(m_lo, n_m, self.group)
        return _Tile(n_block, hkv, b, q_off, k_off, seqlen_q, seqlen_k, rows_k, diag, stat_off, walk)

    def _first_key(self, n_block):
        """The first key of the MMAs' key span (the walk sees any key of it)."""
        return n_block * TILE_N

    def _tmem_tensors(self, tmem, cols, mmas):
        """Accumulators in TMEM: S^T, dP^T (keys x queries), dV, dK (keys x head dim), dQ (queries x
        head dim, at cols["dq"]: over S^T's columns). The CTA pair's are its halves of the pair's
        (keys: the pair's)."""
        sdp_mma, dv_mma, dk_mma, dq_mma = mmas
        keys = self.mma_keys

        def acc(mma, shape, col):
            thr = mma.get_slice(0)
            layout = thr.make_fragment_C(thr.partition_shape_C(shape)).layout
            return cute.make_tensor(tmem + col, layout)

        return (acc(sdp_mma, (keys, TILE_M), cols["s"]), acc(sdp_mma, (keys, TILE_M), cols["dp"]),
                acc(dv_mma, (keys, self.dv), cols["dv"]), acc(dk_mma, (keys, self.d), cols["dk"]),
                acc(dq_mma, (TILE_M, self.d), cols["dq"]))

    @cute.jit
    def _head_rows(self, t: cute.Tensor, h, b, off):
        """The (seq, ...) slab of head h, batch b, offset to the sequence's first row (varlen)."""
        return head_slab(t, h, b, off, self.varlen)

    # ------------------------------------------------------------------ load warp
    @cute.jit
    def load_role(self, gmem, tmas, mmas, sK, sV, sQ, sdO, pipe_kv, pipe_q, tile: _Tile):
        mQ, mK, mV, mdO = gmem[0], gmem[1], gmem[2], gmem[3]
        tma_Q, tma_K, tma_V, tma_dO = tmas
        thr = mmas[0].get_slice(0)
        d, dv = self.d, self.dv
        walk = tile.walk
        if walk.count > 0:
            mK_cur = self._head_rows(mK, tile.hkv, tile.b, tile.k_off)
            mV_cur = self._head_rows(mV, tile.hkv, tile.b, tile.k_off)
            gK = thr.partition_A(cute.local_tile(mK_cur, (TILE_N, d), (None, 0)))
            gV = thr.partition_A(cute.local_tile(mV_cur, (TILE_N, dv), (None, 0)))
            tKs, tKg = cpasync.tma_partition(tma_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                                             cute.group_modes(gK, 0, 3))
            tVs, tVg = cpasync.tma_partition(tma_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
                                             cute.group_modes(gV, 0, 3))
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_kv.producer_acquire(kv_state)
            bar = pipe_kv.producer_get_barrier(kv_state)
            cute.copy(tma_K, tKg[None, tile.n_block], tKs[None, 0], tma_bar_ptr=bar)
            cute.copy(tma_V, tVg[None, tile.n_block], tVs[None, 0], tma_bar_ptr=bar)

            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.lay.stages)
            cur_h, cur_m = walk.start()
            for step in cutlass.range(walk.count, unroll=1):
                h_local, m_block, _ = walk.at(step, cur_h, cur_m)
                cur_h, cur_m = walk.advance(cur_h, cur_m)
                h = tile.hkv * self.group + h_local
                mQ_cur = self._head_rows(mQ, h, tile.b, tile.q_off)
                mdO_cur = self._head_rows(mdO, h, tile.b, tile.q_off)
                gQ = thr.partition_B(cute.local_tile(mQ_cur, (TILE_M, d), (None, 0)))
                gdO = thr.partition_B(cute.local_tile(mdO_cur, (TILE_M, dv), (None, 0)))
                tQs, tQg = cpasync.tma_partition(tma_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                                                 cute.group_modes(gQ, 0, 3))
                tdOs, tdOg = cpasync.tma_partition(tma_dO, 0, cute.make_layout(1),
                                                   cute.group_modes(sdO, 0, 3), cute.group_modes(gdO, 0, 3))
                pipe_q.producer_acquire(q_state)
                bar = pipe_q.producer_get_barrier(q_state)
                cute.copy(tma_Q, tQg[None, m_block], tQs[None, q_state.index], tma_bar_ptr=bar)
                cute.copy(tma_dO, tdOg[None, m_block], tdOs[None, q_state.index], tma_bar_ptr=bar)
                q_state.advance()
            # every ring slot released by the MMA warp (tcgen05.commit arrivals must land before exit)
            pipe_q.producer_tail(q_state)

    # ------------------------------------------------------------------ MMA warp
    @cute.jit
    def mma_role(self, mmas, smem_ops, tmem, a_ops, acc, cols, pipe_kv, pipe_q, pipe_s, pipe_dq, pipe_acc,
                 steps):
        """smem_ops: sK, sKt, sV, sQ, sQt, sdO, sdOt, sdS (dQ's A) and the class's own (here dS^T's
        MN-major view); a_ops: where the A operands of dV and dK live (_mma_a_fragments)."""
        sdp_mma, dv_mma, dk_mma, dq_mma = mmas
        sK, sKt, sV, sQ, sQt, sdO, sdOt = smem_ops[:7]
        tS, tdP, tdV, tdK, tdQ = acc
        thr_sdp, thr_dv, thr_dk, thr_dq = (m.get_slice(0) for m in mmas)
        tSrK = thr_sdp.make_fragment_A(sK)[None, None, None, 0]
        tSrV = thr_sdp.make_fragment_A(sV)[None, None, None, 0]
        tSrQ = thr_sdp.make_fragment_B(sQ)
        tSrdO = thr_sdp.make_fragment_B(sdO)
        tVrdO = thr_dv.make_fragment_B(sdOt)
        tKrQ = thr_dk.make_fragment_B(sQt)
        tVrP, tKrdS, tQrdS, tQrK = self._mma_a_fragments((thr_dv, thr_dk, thr_dq), smem_ops, tmem, a_ops,
                                                         cols)
        if steps > 0:
            Consumer, Producer = pipeline.PipelineUserType.Consumer, pipeline.PipelineUserType.Producer
            kv_state = pipeline.make_pipeline_state(Consumer, 1)
            q_state = pipeline.make_pipeline_state(Consumer, self.lay.stages)
            s_state, dq_state, acc_state = (pipeline.make_pipeline_state(Producer, 1) for _ in range(3))
            pipe_kv.consumer_wait(kv_state)
            pipe_s.producer_acquire(s_state)
            for i in cutlass.range(steps, unroll=1):
                pipe_q.consumer_wait(q_state)
                stage = q_state.index
                pipe_dq.producer_acquire(dq_state)  # dQ_{i-1} read out of S^T's columns
                fence_after_sync()
                self._emit_ummas([Umma(sdp_mma, tS, tSrK, tSrQ[None, None, None, stage], False),
                                  Umma(sdp_mma, tdP, tSrV, tSrdO[None, None, None, stage], False)])
                pipe_s.producer_commit(s_state)
                s_state.advance()
                pipe_s.producer_acquire(s_state)  # P^T, dS^T written
                self._acquire_ds()
                fence_after_sync()
                self._emit_ummas([Umma(dv_mma, tdV, tVrP, tVrdO[None, None, None, stage], i > 0),
                                  Umma(dk_mma, tdK, tKrdS, tKrQ[None, None, None, stage], i > 0),
                                  Umma(dq_mma, tdQ, tQrdS, tQrK, False)])
                pipe_dq.producer_commit(dq_state)
                dq_state.advance()
                pipe_q.consumer_release(q_state)
                q_state.advance()
            pipe_acc.producer_commit(acc_state)

    def _mma_a_fragments(self, thrs, smem_ops, tmem, tP_layout, cols):
        """The MMA fragments of P^T (dV's A), dS^T (dK's A), dS (dQ's A) and K^T (dQ's B)."""
        thr_dv, thr_dk, thr_dq = thrs
        sKt, sdS, sdSt = smem_ops[1], smem_ops[7], smem_ops[8]
        tKrdS = thr_dk.make_fragment_A(sdS)[None, None, None, 0]
        tQrdS = thr_dq.make_fragment_A(sdSt)[None, None, None, 0]
        tQrK = thr_dq.make_fragment_B(sKt)[None, None, None, 0]
        # P^T: the 16-bit A operand of dV in TMEM over the first half of S^T's columns (addresses
        # relative to column 0: the kernel allocates all 512 columns, whose base is lane 0, column 0)
        tVrP = thr_dv.make_fragment_A(cute.make_tensor(tmem, tP_layout.outer))[None, None, None, 0]
        tVrP = cute.make_tensor(tVrP.iterator + (Float32.width // self.dtype.width) * cols["s"], tVrP.layout)
        return tVrP, tKrdS, tQrdS, tQrK

    def _emit_ummas(self, batch):
        """Emit a batch of UMMAs (one elected region: umma_batch)."""
        umma_batch(batch)

    def _acquire_ds(self):
        """Between the compute warps' release of P^T / dS^T and the MMAs reading them (the CTA
        pair: the peer's dS stores)."""

    # ------------------------------------------------------------------ compute warpgroup
    @cute.jit
    def compute_role(self, acc, smem_ds, stats, pipe_s, pipe_acc, gmem, tile: _Tile, scalars, aux, tid,
                     rank=0):
        """smem_ds: the shared-memory tiles the step's dS values go to (_write_p_ds)."""
        tS, tdP, tdV, tdK, _ = acc
        mLSE2, mDpsum = gmem[4], gmem[5]
        sLSE, sDp = stats
        scale, scale_log2, softcap_val, window_left, window_right = scalars
        ctx = self._compute_setup(tS, tdP, smem_ds, rank, tid)
        t_key, q_base, chunks, tSt, tdPt, load, regs = ctx[:7]
        row_layout = cute.make_layout((1, _CHUNK))
        # a chunk as BwdScores sees a fragment: element (0, c) is key +0, query +c from the
        # thread's origin (static offsets)
        c0 = cute.make_identity_tensor((1, _CHUNK))
        walk = tile.walk
        key0 = tile.n_block * self.tile_n
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        cur_h, cur_m = walk.start()
        for step in cutlass.range(walk.count, unroll=1):
            h_local, m_block, partial = walk.at(step, cur_h, cur_m)
            cur_h, cur_m = walk.advance(cur_h, cur_m)
            h = tile.hkv * self.group + h_local
            row0 = m_block * TILE_M
            mod_ctx = (tile.b, h, aux[0], aux[1], partial)
            stage = step % 2
            # the query tile's LSE2 / dPsum (padded to whole tiles) into this step's buffer; the
            # buffer's previous readers (two steps back) all passed the last step's barrier
            bi = 0 if const_expr(self.varlen) else tile.b
            stat_row = tile.stat_off + row0 + tid
            sLSE[tid, stage] = mLSE2[stat_row, h, bi]
            sDp[tid, stage] = mDpsum[stat_row, h, bi]
            cute.arch.barrier(barrier_id=_BAR_STATS, number_of_threads=128)
            pipe_s.consumer_wait(s_state)
            fence_after_sync()
            for c in cutlass.range(chunks, unroll=1):
                rS = cute.make_rmem_tensor(regs, Float32)
                rdP = cute.make_rmem_tensor(regs, Float32)
                cute.copy(load, cute.make_tensor(tSt.iterator + c * _CHUNK, tSt.layout), rS)
                cute.copy(load, cute.make_tensor(tdPt.iterator + c * _CHUNK, tdPt.layout), rdP)
                cute.arch.fence_view_async_tmem_load()  # registers valid only after wait::ld
                S = cute.make_tensor(rS.iterator, row_layout)
                dP = cute.make_tensor(rdP.iterator, row_layout)
                t_q = self._chunk_query(q_base, c)
                cS = (t_key, t_q, t_q - t_key, c0)
                at = (cS, sLSE, sDp, stage, row0, key0, tile.seqlen_q, tile.seqlen_k, tile.diag, window_left,
                      window_right, scale, scale_log2, softcap_val, mod_ctx)
                self._p_and_ds(S, dP, at)
                self._write_p_ds(rS, rdP, c, t_q, ctx)
            self._release_p_ds()
            fence_before_sync()
            pipe_s.consumer_release(s_state)
            s_state.advance()
        self.dkdv_epilogue(tdV, tdK, pipe_acc, gmem, tile, scale, tid)

    def _compute_setup(self, tS, tdP, smem_ds, rank, tid):
        """(thread tid's key, its first query, chunks per step, the S^T / dP^T partitions, their
        32x32b load and register shape, then what _write_p_ds needs): key tid, all 128 queries."""
        chunk = cute.composition(tS.layout, cute.make_layout((TILE_N, _CHUNK)))
        load = tmem_copy(Ld32x32bOp, Repetition.x32, cute.make_tensor(tS.iterator, chunk))
        thr_load = load.get_slice(tid)
        tSt = thr_load.partition_S(cute.make_tensor(tS.iterator, chunk))
        tdPt = thr_load.partition_S(cute.make_tensor(tdP.iterator, chunk))
        regs = thr_load.partition_D(cute.make_identity_tensor((TILE_N, _CHUNK))).shape
        # P^T: 16-bit values two per column over the first TILE_M / 2 columns of S^T
        p_chunk = cute.composition(tS.layout, cute.make_layout((TILE_N, _P_COLS)))
        store_p = tmem_copy(St32x32bOp, Repetition.x16, cute.make_tensor(tS.iterator, p_chunk))
        thr_store = store_p.get_slice(tid)
        tPt = thr_store.partition_D(cute.make_tensor(tS.iterator, p_chunk))
        p_regs = thr_store.partition_S(cute.make_identity_tensor((TILE_N, _P_COLS))).shape
        # dS^T's raw shared-memory address (the swizzle is applied per store: bwd_stores)
        sdS_base = smem_ds.iterator.toint()
        return tid, 0, TILE_M // _CHUNK, tSt, tdPt, load, regs, store_p, tPt, p_regs, smem_ds, sdS_base

    def _chunk_query(self, q_base, c):
        """The first query of chunk c of the thread's queries."""
        return c * _CHUNK

    def _write_p_ds(self, rS, rdP, c, t_q, ctx):
        """P^T (rS) and dS^T (rdP) of chunk c, queries t_q.. of key ctx[0], where the dV and dK MMAs
        read them."""
        tid = ctx[0]
        store_p, tPt, p_regs, sdS, sdS_base = ctx[7:]
        # P^T chunk (16-bit) over S^T's columns [16c, 16c + 16): read already (chunk c // 2)
        rP = cute.make_rmem_tensor(p_regs, Float32)
        rP16 = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=self.dtype), cute.make_layout(_CHUNK))
        rP16.store(cute.make_tensor(rS.iterator, cute.make_layout(_CHUNK)).load().to(self.dtype))
        cute.copy(store_p, rP, cute.make_tensor(tPt.iterator + c * _P_COLS, tPt.layout))
        # dS^T chunk -> shared memory (key tid, queries 32c ..): 16-byte stores of 8
        # queries each, at the tile's swizzled byte address
        rdS16 = cute.make_rmem_tensor(cute.make_layout(_CHUNK), self.dtype)
        convert_pairs(cute.make_tensor(rdP.iterator, cute.make_layout(_CHUNK)), rdS16)
        rdS32 = cute.recast_tensor(rdS16, Int32)
        for v in range(_CHUNK // 8):
            q = t_q + 8 * v
            elem = cute.crd2idx(((tid, q % 16), 0, q // 16, 0), sdS.layout)
            addr = sdS_base + swizzle_128b(elem * (self.dtype.width // 8))
            st_shared_v4(addr, *(rdS32[4 * v + i] for i in range(4)))

    def _release_p_ds(self):
        """Order the step's P^T / dS^T writes before the MMAs' reads."""
        cute.arch.fence_view_async_tmem_store()
        # the dS^T stores (generic proxy) before the MMA's reads (async proxy)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def dkdv_epilogue(self, tdV, tdK, pipe_acc, gmem, tile: _Tile, scale, tid):
        """Thread tid's key row of dV and dK (times the softmax scale) from TMEM to global memory
        (_acc_cols of each: here the whole row of key tid); zeros where the walk was empty (no
        query sees these keys)."""
        mdK, mdV = gmem[7], gmem[8]
        steps = tile.walk.count
        if steps > 0:
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_acc.consumer_wait(acc_state)
            fence_after_sync()
        key = self._epilogue_key(tile, tid)
        for t_acc, m_out, width, factor in ((tdV, mdV, self.dv, None), (tdK, mdK, self.d, scale)):
            cols = self._acc_cols(width)
            col0 = self._acc_col0(cols, tid)
            tAt, load, regs, thr_load = self._tmem_chunk_load(t_acc, TILE_N, tid)
            g = self._epilogue_rows(m_out, tile, width)
            for j in cutlass.range_constexpr(cols // _CHUNK):
                r = cute.make_rmem_tensor(regs, Float32)
                if steps > 0:
                    cute.copy(load, cute.make_tensor(tAt.iterator + j * _CHUNK, tAt.layout), r)
                    cute.arch.fence_view_async_tmem_load()
                else:
                    r.fill(0.0)
                if const_expr(factor is not None):
                    for k in cutlass.range_constexpr(cute.size(r)):
                        r[k] = r[k] * factor
                self._store_acc_chunk(r, g, thr_load, j, col0, key, tile, tid)

    def _epilogue_key(self, tile: _Tile, tid):
        """The key of thread tid's dK / dV values."""
        return tile.n_block * TILE_N + tid

    def _acc_cols(self, width):
        """The columns of a `width`-column dK / dV row one thread holds."""
        return width

    def _acc_col0(self, cols, tid):
        """The first of those columns."""
        return 0

    def _epilogue_rows(self, m_out, tile: _Tile, width):
        """What _store_acc_chunk writes into: here the key tile's rows of m_out."""
        return cute.local_tile(self._head_rows(m_out, tile.hkv, tile.b, tile.k_off), (TILE_N, width),
                               (tile.n_block, 0))

    @cute.jit
    def _store_acc_chunk(self, r, g, thr_load, j, col0, key, tile: _Tile, tid):
        """Chunk j of thread tid's dK / dV values (fp32 registers r) as 16-bit values into g."""
        r16 = cute.make_rmem_tensor(r.layout, self.dtype)
        r16.store(r.load().to(self.dtype))
        tAg = thr_load.partition_D(cute.local_tile(g, (TILE_N, _CHUNK), (0, j)))
        if key < tile.rows_k:
            cute.autovec_copy(r16, tAg)

    # ------------------------------------------------------------------ dQ warpgroup
    @cute.jit
    def dq_role(self, acc, pipe_dq, gmem, mSem, tile: _Tile, scalars, tid, rank=0):
        """dQ of a step from TMEM into the fp32 buffer: thread tid holds `dq_cols` columns of one
        query row (_dq_origin: which; the whole row of query tid here)."""
        tdQ = acc[4]
        mdQacc = gmem[6]
        window_left = scalars[3]
        d = self.dq_cols
        tQt, load, regs, _ = self._tmem_chunk_load(tdQ, TILE_M, tid)
        walk = tile.walk
        dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        cur_h, cur_m = walk.start()
        for step in cutlass.range(walk.count, unroll=1):
            h_local, m_block, _ = walk.at(step, cur_h, cur_m)
            cur_h, cur_m = walk.advance(cur_h, cur_m)
            h = tile.hkv * self.group + h_local
            pipe_dq.consumer_wait(dq_state)
            fence_after_sync()
            # the whole row into registers first: TMEM goes back to the MMA warp (the next S^T)
            # before the atomics
            rdQ = cute.make_rmem_tensor(cute.make_layout(d), Float32)
            for j in cutlass.range_constexpr(d // _CHUNK):
                r = cute.make_rmem_tensor(regs, Float32)
                cute.copy(load, cute.make_tensor(tQt.iterator + j * _CHUNK, tQt.layout), r)
                cute.arch.fence_view_async_tmem_load()
                for k in cutlass.range_constexpr(_CHUNK):
                    rdQ[j * _CHUNK + k] = r[k]
            fence_before_sync()
            pipe_dq.consumer_release(dq_state)
            dq_state.advance()
            if const_expr(self.deterministic):
                self._wait_turn(mSem, tile, h, m_block, window_left, tid)
            row = self._dq_row(m_block, rank, tid)
            if row < tile.seqlen_q:
                g = self._head_rows(mdQacc, h, tile.b, tile.q_off)
                row_addr = (g.iterator + cute.crd2idx((row, self._dq_col0(tid)), g.layout)).toint()
                for k in cutlass.range_constexpr(0, d, 4):  # (the buffer's rows are 16-byte aligned)
                    red_add_f32x4(row_addr + 4 * k, *(rdQ[k + i] for i in range(4)))
            if const_expr(self.deterministic):
                self._pass_turn(mSem, tile, h, m_block, tid)

    def _tmem_chunk_load(self, t, rows, tid):
        """(thread tid's partition of accumulator t's first _CHUNK columns, the 32x32b load, its
        register fragment's shape, the thread's slice of the load): advance the partition's
        iterator by the column."""
        chunk = cute.composition(t.layout, cute.make_layout((rows, _CHUNK)))
        load = tmem_copy(Ld32x32bOp, Repetition.x32, cute.make_tensor(t.iterator, chunk))
        thr_load = load.get_slice(tid)
        part = thr_load.partition_S(cute.make_tensor(t.iterator, chunk))
        regs = thr_load.partition_D(cute.make_identity_tensor((rows, _CHUNK))).shape
        return part, load, regs, thr_load

    def _dq_row(self, m_block, rank, tid):
        """The query row of thread tid's dQ values (rank: the CTA's in its cluster)."""
        return m_block * TILE_M + tid

    def _dq_col0(self, tid):
        """The first of thread tid's dq_cols dQ columns."""
        return 0

    @cute.jit
    def _wait_turn(self, mSem, tile: _Tile, h, m_block, window_left, tid):
        """Thread 0 spins until every earlier key tile that reaches query tile m_block has added its
        dQ (each bumps the semaphore by 1), then the warpgroup goes on (sm90's order)."""
        first = Int32(0)
        if const_expr(self.has_left):
            first = cutlass.max(m_block * TILE_M + tile.diag - window_left, 0) // TILE_N
        target = tile.n_block - first
        if tid == 0:
            ptr = mSem.iterator + cute.crd2idx((tile.b, h, m_block), mSem.layout)
            seen = cute.arch.atomic_add(ptr, Int32(0), sem="acquire", scope="gpu")
            while seen < target:
                seen = cute.arch.atomic_add(ptr, Int32(0), sem="acquire", scope="gpu")
        cute.arch.barrier(barrier_id=_BAR_DQ_TURN, number_of_threads=128)

    @cute.jit
    def _pass_turn(self, mSem, tile: _Tile, h, m_block, tid):
        """After every thread's adds: count this key tile's dQ of query tile m_block as added."""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=_BAR_DQ_TURN, number_of_threads=128)
        if tid == 0:
            ptr = mSem.iterator + cute.crd2idx((tile.b, h, m_block), mSem.layout)
            cute.arch.atomic_add(ptr, Int32(1), sem="release", scope="gpu")
