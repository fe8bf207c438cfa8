"""Portable FlashAttention forward: warp-level MMA (mma.sync m16n8k16), ldmatrix and cp.async,
for every NVIDIA GPU since Ampere (sm_80, sm_86, sm_89, sm_90, sm_100, sm_120).

One CTA per work item (query tile, head, batch; kernels/common/tile_scheduler.py orders them),
`num_warps` warps side by side along the query rows, each owning tile_m / num_warps rows of S and O
in registers. Shared memory holds Q, one K and one V tile. Key tiles are walked last to first
(kernels/common/kv_tile_walk.py: masked tiles first), and the cp.async loads overlap the math:

    load Q, K_0
    for t:  wait K_t;   load V_t      (under S_t = Q K_t^T)
            S_t = Q K_t^T
            wait V_t;   load K_t+1    (under the softmax and P V of tile t)
            softcap, score_mod, masks, mask_mod;  online softmax -> P_t;  rescale O
            O += P_t V_t
    O /= row sums -> shared memory (over Q) -> global memory; LSE

Operands reach the tensor cores through ldmatrix (V transposed), one k-slice ahead of the MMA that
reads it. Rows past a sequence's end are zero-filled in shared memory (a predicated cp.async per
row); the tiles that need it (the last key tile, a varlen sequence's edges) take that path only.
The accumulators are viewed as wgmma fragments (mma_fragment.py) so the softmax, the masks and the
mods are the shared ones. Tensors arrive as the other forwards take them (kernels/host/fwd_launch.py).
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from torch_fa4.kernels.common.acc_layout import a_operand, rows_cols
from torch_fa4.kernels.common.block_range import BlockRange
from torch_fa4.kernels.common.convert import convert_pairs
from torch_fa4.kernels.common.kv_tile_walk import DenseKvWalk, SparseKvWalk
from torch_fa4.kernels.common.masking import apply_mask
from torch_fa4.kernels.common.online_softmax import OnlineSoftmax, scale_rows
from torch_fa4.kernels.common.seqlen_info import SeqlenInfo
from torch_fa4.kernels.common.tile_mods import TileMods
from torch_fa4.kernels.common.tile_scheduler import TileScheduler
from torch_fa4.kernels.portable.fwd_config import MAX_AUX, PortableFwdConfig
from torch_fa4.kernels.portable.mma_fragment import wgmma_view
# (the layout views the Hopper forward takes its tensors through; plain layout code)
from torch_fa4.kernels.sm90.fwd import _sequence_major as sequence_major

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453
COPY_BITS = 128  # cp.async and the O store move 16 bytes per thread and instruction


class FlashFwdPortable:
    def __init__(self, cfg: PortableFwdConfig):
        self.cfg = cfg
        self.dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[cfg.dtype_name]
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.hdim, self.hdimv = cfg.head_dim, cfg.head_dim_v
        self.num_threads = cfg.num_threads
        assert self.hdim == self.hdimv, "O is staged over Q's shared memory"
        assert self.tile_m % (16 * cfg.num_warps) == 0 and self.tile_n % 16 == 0 and self.hdim % 32 == 0
        self.score_graph = self.mask_graph = None
        self.num_score_aux = 0
        if cfg.mod_key:
            from torch_fa4.mods import registry

            mods = registry.lookup(cfg.mod_key)
            self.score_graph, self.mask_graph = mods.score_graph, mods.mask_graph
            self.num_score_aux = mods.num_score_aux
        assert len(cfg.aux_specs) <= MAX_AUX
        assert not cfg.block_sparse or self.mask_graph is not None, "a block mask needs its mask_mod"

    # ---- host-side construction (traced once per variant) ------------------------------------------

    def _smem_layout(self, rows: int, cols: int):
        """Row-major (rows, cols) tiles of 8 rows x 64 (or 32) columns, XOR-swizzled so ldmatrix and
        the 16-byte cp.async stores hit every bank once."""
        k_block = 64 if cols % 64 == 0 else 32
        atom = cute.make_composed_layout(
            cute.make_swizzle(3 if k_block == 64 else 2, 3, 3), 0,
            cute.make_layout((8, k_block), stride=(k_block, 1)))
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))

    def _gmem_copy(self, cols: int, atom_op):
        """A tiled copy of 16-byte vectors along rows of `cols` elements, all threads of the CTA."""
        per_vec = COPY_BITS // self.dtype.width
        k_block = 64 if cols % 64 == 0 else 32
        threads_per_row = k_block // per_vec
        atom = cute.make_copy_atom(atom_op, self.dtype, num_bits_per_copy=COPY_BITS)
        rows = self.num_threads // threads_per_row
        thr = cute.make_layout((rows, threads_per_row), stride=(threads_per_row, 1))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, per_vec)))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, Hq, D) or (Tq, Hq, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D) or (Tk, Hkv, D)
        mV: cute.Tensor,
        mO: cute.Tensor,  # like mQ
        mLSE: cute.Tensor,  # (B, Hq, Sq) or (Hq, Tq), fp32
        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSequsedK: Optional[cute.Tensor],
        score_scale: Float32,  # multiplies q.k before softcap's tanh
        softmax_scale_log2: Float32,  # log2(e) * (scale, or softcap)
        window_left: Int32, window_right: Int32,
        num_batch: Int32, max_seqlen_q: Int32, heads_per_group: Int32, tail_pairs: Int32,
        max_ctas: Int32,  # (one CTA per item: unused)
        # block mask (block_sparse only, else None), FlexAttention layout
        mBmNum: Optional[cute.Tensor], mBmIdx: Optional[cute.Tensor],
        mBmFullNum: Optional[cute.Tensor], mBmFullIdx: Optional[cute.Tensor],
        aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7,  # the mods' captured tensors, None past the last
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        aux = (aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7)[: len(cfg.aux_specs)]
        score_aux, mask_aux = aux[: self.num_score_aux], aux[self.num_score_aux:]
        block_mask = (mBmNum, mBmIdx, mBmFullNum, mBmFullIdx) if const_expr(cfg.block_sparse) else None
        mQ, mO, mLSE = (sequence_major(t, cfg.varlen_q) for t in (mQ, mO, mLSE))
        mK, mV = (sequence_major(t, cfg.varlen_k) for t in (mK, mV))

        sQ_layout = self._smem_layout(self.tile_m, self.hdim)
        sK_layout = self._smem_layout(self.tile_n, self.hdim)
        sV_layout = self._smem_layout(self.tile_n, self.hdimv)
        dt = self.dtype

        @cute.struct
        class Shared:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]

        load_op = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
        copy_q = self._gmem_copy(self.hdim, load_op)
        copy_kv = self._gmem_copy(self.hdim, load_op)
        copy_o = self._gmem_copy(self.hdimv, cute.nvgpu.CopyUniversalOp())
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)), (cfg.num_warps, 1, 1),
            permutation_mnk=(cfg.num_warps * 16, 16, 16))

        num_m_blocks = (max_seqlen_q + self.tile_m - 1) // self.tile_m
        grid = TileScheduler.grid(num_m_blocks, cute.size(mQ.shape[2]), num_batch)
        self.kernel(
            mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSequsedK,
            score_scale, softmax_scale_log2, window_left, window_right,
            num_m_blocks, num_batch, heads_per_group, tail_pairs,
            sQ_layout, sK_layout, sV_layout, copy_q, copy_kv, copy_o, tiled_mma, Shared,
            block_mask, score_aux, mask_aux,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], smem=Shared.size_in_bytes(), stream=stream,
                 # (the carveout given, the DSL does not ask the driver for the SM's shared memory
                 # when it applies the bound: a CPU compile needs no GPU)
                 min_blocks_per_mp=cfg.min_blocks_per_sm, preferred_smem_carveout=100)

    # ---- the kernel --------------------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSequsedK: Optional[cute.Tensor],
        score_scale: Float32, softmax_scale_log2: Float32, window_left: Int32, window_right: Int32,
        num_m_blocks: Int32, num_batch: Int32, heads_per_group: Int32, tail_pairs: Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        copy_q: cute.TiledCopy, copy_kv: cute.TiledCopy, copy_o: cute.TiledCopy,
        tiled_mma: cute.TiledMma, Shared: cutlass.Constexpr,
        block_mask, score_aux, mask_aux,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_heads = cute.size(mQ.shape[2])
        sched = TileScheduler(num_m_blocks, num_heads, num_batch, heads_per_group, tail_pairs, cfg.causal)
        m_block, head, batch = sched.work(bidx)
        seqlen = SeqlenInfo(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSequsedK)
        if m_block * self.tile_m < seqlen.seqlen_q:  # (varlen grids are sized for the longest sequence)
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(Shared)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sK_layout)
            sV = storage.sV.get_tensor(sV_layout)
            head_kv = head // (num_heads // cute.size(mK.shape[2]))
            batch_q = batch if const_expr(not cfg.varlen_q) else 0
            batch_k = batch if const_expr(not cfg.varlen_k) else 0
            mQ_cur = seqlen.q_rows(mQ[None, None, head, batch_q])
            mK_cur = seqlen.k_rows(mK[None, None, head_kv, batch_k])
            mV_cur = seqlen.k_rows(mV[None, None, head_kv, batch_k])
            self._item(tidx, m_block, head, batch, batch_q, seqlen, mQ_cur, mK_cur, mV_cur, mO, mLSE,
                       sQ, sK, sV, copy_q, copy_kv, copy_o, tiled_mma, score_scale, softmax_scale_log2,
                       window_left, window_right, block_mask, score_aux, mask_aux)

    @cute.jit
    def _load_rows(self, tiled_copy: cute.TiledCopy, src: cute.Tensor, dst: cute.Tensor, coords: cute.Tensor,
                   rows_left: Int32, predicated: cutlass.Constexpr):
        """cp.async of a (rows, cols) tile partitioned by one thread; with `predicated`, rows at or
        past `rows_left` (relative to the tile) are zero-filled instead of read."""
        if predicated:
            for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
                if coords[0, m, 0][0] < rows_left:
                    cute.copy(tiled_copy, src[None, m, None], dst[None, m, None])
                else:
                    dst[None, m, None].fill(0)
        else:
            cute.copy(tiled_copy, src, dst)

    @cute.jit
    def _load_kv(self, tiled_copy, gX, sX, coords, n_block, seqlen_k):
        rows_left = seqlen_k - n_block * self.tile_n
        if rows_left < self.tile_n:  # the sequence ends inside this tile (or before it)
            self._load_rows(tiled_copy, gX[None, None, None, n_block], sX, coords, rows_left, True)
        else:
            self._load_rows(tiled_copy, gX[None, None, None, n_block], sX, coords, rows_left, False)

    @cute.jit
    def _scores(self, acc_s, coords, brange, m_block, n_block, seqlen, mods, partial, score_scale):
        """Raw q.k -> softmax units in place (the order of the sm90 forward: softcap, score_mod,
        causal / window / length masks, mask_mod). acc_s, coords: wgmma views."""
        if const_expr(self.cfg.softcap):
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = cute.math.tanh(acc_s[i] * score_scale, fastmath=True)
        if const_expr(self.score_graph is not None):
            mods.score_mod(acc_s, coords, m_block * self.tile_m, n_block * self.tile_n)
        if brange.needs_mask(n_block, m_block, seqlen.seqlen_q, seqlen.seqlen_k):
            apply_mask(acc_s, coords, brange, m_block, n_block, seqlen.seqlen_q, seqlen.seqlen_k, True)
        if const_expr(self.mask_graph is not None):
            if partial:  # (a Python True without a block mask)
                mods.mask_mod(acc_s, coords, m_block * self.tile_m, n_block * self.tile_n)

    @cute.jit
    def _gemm(self, tiled_mma, acc, tCrA, tCrB, copy_a, tCsA, tCrA_view, copy_b, tCsB, tCrB_view):
        """acc += A B over the k-slices, each slice's ldmatrix issued one slice ahead of its MMA
        (copy_a None: A already in registers)."""
        num_k = cute.size(tCrB, mode=[2])
        if const_expr(copy_a is not None):
            cute.copy(copy_a, tCsA[None, None, 0], tCrA_view[None, None, 0])
        cute.copy(copy_b, tCsB[None, None, 0], tCrB_view[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if const_expr(k + 1 < num_k):
                if const_expr(copy_a is not None):
                    cute.copy(copy_a, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
                cute.copy(copy_b, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
            cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)

    @cute.jit
    def _item(self, tidx, m_block, head, batch, batch_q, seqlen: SeqlenInfo, mQ_cur, mK_cur, mV_cur, mO, mLSE,
              sQ, sK, sV, copy_q, copy_kv, copy_o, tiled_mma, score_scale, softmax_scale_log2,
              window_left, window_right, block_mask, score_aux, mask_aux):
        cfg = self.cfg
        brange = BlockRange(self.tile_m, self.tile_n, cfg.causal, cfg.has_window, window_left, window_right)
        if const_expr(cfg.block_sparse):
            walk = SparseKvWalk(*block_mask, batch, head, m_block, cfg.bm_tiles_m, cfg.bm_tiles_n)
        else:
            n_min, n_max = brange.n_block_range(m_block, seqlen.seqlen_q, seqlen.seqlen_k)
            walk = DenseKvWalk(n_min, n_max)

        # global tiles and their per-thread cp.async partitions
        gQ = cute.local_tile(mQ_cur, (self.tile_m, self.hdim), (m_block, 0))
        gK = cute.local_tile(mK_cur, (self.tile_n, self.hdim), (None, 0))
        gV = cute.local_tile(mV_cur, (self.tile_n, self.hdimv), (None, 0))
        thr_q = copy_q.get_slice(tidx)
        thr_kv = copy_kv.get_slice(tidx)
        tQgQ, tQsQ = thr_q.partition_S(gQ), thr_q.partition_D(sQ)
        tQcQ = thr_q.partition_S(cute.make_identity_tensor((self.tile_m, self.hdim)))
        tKgK, tKsK = thr_kv.partition_S(gK), thr_kv.partition_D(sK)
        tVgV, tVsV = thr_kv.partition_S(gV), thr_kv.partition_D(sV)
        tKVcKV = thr_kv.partition_S(cute.make_identity_tensor((self.tile_n, self.hdim)))

        # MMA operands: registers and their ldmatrix sources
        sVt = cute.composition(sV, cute.make_layout((self.hdimv, self.tile_n), stride=(self.tile_n, 1)))
        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        s2r_q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        s2r_k = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        s2r_v = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        tSsQ, tSrQ_view = s2r_q.partition_S(sQ), s2r_q.retile(tSrQ)
        tSsK, tSrK_view = s2r_k.partition_S(sK), s2r_k.retile(tSrK)
        tOsVt, tOrVt_view = s2r_v.partition_S(sVt), s2r_v.retile(tOrVt)

        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.hdimv)), Float32)
        acc_o.fill(0.0)
        acc_o_w = wgmma_view(acc_o)
        coords = wgmma_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
        num_rows = cute.size(rows_cols(coords), mode=[0])
        mods = None
        if const_expr(self.score_graph is not None or self.mask_graph is not None):
            # raw score * natural_scale is the score in natural units: scale, or softcap after tanh
            mods = TileMods(self.score_graph, self.mask_graph, score_aux, mask_aux, batch, head,
                            seqlen.seqlen_q, seqlen.seqlen_k, softmax_scale_log2 * Float32(LN_2))
        if const_expr(self.score_graph is not None):
            softmax_scale_log2 = Float32(LOG2_E)  # score_mod's output is in natural units
        softmax = OnlineSoftmax(softmax_scale_log2, num_rows, cfg.rescale_threshold)
        row_scale = cute.make_rmem_tensor(num_rows, Float32)

        # Q, then the walk's first K tile
        q_rows_left = seqlen.seqlen_q - m_block * self.tile_m
        if q_rows_left < self.tile_m:
            self._load_rows(copy_q, tQgQ, tQsQ, tQcQ, q_rows_left, True)
        else:
            self._load_rows(copy_q, tQgQ, tQsQ, tQcQ, q_rows_left, False)
        if walk.nonempty():
            self._load_kv(copy_kv, tKgK, tKsK, tKVcKV, walk.n_block(0), seqlen.seqlen_k)
        cute.arch.cp_async_commit_group()
        copy_q_slices = s2r_q
        if const_expr(cfg.q_in_regs):
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            cute.copy(s2r_q, tSsQ, tSrQ_view)
            copy_q_slices = None

        for t in cutlass.range(walk.count, unroll=1):
            n_block = walk.n_block(t)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # K_t landed for every thread; every read of V_t-1 is done
            self._load_kv(copy_kv, tVgV, tVsV, tKVcKV, n_block, seqlen.seqlen_k)
            cute.arch.cp_async_commit_group()
            acc_s = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.tile_n)), Float32)
            acc_s.fill(0.0)
            self._gemm(tiled_mma, acc_s, tSrQ, tSrK, copy_q_slices, tSsQ, tSrQ_view, s2r_k, tSsK, tSrK_view)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # V_t landed; every read of K_t is done
            if t + 1 < walk.count:
                self._load_kv(copy_kv, tKgK, tKsK, tKVcKV, walk.n_block(t + 1), seqlen.seqlen_k)
                cute.arch.cp_async_commit_group()
            acc_s_w = wgmma_view(acc_s)
            partial = walk.is_partial(t) if const_expr(cfg.block_sparse) else True
            self._scores(acc_s_w, coords, brange, m_block, n_block, seqlen, mods, partial, score_scale)
            if softmax.step(acc_s_w, row_scale):
                scale_rows(acc_o_w, row_scale)
            tOrP = cute.make_rmem_tensor(thr_mma.partition_shape_A((self.tile_m, self.tile_n)), self.dtype)
            convert_pairs(a_operand(acc_s_w), tOrP)
            self._gemm(tiled_mma, acc_o, tOrP, tOrVt, None, None, None, s2r_v, tOsVt, tOrVt_view)

        # epilogue: O / row sums and the LSE
        lse = cute.make_rmem_tensor(num_rows, Float32)
        softmax.finalize(row_scale, lse)
        scale_rows(acc_o_w, row_scale)
        c = rows_cols(coords)
        mLSE_cur = seqlen.q_rows(mLSE[None, head, batch_q])
        if c[0, 0][1] == 0:  # the lane holding column 0 of its rows writes their LSE
            for r in cutlass.range_constexpr(num_rows):
                row = m_block * self.tile_m + c[r, 0][0]
                if row < seqlen.seqlen_q:
                    mLSE_cur[row] = lse[r]
        r_o = cute.make_rmem_tensor(acc_o.layout, self.dtype)
        convert_pairs(acc_o, r_o)
        # every read of Q is done, and no load is still landing in its buffer (with an empty key
        # walk and Q read from shared memory, nothing waited for Q's own load): O goes over it
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        sO = cute.make_tensor(sQ.iterator, sQ.layout)
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma)
        thr_r2s = r2s.get_slice(tidx)
        cute.copy(r2s, thr_r2s.retile(r_o), thr_r2s.partition_D(sO))
        cute.arch.sync_threads()
        thr_o = copy_o.get_slice(tidx)
        mO_cur = seqlen.q_rows(mO[None, None, head, batch_q])
        gO = cute.local_tile(mO_cur, (self.tile_m, self.hdimv), (m_block, 0))
        tOsO, tOgO = thr_o.partition_S(sO), thr_o.partition_D(gO)
        tOcO = thr_o.partition_D(cute.make_identity_tensor((self.tile_m, self.hdimv)))
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.copy(copy_o, tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
            if tOcO[0, m, 0][0] < q_rows_left:
                cute.copy(copy_o, tOrO[None, m, None], tOgO[None, m, None])
