"""CPU: every sm90 backward variant compiles for sm_90a, and its SASS is the intended machine code.

CuTe DSL writes real cubins without a GPU; nvdisasm (nvidia-cuda-nvdisasm) shows that the five
matmuls became warpgroup MMAs (HGMMA), that dQ leaves through TMA reductions, that registers are
handed from the producer to the consumers (setmaxnreg) and that nothing large spilled.
One compile per variant, a few seconds each.
"""

import os

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from naive import call_options, naive_attention, naive_varlen  # noqa: E402
from sass import hinted_loads, sass_of  # noqa: E402
from torch_fa4.call import AttentionCall  # noqa: E402


def _call(d=128, dv=None, hq=2, hkv=2, dtype=torch.bfloat16, varlen=False, seqused=False, sq=16, sk=None, **kw):
    # Shapes are symbolic in the compiled kernel: any small tensors describe the variant (keys a
    # whole number of key tiles, as in the dense grid; key_tail_variant tests the other case).
    dv = dv or d
    sk = (sq if varlen else 256) if sk is None else sk
    assert not varlen or sq == sk
    q = torch.empty(*((sq,) if varlen else (1, sq)), hq, d, dtype=dtype)
    k = torch.empty(*((sk,) if varlen else (1, sk)), hkv, d, dtype=dtype)
    v = torch.empty(*((sk,) if varlen else (1, sk)), hkv, dv, dtype=dtype)
    cu = torch.tensor([0, sq], dtype=torch.int32) if varlen else None
    used = torch.tensor([sk], dtype=torch.int32) if seqused else None
    return AttentionCall(q=q, k=k, v=v, scale=d**-0.5, cu_seqlens_q=cu, cu_seqlens_k=cu,
                         seqused_k=used, max_seqlen_q=sq, max_seqlen_k=sk, **kw)


VARIANTS = {
    "d64": (dict(d=64), False),
    "d128": (dict(d=128), False),
    "d96_causal": (dict(d=96, causal=True), False),
    "d128_fp16_causal": (dict(d=128, dtype=torch.float16, causal=True), False),
    "d128_dv64": (dict(d=128, dv=64), False),
    "d64_gqa_window": (dict(d=64, hq=4, hkv=1, window_left=64, window_right=16), False),
    "d128_softcap_causal": (dict(d=128, softcap=10.0, causal=True), False),
    # the packed-rows varlen variants (one launch for the batch)
    "d128_varlen_causal_gqa": (dict(d=128, hq=4, hkv=2, varlen=True, causal=True), False),
    "d64_varlen_window": (dict(d=64, varlen=True, window_left=64, window_right=16), False),
    "d256_varlen_causal": (dict(d=256, varlen=True, causal=True), False),
    "d128_varlen_causal_deterministic": (dict(d=128, varlen=True, causal=True), True),
    "d64_seqused": (dict(d=64, seqused=True), False),
    "d128_causal_deterministic": (dict(d=128, causal=True), True),
    # narrow variant (64 keys per CTA shared by both warpgroups): head dims above 128
    "d192_causal": (dict(d=192, causal=True), False),
    "d256": (dict(d=256), False),
    "d256_fp16_causal_gqa": (dict(d=256, dtype=torch.float16, hq=4, hkv=1, causal=True), False),
    "d192_dv128_softcap_window": (dict(d=192, dv=128, softcap=10.0, window_left=64, window_right=16), False),
    "d256_causal_deterministic": (dict(d=256, causal=True), True),
    "d256_dv128_causal": (dict(d=256, dv=128, causal=True), False),  # two stages, dQ slabs (Dv < D)
}


# 128 queries per step (D = Dv = 64 on 128-key CTAs, bwd_variant.query_tile), besides VARIANTS'
# D64 entries: name -> (call, deterministic)
VARIANTS_TM128 = {
    "tm128_d64_causal": (dict(d=64, causal=True), False),
    "tm128_d64_softcap": (dict(d=64, softcap=10.0, causal=True), False),
    "tm128_d64_causal_deterministic": (dict(d=64, causal=True), True),
    "tm128_d64_fp16_seqused_gqa": (dict(d=64, dtype=torch.float16, hq=6, hkv=2, seqused=True), False),
}


def _step_bodies(key, call) -> int:
    """How many copies of the step body the variant compiles: with split_mask_loops (walks with a
    limit and no block mask or mask_mod) one unmasked loop, plus a masked loop for the tiles a
    causal / right-window or partial-key-tile limit crosses (below the unmasked ones) and one for
    those a left-window or varlen row limit crosses (above them)."""
    mask_mod = call.mods is not None and call.mods.mask_graph is not None
    low = key.has_right or key.varlen or key.seqused_k or key.mask_key_tail
    high = key.has_left or key.varlen
    if key.sparse is not None or mask_mod or not (low or high):
        return 1
    return 1 + int(low) + int(high)


def _check_backward_sass(sass, key, d, dv, bodies=1):
    hgmma = sass.count("HGMMA.")
    # S, dP and dQ: (K extent / 16) each (dQ's is the key tile: with the head dim split between
    # the warpgroups (64 queries) or the query rows (128 queries), one 64-row tile each);
    # dK, dV: tile_m / 16 each; per copy of the step body (`bodies`, _step_bodies).
    tile_n, tile_m = key.tile_n, key.tile_m
    per_step = d // 16 + dv // 16 + tile_n // 16 + 2 * (tile_m // 16)
    assert hgmma == bodies * per_step, f"{hgmma} HGMMA instructions, {bodies} x {per_step} expected"
    assert "UTMAREDG" in sass, "dQ is not reduced through TMA"
    assert "ADD.F32" not in sass.replace("UTMAREDG", ""), "per-element dQ atomics are back"
    assert "USETMAXREG" in sass or "SETMAXNREG" in sass.upper(), "no register reallocation"
    spills = sass.count("LDL") + sass.count("STL")
    # a few loop scalars spill (d128: ~20 instructions, varlen ~45; the 128-query one-pass causal
    # variant 30 with CUDA 12's ptxas and 65 with CUDA 13's); an accumulator spilling shows up as
    # hundreds
    assert spills <= 80, f"{spills} local-memory spill instructions"
    # ptxas serializes the wgmmas when it cannot track them (advisories C7512 / C7514): a wait
    # then follows every HGMMA (28-40 waits instead of 3 with the next step's S^T overlapping the
    # dQ epilogue, when a group was left in flight across the loop's back edge)
    waits = sass.count("WARPGROUP.DEPBAR")
    assert waits <= 8 * bodies, f"{waits} wgmma waits: ptxas serialized the matmuls"
    # programmatic dependent launch: launch_dependents (PREEXIT) and the grid wait (ACQBULK)
    assert "PREEXIT" in sass and "ACQBULK" in sass, "programmatic dependent launch"
    # the dQ writer warp's slab hand-off is the kernel's only non-blocking named-barrier arrive
    assert ("BAR.ARV" in sass) == key.separate_dq_slabs, "dQ writer warp hand-off"
    # dK / dV leave through shared memory and TMA stores (128-key CTAs, dense), else directly
    if tile_n == 128 and not key.varlen:
        assert "UTMASTG" in sass, "dK / dV are not stored through TMA"
        # (fused_dq: dq's rows, 16-byte stores of the converter warps)
        other = sass.replace("STG.E.128", "") if key.fused_dq else sass
        if key.split_tail:  # a piece's partial dK / dV: one 32-bit store per value
            values = tile_n * (d + dv) // 256
            assert other.count("STG.E ") == values, f"{other.count('STG.E ')} workspace stores, {values} expected"
            other = other.replace("STG.E ", "")
        assert "STG.E" not in other, "direct global stores besides the TMA stores"
    else:
        assert "UTMASTG" not in sass and "STG.E" in sass


def _variant(table, name):
    """(call, deterministic, variant key) of VARIANTS-style table entry `name`."""
    from torch_fa4.kernels.sm90 import bwd

    call_kw, deterministic = table[name]
    call = _call(**call_kw)
    return call, deterministic, bwd.variant_key(call, deterministic)


