"""The portable backward's main kernel (bwd.py has the contract; bwd_config.py the tiles).

One CTA per (key tile, KV head, batch). It keeps its K and V tile in shared memory and dK, dV in
registers, and walks every query head of its KV group and, per head, the query tiles that see
any of its keys: one flattened walk over (head, query tile). Q and dO come in by cp.async, into
one buffer or two (`stages`: the next tile loads while this one computes); then per query tile the
five warp-level MMAs (ldmatrix-fed m16n8k16):

    S  = Q K^T                      P  = exp2(S * scale * log2 e - lse2)   (masked keys: P = 0)
    dP = dO V^T                     dS = P * (dP - dpsum)                  (softcap: * (1 - tanh^2))
    dV += P^T dO                    dK += dS^T Q                           dQ_acc += dS K

P and dS go through shared memory (16-bit) to be read transposed by the dV and dK products. dQ
leaves by fp32 atomic adds into the dQ buffer, or, deterministic, by plain read-add-write in key
tile order, a per-(batch, head, query tile) counter serialising the CTAs (each waits for the
count of key tiles before it, a number both sides compute from the same block range). dK picks
up the softmax scale here; dQ's is applied by the host conversion.

Rows past a sequence's end are zero-filled in shared memory (never garbage times zero: NaN), so
every product stays finite; their statistics read as lse2 = +inf, dpsum = 0 (P = 0).
"""


import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cutlass_dsl import dsl_user_op

from torch_fa4.kernels.common import mod_lowering as mods_dsl
from torch_fa4.kernels.common.seqlen_info import SeqlenInfo

LOG2E = math.log2(math.e)
UNBOUNDED = 1 << 30


def _smem_atom(dtype, cols: int):
    """A swizzled (8, w) row-major atom for 16-bit rows of `cols` elements: ldmatrix rows of one
    8x8 matrix land in distinct banks (w = 64, 32 or 16 elements, the widest dividing cols)."""
    width = 64 if cols % 64 == 0 else (32 if cols % 32 == 0 else 16)
    bits = {64: 3, 32: 2, 16: 1}[width]
    return cute.make_composed_layout(cute.make_swizzle(bits, 3, 3), 0,
                                     cute.make_ordered_layout((8, width), order=(1, 0)))


def _transposed(t: cute.Tensor) -> cute.Tensor:
    """(rows, cols) shared-memory tensor viewed as (cols, rows): the same bytes."""
    rows, cols = cute.size(t, mode=[0]), cute.size(t, mode=[1])
    return cute.composition(t, cute.make_ordered_layout((cols, rows), order=(1, 0)))


def _rows_cols(t: cute.Tensor) -> cute.Tensor:
    """An m16n8 accumulator partition ((2, 2), M, N) viewed as ((2, M), (2, N)): rows, columns."""
    s, d = t.layout.shape, t.layout.stride
    layout = cute.make_layout(((s[0][1], s[1]), (s[0][0], s[2])),
                              stride=((d[0][1], d[1]), (d[0][0], d[2])))
    return cute.make_tensor(t.iterator, layout)


