"""The sm90 backward's consumer warpgroups: per step S^T, dP^T, P, dS, then dV, dK and dQ, with dK
and dV kept in registers over the walk and stored once at its end (bwd_kernel.py has the whole
picture; bwd_scores.py forms P and dS, bwd_dq.py moves dQ into the fp32 buffer)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common import split_tail
from ..common import static_layout as SL
from ..common import wgmma
from ..common.acc_layout import a_operand, rows_cols
from . import bwd_layouts as L


class BwdConsumer:
    """Consumer-warpgroup methods of Sm90AttentionBackward (a mixin: they read its configuration)."""

    @cute.jit
    def _release_stage(self, pipe, pipe_do, state):
        """Hand the ring stage `state` back to the producer (both barriers with split_ring)."""
        pipe.consumer_release(state)
        if const_expr(self.split_ring):
            pipe_do.consumer_release(state)

    @cute.jit
    def _consume(self, cta, tile, ctid, state=None, kv_iter=None, bar_kv_empty=None, s_out=None,
                 both: cutlass.Constexpr = False, piece_end=None):
        """One work tile's steps and its dK / dV. Persistent: `state` carries the ring over tiles
        (returned); K / V are waited for at phase kv_iter and released before the epilogue, which
        stages dK / dV in the dS^T slots (s_out: their (dK, dV) views; `both`: at once).
        split_tail: `piece_end` = (workspace, counters, shared flag, piece, split index, ways);
        a piece (piece >= 0) hands its partial dK / dV to the last piece of its tile, which
        writes the sums (kernels/common/split_tail.finish_sum_piece)."""
        mdQacc, mdK, mdV = cta.gmem[6:]
        tma_dQ, tma_dK, tma_dV = cta.tmas[6:]
        sQ, sK, sV, sdO, sdS, sdQ, sLSE, sDp = cta.smem
        pipe, pipe_do, bar_kv, _ = cta.ring
        mma_SdP, mma_dK, mma_dV, mma_dQ = cta.mmas
        scale, scale_log2, softcap_val, window_left, window_right = cta.scalars
        mSem, score_aux, mask_aux = cta.mSem, cta.score_aux, cta.mask_aux
        n_block, hkv, b, q_off, k_off, seqlen_q, seqlen_k, rows_k, diag, walk, steps = tile
        tm, tn, d, dv = self.tile_m, self.tile_n, self.d, self.dv
        # The warpgroup index, known to the compiler as warp-uniform: shared-memory operand
        # descriptors depend only on it, so their per-k-block arithmetic stays in uniform
        # registers (UIADD3.64) instead of 64-bit vector adds + R2UR moves every step.
        wg = cute.arch.make_warp_uniform(ctid // 128)
        thr_SdP, thr_dK, thr_dV, thr_dQ = (mma.get_slice(ctid) for mma in cta.mmas)
        # Slices for shared-memory (descriptor) operands: every thread of a warpgroup holds the
        # same descriptors, so the warpgroup's first thread stands for all of them.
        wg_thr = wg * 128
        ops_SdP, ops_dK, ops_dV, ops_dQ = (mma.get_slice(wg_thr) for mma in cta.mmas)

        # Operand fragments (descriptors over shared memory).
        tSrK = ops_SdP.make_fragment_A(ops_SdP.partition_A(sK))
        tSrQ = ops_SdP.make_fragment_B(ops_SdP.partition_B(sQ))  # (.., .., .., stage)
        tPrV = ops_SdP.make_fragment_A(ops_SdP.partition_A(sV))
        tPrdO = ops_SdP.make_fragment_B(ops_SdP.partition_B(sdO))
        tdVrdO = ops_dV.make_fragment_B(ops_dV.partition_B(L.transposed(sdO)))
        tdKrQ = ops_dK.make_fragment_B(ops_dK.partition_B(L.transposed(sQ)))
        if const_expr(self.dq_transposed):
            tdQrK = ops_dQ.make_fragment_A(ops_dQ.partition_A(L.transposed(sK)))  # (d, keys)
            tdQrdS = ops_dQ.make_fragment_B(ops_dQ.partition_B(sdS))  # (queries, keys)
            sdS = L.transposed(sdS)  # (keys, queries) from here on, as S^T's accumulator
        else:
            tdQrdS = ops_dQ.make_fragment_A(ops_dQ.partition_A(L.transposed(sdS)))
            tdQrK = ops_dQ.make_fragment_B(ops_dQ.partition_B(L.transposed(sK)))
        tdSsdS = thr_SdP.partition_C(sdS)  # where this thread's dS^T goes
        st_atom = thr_st_dS = tdSsdS_st = dS_slot_stride = dS_thread_offsets = None
        if const_expr(not self.narrow):
            # stmatrix: one shared-memory address per four 8x8 tiles instead of one per 32-bit
            # store (ptxas hoists the swizzled addresses out of the loop and spills them otherwise)
            st_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.dq_transposed, 4), self.dtype)
            st_dS = cute.make_tiled_copy_C(st_atom, mma_SdP)
            thr_st_dS = st_dS.get_slice(ctid)
            tdSsdS_st = thr_st_dS.partition_D(sdS)
            # static byte offset of every consumer thread's first stmatrix row in a dS^T slot
            ident_dS = cute.make_identity_tensor((tn, tm))
            sdS_slot = sdS[None, None, 0]
            dS_slot_stride = int(cute.crd2idx((0, 0, 1), sdS.layout))  # elements between slots
            slot_index = SL.indexer(sdS_slot.layout)
            dS_thread_offsets = tuple(slot_index(c) * 2 for c in SL.first_coords_copy_D(st_dS, 256, ident_dS))
        tdVrP = tdKrdS = None
        if const_expr(self.narrow):  # dV, dK take P^T (slot 0) and dS^T (slot 1) from smem
            tdVrP = ops_dV.make_fragment_A(ops_dV.partition_A(sdS))[None, None, None, 0]
            tdKrdS = ops_dK.make_fragment_A(ops_dK.partition_A(sdS))[None, None, None, 1]
        tdQsdQ_q = tdQsdQ_do = tdQsdQ = sdQ_wg = None
        prev_stage = Int32(0)  # dq_in_ring: the stage the previous step's dQ went through
        if const_expr(self.dq_in_ring):  # (.., stage) partitions; slab 0 of each for the TMA
            tdQsdQ_q = thr_dQ.partition_C(cute.group_modes(sdQ[0], 1, 3))
            tdQsdQ_do = thr_dQ.partition_C(cute.group_modes(sdQ[1], 1, 3))
        else:
            # The two dQ slabs seen as one (tile_m, d) tile: column c lives in slab c // (d/2)
            # (row r in slab r // (tile_m/2) when the warpgroups split the rows), so each
            # warpgroup's accumulator lands in its own slab.
            if const_expr(self.dq_split_rows and self.dq_transposed):
                # the (d, tile_m) tile of dQ^T: query q of slab q // (tile_m/2), transposed
                half = tm // 2
                sdQ_tile = cute.composition(sdQ, cute.make_layout((d, (half, 2)), stride=(half, (1, half * d))))
            elif const_expr(self.dq_split_rows):
                half = tm // 2
                rows_split = cute.make_layout(((half, 2), d), stride=((1, half * d), half))
                sdQ_tile = cute.composition(sdQ, rows_split)
            elif const_expr(self.dq_transposed):
                # the (d, tile_m) tile of dQ^T: head-dim column c of slab c // (d/2), transposed
                half = d // 2
                sdQ_tile = cute.composition(sdQ, cute.make_layout(((half, 2), tm), stride=((tm, tm * half), 1)))
            else:
                sdQ_tile = cute.group_modes(sdQ, 1, 3)
            tdQsdQ = thr_dQ.partition_C(sdQ_tile)
            sdQ_wg = sdQ[None, None, wg]
            # Byte offset of every consumer thread's first dQ element in the (1024-aligned) slabs,
            # static: lets copy_to_swizzled derive its store bases from one swizzled address.
            ident_dq = cute.make_identity_tensor(self._dq_acc_tile())
            tile_index = SL.indexer(sdQ_tile.layout)
            self._dq_thread_offsets = tuple(tile_index(c) * 4 for c in SL.first_coords_mma_C(mma_dQ, 256, ident_dq))
        # Without the writer warp, the first warp of each warpgroup issues its TMA reduction. A
        # whole warp, not one thread: the TMA copy elects its issuing lane with a warp-synchronous
        # instruction.
        is_leader = (ctid % 128) // 32 == 0

        acc_dK = cute.make_rmem_tensor(thr_dK.partition_shape_C((tn, d)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dV.partition_shape_C((tn, dv)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # (key, query) coordinates of this thread's S^T elements, in rows/cols order, split into
        # the thread's offset (t_key, t_q: two registers) and the static per-value offsets of
        # thread 0 (c0): coordinate (r, c) = (t_key + c0[r, c][0], t_q + c0[r, c][1]). Keeps the
        # masks' per-element tests to one compare with an immediate each.
        ident = cute.make_identity_tensor((tn, tm))
        c_thr = rows_cols(thr_SdP.partition_C(ident))
        c0 = rows_cols(mma_SdP.get_slice(0).partition_C(ident))
        t_key = c_thr[0, 0][0] - c0[0, 0][0]
        t_q = c_thr[0, 0][1] - c0[0, 0][1]
        cS = (t_key, t_q, t_q - t_key, c0)

        if steps > 0:
            cute.arch.mbarrier_wait(bar_kv, kv_iter % 2 if const_expr(self.persistent) else 0)
        if const_expr(state is None):
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        cur_h, cur_m = walk.start()
        # What every step reads and no step changes (_step unpacks it in this order).
        ops = (
            acc_dK, acc_dV, b, cS, ctid, dS_slot_stride, dS_thread_offsets, diag, hkv, is_leader,
            mSem, mask_aux, mdQacc, mma_SdP, mma_dK, mma_dQ, mma_dV, n_block, pipe, pipe_do,
            q_off, sDp, sLSE, scale, scale_log2, score_aux, sdQ, sdQ_wg, seqlen_k,
            seqlen_q, softcap_val, st_atom, tPrV, tPrdO, tSrK, tSrQ, tdKrQ, tdKrdS, tdQrK, tdQrdS,
            tdQsdQ, tdQsdQ_do, tdQsdQ_q, tdSsdS, tdSsdS_st, tdVrP, tdVrdO, thr_SdP, thr_dQ,
            thr_st_dS, tm, tma_dQ, tn, walk, wg, window_left, window_right, cta.capture_bufs,)
        if const_expr(not self.split_mask_loops):
            for step in cutlass.range(steps, unroll=1):
                state, cur_h, cur_m, prev_stage = self._step(
                    step, None, (state, cur_h, cur_m, prev_stage), ops)
        else:
            state, cur_h, cur_m, prev_stage = self._masked_and_unmasked_steps(
                tile, window_left, window_right, (state, cur_h, cur_m, prev_stage), ops)
        if const_expr(not self.dq_writer_warp):
            if is_leader:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem must outlive the last read

        # ---- epilogue: dK (scaled), dV in the input dtype. Every row this sequence owns in the
        # k tensor is written (zeros past seqlen_k); rows of the next sequence are left alone.
        gdK = cute.local_tile(self._head_slice(mdK, hkv, b, k_off), (tn, d), (n_block, 0))
        gdV = cute.local_tile(self._head_slice(mdV, hkv, b, k_off), (tn, dv), (n_block, 0))
        if const_expr(self.persistent):
            # K / V are free for the next tile's load once this warpgroup's last products landed
            if steps > 0:
                if ctid % 128 == 0:
                    cute.arch.mbarrier_arrive(bar_kv_empty)
            writes = Boolean(True)  # this CTA writes the tile's dK / dV
            if const_expr(piece_end is not None):
                ws, counters, flag, piece, split_index, ways = piece_end
                if piece >= 0:  # (the consumers' own barrier, as in _store_via_smem)
                    writes = split_tail.finish_sum_piece(ws, counters, flag, piece, split_index, ways, ctid, 256,
                                                         (acc_dK, acc_dV), 1)
            if writes:
                # dK / dV through the dS^T slots (_store_via_smem waits until both warpgroups are
                # past their last dQ, which reads them); the next tile's dS^T may go there only
                # once the TMA stores have read them
                self._store_via_smem(acc_dK, thr_dK, s_out[0], tma_dK, gdK, scale, ctid)
                if const_expr(not both):
                    if ctid // 32 == 0:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                self._store_via_smem(acc_dV, thr_dV, s_out[1], tma_dV, gdV, Float32(1.0), ctid)
                if ctid // 32 == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
        elif const_expr(not self.stage_dkdv):
            self._store_rows(acc_dK, thr_dK.partition_C(gdK), thr_dK.partition_C(cute.make_identity_tensor((tn, d))), rows_k - n_block * tn, scale)
            self._store_rows(acc_dV, thr_dV.partition_C(gdV), thr_dV.partition_C(cute.make_identity_tensor((tn, dv))), rows_k - n_block * tn, Float32(1.0))
        else:
            # TMA drops the rows past the tensor's end; rows past seqused_k hold zeros
            self._store_via_smem(acc_dK, thr_dK, sK, tma_dK, gdK, scale, ctid)
            self._store_via_smem(acc_dV, thr_dV, sV, tma_dV, gdV, Float32(1.0), ctid)
            if ctid // 32 == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem must outlive the reads
        return state

    @cute.jit
    def _masked_and_unmasked_steps(self, tile, window_left, window_right, carry, ops):
        """split_mask_loops: each head's steps as up to three loops, so the steps that cross no
        length / causal / window limit (all but one or two per head under a causal mask) run a
        body with no mask code and no per-step test, and the others one that masks without
        testing (NOTES Experiment 124). Every head of the GQA group walks the same query tiles, so
        the loops' bounds hold for each."""
        walk = tile.walk
        lo, hi = self._unmasked_query_tiles(tile.n_block, tile.seqlen_q, tile.seqlen_k, tile.diag,
                                            window_left, window_right)
        m_end = walk.m_lo + walk.n_m
        lo = cutlass.min(cutlass.max(lo, walk.m_lo), m_end)
        hi = cutlass.min(cutlass.max(hi, lo), m_end)
        # walk order: descending, the tiles from hi up come first, then [lo, hi), then below lo
        first = lo - walk.m_lo
        if const_expr(self.descending_walk):
            first = m_end - hi
        bounds = (first, first + hi - lo, walk.n_m)
        if const_expr(self.group == 1):
            carry = self._head_steps(Int32(0), bounds, carry, ops)
        else:
            for h_local in cutlass.range(self.group, unroll=1):
                carry = self._head_steps(h_local * walk.n_m, bounds, carry, ops)
        return carry

    @cute.jit
    def _head_steps(self, base, bounds, carry, ops):
        """One head's steps base + [0, bounds[0]) masked, [bounds[0], bounds[1]) unmasked,
        [bounds[1], bounds[2]) masked; a masked loop that no limit of this variant can fill is
        not compiled (its count is 0: _unmasked_query_tiles leaves lo at 0 / hi past the end)."""
        high = self.has_left or self.varlen  # tiles from hi up can cross
        low = self.has_right or self.mask_k  # tiles below lo can cross
        first_masked, last_masked = (high, low) if self.descending_walk else (low, high)
        if const_expr(first_masked):
            carry = self._steps(base, base + bounds[0], True, carry, ops)
        carry = self._steps(base + bounds[0], base + bounds[1], False, carry, ops)
        if const_expr(last_masked):
            carry = self._steps(base + bounds[1], base + bounds[2], True, carry, ops)
        return carry

    @cute.jit
    def _steps(self, first, end, limits: cutlass.Constexpr, carry, ops):
        """Steps [first, end) of _head_steps, each masking as `limits` says (_step)."""
        state, cur_h, cur_m, prev_stage = carry
        for step in cutlass.range(first, end, unroll=1):
            state, cur_h, cur_m, prev_stage = self._step(step, limits, (state, cur_h, cur_m, prev_stage), ops)
        return state, cur_h, cur_m, prev_stage

    @cute.jit
    def _step(self, step, limits: cutlass.Constexpr, carry, ops):
        """One step of a work tile's walk: S^T, dP^T, P, dS, dV, dK, dQ of one query tile. `limits`:
        None tests per step whether the tile crosses a length / causal / window limit, True masks
        without testing, False never masks (_masked_and_unmasked_steps knows which steps those
        are). `carry`: what passes from step to step, returned updated."""
        state, cur_h, cur_m, prev_stage = carry
        (acc_dK, acc_dV, b, cS, ctid, dS_slot_stride, dS_thread_offsets, diag, hkv, is_leader,
         mSem, mask_aux, mdQacc, mma_SdP, mma_dK, mma_dQ, mma_dV, n_block, pipe, pipe_do,
         q_off, sDp, sLSE, scale, scale_log2, score_aux, sdQ, sdQ_wg, seqlen_k, seqlen_q,
         softcap_val, st_atom, tPrV, tPrdO, tSrK, tSrQ, tdKrQ, tdKrdS, tdQrK, tdQrdS, tdQsdQ,
         tdQsdQ_do, tdQsdQ_q, tdSsdS, tdSsdS_st, tdVrP, tdVrdO, thr_SdP, thr_dQ, thr_st_dS, tm,
         tma_dQ, tn, walk, wg, window_left, window_right, capture_bufs,) = ops
        h_local, m_block, partial = walk.at(step, cur_h, cur_m)
        cur_h, cur_m = walk.advance(cur_h, cur_m)
        h = hkv * self.group + h_local
        stage = state.index
        pipe.consumer_wait(state)

        acc_S, acc_dP = (cute.make_rmem_tensor(thr_SdP.partition_shape_C((tn, tm)), Float32) for _ in range(2))
        lse_vals = dpsum_vals = None
        if const_expr(self.prefetch_stats):
            # before the products' wgmmas: loads issued behind them wait in the same queue
            lse_vals = self._column_stats(sLSE, cS, stage, rows_cols(acc_S))
            dpsum_vals = self._column_stats(sDp, cS, stage, rows_cols(acc_S))
        if const_expr(self.fold_dpsum):
            dP_init = rows_cols(acc_dP)
            for c in cutlass.range_constexpr(cute.size(dP_init, mode=[1])):
                for r in cutlass.range_constexpr(cute.size(dP_init, mode=[0])):
                    dP_init[r, c] = -dpsum_vals[c]
        wgmma.issue(mma_SdP, acc_S, tSrK, tSrQ[None, None, None, stage], True)
        if const_expr(self.split_ring):
            pipe_do.consumer_wait(state)  # dO, dPsum of this stage
        wgmma.issue(mma_SdP, acc_dP, tPrV, tPrdO[None, None, None, stage], not self.fold_dpsum)
        if const_expr(self.dq_in_ring):
            # The previous step's dQ add has read its stage by now (it ran while these
            # products were issued): hand that stage back, so the producer loads the next
            # step during this one.
            if is_leader:
                if step > 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    pipe.consumer_release(pipeline.PipelineState(self.stages, Int32(0), prev_stage, Int32(0)))
        S, dP = rows_cols(acc_S), rows_cols(acc_dP)
        row0 = m_block * tm  # query index of column 0
        key0 = n_block * tn
        rP, rdS = cute.make_rmem_tensor_like(acc_S, self.dtype), cute.make_rmem_tensor_like(acc_dP, self.dtype)
        mod_ctx = (b, h, score_aux, mask_aux, partial, capture_bufs)
        # what P / dS read besides the products (bwd_scores)
        at = (cS, sLSE, sDp, stage, row0, key0, seqlen_q, seqlen_k, diag, window_left, window_right, scale,
              scale_log2, softcap_val, mod_ctx)
        buf = 1  # the dS^T slot dQ reads (narrow: fixed; below: alternating)
        if const_expr(self.narrow):
            # Both products landed, then P and dS in one pass (each warpgroup: 32 queries).
            warpgroup.wait_group(0)
            self._p_and_ds(S, dP, at, limits=limits)
            rP.store(acc_S.load().to(self.dtype))
            rdS.store(acc_dP.load().to(self.dtype))
            # The other warpgroup may still read the previous step's P^T / dS^T (its dV, dK,
            # dQ); after this barrier both have waited for those products.
            cute.arch.barrier(barrier_id=1, number_of_threads=256)
            cute.autovec_copy(rP, tdSsdS[None, None, None, 0])
            cute.autovec_copy(rdS, tdSsdS[None, None, None, 1])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=1, number_of_threads=256)
            wgmma.issue(mma_dV, acc_dV, tdVrP, tdVrdO[None, None, None, stage], False)
            wgmma.issue(mma_dK, acc_dK, tdKrdS, tdKrQ[None, None, None, stage], False)
        elif const_expr(self.p_under_dp or self.one_pass):
            if const_expr(self.p_under_dp):
                # P (fp32, in place) while dP^T is still on the tensor cores; dS from it once
                # dP^T landed; the bf16 P and dV only then: while dP^T is in flight only S^T,
                # dP^T and dK, dV are live (and the dPsum values are loaded after it landed).
                warpgroup.wait_group(1)
                self._p_and_ds(S, None, at, limits=limits)
                warpgroup.wait_group(0)
                dpsum_vals = self._column_stats(sDp, cS, stage, S)
                for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                    for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                        dP[r, c] = S[r, c] * (dP[r, c] - dpsum_vals[c])
            else:
                # tanh' / score_mod' is needed for dS: P and dS in one pass once both landed.
                warpgroup.wait_group(0)
                self._p_and_ds(S, dP, at, limits=limits)
            rP.store(acc_S.load().to(self.dtype))
            rdS.store(acc_dP.load().to(self.dtype))
            if const_expr(not self.dv_after_ds):
                wgmma.issue(mma_dV, acc_dV, a_operand(rP), tdVrdO[None, None, None, stage], False)
        else:
            # P while dP^T is still on the tensor cores; dS while dV is.
            warpgroup.wait_group(1)
            self._p_and_ds(S, None, at, lse_vals, limits=limits)
            rP.store(acc_S.load().to(self.dtype))
            # dV += P^T dO  (P^T straight from registers)
            wgmma.issue(mma_dV, acc_dV, a_operand(rP), tdVrdO[None, None, None, stage], False)
            warpgroup.wait_group(1)
            for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                    dP[r, c] = S[r, c] * dP[r, c]  # dP^T started at -dPsum (fold_dpsum)
            rdS.store(acc_dP.load().to(self.dtype))

        if const_expr(not self.narrow):
            # dS^T -> shared memory (buffer step % 2), visible to the tensor cores of both WGs.
            buf = step % 2
            L.copy_atom_to_swizzled(st_atom, 8, thr_st_dS.retile(rdS), tdSsdS_st[None, None, None, 0],
                                    dS_thread_offsets, (buf, dS_slot_stride))
            if const_expr(self.dv_after_ds):
                # dV += P^T dO while the stmatrix stores drain
                wgmma.issue(mma_dV, acc_dV, a_operand(rP), tdVrdO[None, None, None, stage], False)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=1, number_of_threads=256)

        acc_dQ = cute.make_rmem_tensor(thr_dQ.partition_shape_C(self._dq_acc_tile()), Float32)
        dq_at = (tma_dQ, mdQacc, mSem, h, b, q_off, m_block, n_block, wg, diag, window_left, is_leader)
        if const_expr(self.dq_transposed):
            wgmma.issue(mma_dQ, acc_dQ, tdQrK, tdQrdS[None, None, None, buf], True)
        else:
            wgmma.issue(mma_dQ, acc_dQ, tdQrdS[None, None, None, buf], tdQrK, True)
        if const_expr(self.dq_under_dk):
            # dK += dS^T Q behind dQ; dQ's epilogue while dK runs; Q's stage is free after dK
            wgmma.issue(mma_dK, acc_dK, a_operand(rdS), tdKrQ[None, None, None, stage], False)
            warpgroup.wait_group(1)
            rdQ = cute.make_rmem_tensor_like(acc_dQ, Float32)
            rdQ.store(acc_dQ.load())
            self._dq_out(rdQ, tdQsdQ, sdQ_wg, dq_at)
            warpgroup.wait_group(0)
            self._release_stage(pipe, pipe_do, state)
            state.advance()
        else:
            warpgroup.wait_group(0)
            if const_expr(not self.dq_in_ring):
                self._release_stage(pipe, pipe_do, state)  # Q, dO, LSE, dPsum are consumed
            state.advance()
            # dQ -> this warpgroup's smem slab -> one TMA add into the fp32 buffer. Rows
            # past seqlen_q (varlen: the next sequence) hold exact zeros (P = 0 there), so adding
            # the whole tile is harmless.
            rdQ = cute.make_rmem_tensor_like(acc_dQ, Float32)
            rdQ.store(acc_dQ.load())
            if const_expr(self.dq_in_ring):
                # Into this stage's Q (warpgroup 0) / dO (warpgroup 1) buffer, once both
                # warpgroups' dK and dV have read them.
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                if wg == 0:
                    self._stage_and_add_dq(rdQ, tdQsdQ_q[None, None, None, stage],
                                           sdQ[0][None, None, 0, stage], dq_at)
                else:
                    self._stage_and_add_dq(rdQ, tdQsdQ_do[None, None, None, stage],
                                           sdQ[1][None, None, 0, stage], dq_at)
                if (ctid % 128) // 32 != 0:  # leader warps release it next step, once the add read it
                    pipe.consumer_release(pipeline.PipelineState(self.stages, Int32(0), stage, Int32(0)))
                prev_stage = stage
                cute.arch.sync_warp()  # reconverge before the back edge (see below)
            else:
                self._dq_out(rdQ, tdQsdQ, sdQ_wg, dq_at)
                # Reconverge the warp before the back edge: with the leader-only TMA region
                # last in the body, ptxas keeps the loop's bookkeeping (stage, phase, walk
                # cursor) in vector registers and rebuilds every stage-indexed descriptor
                # with vector math + R2UR.
                cute.arch.sync_warp()
        return state, cur_h, cur_m, prev_stage

    @cute.jit
    def _store_via_smem(self, acc, thr, s_tile, tma_store, g_tile, factor, ctid):
        """A (keys, head dim) accumulator of both consumer warpgroups -> `s_tile` (the K or V
        buffer, in the input dtype) -> one TMA store into `g_tile`, issued by the first consumer
        warp (which must wait for the read before the CTA exits)."""
        # every consumer is past its last product reading the buffer (S^T and dQ read K, dP^T V)
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        r = cute.make_rmem_tensor_like(acc, self.dtype)
        r.store((acc.load() * factor).to(self.dtype))
        L.copy_to_swizzled(r, thr.partition_C(s_tile))
        cute.arch.fence_proxy("async.shared", space="cta")  # generic-proxy writes before the TMA read
        cute.arch.barrier(barrier_id=1, number_of_threads=256)
        if ctid // 32 == 0:
            one = cute.make_layout(1)
            tS, tG = cpasync.tma_partition(tma_store, 0, one, cute.group_modes(s_tile, 0, 2),
                                           cute.group_modes(g_tile, 0, 2))
            cute.copy(tma_store, tS, tG)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def _store_rows(self, acc, tg, tc, rows_left, factor):
        # tc: identity coordinates, this thread's origin (tc.iterator) plus static offsets. Its
        # values fall on a few rows: one row test each (a dynamic `if` per element is an scf.if
        # region per element, slow to trace), the row's elements stored in element order.
        n = cute.size(acc)
        row_off = [tc.layout(e)[0] for e in range(n)]
        rows = sorted(set(row_off))
        lim = rows_left - tc.iterator[0]
        for i in cutlass.range_constexpr(len(rows)):
            if rows[i] < lim:
                for e in cutlass.range_constexpr(n):
                    if const_expr(row_off[e] == rows[i]):
                        tg[e] = (acc[e] * factor).to(self.dtype)
