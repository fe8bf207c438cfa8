"""Vector stores of the sm100 backward that CuTe DSL's generic copies emit element by element:
a compute thread's 8 consecutive 16-bit values of its dS^T row into the swizzled shared-memory
tile (one 16-byte st.shared instead of eight 2-byte ones), and four consecutive fp32 dQ values
added into global memory by one red.global.add.v4.f32 (sm_90 and later) instead of four.
"""

from typing import Optional

from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

SWIZZLE_128B = "S<3,4,3>"  # the byte-address swizzle of 128-byte rows (the dS^T tile's)


def swizzle_128b(byte_offset: Int32) -> Int32:
    """Swizzle<3, 4, 3> on a byte offset from a 1024-byte aligned base: the 16-byte chunk index
    (bits 4-6) XOR the row index within 8 rows of 128 bytes (bits 7-9). Chunks stay whole, so 16
    aligned bytes stay contiguous."""
    return byte_offset ^ ((byte_offset >> 3) & 0x70)


@dsl_user_op
def st_shared_v4(addr: Int32, a: Int32, b: Int32, c: Int32, d: Int32, *, loc: Optional[ir.Location] = None,
                 ip: Optional[ir.InsertionPoint] = None) -> None:
    """16 bytes (four 32-bit registers) to a 16-byte aligned shared-memory address."""
    llvm.inline_asm(
        None,
        [Int32(x).ir_value(loc=loc, ip=ip) for x in (addr, a, b, c, d)],
        "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r",
        has_side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def red_add_f32x4(addr: Int64, a: Float32, b: Float32, c: Float32, d: Float32, *,
                  loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> None:
    """Four fp32 values added to a 16-byte aligned global address (relaxed, no result)."""
    llvm.inline_asm(
        None,
        [Int64(addr).ir_value(loc=loc, ip=ip)] + [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f",
        has_side_effects=True, loc=loc, ip=ip,
    )
