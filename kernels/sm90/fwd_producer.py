"""The sm90 forward's producer warp: per work item Q once, then K and V tiles into their rings by
TMA, in the order the consumers need them (fwd.py has the whole picture). Paged caches
(`page_box`): a tile loads as boxes of page_box rows, each from the page the page table names for
its keys; the page-table reads of a tile go out before the wait for its ring slot."""

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
            if const_expr(cfg.page_box):
                # boxes of page_box rows: gmem (box, D, boxes per page, 1, pages), smem slots
                # (box, D, boxes per tile, 1, stages)
                box = cfg.page_box
                gK = cute.flat_divide(mK[None, None, head_kv, None], (box, self.hdim))
                gV = cute.flat_divide(mV[None, None, head_kv, None], (box, self.hdimv))
                sK_boxes = cute.flat_divide(sK, (box, self.hdim))
                sV_boxes = cute.flat_divide(sV, (box, self.hdimv))
            else:
                gK = cute.local_tile(seqlen.k_rows(mK[None, None, head_kv, batch_k]),
                                     (self.tile_n, self.hdim), (None, 0))
                gV = cute.local_tile(seqlen.k_rows(mV[None, None, head_kv, batch_k]),
                                     (self.tile_n, self.hdimv), (None, 0))
                sK_boxes, sV_boxes = sK, sV
            tQsQ, tQgQ = cpasync.tma_partition(tma_Q, 0, cute.make_layout(1),
                                               cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            rank, pair = 0, 1
            if const_expr(cfg.kv_multicast):
                rank, pair = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()), 2
            tKsK, tKgK = cpasync.tma_partition(tma_K, rank, cute.make_layout(pair),
                                               cute.group_modes(sK_boxes, 0, 2), cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma_V, rank, cute.make_layout(pair),
                                               cute.group_modes(sV_boxes, 0, 2), cute.group_modes(gV, 0, 2))
            kv_copy = {}
            if const_expr(cfg.kv_multicast):
                kv_copy = dict(mcast_mask=cutlass.Int16(3))  # this CTA's half lands in both
            # order: K[first]; Q; then K[t+1], V[t] pairs; then V[last] -- the consumers' order of
            # need, so a full ring never blocks the tile they wait for. The first K goes before Q:
            # Q's buffer frees only when the previous item is done with it, K's slot earlier.
            pager = self._pager(batch, seqlen) if const_expr(cfg.page_box) else None
            k_load = (tma_K, tKgK, tKsK, pipe_k, kv_copy)
            v_load = (tma_V, tVgV, tVsV, pipe_v, kv_copy)
            if walk.nonempty():
                self._load_tile(k_load, k_state, walk, 0, pager)
                k_state.advance()
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
            if walk.nonempty():
                for i in cutlass.range(walk.count - 1, unroll=1):
                    self._load_tile(k_load, k_state, walk, i + 1, pager)
                    k_state.advance()
                    self._load_tile(v_load, v_state, walk, i, pager)
                    v_state.advance()
                self._load_tile(v_load, v_state, walk, walk.count - 1, pager)
                v_state.advance()
        return q_state, k_state, v_state

    @cute.jit
    def _load_tile(self, load, state, walk, t, pager):
        """Key tile t of the walk into ring slot `state` (K or V: `load` is its TMA atom, its
        partitioned global and shared tensors, its pipeline and copy options): one box, or paged,
        a box per page, the page ids read before the wait for the slot."""
        tma, tXgX, tXsX, pipe, kv_copy = load
        if const_expr(self.cfg.page_box):
            lane_page, in_page = self._tile_pages(walk.n_block(t), pager)
            pipe.producer_acquire(state)
            for j in cutlass.range_constexpr(self.tile_n // self.cfg.page_box):
                page = lane_page
                if const_expr(self.tile_n > self.cfg.page_box):
                    page = cute.arch.shuffle_sync(lane_page, j)  # box j's page, from lane j
                cute.copy(tma, tXgX[None, in_page, 0, page], tXsX[None, j, 0, state.index],
                          tma_bar_ptr=pipe.producer_get_barrier(state))
        else:
            pipe.producer_acquire(state)
            cute.copy(tma, tXgX[None, walk.n_block(t)], tXsX[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state), **kv_copy)

    @cute.jit
    def _pager(self, batch, seqlen):
        """What a work item's page lookups need, computed once per item: (its batch, how many
        boxes or tiles hold keys of the sequence and have a page-table entry, the tiles per page
        where pages hold whole tiles)."""
        box = self.cfg.page_box
        max_pages = self._page_table.shape[1]
        used = cutlass.min((seqlen.seqlen_k + box - 1) // box, max_pages)
        tiles_per_page = Int32(1)
        if const_expr(box == self.tile_n):  # pages of whole tiles
            tiles_per_page = self._mK.shape[0] // self.tile_n  # (mK: (page_size, D, Hkv, pages))
            used = cutlass.min((seqlen.seqlen_k + box - 1) // box, max_pages * tiles_per_page)
        return batch, used, tiles_per_page

    @cute.jit
    def _tile_pages(self, n_block, pager):
        """Where key tile n_block's boxes lie in a paged cache: (a page id, the box's index inside
        its page). Pages of page_box < tile_n keys hold one box each, and lane j of the warp reads
        box j's page (one register for the whole tile; the producer runs on few); pages of whole
        tiles (page_box = tile_n) hold page_size / tile_n boxes, the tile's one page read by
        every lane. A box past the sequence's end (or past the page table's row) reads no
        page-table entry: it loads from a page past the cache, which the TMA fills with zeros,
        so unused entries may hold anything."""
        batch, used, tiles_per_page = pager
        boxes = self.tile_n // self.cfg.page_box
        table = self._page_table
        page = Int32(self._mK.shape[3])  # past the cache
        in_page = Int32(0)
        if const_expr(boxes > 1):  # pages of page_box keys
            lane = cute.arch.lane_idx()
            index = n_block * boxes + lane
            if lane < boxes and index < used:
                page = table[batch, index]
        else:  # pages of whole tiles
            index = n_block // tiles_per_page
            in_page = n_block - index * tiles_per_page
            if n_block < used:
                page = table[batch, index]
        return page, in_page
