"""FlashAttention forward for Blackwell (sm_100a) in CuTe DSL: tcgen05 MMAs with S and O in tensor memory.

Compile-verified only: every non-MMA piece is the sm90 kernel's code from kernels/common (block
ranges, masks, online softmax, tile scheduler, varlen bookkeeping).

CTA = two 128-row query tiles (Q0, Q1) x one head x one batch; every K/V tile loaded is used by both.
(One tile with `q_tiles = 1`, below.)
Warp roles (16 warps, 512 threads; FA4's specialisation):

    warps 0-3   softmax for Q0     S0 (TMEM) -> registers, mask, online softmax, P0 -> TMEM
    warps 4-7   softmax for Q1     same for S1 / P1
    warps 8-11  correction         rescale O0/O1 in TMEM when a row's reference max moved; at the
                                   end normalise O, write O and LSE to global memory
    warp 12     MMA                issues every tcgen05.mma (one elected thread), owns TMEM allocation
    warp 13     load               TMA: Q0, Q1 once; K and V tiles alternating in one smem ring
    warps 14-15 idle               (keep warpgroup 3 whole for setmaxnreg)

Tensor memory (fwd_config.Sm100FwdConfig.tmem_columns): S0 | S1 | O0 | O1. P_t (16-bit) overwrites
the first half of S_t's columns once the softmax has S_t in registers, and is the A operand of
O_t += P_t V straight from TMEM (tcgen05 "TS" MMA): P never touches shared memory.

MMA issue order per key tile i (ping-pong: while one softmax warpgroup works on its S, the tensor
core computes the other tile's matmuls):

    S0 = Q0 K_i^T | O1 += P1 V_{i-1} | S1 = Q1 K_i^T | O0 += P0 V_i

tcgen05 MMAs from one thread execute in issue order, so O_t += P_t V always reads P_t before the
next S_t = Q_t K^T overwrites those columns.

Handshakes (mbarrier pipelines, one stage each unless noted):
    q (q_tiles stages), kv (kv_stages): TMA -> MMA         (PipelineTmaUmma)
    s_t:  MMA -> softmax_t "S_t ready";  softmax_t -> MMA "P_t ready"          (PipelineUmmaAsync)
    o_t:  MMA -> correction "O_t += P V done";  correction -> MMA "O_t rescaled" (PipelineUmmaAsync)
    c_t:  softmax_t -> correction: per-row factor (shared memory), then 1/rowsum and LSE (PipelineAsync)

Rows are lanes: thread j of a softmax or correction warpgroup owns row j of its tile (32x32b
tcgen05.ld/st), so row max/sum need no shuffles and the correction skips the TMEM round trip for a
warp whose 32 rows all kept their reference (conditional rescale).

Key tiles run from last to first, as on sm90, so masked tiles come first. Output is stored from
registers with a per-row predicate (dense, odd lengths and varlen alike).

One query tile per CTA (`q_tiles = 1`: D=256, whose O and S fill 384 columns, 128-row block masks,
gathering mask_mods): warps 4-7 idle and give their registers to the softmax, and the MMA order
is S0 = Q0 K_i^T | O0 += P0 V_i, with nothing to overlap the softmax with.

Two score buffers (`s_stages = 2`, one query tile only: S_0 | S_1 | O in 512 columns): key tile i's
S goes to buffer i % 2 and the MMA order becomes S_i = Q K_i^T | O += P_{i-1} V_{i-1}, so the tensor
core computes the next S while the softmax works on this one (`_mma_s_ring`).

A pair of CTAs (`two_cta`, kernels/sm100/pair): a cluster of two CTAs shares every MMA (tcgen05
cta_group::2, M = 256). Each CTA holds its own query tile(s) (the pair's 256-row MMA tile has CTA 0's
rows first), half of each K tile's keys and half of each V tile's columns, loaded by 2-SM TMA into its
own shared memory with completion counted on the leader CTA's (rank 0's) barrier; the leader's MMA
warp issues every MMA, whose commits arrive on both CTAs' barriers, and the softmax / correction of
both CTAs release to the leader's barriers (cutlass.pipeline with the cluster layout). Each CTA's
tensor memory holds its own rows' S / P / O, allocated for the pair (tmem.setup_pair_tmem). The
pair walks one list of key tiles for its rows; everything after the MMAs is the one-CTA code.

Mods as on sm90 (kernels/common/tile_mods.py): softcap, score_mod in natural units, the causal /
window / length masks, then mask_mod, on the thread's row viewed as a one-row wgmma fragment
(`as_wgmma_row`). With a block mask the key tiles come from its lists (common/kv_tile_walk.py;
the CTA's rows lie in one block-mask row) and mask_mod runs on its partial tiles only.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass import pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cute.nvgpu.tcgen05.copy import Ld32x32bOp, Repetition, St32x32bOp

from torch_fa4.kernels.common.block_range import BlockRange
from torch_fa4.kernels.common.kv_tile_walk import DenseKvWalk, SparseKvWalk
from torch_fa4.kernels.common.masking import apply_mask
from torch_fa4.kernels.common.online_softmax import OnlineSoftmax
from torch_fa4.kernels.common.seqlen_info import SeqlenInfo
from torch_fa4.kernels.common.tile_mods import TileMods
from torch_fa4.kernels.common.tile_scheduler import TileScheduler
from torch_fa4.kernels.sm100.fwd_config import MAX_Q_TILES, Q_TILE_ROWS, TMEM_COLUMNS, Sm100FwdConfig
from torch_fa4.kernels.sm100.packed_softmax import PackedOnlineSoftmax, scale_pairs
from torch_fa4.kernels.sm100.tmem import fence_after_sync as _tcgen05_fence_after_sync
from torch_fa4.kernels.sm100.tmem import fence_before_sync as _tcgen05_fence_before_sync
from torch_fa4.kernels.sm100.tmem import release_pair_tmem, setup_pair_tmem, setup_tmem
from torch_fa4.kernels.sm100.tmem import tmem_copy as _tmem_copy
from torch_fa4.kernels.sm100.tmem import umma as _umma
from torch_fa4.kernels.sm90.fwd import _sequence_major
from torch_fa4.kernels.sm90.fwd_config import MAX_AUX

SMEM_BYTES = 227 * 1024  # shared memory one CTA may allocate on sm_100
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453

_SOFTMAX_WARPS = (0, 4)  # first warp of softmax warpgroup 0 / 1
_CORRECTION_WARP0 = 8
_MMA_WARP = 12
_LOAD_WARP = 13
_NUM_THREADS = 512
# registers per thread after setmaxnreg (512 threads x 128 on entry = 64K): Sm100FwdConfig.registers.
# The softmax holds a full 128-column score row (P is converted and stored chunk by chunk); the
# correction works on 32-column chunks of O; MMA and load warps need few.
# With one query tile the idle softmax warpgroup gives its registers to the other (240 + 24 + 80 +
# 64 <= 512 per thread-slot of the four warpgroups): room for a mask_mod's gathered values
_REGS_SOFTMAX_ALONE, _REGS_IDLE = 240, 24
_CHUNK = 32  # O columns per tcgen05.ld/st in the correction warps
_P_CHUNK = 16  # P columns (32 scores) per tcgen05.st in the softmax warps
_MOD_CHUNK = 32  # scores per score_mod / mask_mod emission (`row_chunks`)


def as_wgmma_row(t: cute.Tensor) -> cute.Tensor:
    """A thread's 1-row fragment (N values in any layout) viewed as a wgmma accumulator, ((1, 1, N), 1,
    1), whose `rows_cols` is one row of N columns in the fragment's order: so the masks and the online
    softmax are sm90's code (OnlineSoftmax with row_lanes=1: no cross-lane reductions)."""
    n = cute.size(t)
    return cute.make_tensor(t.iterator, cute.composition(t.layout, cute.make_layout(((1, 1, n), 1, 1))))


