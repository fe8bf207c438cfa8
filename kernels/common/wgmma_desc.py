"""Hopper wgmma issued from shared-memory descriptors the kernel builds itself.

`wgmma.issue` (cute.gemm) lowers each operand's descriptor from the fragment's shared-memory
address at every matmul; in the D64 forward key loop that is ~30 uniform instructions per key
tile, placed by ptxas between the warpgroup taking its turn and its first HGMMA (NOTES "Experiment
155"). Here the caller builds a 64-bit descriptor once per CTA for each operand's stage 0, k-block
0; a ring stage is then one add into the address field, formed before the turn is taken, and a
k-block one 64-bit add at the issue.

Descriptor format (PTX ISA, "Matrix Descriptor Format" for wgmma): bits 0-13 the start address
>> 4, bits 16-29 the leading-dimension byte offset >> 4, bits 32-45 the stride-dimension byte
offset >> 4, bits 62-63 the swizzle mode (1: 128-byte swizzle). Only the layout this module is
used with is encoded: 16-bit elements, 128-byte rows (64 elements) in a 128-byte swizzle, so the
8-row core-matrix groups are 1024 bytes apart and the leading offset is unused. That holds for
K-major Q and K tiles of head dim 64 and for the MN-major V tile of value dim 64 (one swizzle
atom wide): `check_layouts` asserts it for each operand at trace time.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import warpgroup

ROW_BYTES = 128  # one swizzle row: 64 16-bit elements
GROUP_BYTES = 8 * ROW_BYTES  # 8-row core-matrix groups (the stride-dimension offset)
# upper word: stride offset 1024 >> 4 in bits 32-45, 128-byte swizzle (1) in bits 62-63
_UPPER = (GROUP_BYTES >> 4) | (1 << 30)
K_MAJOR_KBLOCK = 32 >> 4  # next 16 elements along a K-major row: 32 bytes further
MN_MAJOR_KBLOCK = (16 * ROW_BYTES) >> 4  # next 16 rows of an MN-major tile: 2 KB further


def check_layouts(elem_bits: int, tile_n: int, *staged_layouts):
    """Trace-time check that each shared-memory layout (rows, 64[, stages]) is the one the
    descriptors here encode: 16-bit elements, 128-byte rows, 128-byte swizzle (Swizzle<3,4,3> on
    16-byte units), 8-row groups 1024 bytes apart, ring stages whole tiles of tile_n rows."""
    assert elem_bits == 16, "hand-built descriptors: 16-bit operands only"
    for layout in staged_layouts:
        assert str(layout.inner) == "S<3,4,3>", f"hand-built descriptors: 128-byte swizzle only, not {layout.inner}"
        outer = layout.outer
        two = cute.select(outer, mode=[0, 1])
        assert cute.size(outer, mode=[1]) * elem_bits // 8 == ROW_BYTES, "hand-built descriptors: 128-byte rows only"
        assert cute.crd2idx((8, 0), two) * elem_bits // 8 == GROUP_BYTES
        assert cute.crd2idx((0, 8), two) * elem_bits // 8 == 16, "rows must be K-contiguous"
        if cute.rank(outer) == 3:
            assert cute.crd2idx((0, 0, 1), outer) * elem_bits // 8 == tile_n * ROW_BYTES


def descriptor(addr: Int32) -> Int64:
    """The descriptor of a 128-byte-swizzled tile at shared-memory byte address `addr` (1024-byte
    aligned), as an opaque value: LLVM would otherwise sink its arithmetic back to every use (the
    key loop, after the turn barrier)."""
    lo = Int64(cutlass.Uint32((Int32(addr) >> 4) & 0x3FFF))
    return _opaque(lo | (Int64(_UPPER) << 32))


@dsl_user_op
def _opaque(x: Int64, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> Int64:
    res = llvm.inline_asm(T.i64(), [Int64(x).ir_value(loc=loc, ip=ip)], "mov.b64 $0, $1;", "=l,l",
                          has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                          loc=loc, ip=ip)
    return Int64(res)


@dsl_user_op
def _mma_asm(acc_vals: list, head: str, a_ops: list, a_constraints: str, desc_b: Int64, accumulate: bool, tail: str,
             *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None) -> list:
    n, b = len(acc_vals), len(acc_vals) + len(a_ops)  # operands: accumulators, A, B's descriptor, scale-d
    outs = ", ".join(f"${i}" for i in range(n))
    a_refs = ", ".join(f"${i}" for i in range(n, b))
    if len(a_ops) > 1:
        a_refs = "{" + a_refs + "}"
    asm = ("{\n.reg .pred p;\n"
           f"setp.ne.b32 p, ${b + 1}, 0;\n"
           f"{head} {{{outs}}}, {a_refs}, ${b}, p, {tail};\n}}\n")
    constraints = ",".join(["=f"] * n) + "," + a_constraints + ",l,r," + ",".join(str(i) for i in range(n))
    operands = [x.ir_value(loc=loc, ip=ip) for x in a_ops] + [Int64(desc_b).ir_value(loc=loc, ip=ip),
                                                             Int32(1 if accumulate else 0).ir_value(loc=loc, ip=ip)]
    operands += [Float32(v).ir_value(loc=loc, ip=ip) for v in acc_vals]
    struct = llvm.StructType.get_literal([T.f32()] * n)
    res = llvm.inline_asm(struct, operands, asm, constraints, has_side_effects=True, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n)]


def _mma(acc: cute.Tensor, n: int, ab: str, a_ops: list, a_constraints: str, desc_b: Int64, accumulate: bool,
         tail: str):
    head = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab}"
    vals = [acc[i] for i in range(cute.size(acc))]
    for i, v in enumerate(_mma_asm(vals, head, a_ops, a_constraints, desc_b, accumulate, tail)):
        acc[i] = v


def mma_ss(acc: cute.Tensor, desc_a: Int64, desc_b: Int64, n: int, ab: str, accumulate: bool):
    """acc (+)= A B for one k16 block, A and B K-major in shared memory (S = Q K^T)."""
    _mma(acc, n, ab, [Int64(desc_a)], "l", desc_b, accumulate, "1, 1, 0, 0")


def mma_rs(acc: cute.Tensor, a_regs: cute.Tensor, desc_b: Int64, n: int, ab: str):
    """acc += A B for one k16 block, A the four 32-bit registers of a 16-bit fragment, B MN-major
    (transposed) in shared memory (O += P V)."""
    _mma(acc, n, ab, [Int32(a_regs[i]) for i in range(4)], "r,r,r,r", desc_b, True, "1, 1, 1")


class KeyLoopDescriptors:
    """The forward key loop's operands as descriptors: Q (this warpgroup's 64 rows) fixed, K and V
    one per ring stage. Built once per CTA by a consumer warpgroup; `stage` forms a key step's K
    and V descriptors, `qk` and `pv` issue its two matmuls as committed wgmma groups."""

    def __init__(self, sQ: cute.Tensor, sK: cute.Tensor, sVt: cute.Tensor, wg, tile_n: int, hdim: int, dtype):
        # (operand width, rows and swizzle: check_layouts, run on the kernel's host side first)
        self.ab = {cutlass.BFloat16: "bf16", cutlass.Float16: "f16"}[dtype]
        self.tile_n, self.hdim, self.hdimv = tile_n, hdim, cute.size(sVt, mode=[0])
        self.stage_units = tile_n * ROW_BYTES >> 4  # a ring stage in descriptor units (16 bytes)
        self.q = descriptor(Int32(sQ.iterator.toint()) + wg * (64 * ROW_BYTES))
        self.k0 = descriptor(Int32(sK.iterator.toint()))
        self.v0 = descriptor(Int32(sVt.iterator.toint()))

    def stage(self, k_index, v_index):
        """A key step's K and V descriptors (k-block 0). The k-blocks' adds are left to the issue:
        formed here too, ptxas split them into 32-bit adds with carries and moved V's descriptor
        to per-thread registers (more instructions per key step)."""
        # (stage offsets stay inside the 14-bit address field: no carry into the upper word)
        return (self.k0 + Int64(cutlass.Uint32(k_index * self.stage_units)),
                self.v0 + Int64(cutlass.Uint32(v_index * self.stage_units)))

    def qk(self, acc_s: cute.Tensor, k_desc: Int64):
        """S = Q K^T (one committed group, left in flight)."""
        warpgroup.fence()
        for k in range(self.hdim // 16):
            mma_ss(acc_s, self.q + K_MAJOR_KBLOCK * k, k_desc + K_MAJOR_KBLOCK * k, self.tile_n, self.ab, k > 0)
        warpgroup.commit_group()

    def pv(self, acc_o: cute.Tensor, tOrP: cute.Tensor, v_desc: Int64):
        """O += P V (one committed group, left in flight)."""
        p_regs = cute.recast_tensor(tOrP, Int32)
        warpgroup.fence()
        for k in range(self.tile_n // 16):
            mma_rs(acc_o, p_regs[None, 0, k], v_desc + MN_MAJOR_KBLOCK * k, self.hdimv, self.ab)
        warpgroup.commit_group()
