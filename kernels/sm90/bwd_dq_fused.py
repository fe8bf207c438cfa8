"""dq in the input dtype written by the persistent backward itself (`fused_dq`), instead of by a
conversion pass after it.

The fp32 dQ buffer still collects every key tile's dQ by TMA reduce-adds. What changes is when it
is turned into dq: as soon as a query tile is complete. Per (batch, query head, query tile) an
int32 counter in global memory counts the key tiles whose adds have landed. Two warps of the
producer warpgroup that had no role take this on, so the dQ writer warp, which the consumers wait
for at every step, only adds one hand-off per step:
- the writer, two steps behind its adds (by then they have completed: the wait costs nothing),
  makes them visible to other CTAs (async-proxy fence) and passes their query tile to the
  counting warp (warp 2) through a two-slot mailbox (kernels/common/tile_mailbox.py);
- the counting warp bumps that tile's counter with acquire / release semantics; the key tile
  that brings it to the tile's number of contributors (`dq_contributors`, the inverse of
  bwd_kernel._tile_walk's query range) appends the tile to a global queue: a slot taken from a
  tail counter, the tile stored there with release semantics;
- every CTA's converter warp (warp 3) takes the queue's slots in order from a head counter, waits
  for its slot to be filled, loads the finished fp32 tile by TMA into a staging tile, scales and
  narrows it and stores dq's rows from registers (16-byte stores: nothing to wait for).
The counting is not the writer's own (each atomic is a round trip to L2 the consumers would wait
behind), and the queue is global, not per CTA: the key tiles of one head walk the query tiles in
lockstep, so one CTA may complete a tile at every step while the others complete none; through
the global queue each conversion goes to whichever SM's converter is free (NOTES Experiment 127).

The queue, its counters and the per-tile counters live in the semaphore argument, zeroed by the
host: (B, Hq, 2 * n_m + 3) int32, n_m query tiles per head. Columns [0, n_m): the tiles' counters;
[n_m, 2 n_m): the queue's slots, slot e at row (e // n_m) (batch-major over (B, Hq)), column
n_m + e % n_m, holding 1 + the tile's index (0: not yet filled); row (0, 0) ends with the queue's
head and tail counters and the persistent tile counter (its last element, as without fused_dq).

This saves the separate pass over the whole fp32 buffer: each query tile is read back once from
L2 while the key tiles still run. Every query tile needs at least one contributor, or the
converters would wait forever (bwd_variant._fused_dq_applies).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from ..common.tile_mailbox import publish_item, read_item


# the converter warps' named barrier (ids 1-7 belong to the consumers and the dQ hand-off)
BAR_CVT = 8
COUNT_WARP = 2  # producer warpgroup warps with no other role: the counting warp ...
CVT_WARP = 3  # ... and the converter
CVT_THREADS = 32
VEC = 8  # elements per 16-byte dq store
# the queue's counters at the end of the semaphore argument's first row (module docstring)
HEAD_FROM_END, TAIL_FROM_END = 2, 1


class BwdDqFused:
    """Fused dq conversion methods of Sm90AttentionBackward (a mixin: they read its configuration)."""

    @cute.jit
    def dq_contributors(self, m_block, seqlen_q, seqlen_k, diag, window_left, window_right):
        """How many key tiles walk query tile m_block: those n with m_lo(n) <= m_block < m_hi(n)
        in _tile_walk's terms. A key tile reaches the tile iff its first key lies within the
        right limit of the tile's last row, n * tile_n < (m_block + 1) * tile_m + diag + right,
        and its last key within the left limit of the tile's first row, (n + 1) * tile_n >
        m_block * tile_m + diag - left (every key tile below ceil(seqlen_k / tile_n))."""
        tm, tn = self.tile_m, self.tile_n
        n_lo = Int32(0)
        n_hi = cute.ceil_div(seqlen_k, tn) - 1
        if const_expr(self.has_right):
            x = (m_block + 1) * tm + diag + window_right
            n_hi = cutlass.min(n_hi, (cutlass.max(x, 1) - 1) // tn)
            if x <= 0:
                n_hi = Int32(-1)
        if const_expr(self.has_left):
            n_lo = cutlass.max(m_block * tm + diag - window_left, 0) // tn
        return cutlass.max(n_hi - n_lo + 1, 0)

    @cute.jit
    def _sem_at(self, mSem, b, h, col):
        return mSem.iterator + cute.crd2idx((b, h, col), mSem.layout)

    @cute.jit
    def _queue_slot(self, mSem, e, n_m):
        """Queue slot e (module docstring)."""
        rows = e // n_m
        return self._sem_at(mSem, rows // mSem.shape[1], rows % mSem.shape[1], n_m + e % n_m)

    @cute.jit
    def _pass_landed_dq(self, job, cnt_bar, cnt_slots, passed):
        """Writer warp, once its adds into query tile `job` ((batch * Hq + head) * n_m + tile)
        have completed: make them visible beyond the CTA and hand the tile to the counting warp.
        Returns the hand-offs so far (the mailbox position)."""
        cute.arch.fence_proxy("async.global")  # the TMA adds before the counting warp's release
        publish_item(cnt_bar, cnt_slots, passed, job)
        return passed + 1

    @cute.jit
    def _count_dq_tiles(self, mSem, cnt_bar, cnt_slots, seqlen_q, seqlen_k, window_left, window_right):
        """Counting warp: every tile the writer passes, until it passes -1 (module docstring)."""
        heads = mSem.shape[1]
        n_m = (mSem.shape[2] - 3) // 2
        last = mSem.shape[2] - 1
        i = Int32(0)
        job = read_item(cnt_bar, cnt_slots, i)
        while job >= 0:
            m_block = job % n_m
            h = (job // n_m) % heads
            b = job // (n_m * heads)
            expected = self.dq_contributors(m_block, seqlen_q, seqlen_k, seqlen_k - seqlen_q, window_left, window_right)
            if cute.arch.lane_idx() == 0:
                before = cute.arch.atomic_add(self._sem_at(mSem, b, h, m_block), Int32(1), sem="acq_rel", scope="gpu")
                if before + 1 == expected:
                    slot = cute.arch.atomic_add(self._sem_at(mSem, 0, 0, last - TAIL_FROM_END), Int32(1),
                                                sem="relaxed", scope="gpu")
                    cute.arch.atomic_add(self._queue_slot(mSem, slot, n_m), job + 1, sem="release", scope="gpu")
            cute.arch.sync_warp()
            i += 1
            job = read_item(cnt_bar, cnt_slots, i)

    @cute.jit
    def _convert_dq_tiles(self, mdQacc, mdQ, mSem, tma_cvt, sCvt, sJob, bar_load, q_off, scale, ctid):
        """Converter warp: queue slots taken in turn until every tile is taken; each tile: fp32
        buffer -> staging (TMA) -> dq rows (scaled, narrowed, 16-byte stores)."""
        tm, d = self.tile_m, self.d
        heads = mSem.shape[1]
        n_m = (mSem.shape[2] - 3) // 2
        jobs = mSem.shape[0] * heads * n_m
        last = mSem.shape[2] - 1
        chunks = tm * d // VEC  # 16-byte pieces of the tile, dealt out round-robin
        i = Int32(0)
        job = Int32(0)
        while job >= 0:
            if ctid == 0:
                taken = cute.arch.atomic_add(self._sem_at(mSem, 0, 0, last - HEAD_FROM_END), Int32(1),
                                             sem="relaxed", scope="gpu")
                found = Int32(-1)
                if taken < jobs:
                    ptr = self._queue_slot(mSem, taken, n_m)
                    seen = cute.arch.atomic_add(ptr, Int32(0), sem="acquire", scope="gpu")
                    while seen == 0:  # the tile is not complete yet (each poll: an L2 round trip)
                        seen = cute.arch.atomic_add(ptr, Int32(0), sem="acquire", scope="gpu")
                    found = seen - 1
                sJob[0] = found
            cute.arch.barrier(barrier_id=BAR_CVT, number_of_threads=CVT_THREADS)
            job = sJob[0]
            if job >= 0:
                m_block = job % n_m
                h = (job // n_m) % heads
                b = job // (n_m * heads)
                # the slot's acquire (thread 0, then the barrier) orders every contributor's adds
                # before this read; the load is an async-proxy access, and the previous tile's
                # generic reads of the staging tile come before the TMA writes it
                cute.arch.fence_proxy("async.global")
                cute.arch.fence_proxy("async.shared", space="cta")
                # (one warp: it issues the load itself)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(bar_load, tm * d * 4)
                gsrc = cute.local_tile(self._head_slice(mdQacc, h, b, q_off), (tm, d), (m_block, 0))
                tS, tG = cpasync.tma_partition(tma_cvt, 0, cute.make_layout(1), cute.group_modes(sCvt, 0, 2),
                                               cute.group_modes(gsrc, 0, 2))
                cute.copy(tma_cvt, tG, tS, tma_bar_ptr=bar_load)
                cute.arch.mbarrier_wait(bar_load, i % 2)
                gdq = self._head_slice(mdQ, h, b, q_off)  # (Sq, D) of this head
                rows_left = mdQ.shape[0] - m_block * tm  # (dense: the sequence's rows)
                for k in cutlass.range_constexpr(chunks // CVT_THREADS):
                    c = ctid + k * CVT_THREADS
                    row = c // (d // VEC)
                    col = c % (d // VEC)
                    if row < rows_left:
                        src = cute.make_rmem_tensor((1, VEC), Float32)
                        cute.autovec_copy(cute.local_tile(sCvt, (1, VEC), (row, col)), src)
                        out = cute.make_rmem_tensor((1, VEC), self.dtype)
                        out.store((src.load() * scale).to(self.dtype))
                        cute.autovec_copy(out, cute.local_tile(gdq, (1, VEC), (m_block * tm + row, col)))
                i += 1
            # every converter thread is done with the staging tile and the job before the next
            cute.arch.barrier(barrier_id=BAR_CVT, number_of_threads=CVT_THREADS)
