"""The sm90 forward's producer warp: per work item Q once, then K and V tiles into their rings by
TMA, in the order the consumers need them (fwd.py has the whole picture)."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync

from torch_fa4.kernels.common.tile_mailbox import next_item, publish_item


class FwdProducer:
    """Producer-warp methods of FlashFwdSm90 (a mixin: they read its configuration)."""

    @cute.jit
    def produce(self, bidx):
        """The TMA warp: for each work item of this CTA, Q once and the walk's K and V tiles."""
        cfg, sched = self.cfg, self._sched
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.num_stages)
        tile = bidx
        if const_expr(cfg.dynamic_schedule):
            bar, slots, counter = self._mailbox
            num_ctas = cute.arch.grid_dim()[0]
            i = Int32(0)
            while tile < sched.num_tiles():
                publish_item(bar, slots, i, tile)
                q_state, k_state, v_state = self.produce_item(tile, q_state, k_state, v_state)
                # taken once this item's loads are all issued, as a freed SM would take a new CTA
                # (taken as they start instead: worse, NOTES "Experiment 63")
                tile = next_item(counter, num_ctas)
                i += 1
            publish_item(bar, slots, i, tile)  # past the last item: the consumers stop
        elif const_expr(cfg.persistent):
            num_ctas = cute.arch.grid_dim()[0]
            rnd = Int32(0)
            while tile < sched.num_tiles():
                q_state, k_state, v_state = self.produce_item(tile, q_state, k_state, v_state)
                rnd += 1
                tile = sched.persistent_tile(rnd, bidx, num_ctas)
        else:
            if tile < sched.num_tiles():
                q_state, k_state, v_state = self.produce_item(tile, q_state, k_state, v_state)
        if const_expr(cfg.kv_multicast):
            # the other CTA's consumers release slots here until the end: stay until they have
            _, pipe_k, pipe_v = self._pipes
            pipe_k.producer_tail(k_state)
            pipe_v.producer_tail(v_state)

    @cute.jit
    def produce_item(self, tile, q_state, k_state, v_state):
        """Work item `tile`'s loads; returns the ring positions after them."""
        cfg = self.cfg
        mQ, mK, mV = self._mQ, self._mK, self._mV
        sQ, sK, sV = self._sQ, self._sK, self._sV
        tma_Q, tma_K, tma_V = self._tma_loads
        pipe_q, pipe_k, pipe_v = self._pipes
        num_heads_kv = cute.size(mK.shape[2])
        m_block, head, batch, piece = self._unit(tile)
        seqlen = self._seqlen(batch)
        if self._takes_part(m_block, seqlen):
            batch_q = batch if const_expr(not cfg.varlen_q) else 0
            batch_k = batch if const_expr(not cfg.varlen_k) else 0
            head_kv = head // (cute.size(mQ.shape[2]) // num_heads_kv)
            walk = self._kv_walk(seqlen, m_block, head, batch, piece)
            gQ = cute.local_tile(seqlen.q_rows(mQ[None, None, head, batch_q]), (self.tile_m, self.hdim), (m_block, 0))
            gK = cute.local_tile(seqlen.k_rows(mK[None, None, head_kv, batch_k]), (self.tile_n, self.hdim), (None, 0))
            gV = cute.local_tile(seqlen.k_rows(mV[None, None, head_kv, batch_k]), (self.tile_n, self.hdimv), (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_Q, 0, cute.make_layout(1),
                                               cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            rank, pair = 0, 1
            if const_expr(cfg.kv_multicast):
                rank, pair = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()), 2
            tKsK, tKgK = cpasync.tma_partition(tma_K, rank, cute.make_layout(pair),
                                               cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma_V, rank, cute.make_layout(pair),
                                               cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
            kv_copy = {}
            if const_expr(cfg.kv_multicast):
                kv_copy = dict(mcast_mask=cutlass.Int16(3))  # this CTA's half lands in both
            # order: K[first]; Q; then K[t+1], V[t] pairs; then V[last] -- the consumers' order of
            # need, so a full ring never blocks the tile they wait for. The first K goes before Q:
            # Q's buffer frees only when the previous item is done with it, K's slot earlier.
            if walk.nonempty():
                pipe_k.producer_acquire(k_state)
                cute.copy(tma_K, tKgK[None, walk.n_block(0)], tKsK[None, k_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(k_state), **kv_copy)
                k_state.advance()
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
            if walk.nonempty():
                for i in cutlass.range(walk.count - 1, unroll=1):
                    pipe_k.producer_acquire(k_state)
                    cute.copy(tma_K, tKgK[None, walk.n_block(i + 1)], tKsK[None, k_state.index],
                              tma_bar_ptr=pipe_k.producer_get_barrier(k_state), **kv_copy)
                    k_state.advance()
                    pipe_v.producer_acquire(v_state)
                    cute.copy(tma_V, tVgV[None, walk.n_block(i)], tVsV[None, v_state.index],
                              tma_bar_ptr=pipe_v.producer_get_barrier(v_state), **kv_copy)
                    v_state.advance()
                pipe_v.producer_acquire(v_state)
                cute.copy(tma_V, tVgV[None, walk.n_block(walk.count - 1)], tVsV[None, v_state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(v_state), **kv_copy)
                v_state.advance()
        return q_state, k_state, v_state
