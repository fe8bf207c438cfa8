"""The shared online softmax (kernels/common/online_softmax.py) with its per-score arithmetic on
Blackwell's packed fp32 pairs: FFMA2 / FADD2 / FMUL2 do two fp32 operations per instruction slot.

On sm_100 a thread of the softmax holds a whole score row, and the softmax warps are bound by
instruction throughput next to the tensor core: per score one scale-and-subtract, one
exponential, one add to the row sum, half a conversion. Pairing the scale (p = s * scale_log2 -
ref) and the row sum halves two of those four instructions per score. Same results as the
scalar path up to rounding: the scale is one fused multiply-add, and the row sum is kept as two
interleaved partial sums.

The exponentials on the FMA pipe (`emulate_every` = k) come in pairs here: both columns of every
k-th column pair, so still one exponential in k, each pair one packed polynomial
(`exp2_fma_pair`: kernels/common/exp2_emulation.py's arithmetic, constants and all, two lanes at a
time). A pair split between MUFU and the polynomial cost registers: the D=128 softmax spilled.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from torch_fa4.kernels.common.exp2_mufu import exp2_mufu
from torch_fa4.kernels.common.online_softmax import OnlineSoftmax


class PackedOnlineSoftmax(OnlineSoftmax):
    """OnlineSoftmax whose `_exp2_row` works on column pairs (rows of an even number of scores)."""

    @cute.jit
    def _exp2_row(self, s_row: cute.Tensor, ref_safe: Float32) -> Float32:
        """p = 2^(s * scale_log2 - ref) in place; returns the partial row sum."""
        n = cute.size(s_row)
        assert n % 2 == 0
        sums = (Float32(0.0), Float32(0.0))
        scale = (self.scale_log2, self.scale_log2)
        neg_ref = (-ref_safe, -ref_safe)
        for c in cutlass.range_constexpr(0, n, 2):
            x = cute.arch.fma_packed_f32x2((s_row[c], s_row[c + 1]), scale, neg_ref)
            k = self.emulate_every
            if const_expr(k > 0 and (c // 2) % k == k - 1):
                p = exp2_fma_pair(x)
            else:
                p = (exp2_mufu(x[0]), exp2_mufu(x[1]))
            s_row[c], s_row[c + 1] = p[0], p[1]
            sums = cute.arch.add_packed_f32x2(sums, p)
        return sums[0] + sums[1]


# exp2_emulation's constants (as fp32 hex there): the clamp, 1.5 * 2^23, and the polynomial
# 2^f ~= 1 + C1 f + C2 f^2 + C3 f^3 on [0, 1)
EXP2_CLAMP = -127.0
EXP2_MAGIC = 12582912.0
EXP2_C1, EXP2_C2, EXP2_C3 = 0.69511662, 0.2276457, 0.07706641

_SCALE_BY_EXPONENT = (
    "{\n"
    ".reg .b32 tb, pb;\n"
    "mov.b32 pb, {$r0};\n"
    "mov.b32 tb, {$r1};\n"
    "shl.b32 tb, tb, 23;\n"  # low bits of t are j; the 1.5*2^23 part shifts out
    "add.s32 pb, pb, tb;\n"  # p * 2^j through the exponent field
    "mov.b32 {$w0}, pb;\n"
    "}\n"
)


@cute.jit
def exp2_fma_pair(x):
    """(2^x0, 2^x1) on the FMA pipe: exp2_emulation.exp2_fma on a pair, its floating-point steps
    packed (FADD2 / FFMA2)."""
    magic = (Float32(EXP2_MAGIC), Float32(EXP2_MAGIC))
    xc = (cute.arch.fmax(x[0], Float32(EXP2_CLAMP)), cute.arch.fmax(x[1], Float32(EXP2_CLAMP)))
    t = cute.arch.add_packed_f32x2(xc, magic, rnd="rm")  # floor(xc) + 1.5*2^23
    j = cute.arch.sub_packed_f32x2(t, magic)
    f = cute.arch.sub_packed_f32x2(xc, j)
    c3, c2 = (Float32(EXP2_C3), Float32(EXP2_C3)), (Float32(EXP2_C2), Float32(EXP2_C2))
    p = cute.arch.fma_packed_f32x2(f, c3, c2)
    p = cute.arch.fma_packed_f32x2(p, f, (Float32(EXP2_C1), Float32(EXP2_C1)))
    p = cute.arch.fma_packed_f32x2(p, f, (Float32(1.0), Float32(1.0)))
    return tuple(cute.arch.inline_ptx(_SCALE_BY_EXPONENT, write_only_types=[Float32],
                                      read_only_args=[Float32(p[i]), Float32(t[i])]) for i in range(2))


@cute.jit
def scale_pairs(r: cute.Tensor, factor: Float32):
    """r *= factor on an even-sized fragment, two values per FMUL2."""
    for k in cutlass.range_constexpr(0, cute.size(r), 2):
        r[k], r[k + 1] = cute.arch.mul_packed_f32x2((r[k], r[k + 1]), (factor, factor))
