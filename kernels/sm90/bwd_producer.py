"""The sm90 backward's producer warp: K and V once per key tile, then per step Q, dO and the row
statistics (LSE, dPsum) into the stage ring, by TMA (bwd_kernel.py has the whole picture)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync

from ..common import l2_hints


class BwdProducer:
    """Producer-warp methods of Sm90AttentionBackward (a mixin: they read its configuration)."""

    @cute.jit
    def _produce(self, cta, tile, state=None, kv_iter=None, bar_kv_empty=None):
        """K / V once, then Q, dO, LSE, dPsum per step into the ring. Persistent: `state` carries
        the ring over tiles (returned); the K / V load of the tile's kv_iter-th use of the
        buffers waits until both consumer warpgroups are done with the previous one, so it comes
        after the tile's first `stages` - 1 ring loads, which only need the previous tile's last
        steps to have freed their stages."""
        mQ, mK, mV, mdO, mLSE2, mDpsum = cta.gmem[:6]
        tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Dp = cta.tmas[:6]
        sQ, sK, sV, sdO, _, _, sLSE, sDp = cta.smem
        pipe, pipe_do, bar_kv, bytes_kv = cta.ring
        n_block, hkv, b, q_off, k_off, _, _, _, _, walk, steps = tile
        tm, tn = self.tile_m, self.tile_n
        one = cute.make_layout(1)
        # K and V once.
        gK = cute.local_tile(self._head_slice(mK, hkv, b, k_off), (tn, self.d), (n_block, 0))
        gV = cute.local_tile(self._head_slice(mV, hkv, b, k_off), (tn, self.dv), (n_block, 0))
        tKs, tKg = cpasync.tma_partition(tma_K, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_V, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        if const_expr(not self.persistent):
            if steps > 0:
                self._load_kv(tma_K, tma_V, tKg, tKs, tVg, tVs, bar_kv, bytes_kv)
        else:
            kv_at = cutlass.min(self.stages - 1, steps - 1)  # the step whose ring loads K / V precede

        cute.arch.griddepcontrol_wait()  # the row statistics are written (see kernel)
        if const_expr(state is None):
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        stat_off = self._stat_row_offset(q_off, b)
        cur_h, cur_m = walk.start()
        for step in cutlass.range(steps, unroll=1):
            if const_expr(self.persistent):
                if step == kv_at:
                    if kv_iter > 0:
                        cute.arch.mbarrier_wait(bar_kv_empty, (kv_iter - 1) % 2)
                    self._load_kv(tma_K, tma_V, tKg, tKs, tVg, tVs, bar_kv, bytes_kv)
            h_local, m_block, _ = walk.at(step, cur_h, cur_m)
            cur_h, cur_m = walk.advance(cur_h, cur_m)
            h = hkv * self.group + h_local
            gQ = cute.local_tile(self._head_slice(mQ, h, b, q_off), (tm, self.d), (None, 0))
            gdO = cute.local_tile(self._head_slice(mdO, h, b, q_off), (tm, self.dv), (None, 0))
            gL = cute.local_tile(self._head_slice(mLSE2, h, b, stat_off), (tm,), (None,))
            gD = cute.local_tile(self._head_slice(mDpsum, h, b, stat_off), (tm,), (None,))
            tQs, tQg = cpasync.tma_partition(tma_Q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            tdOs, tdOg = cpasync.tma_partition(tma_dO, 0, one, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2))
            tLs, tLg = cpasync.tma_partition(tma_LSE, 0, one, cute.group_modes(sLSE, 0, 1), cute.group_modes(gL, 0, 1))
            tDs, tDg = cpasync.tma_partition(tma_Dp, 0, one, cute.group_modes(sDp, 0, 1), cute.group_modes(gD, 0, 1))
            pipe.producer_acquire(state)
            bar = pipe.producer_get_barrier(state)
            hint = l2_hints.policy(True, l2_hints.EVICT_LAST)
            cute.copy(tma_Q, tQg[None, m_block], tQs[None, state.index], tma_bar_ptr=bar, cache_policy=hint)
            cute.copy(tma_LSE, tLg[None, m_block], tLs[None, state.index], tma_bar_ptr=bar, cache_policy=hint)
            if const_expr(self.split_ring):
                pipe.producer_commit(state)
                pipe_do.producer_acquire(state)
                bar = pipe_do.producer_get_barrier(state)
            cute.copy(tma_dO, tdOg[None, m_block], tdOs[None, state.index], tma_bar_ptr=bar, cache_policy=hint)
            cute.copy(tma_Dp, tDg[None, m_block], tDs[None, state.index], tma_bar_ptr=bar, cache_policy=hint)
            if const_expr(self.split_ring):
                pipe_do.producer_commit(state)
            else:
                pipe.producer_commit(state)
            state.advance()
        return state

    @cute.jit
    def _load_kv(self, tma_K, tma_V, tKg, tKs, tVg, tVs, bar_kv, bytes_kv: cutlass.Constexpr):
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar_kv, bytes_kv)
        hint = l2_hints.policy(True, l2_hints.EVICT_FIRST)
        cute.copy(tma_K, tKg, tKs, tma_bar_ptr=bar_kv, cache_policy=hint)
        cute.copy(tma_V, tVg, tVs, tma_bar_ptr=bar_kv, cache_policy=hint)
