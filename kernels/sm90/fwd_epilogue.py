"""The sm90 forward's epilogue: O normalised, converted and stored (through shared memory and TMA,
or from registers with a row predicate for varlen), and the LSE."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from torch_fa4.kernels.common.acc_layout import rows_cols
from torch_fa4.kernels.common.online_softmax import scale_rows
from torch_fa4.kernels.common.seqlen_info import SeqlenInfo
from torch_fa4.kernels.sm90.fwd_consumer import BAR_EPI_ALL, BAR_EPI_WG


class FwdEpilogue:
    """Epilogue methods of FlashFwdSm90 (a mixin: they read its configuration)."""

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
