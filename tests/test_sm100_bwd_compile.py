"""CPU: the sm100 backward's variants compile for sm_100a, and their SASS is a Blackwell kernel.

There is no Blackwell GPU in this project, so this is the sm100 backward's verification (as
tests/test_sm100_fwd_compile.py is the forward's). Per variant: the five matmuls of a step became
tcgen05 UMMAs (`UTCHMMA`, exactly as many as the kernel issues: S^T and dP^T over the head dim,
dV, dK and dQ over 128 queries / keys), S^T, dP^T, dQ, dK and dV move through tensor memory
(`LDTM`, P^T back with `STTM`), Q / dO / K / V arrive by TMA (`UTMALDG`), dQ leaves by fp32
atomics (a RED of four columns each), dS^T by 16-byte shared-memory stores, nothing spills to
local memory, and the tiles fit tensor memory (512 columns) and shared memory (227 KB: the
kernel asserts its whole shared storage while compiling); mod variants spill at most a few per-step
scalars. One compile per variant (a few seconds to tens of seconds each): VARIANTS and
MOD_VARIANTS are a representative set of the supported feature combinations (each feature at least
once, each head dim at least twice), about two minutes in all.

The kernel reads Q, dO, K and the dS^T tile both K-major and MN-major from one shared-memory
buffer each; `test_transposed_operand_views_are_the_same_bytes` checks, element by element, that
the two canonical layouts agree.
"""

import math
import re
from dataclasses import replace

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from sass import sass_of  # noqa: E402
from test_sm90_fwd_compile import _alibi, _bias_table, _doc_mask, _mod_call  # noqa: E402
from torch_fa4.call import AttentionCall  # noqa: E402