def row_chunks(t: cute.Tensor, width: int) -> list:
    """A thread's 1-row fragment (or its coordinates) cut into `width`-column pieces, each as a
    wgmma row (`as_wgmma_row`): the mods run chunk by chunk, so the values a mod gathers per column
    (doc_ids[kv_idx]) are live for one chunk at a time beside the row of scores."""
    n = cute.size(t)
    flat = cute.make_tensor(t.iterator, cute.composition(t.layout, cute.make_layout(n)))
    pieces = cute.zipped_divide(flat, (width,))
    return [as_wgmma_row(pieces[None, c]) for c in range(n // width)]


class FlashFwdSm100:
    def __init__(self, cfg: Sm100FwdConfig):
        self.cfg = cfg
        self.dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[cfg.dtype_name]
        self.hdim, self.hdimv = cfg.head_dim, cfg.head_dim_v
        assert self.hdim == self.hdimv, "K and V tiles share one shared-memory ring"
        self.tile_n = cfg.tile_n
        self.q_tiles = cfg.q_tiles
        self._softmax_kind = PackedOnlineSoftmax if cfg.packed_f32x2 else OnlineSoftmax
        assert 1 <= self.q_tiles <= MAX_Q_TILES
        regs_softmax, regs_correction, regs_other = cfg.registers
        assert 2 * max(regs_softmax, _REGS_SOFTMAX_ALONE // 2) + regs_correction + regs_other <= 512
        assert all(r % 8 == 0 for r in cfg.registers), "setmaxnreg takes multiples of 8"
        self.score_graph = self.mask_graph = None
        self.num_score_aux = 0
        if cfg.mod_key:
            from torch_fa4.mods import registry

            mods = registry.lookup(cfg.mod_key)
            self.score_graph, self.mask_graph = mods.score_graph, mods.mask_graph
            self.num_score_aux = mods.num_score_aux
        assert len(cfg.aux_specs) <= MAX_AUX
        assert not cfg.block_sparse or self.mask_graph is not None, "a block mask needs its mask_mod"
        self.cols = cfg.tmem_columns()
        self.s_stages = cfg.s_stages
        assert self.s_stages in (1, 2) and (self.s_stages == 1 or self.q_tiles == 1), "2 S buffers: 1 Q tile"
        assert self.cols["used"] <= TMEM_COLUMNS, "S0, S1, O0, O1 do not fit in tensor memory"
        assert self.hdimv % _CHUNK == 0
        # MMA tiles: M = 128 rows per CTA, 256 for a pair sharing each MMA (cfg.two_cta)
        self.pair = cfg.cta_group
        assert not (cfg.two_cta and cfg.block_sparse), "a pair walks one key list for 256 rows"
        self.qk_tiler = (self.pair * Q_TILE_ROWS, self.tile_n, self.hdim)
        self.pv_tiler = (self.pair * Q_TILE_ROWS, self.hdimv, self.tile_n)

    # ------------------------------------------------------------------ host side
    def _tiled_mmas(self):
        cta = tcgen05.CtaGroup.TWO if const_expr(self.pair == 2) else tcgen05.CtaGroup.ONE
        qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, cta,
            self.qk_tiler[:2])
        # P comes from TMEM (always K-major there); V^T is read MN-major from V's (keys, D) tiles
        pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32, cta,
            self.pv_tiler[:2], tcgen05.OperandSource.TMEM)
        return qk, pv

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
        tail_pairs: Int32,  # the last this many (batch, head) pairs as one group (0: none)
        max_ctas: Int32,  # persistent grids only (the sm90 kernel); this one is one-shot
        # block mask (block_sparse only, else None): kv_num_blocks, kv_indices, full_kv_num_blocks,
        # full_kv_indices, int32, FlexAttention layout
        mBmNum: Optional[cute.Tensor], mBmIdx: Optional[cute.Tensor],
        mBmFullNum: Optional[cute.Tensor], mBmFullIdx: Optional[cute.Tensor],
        # captured tensors of the mods, ModSet order, None past the last (as the sm90 kernel's)
        aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        aux = (aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7)[: len(cfg.aux_specs)]
        score_aux, mask_aux = aux[: self.num_score_aux], aux[self.num_score_aux:]
        block_mask = (mBmNum, mBmIdx, mBmFullNum, mBmFullIdx) if const_expr(cfg.block_sparse) else None
        # sequence-major views as sm90's: (S, D, H, B), LSE (S, H, B); V as V^T (D, S, H, B), the
        # B operand of O += P V
        mQ, mO, mLSE = (_sequence_major(t, cfg.varlen_q) for t in (mQ, mO, mLSE))
        mK, mV = (_sequence_major(t, cfg.varlen_k) for t in (mK, mV))
        mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[1, 0, 2, 3]))

        qk_mma, pv_mma = self._tiled_mmas()
        sQ_layout = sm100_utils.make_smem_layout_a(qk_mma, self.qk_tiler, self.dtype, self.q_tiles)
        sK_layout = sm100_utils.make_smem_layout_b(qk_mma, self.qk_tiler, self.dtype, cfg.kv_stages)
        sV_layout = sm100_utils.make_smem_layout_b(pv_mma, self.pv_tiler, self.dtype, cfg.kv_stages)
        tP_layout = sm100_utils.make_smem_layout_a(pv_mma, self.pv_tiler, self.dtype, 1)

        cluster_vmnk = self._cluster_layout(qk_mma).shape
        # a pair's loads are 2-SM TMA: each CTA fills its own shared memory and signals the
        # leader CTA's barrier, which expects both halves' bytes
        load_op = cpasync.CopyBulkTensorTileG2SOp(
            tcgen05.CtaGroup.TWO if const_expr(self.pair == 2) else tcgen05.CtaGroup.ONE)
        sQ1, sK1, sV1 = (cute.select(layout, mode=[0, 1, 2]) for layout in (sQ_layout, sK_layout, sV_layout))
        tma_Q, tQ = cute.nvgpu.make_tiled_tma_atom_A(load_op, mQ, sQ1, self.qk_tiler, qk_mma, cluster_vmnk)
        tma_K, tK = cute.nvgpu.make_tiled_tma_atom_B(load_op, mK, sK1, self.qk_tiler, qk_mma, cluster_vmnk)
        tma_V, tV = cute.nvgpu.make_tiled_tma_atom_B(load_op, mV, sV1, self.pv_tiler, pv_mma, cluster_vmnk)
        bytes_q = cute.size_in_bytes(self.dtype, sQ1) * self.pair
        bytes_kv = cute.size_in_bytes(self.dtype, sK1) * self.pair
        # V tiles are read through K's ring: a V stage must not be larger than a K stage
        assert cute.cosize(sV_layout) <= cute.cosize(sK_layout)

        @cute.struct
        class Storage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_tiles]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * cfg.kv_stages]
            mbar_s0: cute.struct.MemRange[cutlass.Int64, 2 * cfg.s_stages]
            mbar_s1: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_o0: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_o1: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_c0: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_c1: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_base: Int32
            # softmax -> correction messages, per query tile and row: (factor, lse)
            msg: cute.struct.MemRange[Float32, 2 * Q_TILE_ROWS * self.q_tiles]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]

        # every barrier, message and tile: within sm_100's opt-in 227 KB (fwd_config.SMEM_LIMIT
        # budgets the tiles against this)
        assert Storage.size_in_bytes() <= SMEM_BYTES, f"{Storage.size_in_bytes()} bytes of shared memory"
        num_m_blocks = (max_seqlen_q + cfg.cta_tile_m - 1) // cfg.cta_tile_m
        grid = TileScheduler.grid(num_m_blocks, cute.size(mQ.shape[2]), num_batch)
        # a pair's two CTAs are adjacent blocks of one cluster and share its work item
        grid = (grid[0] * self.pair, 1, 1)
        self.kernel(
            tQ, tK, tV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSequsedK, tma_Q, tma_K, tma_V,
            score_scale, softmax_scale_log2, window_left, window_right,
            sQ_layout, sK_layout, sV_layout, tP_layout, qk_mma, pv_mma,
            num_m_blocks, num_batch, heads_per_group, tail_pairs, bytes_q, bytes_kv, Storage,
            block_mask, score_aux, mask_aux,
        ).launch(
            grid=grid,
            block=[_NUM_THREADS, 1, 1],
            cluster=[2, 1, 1] if const_expr(self.pair == 2) else None,
            stream=stream,
            min_blocks_per_mp=1,
        )

    def _cluster_layout(self, qk_mma):
        """The cluster as (V, M, N, K): V = the CTAs sharing one MMA (1 or 2), nothing else."""
        return cute.tiled_divide(cute.make_layout((self.pair, 1, 1)), (qk_mma.thr_id.shape,))

    def _m_tile(self, m_block, t, cta_v):
        """The 128-row query tile that query tile t of this CTA holds: with a pair, the 256-row MMA
        tile q_tiles * m_block + t has CTA 0's rows first."""
        return (self.q_tiles * m_block + t) * self.pair + cta_v

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSequsedK: Optional[cute.Tensor],
        tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom, tma_V: cute.CopyAtom,
        score_scale: Float32, softmax_scale_log2: Float32, window_left: Int32, window_right: Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
        qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
        num_m_blocks: Int32, num_batch: Int32, heads_per_group: Int32, tail_pairs: Int32,
        bytes_q: cutlass.Constexpr[int], bytes_kv: cutlass.Constexpr[int], Storage: cutlass.Constexpr,
        block_mask, score_aux, mask_aux,
    ):
        cfg = self.cfg
        self._score_aux, self._mask_aux = score_aux, mask_aux  # (read by the softmax's mods)
        bidx, _, _ = cute.arch.block_idx()
        sched = TileScheduler(num_m_blocks, cute.size(mQ.shape[2]), num_batch, heads_per_group, tail_pairs,
                              cfg.causal)
        cta_v = Int32(0)  # this CTA's place in its pair (0: the leader, which issues the MMAs)
        if const_expr(self.pair == 2):
            cta_v = bidx % 2
        m_block, head, batch = sched.work(bidx // self.pair)
        # varlen grids are sized for the longest sequence; the whole CTA leaves before any barrier
        # (the query side's lengths only: the key side's loads stay inside the branch)
        if m_block * cfg.cta_tile_m < SeqlenInfo(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ).seqlen_q:
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tidx, _, _ = cute.arch.thread_idx()
            seqlen = SeqlenInfo(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSequsedK)
            batch_q = batch if const_expr(not cfg.varlen_q) else 0
            batch_k = batch if const_expr(not cfg.varlen_k) else 0
            head_kv = head // (cute.size(mQ.shape[2]) // cute.size(mK.shape[2]))
            # key tiles are chosen for the whole CTA (both query tiles); masks per 128-row tile
            limits = (self.tile_n, cfg.causal, cfg.has_window, window_left, window_right)
            cta_range = BlockRange(cfg.cta_tile_m, *limits)
            tile_range = BlockRange(Q_TILE_ROWS, *limits)
            if const_expr(cfg.block_sparse):
                # the CTA's rows lie in one block-mask row (bm_tiles_m CTA tiles per block)
                walk = SparseKvWalk(*block_mask, batch, head, m_block, cfg.bm_tiles_m, cfg.bm_tiles_n)
            else:
                walk = DenseKvWalk(*cta_range.n_block_range(m_block, seqlen.seqlen_q, seqlen.seqlen_k))
            n_count = cutlass.max(walk.count, 0)

            if warp_idx == _LOAD_WARP:
                for atom in (tma_Q, tma_K, tma_V):
                    cpasync.prefetch_descriptor(atom)

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(Storage)
            one = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
            wg = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128)
            # the MMA thread (the leader CTA's) waits for a warpgroup of each CTA of a pair
            wg_pair = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.pair)
            # with a pair the MMA-side pipelines span the cluster: commits multicast to both CTAs'
            # barriers, releases arrive on the leader's (cutlass.pipeline's cta_layout_vmnk)
            cluster = dict(cta_layout_vmnk=self._cluster_layout(qk_mma)) if const_expr(self.pair == 2) else {}
            pipe_q = pipeline.PipelineTmaUmma.create(
                num_stages=self.q_tiles, producer_group=one, consumer_group=one, tx_count=bytes_q,
                barrier_storage=storage.mbar_q.data_ptr(), defer_sync=True, **cluster)
            pipe_kv = pipeline.PipelineTmaUmma.create(
                num_stages=cfg.kv_stages, producer_group=one, consumer_group=one, tx_count=bytes_kv,
                barrier_storage=storage.mbar_kv.data_ptr(), defer_sync=True, **cluster)

            def per_tile(kind, bars, producer, consumer, stages=1, **kw):  # one pipeline per query tile
                return [kind.create(num_stages=stages, producer_group=producer, consumer_group=consumer,
                                    barrier_storage=b.data_ptr(), defer_sync=True, **kw) for b in bars]

            tiles = slice(0, self.q_tiles)
            umma_async = pipeline.PipelineUmmaAsync
            pipe_s = per_tile(umma_async, (storage.mbar_s0, storage.mbar_s1)[tiles], one, wg_pair,
                              self.s_stages, **cluster)
            pipe_o = per_tile(umma_async, (storage.mbar_o0, storage.mbar_o1)[tiles], one, wg_pair, **cluster)
            pipe_c = per_tile(pipeline.PipelineAsync, (storage.mbar_c0, storage.mbar_c1)[tiles], wg, wg)

            if const_expr(self.pair == 2):
                tmem = setup_pair_tmem(storage.tmem_base, warp_idx == _MMA_WARP)
            else:
                tmem = setup_tmem(storage.tmem_base, warp_idx == _MMA_WARP)
            # thread 0 of the MMA: the tensor-memory views and the score coordinates (a pair's CTAs
            # hold the same 128 x N accumulator shapes); this CTA's slice for its loads
            thr_qk = qk_mma.get_slice(0)
            thr_pv = pv_mma.get_slice(0)
            load_qk, load_pv = thr_qk, thr_pv
            if const_expr(self.pair == 2):
                load_qk, load_pv = qk_mma.get_slice(cta_v), pv_mma.get_slice(cta_v)
            s_layout = thr_qk.make_fragment_C(thr_qk.partition_shape_C(self.qk_tiler[:2])).layout
            o_layout = thr_pv.make_fragment_C(thr_pv.partition_shape_C(self.pv_tiler[:2])).layout
            tS = [cute.make_tensor(tmem + c, s_layout) for c in self.cols["s"]]
            tO = [cute.make_tensor(tmem + c, o_layout) for c in self.cols["o"]]

            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
            # V tiles live in the same ring as K tiles, viewed through V's (MN-major) layout
            sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
            # (row, field, q tile)
            msg = storage.msg.get_tensor(cute.make_layout((Q_TILE_ROWS, 2, self.q_tiles)))
            softmax_args = (thr_qk, msg, tile_range, score_scale, softmax_scale_log2, seqlen, m_block, cta_v,
                            walk, n_count, batch, head, tidx % 128)

            regs_softmax, regs_correction, regs_other = cfg.registers
            if warp_idx < _SOFTMAX_WARPS[1]:
                cute.arch.setmaxregister_increase(regs_softmax if const_expr(self.q_tiles == 2)
                                                  else _REGS_SOFTMAX_ALONE)
                self.softmax_role(0, tS[0], pipe_s[0], pipe_c[0], *softmax_args)
            elif warp_idx < _CORRECTION_WARP0:
                if const_expr(self.q_tiles == 2):
                    cute.arch.setmaxregister_increase(regs_softmax)
                    self.softmax_role(1, tS[1], pipe_s[1], pipe_c[1], *softmax_args)
                else:  # no second query tile: this warpgroup idles
                    cute.arch.setmaxregister_decrease(_REGS_IDLE)
            elif warp_idx < _MMA_WARP:
                cute.arch.setmaxregister_decrease(regs_correction)
                self.correction_role(tO, thr_pv, pipe_o, pipe_c, msg, mO, mLSE, seqlen, m_block, cta_v, head,
                                     batch_q, n_count, tidx % 128)
            else:
                cute.arch.setmaxregister_decrease(regs_other)
                if warp_idx == _MMA_WARP:
                    if cta_v == 0:  # (a pair's MMAs are the leader's)
                        self.mma_role(qk_mma, pv_mma, thr_qk, thr_pv, sQ, sK, sV, tmem, tP_layout, tS, tO,
                                      pipe_q, pipe_kv, pipe_s, pipe_o, n_count)
                elif warp_idx == _LOAD_WARP:
                    self.load_role(mQ, mK, mV, sQ, sK, sV, tma_Q, tma_K, tma_V, load_qk, load_pv, pipe_q,
                                   pipe_kv, seqlen, m_block, head, head_kv, batch_q, batch_k, walk, n_count)

            # every TMEM reader/writer is done: give the columns back
            if const_expr(self.pair == 2):
                release_pair_tmem(tmem, warp_idx == _MMA_WARP)
            else:
                cute.arch.sync_threads()
                if warp_idx == _MMA_WARP:
                    cute.arch.dealloc_tmem(tmem, TMEM_COLUMNS)

    # ------------------------------------------------------------------ load warp
    @cute.jit
    def load_role(self, mQ, mK, mV, sQ, sK, sV, tma_Q, tma_K, tma_V, thr_qk, thr_pv, pipe_q, pipe_kv,
                  seqlen: SeqlenInfo, m_block, head, head_kv, batch_q, batch_k, walk, n_count):
        mQ_cur = seqlen.q_rows(mQ[None, None, head, batch_q])
        mK_cur = seqlen.k_rows(mK[None, None, head_kv, batch_k])
        mV_cur = mV[None, None, head_kv, batch_k]
        if const_expr(self.cfg.varlen_k):  # V is (D, keys): the sequence offset is on mode 1
            mV_cur = cute.domain_offset((0, seqlen.offset_k), mV_cur)
        # MMA tiles (a pair's: 256 rows, and thr_qk / thr_pv this CTA's slice, so each CTA loads its
        # 128 query rows, half of each K tile's keys and half of each V tile's columns)
        gQ = thr_qk.partition_A(cute.local_tile(mQ_cur, self.qk_tiler[::2], (None, 0)))
        gK = thr_qk.partition_B(cute.local_tile(mK_cur, (self.tile_n, self.hdim), (None, 0)))
        gV = thr_pv.partition_B(cute.local_tile(mV_cur, (self.hdimv, self.tile_n), (0, None)))
        tQs, tQg = cpasync.tma_partition(tma_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                                         cute.group_modes(gQ, 0, 3))
        tKs, tKg = cpasync.tma_partition(tma_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                                         cute.group_modes(gK, 0, 3))
        tVs, tVg = cpasync.tma_partition(tma_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
                                         cute.group_modes(gV, 0, 3))

        if n_count > 0:
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_tiles)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.kv_stages)
            # order of need: Q0, K of the walk's first tile, Q1, its V, then the walk's K, V pairs
            n_first = walk.n_block(0)
            q_state = self._load(tma_Q, tQg, self.q_tiles * m_block, tQs, pipe_q, q_state)
            kv_state = self._load(tma_K, tKg, n_first, tKs, pipe_kv, kv_state)
            if const_expr(self.q_tiles == 2):
                q_state = self._load(tma_Q, tQg, 2 * m_block + 1, tQs, pipe_q, q_state)
            kv_state = self._load(tma_V, tVg, n_first, tVs, pipe_kv, kv_state)
            for i in cutlass.range(1, n_count, unroll=1):
                n_block = walk.n_block(i)
                kv_state = self._load(tma_K, tKg, n_block, tKs, pipe_kv, kv_state)
                kv_state = self._load(tma_V, tVg, n_block, tVs, pipe_kv, kv_state)
            # wait until the MMA warp has released every slot: its releases are tcgen05.commit
            # arrivals, which must not land after the CTA has exited
            pipe_kv.producer_tail(kv_state)

    @staticmethod
    def _load(tma, src, tile, dst, pipe, state):
        """TMA: tile `tile` of src -> the ring slot `state` of dst; returns the next slot."""
        pipe.producer_acquire(state)
        cute.copy(tma, src[None, tile], dst[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))
        state.advance()
        return state

    # ------------------------------------------------------------------ MMA warp
    @cute.jit
    def mma_role(self, qk_mma, pv_mma, thr_qk, thr_pv, sQ, sK, sV, tmem, tP_layout, tS, tO,
                 pipe_q, pipe_kv, pipe_s, pipe_o, n_count):
        tSrQ = thr_qk.make_fragment_A(sQ)
        tSrK = thr_qk.make_fragment_B(sK)
        tOrV = thr_pv.make_fragment_B(sV)
        # P_t: the 16-bit A operand in TMEM over the first half of S_t's columns (the fragment
        # counts 16-bit elements, two per 32-bit column). Its addresses are relative to column 0:
        # right because the kernel allocates all 512 columns, whose base is always lane 0, column 0
        # (the PTX shows P at columns 0.. and 128..)
        tOrP = thr_pv.make_fragment_A(cute.make_tensor(tmem, tP_layout.outer))[None, None, None, 0]
        p_per_col = Float32.width // self.dtype.width
        tOrP = [cute.make_tensor(tOrP.iterator + p_per_col * c, tOrP.layout) for c in self.cols["s"]]
        if const_expr(self.s_stages == 2):
            self._mma_s_ring(qk_mma, pv_mma, tSrQ, tSrK, tOrV, tOrP[0], tS[0], tO[0], pipe_q, pipe_kv,
                             pipe_s[0], pipe_o[0], n_count)
        # pipeline states are plain locals advanced in the loop body: the DSL carries them
        # through its loops only that way
        elif n_count > 0:
            Consumer, Producer = pipeline.PipelineUserType.Consumer, pipeline.PipelineUserType.Producer
            q_state = pipeline.make_pipeline_state(Consumer, self.q_tiles)
            kv_state = pipeline.make_pipeline_state(Consumer, self.cfg.kv_stages)
            s0_state, s1_state, o0_state, o1_state = (
                pipeline.make_pipeline_state(Producer, 1) for _ in range(4))

            # first key tile: S0 = Q0 K^T, S1 = Q1 K^T, then O0 = P0 V
            pipe_q.consumer_wait(q_state)
            q_state.advance()
            k_state = kv_state.clone()
            pipe_kv.consumer_wait(k_state)
            kv_state.advance()
            tSrK0 = tSrK[None, None, None, k_state.index]
            self._qk(qk_mma, 0, tS, tSrQ, tSrK0, pipe_s, s0_state, True)
            s0_state.advance()
            if const_expr(self.q_tiles == 2):
                pipe_q.consumer_wait(q_state)
                self._qk(qk_mma, 1, tS, tSrQ, tSrK0, pipe_s, s1_state, True)
                s1_state.advance()
            pipe_kv.consumer_release(k_state)
            v_state = kv_state.clone()
            pipe_kv.consumer_wait(v_state)
            kv_state.advance()
            self._pv(pv_mma, 0, tO, tOrP, tOrV, v_state, False, pipe_s, s0_state, pipe_o, o0_state)
            o0_state.advance()
            if const_expr(self.q_tiles == 1):
                pipe_kv.consumer_release(v_state)

            for i in cutlass.range(1, n_count, unroll=1):
                k_state = kv_state.clone()
                pipe_kv.consumer_wait(k_state)
                kv_state.advance()
                tSrKi = tSrK[None, None, None, k_state.index]
                # S0 = Q0 K_i^T (S0 came back with P0 before the last O0 += P0 V)
                self._qk(qk_mma, 0, tS, tSrQ, tSrKi, pipe_s, s0_state, False)
                s0_state.advance()
                if const_expr(self.q_tiles == 2):
                    # O1 += P1 V_{i-1}; the first P1 V starts O1 afresh
                    self._pv(pv_mma, 1, tO, tOrP, tOrV, v_state, i > 1, pipe_s, s1_state, pipe_o, o1_state)
                    o1_state.advance()
                    pipe_kv.consumer_release(v_state)
                    # S1 = Q1 K_i^T
                    self._qk(qk_mma, 1, tS, tSrQ, tSrKi, pipe_s, s1_state, False)
                    s1_state.advance()
                pipe_kv.consumer_release(k_state)
                # O0 += P0 V_i
                v_state = kv_state.clone()
                pipe_kv.consumer_wait(v_state)
                kv_state.advance()
                self._pv(pv_mma, 0, tO, tOrP, tOrV, v_state, True, pipe_s, s0_state, pipe_o, o0_state)
                o0_state.advance()
                if const_expr(self.q_tiles == 1):
                    pipe_kv.consumer_release(v_state)

            if const_expr(self.q_tiles == 2):
                self._pv(pv_mma, 1, tO, tOrP, tOrV, v_state, n_count > 1, pipe_s, s1_state, pipe_o, o1_state)
                pipe_kv.consumer_release(v_state)

    @cute.jit
    def _mma_s_ring(self, qk_mma, pv_mma, tSrQ, tSrK, tOrV, tOrP, tS, tO, pipe_q, pipe_kv, pipe_s, pipe_o,
                    n_count):
        """One query tile, two S buffers: per key tile i, S_i = Q K_i^T into buffer i % 2, then
        O += P_{i-1} V_{i-1}, so the tensor core computes S_i while the softmax works on S_{i-1}.

        The s pipeline's "empty" arrival is the softmax's "P ready" (as with one buffer): the MMA
        acquires both buffers once up front, then each O += P V acquires its P's buffer, which is
        also the acquisition of the S two key tiles later (issued after that O += P V, and tcgen05
        MMAs from one thread run in order, so P is read before S overwrites it)."""
        if n_count > 0:
            Consumer, Producer = pipeline.PipelineUserType.Consumer, pipeline.PipelineUserType.Producer
            q_state = pipeline.make_pipeline_state(Consumer, 1)
            kv_state = pipeline.make_pipeline_state(Consumer, self.cfg.kv_stages)
            s_filled = pipeline.make_pipeline_state(Producer, 2)  # the buffer the next S goes to
            p_taken = pipeline.make_pipeline_state(Producer, 2)  # the buffer the next O += P V reads
            o_state = pipeline.make_pipeline_state(Producer, 1)
            pipe_s.producer_acquire(p_taken)
            p_taken.advance()
            pipe_s.producer_acquire(p_taken)
            p_taken.advance()
            pipe_q.consumer_wait(q_state)
            _tcgen05_fence_after_sync()
            tSrQ0 = tSrQ[None, None, None, 0]
            k_state = kv_state.clone()
            pipe_kv.consumer_wait(k_state)
            kv_state.advance()
            _umma(qk_mma, cute.make_tensor(tS.iterator + s_filled.index * self.tile_n, tS.layout), tSrQ0,
                  tSrK[None, None, None, k_state.index], False)
            pipe_s.producer_commit(s_filled)
            s_filled.advance()
            pipe_kv.consumer_release(k_state)
            v_state = kv_state.clone()
            pipe_kv.consumer_wait(v_state)
            kv_state.advance()
            for i in cutlass.range(1, n_count, unroll=1):
                k_state = kv_state.clone()
                pipe_kv.consumer_wait(k_state)
                kv_state.advance()
                _umma(qk_mma, cute.make_tensor(tS.iterator + s_filled.index * self.tile_n, tS.layout), tSrQ0,
                      tSrK[None, None, None, k_state.index], False)
                pipe_s.producer_commit(s_filled)
                s_filled.advance()
                pipe_kv.consumer_release(k_state)
                self._pv_ring(pv_mma, tO, tOrP, tOrV, v_state, i > 1, pipe_s, p_taken, pipe_o, o_state)
                o_state.advance()
                p_taken.advance()
                pipe_kv.consumer_release(v_state)
                v_state = kv_state.clone()
                pipe_kv.consumer_wait(v_state)
                kv_state.advance()
            self._pv_ring(pv_mma, tO, tOrP, tOrV, v_state, n_count > 1, pipe_s, p_taken, pipe_o, o_state)
            pipe_kv.consumer_release(v_state)

    @cute.jit
    def _pv_ring(self, pv_mma, tO, tOrP, tOrV, v_state, accumulate, pipe_s, p_state, pipe_o, o_state):
        """O += P V from the S buffer p_state names, once the correction has rescaled O and the
        softmax has written that P."""
        pipe_o.producer_acquire(o_state)
        pipe_s.producer_acquire(p_state)
        _tcgen05_fence_after_sync()
        p_per_col = Float32.width // self.dtype.width
        tOrPi = cute.make_tensor(tOrP.iterator + p_state.index * (self.tile_n * p_per_col), tOrP.layout)
        _umma(pv_mma, tO, tOrPi, tOrV[None, None, None, v_state.index], accumulate)
        pipe_o.producer_commit(o_state)

    @cute.jit
    def _qk(self, qk_mma, t: cutlass.Constexpr[int], tS, tSrQ, tSrKi, pipe_s, s_state,
            acquire: cutlass.Constexpr[bool]):
        """S_t = Q_t K^T, then signal softmax t. The first S_t acquires the buffer here; later ones
        were acquired with P_t before the previous O_t += P_t V."""
        tSrQt = tSrQ[None, None, None, t]
        if const_expr(acquire):
            pipe_s[t].producer_acquire(s_state)
            _tcgen05_fence_after_sync()
        _umma(qk_mma, tS[t], tSrQt, tSrKi, False)
        pipe_s[t].producer_commit(s_state)

    @cute.jit
    def _pv(self, pv_mma, t: cutlass.Constexpr[int], tO, tOrP, tOrV, v_state, accumulate, pipe_s, s_state,
            pipe_o, o_state):
        """O_t += P_t V once the correction has rescaled O_t and softmax t has written P_t; signals O_t."""
        tOrVi = tOrV[None, None, None, v_state.index]
        pipe_o[t].producer_acquire(o_state)
        pipe_s[t].producer_acquire(s_state)
        _tcgen05_fence_after_sync()
        _umma(pv_mma, tO[t], tOrP[t], tOrVi, accumulate)
        pipe_o[t].producer_commit(o_state)

    # ------------------------------------------------------------------ softmax warpgroups
    @cute.jit
    def softmax_role(self, t: cutlass.Constexpr[int], tS_t, pipe_s, pipe_c, thr_qk, msg,
                     tile_range: BlockRange, score_scale, softmax_scale_log2, seqlen: SeqlenInfo,
                     m_block, cta_v, walk, n_count, batch, head, tid):
        cfg = self.cfg
        mods = None
        if const_expr(self.score_graph is not None or self.mask_graph is not None):
            # raw score * natural_scale is the score in natural units: scale, or softcap after tanh
            mods = TileMods(self.score_graph, self.mask_graph, self._score_aux, self._mask_aux, batch, head,
                            seqlen.seqlen_q, seqlen.seqlen_k, softmax_scale_log2 * Float32(LN_2))
        load_s = _tmem_copy(Ld32x32bOp, Repetition.x32, tS_t)
        thr_load = load_s.get_slice(tid)
        tSt = thr_load.partition_S(tS_t)
        # (thread 0's slice: rows 0-127 of the MMA tile, as this CTA's lanes)
        tSc = thr_load.partition_D(thr_qk.partition_C(cute.make_identity_tensor(self.qk_tiler[:2])))
        # P: 16-bit values packed two per 32-bit column over the first tile_n/2 columns of S_t,
        # written in chunks of _P_CHUNK columns so only one chunk of P is live in registers
        p_chunk = cute.composition(tS_t.layout, cute.make_layout((Q_TILE_ROWS, _P_CHUNK)))
        store_p = _tmem_copy(St32x32bOp, Repetition.x16, cute.make_tensor(tS_t.iterator, p_chunk))
        thr_store = store_p.get_slice(tid)
        tPt = thr_store.partition_D(cute.make_tensor(tS_t.iterator, p_chunk))
        p_regs = thr_store.partition_S(cute.make_identity_tensor((Q_TILE_ROWS, _P_CHUNK))).shape
        s_per_chunk = 2 * _P_CHUNK  # scores per P chunk (two 16-bit values per column)
        chunk_scores = cute.make_layout(s_per_chunk)

        m_tile = self._m_tile(m_block, t, cta_v)
        if const_expr(self.score_graph is not None):
            softmax_scale_log2 = Float32(LOG2_E)  # score_mod's output is in natural units
        softmax = self._softmax_kind(softmax_scale_log2, 1, cfg.rescale_threshold, cfg.exp2_emulate_every,
                                     row_lanes=1)
        row_scale = cute.make_rmem_tensor(1, Float32)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.s_stages)
        c_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for i in cutlass.range(n_count, unroll=1):
            n_block = walk.n_block(i)
            pipe_s.consumer_wait(s_state)
            _tcgen05_fence_after_sync()
            tSt_i, tPt_i = tSt, tPt
            if const_expr(self.s_stages == 2):  # this key tile's buffer of the two
                tSt_i = cute.make_tensor(tSt.iterator + s_state.index * self.tile_n, tSt.layout)
                tPt_i = cute.make_tensor(tPt.iterator + s_state.index * self.tile_n, tPt.layout)
            rS = cute.make_rmem_tensor(tSc.shape, Float32)
            cute.copy(load_s, tSt_i, rS)
            cute.arch.fence_view_async_tmem_load()
            # raw q.k -> softmax units (softcap, score_mod) and masks (causal / window / length,
            # then mask_mod), as sm90's FwdConsumer._scores on one row
            if const_expr(cfg.softcap):
                for j in cutlass.range_constexpr(cute.size(rS)):
                    rS[j] = cute.math.tanh(rS[j] * score_scale, fastmath=True)
            row0, col0 = m_tile * Q_TILE_ROWS, n_block * self.tile_n
            if const_expr(self.score_graph is not None):
                for s_c, c_c in zip(row_chunks(rS, _MOD_CHUNK), row_chunks(tSc, _MOD_CHUNK)):
                    mods.score_mod(s_c, c_c, row0, col0)
            if tile_range.needs_mask(n_block, m_tile, seqlen.seqlen_q, seqlen.seqlen_k):
                apply_mask(as_wgmma_row(rS), as_wgmma_row(tSc), tile_range, m_tile, n_block,
                           seqlen.seqlen_q, seqlen.seqlen_k)
            if const_expr(self.mask_graph is not None):
                if self._is_partial(walk, i):  # (a full tile of a block mask: mask_mod is true there)
                    for s_c, c_c in zip(row_chunks(rS, _MOD_CHUNK), row_chunks(tSc, _MOD_CHUNK)):
                        mods.mask_mod(s_c, c_c, row0, col0)
            softmax.step(as_wgmma_row(rS), row_scale)
            # rS holds the row in column order (flat index = column)
            for c in cutlass.range_constexpr(self.tile_n // s_per_chunk):
                rP = cute.make_rmem_tensor(p_regs, Float32)
                rP16 = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=self.dtype), chunk_scores)
                p_vals = cute.make_tensor(rS.iterator + c * s_per_chunk, chunk_scores)
                rP16.store(p_vals.load().to(self.dtype))
                cute.copy(store_p, rP, cute.make_tensor(tPt_i.iterator + c * _P_CHUNK, tPt_i.layout))
            cute.arch.fence_view_async_tmem_store()
            _tcgen05_fence_before_sync()
            pipe_s.consumer_release(s_state)  # P_t is in TMEM; S_t's columns are free again
            s_state.advance()
            if i > 0:  # the first tile starts O afresh: nothing to rescale
                pipe_c.producer_acquire(c_state)
                msg[tid, 0, t] = row_scale[0]
                pipe_c.producer_commit(c_state)
                c_state.advance()

        lse = cute.make_rmem_tensor(1, Float32)
        softmax.finalize(row_scale, lse)
        pipe_c.producer_acquire(c_state)
        msg[tid, 0, t] = row_scale[0]
        msg[tid, 1, t] = lse[0]
        pipe_c.producer_commit(c_state)

    def _is_partial(self, walk, i):
        return walk.is_partial(i) if const_expr(self.cfg.block_sparse) else True

    # ------------------------------------------------------------------ correction warpgroup
    @cute.jit
    def correction_role(self, tO, thr_pv, pipe_o, pipe_c, msg, mO, mLSE, seqlen: SeqlenInfo,
                        m_block, cta_v, head, batch_q, n_count, tid):
        # one O chunk of _CHUNK columns; the others are the same view shifted along columns
        chunk = cute.composition(tO[0].layout, cute.make_layout((Q_TILE_ROWS, _CHUNK)))
        chunks = [cute.make_tensor(o.iterator, chunk) for o in tO]
        copy_ld = _tmem_copy(Ld32x32bOp, Repetition.x32, chunks[0])
        copy_st = _tmem_copy(St32x32bOp, Repetition.x32, chunks[0])
        thr_ld = copy_ld.get_slice(tid)
        thr_st = copy_st.get_slice(tid)
        tOt = [thr_ld.partition_S(c) for c in chunks]
        tOt_st = [thr_st.partition_D(c) for c in chunks]
        # the registers of one chunk: this thread's row, _CHUNK columns
        chunk_regs = thr_ld.partition_D(cute.make_identity_tensor((Q_TILE_ROWS, _CHUNK))).shape

        Consumer = pipeline.PipelineUserType.Consumer
        o0_state, o1_state, c0_state, c1_state = (pipeline.make_pipeline_state(Consumer, 1) for _ in range(4))
        for i in cutlass.range(1, n_count, unroll=1):
            self._rescale(0, tOt, tOt_st, chunk_regs, copy_ld, copy_st, pipe_o, o0_state, pipe_c, c0_state,
                          msg, tid)
            o0_state.advance()
            c0_state.advance()
            if const_expr(self.q_tiles == 2):
                self._rescale(1, tOt, tOt_st, chunk_regs, copy_ld, copy_st, pipe_o, o1_state, pipe_c,
                              c1_state, msg, tid)
                o1_state.advance()
                c1_state.advance()

        for t, o_state, c_state in ((0, o0_state, c0_state), (1, o1_state, c1_state))[: self.q_tiles]:
            if n_count > 0:
                pipe_o[t].consumer_wait(o_state)  # the last O_t += P_t V is done
            pipe_c[t].consumer_wait(c_state)
            self.epilogue(t, tOt[t], chunk_regs, copy_ld, thr_ld, msg[tid, 0, t], msg[tid, 1, t], mO, mLSE,
                          seqlen, m_block, cta_v, head, batch_q, n_count, tid)

    @cute.jit
    def _rescale(self, t: cutlass.Constexpr[int], tOt, tOt_st, chunk_regs: cutlass.Constexpr, copy_ld,
                 copy_st, pipe_o, o_state, pipe_c, c_state, msg, tid):
        """Bring O_t (key tiles before this one) to the softmax's new reference, then hand it back."""
        tOt, tOt_st, pipe_o, pipe_c = tOt[t], tOt_st[t], pipe_o[t], pipe_c[t]
        pipe_o.consumer_wait(o_state)
        pipe_c.consumer_wait(c_state)
        scale = msg[tid, 0, t]
        pipe_c.consumer_release(c_state)
        # conditional rescale: most tiles leave every row's reference alone, and a warp whose 32
        # rows all kept theirs skips the TMEM round trip
        if cute.arch.vote_any_sync(scale != Float32(1.0)):
            _tcgen05_fence_after_sync()
            for j in cutlass.range_constexpr(self.hdimv // _CHUNK):
                r = cute.make_rmem_tensor(chunk_regs, Float32)
                cute.copy(copy_ld, cute.make_tensor(tOt.iterator + j * _CHUNK, tOt.layout), r)
                cute.arch.fence_view_async_tmem_load()  # registers valid only after wait::ld
                self._scale(r, scale)
                cute.copy(copy_st, r, cute.make_tensor(tOt_st.iterator + j * _CHUNK, tOt_st.layout))
            cute.arch.fence_view_async_tmem_store()
            _tcgen05_fence_before_sync()
        pipe_o.consumer_release(o_state)

    @cute.jit
    def _scale(self, r: cute.Tensor, factor: Float32):
        """An O chunk in registers times a row factor."""
        if const_expr(self.cfg.packed_f32x2):
            scale_pairs(r, factor)
        else:
            for k in cutlass.range_constexpr(cute.size(r)):
                r[k] = r[k] * factor

    @cute.jit
    def epilogue(self, t: cutlass.Constexpr[int], tOt, chunk_regs: cutlass.Constexpr, copy_ld, thr_ld,
                 inv_sum, lse, mO, mLSE, seqlen: SeqlenInfo, m_block, cta_v, head, batch_q, n_count, tid):
        """Row tid of query tile t: O / rowsum to global memory (a row past the end writes nothing)."""
        m_tile = self._m_tile(m_block, t, cta_v)
        row = m_tile * Q_TILE_ROWS + tid
        in_bounds = row < seqlen.seqlen_q
        mLSE_cur = seqlen.q_rows(mLSE[None, head, batch_q])
        if in_bounds:
            mLSE_cur[row] = lse
        mO_cur = seqlen.q_rows(mO[None, None, head, batch_q])
        gO = cute.local_tile(mO_cur, (Q_TILE_ROWS, self.hdimv), (m_tile, 0))
        if n_count > 0:
            _tcgen05_fence_after_sync()
        for j in cutlass.range_constexpr(self.hdimv // _CHUNK):
            r = cute.make_rmem_tensor(chunk_regs, Float32)
            if n_count > 0:
                cute.copy(copy_ld, cute.make_tensor(tOt.iterator + j * _CHUNK, tOt.layout), r)
                cute.arch.fence_view_async_tmem_load()
            else:
                r.fill(0.0)  # no key visible to the whole CTA: out = 0
            self._scale(r, inv_sum)
            r16 = cute.make_rmem_tensor(r.layout, self.dtype)
            r16.store(r.load().to(self.dtype))
            tOg = thr_ld.partition_D(cute.local_tile(gO, (Q_TILE_ROWS, _CHUNK), (0, j)))
            if in_bounds:
                cute.autovec_copy(r16, tOg)
