"""FlashAttention backward for Blackwell (sm_100a) on CTA pairs: cta_group::2 tcgen05 MMAs whose M
spans the keys of a cluster of two CTAs. Compile-verified only (no Blackwell GPU has run it).

Everything but the MMA / memory pipeline is the 1-CTA kernel's (kernels/sm100/bwd_kernel.py, this
class's base): the walk over query tiles, the per-score element code (sm90's BwdScores), the
statistics hand-off and the fp32 dQ atomics. Each CTA owns `keys` keys (bwd_config.pair_keys: 128
at D = 128, 64 at D = 192 / 256); the pair's two CTAs walk the same query tiles (those that see
any of the pair's keys) and the leader CTA (rank 0) issues every MMA for both:

    S^T  = K Q^T     M = the pair's keys, N = 128 queries: each CTA loads K of its keys and Q of
                     64 queries
    dP^T = V dO^T    (the same split)
    dV  += P^T dO    A = P^T of each CTA's keys, B = dO^T split over Dv: each CTA loads Dv / 2
    dK  += dS^T Q    A = dS^T of each CTA's keys, B = Q split over D
    dQ   = dS K      M = 128 queries (64 per CTA), K = the pair's keys: A = dS of the CTA's 64
                     queries by all the pair's keys, B = K^T's D / 2 columns by the same keys

The pair's MMAs read each operand half from one CTA, so every B tile is loaded in two halvings:
Q by queries (S^T) and by D (dK), dO by queries (dP^T) and by Dv (dV), K by keys (S^T's A) and
K^T by D (dQ's B). dQ's A mixes both CTAs' keys: each compute thread writes its dS values of
queries 0-63 into CTA 0's dS tile and of 64-127 into CTA 1's, at its key's place among the pair's
(st.shared::cluster: for D = 128 one of the two stores is remote), before arriving on the
leader's barrier.

Accumulator layouts (tensor memory: bwd_config.py). With 128 keys per CTA (pair M = 256) S^T,
dP^T, dV and dK are the 1-CTA kernel's (lane = key, one row per thread), P^T and dS^T go back to
TMEM as the 16-bit A operands of dV and dK; the pair's dQ (M = 128) is in the half-row layout
(lanes 0-63: the CTA's 64 queries, columns [0, D/2); lanes 64-127: columns [D/2, D)). With 64
keys per CTA (pair M = 128, "narrow") every accumulator is in that half-row layout (thread t: key
t % 64, queries or columns of half t // 64) and P^T / dS^T go to shared memory; at D = Dv = 256
the dS, P^T and dS^T tiles share shared memory with the step's query-split Q and dO halves
(bwd_config.pair_aliases: dead once S^T and dP^T completed, reloaded after the step's last MMA).

Handshakes are the 1-CTA kernel's, pair-wide: the TMA loads of both CTAs complete on the
leader's barriers (expecting both halves' bytes), the leader's commits arrive on both CTAs'
barriers (multicast), and the consumer warps of both CTAs arrive on the leader's barriers (twice
the threads). The dS tiles are rewritten at step i+1 only after S^T_{i+1} landed, whose commit
follows dQ_i (a commit tracks every earlier MMA of its thread), as in the 1-CTA kernel; the pair
leaves through a cluster barrier, so no CTA exits while its peer may still write its shared
memory or arrive on its barriers.

Not here (pair/bwd.py routes them): deterministic dQ (one semaphore count per key tile, on the
1-CTA or portable kernel) and block masks (the sparse walk's tiles are 128 keys).
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass import pipeline
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cute.nvgpu.tcgen05.copy import Ld32x32bOp, Repetition, St32x32bOp
from cutlass.cutlass_dsl import dsl_user_op

from torch_fa4.kernels.common.convert import convert_pairs
from torch_fa4.kernels.sm100.bwd_config import (DQ_WARP0, LOAD_WARP, MMA_WARP, NUM_THREADS, TILE_M,
                                                TILE_N, Sm100BwdLayout, pair_aliases,
                                                pair_registers)
from torch_fa4.kernels.sm100.bwd_kernel import SMEM_BYTES, Sm100AttentionBackward, _Tile
from torch_fa4.kernels.sm100.bwd_stores import SWIZZLE_128B, st_shared_v4, swizzle_128b
from torch_fa4.kernels.sm100.tmem import release_pair_tmem, setup_pair_tmem, tmem_copy, umma

_CHUNK = 32  # TMEM columns per tcgen05.ld/st (as the 1-CTA kernel)
_P_COLS = _CHUNK // 2
_HALF_M = TILE_M // 2  # queries of dQ per CTA
_BAR_STATS = 1
_CLUSTER = (2, 1, 1)


@dsl_user_op
def st_cluster_v4(addr: Int32, rank: Int32, a: Int32, b: Int32, c: Int32, d: Int32, *,
                  loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> None:
    """16 bytes to the shared memory of CTA `rank` of the cluster, at the address `addr` has in
    this CTA (16-byte aligned)."""
    llvm.inline_asm(
        None,
        [Int32(x).ir_value(loc=loc, ip=ip) for x in (addr, rank, a, b, c, d)],
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, $0, $1;\n"
        "st.shared::cluster.v4.b32 [remote], {$2, $3, $4, $5};\n}",
        "r,r,r,r,r,r",
        has_side_effects=True, loc=loc, ip=ip,
    )


def _set_registers(count: int) -> None:
    """setmaxnreg to `count` from the launch's even share (65536 / NUM_THREADS, in steps of 8)."""
    share = 65536 // NUM_THREADS // 8 * 8
    if count > share:
        cute.arch.setmaxregister_increase(count)
    elif count < share:
        cute.arch.setmaxregister_decrease(count)