def _compiled_and_checked(key, call, tmp_path) -> str:
    """Compile the variant `key` into tmp_path, run the common SASS checks, return the SASS."""
    from torch_fa4.kernels.sm90 import bwd

    bwd.compile_variant(key, dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    _check_backward_sass(sass, key, call.head_dim, call.head_dim_v, _step_bodies(key, call))
    return sass


@pytest.mark.parametrize("name", list(VARIANTS))
def test_backward_variant_compiles_to_hgmma(name, tmp_path):
    from torch_fa4.kernels.sm90 import bwd

    call_kw, deterministic = VARIANTS[name]
    call = _call(**call_kw)
    assert bwd.unsupported_reason(call) is None
    key = bwd.variant_key(call, deterministic)
    assert key.tile_n == (128 if max(call.head_dim, call.head_dim_v) <= 128 else 64)
    _compiled_and_checked(key, call, tmp_path)


def test_backward_l2_hints_reach_every_load(tmp_path):
    # Q / dO / statistics and the dQ adds evict-last, K / V evict-first: every TMA load and add
    # carries a policy (a policy-less one reads desc[URZ]; kernels/common/l2_hints.py)
    from torch_fa4.kernels.sm90 import bwd

    call = _call(d=128, causal=True)
    sass = _compiled_and_checked(bwd.variant_key(call, False), call, tmp_path)
    hinted, loads = hinted_loads(sass)
    assert loads >= 6 and hinted == loads
    adds = [line for line in sass.splitlines() if "UTMAREDG" in line]
    assert adds, "no dQ TMA adds"
    assert all("desc[URZ]" not in line for line in adds)


# walks with a limit run separate masked / unmasked loops: one step body, or two (causal) or three
# (window, varlen)
@pytest.mark.parametrize("name,bodies", [("d96_causal", 2), ("d64_gqa_window", 3),
                                         ("d64_varlen_window", 3), ("d128_causal_deterministic", 2),
                                         ("d192_causal", 2), ("d64", 1)])
def test_backward_split_mask_loops_compile(name, bodies, tmp_path):
    call, deterministic, key = _variant(VARIANTS, name)
    assert _step_bodies(key, call) == bodies
    _compiled_and_checked(key, call, tmp_path)


def test_dq_first_selection():
    from torch_fa4.kernels.sm90 import bwd

    # dQ issued before dK, by the dQ writer warp: the 128-key variants (separate dQ slabs)
    dq_first = lambda call, det=False: bwd.variant_key(call, det).separate_dq_slabs  # noqa: E731
    for kw in (dict(d=64), dict(d=128), dict(d=96, causal=True), dict(d=128, softcap=10.0), dict(d=128, dv=64),
               dict(d=64, hq=4, hkv=1, window_left=64, window_right=16)):
        assert dq_first(_call(**kw)), kw
    assert dq_first(_call(d=128, causal=True), det=True)
    # 64-key variants keep their order and the leader-warp adds (dQ staged in the ring (D256)
    # hands the stage back to the producer from them; D192 has slabs but is not converted)
    assert bwd.variant_key(_call(d=256), False).dq_in_ring
    assert not dq_first(_call(d=192)) and not dq_first(_call(d=256))


def test_descending_walk_selection():
    """Causal and right-window walks run from the last query tile down (bwd_q_walk.DenseQWalk);
    unmasked, left-window-only and deterministic ones keep the ascending order."""
    from torch_fa4.kernels.sm90 import bwd

    descending = lambda call, det=False: bwd.variant_key(call, det).descending_walk  # noqa: E731
    for kw in (dict(d=64, causal=True), dict(d=128, causal=True), dict(d=128, window_right=8),
               dict(d=256, causal=True), dict(d=64, causal=True, varlen=True)):
        assert descending(_call(**kw)), kw
    for kw in (dict(d=64), dict(d=128), dict(d=128, window_left=8)):
        assert not descending(_call(**kw)), kw
    assert not descending(_call(d=128, causal=True), det=True)


def test_varlen_kernel_selection():
    """Packed varlen batches run the kernel's packed-rows variant in one launch, deterministic
    mode included, unless BwdTuning asks for one dense launch per sequence; one-sided cu_seqlens
    always run per sequence, dense batches never."""
    import dataclasses

    from torch_fa4.kernels.sm90 import bwd

    packed = _call(d=128, varlen=True, causal=True)
    assert not bwd.runs_per_sequence(packed, False)
    assert bwd.runs_per_sequence(packed, False, bwd.BwdTuning(varlen_kernel=False))
    assert not bwd.runs_per_sequence(packed, True)
    assert bwd.runs_per_sequence(dataclasses.replace(packed, cu_seqlens_k=None), False)
    assert not bwd.runs_per_sequence(_call(d=128, causal=True), False)


def test_variant_key_memo_agrees():
    """variant_key is memoized on what it reads: every call gets the key a fresh derivation gives."""
    from torch_fa4.kernels.sm90 import bwd_variant

    cases = [dict(d=64), dict(d=128), dict(d=128, causal=True), dict(d=128, window_right=8),
             dict(d=128, window_left=8), dict(d=96, softcap=5.0), dict(d=128, hq=4, hkv=1),
             dict(d=256, dtype=torch.float16), dict(d=128, seqused=True), dict(d=64, varlen=True)]
    for det in (False, True):
        for kw in cases:
            for _ in range(2):
                assert bwd_variant.variant_key(_call(**kw), det) == bwd_variant._variant_key(_call(**kw), det), (kw, det)
    assert bwd_variant.variant_key(_call(d=64), False) != bwd_variant.variant_key(_call(d=64, causal=True), False)


def test_launch_plan_memo_agrees():
    """launch_plan is memoized for dense calls on the variant key, the shapes and the tuning:
    every call gets the plan a fresh derivation gives, and calls of other shapes get their own."""
    from torch_fa4.kernels.sm90 import bwd, bwd_variant

    cases = [dict(d=64), dict(d=128, causal=True), dict(d=128, sq=384, sk=640, causal=True),
             dict(d=128, hq=4, hkv=1, window_left=8), dict(d=96, softcap=5.0), dict(d=64, varlen=True)]
    plans = set()
    for kw in cases:
        call = _call(**kw)
        key = bwd.variant_key(call, False)
        for tuning in (bwd_variant.DEFAULT_TUNING, bwd.BwdTuning(persistent_ctas=1)):
            for _ in range(2):
                plan = bwd.launch_plan(call, key, tuning)
                assert plan == bwd_variant._launch_plan(call, key, tuning), (kw, tuning)
                plans.add(plan)
    wide = _call(d=128, hq=8, hkv=8, sq=512, sk=512)
    key = bwd.variant_key(wide, False)
    assert bwd.launch_plan(wide, key, bwd.BwdTuning(persistent_ctas=3)).ctas == 3
    assert bwd.launch_plan(wide, key).ctas == 32  # (off CUDA: one CTA per work tile)
    assert len({(p.max_q, p.max_k) for p in plans}) >= 2  # shapes keep plans apart


@pytest.mark.parametrize("name", list(VARIANTS_TM128))
def test_backward_128_query_variant_compiles_to_hgmma(name, tmp_path):
    from torch_fa4.kernels.sm90 import bwd

    call, deterministic, key = _variant(VARIANTS_TM128, name)
    assert bwd.unsupported_reason(call) is None
    assert (key.tile_n, key.stages, key.dq_in_ring, key.tile_m) == (128, 2, False, 128), key
    _compiled_and_checked(key, call, tmp_path)


@pytest.mark.parametrize("name", ["d128", "d128_softcap_causal", "d128_causal_deterministic",
                                  "d128_fp16_causal", "d128_dv64"])
def test_backward_transposed_dq_compiles(name, tmp_path):
    # dQ^T at 64 queries: dS^T stored keys-contiguous by a transposing stmatrix, and the dQ slab
    # written by 32-bit stores (the 64-bit pairs of dQ = dS K conflict in banks)
    call, deterministic, key = _variant(VARIANTS, name)
    assert key.tile_m == 64 and key.dq_transposed, key
    sass = _compiled_and_checked(key, call, tmp_path)
    assert "STSM.16.MT88" in sass, "dS is not stored by a transposing stmatrix"
    assert "STS.64" not in sass, "dQ is still stored in 64-bit pairs"


@pytest.mark.parametrize("name", ["d64", "tm128_d64_causal", "tm128_d64_softcap"])
def test_backward_128_query_transposed_dq_compiles(name, tmp_path):
    # D64 at 128 queries: each warpgroup's dQ^T is the whole head dim by its 64 queries
    call, deterministic, key = _variant(VARIANTS if name in VARIANTS else VARIANTS_TM128, name)
    assert key.tile_m == 128 and key.dq_transposed, key
    sass = _compiled_and_checked(key, call, tmp_path)
    assert "STSM.16.MT88" in sass and "STS.64" not in sass


def test_ring_barrier_choice():
    # At 128 queries per step walks without a right limit split the ring barrier (Q + LSE, dO +
    # dPsum) and causal / right-window walks keep one (NOTES Experiment 157); the variant tests
    # compile both
    from torch_fa4.kernels.sm90 import bwd

    for kw, split in ((dict(d=64), True), (dict(d=64, hq=4, hkv=1, window_left=64, window_right=16), False),
                      (dict(d=64, causal=True), False), (dict(d=64, window_left=64), True)):
        key = bwd.variant_key(_call(**kw), False)
        assert key.tile_m == 128 and key.split_ring is split, kw
    assert bwd.variant_key(_call(d=128), False).split_ring is False  # 64-query variants keep one barrier


def _hgmma_between_ds_stores_and_fence(sass: str) -> int:
    """HGMMAs issued between the loop's last dS^T stmatrix and the async-proxy fence after it."""
    lines = sass.splitlines()
    last_stsm = max(i for i, ln in enumerate(lines) if "STSM.16" in ln)
    fence = next(i for i in range(last_stsm, len(lines)) if "FENCE.VIEW.ASYNC.S" in lines[i])
    return sum("HGMMA." in ln for ln in lines[last_stsm:fence])


@pytest.mark.parametrize("name", ["tm128_d64_causal", "tm128_d64_softcap"])
def test_backward_dv_after_ds_stores(name, tmp_path):
    # dV's 8 HGMMAs (128 queries / 16) issue after the dS^T stmatrix, before the fence that
    # orders those stores for the tensor cores
    call, deterministic, key = _variant(VARIANTS_TM128, name)
    sass = _compiled_and_checked(key, call, tmp_path)
    assert _hgmma_between_ds_stores_and_fence(sass) == 8


def test_persistent_selection():
    # the dense 128-key variants (the dQ writer warp's); never with deterministic mode, varlen or
    # the 64-key (D > 128) variants
    from torch_fa4.kernels.sm90 import bwd

    on = lambda call, det=False: bwd.variant_key(call, det).persistent  # noqa: E731
    assert on(_call(d=64)) and on(_call(d=64, causal=True)) and on(_call(d=128, window_left=64, window_right=0))
    assert not on(_call(d=64), True) and not on(_call(d=256)) and not on(_call(d=128, varlen=True))


def test_split_tail_selection():
    """The split tail's code goes into the dense persistent 128-query (D64) variant without
    causal / window limits, softcap, mods, seqused_k or determinism."""
    from torch_fa4.kernels.sm90 import bwd

    def split(deterministic=False, **kw):
        return bwd.variant_key(_call(**kw), deterministic).split_tail

    assert split(d=64) and not split(d=128) and not split(d=96)
    for kw in (dict(causal=True), dict(window_left=100), dict(softcap=5.0), dict(seqused=True)):
        assert not split(d=64, **kw), kw
    assert not split(d=64, deterministic=True)


def test_split_plan():
    """The last round's tiles and their pieces (host.split_plan.choose with the backward's
    costs): the grid's D64 rows have 4096 tiles, 4 of them in a last round on 132 SMs."""
    from torch_fa4.kernels.sm90 import bwd_variant as bwd

    assert bwd.split_plan(4096, 132, 128) == (4, 8)  # S16k: 128 steps per tile
    assert bwd.split_plan(4096, 132, 32) == (4, 8)  # S4k: pieces of 4 steps
    assert bwd.split_plan(4096, 132, 8) == (0, 1)  # S1k: 2 steps of piece cost on 8 do not pay
    assert bwd.split_plan(132 * 31, 132, 128) == (0, 1)  # full rounds
    assert bwd.split_plan(100, 132, 128) == (0, 1)  # one round
    # 68 tiles left over (D128's 2048 tiles): 3 pieces need a second round of pieces, still a gain
    r, k = bwd.split_plan(2048, 132, 256)
    assert r == 68 and k >= 3


def test_persistent_grid_size(monkeypatch):
    # one CTA per multiprocessor (off CUDA: per tile), at most one per tile, capped by
    # BwdTuning.persistent_ctas, never zero
    from torch_fa4.kernels.sm90 import bwd_variant

    cpu = torch.device("cpu")
    assert bwd_variant.persistent_ctas(7, cpu) == 7 and bwd_variant.persistent_ctas(500, cpu) == 500
    assert bwd_variant.persistent_ctas(0, cpu) == 1
    assert bwd_variant.persistent_ctas(500, cpu, 3) == 3 and bwd_variant.persistent_ctas(2, cpu, 3) == 2
    from torch_fa4.kernels.host import fwd_launch

    monkeypatch.setattr(fwd_launch, "sm_count", lambda device: 132)
    assert bwd_variant.persistent_ctas(4096, torch.device("cuda", 0)) == 132
    assert bwd_variant.persistent_ctas(40, torch.device("cuda", 0)) == 40


@pytest.mark.parametrize("kw,det,persistent", [(dict(d=64, causal=True), False, True), (dict(d=128), False, True),
                                               (dict(d=128, causal=True, varlen=True), False, False)],
                         ids=["d64_causal", "d128", "d128_varlen_causal"])
def test_persistent_variant_compiles(kw, det, persistent, tmp_path):
    # the persistent form takes tiles from the counter (an atomic add) and hands them over
    # through its mailbox barriers; one CTA per tile (varlen) has no atomics
    from torch_fa4.kernels.sm90 import bwd

    call = _call(**kw)
    key = bwd.variant_key(call, det)
    assert key.persistent is persistent
    sass = _compiled_and_checked(key, call, tmp_path)
    assert ("ATOMG" in sass) is persistent


def test_split_tail_variant_compiles(tmp_path):
    # the split tail's code (D64, GQA); the SASS check counts the pieces' 32-bit workspace stores
    from torch_fa4.kernels.sm90 import bwd

    call = _call(d=64, hq=4, hkv=2)
    key = bwd.variant_key(call, False)
    assert key.split_tail and key.persistent
    sass = _compiled_and_checked(key, call, tmp_path)
    assert "ATOMG" in sass


def test_own_dv_stage_selection():
    # the persistent 64-query variants (D96, D128) stage dV in a buffer of its own, which fits
    # shared memory; the 128-query D64 variant already stages dK and dV together in its dS^T
    # slots; one CTA per tile never
    from torch_fa4.kernels.sm90 import bwd, bwd_config

    for kw in (dict(d=128), dict(d=128, causal=True), dict(d=96, causal=True)):
        t = bwd.variant_key(_call(**kw), False)
        assert t.persistent and t.tile_m == 64 and t.own_dv_stage and not t.fused_dq, kw
        d = kw["d"]
        need = bwd_config.smem_bytes(d, d, t.tile_n, t.stages, t.dq_in_ring, t.tile_m, own_dv_stage=True)
        without = bwd_config.smem_bytes(d, d, t.tile_n, t.stages, t.dq_in_ring, t.tile_m)
        assert without + t.tile_n * d * 2 <= need <= bwd_config.SMEM_LIMIT
    t = bwd.variant_key(_call(d=64, causal=True), False)
    assert t.tile_m == 128 and t.dkdv_share_slots and not t.own_dv_stage
    assert not bwd.variant_key(_call(d=128), True).own_dv_stage  # deterministic: one CTA per tile


def test_fused_dq_selection():
    # the persistent 128-query variants (D64) write dq themselves wherever every query tile sees a
    # key (their staging tile fills shared memory to the byte), up to 4096 queries; the 64-query
    # ones (D96, D128) keep the conversion pass; never with seqused_k, varlen, deterministic mode
    # or one CTA per tile
    from torch_fa4.kernels.sm90 import bwd, bwd_config

    fused = lambda call, det=False: bwd.variant_key(call, det).fused_dq  # noqa: E731
    for kw in (dict(d=64), dict(d=64, causal=True), dict(d=64, window_left=64, window_right=0),
               dict(d=64, hq=4, hkv=1)):
        t = bwd.variant_key(_call(**kw), False)
        assert t.fused_dq and t.persistent and t.tile_m == 128, kw
        assert bwd_config.smem_bytes(64, 64, t.tile_n, t.stages, False, t.tile_m, fused_dq=True) <= bwd_config.SMEM_LIMIT
    for kw in (dict(d=128), dict(d=128, causal=True), dict(d=96)):
        assert not fused(_call(**kw)), kw
    assert not fused(_call(d=64), True)
    assert not fused(_call(d=64, seqused=True)) and not fused(_call(d=64, varlen=True))

    def shaped(sq, sk, **kw):
        q = torch.empty(1, sq, 2, 64, dtype=torch.bfloat16)
        k = torch.empty(1, sk, 2, 64, dtype=torch.bfloat16)
        return AttentionCall(q=q, k=k, v=k, scale=0.1, **kw)

    # causal, 128-query tiles: the first tile's last row (127) sees key 0 while Sq - Sk <= 127
    assert fused(shaped(164, 37, causal=True)) and not fused(shaped(165, 37, causal=True))
    assert fused(shaped(165, 37)) and fused(shaped(165, 37, window_left=5))
    assert not fused(shaped(300, 100, window_right=10, window_left=0))  # rows 0-189 see no key
    # calls of more than 4096 queries take the conversion pass
    assert fused(shaped(4096, 4096)) and fused(shaped(4096, 4096, causal=True))
    assert not fused(shaped(4097, 4097)) and not fused(shaped(16384, 16384, causal=True))
    assert not fused(shaped(4097, 64)) and fused(shaped(1024, 1024)) and fused(shaped(2048, 8192))


def _contributors_closed_form(m, tile_m, tile_n, sq, sk, has_right, has_left, right, left):
    """bwd_dq_fused.dq_contributors, transcribed (Python's floor division equals the kernel's
    where its operands are kept non-negative)."""
    diag, n_lo, n_hi = sk - sq, 0, -(-sk // tile_n) - 1
    if has_right:
        x = (m + 1) * tile_m + diag + right
        n_hi = min(n_hi, (max(x, 1) - 1) // tile_n) if x > 0 else -1
    if has_left:
        n_lo = max(m * tile_m + diag - left, 0) // tile_n
    return max(n_hi - n_lo + 1, 0)


def test_dq_contributors_match_the_walks():
    # the kernel's count of a query tile's contributors against the key tiles' walks, one by one,
    # over random shapes and limits
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    for _ in range(400):
        tile_m = (64, 128)[int(torch.randint(2, (1,), generator=g))]
        sq, sk = (int(x) for x in torch.randint(1, 700, (2,), generator=g))
        has_right, has_left = (bool(x) for x in torch.randint(2, (2,), generator=g))
        right, left = (int(x) for x in torch.randint(0, 300, (2,), generator=g))
        for m in range(-(-sq // tile_m)):
            want = _contributors(m, tile_m, 128, sq, sk, has_right, has_left, right, left)
            got = _contributors_closed_form(m, tile_m, 128, sq, sk, has_right, has_left, right, left)
            assert got == want, (m, tile_m, sq, sk, has_right, has_left, right, left)


def test_fused_dq_compiles(tmp_path):
    # fused_dq (up to 4096 queries) adds the converter: one more TMA load (the finished fp32
    # tile), the dQ counters' atomics, and dq's 16-byte stores (none without it, past 4096
    # queries: the conversion pass writes dq)
    from torch_fa4.kernels.sm90 import bwd

    sass = {}
    for on, sq in (("1", 1024), ("0", 8192)):
        call = _call(d=64, causal=True, sq=sq, sk=sq)
        key = bwd.variant_key(call, False)
        assert key.fused_dq is (on == "1")
        (tmp_path / on).mkdir()
        sass[on] = _compiled_and_checked(key, call, tmp_path / on)
    count = lambda on, op: sass[on].count(op)  # noqa: E731
    assert count("1", "UTMALDG") == count("0", "UTMALDG") + 1
    assert count("1", "ATOMG") > count("0", "ATOMG") >= 1
    assert count("1", "STG.E.128") >= 16 and count("0", "STG.E.128") == 0
    # (the writer warp at 24 registers keeps one value in local memory: a store and a load)
    assert sass["1"].count("LDL") + sass["1"].count("STL") <= 4


def test_128_query_variant_selection():
    from torch_fa4.kernels.sm90 import bwd, bwd_config

    assert bwd.variant_key(_call(d=64), False).tile_m == 128
    # head dims above 64 keep 64 queries per step
    for d, dv in ((96, 96), (128, 128), (128, 64), (256, 256)):
        assert bwd.variant_key(_call(d=d, dv=dv), False).tile_m == 64
    assert bwd_config.smem_bytes(64, 64, 128, 2, False, 128) <= bwd_config.SMEM_LIMIT


def test_tiles_fit_shared_memory_and_registers():
    from torch_fa4.kernels.sm90 import bwd, bwd_config, bwd_variant

    dims = bwd.SUPPORTED_HEAD_DIMS
    for d in dims:
        for dv in dims:
            tile_n = bwd_variant.key_tile(d, dv)
            stages, dq_in_ring = bwd_config.ring(d, dv, tile_n)
            assert bwd_config.smem_bytes(d, dv, tile_n, stages, dq_in_ring) <= 227 * 1024
            assert not dq_in_ring or dv >= d
            # fp32 accumulators per consumer thread that live through the walk (dK + dV) plus dQ:
            # 2 warpgroups x 128 threads share them
            assert (tile_n * (d + dv) + 64 * d) // 256 <= 192, (d, dv, tile_n)
    assert bwd_config.ring(128, 128, 128) == (2, False)
    assert bwd_variant.key_tile(192, 192) == 64 and bwd_config.ring(192, 192, 64) == (2, False)
    assert bwd_config.ring(256, 256, 64) == (2, True)  # dQ staged in the consumed Q / dO stage


def test_unsupported_calls_are_rejected():
    from torch_fa4.kernels.sm90 import bwd

    assert "head dims" in bwd.unsupported_reason(_call(d=80))
    assert "head dims" in bwd.unsupported_reason(_call(d=128, dv=320))
    assert "fp16/bf16" in bwd.unsupported_reason(_call(d=64, dtype=torch.float32))
    odd = _call(d=64)
    odd.q = torch.empty(1, 16, 2, 68, dtype=torch.bfloat16)[..., :64]  # strides not 16-byte multiples
    assert bwd.unsupported_reason(odd) is not None
    assert "score_mod" in bwd.unsupported_reason(_call(d=64, mod_key="some_mod"))


@pytest.mark.parametrize("s,tile_m,want_rows", [(70, 64, 128), (130, 128, 256), (128, 128, 128)])
def test_row_statistics_match_float64(s, tile_m, want_rows):
    from torch_fa4.kernels.sm90 import bwd_row_stats

    b, h, d = 2, 3, 64
    call = _call(d=d, hq=h, hkv=h)
    call.q = torch.empty(b, s, h, d, dtype=torch.bfloat16)
    dout = torch.randn(b, s, h, d).to(torch.bfloat16)
    out = torch.randn(b, s, h, d).to(torch.bfloat16)
    lse = torch.randn(b, h, s)
    lse[0, 1, 5] = -float("inf")  # a row that sees no key
    lse2, dpsum, rows = bwd_row_stats.row_statistics(call, dout, out, lse, tile_m=tile_m)
    assert rows == want_rows and lse2.shape == (b, h, rows) and dpsum.shape == (b, h, rows)
    assert lse2.is_contiguous() and dpsum.is_contiguous()
    ref_d = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(dpsum[..., :s].double(), ref_d, rtol=1e-5, atol=1e-5)
    assert (dpsum[..., s:] == 0).all()
    finite = torch.isfinite(lse)
    torch.testing.assert_close(lse2[..., :s][finite].double(), lse[finite].double() * 1.4426950408889634)
    assert lse2[0, 1, 5] == float("inf") and (lse2[..., s:] == float("inf")).all()


def test_size_one_dims_get_tma_strides():
    from torch_fa4.kernels.sm90 import bwd

    t = torch.empty(1, 16, 1, 64, dtype=torch.bfloat16).as_strided((1, 16, 1, 64), (3, 64, 5, 1))
    assert bwd.tma_compatible(t)
    v = bwd._tma_view(t)
    assert v.stride() == (1024, 64, 64, 1) and v.data_ptr() == t.data_ptr()
    assert not bwd.tma_compatible(torch.ones(1, dtype=torch.bfloat16).expand(2, 16, 3, 64))


def test_variants_differ_only_where_code_differs():
    from torch_fa4.kernels.sm90 import bwd

    a = bwd.variant_key(_call(d=128, causal=True), False)
    b = bwd.variant_key(_call(d=128, causal=True, softcap=0.0), False)
    assert a == b
    # window sizes and softcap values are runtime arguments: no new variant per value
    w1 = bwd.variant_key(_call(d=128, window_left=10, window_right=3), False)
    w2 = bwd.variant_key(_call(d=128, window_left=99, window_right=0), False)
    assert w1 == w2
    assert bwd.variant_key(_call(d=128), True) != bwd.variant_key(_call(d=128), False)


# ---- the host wrapper (padding, -inf rows, dQ buffer, varlen splitting) around a float64
# emulation of the kernel's contract, against float64 autograd. Runs without a GPU.

def _visible(sq, sk_rows, sk, has_right, has_left, right, left):
    """(row index, key index, (sq, sk_rows) bool): key j visible from query i, bottom-right
    aligned, keys past sk (seqused_k) hidden."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk_rows)[None, :]
    vis = (j < sk).expand(sq, sk_rows).clone()
    if has_right:
        vis &= j <= i + (sk - sq) + right
    if has_left:
        vis &= j >= i + (sk - sq) - left
    return i, j, vis


def _head_grads(q, k, v, do, lse2, dpsum, weight, scale, scale_log2, softcap, softcap_val):
    """One query head's float64 (dQ unscaled, as the kernel adds it; dK; dV) from the row
    statistics the host hands the kernel; `weight` zeroes (or counts) each element's P."""
    f = lambda t: t.double()
    s = f(q) @ f(k).T
    factor = 1.0
    if softcap:
        t = torch.tanh(s * scale / softcap_val)
        x = t * softcap_val * 1.4426950408889634
        factor = 1 - t * t
    else:
        x = s * scale_log2
    p = torch.exp2(x - f(lse2)[:, None]) * weight
    ds = p * (f(do) @ f(v).T - f(dpsum)[:, None]) * factor
    return ds @ f(k), scale * ds.T @ f(q), p.T @ f(do)


def _emulated_kernel(key):
    """What the compiled kernel computes, in float64 torch, given bwd.backward's arguments.

    Mask_mods are evaluated with the ModSet's PyTorch lowering; under a block-sparse walk only the
    (64-query, 128-key) tiles the transposed lists name contribute, with the mask_mod applied on
    partial ones only, each as many times as it is listed (as the kernel would add it)."""
    d, dv, group, has_right, has_left = key.head_dim, key.head_dim_v, key.group, key.has_right, key.has_left
    softcap, deterministic, sparse, mod_key = key.softcap, key.deterministic, key.sparse, key.mods_key
    tile_n, tile_m = key.tile_n, key.tile_m
    if key.varlen:  # the packed-rows variant
        assert not mod_key and sparse is None and not deterministic
        return _emulated_packed_kernel(d, dv, group, has_right, has_left, softcap, key)
    mods = None
    if mod_key:
        from torch_fa4.mods.registry import lookup

        mods = lookup(mod_key)
        assert mods.score_graph is None, "the emulation covers mask_mods only"

    def fn(q, k, v, do, lse2, dpsum, dq_acc, dk, dvv, dq_out, cu_q, cu_k, used, sem, split_ws, split_cnt, *rest):
        q_num, q_idx, full_num, full_idx = rest[:4]
        (scale, scale_log2, softcap_val, left, right, max_k, cta_group, cta_tail, num_ctas, split_items,
         split_ways) = rest[4:15]
        # the CTA order, the persistent grid and the split tail change nothing the emulation
        # computes; the split's plan and buffers are checked against the launch
        assert cta_group >= 1 and cta_tail >= 1 and num_ctas >= 1
        _check_split_launch(key, d, dv, k, sem, split_ws, split_cnt, num_ctas, split_items, split_ways)
        if split_items:
            _LAST_SPLIT.append((split_items, split_ways))
        mask_aux = [t for t in rest[15:] if t is not None][mods.num_score_aux if mods else 0:]
        assert (q_num is None) == (sparse is None)
        # the kernel reads whole query tiles of tile_m rows: statistics padded to them; the dQ
        # buffer is not (its TMA adds drop rows past Sq)
        assert lse2.shape[-1] % tile_m == 0 and dq_acc.shape[-2] == q.shape[1]
        assert lse2.shape[-1] >= -(-q.shape[1] // tile_m) * tile_m
        n_m = -(-q.shape[1] // tile_m)
        if deterministic:  # one semaphore per query tile (else: the persistent tile counter)
            assert sem.shape[-1] == n_m
        elif key.fused_dq:  # per query tile a counter and a queue slot; 3 counters
            assert sem.shape == (q.shape[0], q.shape[2], 2 * n_m + 3) and int(sem.abs().sum()) == 0
        elif key.persistent:
            assert sem.shape == (1, 1, 1) and int(sem.sum()) == 0
        assert (dq_out is not None) == key.fused_dq
        for b in range(q.shape[0]):
            sq, sk_rows = q.shape[1], k.shape[1]
            sk = int(used[b]) if used is not None else sk_rows
            i, j, vis = _visible(sq, sk_rows, sk, has_right, has_left, right, left)
            gk = torch.zeros(sk_rows, k.shape[2], d, dtype=torch.float64)
            gv = torch.zeros(sk_rows, k.shape[2], dv, dtype=torch.float64)
            for h in range(q.shape[2]):
                hk = h // group
                weight = vis.double()
                if mods is not None:
                    keep = torch.broadcast_to(mods.mask_torch(torch.tensor(b), torch.tensor(h), i, j, mask_aux), vis.shape)
                    if sparse is None:
                        weight = weight * keep
                    else:
                        wp, wf = _visits(q_num, q_idx, full_num, full_idx, sparse, b, h, hk, group, sk_rows,
                                         lse2.shape[-1], tile_n, tile_m)
                        weight = weight * (wp[:sq, :sk_rows] * keep + wf[:sq, :sk_rows])
                dq_h, dk_h, dv_h = _head_grads(q[b, :, h], k[b, :, hk], v[b, :, hk], do[b, :, h],
                                               lse2[b, h, :sq], dpsum[b, h, :sq], weight, scale,
                                               scale_log2, softcap, softcap_val)
                dq_acc[b, h, :sq] += dq_h.float()
                gk[:, hk] += dk_h
                gv[:, hk] += dv_h
            dk[b].copy_(gk)
            dvv[b].copy_(gv)
            if dq_out is not None:  # the converter warps: every query tile some key tile walks
                for m in range(n_m):
                    if _contributors(m, tile_m, tile_n, sq, sk, has_right, has_left, right, left) > 0:
                        rows = slice(m * tile_m, (m + 1) * tile_m)
                        dq_out[b, rows] = (dq_acc[b, :, rows].transpose(0, 1) * scale).to(dq_out.dtype)

    return fn


_LAST_SPLIT: list = []  # (split tiles, ways) of the emulated launches that split


def _check_split_launch(kernel_tiles, d, dv, k, sem, split_ws, split_cnt, num_ctas, split_items, split_ways):
    """The split tail's launch arguments (bwd.backward): none without the variant's split code;
    with it, the last round's tiles (0 when the rounds are full or splitting does not pay), a
    workspace slot of (tile_n (d + dv) / 256, 256) fp32 per piece, and zeroed counters that
    follow the tile counter in one buffer."""
    if not kernel_tiles.split_tail:
        assert split_ws is None and split_cnt is None and (split_items, split_ways) == (0, 1)
        return
    tiles = -(-k.shape[1] // kernel_tiles.tile_n) * k.shape[0] * k.shape[2]
    assert split_items == tiles % num_ctas and split_items < num_ctas
    # (a launch that does not split runs the variant without the split code)
    assert split_items and split_ways >= 2 and tiles > num_ctas
    values = kernel_tiles.tile_n * (d + dv) // 256
    assert split_ws.dtype == torch.float32 and split_ws.shape == (max(split_items * split_ways, 1), values, 256)
    assert split_cnt.dtype == torch.int32 and split_cnt.shape == (max(split_items, 1),)
    assert int(split_cnt.abs().sum()) == 0
    assert split_cnt.data_ptr() == sem.data_ptr() + 4 * sem.numel()  # zeroed with the tile counter


def _contributors(m, tile_m, tile_n, sq, sk, has_right, has_left, right, left):
    """Key tiles whose walk (bwd_kernel._tile_walk's query range) holds query tile m, counted
    one by one."""
    diag, count = sk - sq, 0
    for n in range(-(-sk // tile_n)):
        n0, n1 = n * tile_n, min(n * tile_n + tile_n, sk)
        row_lo = max(n0 - diag - right, 0) if has_right else 0
        row_hi = min(n1 - diag + left, sq) if has_left else sq
        count += row_lo // tile_m <= m < -(-max(row_hi, 0) // tile_m)
    return count


def _emulated_packed_kernel(d, dv, group, has_right, has_left, softcap, kernel_tiles):
    """_emulated_kernel for the packed-rows varlen variant: q / do (Tq, Hq, D), k / v (Tk, Hkv, D),
    the dQ buffer (Hq, T, D) over the packed rows, sequences at the cu_seqlens offsets, a grid
    sized by max_k; the row statistics (Hq, rows') with sequence b's rows from
    (cu_q[b] + b tile_m) // tile_m * tile_m (bwd_kernel._stat_row_offset)."""
    tile_m = kernel_tiles.tile_m

    def fn(q, k, v, do, lse2, dpsum, dq_acc, dk, dvv, dq_out, cu_q, cu_k, used, sem, split_ws, split_cnt, *rest):
        scale, scale_log2, softcap_val, left, right, max_k = rest[4:10]
        assert all(t is None for t in rest[:4]) and sem is None and dq_out is None
        assert split_ws is None and split_cnt is None and tuple(rest[13:15]) == (0, 1)
        # the dQ buffer: a (Hq, T, D) view of zeroed (T, Hq, D) rows (TMA adds drop rows past T)
        assert lse2.shape == dpsum.shape and lse2.shape[0] == q.shape[1] and lse2.shape[-1] % tile_m == 0
        assert dq_acc.shape == (q.shape[1], q.shape[0], d) and dq_acc.transpose(0, 1).is_contiguous()
        assert int(dq_acc.abs().sum()) == 0
        stats_end = 0  # every statistics tile a CTA reads lies inside the buffer, past the last sequence's
        for b in range(cu_q.shape[0] - 1):
            qa, qb, ka, kb = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
            sq, sk_rows = qb - qa, kb - ka
            st = (qa + b * tile_m) // tile_m * tile_m
            assert st >= stats_end and st + -(-sq // tile_m) * tile_m <= lse2.shape[-1]
            stats_end = st + -(-sq // tile_m) * tile_m
            assert sk_rows <= max_k, "the grid does not cover the longest sequence's key tiles"
            sk = int(used[b]) if used is not None else sk_rows
            _, _, vis = _visible(sq, sk_rows, sk, has_right, has_left, right, left)
            gk = torch.zeros(sk_rows, k.shape[1], d, dtype=torch.float64)
            gv = torch.zeros(sk_rows, k.shape[1], dv, dtype=torch.float64)
            for h in range(q.shape[1]):
                hk = h // group
                dq_h, dk_h, dv_h = _head_grads(q[qa:qb, h], k[ka:kb, hk], v[ka:kb, hk], do[qa:qb, h],
                                               lse2[h, st : st + sq], dpsum[h, st : st + sq], vis.double(), scale,
                                               scale_log2, softcap, softcap_val)
                dq_acc[h, qa:qb] += dq_h.float()
                gk[:, hk] += dk_h
                gv[:, hk] += dv_h
            dk[ka:kb].copy_(gk)
            dvv[ka:kb].copy_(gv)

    return fn


def _visits(q_num, q_idx, full_num, full_idx, ratios, b, h, hk, group, sk_rows, rows, tile_n, tile_m):
    """Element weights (partial visits, full visits) of the tiles that KV head hk's CTAs walk for
    query head h, read from the transposed lists exactly as the kernel's SparseQWalk reads them."""
    rm, rn = ratios
    n_tiles = -(-sk_rows // tile_n)
    wp = torch.zeros(rows // tile_m, n_tiles, dtype=torch.float64)
    wf = torch.zeros_like(wp)
    bb = 0 if q_num.shape[0] == 1 else b
    hb = 0 if q_num.shape[1] == 1 else h
    assert h // group == hk
    for n_block in range(n_tiles):
        nb = n_block // rn
        assert nb < q_num.shape[2], "a CTA would read past the key-block lists"
        for num, idx, w in ((q_num, q_idx, wp), (full_num, full_idx, wf)):
            for t in range(int(num[bb, hb, nb])):
                for sub in range(rm):
                    m_block = int(idx[bb, hb, nb, t]) * rm + sub
                    assert m_block < rows // tile_m, "a listed step reads past the padded row statistics"
                    w[m_block, n_block] += 1
    expand = lambda w: w.repeat_interleave(tile_m, 0).repeat_interleave(tile_n, 1)
    return expand(wp), expand(wf)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", ["dense_causal_gqa", "varlen_window", "varlen_window_packed", "varlen_causal_packed",
                                  "varlen_q_only_seqused", "softcap", "deterministic_window", "plain_split_gqa"])
def test_host_wrapper_with_emulated_kernel(case, d, monkeypatch):
    """d: D64 runs the 128-query variant (dq written by the kernel, `fused_dq`), D128 the
    64-query one (the dq conversion pass after the kernel). varlen_*_packed: one launch of the
    packed-rows variant, max_seqlen_k left for the host to read from cu_seqlens; varlen_window:
    one dense launch per sequence; plain_split_gqa: 12 work tiles on 5 persistent CTAs, at D64
    the last round's 2 tiles split in 2."""
    import math

    from torch_fa4.kernels.sm90 import bwd

    monkeypatch.setattr(bwd, "compile_variant", _emulated_kernel)
    tuning = bwd.BwdTuning(varlen_kernel=case.endswith("_packed") or not case.startswith("varlen"))
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(torch.bfloat16)
    hq, hkv = 4, 2
    kw = {}
    if case == "dense_causal_gqa":
        q, k, v, do = rnd(2, 70, hq, d), rnd(2, 50, hkv, d), rnd(2, 50, hkv, d), rnd(2, 70, hq, d)
        kw = dict(causal=True)  # 70 queries over 50 keys: the first 20 rows see nothing
    elif case == "plain_split_gqa":  # 16 steps per work tile at D64: splitting pays
        q, k, v, do = rnd(2, 1024, hq, d), rnd(2, 290, hkv, d), rnd(2, 290, hkv, d), rnd(2, 1024, hq, d)
        tuning = bwd.BwdTuning(persistent_ctas=5)
    elif case == "softcap":
        q, k, v, do = rnd(1, 33, hq, d), rnd(1, 90, hkv, d), rnd(1, 90, hkv, d), rnd(1, 33, hq, d)
        kw = dict(softcap=5.0, window_left=20, window_right=3)
    elif case == "deterministic_window":
        q, k, v, do = rnd(2, 300, hq, d), rnd(2, 200, hkv, d), rnd(2, 200, hkv, d), rnd(2, 300, hq, d)
        kw = dict(window_left=70, causal=True)
    elif case in ("varlen_window", "varlen_window_packed"):
        cu_q, cu_k = torch.tensor([0, 40, 40, 107], dtype=torch.int32), torch.tensor([0, 30, 55, 55], dtype=torch.int32)
        q, k, v, do = rnd(107, hq, d), rnd(55, hkv, d), rnd(55, hkv, d), rnd(107, hq, d)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=67, max_seqlen_k=30, window_left=7)
    elif case == "varlen_causal_packed":  # no maxima given: the host reads them
        cu_q, cu_k = torch.tensor([0, 3, 150, 171], dtype=torch.int32), torch.tensor([0, 90, 95, 230], dtype=torch.int32)
        q, k, v, do = rnd(171, hq, d), rnd(230, hkv, d), rnd(230, hkv, d), rnd(171, hq, d)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    else:  # packed queries over a dense KV cache limited by seqused_k
        cu_q = torch.tensor([0, 5, 29], dtype=torch.int32)
        q, do = rnd(29, hq, d), rnd(29, hq, d)
        k, v = rnd(2, 64, hkv, d), rnd(2, 64, hkv, d)
        kw = dict(cu_seqlens_q=cu_q, seqused_k=torch.tensor([17, 64], dtype=torch.int32), max_seqlen_q=24,
                  max_seqlen_k=64, causal=True)
    call = AttentionCall(q=q, k=k, v=v, scale=d**-0.5, **kw)
    assert bwd.runs_per_sequence(call, case.startswith("deterministic"), tuning) == (
        call.cu_seqlens_q is not None and not case.endswith("_packed"))
    if case in ("dense_causal_gqa", "plain_split_gqa"):
        assert bwd.variant_key(call, False).fused_dq is (d == 64)

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out64, lse = naive_varlen(q64, k64, v64, **call_options(call), differentiable=True)
    ref = torch.autograd.grad(out64, (q64, k64, v64), do.double())
    lse = lse.detach().float()

    grads = [torch.full(t.shape, math.nan, dtype=t.dtype) for t in (q, k, v)]
    _LAST_SPLIT.clear()
    bwd.backward(call, do, out64.detach().to(torch.bfloat16), lse, *grads, case.startswith("deterministic"), tuning)
    if case == "plain_split_gqa":
        assert _LAST_SPLIT == ([(2, 2)] if d == 64 else [])  # (split tiles, ways) the launch passed
    for name, got, r in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(got).any(), f"{name}: rows left unwritten"
        err = (got.double() - r).norm() / r.norm()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"


# ---- block-sparse walk: host lists (transposed block mask, padding) around the emulated kernel

def _document_mask(doc):
    def mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return mask_mod


def _per_head_tail_mask(doc, cut):  # keys past `cut` are seen by no query (their dK, dV = 0)
    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx < cut) & ((q_idx + h) % 3 != 0)

    return mask_mod


SPARSE_CASES = {
    # name: (mask kind, causal, BLOCK_SIZE, block mask per head?, expected ratios or None = dense,
    # queries per step); D64 steps 128 queries where the block-mask rows allow
    "doc_128x128_causal": ("doc", True, (128, 128), False, (1, 1), 128),
    "doc_64x128": ("doc", False, (64, 128), False, (1, 1), 64),  # 64-row tiles: the 64-query variant
    "tail_per_head_128x256": ("tail", False, (128, 256), True, (1, 2), 128),
    "doc_96_falls_back_dense": ("doc", True, (96, 96), False, None, 128),
    # D=256 runs the narrow variant: 64-key CTAs, two per 128-key block-mask column
    "doc_128x128_d256": ("doc", False, (128, 128), False, (2, 2), 64),
    # 64-key block-mask columns at D=64: the 64-key variant takes them instead of the dense walk
    "doc_64x64_narrow": ("doc", True, (64, 64), False, (1, 1), 64),
}


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_host_path_with_emulated_kernel(case, monkeypatch):
    import math

    from torch_fa4.kernels.sm90 import bwd
    from torch_fa4.mods import create_block_mask
    from torch_fa4.mods.prepare import prepare
    from torch_fa4.mods.registry import lookup

    kind, causal, block, per_head, expect, want_tile_m = SPARSE_CASES[case]
    monkeypatch.setattr(bwd, "compile_variant", _emulated_kernel)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(torch.bfloat16)
    b, sq, sk, hq, hkv = 2, 130, 300, 4, 2  # 130: the last 128-row block reaches past Sq
    d = 256 if case.endswith("d256") else 64
    doc = torch.sort(torch.randint(0, 3, (max(sq, sk),), generator=g)).values.to(torch.int32)
    mask_mod = _document_mask(doc) if kind == "doc" else _per_head_tail_mask(doc, 250)
    bm = create_block_mask(mask_mod, None, hq if per_head else None, sq, sk, device="cpu", BLOCK_SIZE=block)
    key, aux = prepare(None, mask_mod)
    q, k, v, do = rnd(b, sq, hq, d), rnd(b, sk, hkv, d), rnd(b, sk, hkv, d), rnd(b, sq, hq, d)
    call = AttentionCall(q=q, k=k, v=v, scale=d**-0.5, causal=causal, mod_key=key, mods=lookup(key),
                         aux_tensors=aux, block_mask=tuple(bm.as_tensors()), block_mask_q=block[0],
                         block_mask_kv=block[1], max_seqlen_q=sq, max_seqlen_k=sk)
    assert bwd.unsupported_reason(call) is None
    assert bwd.variant_key(call, False).sparse == expect
    assert bwd.variant_key(call, False).tile_m == want_tile_m
    assert bwd.variant_key(call, True).sparse is None  # deterministic: dense walk

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out64, lse = naive_attention(q64, k64, v64, scale=call.scale, causal=causal, mask_mod=mask_mod,
                                 differentiable=True)
    ref = torch.autograd.grad(out64, (q64, k64, v64), do.double())
    lse = lse.detach().float()

    grads = [torch.full(t.shape, math.nan, dtype=t.dtype) for t in (q, k, v)]
    bwd.backward(call, do, out64.detach().to(torch.bfloat16), lse, *grads, False)
    for name, got, r in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(got).any(), f"{name}: rows left unwritten"
        err = (got.double() - r).norm() / r.norm()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"
    if kind == "tail":  # keys no query sees: exactly zero
        assert (grads[1][:, 256:] == 0).all() and (grads[2][:, 256:] == 0).all()


@pytest.mark.parametrize("d,hq,hkv,block,per_head,causal,tile_m", [
    (128, 4, 2, (128, 128), False, True, 64),  # 2 query steps per block-mask row
    (64, 2, 2, (128, 256), True, False, 128),  # 2 CTAs per block-mask column, per-head lists
    (96, 6, 1, (64, 128), False, False, 64),  # one step per row, MQA (6 heads share the lists walk)
    (256, 4, 2, (128, 128), False, True, 64),  # narrow: 64-key CTAs, 2 per block-mask column
    (64, 4, 2, (64, 64), False, False, 64),  # 64-key block-mask columns: the narrow variant at D=64
    (64, 4, 2, (128, 128), False, True, 128),  # 128 queries per step: one step per block-mask row
    (64, 2, 2, (256, 128), True, False, 128),  # 2 steps of 128 per block-mask row, per-head lists
])
def test_sparse_variant_compiles_to_hgmma(d, hq, hkv, block, per_head, causal, tile_m, tmp_path, monkeypatch):
    from torch_fa4.kernels.sm90 import bwd
    from torch_fa4.mods import create_block_mask
    from torch_fa4.mods.prepare import prepare
    from torch_fa4.mods.registry import lookup

    mask_mod = _document_mask(torch.zeros(256, dtype=torch.int32))
    bm = create_block_mask(mask_mod, None, hq if per_head else None, 256, 256, device="cpu", BLOCK_SIZE=block)
    key, aux = prepare(None, mask_mod)
    call = _call(d=d, hq=hq, hkv=hkv, causal=causal, mod_key=key, mods=lookup(key), aux_tensors=aux,
                 block_mask=tuple(bm.as_tensors()), block_mask_q=block[0], block_mask_kv=block[1])
    call.q = torch.empty(1, 256, hq, d, dtype=torch.bfloat16)
    call.k = call.v = torch.empty(1, 256, hkv, d, dtype=torch.bfloat16)
    assert bwd.unsupported_reason(call) is None
    vk = bwd.variant_key(call, False)
    tile_n = vk.tile_n
    assert tile_n == (64 if d > 128 or block[1] == 64 else 128)
    assert vk.tile_m == tile_m
    assert vk.sparse == (block[0] // tile_m, block[1] // tile_n)
    bwd.compile_variant(vk, dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    assert sass.count("HGMMA.") == 2 * (d // 16) + tile_n // 16 + 2 * (tile_m // 16)  # S, dP, dQ, dK, dV as above
    assert "UTMAREDG" in sass
    assert sass.count("LDL") + sass.count("STL") <= 64


def test_transposed_lists_are_the_tile_map_turned_around():
    from torch_fa4.kernels.sm90 import bwd_sparse
    from torch_fa4.mods import create_block_mask

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    doc = torch.sort(torch.randint(0, 5, (700,), generator=g)).values

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx + h * 64)

    bm = create_block_mask(mask_mod, None, 3, 600, 700, device="cpu", BLOCK_SIZE=128)
    call = AttentionCall(q=torch.empty(1, 600, 3, 64), k=torch.empty(1, 700, 3, 64), v=torch.empty(1, 700, 3, 64),
                         scale=1.0, block_mask=tuple(bm.as_tensors()))
    q_num, q_idx, full_num, full_idx = bwd_sparse.transposed_lists(call)
    classes = bm.tile_classes()  # (1, 3, nq, nkv)
    assert q_num.shape == (1, 3, 6) and q_idx.shape == (1, 3, 6, 5)
    for num, idx, cls in ((q_num, q_idx, 1), (full_num, full_idx, 2)):
        assert num.dtype == idx.dtype == torch.int32 and idx.is_contiguous()
        for h in range(3):
            for n in range(6):
                want = torch.nonzero(classes[0, h, :, n] == cls).flatten().tolist()
                got = idx[0, h, n, : num[0, h, n]].tolist()
                assert got == want  # ascending, exactly the tiles of that class
    assert int(q_num.sum() + full_num.sum()) == int((classes > 0).sum())
    assert int((classes == 1).sum()) > 0 and int((classes == 2).sum()) > 0 and int((classes == 0).sum()) > 0


def test_sparse_walk_refuses_what_it_cannot_walk():
    from torch_fa4.kernels.sm90 import bwd_sparse
    from torch_fa4.mods import create_block_mask
    from torch_fa4.mods.prepare import prepare
    from torch_fa4.mods.registry import lookup

    doc = torch.zeros(256, dtype=torch.int32)
    mask_mod = _document_mask(doc)
    key, aux = prepare(None, mask_mod)

    def call_with(block, sq=256, sk=256, **kw):
        bm = create_block_mask(mask_mod, None, None, 256, 256, device="cpu", BLOCK_SIZE=block)
        c = _call(d=64, mod_key=key, mods=lookup(key), aux_tensors=aux, block_mask=tuple(bm.as_tensors()),
                  block_mask_q=bm.BLOCK_SIZE[0], block_mask_kv=bm.BLOCK_SIZE[1], **kw)
        c.q, c.k, c.v = torch.empty(1, sq, 2, 64), torch.empty(1, sk, 2, 64), torch.empty(1, sk, 2, 64)
        return c

    assert bwd_sparse.sparse_walk_reason(call_with(128), False, 128) is None
    assert "deterministic" in bwd_sparse.sparse_walk_reason(call_with(128), True, 128)
    assert "multiple of 64" in bwd_sparse.sparse_walk_reason(call_with((96, 128)), False, 128)
    assert "multiple of 128" in bwd_sparse.sparse_walk_reason(call_with((128, 64)), False, 128)
    assert "covers fewer" in bwd_sparse.sparse_walk_reason(call_with(128, sk=300), False, 128)
    no_mod = call_with(128)
    no_mod.mods, no_mod.mod_key = None, ""
    assert "without a mask_mod" in bwd_sparse.sparse_walk_reason(no_mod, False, 128)


def _alibi_mods():
    slopes = torch.rand(4)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return score_mod, None


def _tanh_bias_document_mods():
    doc = torch.zeros(64, dtype=torch.int32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score * 0.5) * 2.0 + torch.where(q_idx >= kv_idx, 0.25, -0.5)

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return score_mod, mask_mod


@pytest.mark.parametrize("d,tile_m", [(128, 64), (64, 128)])
@pytest.mark.parametrize("make_mods", [_alibi_mods, _tanh_bias_document_mods])
def test_mods_variant_compiles_to_hgmma(make_mods, d, tile_m, tmp_path):
    from torch_fa4.kernels.sm90 import bwd
    from torch_fa4.mods.prepare import prepare
    from torch_fa4.mods.registry import lookup

    key, aux = prepare(*make_mods())
    call = _call(d=d, hq=4, hkv=2, causal=True, mod_key=key, mods=lookup(key), aux_tensors=aux)
    assert bwd.unsupported_reason(call) is None
    vk = bwd.variant_key(call, False)
    assert vk.tile_m == tile_m
    bwd.compile_variant(vk, dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    bodies = _step_bodies(vk, call)  # a score_mod alone keeps the split loops
    assert sass.count("HGMMA.") == bodies * (d // 16 * 2 + 128 // 16 + 2 * (tile_m // 16))
    assert sass.count("LDL") + sass.count("STL") <= 64
    assert sass.count("WARPGROUP.DEPBAR") <= 8 * bodies
    if make_mods is _alibi_mods:
        # the score_mod through the fragment emitter: kv_idx - q_idx in exact fp32 from one
        # conversion per step, not an I2F per element (a per-element lowering has 64 / 128 at
        # D128 / D64, plus ~9 elsewhere in the kernel, and the D64 variant's fused dq conversion
        # ~10 more in its integer divisions)
        assert sass.count("I2F") <= 32, sass.count("I2F")


def test_varlen_mods_variant_compiles_to_hgmma(tmp_path):
    """score_mod and mask_mod on packed varlen batches: the packed-rows variant, whose mods see
    each sequence's own positions and its index as b; refused where the batch would run one
    dense launch per sequence (each launch would see its sequence as batch 0)."""
    import dataclasses

    from torch_fa4.kernels.sm90 import bwd
    from torch_fa4.mods.prepare import prepare
    from torch_fa4.mods.registry import lookup

    key, aux = prepare(*_tanh_bias_document_mods())
    call = _call(d=128, hq=4, hkv=2, varlen=True, causal=True, mod_key=key, mods=lookup(key), aux_tensors=aux)
    assert bwd.unsupported_reason(call) is None
    assert "both sides" in bwd.unsupported_reason(dataclasses.replace(call, cu_seqlens_k=None))
    assert "packed-rows" in bwd.unsupported_reason(call, bwd.BwdTuning(varlen_kernel=False))
    vk = bwd.variant_key(call, False)
    assert vk.varlen and vk.mods_key == key
    bwd.compile_variant(vk, dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    bodies = _step_bodies(vk, call)
    assert sass.count("HGMMA.") == bodies * (128 // 16 * 2 + 128 // 16 + 2 * (64 // 16))
    assert sass.count("LDL") + sass.count("STL") <= 64


def test_score_mod_capturing_trainable_tensors_is_taken(monkeypatch):
    """dQ, dK, dV treat captured tensors as constants; their own gradients come from
    torch_fa4::bwd_captured (torch_fa4/mods/capture_grad.py), so the kernel takes the call."""
    from torch_fa4.kernels.sm90 import bwd
    from torch_fa4.mods.prepare import prepare
    from torch_fa4.mods.registry import lookup

    bias = torch.zeros(4, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    key, aux = prepare(score_mod, None)
    call = _call(d=64, hq=4, hkv=4, mod_key=key, mods=lookup(key), aux_tensors=aux)
    assert bwd.unsupported_reason(call) is None


def test_cta_tail_groups_the_last_pairs_only_under_masks():
    # cta_tail: how many (kv head, batch) pairs start as one group at the end of the grid
    from torch_fa4.kernels.sm90 import bwd_variant as bwd

    def call(s, d, hq=2, hkv=2, **kw):
        q = torch.empty(1, s, hq, d, dtype=torch.bfloat16, device="meta")
        k = torch.empty(1, s, hkv, d, dtype=torch.bfloat16, device="meta")
        return AttentionCall(q=q, k=k, v=k, scale=1.0, **kw)

    assert bwd.cta_tail(call(1024, 64), pairs=512) == 1  # no mask: every CTA walks as far
    # a pair's query side: S x group x (D x (2 + 4) + Dv x 2) bytes, 16 MB of them, at most 16 pairs
    assert bwd.cta_tail(call(1024, 64, causal=True), pairs=512) == 16
    assert bwd.cta_tail(call(4096, 128, causal=True), pairs=64) == 4
    assert bwd.cta_tail(call(16384, 128, causal=True), pairs=16) == 1
    assert bwd.cta_tail(call(4096, 128, hq=8, hkv=2, causal=True), pairs=64) == 1  # GQA: 4 heads a pair
    assert bwd.cta_tail(call(1024, 64, window_left=128, window_right=0), pairs=512) == 16
    assert bwd.cta_tail(call(1024, 64, causal=True), pairs=3) == 3  # never more than the grid has


_DISK_CACHE_SCRIPT = r"""
import sys, torch
from torch_fa4.call import AttentionCall
from torch_fa4.kernels import compile_cache
from torch_fa4.kernels.sm90 import bwd, bwd_dq_convert, bwd_prepare
q = torch.randn(1, 256, 4, 64).bfloat16()
call = AttentionCall(q=q, k=q, v=q, scale=0.1, causal=True)
lse, stats = torch.zeros(1, 4, 256), torch.empty(1, 4, 256)
results = []
def attempt(fn):
    try:
        fn()
        results.append("ran")
    except ValueError as e:  # TVM-FFI's check of the CPU tensors, after the kernel was found
        results.append("device-check" if "device_type=cuda" in str(e) else str(e)[:200])
g = lambda: torch.empty_like(q)
attempt(lambda: bwd.backward(call, g(), g(), lse, g(), g(), g(), False))
attempt(lambda: bwd_prepare.compile_kernel(torch.bfloat16, 64, d_zero=64)(q, q, lse, stats, stats, torch.empty(1, 256, 4, 64)))
attempt(lambda: bwd_dq_convert.compile_kernel(torch.bfloat16)(torch.empty(64), torch.empty(64).bfloat16(), 1.0))
print("RESULT", ",".join(results), compile_cache.stats()["from_disk"], "cutlass" in sys.modules)
"""


@pytest.mark.parametrize("setting", ["default", "0"])
def test_backward_kernels_load_from_disk_in_a_new_process(tmp_path, setting):
    """The disk cache (on by default, TORCH_FA4_KERNEL_CACHE=0 off) covers the backward's three
    kernels: the first process compiles and stores them, the second loads all three without
    importing CuTe DSL, and their launches bind the host's arguments (up to TVM-FFI's device check
    of these CPU tensors); off, every process compiles and nothing is stored."""
    from _fresh_process import result_fields

    env = dict(os.environ, TORCH_FA4_CACHE_DIR=str(tmp_path), CUTE_DSL_ARCH="sm_90a")
    env.pop("TORCH_FA4_KERNEL_CACHE", None)
    if setting != "default":
        env["TORCH_FA4_KERNEL_CACHE"] = setting
    results = [result_fields(_DISK_CACHE_SCRIPT, env, timeout=600) for _ in range(2)]
    checks = ",".join(["device-check"] * 3)
    assert results[0] == [checks, "0", "True"], results[0]  # compiled (and stored, by default)
    stored = list((tmp_path / "kernels").glob("*.so")) if (tmp_path / "kernels").exists() else []
    if setting == "default":
        assert results[1] == [checks, "3", "False"], results[1]  # loaded; the DSL never imported
        assert len(stored) == 3
    else:
        assert results[1] == [checks, "0", "True"], results[1]
        assert not stored


# ---- launch records (bwd_launch_record): repeated dense calls replayed, with emulated kernels
@pytest.mark.parametrize("case", ["causal_gqa", "plain_split", "conversion_pass", "one_sequence_window",
                                  "packed_causal_gqa", "packed_window"])
def test_launch_record_replays_the_general_path(case, monkeypatch):
    """A dense call's or a packed batch's second and later backwards run from its launch record
    (the main kernel, the row-statistics pass and the dq conversion emulated on the CPU): the
    same gradients as the general path and float64 autograd, one record per shape and knob
    setting; a packed batch with new offsets of the same count reuses its record."""
    import math

    import test_sm90_bwd_prepare_compile as prepare_tests

    from torch_fa4.kernels.sm90 import bwd, bwd_dq_convert, bwd_launch_record, bwd_prepare

    monkeypatch.setattr(bwd, "compile_variant", _emulated_kernel)
    monkeypatch.setattr(bwd_prepare, "compile_kernel", lambda *a, **kw: prepare_tests._emulated)
    monkeypatch.setattr(bwd_prepare, "unsupported_reason", lambda *a: None)
    monkeypatch.setattr(bwd_dq_convert, "compile_kernel",
                        lambda *a, **kw: lambda src, dst, scale: dst.copy_(src * scale))
    monkeypatch.setattr(bwd_dq_convert, "takes", lambda src, dst: True)  # (it asks for CUDA tensors)
    monkeypatch.setattr(bwd_launch_record, "_on_gpu", lambda t: True)
    monkeypatch.setattr(bwd_launch_record, "_records", {})
    tuning = bwd.BwdTuning()
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(torch.bfloat16)
    hq, hkv, d, kw = 4, 2, 64, {}
    if case == "causal_gqa":
        b, sq, sk, kw = 2, 70, 50, dict(causal=True)
    elif case == "plain_split":  # 12 work tiles on 5 CTAs: the last round's 2 tiles split in 2
        b, sq, sk = 2, 1024, 290
        tuning = bwd.BwdTuning(persistent_ctas=5)
    elif case == "conversion_pass":  # (the 64-query D128 variant)
        b, sq, sk, kw, d = 2, 130, 130, dict(causal=True), 128
    elif case == "one_sequence_window":  # batch 1: size-one strides repacked for the compiled signatures
        b, sq, sk, kw = 1, 90, 120, dict(window_left=20, window_right=3, softcap=5.0)
    packed = case.startswith("packed")
    if packed:  # sequences of 3, 147 and 21 queries starting at rows no tile aligns to
        cu_q, cu_k = torch.tensor([0, 3, 150, 171], dtype=torch.int32), torch.tensor([0, 90, 95, 230], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=147, max_seqlen_k=135,
                  **(dict(causal=True) if case == "packed_causal_gqa" else dict(window_left=30, window_right=5)))
        q, k, v, do = rnd(171, hq, d), rnd(230, hkv, d), rnd(230, hkv, d), rnd(171, hq, d)
    else:
        q, k, v, do = rnd(b, sq, hq, d), rnd(b, sk, hkv, d), rnd(b, sk, hkv, d), rnd(b, sq, hq, d)
    call = AttentionCall(q=q, k=k, v=v, scale=d**-0.5, **kw)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out64, lse = naive_varlen(q64, k64, v64, **call_options(call), differentiable=True)
    ref = torch.autograd.grad(out64, (q64, k64, v64), do.double())
    out, lse = out64.detach().to(torch.bfloat16), lse.detach().float()

    def grads(record: bool):
        if not record:
            monkeypatch.setattr(bwd_launch_record, "run", lambda *a: False)
        got = [torch.full(t.shape, math.nan, dtype=t.dtype) for t in (q, k, v)]
        bwd.backward(call, do, out, lse, *got, False, tuning)
        return got

    real_run = bwd_launch_record.run
    general = grads(record=False)
    monkeypatch.setattr(bwd_launch_record, "run", real_run)
    first, second = grads(record=True), grads(record=True)
    records = list(bwd_launch_record._records.values())
    assert len(records) == 1 and isinstance(records[0], bwd_launch_record.LaunchRecord)
    for name, a, bb, c, r in zip(("dq", "dk", "dv"), general, first, second, ref):
        assert not torch.isnan(bb).any(), f"{name}: rows left unwritten"
        assert torch.equal(bb, c), f"{name}: the record's replays differ"
        err = (bb.double() - r).norm() / r.norm()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"
        assert (bb.double() - a.double()).abs().max() <= 0.02 * r.abs().max(), f"{name}: record and general path differ"
    if case == "plain_split":
        assert records[0].scalars[9:11] == (2, 2)  # (split tiles, ways)
    assert bool(records[0].stat_tile) == packed
    tuning = bwd.BwdTuning(persistent_ctas=3)  # another tuning: a record of its own
    grads(record=True)
    assert len(bwd_launch_record._records) == 2
    if packed:
        # other lengths in the same number of sequences (171 and 230 rows as before): the same
        # record, and the statistics and gradients follow the new offsets
        cu_q2, cu_k2 = torch.tensor([0, 100, 101, 171], dtype=torch.int32), torch.tensor([0, 40, 170, 230], dtype=torch.int32)
        kw2 = dict(kw, cu_seqlens_q=cu_q2, cu_seqlens_k=cu_k2)
        call = AttentionCall(q=q, k=k, v=v, scale=d**-0.5, **kw2)
        out64, lse = naive_varlen(q64, k64, v64, **call_options(call), differentiable=True)
        ref = torch.autograd.grad(out64, (q64, k64, v64), do.double())
        out, lse = out64.detach().to(torch.bfloat16), lse.detach().float()
        for name, got, r in zip(("dq", "dk", "dv"), grads(record=True), ref):
            assert not torch.isnan(got).any(), f"{name}: rows left unwritten"
            err = (got.double() - r).norm() / r.norm()
            assert err < 1e-2, f"{name}: relative error {err:.2e} with new offsets"
        assert len(bwd_launch_record._records) == 2
        call = AttentionCall(q=q, k=k, v=v, scale=d**-0.5, **dict(kw2, max_seqlen_k=140))  # the grid's size
        grads(record=True)
        assert len(bwd_launch_record._records) == 3
        assert sorted(r.scalars[5] for r in bwd_launch_record._records.values()) == [135, 135, 140]
        monkeypatch.setattr(bwd_launch_record, "_records", {})  # without max_seqlen_q: the general path
        call = AttentionCall(q=q, k=k, v=v, scale=d**-0.5, **dict(kw2, max_seqlen_q=0))
        grads(record=True)
        assert not bwd_launch_record._records




@pytest.mark.parametrize("kw", [dict(d=128), dict(d=64, causal=True), dict(d=256)], ids=["d128", "d64_causal", "d256"])
def test_key_tail_variant_masks_the_tail(kw, tmp_path):
    """Dense keys ending inside a key tile compile the variant that masks the tail's keys (their
    zero-filled K / V still give P = exp2(-lse2), which can overflow dS); whole tiles do not."""
    import dataclasses

    from torch_fa4.kernels.sm90 import bwd

    whole = bwd.variant_key(_call(sk=256, **kw), False)
    tail = bwd.variant_key(_call(sk=257, **kw), False)
    assert not whole.mask_key_tail and tail.mask_key_tail
    assert dataclasses.replace(tail, mask_key_tail=False) == whole
    assert not bwd.variant_key(_call(sk=255, seqused=True, **kw), False).mask_key_tail  # masked anyway
    call = _call(sk=257, **kw)
    _compiled_and_checked(tail, call, tmp_path)
