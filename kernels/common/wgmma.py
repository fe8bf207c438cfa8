"""One warpgroup matrix multiply on Hopper, issued as one committed wgmma group (shared by the sm90
forward and backward)."""

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import warpgroup


@cute.jit
def issue(tiled_mma, acc, a_frag, b_frag, zero_init: cutlass.Constexpr[bool], wait: cutlass.Constexpr[int] = -1):
    """acc (+)= A @ B over the K blocks of the fragments, as one committed wgmma group.

    wait >= 0 waits until at most `wait` groups are in flight; -1 returns with it in flight."""
    warpgroup.fence()
    # A fresh atom per call: its ACCUMULATE field is mutated below.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(a_frag.shape[2])):
        cute.gemm(atom, acc, a_frag[None, None, k], b_frag[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait >= 0):
        warpgroup.wait_group(wait)