class Sm100PairAttentionBackward(Sm100AttentionBackward):
    def __init__(self, dtype, config, mods=None):
        super().__init__(dtype, config, mods)
        assert not config.deterministic and config.sparse is None, "the 1-CTA kernel takes these"
        # keys per CTA (bwd_config.pair_keys): 64 above D = 128, every accumulator then in the
        # half-row layout and P^T / dS^T in shared memory ("narrow")
        self.keys = self.tile_n = self.lay.keys
        self.narrow = self.keys < TILE_N
        self.pair_n = self.mma_keys = 2 * self.keys
        self.dq_cols = self.d // 2  # the half-row layout
        # D = Dv = 256: dS, P^T and dS^T over the step's Q and dO halves (bwd_config.pair_aliases)
        self.alias = pair_aliases(self.d, self.dv)
        self.registers = pair_registers(self.d, mods is not None)
        self.rebalance = self.registers is not None

    def _layout(self, config) -> Sm100BwdLayout:
        return Sm100BwdLayout.of(config, ctas=2)

    # ------------------------------------------------------------------ host side (jit)
    def _mmas(self):
        dt, two = self.dtype, tcgen05.CtaGroup.TWO
        K_MAJ, MN_MAJ = OperandMajorMode.K, OperandMajorMode.MN
        make = sm100_utils.make_trivial_tiled_mma
        src = tcgen05.OperandSource.SMEM if self.narrow else tcgen05.OperandSource.TMEM  # P^T, dS^T
        sdp = make(dt, dt, K_MAJ, K_MAJ, Float32, two, (self.pair_n, TILE_M))  # S^T, dP^T
        dv = make(dt, dt, K_MAJ, MN_MAJ, Float32, two, (self.pair_n, self.dv), src)
        dk = make(dt, dt, K_MAJ, MN_MAJ, Float32, two, (self.pair_n, self.d), src)
        dq = make(dt, dt, MN_MAJ, MN_MAJ, Float32, two, (TILE_M, self.d))
        return sdp, dv, dk, dq

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
        mLSE2: cute.Tensor, mDpsum: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
        mdQ, mCuQ, mCuK, mSeqUsedK, mSem,
        mSplitWs, mSplitCnt, mQNum, mQIdx, mFullQNum, mFullQIdx,
        scale: Float32, scale_log2: Float32, softcap_val: Float32,
        window_left: Int32, window_right: Int32, max_seqlen_k: Int32,
        cta_group: Int32, cta_tail: Int32, num_ctas: Int32, split_items: Int32, split_ways: Int32,
        aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7,
        stream,
    ):
        aux = (aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7)[: self.num_aux]
        score_aux, mask_aux = aux[: self.num_score_aux], aux[self.num_score_aux:]
        mQ, mK, mV, mdO, mdK, mdV, mLSE2, mDpsum, mdQacc = self._gmem_views(
            mQ, mK, mV, mdO, mdK, mdV, mLSE2, mDpsum, mdQacc)
        # the transposed (D, S, H, B) views load the B halves split over the head dim
        mQt, mKt, mdOt = [cute.make_tensor(t.iterator, cute.select(t.layout, [1, 0, 2, 3]))
                          for t in (mQ, mK, mdO)]

        dt, d, dv, stages = self.dtype, self.d, self.dv, self.lay.stages
        sdp_mma, dv_mma, dk_mma, dq_mma = self._mmas()
        pair_n = self.pair_n
        sdp_tiler = (pair_n, TILE_M, d)
        sdp_v_tiler = (pair_n, TILE_M, dv)
        dv_tiler = (pair_n, dv, TILE_M)
        dk_tiler = (pair_n, d, TILE_M)
        dq_tiler = (TILE_M, d, pair_n)
        make_a, make_b = sm100_utils.make_smem_layout_a, sm100_utils.make_smem_layout_b
        sK_layout = make_a(sdp_mma, sdp_tiler, dt, 1)  # (own keys, D) K-major
        sV_layout = make_a(sdp_mma, sdp_v_tiler, dt, 1)
        sQ_layout = make_b(sdp_mma, sdp_tiler, dt, stages)  # (64 queries, D) K-major
        sdO_layout = make_b(sdp_mma, sdp_v_tiler, dt, stages)
        sQt_layout = make_b(dk_mma, dk_tiler, dt, stages)  # (D / 2, 128 queries) MN-major
        sdOt_layout = make_b(dv_mma, dv_tiler, dt, stages)
        sKt_layout = make_b(dq_mma, dq_tiler, dt, 1)  # (D / 2, 256 keys) MN-major
        sdS_layout = make_a(dq_mma, dq_tiler, dt, 1)  # (64 queries, 256 keys) MN-major
        tP_layout = make_a(dv_mma, dv_tiler, dt, 1)  # dV's A: P^T (TMEM; narrow: shared memory)
        tdS_layout = make_a(dk_mma, dk_tiler, dt, 1)  # dK's A: dS^T (likewise)
        # (the P^T / dS^T tiles take shared memory only when narrow)
        # (tiles that live elsewhere keep an 8-element stand-in, unaligned: at D = 256 the storage
        # is within 1 KB of the limit)
        own_p = self.narrow and not self.alias
        p_elems, p_align = (cute.cosize(tP_layout), 1024) if const_expr(own_p) else (8, 16)
        ds_elems = cute.cosize(tdS_layout) if const_expr(own_p) else 8
        dq_a_elems, dq_a_align = (cute.cosize(sdS_layout), 1024) if const_expr(not self.alias) else (8, 16)
        if const_expr(self.alias):  # P^T, dS^T over Q's half, dS over dO's (whole 1024-byte blocks)
            assert self.lay.stages == 1
            assert cute.cosize(tP_layout) + cute.cosize(tdS_layout) <= cute.cosize(sQ_layout)
            assert cute.cosize(sdS_layout) <= cute.cosize(sdO_layout)
            assert cute.cosize(tP_layout) * dt.width // 8 % 1024 == 0

        cluster = cute.tiled_divide(cute.make_layout(_CLUSTER), (sdp_mma.thr_id.shape,)).shape
        load_a = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.TWO)
        load_b = sm100_utils.cluster_shape_to_tma_atom_B(_CLUSTER, sdp_mma.thr_id)
        first = lambda layout: cute.select(layout, mode=[0, 1, 2])  # noqa: E731
        tma_a, tma_b = cute.nvgpu.make_tiled_tma_atom_A, cute.nvgpu.make_tiled_tma_atom_B
        tma_K, tK = tma_a(load_a, mK, first(sK_layout), sdp_tiler, sdp_mma, cluster)
        tma_V, tV = tma_a(load_a, mV, first(sV_layout), sdp_v_tiler, sdp_mma, cluster)
        tma_Q, tQ = tma_b(load_b, mQ, first(sQ_layout), sdp_tiler, sdp_mma, cluster)
        tma_dO, tdO = tma_b(load_b, mdO, first(sdO_layout), sdp_v_tiler, sdp_mma, cluster)
        tma_Qt, tQt = tma_b(load_b, mQt, first(sQt_layout), dk_tiler, dk_mma, cluster)
        tma_dOt, tdOt = tma_b(load_b, mdOt, first(sdOt_layout), dv_tiler, dv_mma, cluster)
        tma_Kt, tKt = tma_b(load_b, mKt, first(sKt_layout), dq_tiler, dq_mma, cluster)
        size = lambda layout: cute.size_in_bytes(dt, first(layout))  # noqa: E731
        # both CTAs' halves complete on the leader's barrier
        bytes_kv = 2 * (size(sK_layout) + size(sV_layout) + size(sKt_layout))
        bytes_qdo = 2 * (size(sQ_layout) + size(sdO_layout) + size(sQt_layout) + size(sdOt_layout))

        @cute.struct
        class Storage:
            # the tiles first (1024-byte aligned from the base), the small fields in the last one's
            # tail: at D = 256 the tiles take 224 of the 227 KB
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
            sKt: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKt_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sQt: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQt_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_layout)], 1024]
            sdOt: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdOt_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, dq_a_elems], dq_a_align]
            sP: cute.struct.Align[cute.struct.MemRange[dt, p_elems], p_align]
            sdSt: cute.struct.Align[cute.struct.MemRange[dt, ds_elems], p_align]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_s: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dq: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_acc: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_base: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, 2 * TILE_M], 128]
            sDp: cute.struct.Align[cute.struct.MemRange[Float32, 2 * TILE_M], 128]

        # the dS (and narrow: P^T, dS^T) stores apply this swizzle by hand (bwd_stores.swizzle_128b)
        assert str(sdS_layout.inner).startswith(SWIZZLE_128B), sdS_layout.inner
        if const_expr(self.narrow):
            assert str(tP_layout.inner).startswith(SWIZZLE_128B), tP_layout.inner
            assert str(tdS_layout.inner).startswith(SWIZZLE_128B), tdS_layout.inner
        assert Storage.size_in_bytes() <= SMEM_BYTES, f"{Storage.size_in_bytes()} bytes of shared memory"
        batch = mCuK.shape[0] - 1 if const_expr(self.varlen) else mK.shape[3]
        pairs = cute.ceil_div(max_seqlen_k, pair_n)
        grid = (2 * pairs, mK.shape[2], batch)  # (key tile: two per pair, kv head, batch)
        self.kernel(
            (tQ, tK, tV, tdO, mLSE2, mDpsum, mdQacc, mdK, mdV, tQt, tKt, tdOt),
            (tma_Q, tma_K, tma_V, tma_dO, tma_Qt, tma_Kt, tma_dOt), mCuQ, mCuK, mSeqUsedK,
            (sK_layout, sV_layout, sKt_layout, sQ_layout, sQt_layout, sdO_layout, sdOt_layout, sdS_layout,
             tP_layout, tdS_layout),
            (sdp_mma, dv_mma, dk_mma, dq_mma), (scale, scale_log2, softcap_val, window_left, window_right),
            bytes_kv, bytes_qdo, Storage, score_aux, mask_aux,
        ).launch(grid=grid, block=[NUM_THREADS, 1, 1], cluster=list(_CLUSTER), stream=stream,
                 min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, gmem, tmas, mCuQ, mCuK, mSeqUsedK, layouts, mmas, scalars,
               bytes_kv: cutlass.Constexpr[int], bytes_qdo: cutlass.Constexpr[int],
               Storage: cutlass.Constexpr, score_aux, mask_aux):
        (sK_layout, sV_layout, sKt_layout, sQ_layout, sQt_layout, sdO_layout, sdOt_layout, sdS_layout,
         tP_layout, tdS_layout) = layouts
        sdp_mma = mmas[0]
        n_block, hkv, b = cute.arch.block_idx()
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        tile = self._tile(gmem, mCuQ, mCuK, mSeqUsedK, None, n_block, hkv, b, scalars)
        # a pair past the sequence's rows: both CTAs leave before any barrier (the test reads the
        # pair's first key, the same on both)
        if n_block // 2 * self.pair_n < tile.rows_k:
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tidx, _, _ = cute.arch.thread_idx()
            steps = tile.walk.count
            if warp_idx == LOAD_WARP:
                for atom in tmas:
                    cpasync.prefetch_descriptor(atom)

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(Storage)
            cluster = cute.tiled_divide(cute.make_layout(_CLUSTER), (sdp_mma.thr_id.shape,))
            pipes = self._pipelines(storage, bytes_kv, bytes_qdo, cluster, ctas=2)  # both CTAs arrive
            pipe_kv, pipe_q, pipe_s, pipe_dq, pipe_acc = pipes

            tmem = setup_pair_tmem(storage.tmem_base, warp_idx == MMA_WARP)

            sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
            sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
            sKt = storage.sKt.get_tensor(sKt_layout.outer, swizzle=sKt_layout.inner)
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sQt = storage.sQt.get_tensor(sQt_layout.outer, swizzle=sQt_layout.inner)
            sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
            sdOt = storage.sdOt.get_tensor(sdOt_layout.outer, swizzle=sdOt_layout.inner)
            sP = sdSt = None
            if const_expr(self.alias):
                def over(buf, elems, layout):  # a tile `elems` 16-bit values into another's storage
                    ptr = cute.recast_ptr(buf.data_ptr() + elems, layout.inner)
                    return cute.make_tensor(ptr, layout.outer)

                sdS = over(storage.sdO, 0, sdS_layout)
                sP = over(storage.sQ, 0, tP_layout)
                sdSt = over(storage.sQ, cute.cosize(tP_layout), tdS_layout)
            else:
                sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
                if const_expr(self.narrow):
                    sP = storage.sP.get_tensor(tP_layout.outer, swizzle=tP_layout.inner)
                    sdSt = storage.sdSt.get_tensor(tdS_layout.outer, swizzle=tdS_layout.inner)
            smem_ops = (sK, sKt, sV, sQ, sQt, sdO, sdOt, sdS)
            stats = (storage.sLSE.get_tensor(cute.make_layout((TILE_M, 2))),
                     storage.sDp.get_tensor(cute.make_layout((TILE_M, 2))))
            cols = self.lay.columns()
            acc = self._tmem_tensors(tmem, cols, mmas)

            regs_compute, regs_dq, regs_other = self.registers if const_expr(self.rebalance) else (0, 0, 0)
            if warp_idx < DQ_WARP0:
                if const_expr(self.rebalance):
                    _set_registers(regs_compute)
                self.compute_role(acc, (sdS, sP, sdSt), stats, pipe_s, pipe_acc, gmem, tile, scalars,
                                  (score_aux, mask_aux), tidx % 128, rank)
            elif warp_idx < MMA_WARP:
                if const_expr(self.rebalance):
                    _set_registers(regs_dq)
                self.dq_role(acc, pipe_dq, gmem, None, tile, scalars, tidx % 128, rank)
            else:
                if const_expr(self.rebalance):
                    _set_registers(regs_other)
                if warp_idx == MMA_WARP:
                    # the leader, rank 0: the block index's parity along the (2, 1, 1) cluster, the
                    # same value as `rank`, which ptxas does not see as warp-uniform (CUDA 12's then
                    # wraps every UMMA in a loop over the lanes)
                    if n_block % 2 == 0:
                        self.mma_role(mmas, smem_ops, tmem, ((tP_layout, tdS_layout), (sP, sdSt)), acc,
                                           cols, pipe_kv, pipe_q, pipe_s, pipe_dq, pipe_acc, steps)
                elif warp_idx == LOAD_WARP:
                    self.pair_load_role(gmem, tmas, mmas, smem_ops, pipe_kv, pipe_q, tile, rank)

            release_pair_tmem(tmem, warp_idx == MMA_WARP)

    def _first_key(self, n_block):
        """The pair's first key (both CTAs walk the query tiles that see any of its keys)."""
        return n_block // 2 * self.pair_n

    def _tmem_chunk_load(self, t, rows, tid):
        """As the 1-CTA kernel's, over TMEM lanes (the pair's accumulators are one CTA's half)."""
        lanes = cute.make_layout((rows, _CHUNK), stride=(1 << 16, 1))  # (TMEM lane, column)
        chunk = cute.make_tensor(t.iterator, lanes)
        load = tmem_copy(Ld32x32bOp, Repetition.x32, chunk)
        thr_load = load.get_slice(tid)
        part = thr_load.partition_S(chunk)
        regs = thr_load.partition_D(cute.make_identity_tensor((rows, _CHUNK))).shape
        return part, load, regs, thr_load

    def _dq_row(self, m_block, rank, tid):
        """dQ of the CTA's 64 queries: thread t holds query t % 64, D columns [D/2 (t // 64), +D/2)
        (the half-row layout)."""
        return m_block * TILE_M + rank * _HALF_M + tid % _HALF_M

    def _dq_col0(self, tid):
        return tid // _HALF_M * self.dq_cols

    @cute.jit
    def _head_cols(self, t: cute.Tensor, h, b, off):
        """The (dim, seq) slab of head h, batch b of a transposed (D, S, H, B) view."""
        bi = 0 if const_expr(self.varlen) else b
        r = t[(None, None, h, bi)]
        if const_expr(self.varlen):
            r = cute.domain_offset((0, off), r)
        return r

    # ------------------------------------------------------------------ load warp (both CTAs)
    @cute.jit
    def pair_load_role(self, gmem, tmas, mmas, smem_ops, pipe_kv, pipe_q, tile: _Tile, rank):
        mQ, mK, mV, mdO = gmem[0], gmem[1], gmem[2], gmem[3]
        mQt, mKt, mdOt = gmem[9], gmem[10], gmem[11]
        tma_Q, tma_K, tma_V, tma_dO, tma_Qt, tma_Kt, tma_dOt = tmas
        sK, sKt, sV, sQ, sQt, sdO, sdOt, _ = smem_ops
        thr_sdp, thr_dv, thr_dk, thr_dq = (m.get_slice(rank) for m in mmas)
        d, dv = self.d, self.dv
        pair = tile.n_block // 2
        walk = tile.walk

        def part(atom, s, g):
            return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 3),
                                         cute.group_modes(g, 0, 3))

        if walk.count > 0:
            gK = thr_sdp.partition_A(cute.local_tile(self._head_rows(mK, tile.hkv, tile.b, tile.k_off),
                                                     (self.pair_n, d), (None, 0)))
            gV = thr_sdp.partition_A(cute.local_tile(self._head_rows(mV, tile.hkv, tile.b, tile.k_off),
                                                     (self.pair_n, dv), (None, 0)))
            gKt = thr_dq.partition_B(cute.local_tile(self._head_cols(mKt, tile.hkv, tile.b, tile.k_off),
                                                     (d, self.pair_n), (0, None)))
            tKs, tKg = part(tma_K, sK, gK)
            tVs, tVg = part(tma_V, sV, gV)
            tKts, tKtg = part(tma_Kt, sKt, gKt)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_kv.producer_acquire(kv_state)
            bar = pipe_kv.producer_get_barrier(kv_state)
            cute.copy(tma_K, tKg[None, pair], tKs[None, 0], tma_bar_ptr=bar)
            cute.copy(tma_V, tVg[None, pair], tVs[None, 0], tma_bar_ptr=bar)
            cute.copy(tma_Kt, tKtg[None, pair], tKts[None, 0], tma_bar_ptr=bar)

            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.lay.stages)
            cur_h, cur_m = walk.start()
            for step in cutlass.range(walk.count, unroll=1):
                h_local, m_block, _ = walk.at(step, cur_h, cur_m)
                cur_h, cur_m = walk.advance(cur_h, cur_m)
                h = tile.hkv * self.group + h_local
                gQ = thr_sdp.partition_B(cute.local_tile(self._head_rows(mQ, h, tile.b, tile.q_off),
                                                         (TILE_M, d), (None, 0)))
                gdO = thr_sdp.partition_B(cute.local_tile(self._head_rows(mdO, h, tile.b, tile.q_off),
                                                          (TILE_M, dv), (None, 0)))
                gQt = thr_dk.partition_B(cute.local_tile(self._head_cols(mQt, h, tile.b, tile.q_off),
                                                         (d, TILE_M), (0, None)))
                gdOt = thr_dv.partition_B(cute.local_tile(self._head_cols(mdOt, h, tile.b, tile.q_off),
                                                          (dv, TILE_M), (0, None)))
                tQs, tQg = part(tma_Q, sQ, gQ)
                tdOs, tdOg = part(tma_dO, sdO, gdO)
                tQts, tQtg = part(tma_Qt, sQt, gQt)
                tdOts, tdOtg = part(tma_dOt, sdOt, gdOt)
                pipe_q.producer_acquire(q_state)
                bar = pipe_q.producer_get_barrier(q_state)
                stage = q_state.index
                cute.copy(tma_Q, tQg[None, m_block], tQs[None, stage], tma_bar_ptr=bar)
                cute.copy(tma_dO, tdOg[None, m_block], tdOs[None, stage], tma_bar_ptr=bar)
                cute.copy(tma_Qt, tQtg[None, m_block], tQts[None, stage], tma_bar_ptr=bar)
                cute.copy(tma_dOt, tdOtg[None, m_block], tdOts[None, stage], tma_bar_ptr=bar)
                q_state.advance()
            pipe_q.producer_tail(q_state)

    # ------------------------------------------------------------------ MMA warp (leader CTA)
    def _mma_a_fragments(self, thrs, smem_ops, tmem, a_ops, cols):
        """dS (dQ's A) and K^T (dQ's B) from shared memory; P^T and dS^T: 16-bit A operands in TMEM
        over S^T's and dP^T's first columns (addresses relative to column 0 of the 512-column
        allocation); narrow: from shared memory."""
        thr_dv, thr_dk, thr_dq = thrs
        (tP_layout, tdS_layout), smem_a = a_ops
        tQrdS = thr_dq.make_fragment_A(smem_ops[7])[None, None, None, 0]
        tQrK = thr_dq.make_fragment_B(smem_ops[1])[None, None, None, 0]
        if const_expr(self.narrow):
            tVrP = thr_dv.make_fragment_A(smem_a[0])[None, None, None, 0]
            tKrdS = thr_dk.make_fragment_A(smem_a[1])[None, None, None, 0]
        else:
            per_col = Float32.width // self.dtype.width
            tVrP = thr_dv.make_fragment_A(cute.make_tensor(tmem, tP_layout.outer))[None, None, None, 0]
            tVrP = cute.make_tensor(tVrP.iterator + per_col * cols["s"], tVrP.layout)
            tKrdS = thr_dk.make_fragment_A(cute.make_tensor(tmem, tdS_layout.outer))[None, None, None, 0]
            tKrdS = cute.make_tensor(tKrdS.iterator + per_col * cols["dp"], tKrdS.layout)
        return tVrP, tKrdS, tQrdS, tQrK

    def _emit_ummas(self, batch):
        """One pair UMMA at a time (tmem.umma; the leader's MMA warp)."""
        for m in batch:
            umma(m.tiled_mma, m.acc, m.a, m.b, m.accumulate)

    def _acquire_ds(self):
        """The peer's dS stores were released at cluster scope: acquire them at that scope."""
        cute.arch.fence_acq_rel_cluster()

    # ------------------------------------------------------------------ compute warpgroup
    def _compute_setup(self, tS, tdP, smem_ds, rank, tid):
        """Thread tid reads TMEM lane tid: key tid and all 128 queries; narrow (the half-row
        layout): key tid % 64 and the 64 queries from (tid // 64) * 64."""
        sdS, sP, sdSt = smem_ds
        t_key = tid % self.keys
        q_base = tid // self.keys * _HALF_M
        chunks = (TILE_M if const_expr(not self.narrow) else _HALF_M) // _CHUNK
        lanes = cute.make_layout((TILE_M, _CHUNK), stride=(1 << 16, 1))  # (TMEM lane, column)
        load = tmem_copy(Ld32x32bOp, Repetition.x32, cute.make_tensor(tS.iterator, lanes))
        thr_load = load.get_slice(tid)
        tSt = thr_load.partition_S(cute.make_tensor(tS.iterator, lanes))
        tdPt = thr_load.partition_S(cute.make_tensor(tdP.iterator, lanes))
        regs = thr_load.partition_D(cute.make_identity_tensor((TILE_M, _CHUNK))).shape
        # P^T over S^T's first columns, dS^T over dP^T's: 16-bit values two per column (not narrow)
        p_lanes = cute.make_layout((TILE_M, _P_COLS), stride=(1 << 16, 1))
        store_p = tmem_copy(St32x32bOp, Repetition.x16, cute.make_tensor(tS.iterator, p_lanes))
        thr_store = store_p.get_slice(tid)
        tPt = thr_store.partition_D(cute.make_tensor(tS.iterator, p_lanes))
        tdSt = thr_store.partition_D(cute.make_tensor(tdP.iterator, p_lanes))
        p_regs = thr_store.partition_S(cute.make_identity_tensor((TILE_M, _P_COLS))).shape
        # dS (dQ's A: 64 queries x the pair's keys per CTA): this thread's key among the pair's
        sdS_base = sdS.iterator.toint()
        pair_key = rank * self.keys + t_key
        return (t_key, q_base, chunks, tSt, tdPt, load, regs, store_p, tPt, tdSt, p_regs, smem_ds, sdS_base,
                pair_key)

    def _chunk_query(self, q_base, c):
        return q_base + c * _CHUNK

    def _write_p_ds(self, rS, rdP, c, t_q, ctx):
        """P^T and dS^T to TMEM (narrow: this CTA's shared memory), dS to the shared memory of the
        CTA owning queries t_q.."""
        t_key = ctx[0]
        store_p, tPt, tdSt, p_regs, (sdS, sP, sdSt), sdS_base, pair_key = ctx[7:]
        rP = cute.make_rmem_tensor(p_regs, Float32)
        as16 = lambda t: cute.make_tensor(cute.recast_ptr(t.iterator, dtype=self.dtype),  # noqa: E731
                                          cute.make_layout(_CHUNK))
        rP16 = as16(rP)
        rP16.store(cute.make_tensor(rS.iterator, cute.make_layout(_CHUNK)).load().to(self.dtype))
        rdS = cute.make_rmem_tensor(p_regs, Float32)
        rdS16 = as16(rdS)
        convert_pairs(cute.make_tensor(rdP.iterator, cute.make_layout(_CHUNK)), rdS16)
        rP32 = cute.recast_tensor(rP16, Int32)
        rdS32 = cute.recast_tensor(rdS16, Int32)
        if const_expr(self.narrow):
            # P^T and dS^T rows (key t_key, 32 queries) into this CTA's tiles, 16 bytes per store
            for v in range(_CHUNK // 8):
                q = t_q + 8 * v
                elem = cute.crd2idx(((t_key, q % 16), 0, q // 16, 0), sP.layout)
                off = swizzle_128b(elem * (self.dtype.width // 8))
                st_shared_v4(sP.iterator.toint() + off, *(rP32[4 * v + i] for i in range(4)))
                elem = cute.crd2idx(((t_key, q % 16), 0, q // 16, 0), sdSt.layout)
                off = swizzle_128b(elem * (self.dtype.width // 8))
                st_shared_v4(sdSt.iterator.toint() + off, *(rdS32[4 * v + i] for i in range(4)))
        else:
            # P^T and dS^T (16-bit) over the TMEM columns this chunk's loads have read
            cute.copy(store_p, rP, cute.make_tensor(tPt.iterator + c * _P_COLS, tPt.layout))
            cute.copy(store_p, rdS, cute.make_tensor(tdSt.iterator + c * _P_COLS, tdSt.layout))
        # the same dS values into dQ's A of the CTA owning these queries (0-63: CTA 0,
        # 64-127: CTA 1), 16 bytes of 8 queries per store
        owner = t_q // _HALF_M
        for v in range(_CHUNK // 8):
            q = t_q % _HALF_M + 8 * v
            elem = cute.crd2idx(((q, pair_key % 16), 0, pair_key // 16, 0), sdS.layout)
            addr = sdS_base + swizzle_128b(elem * (self.dtype.width // 8))
            st_cluster_v4(addr, owner, *(rdS32[4 * v + i] for i in range(4)))

    def _release_p_ds(self):
        if const_expr(not self.narrow):
            cute.arch.fence_view_async_tmem_store()
        # the dS stores (generic proxy, either CTA's shared memory) before the MMA's reads
        cute.arch.fence_proxy("async.shared", space="cluster")
        # and ordered, at cluster scope, before the arrive on the leader's barrier (a remote
        # arrive releases at CTA scope only)
        cute.arch.fence_acq_rel_cluster()

    def _epilogue_key(self, tile: _Tile, tid):
        """Key tid; narrow (the half-row layout): key tid % 64, half the columns (_acc_cols)."""
        return tile.n_block * self.keys + tid % self.keys

    def _acc_cols(self, width):
        return width // 2 if const_expr(self.narrow) else width

    def _acc_col0(self, cols, tid):
        return tid // self.keys * cols

    def _epilogue_rows(self, m_out, tile: _Tile, width):
        return self._head_rows(m_out, tile.hkv, tile.b, tile.k_off)

    @cute.jit
    def _store_acc_chunk(self, r, g, thr_load, j, col0, key, tile: _Tile, tid):
        r16 = cute.make_rmem_tensor(cute.make_layout(_CHUNK), self.dtype)
        r16.store(cute.make_tensor(r.iterator, cute.make_layout(_CHUNK)).load().to(self.dtype))
        if key < tile.rows_k:
            gt = cute.local_tile(g, (self.keys, _CHUNK), (tile.n_block, col0 // _CHUNK + j))
            cute.autovec_copy(r16, gt[tid % self.keys, None])
