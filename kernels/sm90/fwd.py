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

so the softmax of tile i runs while the tensor cores work on tile i-1's P V ("intra-warpgroup
overlap"). With `split_mask_loops` (fwd_host picks it per head dim) the loop runs as three
loops: the tiles at either end of the walk that the causal / window / length limits cut (with
element masks) and the tiles between them (no mask code at all); `BlockRange.masked_ends` finds
the split. With `pingpong`, named barriers make the consumer warpgroups take turns issuing their
matmuls, so one warpgroup's softmax runs under the other's matmuls. P stays in registers and is
the A operand of the second wgmma (no shared-memory round trip), converted by packed pairs
(kernels/common/convert.py: an element-wise conversion doubled P's registers at 192 rows).

Mods (score_mod / mask_mod, traced graphs from torch_fa4.mods, named by `mod_key`) are inlined per
score element (kernels/common/tile_mods.py): softcap, then score_mod in natural units (the softmax
then runs with scale log2(e)), then the causal / window / length masks, then mask_mod. With a
block mask (`block_sparse`) the key tiles come from its lists (kernels/common/kv_tile_walk.py) and
mask_mod runs on its partial tiles only. Without mods every piece of this is absent at compile time.

Work items (query tile, head, batch) come from kernels/common/tile_scheduler.py in longest-first
order. With `persistent` (D <= 128, no window, no mods: beyond that the outer loop costs ptxas the
registers it needs to keep the wgmmas asynchronous) each CTA loops over its items -- the producer
loads the next item's first K and Q while the consumers finish the current one -- and the host
chooses the grid: about one CTA per SM, or one per item (each CTA's loop then runs once). A
persistent CTA takes its items in a static round-robin, or with `dynamic_schedule` from a global
counter as it frees (kernels/common/tile_mailbox.py: the producer warp takes each item and hands
it to the consumer warps through shared memory), which balances causal items of unequal length.
With `early_q_release` Q's buffer is freed as soon as the walk's last Q K^T lands, so the next
item's Q loads under this item's last softmax and P V.

Epilogue: O is normalised in registers, converted, written to shared memory over Q's buffer (Q is
dead by then) and stored with TMA, 64 rows per warpgroup; varlen tiles, whose last rows would spill
into the next sequence, store from registers with a row predicate instead. LSE goes straight from
registers.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
from cutlass import Float32, Int32, const_expr
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.utils import LayoutEnum

from torch_fa4.kernels.common.acc_layout import a_operand, rows_cols
from torch_fa4.kernels.common.block_range import BlockRange
from torch_fa4.kernels.common.convert import convert_pairs
from torch_fa4.kernels.common import l2_hints
from torch_fa4.kernels.common.kv_tile_walk import DenseKvWalk, SparseKvWalk
from torch_fa4.kernels.common.masking import apply_mask
from torch_fa4.kernels.common.online_softmax import OnlineSoftmax, scale_rows
from torch_fa4.kernels.common.ring_waits import wait_full
from torch_fa4.kernels.common.seqlen_info import SeqlenInfo
from torch_fa4.kernels.common.tile_mods import TileMods
from torch_fa4.kernels.common.tile_mailbox import init_mailbox, next_item, publish_item, read_item
from torch_fa4.kernels.common.tile_scheduler import TileScheduler
from torch_fa4.kernels.common import wgmma
from torch_fa4.kernels.sm90.fwd_config import MAX_AUX, FwdConfig  # noqa: F401  (FwdConfig re-exported)

SMEM_BYTES = 227 * 1024  # shared memory one CTA may allocate on sm_90
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453

# Tracing (cfg.trace): per work item, the global nanosecond timer (low 32 bits) at these points,
# then the SM's id, into mTrace[item, :] (benchmarks/fwd_trace.py). The producer warp stamps the
# first two, the first thread of consumer warpgroup 0 the rest.
FWD_TRACE_EVENTS = ("item_start", "q_issued", "q_ready", "first_s", "last_pv", "epilogue_done")
FWD_TRACE_SMID = len(FWD_TRACE_EVENTS)

# named barrier ids (0 is __syncthreads)
_BAR_SCHED = 1  # 1..3: consumer warpgroup turn-taking
_BAR_EPI_ALL = 4  # all consumers: every wgmma reading Q is done before O overwrites it
_BAR_EPI_WG = 5  # 5..7: one warpgroup's O tile is in shared memory


class FlashFwdSm90:
    def __init__(self, cfg: FwdConfig):
        self.cfg = cfg
        self.dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[cfg.dtype_name]
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.hdim, self.hdimv = cfg.head_dim, cfg.head_dim_v
        assert self.hdim == self.hdimv, "O reuses Q's shared memory"
        self.num_wg = cfg.num_consumer_wg
        assert self.num_wg in (1, 2, 3)
        self.num_threads = 128 * (self.num_wg + 1)
        # registers per thread after setmaxnreg: producer gives up what the consumers take
        self.producer_regs, self.consumer_regs = {1: (56, 256), 2: (24, 240), 3: (32, 160)}[self.num_wg]
        self.pingpong = cfg.pingpong and self.num_wg >= 2
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
        # the early rescale applies every tile's factors; the conditional rescale skips some (fwd_config)
        assert not (cfg.early_o_rescale and cfg.rescale_threshold is not None)
        # O gets its own shared-memory tile when it fits beside Q and the K/V rings (D <= 128): the
        # next work item's Q then loads while this one's epilogue runs. Otherwise O is staged over
        # Q's buffer and the next Q waits for the O store.
        elem = 2
        ring = cfg.num_stages * cfg.tile_n * (self.hdim + self.hdimv) * elem
        q_o = cfg.tile_m * (self.hdim + self.hdimv) * elem
        self.separate_o = ring + q_o + 4 * 1024 <= SMEM_BYTES
        self._early_q_release = cfg.early_q_release and self.separate_o

    # ------------------------------------------------------------------ layouts
    def _smem_layout(self, rows: int, cols: int, stages: Optional[int]):
        atom = warpgroup.make_smem_layout_atom(
            hopper.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, cols), self.dtype
        )
        shape = (rows, cols) if stages is None else (rows, cols, stages)
        order = (0, 1) if stages is None else (0, 1, 2)
        return cute.tile_to_shape(atom, shape, order)

    def _tiled_mmas(self):
        qk = hopper.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.tile_n),
        )
        pv = hopper.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.hdimv),
            a_source=warpgroup.OperandSource.RMEM,
        )
        return qk, pv

    def _storage_class(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        stages, dt = self.cfg.num_stages, self.dtype

        def buffer(layout):
            return cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(layout)], 1024]

        @cute.struct
        class Shared:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_sched: cute.struct.MemRange[cutlass.Int64, 4]  # dynamic_schedule: item mailbox
            sched_slots: cute.struct.MemRange[Int32, 2]
            sQ: buffer(sQ_layout)
            sK: buffer(sK_layout)
            sV: buffer(sV_layout)

        if not self.separate_o:
            return Shared

        @cute.struct
        class SharedWithO:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_sched: cute.struct.MemRange[cutlass.Int64, 4]  # dynamic_schedule: item mailbox
            sched_slots: cute.struct.MemRange[Int32, 2]
            sQ: buffer(sQ_layout)
            sK: buffer(sK_layout)
            sV: buffer(sV_layout)
            sO: buffer(sO_layout)

        return SharedWithO

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, Hq, D) or (Tq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D) or (Tk, Hkv, D)
        mV: cute.Tensor,
        mO: cute.Tensor,  # like mQ, contiguous
        mLSE: cute.Tensor,  # (B, Hq, Sq) or (Hq, Tq), fp32
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSequsedK: Optional[cute.Tensor],
        score_scale: Float32,  # multiplies q.k before softmax (scale, or scale/softcap)
        softmax_scale_log2: Float32,  # log2(e) * (scale, or softcap)
        window_left: Int32,
        window_right: Int32,
        num_batch: Int32,
        max_seqlen_q: Int32,
        heads_per_group: Int32,
        max_ctas: Int32,  # persistent grid size (about one CTA per SM)
        # block mask (block_sparse only, else None): kv_num_blocks, kv_indices, full_kv_num_blocks,
        # full_kv_indices, int32, FlexAttention layout
        mBmNum: Optional[cute.Tensor],
        mBmIdx: Optional[cute.Tensor],
        mBmFullNum: Optional[cute.Tensor],
        mBmFullIdx: Optional[cute.Tensor],
        # captured tensors of the mods, ModSet order, None past the last (TVM-FFI takes no tuples)
        aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7,
        mSched: Optional[cute.Tensor],  # (1,) int32, zero at launch (cfg.dynamic_schedule), else None
        mTrace: Optional[cute.Tensor],  # (work items, len(FWD_TRACE_EVENTS) + 1) int32 (cfg.trace), else None
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        aux = (aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7)[: len(cfg.aux_specs)]
        score_aux, mask_aux = aux[: self.num_score_aux], aux[self.num_score_aux:]
        block_mask = (mBmNum, mBmIdx, mBmFullNum, mBmFullIdx) if const_expr(cfg.block_sparse) else None
        # sequence-major views: (S, D, H, B); varlen gets a unit batch mode so indexing is uniform
        if const_expr(cfg.varlen_q):
            mQ = cute.make_tensor(mQ.iterator, cute.append(cute.select(mQ.layout, mode=[0, 2, 1]), cute.make_layout(1, stride=0)))
            mO = cute.make_tensor(mO.iterator, cute.append(cute.select(mO.layout, mode=[0, 2, 1]), cute.make_layout(1, stride=0)))
            mLSE = cute.make_tensor(mLSE.iterator, cute.append(cute.select(mLSE.layout, mode=[1, 0]), cute.make_layout(1, stride=0)))
        else:
            mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
            mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))
        if const_expr(cfg.varlen_k):
            mK = cute.make_tensor(mK.iterator, cute.append(cute.select(mK.layout, mode=[0, 2, 1]), cute.make_layout(1, stride=0)))
            mV = cute.make_tensor(mV.iterator, cute.append(cute.select(mV.layout, mode=[0, 2, 1]), cute.make_layout(1, stride=0)))
        else:
            mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
            mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[1, 3, 2, 0]))

        tiled_mma_qk, tiled_mma_pv = self._tiled_mmas()
        sQ_layout = self._smem_layout(self.tile_m, self.hdim, None)
        sK_layout = self._smem_layout(self.tile_n, self.hdim, cfg.num_stages)
        sV_layout = self._smem_layout(self.tile_n, self.hdimv, cfg.num_stages)
        # O: one standalone 64-row tile per consumer warpgroup, each stored by its own TMA
        sO_layout = self._smem_layout(64, self.hdimv, self.num_wg)

        tma_Q, tQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, sQ_layout, (self.tile_m, self.hdim))
        tma_K, tK = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.hdim))
        tma_V, tV = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, self.hdimv))
        tma_O, tO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]), (64, self.hdimv))

        bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))

        Storage = self._storage_class(sQ_layout, sK_layout, sV_layout, sO_layout)

        num_m_blocks = (max_seqlen_q + self.tile_m - 1) // self.tile_m
        grid = TileScheduler.grid(num_m_blocks, cute.size(mQ.shape[2]), num_batch)
        if const_expr(cfg.persistent):
            grid = (cutlass.min(grid[0], max_ctas), 1, 1)
        self.kernel(
            tQ, tK, tV, tO, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSequsedK,
            tma_Q, tma_K, tma_V, tma_O,
            score_scale, softmax_scale_log2, window_left, window_right,
            sQ_layout, sK_layout, sV_layout, sO_layout,
            tiled_mma_qk, tiled_mma_pv, num_m_blocks, num_batch, heads_per_group,
            bytes_q, bytes_k, bytes_v, Storage, block_mask, score_aux, mask_aux, mSched, mTrace,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------ device side
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
        num_m_blocks: Int32, num_batch: Int32, heads_per_group: Int32,
        bytes_q: cutlass.Constexpr[int], bytes_k: cutlass.Constexpr[int], bytes_v: cutlass.Constexpr[int],
        Storage: cutlass.Constexpr,
        block_mask, score_aux, mask_aux, mSched, mTrace,
    ):
        cfg = self.cfg
        # read by _stamp while this kernel is traced (saves threading it through every role)
        self._trace = mTrace
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        sched = TileScheduler(num_m_blocks, cute.size(mQ.shape[2]), num_batch, heads_per_group, cfg.causal)
        brange = BlockRange(self.tile_m, self.tile_n, cfg.causal, cfg.has_window, window_left, window_right)

        if warp_idx == 0:
            for atom in (tma_Q, tma_K, tma_V, tma_O):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(Storage)
        tma_warp = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_wg * 4)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=tma_warp,
            consumer_group=consumer_warps, tx_count=bytes_q, defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=cfg.num_stages,
            producer_group=tma_warp, consumer_group=consumer_warps, tx_count=bytes_k, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=cfg.num_stages,
            producer_group=tma_warp, consumer_group=consumer_warps, tx_count=bytes_v, defer_sync=True)
        mailbox = None
        if const_expr(cfg.dynamic_schedule):
            mailbox = (storage.mbar_sched.data_ptr(), storage.sched_slots.get_tensor(cute.make_layout(2)),
                       mSched.iterator)
            if warp_idx == 0:
                with cute.arch.elect_one():
                    init_mailbox(mailbox[0], self.num_wg * 4)  # every consumer warp reads each item
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

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

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(mQ, mK, mV, mCuSeqlensQ, mCuSeqlensK, mSequsedK, sQ, sK, sV,
                             tma_Q, tma_K, tma_V, pipe_q, pipe_k, pipe_v, sched, brange, block_mask,
                             bidx, mailbox)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(
                mQ, mK, mO_tma, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSequsedK, sQ, sK, sVt, sO, sO_mn,
                tma_O, pipe_q, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv, score_scale,
                softmax_scale_log2, brange, sched, block_mask, score_aux, mask_aux, bidx,
                tidx - 128, mailbox)

    @cute.jit
    def _kv_walk(self, brange: BlockRange, seqlen: SeqlenInfo, block_mask, m_block, head, batch):
        if const_expr(self.cfg.block_sparse):
            return SparseKvWalk(*block_mask, batch, head, m_block, self.cfg.bm_tiles_m, self.cfg.bm_tiles_n)
        n_min, n_max = brange.n_block_range(m_block, seqlen.seqlen_q, seqlen.seqlen_k)
        return DenseKvWalk(n_min, n_max)

    @cute.jit
    def produce(self, mQ, mK, mV, mCuSeqlensQ, mCuSeqlensK, mSequsedK, sQ, sK, sV,
                tma_Q, tma_K, tma_V, pipe_q, pipe_k, pipe_v, sched: TileScheduler, brange: BlockRange,
                block_mask, bidx, mailbox):
        """The TMA warp: for each work item of this CTA, Q once and the walk's K and V tiles."""
        cfg = self.cfg
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.num_stages)
        args = (mQ, mK, mV, mCuSeqlensQ, mCuSeqlensK, mSequsedK, sQ, sK, sV, tma_Q, tma_K, tma_V,
                pipe_q, pipe_k, pipe_v, sched, brange, block_mask)
        tile = bidx
        if const_expr(cfg.dynamic_schedule):
            bar, slots, counter = mailbox
            num_ctas = cute.arch.grid_dim()[0]
            i = Int32(0)
            while tile < sched.num_tiles():
                publish_item(bar, slots, i, tile)
                q_state, k_state, v_state = self.produce_item(tile, q_state, k_state, v_state, *args)
                # taken once this item's loads are all issued, as a freed SM would take a new CTA
                # (taken as they start instead: worse, NOTES "Experiment 63")
                tile = next_item(counter, num_ctas)
                i += 1
            publish_item(bar, slots, i, tile)  # past the last item: the consumers stop
        elif const_expr(cfg.persistent):
            num_ctas = cute.arch.grid_dim()[0]
            rnd = Int32(0)
            while tile < sched.num_tiles():
                q_state, k_state, v_state = self.produce_item(tile, q_state, k_state, v_state, *args)
                rnd += 1
                tile = sched.persistent_tile(rnd, bidx, num_ctas)
        else:
            if tile < sched.num_tiles():
                self.produce_item(tile, q_state, k_state, v_state, *args)

    @cute.jit
    def produce_item(self, tile, q_state, k_state, v_state, mQ, mK, mV, mCuSeqlensQ, mCuSeqlensK, mSequsedK,
                     sQ, sK, sV, tma_Q, tma_K, tma_V, pipe_q, pipe_k, pipe_v, sched: TileScheduler,
                     brange: BlockRange, block_mask):
        """Work item `tile`'s loads; returns the ring positions after them."""
        cfg = self.cfg
        lane0 = cute.arch.lane_idx() == 0
        if lane0:
            self._stamp(tile, 0)
        # every query tile of a head reads the same K and V; Q is read once
        shared_hint = l2_hints.policy(cfg.kv_evict_last, l2_hints.EVICT_LAST)
        once_hint = l2_hints.policy(cfg.q_evict_first, l2_hints.EVICT_FIRST)
        num_heads_kv = cute.size(mK.shape[2])
        m_block, head, batch = sched.work(tile)
        seqlen = SeqlenInfo(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSequsedK)
        # varlen grids are sized for the longest sequence: items past a sequence's end are empty
        if m_block * self.tile_m < seqlen.seqlen_q:
            batch_q = batch if const_expr(not cfg.varlen_q) else 0
            batch_k = batch if const_expr(not cfg.varlen_k) else 0
            head_kv = head // (cute.size(mQ.shape[2]) // num_heads_kv)
            walk = self._kv_walk(brange, seqlen, block_mask, m_block, head, batch)
            gQ = cute.local_tile(seqlen.q_rows(mQ[None, None, head, batch_q]), (self.tile_m, self.hdim), (m_block, 0))
            gK = cute.local_tile(seqlen.k_rows(mK[None, None, head_kv, batch_k]), (self.tile_n, self.hdim), (None, 0))
            gV = cute.local_tile(seqlen.k_rows(mV[None, None, head_kv, batch_k]), (self.tile_n, self.hdimv), (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_Q, 0, cute.make_layout(1),
                                               cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            tKsK, tKgK = cpasync.tma_partition(tma_K, 0, cute.make_layout(1),
                                               cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma_V, 0, cute.make_layout(1),
                                               cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
            # order: K[first]; Q; then K[t+1], V[t] pairs; then V[last] -- the consumers' order of
            # need, so a full ring never blocks the tile they wait for. The first K goes before Q:
            # Q's buffer frees only when the previous item is done with it, K's slot earlier.
            if walk.nonempty():
                pipe_k.producer_acquire(k_state)
                cute.copy(tma_K, tKgK[None, walk.n_block(0)], tKsK[None, k_state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(k_state), cache_policy=shared_hint)
                k_state.advance()
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state), cache_policy=once_hint)
            q_state.advance()
            if lane0:
                self._stamp(tile, 1)
            if walk.nonempty():
                for i in cutlass.range(walk.count - 1, unroll=1):
                    pipe_k.producer_acquire(k_state)
                    cute.copy(tma_K, tKgK[None, walk.n_block(i + 1)], tKsK[None, k_state.index],
                              tma_bar_ptr=pipe_k.producer_get_barrier(k_state), cache_policy=shared_hint)
                    k_state.advance()
                    pipe_v.producer_acquire(v_state)
                    cute.copy(tma_V, tVgV[None, walk.n_block(i)], tVsV[None, v_state.index],
                              tma_bar_ptr=pipe_v.producer_get_barrier(v_state), cache_policy=shared_hint)
                    v_state.advance()
                pipe_v.producer_acquire(v_state)
                cute.copy(tma_V, tVgV[None, walk.n_block(walk.count - 1)], tVsV[None, v_state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(v_state), cache_policy=shared_hint)
                v_state.advance()
        return q_state, k_state, v_state

    @cute.jit
    def _stamp(self, tile, event: cutlass.Constexpr):
        """Tracing: the global timer at FWD_TRACE_EVENTS[event] of work item `tile` (and the SM id
        with the last event); no code when off. Stored at once: a timer read kept for later may be
        moved by the compiler."""
        if const_expr(self.cfg.trace):
            self._trace[tile, event] = cute.arch.globaltimer_lo()
            if const_expr(event == FWD_TRACE_SMID - 1):
                self._trace[tile, FWD_TRACE_SMID] = cute.arch.smid()

    # consumer warpgroups take turns issuing matmuls (pingpong); no-ops otherwise
    @cute.jit
    def _turn_wait(self, wg: Int32):
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=_BAR_SCHED + wg, number_of_threads=256)

    @cute.jit
    def _turn_pass(self, wg: Int32):
        if const_expr(self.pingpong):
            nxt = wg + 1
            if nxt == self.num_wg:
                nxt = 0
            cute.arch.barrier_arrive(barrier_id=_BAR_SCHED + nxt, number_of_threads=256)

    @cute.jit
    def _scores(self, acc_s, coords, brange, m_block, n_block, seqlen, score_scale, mods, partial,
                masked: cutlass.Constexpr = None):
        """Raw q.k -> softmax units (softcap, score_mod) and masks, in place.

        partial: whether mask_mod must run on this tile (a block mask's partial tile; always True
        without a block mask). masked: whether the causal / window / length mask applies (None:
        decided per tile at run time)."""
        if const_expr(self.cfg.softcap):
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = cute.math.tanh(acc_s[i] * score_scale, fastmath=True)
        if const_expr(self.score_graph is not None):
            mods.score_mod(acc_s, coords, m_block * self.tile_m, n_block * self.tile_n)
        if const_expr(masked is None):
            if brange.needs_mask(n_block, m_block, seqlen.seqlen_q, seqlen.seqlen_k):
                apply_mask(acc_s, coords, brange, m_block, n_block, seqlen.seqlen_q, seqlen.seqlen_k, True)
        elif const_expr(masked):
            apply_mask(acc_s, coords, brange, m_block, n_block, seqlen.seqlen_q, seqlen.seqlen_k, True)
        if const_expr(self.mask_graph is not None):
            if const_expr(self.cfg.block_sparse):
                if partial:
                    mods.mask_mod(acc_s, coords, m_block * self.tile_m, n_block * self.tile_n)
            else:
                mods.mask_mod(acc_s, coords, m_block * self.tile_m, n_block * self.tile_n)

    def _is_partial(self, walk, t):
        return walk.is_partial(t) if const_expr(self.cfg.block_sparse) else True

    @cute.jit
    def _kv_step(self, t, masked: cutlass.Constexpr, state, v_state, softmax, acc_s, acc_o, tOrP,
                 row_scale, coords, tSrQ, tSrK, tOrVt, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv,
                 brange, m_block, seqlen, score_scale, mods, walk, wg, pipe_q, q_state):
        """Key tile t >= 1 of the walk: S_t = Q K_t^T beside O += P_{t-1} V_{t-1}, then the softmax
        of S_t under the P V. Returns the ring positions and the softmax state after it."""
        n_block = walk.n_block(t)
        partial = self._is_partial(walk, t)
        if const_expr(self.cfg.early_o_rescale):
            # O holds the tiles up to t-2 against the reference before tile t-1: move it to tile
            # t-1's reference (row_scale still holds that tile's factors) before P_{t-1} V_{t-1} joins
            scale_rows(acc_o, row_scale)
        wait_full(pipe_k, state, self.cfg.peek_waits)
        self._turn_wait(wg)
        wgmma.issue(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, state.index], True, -1)
        wait_full(pipe_v, v_state, self.cfg.peek_waits)
        wgmma.issue(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, v_state.index], False, -1)
        self._turn_pass(wg)
        warpgroup.wait_group(1)  # S ready; P V still running
        if const_expr(self._early_q_release):
            if t == walk.count - 1:  # the walk's last Q K^T is done
                pipe_q.consumer_release(q_state)
        if const_expr(not self.cfg.pin_pv_wait):
            pipe_k.consumer_release(state)
        self._scores(acc_s, coords, brange, m_block, n_block, seqlen, score_scale, mods, partial, masked)
        moved = softmax.step(acc_s, row_scale)
        if const_expr(self.cfg.pin_pv_wait):
            self._release_after_softmax(pipe_k, state, softmax)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        if const_expr(not self.cfg.early_o_rescale):
            if moved:
                scale_rows(acc_o, row_scale)
        convert_pairs(a_operand(acc_s), tOrP)
        v_state = state.clone()
        state.advance()
        return state, v_state, softmax

    @cute.jit
    def _release_after_softmax(self, pipe_k, state, softmax):
        """Release the K slot once the softmax is done, as a data dependence ptxas can see.

        ptxas moves the P V wait (WARPGROUP.DEPBAR) freely among the softmax's arithmetic, and
        put it right after the row max: the warpgroup then waited for P V before its
        exponentials, which no longer ran under the matmul. It does not move the wait above a
        memory operation such as this mbarrier arrive, so the arrive is predicated on the row
        sums (never negative, so the predicate is always true; NaN compares false too): it cannot
        issue before the last exponential, and the wait follows it."""
        total = softmax.row_sum[0]
        for r in cutlass.range_constexpr(1, cute.size(softmax.row_sum)):
            total = total + softmax.row_sum[r]
        if not (total < Float32(0.0)):
            pipe_k.consumer_release(state)

    @cute.jit
    def consume(self, mQ, mK, mO_tma, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSequsedK, sQ, sK, sVt, sO, sO_mn,
                tma_O, pipe_q, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv, score_scale, softmax_scale_log2,
                brange: BlockRange, sched: TileScheduler, block_mask, score_aux, mask_aux, bidx,
                tidx, mailbox):
        """A consumer warpgroup: its 64 rows of every work item of this CTA."""
        cfg = self.cfg
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        if const_expr(self.pingpong):
            if wg == 0:  # the first warpgroup goes first
                cute.arch.barrier_arrive(barrier_id=_BAR_SCHED, number_of_threads=256)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        # K and V are produced in the same number per item, so one ring position serves both
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages)
        args = (mQ, mK, mO_tma, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSequsedK, sO, sO_mn, tma_O,
                pipe_q, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, score_scale,
                softmax_scale_log2, brange, sched, block_mask, score_aux, mask_aux, wg, tidx)
        tile = bidx
        if const_expr(cfg.dynamic_schedule):
            bar, slots, _ = mailbox
            i = Int32(0)
            tile = read_item(bar, slots, i)
            while tile < sched.num_tiles():
                q_state, state = self.consume_tile(tile, q_state, state, *args)
                i += 1
                tile = read_item(bar, slots, i)
        elif const_expr(cfg.persistent):
            num_ctas = cute.arch.grid_dim()[0]
            rnd = Int32(0)
            while tile < sched.num_tiles():
                q_state, state = self.consume_tile(tile, q_state, state, *args)
                rnd += 1
                tile = sched.persistent_tile(rnd, bidx, num_ctas)
        else:
            if tile < sched.num_tiles():
                self.consume_tile(tile, q_state, state, *args)

    @cute.jit
    def consume_tile(self, tile, q_state, state, mQ, mK, mO_tma, mO, mLSE, mCuSeqlensQ, mCuSeqlensK,
                     mSequsedK, sO, sO_mn, tma_O, pipe_q, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv, tSrQ,
                     tSrK, tOrVt, score_scale, softmax_scale_log2, brange: BlockRange, sched: TileScheduler,
                     block_mask, score_aux, mask_aux, wg, tidx):
        """Work item `tile`, unless it lies past its sequence's end; returns the Q and K/V ring
        positions after it."""
        m_block, head, batch = sched.work(tile)
        seqlen = SeqlenInfo(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSequsedK)
        if m_block * self.tile_m < seqlen.seqlen_q:
            walk = self._kv_walk(brange, seqlen, block_mask, m_block, head, batch)
            args = (mO_tma, mO, mLSE, sO, sO_mn, tma_O, pipe_q, pipe_k, pipe_v, tiled_mma_qk,
                    tiled_mma_pv, tSrQ, tSrK, tOrVt, score_scale, softmax_scale_log2, brange, seqlen,
                    walk, m_block, head, batch, score_aux, mask_aux, q_state, state, wg, tidx, tile)
            if const_expr(self.cfg.skip_idle_rows and self.num_wg > 1):
                if m_block * self.tile_m + wg * 64 >= seqlen.seqlen_q:
                    state = self._idle_item(walk, pipe_q, pipe_k, pipe_v, q_state, state, wg)
                else:
                    state = self.consume_item(*args)
            else:
                state = self.consume_item(*args)
            q_state.advance()
            if tidx == 0:
                self._stamp(tile, 5)
        return q_state, state

    @cute.jit
    def _idle_item(self, walk, pipe_q, pipe_k, pipe_v, q_state, state, wg):
        """A work item for a warpgroup whose 64 rows all lie past the sequence's end (the last
        query tile of a sequence that is not a multiple of tile_m: 4096 = 21 x 192 + 64 leaves two
        of the three warpgroups idle there). It issues no matmul, so the tensor cores serve the
        other warpgroups, but stays in step with them: a turn at every matmul issue point of
        consume_item, every Q / K / V slot waited for and released once, and the barrier before O
        overwrites Q. Returns the K/V ring position after the item."""
        wait_full(pipe_q, q_state, self.cfg.peek_waits)
        if walk.nonempty():
            wait_full(pipe_k, state, self.cfg.peek_waits)  # the first key tile: S only
            self._turn_wait(wg)
            self._turn_pass(wg)
            pipe_k.consumer_release(state)
            v_state = state.clone()
            state.advance()
            for _ in cutlass.range(walk.count - 1, unroll=1):  # S of this tile, P V of the last
                wait_full(pipe_k, state, self.cfg.peek_waits)
                self._turn_wait(wg)
                wait_full(pipe_v, v_state, self.cfg.peek_waits)
                self._turn_pass(wg)
                pipe_k.consumer_release(state)
                pipe_v.consumer_release(v_state)
                v_state = state.clone()
                state.advance()
            wait_full(pipe_v, v_state, self.cfg.peek_waits)  # the last tile's P V
            self._turn_wait(wg)
            self._turn_pass(wg)
            pipe_v.consumer_release(v_state)
        if const_expr(not self.separate_o and not self.cfg.varlen_q):
            cute.arch.barrier(barrier_id=_BAR_EPI_ALL, number_of_threads=128 * self.num_wg)
        pipe_q.consumer_release(q_state)
        return state

    @cute.jit
    def consume_item(self, mO_tma, mO, mLSE, sO, sO_mn, tma_O, pipe_q, pipe_k, pipe_v, tiled_mma_qk,
                     tiled_mma_pv, tSrQ, tSrK, tOrVt, score_scale, softmax_scale_log2, brange: BlockRange,
                     seqlen: SeqlenInfo, walk, m_block, head, batch, score_aux, mask_aux, q_state, state,
                     wg, tidx, tile):
        """One work item: the online-softmax loop over the walk's key tiles, then the epilogue.
        Returns the K/V ring position after the item."""
        cfg = self.cfg
        batch_q = batch if const_expr(not cfg.varlen_q) else 0
        thr_qk = tiled_mma_qk.get_slice(tidx)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_o = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((self.tile_m, self.hdimv)), Float32)
        acc_o.fill(0.0)
        coords = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        num_rows = cute.size(rows_cols(coords), mode=[0])
        mods = None
        if const_expr(self.score_graph is not None or self.mask_graph is not None):
            # raw score * natural_scale is the score in natural units: scale, or softcap after tanh
            mods = TileMods(self.score_graph, self.mask_graph, score_aux, mask_aux, batch, head,
                            seqlen.seqlen_q, seqlen.seqlen_k, softmax_scale_log2 * Float32(LN_2))
        if const_expr(self.score_graph is not None):
            softmax_scale_log2 = Float32(LOG2_E)  # score_mod's output is in natural units
        softmax = OnlineSoftmax(softmax_scale_log2, num_rows, cfg.rescale_threshold, cfg.exp2_emulate_every)
        row_scale = cute.make_rmem_tensor(num_rows, Float32)

        wait_full(pipe_q, q_state, self.cfg.peek_waits)
        if tidx == 0:
            self._stamp(tile, 2)

        if walk.nonempty():
            # first key tile of the walk (the rightmost without a block mask): S only
            acc_s = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
            wait_full(pipe_k, state, self.cfg.peek_waits)
            self._turn_wait(wg)
            wgmma.issue(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, state.index], True, -1)
            self._turn_pass(wg)
            warpgroup.wait_group(0)
            if tidx == 0:
                self._stamp(tile, 3)
            pipe_k.consumer_release(state)
            if const_expr(self._early_q_release):
                if walk.count == 1:
                    pipe_q.consumer_release(q_state)
            self._scores(acc_s, coords, brange, m_block, walk.n_block(0), seqlen, score_scale, mods,
                         self._is_partial(walk, 0))
            softmax.step(acc_s, row_scale)
            convert_pairs(a_operand(acc_s), tOrP)
            v_state = state.clone()
            state.advance()

            step = (acc_s, acc_o, tOrP, row_scale, coords, tSrQ, tSrK, tOrVt, pipe_k, pipe_v,
                    tiled_mma_qk, tiled_mma_pv, brange, m_block, seqlen, score_scale, mods, walk, wg,
                    pipe_q, q_state)
            if const_expr(cfg.block_sparse or not cfg.split_mask_loops):
                for i in cutlass.range(walk.count - 1, unroll=1):
                    state, v_state, softmax = self._kv_step(i + 1, None, state, v_state, softmax, *step)
            else:
                # three loops so the tiles that need no element mask (most of them) run without
                # any mask code: [1, r) masked, [r, l) unmasked, [l, count) masked
                r, l = brange.masked_ends(m_block, seqlen.seqlen_q, seqlen.seqlen_k, walk.n_min, walk.n_max)
                r = cutlass.max(r, 1)
                l = cutlass.max(l, r)
                for t in cutlass.range(1, r, unroll=1):
                    state, v_state, softmax = self._kv_step(t, True, state, v_state, softmax, *step)
                for t in cutlass.range(r, l, unroll=cfg.unroll_unmasked):
                    state, v_state, softmax = self._kv_step(t, False, state, v_state, softmax, *step)
                if const_expr(cfg.has_window):  # else l == count (masked_ends): no third loop to compile
                    for t in cutlass.range(l, walk.count, unroll=1):
                        state, v_state, softmax = self._kv_step(t, True, state, v_state, softmax, *step)

            if const_expr(cfg.early_o_rescale):
                scale_rows(acc_o, row_scale)  # the last tile's factors, before its P V joins O
            wait_full(pipe_v, v_state, self.cfg.peek_waits)
            self._turn_wait(wg)
            wgmma.issue(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, v_state.index], False, -1)
            self._turn_pass(wg)
            warpgroup.wait_group(0)
            if tidx == 0:
                self._stamp(tile, 4)
            pipe_v.consumer_release(v_state)
        if const_expr(self.separate_o):
            if const_expr(self._early_q_release):
                if not walk.nonempty():  # (else released after the walk's last Q K^T)
                    pipe_q.consumer_release(q_state)
            else:
                pipe_q.consumer_release(q_state)  # every Q K^T of this item is done: next Q may load

        lse = cute.make_rmem_tensor(num_rows, Float32)
        softmax.finalize(row_scale, lse)
        scale_rows(acc_o, row_scale)
        self.epilogue(acc_o, lse, coords, mO_tma, mO, mLSE, sO, sO_mn, tma_O, tiled_mma_pv,
                      seqlen, m_block, head, batch_q, wg, tidx)
        if const_expr(not self.separate_o):
            # O was staged over Q's buffer: Q may load again once the O store has read it out
            pipe_q.consumer_release(q_state)
        return state

    @cute.jit
    def epilogue(self, acc_o, lse, coords, mO_tma, mO, mLSE, sO, sO_mn, tma_O, tiled_mma_pv,
                 seqlen: SeqlenInfo, m_block, head, batch_q, wg, tidx):
        cfg = self.cfg
        # LSE: the lane holding column 0 of a row writes it
        c = rows_cols(coords)
        mLSE_cur = seqlen.q_rows(mLSE[None, head, batch_q])
        if c[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + c[r, 0][0]
                if row < seqlen.seqlen_q:
                    mLSE_cur[row] = lse[r]

        r_o = cute.make_rmem_tensor(acc_o.layout, self.dtype)
        r_o.store(acc_o.load().to(self.dtype))
        thr_pv = tiled_mma_pv.get_slice(tidx)
        if const_expr(not cfg.varlen_q):
            if const_expr(self.separate_o):
                # this warpgroup's previous O store has read its tile out (its issuing warp waits
                # for that before it gets here)
                cute.arch.barrier(barrier_id=_BAR_EPI_WG + wg, number_of_threads=128)
            else:
                # every consumer's Q reads are done before O overwrites Q's buffer
                cute.arch.barrier(barrier_id=_BAR_EPI_ALL, number_of_threads=128 * self.num_wg)
            # stmatrix: one shared-memory address per 8x8 block of four (a per-element copy keeps
            # an address per store live and starves the wgmma pipeline of registers)
            stsm = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
            thr_stsm = cute.make_tiled_copy_C(stsm, tiled_mma_pv).get_slice(tidx)
            cute.copy(thr_stsm, thr_stsm.retile(r_o), thr_stsm.partition_D(sO_mn))
            cute.arch.fence_view_async_shared()  # generic-proxy writes -> TMA reads
            cute.arch.barrier(barrier_id=_BAR_EPI_WG + wg, number_of_threads=128)
            if tidx % 128 < 32:
                gO = cute.local_tile(mO_tma[None, None, head, batch_q], (64, self.hdimv),
                                     (m_block * self.num_wg + wg, 0))
                tOsO, tOgO = cpasync.tma_partition(
                    tma_O, 0, cute.make_layout(1), cute.group_modes(sO[None, None, wg], 0, 2),
                    cute.group_modes(gO, 0, 2))
                cute.copy(tma_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            if const_expr(not self.separate_o):
                # the caller releases Q's buffer next: the store must have read it out
                cute.arch.barrier(barrier_id=_BAR_EPI_WG + wg, number_of_threads=128)
        else:
            mO_cur = seqlen.q_rows(mO[None, None, head, batch_q])
            gO = cute.local_tile(mO_cur, (self.tile_m, self.hdimv), (m_block, 0))
            tOgO = thr_pv.partition_C(gO)
            tOcO = thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.hdimv)))
            limit = seqlen.seqlen_q - m_block * self.tile_m
            for i in cutlass.range_constexpr(cute.size(r_o)):
                if tOcO[i][0] < limit:
                    tOgO[i] = r_o[i]
