"""A batch of tcgen05 MMAs from one elected thread: the MMA warps' low-overhead form of `tmem.umma`.

`cute.gemm` on a tcgen05 atom opens its own `elect.sync` region per K block and moves each K
block's 64-bit shared-memory descriptor into uniform registers on its own, so an MMA costs a
dozen or more instructions around it. `umma_batch` emits all the MMAs of one batch (one or several
matmuls, each over its K blocks) as one PTX block: one `elect.sync`, then every
`tcgen05.mma` predicated on the elected lane, each descriptor advanced from its first K block's
value by a constant.

The MMAs are the ones `tmem.umma` makes, operand for operand:

- Shared-memory descriptors: the first K block's 64-bit value is the DSL's own (the fragment's
  iterator, `make_fragment_A/B` of the same tiled MMA); K block k adds the fragment layout's
  static offset of (0, 0, k), in the descriptor's 16-byte units, with a 64-bit add: the same
  arithmetic `cute.gemm` emits for the K-block slices of a descriptor fragment.
- A in tensor memory: the fragment's TMEM address plus the layout offset of K block k converted
  from elements to 32-bit columns, as the DSL's TMEM pointer arithmetic does.
- Instruction descriptor: `instr_desc`, the PTX ISA's tcgen05 kind::f16 layout filled from the
  MMA op (formats, majors, M, N); kind::f16 only (every MMA of these kernels).
- Accumulate: the batch entry's flag (static or dynamic) on the first K block, on for the rest.
- Same `.collector::a::discard` qualifier and all-zero disable-output-lane mask (4 words per CTA
  of the group) as the DSL emits.
- Order: the entries' K blocks in list order, all from the warp's lowest lane (`elect.sync` with a
  full mask picks the same lane as each of the DSL's per-MMA elections and as the commits'
  `elect_one`, so the commits that follow still track every MMA of the batch).

Called by all 32 lanes of the MMA warp together (warp-uniform control flow), like `cute.gemm`.

What it saves depends on ptxas. With CUDA 12's, `cute.gemm` per K block costs an ELECT and a
descriptor rebuild (R2UR / UMOV) per MMA, and a batch about halves the one-CTA backward's MMA
loop. CUDA 13's already merges the elections and keeps the bases uniform: there a batch is
neutral for one-CTA MMAs, but for cta_group::2 MMAs it hoists every K block's descriptor into
vector registers (longer loop, spills), so the CTA-pair kernels keep `cute.gemm`.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import tcgen05

# tcgen05 instruction descriptor (kind::f16), PTX ISA "Instruction descriptor": bit offsets
_C_FORMAT, _A_FORMAT, _B_FORMAT, _A_MAJOR, _B_MAJOR, _N_DIM, _M_DIM = 4, 7, 10, 15, 16, 17, 24
_F16_FORMATS = {cutlass.Float16: 0, cutlass.BFloat16: 1}
_ACC_FORMATS = {cutlass.Float16: 0, cutlass.Float32: 1}


def instr_desc(op) -> int:
    """The 32-bit instruction descriptor of a kind::f16 tcgen05 MMA op (dense, no negation, no
    saturation, no shift)."""
    assert isinstance(op, tcgen05.MmaF16BF16Op), f"kind::f16 ops only, got {type(op).__name__}"
    assert op.a_dtype in _F16_FORMATS and op.b_dtype in _F16_FORMATS and op.acc_dtype in _ACC_FORMATS
    m, n = op.shape_mnk[0], op.shape_mnk[1]
    mn_major = cute.nvgpu.OperandMajorMode.MN.value
    return ((_ACC_FORMATS[op.acc_dtype] << _C_FORMAT) | (_F16_FORMATS[op.a_dtype] << _A_FORMAT)
            | (_F16_FORMATS[op.b_dtype] << _B_FORMAT)
            | (int(op.a_major_mode.value == mn_major) << _A_MAJOR)
            | (int(op.b_major_mode.value == mn_major) << _B_MAJOR)
            | ((n >> 3) << _N_DIM) | ((m >> 4) << _M_DIM))


@dataclass
class Umma:
    """One matmul of a batch: acc (+)= A @ B over the K blocks of the fragments `a` / `b` (as
    `tmem.umma` takes them); `accumulate` (static or dynamic) applies to the first K block."""
    tiled_mma: Any
    acc: Any
    a: Any
    b: Any
    accumulate: Any


def _k_offsets(frag, units) -> list:
    """Static offsets of the fragment's K blocks (mode 2) from block 0, in `units` of its layout's
    elements (1: descriptor units as they are)."""
    offsets = []
    for k in range(cute.size(frag, mode=[2])):
        off = cute.crd2idx((0, 0, k), frag.layout)
        assert isinstance(off, int), "K-block offsets must be static"
        assert off * units[0] % units[1] == 0, "a K block starting inside a TMEM column"
        offsets.append(off * units[0] // units[1])
    return offsets


def _desc(frag):
    """The DSL's 64-bit descriptor of the fragment's first K block."""
    return tcgen05.smem_descriptor_to_int(frag.iterator)


def umma_batch(batch: list) -> None:
    """Emit every K block of every `Umma` in `batch`, in order, from one elected lane."""
    args, lines = [], []

    def arg(value) -> str:
        args.append(value)
        return f"{{$r{len(args) - 1}}}"

    decls = [".reg .pred leader, first;", ".reg .b32 zero, idesc, tmem_a;", ".reg .b64 da, db;"]
    lines.append("elect.sync _|leader, -1;")
    lines.append("mov.b32 zero, 0;")
    for mma in batch:
        op = mma.tiled_mma.op
        group = {tcgen05.CtaGroup.ONE: 1, tcgen05.CtaGroup.TWO: 2}[op.cta_group]
        mask = ", ".join(["zero"] * 4 * group)  # disable-output-lane: one word per 32 lanes per CTA
        a_in_tmem = op.a_src == tcgen05.OperandSource.TMEM
        acc_addr = arg(Int32(mma.acc.iterator.toint()))
        b_desc = arg(_desc(mma.b))
        b_offsets = _k_offsets(mma.b, (1, 1))
        if a_in_tmem:
            a_addr = arg(Int32(mma.a.iterator.toint()))
            a_offsets = _k_offsets(mma.a, (op.a_dtype.width, 32))
        else:
            a_desc = arg(_desc(mma.a))
            a_offsets = _k_offsets(mma.a, (1, 1))
        assert len(a_offsets) == len(b_offsets)
        assert all(off >= 0 for off in a_offsets + b_offsets)
        if isinstance(mma.accumulate, bool):
            first = "1" if mma.accumulate else "0"
        else:
            lines.append(f"setp.ne.b32 first, {arg(Int32(mma.accumulate))}, 0;")
            first = "first"
        lines.append(f"mov.b32 idesc, {instr_desc(op)};")
        for k, (a_off, b_off) in enumerate(zip(a_offsets, b_offsets)):
            lines.append(f"add.s64 db, {b_desc}, {b_off};")
            if a_in_tmem:
                lines.append(f"add.u32 tmem_a, {a_addr}, {a_off};")
                a_operand = "[tmem_a]"
            else:
                lines.append(f"add.s64 da, {a_desc}, {a_off};")
                a_operand = "da"
            lines.append(f"@leader tcgen05.mma.cta_group::{group}.kind::f16.collector::a::discard "
                         f"[{acc_addr}], {a_operand}, db, idesc, {{{mask}}}, "
                         f"{first if k == 0 else '1'};")
    cute.arch.inline_ptx("{\n" + "\n".join(decls + lines) + "\n}", read_only_args=args)
