"""The sm90 forward's consumer warpgroups: per work item the online-softmax key loop (S = Q K^T
beside P V, masks and mods, turn-taking between warpgroups), then the epilogue: O normalised,
converted and stored (through shared memory and TMA, or from registers with a row predicate for
varlen), and the LSE. fwd.py has the whole picture."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from torch_fa4.kernels.common.acc_layout import a_operand, rows_cols
from torch_fa4.kernels.common.convert import convert_pairs
from torch_fa4.kernels.common.masking import apply_mask
from torch_fa4.kernels.common.online_softmax import OnlineSoftmax, scale_rows
from torch_fa4.kernels.common.seqlen_info import SeqlenInfo
from torch_fa4.kernels.common.tile_mods import TileMods
from torch_fa4.kernels.common.tile_mailbox import read_item
from torch_fa4.kernels.common import split_tail, wgmma, wgmma_desc

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453

# named barrier ids (0 is __syncthreads)
BAR_SCHED = 1  # 1..3: consumer warpgroup turn-taking
BAR_EPI_ALL = 4  # all consumers: every wgmma reading Q is done before O overwrites it
BAR_EPI_WG = 5  # 5..7: one warpgroup's O tile is in shared memory


class FwdConsumer:
    """Consumer-warpgroup methods of FlashFwdSm90 (a mixin: they read its configuration)."""

    # consumer warpgroups take turns issuing matmuls (pingpong); no-ops otherwise
    @cute.jit
    def _turn_wait(self, wg: Int32):
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=BAR_SCHED + wg, number_of_threads=256)

    @cute.jit
    def _turn_pass(self, wg: Int32):
        if const_expr(self.pingpong):
            nxt = wg + 1
            if nxt == self.num_wg:
                nxt = 0
            cute.arch.barrier_arrive(barrier_id=BAR_SCHED + nxt, number_of_threads=256)

    @cute.jit
    def _scores(self, acc_s, coords, m_block, n_block, seqlen, mods, partial,
                masked: cutlass.Constexpr = None):
        """Raw q.k -> softmax units (softcap, score_mod) and masks, in place.

        partial: whether mask_mod must run on this tile (a block mask's partial tile; always True
        without a block mask). masked: whether the causal / window / length mask applies (None:
        decided per tile at run time)."""
        brange = self._brange
        if const_expr(self.cfg.softcap):
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = cute.math.tanh(acc_s[i] * self._score_scale, fastmath=True)
        if const_expr(self.score_graph is not None):
            mods.score_mod(acc_s, coords, m_block * self.tile_m, n_block * self.tile_n)
        if const_expr(masked is None):
            if brange.needs_mask(n_block, m_block, seqlen.seqlen_q, seqlen.seqlen_k):
                apply_mask(acc_s, coords, brange, m_block, n_block, seqlen.seqlen_q, seqlen.seqlen_k, True)
        elif const_expr(masked):
            apply_mask(acc_s, coords, brange, m_block, n_block, seqlen.seqlen_q, seqlen.seqlen_k, True)
        if const_expr(self.mask_graph is not None):
            if partial:  # (a Python True without a block mask: resolved at compile time)
                mods.mask_mod(acc_s, coords, m_block * self.tile_m, n_block * self.tile_n)

    def _is_partial(self, walk, t):
        return walk.is_partial(t) if const_expr(self.cfg.block_sparse) else True

    @cute.jit
    def _kv_step(self, t, masked: cutlass.Constexpr, state, v_state, softmax, acc_s, acc_o, tOrP,
                 row_scale, coords, m_block, seqlen, mods, walk, q_state):
        """Key tile t >= 1 of the walk: S_t = Q K_t^T beside O += P_{t-1} V_{t-1}, then the softmax
        of S_t under the P V. Returns the ring positions and the softmax state after it."""
        pipe_q, pipe_k, pipe_v = self._pipes
        tiled_mma_qk, tiled_mma_pv = self._mmas
        tSrQ, tSrK, tOrVt, wg = self._wg_operands
        n_block = walk.n_block(t)
        partial = self._is_partial(walk, t)
        if const_expr(self.cfg.early_o_rescale):
            # O holds the tiles up to t-2 against the reference before tile t-1: move it to tile
            # t-1's reference (row_scale still holds that tile's factors) before P_{t-1} V_{t-1} joins
            scale_rows(acc_o, row_scale)
        if const_expr(self.cfg.hand_descriptors):
            # this step's K and V descriptors, formed before the turn is taken
            k_desc, v_desc = self._hand_descs.stage(state.index, v_state.index)
        pipe_k.consumer_wait(state)
        self._turn_wait(wg)
        if const_expr(self.cfg.hand_descriptors):
            self._hand_descs.qk(acc_s, k_desc)
        else:
            wgmma.issue(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, state.index], True, -1)
        pipe_v.consumer_wait(v_state)
        if const_expr(self.cfg.hand_descriptors):
            self._hand_descs.pv(acc_o, tOrP, v_desc)
        else:
            wgmma.issue(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, v_state.index], False, -1)
        self._turn_pass(wg)
        warpgroup.wait_group(1)  # S ready; P V still running
        if const_expr(self._early_q_release):
            if t == walk.count - 1:  # the walk's last Q K^T is done
                pipe_q.consumer_release(q_state)
        if const_expr(not self.cfg.pin_pv_wait):
            pipe_k.consumer_release(state)
        self._scores(acc_s, coords, m_block, n_block, seqlen, mods, partial, masked)
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
    def _sees_first_tile(self, seqlen, walk, m_block, wg):
        """Whether this warpgroup's rows see any key of the walk's first tile (the rightmost of a
        dense walk); always, unless cfg.skip_masked_first. Its last row has the largest right
        limit (causal / window), so a tile starting at or past that limit is masked for every row."""
        if const_expr(not self.cfg.skip_masked_first):
            return True  # a Python constant: the branches on it are resolved at compile time
        last_row = cutlass.min(m_block * self.tile_m + (wg + 1) * 64, seqlen.seqlen_q) - 1
        first_key = walk.n_block(0) * self.tile_n
        return first_key < self._brange.right_limit(last_row, seqlen.seqlen_q, seqlen.seqlen_k)

    @cute.jit
    def _release_after_softmax(self, pipe_k, state, softmax):
        """Release the K slot once the softmax is done, as a data dependence ptxas can see: ptxas
        moves the P V wait (WARPGROUP.DEPBAR) freely among the softmax's arithmetic and put it
        right after the row max, so the exponentials no longer ran under the matmul. It does not
        move the wait above a memory operation such as this mbarrier arrive, so the arrive is
        predicated on the row sums (never negative, so always true; NaN compares false too): it
        cannot issue before the last exponential, and the wait follows it."""
        total = softmax.row_sum[0]
        for r in cutlass.range_constexpr(1, cute.size(softmax.row_sum)):
            total = total + softmax.row_sum[r]
        if not (total < Float32(0.0)):
            pipe_k.consumer_release(state)

    @cute.jit
    def consume(self, bidx, tidx):
        """A consumer warpgroup: its 64 rows of every work item of this CTA (tidx: the thread's index
        among the consumers)."""
        self._tidx = tidx  # (not set in kernel(): there it would be written under a run-time if)
        cfg, sched = self.cfg, self._sched
        sQ, sK, sVt = self._sQ, self._sK, self._sVt
        tiled_mma_qk, tiled_mma_pv = self._mmas
        wg = cute.arch.make_warp_uniform(self._tidx // 128)
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        self._wg_operands = (tSrQ, tSrK, tOrVt, wg)
        if const_expr(cfg.hand_descriptors):
            self._hand_descs = wgmma_desc.KeyLoopDescriptors(sQ, sK, sVt, wg, self.tile_n, self.hdim, self.dtype)
        if const_expr(self.pingpong):
            if wg == 0:  # the first warpgroup goes first
                cute.arch.barrier_arrive(barrier_id=BAR_SCHED, number_of_threads=256)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        # K and V are produced in the same number per item, so one ring position serves both
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages)
        tile = bidx
        if const_expr(cfg.dynamic_schedule):
            bar, slots, _ = self._mailbox
            i = Int32(0)
            tile = read_item(bar, slots, i)
            while tile < sched.num_tiles():
                q_state, state = self.consume_tile(tile, q_state, state)
                i += 1
                tile = read_item(bar, slots, i)
        elif const_expr(cfg.persistent):
            num_ctas = cute.arch.grid_dim()[0]
            rnd = Int32(0)
            while tile < sched.num_tiles():
                q_state, state = self.consume_tile(tile, q_state, state)
                rnd += 1
                tile = sched.persistent_tile(rnd, bidx, num_ctas)
        else:
            if tile < sched.num_tiles():
                self.consume_tile(tile, q_state, state)

    @cute.jit
    def consume_tile(self, tile, q_state, state):
        """Work item `tile`, unless it lies past its sequence's end; returns the Q and K/V ring
        positions after it."""
        wg = self._wg_operands[3]
        m_block, head, batch, piece = self._unit(tile)
        seqlen = self._seqlen(batch)
        if self._takes_part(m_block, seqlen):
            walk = self._kv_walk(seqlen, m_block, head, batch, piece)
            args = (seqlen, walk, m_block, head, batch, q_state)
            if const_expr(self.num_wg > 1):
                # A warpgroup whose 64 rows all lie past the sequence's end issues no matmul
                # (_idle_item; NOTES "Experiment 77"). The ring position after the item is computed
                # here, outside the branch: taken from the branch, the merged position made ptxas
                # build every wgmma descriptor of the persistent D256 key loops in per-thread
                # registers (NOTES "Experiment 103").
                after = state.clone()
                if walk.nonempty():
                    after.advance(Int32(walk.count))
                if m_block * self.tile_m + wg * 64 >= seqlen.seqlen_q:
                    self._idle_item(walk, q_state, state.clone())
                else:
                    self.consume_item(*args, state.clone(), tile)
                state = after
            else:
                state = self.consume_item(*args, state, tile)
            q_state.advance()
        return q_state, state

    @cute.jit
    def _idle_item(self, walk, q_state, state):
        """A work item for a warpgroup whose 64 rows all lie past the sequence's end (4096 = 21 x
        192 + 64 leaves two of three warpgroups idle in the last tile). It issues no matmul, so the
        tensor cores serve the other warpgroups, but stays in step with them: a turn at every
        matmul issue point of consume_item, every Q / K / V slot waited for and released once, and
        the barrier before O overwrites Q. Returns the K/V ring position after the item."""
        pipe_q, pipe_k, pipe_v = self._pipes
        wg = self._wg_operands[3]
        pipe_q.consumer_wait(q_state)
        if walk.nonempty():
            pipe_k.consumer_wait(state)  # the first key tile: S only
            self._turn_wait(wg)
            self._turn_pass(wg)
            pipe_k.consumer_release(state)
            v_state = state.clone()
            state.advance()
            for _ in cutlass.range(walk.count - 1, unroll=1):  # S of this tile, P V of the last
                pipe_k.consumer_wait(state)
                self._turn_wait(wg)
                pipe_v.consumer_wait(v_state)
                self._turn_pass(wg)
                pipe_k.consumer_release(state)
                pipe_v.consumer_release(v_state)
                v_state = state.clone()
                state.advance()
            pipe_v.consumer_wait(v_state)  # the last tile's P V
            self._turn_wait(wg)
            self._turn_pass(wg)
            pipe_v.consumer_release(v_state)
        if const_expr(not self.separate_o and not self.cfg.varlen_q):
            cute.arch.barrier(barrier_id=BAR_EPI_ALL, number_of_threads=128 * self.num_wg)
        pipe_q.consumer_release(q_state)
        return state

    @cute.jit
    def consume_item(self, seqlen: SeqlenInfo, walk, m_block, head, batch, q_state, state, tile):
        """One work unit: the online-softmax loop over the walk's key tiles, then the epilogue
        (for a piece of a split item: its state stored, and the epilogue only by the last piece,
        after merging the others'). Returns the K/V ring position after the unit."""
        cfg, brange, tidx = self.cfg, self._brange, self._tidx
        pipe_q, pipe_k, pipe_v = self._pipes
        tiled_mma_qk, tiled_mma_pv = self._mmas
        tSrQ, tSrK, tOrVt, wg = self._wg_operands
        softmax_scale_log2 = self._softmax_scale_log2
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
            mods = TileMods(self.score_graph, self.mask_graph, self._score_aux, self._mask_aux, batch, head,
                            seqlen.seqlen_q, seqlen.seqlen_k, softmax_scale_log2 * Float32(LN_2))
        if const_expr(self.score_graph is not None):
            softmax_scale_log2 = Float32(LOG2_E)  # score_mod's output is in natural units
        softmax = OnlineSoftmax(softmax_scale_log2, num_rows, cfg.rescale_threshold, max_chains=cfg.max_chains)
        row_scale = cute.make_rmem_tensor(num_rows, Float32)

        pipe_q.consumer_wait(q_state)

        if walk.nonempty():
            # first key tile of the walk (the rightmost without a block mask): S only
            acc_s = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
            pipe_k.consumer_wait(state)
            sees_first = self._sees_first_tile(seqlen, walk, m_block, wg)
            self._turn_wait(wg)
            if sees_first:
                # (the wait inside the branch too: a wgmma group left open across a branch makes
                # ptxas serialize the matmuls)
                wgmma.issue(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, state.index], True, -1)
                self._turn_pass(wg)
                warpgroup.wait_group(0)
            else:
                self._turn_pass(wg)
            pipe_k.consumer_release(state)
            if const_expr(self._early_q_release):
                if walk.count == 1:
                    pipe_q.consumer_release(q_state)
            if sees_first:
                self._scores(acc_s, coords, m_block, walk.n_block(0), seqlen, mods, self._is_partial(walk, 0))
                softmax.step(acc_s, row_scale)
                convert_pairs(a_operand(acc_s), tOrP)
            else:
                # what the softmax makes of a tile with every score masked: P = 0, the state
                # untouched; row_scale is read by the early O rescale before the next P V
                tOrP.fill(0.0)
                row_scale.fill(1.0)
            v_state = state.clone()
            state.advance()

            step = (acc_s, acc_o, tOrP, row_scale, coords, m_block, seqlen, mods, walk, q_state)
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
                for t in cutlass.range(r, l, unroll=1):
                    state, v_state, softmax = self._kv_step(t, False, state, v_state, softmax, *step)
                if const_expr(cfg.has_window):  # else l == count (masked_ends): no third loop to compile
                    for t in cutlass.range(l, walk.count, unroll=1):
                        state, v_state, softmax = self._kv_step(t, True, state, v_state, softmax, *step)

            if const_expr(cfg.early_o_rescale):
                # the last tile's factors, before its P V joins O
                scale_rows(acc_o, row_scale)
            pipe_v.consumer_wait(v_state)
            self._turn_wait(wg)
            wgmma.issue(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, v_state.index], False, -1)
            self._turn_pass(wg)
            warpgroup.wait_group(0)
            pipe_v.consumer_release(v_state)
        if const_expr(self.separate_o):
            if const_expr(self._early_q_release):
                if not walk.nonempty():  # (else released after the walk's last Q K^T)
                    pipe_q.consumer_release(q_state)
            else:
                pipe_q.consumer_release(q_state)  # every Q K^T of this item is done: next Q may load

        out_args = (acc_o, softmax, row_scale, num_rows, coords, seqlen, m_block, head, batch_q, wg)
        if const_expr(not cfg.split_ways):
            self.epilogue(*out_args)
        else:
            # taken again from the unit number rather than kept through the key loop
            piece, split_index = self._sched.piece(tile)
            writes_out = cutlass.Boolean(True)
            if piece >= 0:
                ws, counters, flags = self._split
                writes_out = split_tail.finish_piece(ws, counters, flags, piece, split_index, cfg.split_ways, wg,
                                                     self.num_wg, tidx % 128, acc_o, softmax.ref,
                                                     softmax.row_sum, BAR_EPI_WG + wg)
            if writes_out:
                self.epilogue(*out_args)
            else:
                if const_expr(not self.separate_o and not cfg.varlen_q):
                    # the epilogue's barrier of every consumer warpgroup (before O overwrites Q)
                    cute.arch.barrier(barrier_id=BAR_EPI_ALL, number_of_threads=128 * self.num_wg)
        if const_expr(not self.separate_o):
            # O was staged over Q's buffer: Q may load again once the O store has read it out
            pipe_q.consumer_release(q_state)
        return state

    @cute.jit
    def epilogue(self, acc_o, softmax, row_scale, num_rows, coords, seqlen: SeqlenInfo, m_block, head,
                 batch_q, wg):
        """O normalised by the row sums and written with the LSE."""
        lse = cute.make_rmem_tensor(num_rows, Float32)
        softmax.finalize(row_scale, lse)
        scale_rows(acc_o, row_scale)
        cfg, tidx = self.cfg, self._tidx
        mO, sO, sO_mn, tma_O, tiled_mma_pv = self._mO, self._sO, self._sO_mn, self._tma_O, self._mmas[1]
        # LSE: the lane holding column 0 of a row writes it
        c = rows_cols(coords)
        mLSE_cur = seqlen.q_rows(self._mLSE[None, head, batch_q])
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
                cute.arch.barrier(barrier_id=BAR_EPI_WG + wg, number_of_threads=128)
            else:
                # every consumer's Q reads are done before O overwrites Q's buffer
                cute.arch.barrier(barrier_id=BAR_EPI_ALL, number_of_threads=128 * self.num_wg)
            # stmatrix: one shared-memory address per 8x8 block of four (a per-element copy keeps
            # an address per store live and starves the wgmma pipeline of registers)
            stsm = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
            thr_stsm = cute.make_tiled_copy_C(stsm, tiled_mma_pv).get_slice(tidx)
            cute.copy(thr_stsm, thr_stsm.retile(r_o), thr_stsm.partition_D(sO_mn))
            cute.arch.fence_view_async_shared()  # generic-proxy writes -> TMA reads
            cute.arch.barrier(barrier_id=BAR_EPI_WG + wg, number_of_threads=128)
            if tidx % 128 < 32:
                gO = cute.local_tile(self._mO_tma[None, None, head, batch_q], (64, self.hdimv),
                                     (m_block * self.num_wg + wg, 0))
                tOsO, tOgO = cpasync.tma_partition(
                    tma_O, 0, cute.make_layout(1), cute.group_modes(sO[None, None, wg], 0, 2),
                    cute.group_modes(gO, 0, 2))
                cute.copy(tma_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            if const_expr(not self.separate_o):
                # the caller releases Q's buffer next: the store must have read it out
                cute.arch.barrier(barrier_id=BAR_EPI_WG + wg, number_of_threads=128)
        else:
            mO_cur = seqlen.q_rows(mO[None, None, head, batch_q])
            gO = cute.local_tile(mO_cur, (self.tile_m, self.hdimv), (m_block, 0))
            tOgO = thr_pv.partition_C(gO)
            tOcO = thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.hdimv)))
            limit = seqlen.seqlen_q - m_block * self.tile_m
            for i in cutlass.range_constexpr(cute.size(r_o)):
                if tOcO[i][0] < limit:
                    tOgO[i] = r_o[i]
