"""dQ of the sm90 backward: each consumer warpgroup's dQ part through a shared-memory slab into the
fp32 dQ buffer by TMA reduce-add, issued by the consumers' leader warps or by the dQ writer warp,
and the deterministic mode's per-query-tile turns (key tiles add in ascending order)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from ..common import l2_hints
from . import bwd_layouts as L

# Named barriers of the dQ hand-off (bwd_kernel.py lists them all): with dq_writer_warp, per
# consumer warpgroup wg a "slab empty" (4 + wg) and a "slab full" (6 + wg) barrier between that
# warpgroup and the dQ writer warp (128 + 32 threads).
BAR_DQ_EMPTY = 4
BAR_DQ_FULL = 6
DQ_HANDOFF_THREADS = 128 + 32


class BwdDq:
    """dQ methods of Sm90AttentionBackward (a mixin: they read its configuration)."""

    def _dq_acc_tile(self):
        """(M, N) of the dQ product over both warpgroups: (tile_m, d), or (d, tile_m) for dQ^T."""
        return (self.d, self.tile_m) if self.dq_transposed else (self.tile_m, self.d)

    def _dq_slab(self):
        """(rows, cols) of one consumer warpgroup's dQ slab (and TMA add box)."""
        if self.dq_split_rows:
            return self.tile_m // 2, self.d
        return self.tile_m, self.d // 2

    @cute.jit
    def _dq_out(self, rdQ, tdQsdQ, sdQ_wg, dq_at):
        """A finished dQ (unscaled: the dq conversion applies the scale) -> this warpgroup's slab ->
        TMA add into the fp32 buffer (the separate-slab paths; with dq_writer_warp the writer warp
        issues the add). dq_at: _stage_and_add_dq's."""
        wg, is_leader = dq_at[8], dq_at[11]
        if const_expr(self.dq_writer_warp):
            # The writer's previous add has read the slab; store, then hand it over without
            # waiting (the async-proxy fence orders the stores before the TMA read).
            cute.arch.barrier(barrier_id=BAR_DQ_EMPTY + wg, number_of_threads=DQ_HANDOFF_THREADS)
            L.copy_to_swizzled(rdQ, tdQsdQ, self._dq_thread_offsets)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier_arrive(barrier_id=BAR_DQ_FULL + wg, number_of_threads=DQ_HANDOFF_THREADS)
        else:
            if is_leader:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # previous slab read out
            cute.arch.barrier(barrier_id=2 + wg, number_of_threads=128)
            self._stage_and_add_dq(rdQ, tdQsdQ, sdQ_wg, dq_at)

    @cute.jit
    def _stage_and_add_dq(self, rdQ, tdQsdQ, sdQ_wg, dq_at):
        """This warpgroup's dQ half -> its smem slab (free to write) -> one TMA add (leader).
        dq_at: (tma_dQ, mdQacc, mSem, h, b, q_off, m_block, n_block, wg, diag, window_left,
        is_leader) of the step (bwd_consumer._step)."""
        tma_dQ, mdQacc, mSem, h, b, q_off, m_block, n_block, wg, diag, window_left, is_leader = dq_at
        L.copy_to_swizzled(rdQ, tdQsdQ, getattr(self, "_dq_thread_offsets", None))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=2 + wg, number_of_threads=128)
        if is_leader:
            if const_expr(self.deterministic):
                self._wait_turn(mSem, b, h, m_block, n_block, diag, window_left)
            self._add_slab(tma_dQ, mdQacc, sdQ_wg, h, b, q_off, m_block, wg)
            if const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0)  # landed in global before the hand-off
                self._pass_turn(mSem, b, h, m_block, 1)

    @cute.jit
    def _add_slab(self, tma_dQ, mdQacc, sdQ_wg, h, b, q_off, m_block, wg):
        """One warp: warpgroup wg's staged dQ slab -> one TMA reduce-add into the fp32 buffer,
        committed as one bulk group."""
        slab = self._dq_slab()
        coord = (m_block * 2 + wg, 0) if const_expr(self.dq_split_rows) else (m_block, wg)
        gdQ = cute.local_tile(self._head_slice(mdQacc, h, b, q_off), slab, coord)
        tS, tG = cpasync.tma_partition(tma_dQ, 0, cute.make_layout(1), cute.group_modes(sdQ_wg, 0, 2),
                                       cute.group_modes(gdQ, 0, 2))
        cute.copy(tma_dQ, tS, tG, cache_policy=l2_hints.policy(True, l2_hints.EVICT_LAST))
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def _write_dq(self, cta, tile, fused=None):
        """The dQ writer warp: walks the consumers' steps; per step and consumer warpgroup, waits
        for the slab to be full, adds it into the fp32 buffer, and hands it back once read.
        Each consumer warpgroup syncs on its "empty" barrier and arrives on "full" once per step,
        so the writer arrives on "empty" `steps` times too: before the first step, then after
        every step but the last; nothing when the walk is empty.
        Deterministic: one turn per step for both slabs (wait, both adds, landed, pass 2), the
        semaphore wait overlapping the consumers' work on the step.
        fused_dq (`fused` = (query heads, query tiles per head, counting-warp mailbox barriers and
        slots, hand-offs so far)): once a step's slabs are handed back, the adds of two steps
        before are waited for (done by then) and handed to the counting warp (bwd_dq_fused.py),
        the last two steps' after the walk; returns the hand-offs so far."""
        mdQacc, tma_dQ, sdQ = cta.gmem[6], cta.tmas[6], cta.smem[5]
        mSem, window_left = cta.mSem, cta.scalars[3]
        n_block, hkv, b, q_off, _, _, _, _, diag, walk, steps = tile
        if steps > 0:
            for wg in cutlass.range_constexpr(2):  # both slabs start empty
                cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY + wg,
                                         number_of_threads=DQ_HANDOFF_THREADS)
        passed = None
        if const_expr(fused is not None):
            n_heads, n_m, cnt_bar, cnt_slots, passed = fused
        prev = Int32(0)  # fused_dq: the query tiles of the last two steps (prev2 the older)
        prev2 = Int32(0)
        cur_h, cur_m = walk.start()
        for step in cutlass.range(steps, unroll=1):
            h_local, m_block, _ = walk.at(step, cur_h, cur_m)
            cur_h, cur_m = walk.advance(cur_h, cur_m)
            h = hkv * self.group + h_local
            if const_expr(self.deterministic):
                self._wait_turn(mSem, b, h, m_block, n_block, diag, window_left)
            for wg in cutlass.range_constexpr(2):
                cute.arch.barrier(barrier_id=BAR_DQ_FULL + wg, number_of_threads=DQ_HANDOFF_THREADS)
                self._add_slab(tma_dQ, mdQacc, sdQ[None, None, wg], h, b, q_off, m_block, wg)
            if const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0)  # both landed in global before the hand-off
                self._pass_turn(mSem, b, h, m_block, 2)
            if step + 1 < steps:
                for wg in cutlass.range_constexpr(2):
                    # bulk groups of this step: slab 0's add, then slab 1's
                    cute.arch.cp_async_bulk_wait_group(1 - wg, read=True)
                    cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY + wg,
                                             number_of_threads=DQ_HANDOFF_THREADS)
            if const_expr(fused is not None):
                if step > 1:
                    cute.arch.cp_async_bulk_wait_group(4)  # the adds of two steps before completed
                    passed = self._pass_landed_dq(prev2, cnt_bar, cnt_slots, passed)
                prev2 = prev
                prev = (b * n_heads + h) * n_m + m_block
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem must outlive the last read
        if const_expr(fused is not None):
            cute.arch.cp_async_bulk_wait_group(0)  # the last two steps' adds completed
            if steps > 1:
                passed = self._pass_landed_dq(prev2, cnt_bar, cnt_slots, passed)
            if steps > 0:
                passed = self._pass_landed_dq(prev, cnt_bar, cnt_slots, passed)
        return passed

    # ------------------------------------------------------------------ deterministic dQ order
    @cute.jit
    def _wait_turn(self, mSem, b, h, m_block, n_block, diag, window_left):
        """Spin (one lane of the adding warp) until every earlier KV tile has added its dQ."""
        # Each KV tile from the first that reaches query tile m_block (a left window's) bumps the
        # counter by 2 once its two slabs' adds have landed: each leader warp by 1, or the writer
        # warp by 2 for both.
        first = Int32(0)
        if const_expr(self.has_left):
            first = cutlass.max(m_block * self.tile_m + diag - window_left, 0) // self.tile_n
        target = (n_block - first) * 2
        ptr = mSem.iterator + cute.crd2idx((b, h, m_block), mSem.layout)
        if cute.arch.lane_idx() == 0:  # one lane polls; the warp reconverges below
            seen = cute.arch.atomic_add(ptr, Int32(0), sem="acquire", scope="gpu")
            while seen < target:
                seen = cute.arch.atomic_add(ptr, Int32(0), sem="acquire", scope="gpu")
        cute.arch.sync_warp()

    @cute.jit
    def _pass_turn(self, mSem, b, h, m_block, slabs: cutlass.Constexpr):
        """Count `slabs` landed dQ adds of this KV tile (see _wait_turn)."""
        cute.arch.fence_proxy("async.global")  # order the TMA add before the counter release
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            ptr = mSem.iterator + cute.crd2idx((b, h, m_block), mSem.layout)
            cute.arch.atomic_add(ptr, Int32(slabs), sem="release", scope="gpu")
