"""fp32 register fragments -> 16-bit float fragments, two elements per conversion instruction.

`tensor.load().to(BFloat16)` on a fragment read through a rearranged view (the S accumulator read
as the A operand of P @ V) lowers to one `cvt.rn.bf16.f32` per element, each into its own 16-bit
register, and a later `mov.b32 {lo, hi}` per pair. ptxas sinks those moves to the wgmma that reads
P, so between the softmax and the next key tile's P @ V the tile lives in twice the registers it
needs (one half-empty register per element: +32 registers for a 64 x 128 tile per warpgroup). One
`cvt.rn.bf16x2.f32` per adjacent pair writes the packed register directly. Same rounding (round to
nearest even, no saturation), so the same bits.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from torch_fa4.kernels.common import static_layout

@dsl_user_op
def cvt_pair(lo: Float32, hi: Float32, kind: str, *, loc: Optional[ir.Location] = None,
             ip: Optional[ir.InsertionPoint] = None) -> Int32:
    """(lo, hi) -> one 32-bit register holding both as 16-bit floats (kind: bf16 or f16), lo in
    the low half."""
    # PTX: the first source lands in the upper half. No side effects: ptxas may schedule it freely.
    res = llvm.inline_asm(
        T.i32(),
        [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}x2.f32 $0, $1, $2;", "=r,f,f", loc=loc, ip=ip,
    )
    return Int32(res)


def _is_compact(layout) -> bool:
    """Flat index i lives at offset i (registers in the order of the logical elements). Plain
    Python on the static layout: `layout(i)` emitted MLIR ops for each element (~570 per forward
    compile, for a trace-time check)."""
    index = static_layout.indexer(layout)
    return all(index(i) == i for i in range(cute.size(layout)))


@cute.jit
def convert_pairs(src: cute.Tensor, dst: cute.Tensor):
    """dst = src (fp32, any layout of dst's shape) in dst's 16-bit float type, by pairs of logical
    elements (2i, 2i+1). dst must be a compact register fragment (its pairs share a register)."""
    assert const_expr(_is_compact(dst.layout)), "destination fragment is not compact"
    assert const_expr(cute.size(dst) % 2 == 0)
    kind = {cutlass.BFloat16: "bf16", cutlass.Float16: "f16"}[dst.element_type]
    dst32 = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(dst) // 2):
        dst32[i] = cvt_pair(src[2 * i], src[2 * i + 1], kind)
