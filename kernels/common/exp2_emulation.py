"""2^x on the FMA pipe (FA4's trick), for x <= ~8 as softmax produces.

Hardware ex2 runs on the MUFU unit, 16 ops/clk/SM on Hopper against 128 FMAs/clk; at small head dims
the exponentials of a score tile take about as long as its matmuls. Computing a share of them with
FMAs moves that work onto an idle pipe. Cody-Waite range reduction:

    2^x = 2^j * 2^f,  j = floor(x),  f = x - j in [0, 1)

2^f is a degree-3 polynomial (relative error 8.6e-5, far below bf16's 3.9e-3 step, fitted by
iteratively reweighted least squares on [0, 1) with p(0) = 1), and 2^j is applied by adding j to
the exponent bits. floor() uses the 1.5 * 2^23 round-down trick, so no conversion unit is needed:
after `t = x + 1.5*2^23` rounded toward -inf, t's low mantissa bits hold j and `t - 1.5*2^23` is j.
x is clamped at -127 first, so -inf (masked scores) gives a tiny positive number, never NaN; the
caller treats rows whose max is -inf separately.
"""

from cutlass import Float32
import cutlass.cute as cute

# p(f) = 1 + C1 f + C2 f^2 + C3 f^3 ~= 2^f on [0, 1), C1, C2, C3 = 0.69511662, 0.2276457, 0.07706641

_PTX = (
    "{\n"
    ".reg .f32 xc, t, j, f, p;\n"
    ".reg .b32 tb, pb;\n"
    "max.f32 xc, {$r0}, 0fC2FE0000;\n"  # clamp at -127
    "add.rm.f32 t, xc, 0f4B400000;\n"  # t = floor(xc) + 1.5*2^23
    "sub.f32 j, t, 0f4B400000;\n"  # j = floor(xc), exact
    "sub.f32 f, xc, j;\n"  # f in [0, 1)
    "fma.rn.f32 p, f, 0f3D9DD4FE, 0f3E691BF4;\n"  # C3 f + C2
    "fma.rn.f32 p, p, f, 0f3F31F32A;\n"  # (..) f + C1
    "fma.rn.f32 p, p, f, 0f3F800000;\n"  # (..) f + 1
    "mov.b32 tb, t;\n"
    "mov.b32 pb, p;\n"
    "shl.b32 tb, tb, 23;\n"  # low bits of t are j; the 1.5*2^23 part shifts out
    "add.s32 pb, pb, tb;\n"  # scale by 2^j through the exponent field
    "mov.b32 {$w0}, pb;\n"
    "}\n"
)


@cute.jit
def exp2_fma(x: Float32) -> Float32:
    return cute.arch.inline_ptx(_PTX, write_only_types=[Float32], read_only_args=[Float32(x)])
