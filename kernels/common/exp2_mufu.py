"""2^x on the MUFU unit (`ex2.approx.ftz.f32`), as the forward's softmax has always emitted it.

CuTe DSL 4.8 deprecates `cute.arch.exp2` (the same instruction) in favour of
`cute.math.exp2(fastmath=True)`, which the backward uses. The forward keeps this exact form, an
asm statement marked as having side effects, so LLVM keeps the exponentials where the softmax
issues them and the forward's SASS stays the one it was measured on (changing it is a
performance experiment). ftz: subnormal results flush to zero (only the smallest probabilities).
"""

from typing import Optional

from cutlass import Float32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def exp2_mufu(x: Float32, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> Float32:
    res = llvm.inline_asm(
        T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )
    return Float32(res)