@dsl_user_op
def red_add_pair(ptr: cute.Pointer, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """*ptr += a, *(ptr + 1) += b, one fp32 vector reduction (PTX red .v2.f32: sm_90 and later)."""
    llvm.inline_asm(None, [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
                           Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
                    "red.global.add.v2.f32 [$0], {$1, $2};", "l,f,f", has_side_effects=True,
                    loc=loc, ip=ip)


def _vector_threads(cols: int, threads: int) -> int:
    """Threads along a row for 16-byte copies: the widest of 16, 8, 4 dividing both."""
    for n in (16, 8, 4):
        if (cols // 8) % n == 0 and threads % n == 0:
            return n
    raise ValueError(f"row of {cols} elements")


class PortableBackwardKernel:
    def __init__(self, dtype, d: int, dv: int, tile_m: int, tile_n: int, num_warps: int,
                 causal_or_window: bool, softcap: bool, deterministic: bool, varlen: bool, seqused: bool,
                 sdp_warps_n: int = 1, kv_warps_n: int = 1, dq_warps_n: int = 1, stages: int = 1,
                 mods=None, sparse: bool = False, dq_pair_adds: bool = False, late_row_stats: bool = False,
                 split_walk: bool = True):
        self.dtype = dtype
        self.d, self.dv = d, dv
        self.tile_m, self.tile_n = tile_m, tile_n
        self.num_warps = num_warps
        self.threads = 32 * num_warps
        self.bounded = causal_or_window
        self.softcap = softcap
        self.deterministic = deterministic
        self.varlen = varlen
        self.seqused = seqused
        self.sdp_warps_n = sdp_warps_n
        self.kv_warps_n = kv_warps_n
        self.dq_warps_n = dq_warps_n
        self.stages = stages  # Q / dO buffers: 2 loads the next query tile while this one computes
        # score_mod / mask_mod (a ModSet): inlined per element; d score_mod / d score joins dS
        (self.score_graph, self.mask_graph, self.grad_graph, self.num_score_aux,
         self.num_aux) = mods_dsl.backward_mods(mods)
        self.sparse = sparse  # a block mask's tile map prunes the walk (bwd_sparse.py)
        self.dq_pair_adds = dq_pair_adds  # red.global.add.v2.f32 (sm_90+): two columns per atomic
        self.late_row_stats = late_row_stats  # lse2 / dpsum read after S's product, not before it
        self.split_walk = split_walk  # cut query tiles in a masked loop, the rest in an unmasked one

    # ---- static layouts --------------------------------------------------------------------------

    def _tiled_mma(self, warps_m: int, warps_n: int):
        op = warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16))
        return cute.make_tiled_mma(op, (warps_m, warps_n, 1),
                                   permutation_mnk=(warps_m * 16, warps_n * 16, 16))

    def _gmem_copy(self, cols: int):
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                                   num_bits_per_copy=128)
        tc = _vector_threads(cols, self.threads)
        thr = cute.make_ordered_layout((self.threads // tc, tc), order=(1, 0))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, 8)))

    def _smem_layouts(self):
        """(Q, dO, K, V, P/dS) shared-memory layouts; built where used (a layout made on the host
        side is not visible inside the kernel)."""
        def lay(rows, cols, stages=1):
            return cute.tile_to_shape(_smem_atom(self.dtype, cols), (rows, cols, stages), (0, 1, 2))

        tm, tn, st = self.tile_m, self.tile_n, self.stages
        return lay(tm, self.d, st), lay(tm, self.dv, st), lay(tn, self.d), lay(tn, self.dv), lay(tm, tn)

    def _smem_struct(self):
        q, do, k, v, p = (cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]
                          for layout in self._smem_layouts())

        @cute.struct
        class Storage:
            sK: k
            sV: v
            sQ: q
            sdO: do
            sP: p
            sdS: p

        return Storage

    def smem_bytes(self) -> int:
        tm, tn = self.tile_m, self.tile_n
        return 2 * (self.stages * tm * (self.d + self.dv) + tn * self.d + tn * self.dv + 2 * tm * tn)

    # ---- launch ----------------------------------------------------------------------------------

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mDpsum: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mCuQ, mCuK, mSeqUsedK, mSem, mVisit, scale: Float32, scale_log2: Float32,
                 softcap: Float32, window_left: Int32, window_right: Int32, num_batch: Int32,
                 max_seqlen_k: Int32, aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7, stream):
        # aux*: the mods' captured tensors (None when unused; separate arguments: TVM-FFI takes no
        # tuple of tensors of different ranks)
        aux = (aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7)[: self.num_aux]
        score_aux, mask_aux = aux[: self.num_score_aux], aux[self.num_score_aux:]
        Storage = self._smem_struct()
        grid = (cute.ceil_div(max_seqlen_k, self.tile_n), mK.shape[2], num_batch)
        self.kernel(mQ, mK, mV, mdO, mLSE2, mDpsum, mdQacc, mdK, mdV, mCuQ, mCuK, mSeqUsedK, mSem, mVisit,
                    scale, scale_log2, softcap, window_left, window_right, score_aux, mask_aux,
                    Storage).launch(
            grid=grid, block=(self.threads, 1, 1), smem=Storage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE2: cute.Tensor, mDpsum: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mCuQ, mCuK, mSeqUsedK, mSem, mVisit, scale: Float32, scale_log2: Float32,
               softcap: Float32, window_left: Int32, window_right: Int32, score_aux, mask_aux,
               Storage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, h_kv, batch = cute.arch.block_idx()
        tm, tn = self.tile_m, self.tile_n
        info = SeqlenInfo(batch, mQ.shape[1], mK.shape[1], mCuQ, mCuK, mSeqUsedK)
        seqlen_q, seqlen_k = info.seqlen_q, info.seqlen_k
        tb = batch  # the tensors' batch index: 0 for packed rows
        if const_expr(self.varlen):
            tb = Int32(0)
        group = mQ.shape[2] // mK.shape[2]
        n0 = n_block * tn

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Storage)
        lq, ldo, lk, lv, lp = self._smem_layouts()
        sQ_all = st.sQ.get_tensor(lq)  # (tm, D, stages)
        sdO_all = st.sdO.get_tensor(ldo)
        sK = st.sK.get_tensor(lk)[None, None, 0]
        sV = st.sV.get_tensor(lv)[None, None, 0]
        sP = st.sP.get_tensor(lp)[None, None, 0]
        sdS = st.sdS.get_tensor(lp)[None, None, 0]
        sQ, sdO = sQ_all[None, None, 0], sdO_all[None, None, 0]  # shapes for the fragments
        sPt, sdSt, sKt = (_transposed(t) for t in (sP, sdS, sK))
        sQt, sdOt = _transposed(sQ), _transposed(sdO)

        mma_sdp = self._tiled_mma(self.num_warps // self.sdp_warps_n, self.sdp_warps_n)
        mma_dkv = self._tiled_mma(self.num_warps // self.kv_warps_n, self.kv_warps_n)
        mma_dq = self._tiled_mma(self.num_warps // self.dq_warps_n, self.dq_warps_n)
        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        s2r_sdp_a = cute.make_tiled_copy_A(ldsm, mma_sdp).get_slice(tidx)
        s2r_sdp_b = cute.make_tiled_copy_B(ldsm, mma_sdp).get_slice(tidx)
        s2r_dkv_a = cute.make_tiled_copy_A(ldsm_t, mma_dkv).get_slice(tidx)
        s2r_dkv_b = cute.make_tiled_copy_B(ldsm_t, mma_dkv).get_slice(tidx)
        s2r_dq_a = cute.make_tiled_copy_A(ldsm, mma_dq).get_slice(tidx)
        s2r_dq_b = cute.make_tiled_copy_B(ldsm_t, mma_dq).get_slice(tidx)
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), mma_sdp)
        r2s_thr = r2s.get_slice(tidx)

        # ---- K, V: loaded once ----
        k_rows = info.k_rows(mK[tb, None, h_kv, None])
        v_rows = info.k_rows(mV[tb, None, h_kv, None])
        gK = cute.local_tile(k_rows, (tn, self.d), (n_block, 0))
        gV = cute.local_tile(v_rows, (tn, self.dv), (n_block, 0))
        copy_qk = self._gmem_copy(self.d)
        copy_v = self._gmem_copy(self.dv)
        self._load_rows(copy_qk, gK, sK, seqlen_k - n0, tidx)
        self._load_rows(copy_v, gV, sV, seqlen_k - n0, tidx)
        cute.arch.cp_async_commit_group()

        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((tn, self.d)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((tn, self.dv)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # MMA operand fragments (registers), fed from shared memory by ldmatrix
        rQ = thr_sdp.make_fragment_A(thr_sdp.partition_A(sQ))
        rK = thr_sdp.make_fragment_B(thr_sdp.partition_B(sK))
        rdO = thr_sdp.make_fragment_A(thr_sdp.partition_A(sdO))
        rV = thr_sdp.make_fragment_B(thr_sdp.partition_B(sV))
        rPt = thr_dkv.make_fragment_A(thr_dkv.partition_A(sPt))
        rdOt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sdOt))
        rdSt = thr_dkv.make_fragment_A(thr_dkv.partition_A(sdSt))
        rQt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sQt))
        rdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS))
        rKt = thr_dq.make_fragment_B(thr_dq.partition_B(sKt))

        # coordinates of each accumulator element within its tile
        cS = _rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((tm, tn))))
        cdQ = thr_dq.partition_C(cute.make_identity_tensor((tm, self.d)))

        # ---- which query tiles see this key tile ----
        shift = seqlen_k - seqlen_q  # bottom-right alignment
        row_lo = Int32(0)
        row_hi = seqlen_q
        if const_expr(self.bounded):
            row_lo = cutlass.max(row_lo, n0 - shift - window_right)
            row_hi = cutlass.min(row_hi, n0 + tn - shift + window_left)
        m_begin = row_lo // tm
        m_end = (row_hi + tm - 1) // tm
        if n0 >= seqlen_k:
            m_end = m_begin  # a tile past this sequence's keys (varlen): nothing to do, nothing to write

        # the walk: (query head of the group, query tile) pairs, heads outermost. split_walk: first
        # every head's query tiles that the key limits cut (per-element masks), then the others (no
        # masks), each part its own loop (its own register allocation; one loop with a per-tile
        # branch between the two element codes spilled); without, one loop masks every tile.
        m_end = cutlass.max(m_end, m_begin)
        n_m = m_end - m_begin
        u_begin = m_end  # the uncut query tiles: [u_begin, u_end)
        u_end = m_end
        if const_expr(self.split_walk):
            if n0 + tn <= seqlen_k:
                u_begin = m_begin
                if const_expr(self.bounded):
                    # a tile is uncut when its last key is at most its first row's last visible key,
                    # and its first key at least its last row's first visible key
                    first_ok = cutlass.max(n0 + tn - shift - window_right - 1, 0)
                    u_begin = cutlass.min(cutlass.max((first_ok + tm - 1) // tm, m_begin), m_end)
                    last_ok = cutlass.max(n0 + window_left - shift - tm + 1, -tm)
                    u_end = cutlass.min(cutlass.max((last_ok + tm) // tm, u_begin), m_end)
        walk = (m_begin, u_begin, u_end, m_end, group)
        total = group * n_m
        total_masked = group * (n_m - (u_end - u_begin))
        if const_expr(self.stages > 1):
            if total > 0:
                self._load_item(Int32(0), 0, walk, h_kv, group, info, tb, mQ, mdO, sQ_all, sdO_all,
                                copy_qk, copy_v, seqlen_q, tidx)
            cute.arch.cp_async_commit_group()
        for part in cutlass.range_constexpr(2 if self.split_walk else 1):
            masked = part == 0
            w_lo = 0 if masked else total_masked
            w_hi = total_masked if masked else total
            for w in cutlass.range(w_lo, w_hi, unroll=1):
                hh, m_block = self._walk_item(w, walk, part)
                h = h_kv * group + hh
                m0 = m_block * tm
                stage = 0
                if const_expr(self.stages > 1):
                    stage = w % self.stages
                else:
                    self._load_item(w, 0, walk, h_kv, group, info, tb, mQ, mdO, sQ_all, sdO_all,
                                    copy_qk, copy_v, seqlen_q, tidx, part)
                    cute.arch.cp_async_commit_group()
                dq_rows = info.q_rows(mdQacc[tb, None, h, None])
                lse_row = info.q_rows(mLSE2[tb, h, None])
                dps_row = info.q_rows(mDpsum[tb, h, None])
                sQ = sQ_all[None, None, stage]
                sdO = sdO_all[None, None, stage]
                sQt, sdOt = _transposed(sQ), _transposed(sdO)

                # row statistics of this thread's rows, read while the tiles land (or, late_row_stats,
                # under the dP product)
                n_rows = cute.size(cS, mode=[0])
                lse = cute.make_rmem_tensor((n_rows,), Float32)
                dps = cute.make_rmem_tensor((n_rows,), Float32)
                if const_expr(not self.late_row_stats):
                    self._row_stats(lse, dps, cS, m0, seqlen_q, lse_row, dps_row)

                cute.arch.cp_async_wait_group(0)
                # this item's tiles landed for every thread, and every warp is done with the last item
                # (its Q / dO buffer, sP, sdS): with two buffers the next item then loads into the other
                # one during this step, and no barrier is needed at the end of the step
                cute.arch.barrier()

                # a block mask's empty steps are skipped (their loads were issued: harmless)
                visit = cutlass.Boolean(True)
                if const_expr(self.sparse):
                    visit = mVisit[batch, h, n_block, m_block] != 0
                if visit:
                    acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tm, tn)), Float32)
                    acc_S.fill(0.0)
                    self._gemm(mma_sdp, acc_S, rQ, rK, thr_sdp, s2r_sdp_a, s2r_sdp_b, sQ, sK)
                    if const_expr(self.late_row_stats):
                        self._row_stats(lse, dps, cS, m0, seqlen_q, lse_row, dps_row)
                    acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tm, tn)), Float32)
                    acc_dP.fill(0.0)
                    self._gemm(mma_sdp, acc_dP, rdO, rV, thr_sdp, s2r_sdp_a, s2r_sdp_b, sdO, sV)

                    S = _rows_cols(acc_S)
                    dP = _rows_cols(acc_dP)
                    args = (S, dP, cS, lse, dps, m0, n0, seqlen_q, seqlen_k, shift, window_left, window_right,
                            scale, scale_log2, softcap, batch, h, score_aux, mask_aux)
                    self._p_and_ds(*args, masked)

                    rP = cute.make_fragment_like(acc_S, self.dtype)
                    rP.store(acc_S.load().to(self.dtype))
                    rdSv = cute.make_fragment_like(acc_dP, self.dtype)
                    rdSv.store(acc_dP.load().to(self.dtype))
                    cute.copy(r2s, r2s_thr.retile(rP), r2s_thr.partition_D(sP))
                    cute.copy(r2s, r2s_thr.retile(rdSv), r2s_thr.partition_D(sdS))
                    cute.arch.barrier()
                    self._prefetch(w, total, walk, h_kv, group, info, tb, mQ, mdO, sQ_all, sdO_all,
                                   copy_qk, copy_v, seqlen_q, tidx, part)

                    # (dK before dQ: dQ's product and atomics first, under dK's MMAs, measured 3% slower
                    # at D=128 on the H200)
                    self._gemm(mma_dkv, acc_dV, rPt, rdOt, thr_dkv, s2r_dkv_a, s2r_dkv_b, sPt, sdOt)
                    self._gemm(mma_dkv, acc_dK, rdSt, rQt, thr_dkv, s2r_dkv_a, s2r_dkv_b, sdSt, sQt)

                    acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, self.d)), Float32)
                    acc_dQ.fill(0.0)
                    self._gemm(mma_dq, acc_dQ, rdS, rKt, thr_dq, s2r_dq_a, s2r_dq_b, sdS, sKt)
                    gdQ = thr_dq.partition_C(cute.local_tile(dq_rows, (tm, self.d), (m_block, 0)))
                    self._add_dq(acc_dQ, gdQ, cdQ, seqlen_q - m0, mSem, h, m_block, batch, n_block, shift,
                                 window_left)
                else:
                    self._prefetch(w, total, walk, h_kv, group, info, tb, mQ, mdO, sQ_all, sdO_all,
                                   copy_qk, copy_v, seqlen_q, tidx, part)
                if const_expr(self.stages == 1):
                    cute.arch.barrier()  # every warp is done with sQ, sdO, sP, sdS before the next loads

        # ---- epilogue: dK (with the softmax scale), dV ----
        acc_dK.store(acc_dK.load() * scale)
        dk_rows = info.k_rows(mdK[tb, None, h_kv, None])
        dv_rows = info.k_rows(mdV[tb, None, h_kv, None])
        self._store_rows(acc_dK, thr_dkv.partition_C(cute.local_tile(dk_rows, (tn, self.d), (n_block, 0))),
                         thr_dkv.partition_C(cute.make_identity_tensor((tn, self.d))), seqlen_k - n0)
        self._store_rows(acc_dV, thr_dkv.partition_C(cute.local_tile(dv_rows, (tn, self.dv), (n_block, 0))),
                         thr_dkv.partition_C(cute.make_identity_tensor((tn, self.dv))), seqlen_k - n0)

    # ---- pieces ------------------------------------------------------------------------------------

    @cute.jit
    def _p_and_ds(self, S, dP, cS, lse, dps, m0, n0, seqlen_q, seqlen_k, shift, window_left, window_right,
                  scale, scale_log2, softcap, batch, h, score_aux, mask_aux, masked: cutlass.Constexpr):
        """S -> P and dP -> dS in place (rows, columns views of the accumulators); `masked`: with the
        key limits (causal / window / the sequence's last key) applied per element.

        (Skipping the limits on uncut tiles by a second copy of this code behind a per-tile branch
        made ptxas spill 12 registers in the key loop at D=128 on sm_90a.)"""
        # the limits as offsets from this thread's first element (row0, col0): an element's own offset
        # is a compile-time constant, so each test is one compare against a per-tile scalar
        # (rather than per-element coordinates and per-row bounds held in registers)
        row0, col0 = cS[0, 0][0], cS[0, 0][1]
        key_lim = seqlen_k - n0 - col0  # column offset at or past it: past the sequence's end
        diag = m0 + row0 + shift - n0 - col0
        hi_lim = diag + window_right + 1  # (column - row) offset at or past it: right of the window
        lo_lim = diag - window_left  # below it: left of the window
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            row = m0 + cS[r, 0][0]
            # positions that feed a mod, kept inside the sequence (padded rows and keys)
            i_in = cutlass.min(row, seqlen_q - 1)
            for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                col = n0 + cS[r, c][1]
                s = S[r, c]
                dcap = Float32(1.0)
                if const_expr(self.softcap):
                    t = cute.math.tanh(s * scale / softcap, fastmath=True)
                    dcap = Float32(1.0) - t * t
                    s = t * softcap * Float32(LOG2E)
                else:
                    s = s * scale_log2
                j_in = cutlass.min(col, seqlen_k - 1)
                if const_expr(self.score_graph is not None):
                    # the mod takes the scaled (capped) score in natural units; its derivative at
                    # that score joins the chain rule for dS
                    s_nat = s * Float32(1.0 / LOG2E)
                    s = mods_dsl.score_mod_value(self.score_graph, s_nat, batch, h, i_in, j_in,
                                                 score_aux) * Float32(LOG2E)
                    if const_expr(self.grad_graph is not None):
                        grad = mods_dsl.score_grad_value(self.grad_graph, s_nat, batch, h, i_in, j_in,
                                                         score_aux)
                        dcap = dcap * grad
                p = cute.math.exp2(s - lse[r], fastmath=True)
                if const_expr(self.mask_graph is not None):
                    keep = mods_dsl.mask_mod_value(self.mask_graph, batch, h, i_in, j_in, mask_aux)
                    p = Float32(cutlass.select_(keep, p, Float32(0.0)))
                if const_expr(masked):
                    c_off = cS[r, c][1] - col0
                    if c_off >= key_lim:
                        p = Float32(0.0)
                    if const_expr(self.bounded):
                        diff = c_off - (cS[r, 0][0] - row0)
                        if diff >= hi_lim:
                            p = Float32(0.0)
                        if diff < lo_lim:
                            p = Float32(0.0)
                S[r, c] = p
                dP[r, c] = p * (dP[r, c] - dps[r]) * dcap

    @cute.jit
    def _row_stats(self, lse, dps, cS, m0, seqlen_q, lse_row, dps_row):
        """lse2 and dpsum of this thread's rows (+inf and 0 past the sequence: P = 0)."""
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = m0 + cS[r, 0][0]
            lse[r] = Float32.inf
            dps[r] = Float32(0.0)
            if row < seqlen_q:
                lse[r] = lse_row[row]
                dps[r] = dps_row[row]

    @cute.jit
    def _walk_item(self, w, walk, part: cutlass.Constexpr = None):
        """(query head within the group, query tile) of walk item w: the cut tiles of every head
        first (a head's front ones, before the uncut range, then its back ones), then the uncut;
        `part` 0 or 1: w is known to lie in the first or the second."""
        m_begin, u_begin, u_end, m_end, group = walk
        n_front = u_begin - m_begin
        n_masked = n_front + m_end - u_end
        hh = Int32(0)
        m_block = Int32(0)
        if const_expr(part == 0):
            hh, m_block = self._cut_item(w, m_begin, u_end, n_front, n_masked)
        elif const_expr(part == 1):
            hh, m_block = self._uncut_item(w - group * n_masked, u_begin, u_end - u_begin)
        else:
            if w < group * n_masked:
                hh, m_block = self._cut_item(w, m_begin, u_end, n_front, n_masked)
            else:
                hh, m_block = self._uncut_item(w - group * n_masked, u_begin, u_end - u_begin)
        return hh, m_block

    @cute.jit
    def _cut_item(self, w, m_begin, u_end, n_front, n_masked):
        hh = w // n_masked
        i = w - hh * n_masked
        m_block = m_begin + i
        if i >= n_front:
            m_block = u_end + i - n_front
        return hh, m_block

    @cute.jit
    def _uncut_item(self, v, u_begin, n_plain):
        hh = v // n_plain
        return hh, u_begin + v - hh * n_plain

    @cute.jit
    def _prefetch(self, w, total, walk, h_kv, group, info, tb, mQ, mdO, sQ_all, sdO_all, copy_qk,
                  copy_v, seqlen_q, tidx, part: cutlass.Constexpr):
        """With two buffers: the next walk item's loads, issued once S and dP are done (fewer
        registers live than at the step's start) and landing under the dV, dQ, dK products. (From
        the walk's second part the next item is in it too; from the first, in either.)"""
        if const_expr(self.stages > 1):
            if w + 1 < total:
                self._load_item(w + 1, (w + 1) % self.stages, walk, h_kv, group, info, tb, mQ, mdO,
                                sQ_all, sdO_all, copy_qk, copy_v, seqlen_q, tidx, 1 if part == 1 else None)
                cute.arch.cp_async_commit_group()

    @cute.jit
    def _load_item(self, w, stage, walk, h_kv, group, info, tb, mQ, mdO, sQ_all, sdO_all, copy_qk,
                   copy_v, seqlen_q, tidx, part: cutlass.Constexpr = None):
        """cp.async the Q and dO tiles of walk item w into buffer `stage` (no commit)."""
        hh, m_block = self._walk_item(w, walk, part)
        h = h_kv * group + hh
        gQ = cute.local_tile(info.q_rows(mQ[tb, None, h, None]), (self.tile_m, self.d), (m_block, 0))
        gdO = cute.local_tile(info.q_rows(mdO[tb, None, h, None]), (self.tile_m, self.dv), (m_block, 0))
        rows_left = seqlen_q - m_block * self.tile_m
        self._load_rows(copy_qk, gQ, sQ_all[None, None, stage], rows_left, tidx)
        self._load_rows(copy_v, gdO, sdO_all[None, None, stage], rows_left, tidx)

    @cute.jit
    def _load_rows(self, tiled_copy, g: cute.Tensor, s: cute.Tensor, rows_left: Int32, tidx):
        """cp.async a (rows, cols) tile of global rows into shared memory; rows at or past
        rows_left are zero-filled instead."""
        thr = tiled_copy.get_slice(tidx)
        tg = thr.partition_S(g)
        ts = thr.partition_D(s)
        rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
        tc = thr.partition_S(cute.make_identity_tensor((rows, cols)))
        zero = cute.make_rmem_tensor_like(ts[None, 0, None], self.dtype)
        zero.fill(0.0)
        for m in cutlass.range_constexpr(cute.size(ts, mode=[1])):
            if tc[0, m, 0][0] < rows_left:
                cute.copy(tiled_copy, tg[None, m, None], ts[None, m, None])
            else:
                cute.autovec_copy(zero, ts[None, m, None])

    @cute.jit
    def _gemm(self, tiled_mma, acc, rA, rB, thr_mma, s2r_a, s2r_b, sA, sB):
        """acc += A B^T over the whole K extent: A (M, K), B (N, K) in shared memory, each k16
        slice loaded by ldmatrix one step ahead of its MMA."""
        tsA = s2r_a.partition_S(sA)
        tsB = s2r_b.partition_S(sB)
        rA_view = s2r_a.retile(rA)
        rB_view = s2r_b.retile(rB)
        k_steps = cute.size(tsA, mode=[2])
        cute.copy(s2r_a, tsA[None, None, 0], rA_view[None, None, 0])
        cute.copy(s2r_b, tsB[None, None, 0], rB_view[None, None, 0])
        for k in cutlass.range_constexpr(k_steps):
            if const_expr(k + 1 < k_steps):
                cute.copy(s2r_a, tsA[None, None, k + 1], rA_view[None, None, k + 1])
                cute.copy(s2r_b, tsB[None, None, k + 1], rB_view[None, None, k + 1])
            cute.gemm(tiled_mma, acc, rA[None, None, k], rB[None, None, k], acc)

    @cute.jit
    def _add_dq(self, acc, g: cute.Tensor, coords: cute.Tensor, rows_left: Int32, mSem, h, m_block, batch,
                n_block, shift, window_left):
        """acc into the fp32 dQ buffer: atomic adds, or (deterministic) plain adds in key-tile
        order behind the tile's counter."""
        if const_expr(not self.deterministic):
            # a whole tile of rows adds without a per-element row test (each test compiled to a
            # branch around its atomic)
            if rows_left >= self.tile_m:
                self._atomic_adds(acc, g, coords, rows_left, False)
            else:
                self._atomic_adds(acc, g, coords, rows_left, True)
        else:
            # key tiles that reach this query tile before this one: the first is the lowest key
            # tile any of its rows sees
            first = Int32(0)
            if const_expr(self.bounded):
                first = cutlass.max(m_block * self.tile_m + shift - window_left, 0) // self.tile_n
            turn = n_block - first
            sem = mSem.iterator + cute.crd2idx((batch, h, m_block), mSem.layout)
            if cute.arch.thread_idx()[0] == 0:
                seen = cute.arch.atomic_add(sem, Int32(0), sem="acquire", scope="gpu")
                while seen != turn:
                    seen = cute.arch.atomic_add(sem, Int32(0), sem="acquire", scope="gpu")
            cute.arch.barrier()
            cute.arch.fence_acq_rel_gpu()
            for i in cutlass.range_constexpr(cute.size(acc)):
                if coords[i][0] < rows_left:
                    g[i] = g[i] + acc[i]
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            if cute.arch.thread_idx()[0] == 0:
                cute.arch.atomic_add(sem, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def _atomic_adds(self, acc, g: cute.Tensor, coords: cute.Tensor, rows_left: Int32,
                     tested: cutlass.Constexpr):
        """acc into g by fp32 atomics; `tested`: only rows before rows_left."""
        if const_expr(self.dq_pair_adds):
            # elements (2j, 2j + 1): adjacent columns of one row (the accumulator's mode 0.0)
            assert const_expr(cute.size(acc.layout.shape[0][0]) == 2 and g.layout.stride[0][0] == 1)
            for j in cutlass.range_constexpr(cute.size(acc) // 2):
                if not tested or coords[2 * j][0] < rows_left:
                    red_add_pair(g.iterator + cute.crd2idx(2 * j, g.layout), acc[2 * j], acc[2 * j + 1])
        else:
            for i in cutlass.range_constexpr(cute.size(acc)):
                if not tested or coords[i][0] < rows_left:
                    cute.arch.atomic_add(g.iterator + cute.crd2idx(i, g.layout), acc[i])

    @cute.jit
    def _store_rows(self, acc, g: cute.Tensor, coords: cute.Tensor, rows_left: Int32):
        out = cute.make_fragment_like(acc, self.dtype)
        out.store(acc.load().to(self.dtype))
        for i in cutlass.range_constexpr(cute.size(acc)):
            if coords[i][0] < rows_left:
                g[i] = out[i]
