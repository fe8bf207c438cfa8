"""FlashAttention forward for Hopper (sm_90a) in CuTe DSL.

CTA layout (warp specialization): warpgroup 0 is the producer, whose first warp issues every TMA
load (Q once, then K and V tiles into `num_stages`-deep shared-memory rings guarded by mbarriers);
warpgroups 1..W are consumers, each owning 64 query rows of the tile_m = 64*W row tile. setmaxnreg
moves registers from the producer (which needs few) to the consumers (accumulators for S and O).

Consumer main loop (per warpgroup, key tiles from last to first so masked tiles come first):

    S_0 = Q K_0^T;  P_0 = softmax(S_0)
    for i = 1..:  issue S_i = Q K_i^T and O += P_{i-1} V_{i-1}   (both async wgmma)
                  wait S_i; mask, online softmax -> P_i, row factors   (overlaps O += P V)
                  wait P V; rescale O
    O += P_last V_last;  O /= rowsum;  LSE

so the softmax of tile i runs while the tensor cores work on tile i-1's P V. With
`split_mask_loops` the walk runs as three loops: the tiles at either end that the causal / window
/ length limits cut (with element masks) and the tiles between them (no mask code at all). Named
barriers make the consumer warpgroups take turns issuing their matmuls ("pingpong"), so one
warpgroup's softmax runs under the other's matmuls. P stays in registers as the A operand of the
second wgmma, converted by packed pairs (kernels/common/convert.py).

Mods (traced graphs from torch_fa4.mods, named by `mod_key`) are inlined per score element
(kernels/common/tile_mods.py): softcap, then score_mod in natural units, then the causal / window
/ length masks, then mask_mod. With a block mask (`block_sparse`) the key tiles come from its
lists (kernels/common/kv_tile_walk.py) and mask_mod runs on its partial tiles only.

Work items (query tile, head, batch) come from kernels/common/tile_scheduler.py. With
`persistent` each CTA of a grid of about one CTA per SM loops over its items (the producer loads
the next item's first K and Q while the consumers finish the current one), in a static
round-robin or, with `dynamic_schedule`, from a global counter as it frees
(kernels/common/tile_mailbox.py).

Paged KV caches (`page_box`): K and V are caches of pages (num_pages, page_size, Hkv, D) and a
page table lists each sequence's pages; the producer loads a key tile as tile_n / page_box TMA
boxes, each from its page's rows (kernels/host/paged_kv.py). Boxes past the sequence's end read
no page-table entry and load from a page past the cache, which the TMA fills with zeros.

The roles are mixins: fwd_producer.py (TMA loads) and fwd_consumer.py (a consumer warpgroup's key
loop and epilogue: O, 64 rows per warpgroup, through shared memory and TMA, or from registers for
varlen tiles; the LSE).
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
from cutlass import Float32, Int32, const_expr
from cutlass import pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from torch_fa4.kernels.common.block_range import BlockRange
from torch_fa4.kernels.common.kv_tile_walk import DenseKvWalk, SparseKvWalk
from torch_fa4.kernels.common.seqlen_info import SeqlenInfo
from torch_fa4.kernels.common.tile_mailbox import init_mailbox
from torch_fa4.kernels.common.tile_scheduler import TileScheduler
from torch_fa4.kernels.common import wgmma_desc
from torch_fa4.kernels.sm90.fwd_config import MAX_AUX, FwdConfig
from torch_fa4.kernels.sm90.fwd_consumer import FwdConsumer
from torch_fa4.kernels.sm90.fwd_producer import FwdProducer

SMEM_BYTES = 227 * 1024  # shared memory one CTA may allocate on sm_90


def _sequence_major(t: cute.Tensor, varlen: bool) -> cute.Tensor:
    """t's view with the sequence mode first and the batch mode last: (B, S, H, D) -> (S, D, H, B),
    (B, H, S) -> (S, H, B); a packed varlen tensor ((T, H, D) or (H, T)) gets a unit batch mode so
    indexing is uniform."""
    if varlen:
        modes = [0, 2, 1] if cute.rank(t) == 3 else [1, 0]
        unit_batch = cute.make_layout(1, stride=0)
        return cute.make_tensor(t.iterator, cute.append(cute.select(t.layout, mode=modes), unit_batch))
    modes = [1, 3, 2, 0] if cute.rank(t) == 4 else [2, 1, 0]
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


class FlashFwdSm90(FwdProducer, FwdConsumer):
    def __init__(self, cfg: FwdConfig):
        self.cfg = cfg
        self.dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[cfg.dtype_name]
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.hdim, self.hdimv = cfg.head_dim, cfg.head_dim_v
        assert self.hdim == self.hdimv, "O reuses Q's shared memory"
        self.num_wg = cfg.num_consumer_wg
        # registers per thread after setmaxnreg: producer gives up what the consumers take
        self.producer_regs, self.consumer_regs = {1: (56, 256), 2: (24, 240), 3: (32, 160)}[self.num_wg]
        if cfg.page_box and cfg.persistent and self.num_wg == 2:
            # the page lookups beside a persistent loop's state spill at 24 (CPU compile tests);
            # 40 + 2 x 232 fills the same register file
            self.producer_regs, self.consumer_regs = 40, 232
        self.pingpong = self.num_wg >= 2  # consumer warpgroups take turns issuing their matmuls
        self.score_graph = self.mask_graph = None
        self.num_score_aux = 0
        if cfg.mod_key:
            from torch_fa4.mods import registry

            mods = registry.lookup(cfg.mod_key)
            self.score_graph, self.mask_graph = mods.score_graph, mods.mask_graph
            self.num_score_aux = mods.num_score_aux
        assert len(cfg.aux_specs) <= MAX_AUX
        assert not cfg.block_sparse or self.mask_graph is not None, "a block mask needs its mask_mod"
        assert cfg.num_stages >= 1
        assert cfg.persistent or not cfg.dynamic_schedule, "dynamic_schedule: a persistent kernel's loop"
        assert not cfg.grid3d or not (cfg.persistent or cfg.split_ways or cfg.kv_multicast or cfg.causal
                                      or cfg.has_window or cfg.varlen_q), "grid3d: one-shot plain grids"
        # the early rescale applies every tile's factors; the conditional rescale skips some (fwd_config)
        assert not (cfg.early_o_rescale and cfg.rescale_threshold is not None)
        # the two CTAs of a pair must walk the same key tiles, and an item past the sequence's end
        # must still take part in the loads (the idle warpgroup path)
        assert not cfg.kv_multicast or not (
            cfg.causal or cfg.has_window or cfg.varlen_q or cfg.varlen_k or cfg.block_sparse
            or cfg.dynamic_schedule or self.num_wg < 2 or cfg.page_box), "kv_multicast: plain calls"
        # a paged tile is whole boxes, each starting on a swizzle atom (8 rows)
        assert not cfg.page_box or (cfg.page_box % 8 == 0 and cfg.tile_n % cfg.page_box == 0)
        self.cluster_size = 2 if cfg.kv_multicast else 1
        # O gets its own shared-memory tile when it fits beside Q and the K/V rings (2-byte elements,
        # 4 KB for the barriers; D <= 128): the next work item's Q then loads while this one's
        # epilogue runs. Otherwise O is staged over Q's buffer and the next Q waits for the O store.
        stage_rows = cfg.tile_m + cfg.num_stages * cfg.tile_n
        self.separate_o = stage_rows * (self.hdim + self.hdimv) * 2 + 4 * 1024 <= SMEM_BYTES
        self._early_q_release = cfg.early_q_release and self.separate_o

    def _smem_layout(self, rows: int, cols: int, stages: Optional[int]):
        atom = warpgroup.make_smem_layout_atom(
            hopper.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, cols), self.dtype
        )
        shape = (rows, cols) if stages is None else (rows, cols, stages)
        order = (0, 1) if stages is None else (0, 1, 2)
        return cute.tile_to_shape(atom, shape, order)

    def _box_layout(self, ring_layout, rows: int, cols: int):
        """The shared-memory layout of one TMA box of a K / V ring slot: the whole slot, or paged,
        the slot's first `rows` rows with the slot's swizzle and strides."""
        slot = cute.select(ring_layout, mode=[0, 1])
        if const_expr(not self.cfg.page_box):
            return slot
        return cute.composition(slot, (cute.make_layout(rows), cute.make_layout(cols)))

    def _tiled_mmas(self):
        qk = hopper.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K,
            Float32, atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.tile_n),
        )
        pv = hopper.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN,
            Float32, atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.hdimv),
            a_source=warpgroup.OperandSource.RMEM,
        )
        return qk, pv

    def _storage_class(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        stages, dt, separate_o = self.cfg.num_stages, self.dtype, self.separate_o

        def buffer(layout):
            return cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(layout)], 1024]

        @cute.struct
        class Shared:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_sched: cute.struct.MemRange[cutlass.Int64, 4]  # dynamic_schedule: item mailbox
            sched_slots: cute.struct.MemRange[Int32, 2]
            split_flags: cute.struct.MemRange[Int32, 4]  # split_ways: a counter value per warpgroup
            sQ: buffer(sQ_layout)
            sK: buffer(sK_layout)
            sV: buffer(sV_layout)
            if separate_o:  # (else O is staged over Q's buffer)
                sO: buffer(sO_layout)

        return Shared

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, Hq, D) or (Tq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D) or (Tk, Hkv, D)
        mV: cute.Tensor,
        mO: cute.Tensor,  # like mQ, contiguous
        mLSE: cute.Tensor,  # (B, Hq, Sq) or (Hq, Tq), fp32
        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSequsedK: Optional[cute.Tensor],
        score_scale: Float32,  # multiplies q.k before softmax (scale, or scale/softcap)
        softmax_scale_log2: Float32,  # log2(e) * (scale, or softcap)
        window_left: Int32, window_right: Int32,
        num_batch: Int32, max_seqlen_q: Int32, heads_per_group: Int32,
        tail_pairs: Int32,  # the last this many (batch, head) pairs as one group (0: none)
        max_ctas: Int32,  # persistent grid size (about one CTA per SM)
        # block mask (block_sparse only, else None): kv_num_blocks, kv_indices, full_kv_num_blocks,
        # full_kv_indices, int32, FlexAttention layout
        mBmNum: Optional[cute.Tensor], mBmIdx: Optional[cute.Tensor],
        mBmFullNum: Optional[cute.Tensor], mBmFullIdx: Optional[cute.Tensor],
        # captured tensors of the mods, ModSet order, None past the last (TVM-FFI takes no tuples)
        aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7,
        mSched: Optional[cute.Tensor],  # (1,) int32, zero at launch (cfg.dynamic_schedule), else None
        # cfg.split_ways (kernels/common/split_tail.py), else None / None / 0: the pieces' states
        # (slots, values, 128) fp32, their counters (split items * warpgroups,) int32 zero at
        # launch, and how many of the last items are split
        mSplitWs: Optional[cute.Tensor], mSplitCount: Optional[cute.Tensor], split_items: Int32,
        mPageTable: Optional[cute.Tensor],  # (B, max_pages) int32 (cfg.page_box), else None
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        aux = (aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7)[: len(cfg.aux_specs)]
        score_aux, mask_aux = aux[: self.num_score_aux], aux[self.num_score_aux:]
        block_mask = (mBmNum, mBmIdx, mBmFullNum, mBmFullIdx) if const_expr(cfg.block_sparse) else None
        # sequence-major views: (S, D, H, B), LSE (S, H, B)
        mQ, mO, mLSE = (_sequence_major(t, cfg.varlen_q) for t in (mQ, mO, mLSE))
        mK, mV = (_sequence_major(t, cfg.varlen_k) for t in (mK, mV))

        tiled_mma_qk, tiled_mma_pv = self._tiled_mmas()
        sQ_layout = self._smem_layout(self.tile_m, self.hdim, None)
        sK_layout = self._smem_layout(self.tile_n, self.hdim, cfg.num_stages)
        sV_layout = self._smem_layout(self.tile_n, self.hdimv, cfg.num_stages)
        if const_expr(cfg.hand_descriptors):
            wgmma_desc.check_layouts(self.dtype.width, self.tile_n, sQ_layout, sK_layout, sV_layout)
        # O: one standalone 64-row tile per consumer warpgroup, each stored by its own TMA
        sO_layout = self._smem_layout(64, self.hdimv, self.num_wg)

        tma_Q, tQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, sQ_layout, (self.tile_m, self.hdim))
        kv_load = (cpasync.CopyBulkTensorTileG2SMulticastOp() if cfg.kv_multicast
                   else cpasync.CopyBulkTensorTileG2SOp())
        kv_rows = cfg.page_box if const_expr(cfg.page_box) else self.tile_n  # rows per TMA box
        tma_K, tK = cpasync.make_tiled_tma_atom(
            kv_load, mK, self._box_layout(sK_layout, kv_rows, self.hdim), (kv_rows, self.hdim),
            num_multicast=self.cluster_size)
        tma_V, tV = cpasync.make_tiled_tma_atom(
            kv_load, mV, self._box_layout(sV_layout, kv_rows, self.hdimv), (kv_rows, self.hdimv),
            num_multicast=self.cluster_size)
        tma_O, tO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]), (64, self.hdimv))

        bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))

        Storage = self._storage_class(sQ_layout, sK_layout, sV_layout, sO_layout)

        num_m_blocks = (max_seqlen_q + self.tile_m - 1) // self.tile_m
        cluster = None
        if const_expr(cfg.kv_multicast):
            # pairs of items (2i, 2i+1) are adjacent query tiles of one head: an even count per
            # head (the extra tile lies past the sequence and only loads), an even grid
            num_m_blocks = (num_m_blocks + 1) // 2 * 2
            max_ctas = max_ctas // 2 * 2
            cluster = [2, 1, 1]
        grid = TileScheduler.grid(num_m_blocks, cute.size(mQ.shape[2]), num_batch, split_items, cfg.split_ways)
        if const_expr(cfg.persistent):
            grid = (cutlass.min(grid[0], max_ctas), 1, 1)
        if const_expr(cfg.grid3d):
            grid = (num_m_blocks, cute.size(mQ.shape[2]), num_batch)
        self.kernel(
            tQ, tK, tV, tO, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSequsedK,
            tma_Q, tma_K, tma_V, tma_O,
            score_scale, softmax_scale_log2, window_left, window_right,
            sQ_layout, sK_layout, sV_layout, sO_layout,
            tiled_mma_qk, tiled_mma_pv, num_m_blocks, num_batch, heads_per_group, tail_pairs,
            bytes_q, bytes_k, bytes_v, Storage, block_mask, score_aux, mask_aux, mSched, mSplitWs,
            mSplitCount, split_items, mPageTable,
        ).launch(
            grid=grid,
            block=[128 * (self.num_wg + 1), 1, 1],
            cluster=cluster,
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO_tma: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSequsedK: Optional[cute.Tensor],
        tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom, tma_V: cute.CopyAtom, tma_O: cute.CopyAtom,
        score_scale: Float32, softmax_scale_log2: Float32,
        window_left: Int32, window_right: Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        num_m_blocks: Int32, num_batch: Int32, heads_per_group: Int32, tail_pairs: Int32,
        bytes_q: cutlass.Constexpr[int], bytes_k: cutlass.Constexpr[int], bytes_v: cutlass.Constexpr[int],
        Storage: cutlass.Constexpr,
        block_mask, score_aux, mask_aux, mSched, mSplitWs, mSplitCount, split_items, mPageTable,
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if const_expr(cfg.grid3d):  # the flat item number, for the one-shot test
            _, by, bz = cute.arch.block_idx()
            bidx = bidx + num_m_blocks * (by + cute.size(mQ.shape[2]) * bz)
        sched = TileScheduler(num_m_blocks, cute.size(mQ.shape[2]), num_batch, heads_per_group, tail_pairs,
                              cfg.causal, split_items, cfg.split_ways, 2 if cfg.kv_multicast else 1)
        brange = BlockRange(self.tile_m, self.tile_n, cfg.causal, cfg.has_window, window_left, window_right)

        if warp_idx == 0:
            for atom in (tma_Q, tma_K, tma_V, tma_O):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(Storage)
        tma_warp = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_wg * 4)
        kv_ring = dict(producer_group=tma_warp, consumer_group=consumer_warps)
        if const_expr(cfg.kv_multicast):
            # each consumer warp releases a K/V slot in both CTAs of the pair (lanes 0 and 1 arrive
            # on rank 0's and rank 1's barrier): the next tile is multicast into both
            kv_ring = dict(producer_group=tma_warp,
                           consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_wg * 128),
                           cta_layout_vmnk=cute.make_layout((1, 2, 1, 1)), mcast_mode_mn=(0, 1),
                           enable_multicast_signaling=True)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=tma_warp,
            consumer_group=consumer_warps, tx_count=bytes_q, defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=cfg.num_stages,
            tx_count=bytes_k, defer_sync=True, **kv_ring)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=cfg.num_stages,
            tx_count=bytes_v, defer_sync=True, **kv_ring)
        mailbox = None
        if const_expr(cfg.dynamic_schedule):
            mailbox = (storage.mbar_sched.data_ptr(), storage.sched_slots.get_tensor(cute.make_layout(2)),
                       mSched.iterator)
            if warp_idx == 0:
                with cute.arch.elect_one():
                    init_mailbox(mailbox[0], self.num_wg * 4)  # every consumer warp reads each item
        cute.arch.mbarrier_init_fence()
        if const_expr(cfg.kv_multicast):
            # the pair's barriers are initialised before either CTA arrives on the other's
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        # the CTA's operands, read by the roles' methods (fwd_producer.py, fwd_consumer.py) rather
        # than passed down every call
        self._split = (mSplitWs, mSplitCount, storage.split_flags.get_tensor(cute.make_layout(4)))
        self._sched, self._brange, self._block_mask, self._mailbox = sched, brange, block_mask, mailbox
        self._score_scale, self._softmax_scale_log2 = score_scale, softmax_scale_log2
        self._score_aux, self._mask_aux = score_aux, mask_aux
        self._mQ, self._mK, self._mV, self._mO_tma, self._mO, self._mLSE = mQ, mK, mV, mO_tma, mO, mLSE
        self._seqlen_args = (mCuSeqlensQ, mCuSeqlensK, mSequsedK)
        self._page_table = mPageTable
        self._tma_loads, self._tma_O = (tma_Q, tma_K, tma_V), tma_O
        self._pipes, self._mmas = (pipe_q, pipe_k, pipe_v), (tiled_mma_qk, tiled_mma_pv)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        o_buf = storage.sO if const_expr(self.separate_o) else storage.sQ
        sO = o_buf.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        # the same O tiles stacked along rows, (tile_m, Dv), to partition like the accumulator
        o_outer = sO_layout.outer
        sO_mn = o_buf.get_tensor(
            cute.make_layout(((o_outer.shape[0], o_outer.shape[2]), o_outer.shape[1]),
                             stride=((o_outer.stride[0], o_outer.stride[2]), o_outer.stride[1])),
            swizzle=sO_layout.inner)
        # V^T view (Dv, tile_n, stages): the B operand of O += P V
        sVt = cute.composition(
            sV, cute.make_ordered_layout((self.hdimv, self.tile_n, cfg.num_stages), order=(1, 0, 2)))
        self._sQ, self._sK, self._sV, self._sVt, self._sO, self._sO_mn = sQ, sK, sV, sVt, sO, sO_mn

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(bidx)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(bidx, tidx - 128)

    @cute.jit
    def _unit(self, tile):
        """(m_block, head, batch, piece) of work unit `tile`; piece -1: a whole item (always
        without split_ways)."""
        if const_expr(self.cfg.grid3d):
            m_block, head, batch = cute.arch.block_idx()
            return m_block, head, batch, Int32(-1)
        m_block, head, batch = self._sched.work(tile)
        piece, _ = self._sched.piece(tile)
        return m_block, head, batch, piece

    def _seqlen(self, batch) -> SeqlenInfo:
        keys = self._mK.shape[0]
        if const_expr(self.cfg.page_box):  # a sequence without seqused_k fills its pages
            keys = self._page_table.shape[1] * keys
        return SeqlenInfo(batch, self._mQ.shape[0], keys, *self._seqlen_args)

    @cute.jit
    def _takes_part(self, m_block, seqlen: SeqlenInfo):
        """Whether this CTA loads and walks work item `m_block`. Varlen grids are sized for the
        longest sequence, so items past a sequence's end are empty; under kv_multicast such an
        item (the pair's rounding tile) still loads its half of every K / V tile for the other CTA
        (and a Q tile past the end, which the TMA fills with zeros), its warpgroups taking the
        idle path that releases every slot."""
        live = m_block * self.tile_m < seqlen.seqlen_q
        if const_expr(self.cfg.kv_multicast):
            live = m_block >= 0  # (always)
        return live

    @cute.jit
    def _kv_walk(self, seqlen: SeqlenInfo, m_block, head, batch, piece):
        """The key tiles work unit (m_block, piece) visits: all of the item's, or with split_ways
        = k piece `piece` >= 0 of its k consecutive shares."""
        cfg = self.cfg
        if const_expr(cfg.block_sparse):
            return SparseKvWalk(*self._block_mask, batch, head, m_block, cfg.bm_tiles_m, cfg.bm_tiles_n)
        n_min, n_max = self._brange.n_block_range(m_block, seqlen.seqlen_q, seqlen.seqlen_k)
        if const_expr(cfg.split_ways):
            k = cfg.split_ways
            count = n_max - n_min
            share = cutlass.max(piece, 0)
            n_lo = n_min + count * share // k
            n_hi = n_min + count * (share + 1) // k
            n_min = cutlass.select_(piece >= 0, n_lo, n_min)
            n_max = cutlass.select_(piece >= 0, n_hi, n_max)
        return DenseKvWalk(n_min, n_max)