def _call(D=128, dtype=torch.bfloat16, H=2, Hkv=2, S=256, varlen=False, seqused=False, Dv=None, **kw):
    Dv = Dv or D
    if varlen:
        q = torch.empty(S, H, D, dtype=dtype)
        k = torch.empty(S, Hkv, D, dtype=dtype)
        v = torch.empty(S, Hkv, Dv, dtype=dtype)
        cu = torch.tensor([0, S // 3, S], dtype=torch.int32)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S, max_seqlen_k=S)
    else:
        q = torch.empty(1, S, H, D, dtype=dtype)  # shapes are symbolic in the kernel: any will do
        k = torch.empty(1, S, Hkv, D, dtype=dtype)
        v = torch.empty(1, S, Hkv, Dv, dtype=dtype)
    if seqused:
        kw["seqused_k"] = torch.tensor([S // 2], dtype=torch.int32)
    return AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, **kw)


# name -> (call arguments, deterministic)
VARIANTS = {
    "d128": (dict(D=128), False),
    "d128_causal": (dict(D=128, causal=True), False),
    "d64_gqa_key_tail": (dict(D=64, H=8, Hkv=2, S=300), False),
    "d96_window": (dict(D=96, window_left=100, window_right=30), False),
    "d128_fp16_softcap_causal": (dict(D=128, dtype=torch.float16, softcap=15.0, causal=True), False),
    "d64_varlen_causal": (dict(D=64, varlen=True, causal=True), False),
    "d96_seqused_gqa": (dict(D=96, H=4, Hkv=1, seqused=True), False),
    "d128_deterministic_causal_gqa": (dict(D=128, H=4, Hkv=2, causal=True), True),
    "d64_varlen_window_deterministic": (dict(D=64, varlen=True, window_left=64, window_right=0), True),
    "d128_dv64_causal": (dict(D=128, Dv=64, causal=True), False),
}


# name -> builder of an AttentionCall with mods (traced on CPU: only the captured tensors' dtypes and
# ranks matter), and whether the block mask must drive the walk
MOD_VARIANTS = {
    "d128_alibi_softcap_causal": (
        lambda: _mod_call(128, score_mod=_alibi(), softcap=20.0, causal=True), False),
    "d64_bias_table_causal": (lambda: _mod_call(64, score_mod=_bias_table(), causal=True), False),
    "d128_document_mask": (lambda: _mod_call(128, mask_mod=_doc_mask()), False),
    "d128_document_block_mask": (lambda: _mod_call(128, mask_mod=_doc_mask(), block_size=128), True),
    # 256-row blocks: two query steps per block-mask row
    "d96_alibi_document_block_mask_256": (
        lambda: _mod_call(96, score_mod=_alibi(), mask_mod=_doc_mask(), block_size=(256, 128)), True),
}


# instructions per UMMA in the MMA warp's step loop: ~4.7 (CUDA 13's ptxas) to ~5.8 (CUDA 12's);
# one `cute.gemm` per K block costs ~10 with CUDA 12's (an elected region and a descriptor rebuild
# each)
MMA_LOOP_PER_UMMA = 6.5


def mma_loop(sass: str) -> tuple:
    """(UMMAs, instructions) of the loop (a backward branch's body) holding the most UMMAs."""
    lines = sass.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        if m := re.match(r"^\.(L_x_\d+):", line.strip()):
            labels[m.group(1)] = i
    best = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = [x for x in lines[labels[m.group(1)]: i + 1] if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", x)]
            umma = sum("UTCHMMA" in x for x in body)
            if umma > best[0]:
                best = (umma, len(body))
    return best


def _expected_umma(cfg) -> int:
    """S^T = K Q^T (D/16 k-blocks), dP^T = V dO^T (Dv/16), dV, dK over 128 queries and dQ over 128
    keys (8 k-blocks each): one call site each (bwd_kernel.mma_role)."""
    return cfg.head_dim // 16 + cfg.head_dim_v // 16 + 3 * 128 // 16


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_compiles_to_umma(name, tmp_path):
    call_kw, deterministic = VARIANTS[name]
    _compile_and_check_sass(_call(**call_kw), deterministic, tmp_path)


@pytest.mark.parametrize("name", list(MOD_VARIANTS))
def test_mod_variant_compiles_to_umma(name, tmp_path):
    build, sparse = MOD_VARIANTS[name]
    call = build()
    cfg = _compile_and_check_sass(call, False, tmp_path)
    assert cfg.mods_key == call.mod_key and (cfg.sparse is not None) == sparse


def _compile_and_check_sass(call, deterministic, tmp_path):
    from torch_fa4.kernels.sm100 import bwd
    from torch_fa4.kernels.sm100.bwd_config import Sm100BwdLayout
    from torch_fa4.kernels.sm100.tmem import TMEM_COLUMNS

    assert bwd.unsupported_reason(call) is None, "the test compiles only advertised variants"
    cfg = bwd.variant_key(call, deterministic)
    assert Sm100BwdLayout.of(cfg).tmem_columns <= TMEM_COLUMNS
    bwd.compile_variant(cfg, arch="sm_100a", dump_dir=str(tmp_path))  # bypasses the cache
    sass = sass_of(tmp_path, "*.sm_100a.cubin")
    assert sass.count("UTCHMMA") == _expected_umma(cfg), "matmuls did not all become tcgen05 UMMAs"
    assert "HGMMA" not in sass
    # the MMA warp's step loop holds every UMMA, a few instructions each around them (one elected
    # region per batch, descriptors advanced by constants: kernels/sm100/umma_batch.py)
    loop_umma, loop_length = mma_loop(sass)
    assert loop_umma == _expected_umma(cfg)
    assert loop_length <= MMA_LOOP_PER_UMMA * loop_umma, f"MMA loop: {loop_length} instructions"
    # S^T and dP^T chunks, dQ, dK, dV chunks out of TMEM; P^T back in
    assert sass.count("LDTM") == 2 + cfg.head_dim // 32 + cfg.head_dim // 32 + cfg.head_dim_v // 32
    assert "STTM" in sass, "P^T does not go back to tensor memory"
    assert "UTMALDG" in sass, "no TMA loads"
    # a few per-step scalars of the mod variants are spilled before the warp-role split and reloaded
    # once per step (ALiBi + document block mask: 12); a spilled score chunk would be hundreds
    spills = sass.count("LDL") + sass.count("STL")
    assert spills <= (16 if cfg.mods_key else 0), f"{spills} local-memory spill instructions"
    # the thread's dQ row added four fp32 columns per RED; the semaphore's atomics in
    # deterministic mode only
    assert sass.count("REDG.E.ADD.F32x4") == cfg.head_dim // 4
    assert "ATOMG.E.ADD.F32" not in sass
    assert ("ATOMG.E.ADD.STRONG.GPU" in sass) == deterministic
    # dS^T reaches shared memory in 16-byte stores: 4 per 32-query chunk
    assert sass.count("STS.128") == 4
    exps = sass.count("MUFU.EX2")
    # one per query of a 32-query chunk, once or per mask path (CUDA 13's ptxas may share one)
    assert 32 <= exps <= 64, f"{exps} exp2: more than one per query and mask path"
    assert ("MUFU.TANH" in sass) == cfg.softcap
    # registers rebalanced between the warp roles with mods only (bwd_kernel: `rebalance`)
    assert sass.count("USETMAXREG") == (3 if cfg.mods_key else 0)
    if cfg.mods_key:
        assert "LDG" in sass, "captured tensors / block-mask lists not read"
    return cfg


@pytest.mark.parametrize("D", [64, 96, 128])
def test_transposed_operand_views_are_the_same_bytes(D, monkeypatch):
    """Each 16-bit operand buffer is loaded through one layout and read through its transpose: the
    K-major layout of a (rows, cols) tile and the MN-major layout of the (cols, rows) tile must be
    the same map from (row, col) to shared-memory offsets, with the same swizzle."""
    from cutlass.cute.nvgpu.tcgen05 import mma as tcgen05_mma

    # the tcgen05 MMA atoms below are built outside a compile: they ask the DSL for its target
    dsl = tcgen05_mma.BaseDSL._get_dsl()
    monkeypatch.setattr(dsl, "get_arch_enum", lambda: tcgen05_mma.base_dsl.Arch.sm_100a)
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode as Major
    from cutlass.cute.nvgpu import tcgen05

    def offset(shape, stride, coord):
        """A static (possibly nested) layout mode evaluated at a flat colexicographic index."""
        if isinstance(shape, int):
            return coord * stride
        total = 0
        for s, d in zip(shape, stride):
            size = math.prod(_flat(s))
            total += offset(s, d, coord % size)
            coord //= size
        return total

    def at(layout, mn, k, stage=0):
        """Offset of element (mn, k) of an MMA-partitioned operand layout ((MN, 16), 1, k-blocks,
        stages)."""
        shape, stride = layout.shape, layout.stride
        mn_mode = (shape[0][0], stride[0][0])
        k_mode = (shape[0][1], stride[0][1])
        return (offset(*mn_mode, mn) + offset(*k_mode, k % 16) + offset(shape[2], stride[2], k // 16)
                + offset(shape[3], stride[3], stage))

    results = {}

    @cute.jit
    def build():
        one = tcgen05.CtaGroup.ONE
        make = sm100_utils.make_trivial_tiled_mma
        sdp = make(BFloat16, BFloat16, Major.K, Major.K, Float32, one, (128, 128))
        dv = make(BFloat16, BFloat16, Major.K, Major.MN, Float32, one, (128, D), tcgen05.OperandSource.TMEM)
        dk = make(BFloat16, BFloat16, Major.K, Major.MN, Float32, one, (128, D))
        dq = make(BFloat16, BFloat16, Major.MN, Major.MN, Float32, one, (128, D))
        a, b = sm100_utils.make_smem_layout_a, sm100_utils.make_smem_layout_b
        # (K-major as loaded, MN-major as transposed, rows, cols) per buffer, as bwd_kernel builds them
        pairs = {
            "K": (a(sdp, (128, 128, D), BFloat16, 1), b(dq, (128, D, 128), BFloat16, 1), 128, D),
            "Q": (b(sdp, (128, 128, D), BFloat16, 2), b(dk, (128, D, 128), BFloat16, 2), 128, D),
            "dO": (b(sdp, (128, 128, D), BFloat16, 2), b(dv, (128, D, 128), BFloat16, 2), 128, D),
            "dS": (a(dk, (128, D, 128), BFloat16, 1), a(dq, (128, D, 128), BFloat16, 1), 128, 128),
        }
        for name, (k_major, mn_major, rows, cols) in pairs.items():  # (static layouts: plain ints)
            results[name] = (str(k_major.inner), str(mn_major.inner), _static(k_major.outer),
                             _static(mn_major.outer), rows, cols)

    build()
    assert set(results) == {"K", "Q", "dO", "dS"}
    for name, (swizzle_k, swizzle_mn, outer_k, outer_mn, rows, cols) in results.items():
        assert swizzle_k == swizzle_mn, (name, swizzle_k, swizzle_mn)
        stages = outer_k.shape[3]
        for stage in range(stages):
            for r in range(rows):
                for c in range(cols):
                    assert at(outer_k, r, c, stage) == at(outer_mn, c, r, stage), (name, r, c, stage)


class _StaticLayout:
    def __init__(self, shape, stride):
        self.shape, self.stride = shape, stride


def _static(layout) -> _StaticLayout:
    def plain(x):
        return int(x) if not isinstance(x, tuple) else tuple(plain(y) for y in x)

    return _StaticLayout(plain(layout.shape), plain(layout.stride))


def _flat(shape):
    if isinstance(shape, int):
        return [shape]
    return [x for s in shape for x in _flat(s)]


def test_unsupported_reason_names_what_is_refused():
    """What the sm100 backward does not compile goes to the next family, with the reason."""
    from torch_fa4.kernels.sm100 import bwd

    for D in bwd.SUPPORTED_HEAD_DIMS:
        assert bwd.unsupported_reason(_call(D)) is None
    assert "head dims" in bwd.unsupported_reason(_call(192))
    assert "head dims" in bwd.unsupported_reason(_call(256))
    assert "fp16/bf16" in bwd.unsupported_reason(_call(64, dtype=torch.float32))
    q = torch.empty(1, 8, 2, 128, dtype=torch.bfloat16)
    v = torch.empty(1, 8, 2, 64, dtype=torch.bfloat16)
    assert bwd.unsupported_reason(AttentionCall(q=q, k=q, v=v, scale=0.1)) is None  # Dv != D
    v = torch.empty(1, 8, 2, 256, dtype=torch.bfloat16)
    assert "Dv=256" in bwd.unsupported_reason(AttentionCall(q=q, k=q, v=v, scale=0.1))
    assert "ModSet" in bwd.unsupported_reason(AttentionCall(q=q, k=q, v=q, scale=0.1, mod_key="x"))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    one_side = AttentionCall(q=q, k=q[0], v=q[0], scale=0.1, cu_seqlens_k=cu, max_seqlen_k=8)
    assert "both sides" in bwd.unsupported_reason(one_side)
    strided = torch.empty(1, 8, 2, 136, dtype=torch.bfloat16)[..., 1:129]
    assert "TMA" in bwd.unsupported_reason(AttentionCall(q=strided, k=q, v=q, scale=0.1))
    lists = (torch.ones(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32)) * 2
    bare = AttentionCall(q=q, k=q, v=q, scale=0.1, block_mask=lists, block_mask_q=128, block_mask_kv=128)
    assert "without its mask_mod" in bwd.unsupported_reason(bare)


def test_variant_key_reads_the_features():
    from torch_fa4.kernels.sm100 import bwd

    plain = bwd.variant_key(_call(128, S=256), False)
    assert (plain.has_right, plain.has_left, plain.varlen, plain.mask_key_tail, plain.group) == (
        False, False, False, False, 1)
    causal = bwd.variant_key(_call(64, H=8, Hkv=2, S=300, causal=True), True)
    assert (causal.has_right, causal.deterministic, causal.mask_key_tail, causal.group) == (
        True, True, True, 4)
    window = bwd.variant_key(_call(96, window_left=10, window_right=-1), False)
    assert (window.has_right, window.has_left) == (False, True)
    assert bwd.variant_key(_call(64, varlen=True), False).varlen


def test_ring_depth_fits_shared_memory():
    from torch_fa4.kernels.sm100.bwd_config import SMEM_LIMIT, ring_stages, smem_bytes

    assert [ring_stages(d, d) for d in (64, 96, 128)] == [2, 2, 2]
    assert smem_bytes(128, 128, 3) > SMEM_LIMIT >= smem_bytes(128, 128, 2)
    with pytest.raises(ValueError, match="shared memory"):
        ring_stages(256, 256)


@pytest.mark.parametrize("name", ["prepare", "convert"])
def test_shared_passes_compile_for_sm100(name, tmp_path):
    """The row-statistics / dQ-zeroing pass and the dQ conversion are the sm90 backward's modules,
    compiled for sm_100a here (they use no Hopper-only instruction)."""
    from torch_fa4.kernels.sm90 import bwd_dq_convert, bwd_prepare

    if name == "prepare":
        bwd_prepare.compile_kernel(torch.bfloat16, 128, arch="sm_100a", dump_dir=str(tmp_path), d_zero=128)
    else:
        bwd_dq_convert.compile_kernel(torch.float16, arch="sm_100a", dump_dir=str(tmp_path))
    sass = sass_of(tmp_path, "*.sm_100a.cubin")
    assert "LDG" in sass and "STG" in sass and "LDL" not in sass and "STL" not in sass


@pytest.mark.parametrize("name", ["d128_causal", "d96_seqused_gqa", "d64_varlen_window_deterministic"])
def test_launch_hands_the_kernel_its_compiled_arguments(name, monkeypatch):
    """The host's launch (CPU tensors, an emulated kernel) passes exactly the arguments the variant
    was compiled against: same count, tensors where the compiled signature has tensors, None where
    it has None, and the scalars."""
    from torch_fa4.kernels.sm100 import bwd
    from torch_fa4.kernels.sm90.bwd_compile import MAX_AUX, kernel_args

    call_kw, deterministic = VARIANTS[name]
    call_kw = dict(call_kw, S=200)
    if call_kw.get("varlen"):
        call_kw["S"] = 300
    call = _call(**call_kw)
    call = replace(call, **{n: torch.randn(t.shape).to(t.dtype) for n, t in (("q", call.q), ("k", call.k),
                                                                           ("v", call.v))})
    cfg = bwd.variant_key(call, deterministic)
    launched = []
    monkeypatch.setattr(bwd, "compile_variant", lambda key: (lambda *args: launched.append((key, args))))
    dout = torch.randn(call.out_shape()).to(call.q.dtype)
    out = torch.randn(call.out_shape()).to(call.q.dtype)
    lse = torch.randn(call.lse_shape())
    grads = [torch.empty_like(t) for t in (call.q, call.k, call.v)]
    bwd.backward(call, dout, out, lse, *grads, deterministic)
    (key, args), = launched
    assert key == cfg
    want = kernel_args(cfg, with_captured_grads=False)
    assert len(args) == len(want)
    for got, w in zip(args, want):
        assert (got is None) == (w is None)
        if isinstance(got, torch.Tensor):
            assert got.dim() == len(w.shape), (got.shape, w.shape)
    # the scalars before the captured tensors: scale, scale * log2 e, softcap, window, longest keys
    scalars = args[-MAX_AUX - 11:-MAX_AUX]
    assert scalars[0] == pytest.approx(call.scale)
    assert scalars[1] == pytest.approx(call.scale * math.log2(math.e))
    assert scalars[5] == (call.max_seqlen_k if call.is_varlen else call.k.shape[1])
    assert all(a is None for a in args[-MAX_AUX:])


# (dtype, M, N, A major, B major, A in TMEM, CTAs) -> the instruction descriptor CuTe DSL's own
# cute.gemm put in the PTX of the backward kernels for that MMA (read from their compiled PTX)
_DSL_INSTR_DESCS = [
    ("bf16", 128, 128, "k", "k", False, 1, 0x8200490),  # S^T, dP^T
    ("bf16", 128, 128, "k", "mn", True, 1, 0x8210490),  # dV (P^T from TMEM)
    ("bf16", 128, 128, "k", "mn", False, 1, 0x8210490),  # dK
    ("bf16", 128, 128, "mn", "mn", False, 1, 0x8218490),  # dQ
    ("bf16", 128, 64, "k", "mn", True, 1, 0x8110490),  # dV at Dv = 64
    ("fp16", 128, 128, "k", "k", False, 1, 0x8200010),
    ("fp16", 128, 128, "k", "mn", False, 1, 0x8210010),
    ("fp16", 128, 128, "mn", "mn", False, 1, 0x8218010),
    ("bf16", 256, 128, "k", "k", False, 2, 0x10200490),  # the CTA pair's S^T
    ("bf16", 256, 128, "k", "mn", True, 2, 0x10210490),
]


@pytest.mark.parametrize("case", _DSL_INSTR_DESCS)
def test_batched_umma_instruction_descriptor_is_the_dsls(case, monkeypatch):
    """umma_batch writes its own instruction descriptor: it must equal the DSL's for every MMA op
    the backward runs (a wrong field would be a silently wrong matmul)."""
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
    from cutlass.cutlass_dsl import CuTeDSL

    # tcgen05 ops validate the DSL's target: sm_100a for this test only
    monkeypatch.setattr(CuTeDSL._get_dsl().envar, "arch", "sm_100a")

    from torch_fa4.kernels.sm100.umma_batch import instr_desc

    dtype, m, n, a_major, b_major, a_tmem, ctas, expected = case
    major = {"k": OperandMajorMode.K, "mn": OperandMajorMode.MN}
    op = tcgen05.MmaF16BF16Op(
        {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[dtype], cutlass.Float32, (m, n, 16),
        {1: tcgen05.CtaGroup.ONE, 2: tcgen05.CtaGroup.TWO}[ctas],
        tcgen05.OperandSource.TMEM if a_tmem else tcgen05.OperandSource.SMEM, major[a_major], major[b_major])
    assert instr_desc(op) == expected, f"{instr_desc(op):#x} != {expected:#x}"
