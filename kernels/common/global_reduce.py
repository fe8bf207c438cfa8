"""Vector reductions into global memory: two fp32 values added with one instruction.

`red.global.add.v2.f32` (sm_90, PTX 8.1) adds an aligned pair of floats in L2 without returning
the old values; CuTe DSL's `cute.arch.red` takes scalars, so this wraps the vector form in inline
PTX. Used where per-thread atomics replace a shared-memory staging + TMA reduction.
"""

from typing import Optional

from cutlass import Float32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def red_add_v2_f32(address: Int64, a: Float32, b: Float32, *, loc: Optional[ir.Location] = None,
                   ip: Optional[ir.InsertionPoint] = None) -> None:
    """*address += a, *(address + 4) += b (global memory, 8-byte aligned), relaxed, GPU scope."""
    llvm.inline_asm(
        None,
        [Int64(address).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip),
         Float32(b).ir_value(loc=loc, ip=ip)],
        "red.global.add.v2.f32 [$0], {$1, $2};",
        "l,f,f",
        has_side_effects=True,
        loc=loc,
        ip=ip,
    )
