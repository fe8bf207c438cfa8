"""Tensor-memory and tcgen05 MMA helpers shared by the sm100 forward and backward kernels.

TMEM is 128 lanes x 512 columns of 32 bits. The kernels address it through 32x32b tcgen05.ld/st
(thread i of a warpgroup: lane i, one row per thread) and accumulate into it with tcgen05.mma
issued by one thread; these helpers are the pieces both kernels use the same way.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import tcgen05

TMEM_COLUMNS = 512


@cute.jit
def setup_tmem(tmem_base, allocating_warp):
    """Every CTA thread, once the mbarriers are initialised: one warp (`allocating_warp` true
    on it) takes all TMEM_COLUMNS columns, then the barrier's fence, a CTA barrier, and the TMEM
    base address read back from shared memory `tmem_base` (returned)."""
    if allocating_warp:
        cute.arch.alloc_tmem(TMEM_COLUMNS, tmem_base)
        cute.arch.relinquish_tmem_alloc_permit()
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()  # barriers initialised and the TMEM address published
    return cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_base)


@cute.jit
def fence_before_sync():
    """Order this thread's earlier tcgen05 ops (ld/st) before the barrier arrive that follows."""
    cute.arch.inline_ptx("tcgen05.fence::before_thread_sync;")


@cute.jit
def fence_after_sync():
    """Order this thread's later tcgen05 ops (mma/ld/st) after the barrier wait that preceded."""
    cute.arch.inline_ptx("tcgen05.fence::after_thread_sync;")


def tmem_copy(op, repetition, tmem: cute.Tensor):
    """A 32x32b tcgen05.ld/st (thread i of a warpgroup: TMEM lane i) over the fp32 columns of tmem."""
    return tcgen05.make_tmem_copy(cute.make_copy_atom(op(repetition), Float32), tmem)


@cute.jit
def umma(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, accumulate):
    """acc (+)= A @ B over the K blocks; `accumulate` (may be dynamic) only affects the first.

    A local atom carries the accumulate flag, so no state leaks out of this call into the caller's
    loops (the tiled MMA object itself is never modified)."""
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(tcgen05.Field.ACCUMULATE, accumulate)
    for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
        atom.set(tcgen05.Field.ACCUMULATE, True)


@cute.jit
def setup_pair_tmem(tmem_base, allocating_warp):
    """setup_tmem for a cluster of two CTAs sharing their MMAs (tcgen05 cta_group::2): one warp
    in each CTA takes all TMEM_COLUMNS columns for the pair, and a cluster barrier (release /
    acquire) stands in for the CTA barrier, so each CTA's mbarriers are initialised before the
    other arrives on them (MMA commits, consumer releases, 2-SM TMA loads). Returns the TMEM base."""
    if allocating_warp:
        cute.arch.alloc_tmem(TMEM_COLUMNS, tmem_base, is_two_cta=True)
        cute.arch.relinquish_tmem_alloc_permit(is_two_cta=True)
    cute.arch.mbarrier_init_fence()
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
    return cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_base)


@cute.jit
def release_pair_tmem(tmem, allocating_warp):
    """Every thread of both CTAs, once done with tensor memory: a cluster barrier (neither CTA's
    columns, nor its mbarriers that the other arrives on, go away while the pair still works),
    then the allocating warps give the columns back."""
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
    if allocating_warp:
        cute.arch.dealloc_tmem(tmem, TMEM_COLUMNS, is_two_cta=True)
