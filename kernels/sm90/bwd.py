"""sm90 backward entry point: which calls the kernel takes, and running it.

`backward` = preprocessing (dPsum = rowsum(dO * O), LSE in log2 units) -> the CuTe DSL kernel
(bwd_kernel.py) -> dQ fp32 -> dtype. The row statistics (lse in log2 units, rowsum(dO * O)) come
from one fused pass (bwd_prepare.py); dQ's fp32 -> dtype conversion is one more pass
(bwd_dq_convert.py; it applies the softmax scale, which the kernel leaves out of dQ).
Kernels compile once per `variant_key` (dtype, head dims, GQA group, mask kinds, softcap on/off,
varlen, determinism, key tile, ring stages and queries per step, dQ order and writer warp,
block-mask tile ratios, mods key, L2 hints, split tail); shapes, strides, scale, softcap value, window
sizes, captured mod tensors, block-mask lists and the split tail's plan are runtime arguments, so new
sizes or values never recompile, except that a plain D64 launch whose last round splits
(`split_plan`) takes the variant with the split code (one more compile, once).

Takes: fp16/bf16, head dims 64/96/128/192/256 (Dv may differ; above 128 the narrow 64-key
variant, see `tiles`), causal, sliding window, softcap, GQA/MQA, seqused_k, any 16-byte-aligned
strides, deterministic dQ. Varlen (cu_seqlens) runs one launch of the packed-rows variant for the
batch, deterministic mode and mods included (one dense launch per sequence with one side packed
or with TORCH_FA4_BWD_VARLEN_KERNEL=0; `runs_per_sequence`). score_mod/mask_mod are lowered into
the kernel (derivative from the traced graph; validated on an H200 by
tests/gpu/test_sm90_bwd.py::test_mods). A block mask drives the walk when it can (bwd_sparse.py:
dense batches, not deterministic, block-mask tiles multiples of the kernel's query rows per step
(64, or 128 in the D64 variant: else that call steps 64 rows) and 128 keys, or 64 keys, which then
selects the 64-key variant): each KV tile visits only the query tiles the mask lists for it and
evaluates the mask_mod on partial tiles only. Otherwise the
mask_mod is evaluated on every tile of the dense walk: slower, same result.
"""

from __future__ import annotations

import functools
import math
import os
from typing import TYPE_CHECKING, NamedTuple

import torch

from torch_fa4 import env_vars
from torch_fa4.kernels.common import shape_memo
from torch_fa4.kernels.sm90 import bwd_dq_convert, bwd_launch_record, bwd_prepare
from torch_fa4.kernels.sm90.bwd_buffers import (counter_shape, split_counters, split_workspace_shape,
                                                writes_dq_directly, zeroed_counters)
from torch_fa4.tensor_memo import TensorMemo

if TYPE_CHECKING:
    from torch_fa4.call import AttentionCall

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
_TILE_M = 64  # queries per kernel step everywhere but the D64 choice below
_SMEM_LIMIT = 227 * 1024  # dynamic shared memory per CTA on sm_90

# Queries per kernel step at head dims <= 64 (D = Dv = 64, 128-key CTAs): 64, or 128 (128 x 128
# steps: S^T / dP^T of 64 keys x 128 queries per consumer warpgroup, dQ split by rows; see
# bwd_kernel). 128 is the default: on an H100 it ran +13-33% over 64 queries on every D64 row of
# the benchmark, and its one-pass form +9-14% over "two" (NOTES "Experiment 18").
# _D64_PASSES picks how the 128-query variant forms dS (bwd_kernel `passes`):
# "two" (P while dP^T runs, dS from the bf16 P, dQ epilogue under the next step's products),
# "one" (P and dS in fp32 after both products land, no dQ-epilogue overlap) or
# "split" (P in fp32 while dP^T runs, dS from that fp32 P once dP^T landed, then dV; flash-attn-4's
# order: within 0-5% of "one" on an H100, NOTES Experiment 41; with the separate Q / dO barriers
# and dV issued after the dS^T stores, the default: NOTES Experiment 54).
# Environment overrides, read on every call (benchmarks/bench.py --sweep bwd-tiles sets them):
#   TORCH_FA4_BWD_TILE_M=64|128     TORCH_FA4_BWD_PASSES=two|one|split
# Calls the 128-query variant does not take keep 64: head dims above 64, 64-key CTAs (block masks
# of 64-key columns), block masks whose query tile is not a multiple of 128 (they keep their
# block-sparse walk at 64 queries per step). Causal, window, softcap (always one pass), GQA,
# seqused_k, deterministic mode and mods all run with 128.
_D64_TILE_M = 128
_D64_PASSES = "split"
TILE_M_ENV = "TORCH_FA4_BWD_TILE_M"
PASSES_ENV = "TORCH_FA4_BWD_PASSES"
# Order of the last two products of a step (bwd_kernel `dq_under_dk`) on the 128-key variants: "1"
# issues dQ before dK and stages dQ while dK runs; "0" issues dK first and stages dQ under the next
# step's products. With the dQ writer warp, "1" measured +5-9% at D128 and D64 non-causal, -1-2%
# at D64 causal (H100, NOTES "Experiment 26").
DQ_FIRST_ENV = "TORCH_FA4_BWD_DQ_FIRST"
_DQ_FIRST = "1"
# Queries per kernel step at D = Dv = 128 (128-key CTAs) for calls without a causal / window mask,
# softcap, mods, block mask or deterministic mode: 64, or 80 (flash-attn-4's tile there; dQ
# computed as dQ^T = K^T dS^T). 64 stays the default: on an H100 the 80-query variant ran 1-2%
# below it in one pass and 8-11% below in two (NOTES Experiment 42).
# TORCH_FA4_BWD_D128_TILE_M=64|80 overrides.
D128_TILE_M_ENV = "TORCH_FA4_BWD_D128_TILE_M"
_D128_TILE_M = "64"
# How the 80-query variant forms dS (as _D64_PASSES; "split" does not fit its registers):
# TORCH_FA4_BWD_D128_PASSES=one|two.
D128_PASSES_ENV = "TORCH_FA4_BWD_D128_PASSES"
_D128_PASSES = "one"
# Programmatic dependent launch between the backward's three kernels (bwd_kernel `pdl`, the dQ
# conversion's too): the main kernel's prologue and K / V loads overlap the row-statistics pass,
# and the conversion is scheduled under the main kernel's last wave. TORCH_FA4_BWD_PDL=0|1.
PDL_ENV = "TORCH_FA4_BWD_PDL"
# Separate ring barriers for Q + LSE and dO + dPsum on the 128-query variant (bwd_kernel
# `split_ring`: S^T issued once Q has landed, as flash-attn-4 does), for walks without a right
# limit. H100, NOTES Experiment 45: +0.4-4.3% on five of the six D64 rows, -1.4% on S4k causal.
# Re-timed on today's kernel (H200, GPU time, NOTES Experiment 157): the plain rows still gain
# (S16k +1.9%, S1k +0.8%, S4k +0.4%); walks with a right limit lose (S16k causal -0.5 to -0.7% in
# three probes, S4k causal -0.6%, window 1024 causal -1.1% at S16k and -1.7% at S4k), so those
# take the single barrier.
# TORCH_FA4_BWD_SPLIT_RING=0|1 forces either.
SPLIT_RING_ENV = "TORCH_FA4_BWD_SPLIT_RING"
# dV issued after the dS^T stores on the one-pass / split wide variants (bwd_kernel `dv_after_ds`):
# with "split" the traced D64 step went from 4989 to 4692 cycles and the kernel ran 3-5% faster
# (H100, NOTES Experiment 54). TORCH_FA4_BWD_DV_AFTER_DS=0 gives the old order back.
DV_AFTER_DS_ENV = "TORCH_FA4_BWD_DV_AFTER_DS"
_DV_AFTER_DS = "1"
# Persistent kernel (bwd_kernel `persistent`: one CTA per SM takes the work tiles from a counter)
# on the dense 128-key variants without deterministic mode, varlen or block masks: on an H100
# +1-6% on the causal rows and on D128, level on D64 without a mask (NOTES Experiment 56).
# TORCH_FA4_BWD_PERSISTENT=0 gives one CTA per tile back; TORCH_FA4_BWD_PERSISTENT_CTAS=N caps
# the grid at N CTAs (a runtime argument: tests give each CTA many tiles with it).
PERSISTENT_ENV = "TORCH_FA4_BWD_PERSISTENT"
_PERSISTENT = "1"
PERSISTENT_CTAS_ENV = "TORCH_FA4_BWD_PERSISTENT_CTAS"
# The dQ TMA adds from a dedicated warp (producer warp 1, bwd_kernel `dq_writer_warp`) instead of
# each consumer warpgroup's leader warp: on for the 128-key variants (separate dQ slabs);
# TORCH_FA4_BWD_DQ_WARP=0 gives the leader-warp adds back, =1 is the default. The 64-key variants
# keep the leader adds (dQ staged in the ring needs them; D192 is not converted).
DQ_WARP_ENV = "TORCH_FA4_BWD_DQ_WARP"
# Varlen batches (cu_seqlens_q and _k) in one launch of the kernel's packed-rows variant (per
# sequence row offsets; the row statistics at tile-aligned offsets, varlen_stat_layout), the
# default; TORCH_FA4_BWD_VARLEN_KERNEL=0 runs one dense launch per sequence instead (the way
# calls with only one side packed always run; mods are then refused: each launch would see its
# sequence as batch 0).
VARLEN_KERNEL_ENV = "TORCH_FA4_BWD_VARLEN_KERNEL"
_VARLEN_KERNEL = "1"
# Phase tracing, a measuring tool (benchmarks/bwd_trace.py): TORCH_FA4_BWD_TRACE=N compiles a
# variant that stamps a clock at bwd_kernel.TRACE_EVENTS of the first N steps of the CTAs of batch
# 0, KV head 0 (TORCH_FA4_BWD_TRACE_PAIR=b:hkv picks another pair: batch 0, head 0 run in the
# first wave); `backward` leaves them in LAST_TRACE, (key tiles, 2 warpgroups, N, events) int32,
# followed by every CTA's start / end / SM (bwd_kernel._stamp_cta).
# Not with deterministic mode (the stamps go through the semaphore argument).
TRACE_ENV = "TORCH_FA4_BWD_TRACE"
TRACE_PAIR_ENV = "TORCH_FA4_BWD_TRACE_PAIR"
LAST_TRACE = None
# Every k-th column of P computed with the FMA-pipe polynomial instead of MUFU ex2 (bwd_kernel
# `exp2_emulate_every`): TORCH_FA4_BWD_EXP2_EMU=k, 0 = all hardware ex2.
EXP2_EMU_ENV = "TORCH_FA4_BWD_EXP2_EMU"
_EXP2_EMU = "0"
# dP^T's accumulator initialised to -dPsum (bwd_kernel `fold_dpsum`, the 64-query two-pass path):
# TORCH_FA4_BWD_FOLD_DPSUM=1|0; on: +0.4-5% on the D128 rows (H100, NOTES Experiment 31).
FOLD_DPSUM_ENV = "TORCH_FA4_BWD_FOLD_DPSUM"
_FOLD_DPSUM = "1"
# L2 eviction priorities (bwd_kernel `l2_hints`, kernels/common/l2_hints.py): Q, dO and the row
# statistics, which every key tile of a head reads, and the fp32 dQ buffer, which every key tile
# adds to and the conversion pass reads last, evict-last; K and V, read by one CTA, evict-first.
# TORCH_FA4_BWD_L2_HINTS=0|1|loads|last (loads: the loads' hints only, not the dQ adds'; last: only
# the loads' evict-last ones). H100: the loads' hints +1-2% on most S4k / S16k rows, level at S1k
# (NOTES "Experiment 68"); the dQ adds' evict-last +0.3% at D128 S1k / S4k / S16k causal, +0.9%
# at D64 S1k causal, in GPU time (Experiment 128).
L2_HINTS_ENV = "TORCH_FA4_BWD_L2_HINTS"
_L2_HINTS = "1"
# Causal / right-window walks from the last query tile down to the diagonal (bwd_kernel
# `descending_walk`, bwd_q_walk.DenseQWalk): the CTAs in flight read the same Q / dO tiles at once.
# TORCH_FA4_BWD_DESCENDING=0|1. On: H100, NOTES "Experiment 76", two sweeps: S16k causal +0.5-1.2%,
# S4k causal -1.3% to +1.5%, S1k causal level.
DESCENDING_ENV = "TORCH_FA4_BWD_DESCENDING"
_DESCENDING = "1"
# dQ computed transposed (bwd_kernel `dq_transposed`: dQ^T = K^T dS^T, stored to its slab as
# 32-bit stores free of bank conflicts instead of 64-bit ones that conflict), where each
# warpgroup's part of the head dim is 64: D128 at 64 queries per step, D64 at 128. On by default
# wherever it applies. H100: D128 (NOTES "Experiment 79", two sweeps) +3-7% at S4k, +1-3% at S4k
# causal, +4% at S16k causal, level at S16k; D64 (Experiment 82, three rounds) +2-4% on every row.
# TORCH_FA4_BWD_DQ_T=0 turns it off, =1 is the default.
DQ_T_ENV = "TORCH_FA4_BWD_DQ_T"
# Row statistics (LSE, dPsum) in bwd_stats_layout's permuted order, read as 16-byte vectors
# (bwd_kernel `permuted_stats`; dense 128-key variants). TORCH_FA4_BWD_STATS_T=0|1.
STATS_T_ENV = "TORCH_FA4_BWD_STATS_T"
# A score_mod through the fragment emitter (kernels/common/mod_fragment.py, as the forward does):
# values hoisted per query / key / offset, exact fp32 rewrites of index arithmetic (no per-element
# int -> float conversion on the MUFU's pipe), a tile value times an affine expression as one fma
# per offset; else per element (mod_lowering.score_mod_value). TORCH_FA4_BWD_MOD_FRAGMENT=0|1, on
# by default: H100, NOTES "Experiment 92", ALiBi D128 S4k +3.5% causal, +5% without a mask, D64
# S4k causal +6% (and the D64 variant's spills gone).
MOD_FRAGMENT_ENV = "TORCH_FA4_BWD_MOD_FRAGMENT"
_STATS_T = "0"
_MOD_FRAGMENT = "1"
# Walks with a causal / window / length limit and no mask_mod run the steps that cross a limit and
# those that do not in loops of their own, each with one P / dS body, instead of one loop that
# tests every step and holds both (bwd_kernel `split_mask_loops`; NOTES "Experiment 124").
# TORCH_FA4_BWD_SPLIT_MASK_LOOPS=0|1.
SPLIT_MASK_LOOPS_ENV = "TORCH_FA4_BWD_SPLIT_MASK_LOOPS"
_SPLIT_MASK_LOOPS = "1"
# The persistent kernel stages dK in the dS^T slots and dV in a buffer of its own where the slots
# cannot hold both (64 queries per step: D96, D128) and shared memory has room, so both TMA stores
# go out together and a tile's epilogue waits for one store read instead of two in a row
# (bwd_kernel `own_dv_stage`). TORCH_FA4_BWD_OWN_DV_STAGE=0|1.
OWN_DV_STAGE_ENV = "TORCH_FA4_BWD_OWN_DV_STAGE"
_OWN_DV_STAGE = "1"
# The persistent kernel writes dq itself: the key tile whose dQ add completes a query tile queues
# it for otherwise idle warps that scale and narrow it (bwd_dq_fused.py), instead of a conversion
# pass over the whole fp32 buffer after the kernel. The 128-query variants (D64) where every query
# tile sees a key (`fused_dq_applies`): H100, NOTES "Experiment 127", GPU time per call against the
# conversion pass, D64 S1k causal +1.6%, S1k +5%, S4k causal +2.9%, S16k +4%; at 64 queries per
# step (D96, D128) the per-step hand-off cost more than the pass (D128 -2.2% to +0.2%). Past
# _FUSED_DQ_MAX_SEQLEN_Q queries the pass is faster on today's kernel (NOTES "Experiment 158", GPU
# time, pass against fused: H200 S16k causal +2.0% in two probes, S8k causal +1.2%, S16k +1.0%;
# H100 S16k causal +1.0%, S8k causal +0.3%, S16k +1.0%; at S4k causal fused still leads by 0.5%).
# Session 39 confirmed it (H200, pass against fused: S16k causal +2.0%, S8k causal +1.5%) and found
# a longer hand-off lag in the writer (3 or 4 steps instead of 2) level to -0.5% (Experiment 159).
# TORCH_FA4_BWD_FUSED_DQ=auto (up to that length, the default) | 1 (at any length) | 0 (never).
FUSED_DQ_ENV = "TORCH_FA4_BWD_FUSED_DQ"
_FUSED_DQ = "auto"
_FUSED_DQ_MAX_SEQLEN_Q = 4096
# The passes around the main kernel take their slabs in the reverse of its (batch, head) order, so
# each meets the other's last lines in L2: the row-statistics pass ends on the pairs the main
# kernel starts with, and the conversion starts on the last batch, whose dQ adds landed last.
# H100, GPU time (NOTES "Experiment 128"): D128 S1k causal +1.0%, S1k +0.5%, D64 S1k causal +0.9%,
# level at S4k / S16k. TORCH_FA4_BWD_PASS_ORDER=natural|prepare|convert|both (the passes reversed).
PASS_ORDER_ENV = "TORCH_FA4_BWD_PASS_ORDER"
_PASS_ORDER = "both"
# Extra ptxas flags for the main kernel, passed through cute.compile's --ptxas-options (they change
# the schedule, never the results): TORCH_FA4_BWD_PTXAS="--register-usage-level=10", say. The
# forward's D64 default took that level (NOTES "Experiment 134"); on the D64 backward levels 8
# and 10 lost 1-2% on the causal rows (session 31), so none is the default.
PTXAS_ENV = "TORCH_FA4_BWD_PTXAS"
# The split tail (bwd_kernel `split_tail`, kernels/common/split_tail.py): the last round's work
# tiles run as pieces of consecutive query tiles on the SMs the round leaves idle. Plain dense
# calls (no causal or window limit, softcap, mods, seqused_k or varlen) on the persistent kernel,
# whose tiles all walk the same steps; `split_plan` decides per launch (a piece costs about
# _SPLIT_PIECE_COST_STEPS steps besides its own: its K / V load, the pipeline's fill, the partial
# sums' store and merge), and launches that do not split run the variant without the split code.
# By default the 128-query (D64) variant only. H100, GPU time (NOTES "Experiment 141"), against
# flash-attn-4, no split code / split: D64 S16k 0.984 / 1.007, S4k 0.995 / 1.019 (4096 tiles on
# 132 SMs: a last round of 4 tiles, split 8 ways); at D128 the split code alone (no split) cost
# 1.7% (S16k) and 1.5% (S4k), as much as the split gained. TORCH_FA4_BWD_SPLIT_TAIL=0 (off) | 1
# (automatic, the default) | k (k pieces wherever a round is left partial, at any head dim;
# measuring) | noop (the split code without a split, at any head dim; measuring).
SPLIT_TAIL_ENV = "TORCH_FA4_BWD_SPLIT_TAIL"
_SPLIT_PIECE_COST_STEPS = 4.0
_SPLIT_MIN_STEPS = 4
_SPLIT_MAX_WAYS = 8
_PTXAS = ""


class KernelTiles(NamedTuple):
    """The kernel-shaping part of a variant key (variant_key()[-3]): what bwd_kernel is built with."""

    tile_n: int  # keys per CTA
    stages: int  # Q / dO ring stages
    dq_in_ring: bool  # dQ staged in the consumed Q / dO buffers
    tile_m: int  # queries per step
    passes: str | None  # how the 128- / 80-query variants form dS (None at 64)
    dq_first: bool  # dQ issued before dK
    dq_writer_warp: bool  # dQ adds from a dedicated warp
    trace: object  # 0, or (steps, batch, kv head) of the traced CTAs
    exp2_emulate: int  # every k-th column's exp2 on the FMA pipe (0: none)
    fold_dpsum: bool  # dP^T's accumulator started at -dPsum
    pdl: bool  # programmatic dependent launch
    split_ring: bool  # separate Q / dO ring barriers
    dv_after_ds: bool  # dV issued after the dS^T stores
    persistent: bool  # one CTA per SM taking work tiles from a counter
    l2_hints: str  # "0", "1", "loads" or "last"
    descending: bool  # causal walks from the last query tile down
    dq_transposed: bool  # dQ^T = K^T dS^T
    permuted_stats: bool  # row statistics in bwd_stats_layout's order
    mod_fragment: bool  # the score_mod through the fragment emitter (per element otherwise)
    split_mask_loops: bool  # masked and unmasked steps in loops of their own
    own_dv_stage: bool  # persistent: dV staged in its own shared-memory buffer
    fused_dq: bool  # persistent: dq written by the kernel (no conversion pass)
    ptxas_options: str = ""  # extra ptxas flags (PTXAS_ENV)
    split_tail: bool = False  # persistent: the last round's tiles may run as pieces (SPLIT_TAIL_ENV)
    # dense keys ending inside a key tile: mask the tail's keys (see bwd_kernel's mask_k)
    mask_key_tail: bool = False


def _env_choice(name: str, default: str, allowed: tuple) -> str:
    value = env_vars.get(name, "").strip()
    if not value:
        return default
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {allowed}")
    return value


def query_tile(d: int, dv: int, tile_n: int) -> tuple[int, str | None]:
    """(queries per kernel step, how the 128-query variant forms dS: _D64_PASSES; None at 64
    queries) for head dims d, dv with `tile_n` keys per CTA."""
    if tile_n == 128 and max(d, dv) <= 64:
        tile_m = int(_env_choice(TILE_M_ENV, str(_D64_TILE_M), ("64", "128")))
        if tile_m == 128:
            return tile_m, _env_choice(PASSES_ENV, _D64_PASSES, ("two", "one", "split"))
        return tile_m, None
    return _TILE_M, None


def _takes_80_queries(call: "AttentionCall", deterministic: bool) -> bool:
    """Whether a dense 128-key call at D = Dv = 128 runs 80 queries per step (D128_TILE_M_ENV)."""
    plain = (call.head_dim == call.head_dim_v == 128 and not call.causal and call.window_left < 0
             and call.window_right < 0 and not call.softcap and call.mods is None
             and not call.block_mask and not deterministic)
    return plain and _env_choice(D128_TILE_M_ENV, _D128_TILE_M, ("64", "80")) == "80"


def tiles(d: int, dv: int, tile_n: int | None = None, tile_m: int = _TILE_M) -> tuple[int, int, bool]:
    """(keys per CTA, Q/dO ring stages, dQ staged in the ring) for head dims d, dv (tile_n: force
    64 or 128 keys; tile_m: queries per step).

    dK and dV of a key tile live in fp32 registers for the whole walk: 128 keys fit up to D=128
    (two warpgroups of 64 keys); beyond that the narrow variant shares 64 keys between the
    warpgroups (each holds half the head dim). Two stages of the Q / dO ring with separate dQ
    slabs where shared memory allows (D=192: ~210 KB); else two stages with dQ staged in the
    consumed Q / dO buffers (D=256: ~210 KB instead of ~274 KB; needs Dv >= D); else one stage.
    """
    if tile_n is None:
        tile_n = 128 if max(d, dv) <= 128 else 64
    if _smem_bytes(d, dv, tile_n, 2, False, tile_m) <= _SMEM_LIMIT:
        return tile_n, 2, False
    if tile_m == _TILE_M and dv >= d and _smem_bytes(d, dv, tile_n, 2, True) <= _SMEM_LIMIT:
        return tile_n, 2, True
    return tile_n, 1, False


def split_ring(tile_m: int, right_limit: bool) -> bool:
    """Whether the variant with `tile_m` queries per step gives Q and dO ring barriers of their own
    (walks with a causal / right-window limit: `right_limit`); see SPLIT_RING_ENV."""
    default = "0" if right_limit else "1"
    return tile_m == 128 and _env_choice(SPLIT_RING_ENV, default, ("0", "1")) == "1"


def _separate_dq_slabs(tile_n: int, dq_in_ring: bool) -> bool:
    """The 128-key variants, whose dQ goes through its own shared-memory slabs: where the dQ order
    and the writer warp apply."""
    return tile_n == 128 and not dq_in_ring


def dq_writer_warp(tile_n: int, dq_in_ring: bool) -> bool:
    """Whether the variant with `tile_n` keys per CTA issues its dQ adds from a dedicated warp."""
    on = _env_choice(DQ_WARP_ENV, "1", ("0", "1")) == "1"
    return on and _separate_dq_slabs(tile_n, dq_in_ring)


def persistent(call: "AttentionCall", deterministic: bool, tile_n: int, dq_in_ring: bool, sparse) -> bool:
    """Whether the variant runs persistent (PERSISTENT_ENV): dense 128-key variants with the dQ
    writer warp, without deterministic mode or varlen."""
    on = _env_choice(PERSISTENT_ENV, _PERSISTENT, ("0", "1")) == "1"
    return (on and tile_n == 128 and dq_writer_warp(tile_n, dq_in_ring) and not deterministic
            and not call.is_varlen and sparse is None)


def reversed_passes() -> tuple[bool, bool]:
    """(row-statistics pass reversed, dq conversion reversed): PASS_ORDER_ENV."""
    order = _env_choice(PASS_ORDER_ENV, _PASS_ORDER, ("natural", "prepare", "convert", "both"))
    return order in ("prepare", "both"), order in ("convert", "both")


def pdl() -> bool:
    """Whether the backward's kernels launch as programmatic dependents (PDL_ENV)."""
    return _env_choice(PDL_ENV, "1", ("0", "1")) == "1"


def dq_transposed(d: int, dv: int, tile_n: int, tile_m: int, dq_in_ring: bool) -> bool:
    """Whether the variant computes dQ^T = K^T dS^T (DQ_T_ENV): where each warpgroup's share of
    dQ^T is 64 head-dim rows, D128 at 64 queries per step and D64 at 128."""
    applies = (tile_n == 128 and not dq_in_ring and dv <= 128
               and (tile_m == _TILE_M and d == 128 or tile_m == 128 and d == 64))
    return applies and _env_choice(DQ_T_ENV, "1", ("0", "1")) == "1"


def dq_first(tile_n: int, dq_in_ring: bool) -> bool:
    """Whether the variant issues dQ before dK (its epilogue under dK)."""
    on = _env_choice(DQ_FIRST_ENV, _DQ_FIRST, ("0", "1")) == "1"
    return on and _separate_dq_slabs(tile_n, dq_in_ring)


def _smem_bytes(d: int, dv: int, tile_n: int, stages: int, dq_in_ring: bool, tile_m: int = _TILE_M,
                own_dv_stage: bool = False, fused_dq: bool = False) -> int:
    """Shared memory of bwd_kernel's Storage (16-bit inputs), field by field with its alignments:
    ring barriers, LSE / dPsum ring (128-byte aligned), then 1024-byte aligned Q / dO ring, K, V,
    dS^T (P^T) slots, fp32 dQ slabs (none when dQ is staged in the ring), then where used
    fused_dq's fp32 staging tile and dV's own staging buffer (`own_dv_stage`). (fused_dq's
    mailbox barriers sit in the first block's padding.)"""
    tm = tile_m

    def after(offset: int, align: int, size: int) -> int:
        return -(-offset // align) * align + size

    n = 8 * (4 * stages + 1) + 8 * 5 + 4 * 2 + 8 + 4 * 2 + 8 * 4 + 4 * 2  # ring (Q, dO), K / V, mailboxes
    stat = -(-tm // 32) * 32 * stages * 4  # stages of 128-byte multiples (TMA destinations)
    n = after(after(n, 128, stat), 128, stat)
    slabs = 32 * 4 if dq_in_ring else tm * d * 4
    for size in (stages * tm * d * 2, stages * tm * dv * 2, tile_n * d * 2, tile_n * dv * 2,
                 2 * tile_n * tm * 2, slabs):
        n = after(n, 1024, size)
    n = after(n, 1024, tile_m * d * 4) if fused_dq else n
    return after(n, 1024, tile_n * dv * 2) if own_dv_stage else n


def dkdv_share_slots(d: int, dv: int, tile_n: int, tile_m: int) -> bool:
    """Whether the persistent epilogue stages dK and dV in the dS^T slots at once (bwd_kernel
    `_persistent_roles`): at 128 queries per step, where the slots hold two K tiles and K's
    swizzle is V's."""
    return tile_m == 128 and d == dv and 2 * tile_n * tile_m >= 2 * tile_n * d


def own_dv_stage(d: int, dv: int, tile_n: int, stages: int, tile_m: int, fused_dq: bool = False) -> bool:
    """Whether the persistent variant stages dV in its own buffer (OWN_DV_STAGE_ENV): where the
    dS^T slots cannot take dK and dV at once and the buffer fits shared memory beside the rest
    (D128 at 64 queries: 1 KB to spare without fused_dq's staging tile, too little with it)."""
    if _env_choice(OWN_DV_STAGE_ENV, _OWN_DV_STAGE, ("0", "1")) != "1" or dkdv_share_slots(d, dv, tile_n, tile_m):
        return False
    return _smem_bytes(d, dv, tile_n, stages, False, tile_m, own_dv_stage=True, fused_dq=fused_dq) <= _SMEM_LIMIT


def _long_queries(call: "AttentionCall") -> bool:
    """Whether a dense call has more queries than the fused dq pays for (_FUSED_DQ_MAX_SEQLEN_Q);
    read by fused_dq_applies in "auto" mode and part of variant_key's memo."""
    return not call.is_varlen and call.q.shape[1] > _FUSED_DQ_MAX_SEQLEN_Q


def _first_rows_reach(call: "AttentionCall"):
    """What fused_dq_applies reads of the call's shape, for variant_key's memo: how far (down to
    -129, enough for every tile_m) the first row's right limit lies left of key 0 (0: it reaches
    key 0 or beyond; None: no right limit), or False when there are no keys."""
    if call.k.shape[1] == 0:
        return False
    right, _ = _window(call)
    if right is None:
        return None
    return max(-129, min(0, call.k.shape[1] - call.q.shape[1] + right))


def _split_mode() -> str:
    return _env_choice(SPLIT_TAIL_ENV, "1", ("0", "1", "noop", *map(str, range(2, 65))))


def split_tail_applies(call: "AttentionCall", deterministic: bool, sparse, tile_m: int) -> bool:
    """Whether a persistent call may run the variant with the split tail's code (SPLIT_TAIL_ENV;
    `backward` still drops it for launches that do not split): dense calls whose work tiles all
    walk the same query tiles, on the 128-query variant unless a measuring mode is set."""
    mode = _split_mode()
    if mode == "0" or (mode == "1" and tile_m != 128):
        return False
    limits = call.causal or call.window_left >= 0 or call.window_right >= 0 or call.softcap > 0
    return not (limits or deterministic or sparse is not None or call.mods is not None
                or call.seqused_k is not None or call.is_varlen or call.block_mask)


def split_plan(tiles: int, ctas: int, steps: int) -> tuple[int, int]:
    """(split tiles, ways) for a launch of `tiles` work tiles of `steps` steps each on `ctas`
    persistent CTAs: the last round's tiles and how many pieces each runs as; (0, 1) where
    splitting would not shorten the last round by 15% of a tile (common.split_plan.choose)."""
    from torch_fa4.kernels.common import split_plan as plan

    mode = _split_mode()
    if mode in ("0", "noop"):
        return 0, 1
    if mode != "1":  # k pieces of every tile of a partial last round
        r = tiles % ctas if tiles > ctas else 0
        return (r, int(mode)) if r else (0, 1)
    return plan.choose(tiles, ctas, steps, min_tiles=_SPLIT_MIN_STEPS, max_ways=_SPLIT_MAX_WAYS,
                       piece_cost_tiles=_SPLIT_PIECE_COST_STEPS)


def _launch_split(call: "AttentionCall", tiles: KernelTiles) -> tuple[int, int]:
    """split_plan for a dense persistent launch of `call` on the variant with `tiles`."""
    n_tiles = math.ceil(call.k.shape[1] / tiles.tile_n) * call.k.shape[-2] * call.batch
    steps = math.ceil(call.q.shape[1] / tiles.tile_m) * (call.num_heads // call.num_heads_kv)
    return split_plan(n_tiles, _persistent_ctas(n_tiles, call.q.device), steps)


def fused_dq_applies(call: "AttentionCall", tile_n: int, stages: int, tile_m: int) -> bool:
    """Whether the persistent variant writes dq itself (FUSED_DQ_ENV): a 128-query variant whose
    staging tile fits shared memory (in "auto" mode up to _FUSED_DQ_MAX_SEQLEN_Q queries), where
    every query tile is walked by at least one key tile, or nobody would write its rows: no
    seqused_k (a sequence may have no keys), and under a right limit (causal, right window) the
    first tile's last row reaches key 0 (Sq > Sk + tile_m under causal fails)."""
    mode = _env_choice(FUSED_DQ_ENV, _FUSED_DQ, ("0", "1", "auto"))
    if (mode == "0" or (mode == "auto" and _long_queries(call)) or tile_m != 128
            or call.seqused_k is not None or call.is_varlen):
        return False
    d, dv = call.head_dim, call.head_dim_v
    if _smem_bytes(d, dv, tile_n, stages, False, tile_m, fused_dq=True) > _SMEM_LIMIT:
        return False
    reach = _first_rows_reach(call)
    return reach is not False and (reach is None or tile_m - 1 + reach >= 0)


def unsupported_reason(call: "AttentionCall") -> str | None:
    q, k, v = call.q, call.k, call.v
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"sm90 backward takes fp16/bf16, not {q.dtype}"
    if not (q.dtype == k.dtype == v.dtype):
        return "q, k, v dtypes differ"
    if call.head_dim not in SUPPORTED_HEAD_DIMS or call.head_dim_v not in SUPPORTED_HEAD_DIMS:
        return (
            f"sm90 backward takes head dims {SUPPORTED_HEAD_DIMS}, "
            f"not D={call.head_dim}, Dv={call.head_dim_v}"
        )
    if call.mod_key or call.mods is not None:
        reason = _mods_reason(call)
        if reason is not None:
            return reason
    if call.num_heads % call.num_heads_kv != 0:
        return "query heads are not a multiple of KV heads"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not _tma_compatible(t):
            return f"{name} is not TMA-compatible (last dim contiguous, 16-byte strides/pointer)"
    return None


MAX_AUX = 8  # captured mod tensors the kernel takes (kernels/common/mod_lowering.MAX_AUX)
def _mods_reason(call: "AttentionCall") -> str | None:
    if call.mods is None:
        return "score_mod/mask_mod key given but not resolved to a ModSet"
    if call.is_varlen != (call.cu_seqlens_k is not None):
        return "sm90 backward takes score_mod/mask_mod with cu_seqlens on both sides or neither"
    if call.is_varlen and _env_choice(VARLEN_KERNEL_ENV, _VARLEN_KERNEL, ("0", "1")) == "0":
        # the per-sequence launches would see each sequence as batch 0
        return f"score_mod/mask_mod with varlen need the packed-rows backward ({VARLEN_KERNEL_ENV}=0)"
    if len(call.aux_tensors) > MAX_AUX:
        return f"mods capture {len(call.aux_tensors)} tensors (sm90 backward: at most {MAX_AUX})"
    if any(t.requires_grad for t in call.score_aux):
        return "gradients for tensors captured by score_mod are not supported"
    return None


def _tma_compatible(t: torch.Tensor) -> bool:
    """TMA reads rows with a unit last stride, 16-byte-multiple strides and a 16-byte base."""
    strides = t.stride()
    if strides[-1] != 1 or t.data_ptr() % 16:
        return False
    for n, st in zip(t.shape, strides[:-1]):  # a plain loop: this runs three times per call
        if n > 1 and (st <= 0 or st % 8):
            return False
    return True


# The same view with size-1 dims given packed strides (their stride never addresses anything, but
# the TMA descriptor and the compiled signature want 16-byte multiples): the row-statistics
# pass's helper, whose compiled signature wants the same.
_tma_view = bwd_prepare._packed_size_one_strides


# The environment knobs above that variant_key reads: part of its memo key, read on every call.
_ENV_KNOBS = (TILE_M_ENV, PASSES_ENV, D128_TILE_M_ENV, D128_PASSES_ENV, DQ_FIRST_ENV, DQ_WARP_ENV, TRACE_ENV, TRACE_PAIR_ENV,
               EXP2_EMU_ENV, FOLD_DPSUM_ENV, PDL_ENV, SPLIT_RING_ENV, DV_AFTER_DS_ENV, PERSISTENT_ENV, L2_HINTS_ENV,
               DESCENDING_ENV, DQ_T_ENV, STATS_T_ENV, MOD_FRAGMENT_ENV, SPLIT_MASK_LOOPS_ENV,
               OWN_DV_STAGE_ENV, FUSED_DQ_ENV, PTXAS_ENV, SPLIT_TAIL_ENV)
_env_knobs = env_vars.Snapshot(_ENV_KNOBS)
_variant_memo: dict = {}


def variant_key(call: "AttentionCall", deterministic: bool) -> tuple:
    """The compiled variant that runs `call` (see the module docstring for what it holds).

    Memoized on what it reads (~10-20 us per backward saved on the GPU host), except for calls
    with a block mask, whose tile ratios and walk depend on the mask tensors' shapes."""
    if call.block_mask:
        return _variant_key(call, deterministic)
    memo = (call.q.dtype, call.head_dim, call.head_dim_v, call.num_heads // call.num_heads_kv,
            call.causal or call.window_right >= 0, call.window_left >= 0, call.softcap > 0,
            call.is_varlen, call.seqused_k is not None, bool(deterministic),
            call.mods.key if call.mods is not None else "",
            _first_rows_reach(call), _long_queries(call), _env_knobs(),
            None if call.is_varlen else call.k.shape[1] % 128)  # the key tail (_key_tail)
    key = _variant_memo.get(memo)
    if key is None:
        key = _variant_memo[memo] = _variant_key(call, deterministic)
    return key


def _key_tail(call: "AttentionCall", tile_n: int) -> bool:
    """Whether dense keys end inside a key tile (varlen and seqused_k calls mask their keys anyway)."""
    return not call.is_varlen and call.seqused_k is None and call.k.shape[1] % tile_n != 0


def _variant_key(call: "AttentionCall", deterministic: bool) -> tuple:
    from .bwd_sparse import ratios, sparse_walk_reason

    right, left = _window(call)
    d, dv = call.head_dim, call.head_dim_v
    # the block-mask tile relative to the kernel's enters the variant; the lists are arguments
    tile_n = tiles(d, dv)[0]
    tile_m, passes = query_tile(d, dv, tile_n)
    sparse = None
    if sparse_walk_reason(call, deterministic, tile_n, tile_m) is None:
        sparse = ratios(call, tile_n, tile_m)
    elif tile_m != _TILE_M and sparse_walk_reason(call, deterministic, tile_n, _TILE_M) is None:
        # a block mask whose query tile is not a multiple of 128: 64 queries per step walk it
        tile_m = _TILE_M
        sparse = ratios(call, tile_n, tile_m)
    elif tile_n == 128 and sparse_walk_reason(call, deterministic, 64) is None:
        # a block mask of 64-key columns: the 64-key (narrow) variant walks it
        tile_n, tile_m = 64, _TILE_M
        sparse = ratios(call, 64)
    elif tile_n == 128 and tile_m == _TILE_M and _takes_80_queries(call, deterministic):
        tile_m = 80
        passes = _env_choice(D128_PASSES_ENV, _D128_PASSES, ("one", "two"))
    tile_n, stages, dq_in_ring = tiles(d, dv, tile_n, tile_m=tile_m)
    trace = 0 if deterministic else int(os.environ.get(TRACE_ENV, "0") or 0)
    if trace:  # (steps, batch, kv head) of the traced CTAs
        trace = (trace, *(int(x) for x in (os.environ.get(TRACE_PAIR_ENV) or "0:0").split(":")))
    emulate = int(_env_choice(EXP2_EMU_ENV, _EXP2_EMU, ("0", "2", "3", "4", "5", "6", "8")))
    fold = _env_choice(FOLD_DPSUM_ENV, _FOLD_DPSUM, ("0", "1")) == "1"
    persist = persistent(call, deterministic, tile_n, dq_in_ring, sparse)
    # fused dq's staging tile is placed first; dV's own buffer only where it still fits beside it
    fused = persist and fused_dq_applies(call, tile_n, stages, tile_m)
    own_dv = persist and own_dv_stage(d, dv, tile_n, stages, tile_m, fused)
    kernel_tiles = KernelTiles(
        tile_n=tile_n, stages=stages, dq_in_ring=dq_in_ring, tile_m=tile_m,
        passes=passes if tile_m != _TILE_M else None,
        dq_first=dq_first(tile_n, dq_in_ring), dq_writer_warp=dq_writer_warp(tile_n, dq_in_ring),
        trace=trace, exp2_emulate=emulate, fold_dpsum=fold, pdl=pdl(),
        split_ring=split_ring(tile_m, right is not None),
        dv_after_ds=tile_m != _TILE_M and _env_choice(DV_AFTER_DS_ENV, _DV_AFTER_DS, ("0", "1")) == "1",
        persistent=persist,
        l2_hints=_env_choice(L2_HINTS_ENV, _L2_HINTS, ("0", "1", "loads", "last")),
        descending=(_env_choice(DESCENDING_ENV, _DESCENDING, ("0", "1")) == "1" and right is not None
                    and not deterministic and sparse is None),
        dq_transposed=dq_transposed(d, dv, tile_n, tile_m, dq_in_ring),
        permuted_stats=(tile_n == 128 and not call.is_varlen
                        and _env_choice(STATS_T_ENV, _STATS_T, ("0", "1")) == "1"),
        mod_fragment=(call.mods is not None and call.mods.score_graph is not None
                      and _env_choice(MOD_FRAGMENT_ENV, _MOD_FRAGMENT, ("0", "1")) == "1"),
        split_mask_loops=_env_choice(SPLIT_MASK_LOOPS_ENV, _SPLIT_MASK_LOOPS, ("0", "1")) == "1",
        own_dv_stage=own_dv,
        fused_dq=fused,
        ptxas_options=os.environ.get(PTXAS_ENV, _PTXAS).strip(),
        split_tail=persist and not trace and split_tail_applies(call, deterministic, sparse, tile_m),
        mask_key_tail=_key_tail(call, tile_n),
    )
    return (
        call.q.dtype,
        call.head_dim,
        call.head_dim_v,
        call.num_heads // call.num_heads_kv,
        right is not None,
        left is not None,
        call.softcap > 0,
        call.is_varlen,
        call.seqused_k is not None,
        bool(deterministic),
        kernel_tiles,
        sparse,
        call.mods.key if call.mods is not None else "",
    )


# CTA order (bwd_kernel._cta_coords): the key tiles of groups of G (kv head, batch) pairs, the
# longest causal walks first. G = 1, one pair's key tiles in a row, everywhere: on an H200 G = 4
# or 8 moved the causal rows by -4% to +3% (S16k lost, S4k gained; NOTES Experiment 38).
# TORCH_FA4_BWD_CTA_GROUP=G overrides (a runtime argument: no recompile; bench --sweep bwd-cta-group).
CTA_GROUP_ENV = "TORCH_FA4_BWD_CTA_GROUP"


def _pairs_from_env(name: str, pairs: int) -> int | None:
    """A count of (kv head, batch) pairs set in the environment, within 1..pairs; None if unset."""
    value = env_vars.get(name, "").strip()
    return max(1, min(int(value), pairs)) if value else None


def cta_group(call: "AttentionCall", pairs: int) -> int:
    return _pairs_from_env(CTA_GROUP_ENV, pairs) or 1


# The last T (kv head, batch) pairs start as one group (bwd_kernel._cta_coords): under a causal
# mask the plain order leaves the last pairs' longest CTAs for the end of the grid. T is as many
# pairs as fit their query-side bytes (Q, dO, the fp32 dQ buffer) in a 16 MB share of L2, at most
# 16: grouping more costs the L2 reuse it leaves (H100, NOTES Experiment 53: T = 16 / 4 / 1 at
# D64 S1k / D128 S4k / D128 S16k measured +2.2% / +3.7% / level, and T >= 2 lost 1-2% where a
# pair needs 8 MB or more). Without a mask every CTA walks as far: T = 1.
# TORCH_FA4_BWD_CTA_TAIL=T overrides (a runtime argument: no recompile).
CTA_TAIL_ENV = "TORCH_FA4_BWD_CTA_TAIL"
_CTA_TAIL_L2_BYTES = 16 << 20
_CTA_TAIL_MAX = 16


def cta_tail(call: "AttentionCall", pairs: int) -> int:
    override = _pairs_from_env(CTA_TAIL_ENV, pairs)
    if override is not None:
        return override
    if not (call.causal or call.window_right >= 0 or call.window_left >= 0):
        return 1
    group = call.num_heads // call.num_heads_kv
    pair_bytes = call.q.shape[1] * group * (call.head_dim * (2 + 4) + call.head_dim_v * 2)
    return max(1, min(_CTA_TAIL_L2_BYTES // max(pair_bytes, 1), _CTA_TAIL_MAX, pairs))


def _window(call: "AttentionCall") -> tuple[int | None, int | None]:
    """Effective (right, left) key limits relative to the diagonal; None = unbounded."""
    right = call.window_right if call.window_right >= 0 else None
    if call.causal:
        right = 0 if right is None else min(right, 0)
    left = call.window_left if call.window_left >= 0 else None
    return right, left


def _cute_dtype(dtype: torch.dtype):
    import cutlass

    return {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[dtype]


@functools.cache
def _use_tvm_ffi() -> bool:
    """Whether the kernels launch through TVM-FFI (the only form the disk cache can store); asked
    on every launch, so answered once."""
    import importlib.util

    return importlib.util.find_spec("tvm_ffi") is not None


def compile_stream_and_options(arch: str, dump_dir: str | None, ptxas_options: str = ""):
    """(fake stream, cute.compile options) shared by the backward's kernels: TVM-FFI launches where
    tvm_ffi is installed (without it, a CPU-only checkout, kernels still compile for the tests);
    dump_dir: also keep the cubin and PTX there; ptxas_options: extra ptxas flags."""
    import cutlass.cute as cute

    from torch_fa4.kernels.compile_cache import extra_options

    tvm = _use_tvm_ffi()
    options = f"--gpu-arch {arch}" + (" --enable-tvm-ffi" if tvm else "") + extra_options(dump_dir, ptxas_options)
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm), options


def cached_compile(key: tuple, build):
    """compile_cache.get_or_compile for the backward's kernels: kept on disk where they launch
    through TVM-FFI (the form the disk cache stores)."""
    from torch_fa4.kernels import compile_cache

    return compile_cache.get_or_compile(key, build, persist=_use_tvm_ffi())


def compile_variant(key: tuple, arch: str = "sm_90a", dump_dir: str | None = None):
    """Compile one variant against symbolic shapes (no GPU needed).

    dump_dir: also write the cubin there (always compiles, bypassing the cache)."""
    if dump_dir is not None:
        return _build(key, arch, dump_dir)
    return cached_compile(("sm90_bwd", arch, key), lambda jit=True: _build(key, arch, None, jit))


def _build(key: tuple, arch: str, dump_dir: str | None, jit: bool = True):
    mods = None
    if key[-1]:
        from torch_fa4.mods import registry

        mods = registry.lookup(key[-1])
    return _compile(key[:-1], mods, arch, dump_dir, jit)


def _compile(key: tuple, mods, arch: str, dump_dir: str | None, jit: bool = True):
    """jit=False: without the host JIT engines, only to be exported (compile_cache.get_or_compile)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from .bwd_kernel import Sm90AttentionBackward

    dtype, d, dv, group, has_right, has_left, softcap, varlen, seqused, deterministic, kernel_tiles, sparse = key
    cdt = _cute_dtype(dtype)
    sym = cute.sym_int
    al = lambda: cute.sym_int64(divisibility=8)  # TMA: 16-byte aligned strides

    def fake(dt, shape, stride, align=16):
        return cute.runtime.make_fake_tensor(dt, shape, stride=stride, assumed_align=align)

    b, sq, sk, hq, hkv = sym(), sym(), sym(), sym(), sym()
    sq_pad = sym()
    if varlen:
        tq, tk = sym(), sym()
        stat_rows = sym()  # the statistics' own rows (varlen_stat_layout), not the dQ buffer's
        q = fake(cdt, (tq, hq, d), (al(), al(), 1))
        k = fake(cdt, (tk, hkv, d), (al(), al(), 1))
        v = fake(cdt, (tk, hkv, dv), (al(), al(), 1))
        do = fake(cdt, (tq, hq, dv), (al(), al(), 1))
        lse = fake(Float32, (hq, stat_rows), (al(), 1))
        dps = fake(Float32, (hq, stat_rows), (al(), 1))
        dqa = fake(Float32, (hq, tq, d), (d, al(), 1))  # a (Hq, T, D) view of (T, Hq, D) rows
        dk = fake(cdt, (tk, hkv, d), (al(), d, 1))
        dvv = fake(cdt, (tk, hkv, dv), (al(), dv, 1))
        bp1 = sym()
        cuq = fake(Int32, (bp1,), (1,), 4)
        cuk = fake(Int32, (bp1,), (1,), 4)
        nb = sym()
    else:
        q = fake(cdt, (b, sq, hq, d), (al(), al(), al(), 1))
        k = fake(cdt, (b, sk, hkv, d), (al(), al(), al(), 1))
        v = fake(cdt, (b, sk, hkv, dv), (al(), al(), al(), 1))
        do = fake(cdt, (b, sq, hq, dv), (al(), al(), al(), 1))
        lse = fake(Float32, (b, hq, sq_pad), (al(), al(), 1))
        dps = fake(Float32, (b, hq, sq_pad), (al(), al(), 1))
        # (B, Sq, Hq, D) storage seen as (B, Hq, Sq, D): dq's own layout, so the final conversion
        # to the input dtype is one contiguous pass; TMA drops the adds of rows past Sq
        dqa = fake(Float32, (b, hq, sq, d), (al(), al(), al(), 1))
        dk = fake(cdt, (b, sk, hkv, d), (al(), al(), d, 1))
        dvv = fake(cdt, (b, sk, hkv, dv), (al(), al(), dv, 1))
        cuq = cuk = None
        nb = b
    used = fake(Int32, (nb,), (1,), 4) if seqused else None
    (tile_n, stages, dq_in_ring, tile_m, passes, dq_before_dk, dq_warp, trace, emulate, fold, use_pdl,
     split_ring, dv_after_ds, persist, hints, descending, dq_t, stats_t, mod_frag, split_loops, own_dv,
     fused_dq, ptxas, split_tail, mask_key_tail) = kernel_tiles
    dq_out = fake(cdt, (b, sq, hq, d), (al(), al(), al(), 1)) if fused_dq else None
    sem = None
    if deterministic or trace or persist:  # semaphores, the trace buffer or the tile counter
        sem = fake(Int32, (sym(), sym(), sym()), (cute.sym_int64(), cute.sym_int64(), 1), 4)

    kernel = Sm90AttentionBackward(
        cdt, d, dv, group, has_right, has_left, softcap, varlen, seqused, deterministic, mods, sparse,
        tile_n=tile_n, stages=stages, dq_in_ring=dq_in_ring, tile_m=tile_m, passes=passes,
        dq_under_dk=dq_before_dk, dq_writer_warp=dq_warp, trace=trace, exp2_emulate_every=emulate, fold_dpsum=fold,
        pdl=use_pdl, split_ring=split_ring, dv_after_ds=dv_after_ds, persistent=persist, l2_hints=hints,
        descending_walk=descending, dq_transposed=dq_t, permuted_stats=stats_t, mod_fragment=mod_frag,
        split_mask_loops=split_loops, own_dv_stage=own_dv, fused_dq=fused_dq, split_tail=split_tail,
        mask_key_tail=mask_key_tail,
    )
    split_ws = split_cnt = None
    if split_tail:  # the pieces' partial dK / dV (slots, values, 256 threads) and their counters
        split_ws = fake(Float32, (sym(), sym(), 256), (cute.sym_int64(), 256, 1), 16)
        split_cnt = fake(Int32, (sym(),), (1,), 4)
    lists = [None] * 4
    if sparse is not None:  # transposed block mask: counts (B', H', nkv), indices (B', H', nkv, nq)
        s64 = cute.sym_int64
        counts = lambda: fake(Int32, (sym(), sym(), sym()), (s64(), s64(), 1), 4)
        indices = lambda: fake(Int32, (sym(), sym(), sym(), sym()), (s64(), s64(), s64(), 1), 4)
        lists = [counts(), indices(), counts(), indices()]
    aux = []
    if mods is not None:
        from torch_fa4.kernels.common import mod_lowering

        specs = [a for g in (mods.score_graph, mods.mask_graph) if g is not None for a in g.aux]
        aux = [mod_lowering.fake_aux_tensor(a.dtype, a.ndim) for a in specs]
    aux += [None] * (MAX_AUX - len(aux))
    stream, options = compile_stream_and_options(arch, dump_dir, ptxas)
    args = (q, k, v, do, lse, dps, dqa, dk, dvv, dq_out, cuq, cuk, used, sem, split_ws, split_cnt, *lists,
            Float32(1.0), Float32(1.0), Float32(1.0), Int32(0), Int32(0), Int32(1), Int32(1), Int32(1), Int32(1),
            Int32(0), Int32(1), *aux, stream)
    return cute.compile(kernel, *args, options=options, no_jit_engine=not jit)


_SMS: dict = {}


def _persistent_ctas(tiles: int, device) -> int:
    """The persistent kernel's grid: one CTA per multiprocessor of `device` (looked up once per
    device), at most one per work tile, at most PERSISTENT_CTAS_ENV."""
    n = tiles  # (no multiprocessors to count off CUDA: the host tests' emulated kernel)
    if device.type == "cuda":
        n = _SMS.get(device)
        if n is None:
            n = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    cap = env_vars.get(PERSISTENT_CTAS_ENV)
    return max(1, min(tiles, n, int(cap) if cap else n))


def _pad_rows(x: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """Copy x (..., S) into a contiguous (..., rows) float32 buffer filled with `value`."""
    out = torch.full((*x.shape[:-1], rows), value, dtype=torch.float32, device=x.device)
    out[..., : x.shape[-1]] = x
    return out


def row_statistics(call: "AttentionCall", dout, out, lse, min_rows: int = 0, tile_m: int = _TILE_M,
                   zero_dq=None, permuted: bool = False):
    """Per query row, padded to whole query tiles of `tile_m` rows (the variant's queries per
    step): (lse * log2 e, rowsum(dO * O)) in fp32.

    Layout (B, Hq, rows) dense, (Hq, rows) varlen, contiguous. Rows with no visible key
    (lse = -inf) and padding rows get +inf, so that P = exp2(s - lse) = 0 there: their dq is 0,
    never NaN. dPsum is 0 on padding rows. `min_rows`: at least that many rows (dense), for a
    block-sparse walk whose last block-mask row reaches past the sequence.

    CUDA tensors go through one fused CuTe DSL kernel (bwd_prepare.py) where it takes them;
    otherwise (CPU, unaligned or expanded views) the torch expression below runs.
    `zero_dq`: a dQ buffer to zero as well (inside the fused pass where it can).
    `permuted`: each tile of `tile_m` rows in bwd_stats_layout's order (dense only).
    """
    assert not (permuted and call.is_varlen), "packed rows keep the natural order"
    rows = stat_rows(call, tile_m, min_rows)
    assert not permuted or rows % tile_m == 0, (rows, tile_m)
    if dout.is_cuda:
        from . import bwd_prepare

        if bwd_prepare.unsupported_reason(dout, out, lse) is None:
            fused_zero = zero_dq is not None and bwd_prepare.dq_zeroing_takes(zero_dq, dout)
            stats = bwd_prepare.row_statistics(dout, out, lse, rows, zero_dq if fused_zero else None,
                                               stat_tile=tile_m if permuted else 0,
                                               reversed_order=reversed_passes()[0])
            if zero_dq is not None and not fused_zero:
                zero_dq.zero_()
            if call.is_varlen:
                stats = varlen_stat_layout(call, stats, tile_m)
            return (*stats, rows)
    if zero_dq is not None:
        zero_dq.zero_()
    lse2 = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse * math.log2(math.e))
    dpsum = (dout.float() * out.float()).sum(-1)  # (B, Sq, Hq) or (Tq, Hq)
    if call.is_varlen:
        dpsum = dpsum.transpose(0, 1)  # (Hq, Tq)
    else:
        dpsum = dpsum.transpose(1, 2)  # (B, Hq, Sq)
    lse2, dpsum = _pad_rows(lse2, rows, math.inf), _pad_rows(dpsum, rows, 0.0)
    if permuted:
        from .bwd_stats_layout import permute_rows

        lse2, dpsum = permute_rows(lse2, tile_m), permute_rows(dpsum, tile_m)
    if call.is_varlen:
        lse2, dpsum = varlen_stat_layout(call, torch.stack((lse2, dpsum)), tile_m)
    return lse2, dpsum, rows


def stat_rows(call: "AttentionCall", tile_m: int, min_rows: int = 0) -> int:
    """The rows of row_statistics' buffers before any varlen layout: whole query tiles of tile_m
    (at least min_rows) dense; the packed rows and a tile more varlen (TMA strides: 16-byte
    multiples)."""
    if call.is_varlen:
        return (math.ceil(call.q.shape[0] / tile_m) + 1) * tile_m
    return max(math.ceil(call.q.shape[1] / tile_m) * tile_m, min_rows)


def stat_row_offsets(cu_seqlens_q: torch.Tensor, tile_m: int) -> torch.Tensor:
    """Where each sequence's LSE / dPsum rows start in the varlen backward's layout (int64, B):
    its first packed row moved down to a whole query tile, b tiles further on, so that every
    tile the kernel loads starts 16-byte aligned (bwd_kernel._stat_row_offset computes the same
    on the device). Sequence b's tiles end at or before sequence b + 1's start:
    (c + L + (b + 1) t) // t >= (c + b t) // t + ceil(L / t) for c = cu[b], L its length."""
    cu = cu_seqlens_q.to(torch.int64)
    b = torch.arange(cu.numel() - 1, device=cu.device)
    return (cu[:-1] + b * tile_m) // tile_m * tile_m


def stat_destinations(cu_seqlens_q: torch.Tensor, total: int, tile_m: int) -> tuple[torch.Tensor, int]:
    """(row of each packed query row in the varlen statistics layout (int64, T), rows of the
    layout)."""
    cu64 = cu_seqlens_q.to(torch.int64)
    batch = cu64.numel() - 1
    rows = (math.ceil(total / tile_m) + batch + 1) * tile_m
    t = torch.arange(total, device=cu64.device)
    seq = torch.searchsorted(cu64[1:], t, right=True)  # the sequence of each packed row
    return t + (stat_row_offsets(cu64, tile_m) - cu64[:-1])[seq], rows


# stat_sources' results per live, unmodified cu_seqlens_q tensor (a model's layers share one)
_STAT_SOURCES = TensorMemo(capacity=16)


def stat_sources(cu_seqlens_q: torch.Tensor, total: int, tile_m: int) -> torch.Tensor:
    """For each row of the varlen statistics layout, the packed row it holds, or `total` where it
    holds none (int64, rows). Row `total` of row_statistics' buffers is padding (+inf / 0: their
    varlen rows run a tile past the packed rows), so one gather lays the statistics out, padding
    included. Six small kernels and ~0.3 ms of host time per backward on the H200's host before
    it was kept per offsets tensor (NOTES Experiment 161)."""
    cu = cu_seqlens_q
    hit = _STAT_SOURCES.get((cu,), (total, tile_m))
    if hit is not None:
        return hit
    dest, rows = stat_destinations(cu, total, tile_m)
    src = torch.full((rows,), total, dtype=torch.int64, device=cu.device)
    src[dest] = torch.arange(total, device=cu.device)
    _STAT_SOURCES.put((cu,), (total, tile_m), src)
    return src


def varlen_stat_layout(call: "AttentionCall", stats: torch.Tensor, tile_m: int):
    """The packed rows' statistics, lse2 and dpsum stacked (2, Hq, > T: row T is padding, as
    row_statistics and the launch records allocate them), moved to the tile-aligned per-sequence
    offsets of stat_row_offsets: (lse2, dpsum), (Hq, rows) each, whose other rows hold +inf / 0
    (as padding rows do). One gather of both (it was a fill, a zeroing and two scatters).
    A TMA load whose first element is not 16-byte aligned faults (NOTES Experiment 160), and
    sequences start at any packed row."""
    total = call.q.shape[0]
    assert stats.shape[-1] > total, "row_statistics' varlen buffers end with padding rows"
    moved = stats.index_select(2, stat_sources(call.cu_seqlens_q, total, tile_m))
    return moved[0], moved[1]


def runs_per_sequence(call: "AttentionCall", deterministic: bool) -> bool:
    """Whether a call with cu_seqlens runs one dense launch per sequence: with only one side
    packed, or when VARLEN_KERNEL_ENV=0 asks for it. (Deterministic mode works per sequence as in
    a dense batch: its turns count the key tiles before each query tile of the sequence.)"""
    if not (call.is_varlen or call.cu_seqlens_k is not None):
        return False
    packed = call.is_varlen and call.cu_seqlens_k is not None
    return not (packed and _env_choice(VARLEN_KERNEL_ENV, _VARLEN_KERNEL, ("0", "1")) == "1")


class LaunchPlan(NamedTuple):
    """What a launch of a variant takes besides its tensors: everything backward() derives from
    the call's shape, the variant key and the launch-time knobs."""

    key: tuple  # the variant to run (variant_key's, without the split tail where nothing splits)
    split_items: int  # split tail: the tiles that run as pieces, and how many pieces each
    ways: int
    cta_group: int
    cta_tail: int
    ctas: int  # the persistent grid (1 otherwise)
    max_q: int  # the longest sequences (varlen: given, or read from cu_seqlens)
    max_k: int
    reversed_passes: tuple  # (row statistics, dq conversion) in reversed order


# The launch-time knobs launch_plan reads (with the variant key and the shapes: its memo key).
_LAUNCH_ENV_KNOBS = (CTA_GROUP_ENV, CTA_TAIL_ENV, PERSISTENT_CTAS_ENV, SPLIT_TAIL_ENV, PASS_ORDER_ENV)
_LAUNCH_ENV = env_vars.Snapshot(_LAUNCH_ENV_KNOBS)
# Every knob a backward call's launch reads: bwd_launch_record's records are keyed on them.
RECORD_ENV_KNOBS = _ENV_KNOBS + _LAUNCH_ENV_KNOBS + (VARLEN_KERNEL_ENV,)
_RECORD_ENV = env_vars.Snapshot(RECORD_ENV_KNOBS)
_plan_memo = shape_memo.table()  # (one entry per shape and variant)


def launch_plan(call: "AttentionCall", key: tuple) -> LaunchPlan:
    """The LaunchPlan of `call` on variant `key`. Memoized for dense calls without a block mask
    (varlen maxima and block-mask walks depend on tensor contents): every call of a shape gets the
    same split plan, CTA order and grid, and deriving them was a large share of the Python that
    ran per backward call (NOTES session 41, Experiment 162)."""
    if call.is_varlen or call.block_mask:
        return _launch_plan(call, key)
    memo = (key, call.q.shape, call.k.shape, call.q.device, _LAUNCH_ENV())
    return shape_memo.lookup(_plan_memo, memo, lambda: _launch_plan(call, key))


def _launch_plan(call: "AttentionCall", key: tuple) -> LaunchPlan:
    tiles = key[-3]
    split_items, ways = 0, 1
    if tiles.split_tail:
        split_items, ways = _launch_split(call, tiles)
        if not split_items and _split_mode() != "noop":  # no split: the variant without its code
            key = (*key[:-3], tiles._replace(split_tail=False), *key[-2:])
    if call.is_varlen:
        from torch_fa4.kernels.common.fwd_launch import max_seqlens

        max_q, max_k = max_seqlens(call)
    else:
        max_q, max_k = call.q.shape[1], call.k.shape[1]
    pairs = call.k.shape[-2] * call.batch  # (kv head, batch) pairs: the CTA order's unit
    ctas = _persistent_ctas(math.ceil(max_k / tiles.tile_n) * pairs, call.q.device) if tiles.persistent else 1
    return LaunchPlan(key, split_items, ways, cta_group(call, pairs), cta_tail(call, pairs), ctas,
                      max_q, max_k, reversed_passes())


def backward(call: "AttentionCall", dout, out, lse, dq, dk, dv, deterministic: bool) -> None:
    if bwd_launch_record.run(call, dout, out, lse, dq, dk, dv, deterministic, _RECORD_ENV):
        return  # a repeated dense call: replayed from its launch record
    if runs_per_sequence(call, deterministic):
        assert call.mods is None, "mods on per-sequence launches (unsupported_reason refuses them)"
        _backward_per_sequence(call, dout, out, lse, dq, dk, dv, deterministic)
        return
    plan = launch_plan(call, variant_key(call, deterministic))
    key, split_items, ways = plan.key, plan.split_items, plan.ways
    fn = compile_variant(key)
    tile_m = key[-3].tile_m  # queries per step: row statistics, dQ buffer, semaphores pad to it
    q, k, v = call.q, call.k, call.v
    right, left = _window(call)
    lists = [None] * 4
    min_rows = 0
    if key[-2] is not None:
        from . import bwd_sparse

        lists = bwd_sparse.transposed_lists(call)
        min_rows = bwd_sparse.padded_rows(call)
    if not _tma_compatible(dout):  # autograd may hand over expanded or odd-strided gradients
        dout = dout.contiguous()
    counter = None
    fused = key[-3].fused_dq
    split_ws = split_cnt = None
    if key[-3].split_tail:
        split_ws = torch.empty(split_workspace_shape(call, key[-3], split_items, ways), dtype=torch.float32,
                               device=q.device)
    if key[-3].persistent and not key[-3].trace:
        counter, split_cnt = zeroed_counters(counter_shape(call, key[-3]), split_counters(key[-3], split_items),
                                             q.device)
    if call.is_varlen:
        # dq's (T, Hq, D) rows (as one dense batch of T rows: zeroed by the row-statistics pass,
        # converted by the dense conversion pass), handed to the kernel as a (Hq, T, D) view; the
        # TMA adds of a sequence's last query tile add zeros to the next sequence's first rows
        # (rows past a sequence's end have P = dS = 0) and drop those past T
        dq_acc_rows = torch.empty((1, q.shape[0], call.num_heads, call.head_dim), dtype=torch.float32,
                                  device=q.device)
        lse2, dpsum, _ = row_statistics(call, dout, out, lse, min_rows, tile_m, zero_dq=dq_acc_rows)
        dq_acc = dq_acc_rows[0].transpose(0, 1)
    else:
        # dq's (B, Sq, Hq, D) layout, unpadded (the kernel's TMA adds drop rows past Sq), handed
        # to the kernel as a (B, Hq, Sq, D) view: the conversion below is one contiguous pass.
        # Zeroed by the row-statistics pass.
        dq_acc_rows = torch.empty((q.shape[0], q.shape[1], call.num_heads, call.head_dim),
                                  dtype=torch.float32, device=q.device)
        lse2, dpsum, rows = row_statistics(call, dout, out, lse, min_rows, tile_m, zero_dq=dq_acc_rows,
                                           permuted=key[-3].permuted_stats)
        dq_acc = dq_acc_rows.transpose(1, 2)
    max_q, max_k = plan.max_q, plan.max_k
    sem = None
    if deterministic:
        sem = torch.zeros((call.batch, call.num_heads, math.ceil(max_q / tile_m)), dtype=torch.int32, device=q.device)
    elif key[-3].trace:
        from .bwd_kernel import TRACE_EVENTS

        global LAST_TRACE
        # [:, :2]: the traced pair's steps (key tile, warpgroup, steps * events); [:, 2 + pair, :3]:
        # every CTA's start, end (global ns timer, low 32 bits) and SM (bwd_kernel._stamp_cta)
        # (+ 1: the persistent kernel's tile counter, the last element of the first row)
        n_tiles = math.ceil(k.shape[1] / key[-3].tile_n)
        width = max(key[-3].trace[0] * len(TRACE_EVENTS), 3) + int(key[-3].persistent)
        pairs = k.shape[-2] * call.batch
        sem = torch.zeros((n_tiles, 2 + pairs, width), dtype=torch.int32, device=q.device)
        LAST_TRACE = sem
    elif key[-3].persistent:  # the persistent kernel's tile counter (bwd_kernel._persistent_roles)
        sem = counter
    seqused = call.seqused_k.to(torch.int32).contiguous() if call.seqused_k is not None else None
    cu_q = call.cu_seqlens_q.to(torch.int32).contiguous() if call.is_varlen else None
    cu_k = call.cu_seqlens_k.to(torch.int32).contiguous() if call.is_varlen else None

    q, k, v, dout, dk, dv = map(_tma_view, (q, k, v, dout, dk, dv))
    dq_out = None
    if fused:  # (dq is ours: contiguous, 16-byte aligned)
        assert writes_dq_directly(dq) and dq.data_ptr() % 16 == 0
        dq_out = _tma_view(dq)
    aux = [None] * MAX_AUX
    if call.mods is not None:
        from torch_fa4.kernels.common import mod_lowering

        aux = mod_lowering.kernel_aux_tensors(call.aux_tensors, MAX_AUX)
    fn(
        q, k, v, dout, lse2, dpsum, dq_acc, dk, dv, dq_out,
        cu_q, cu_k, seqused, sem, split_ws, split_cnt, *lists,
        float(call.scale), float(call.scale * math.log2(math.e)), float(call.softcap or 1.0),
        int(left or 0), int(right or 0), int(max_k), plan.cta_group, plan.cta_tail, plan.ctas,
        split_items, ways, *aux,
    )
    # the kernel accumulates dS K; the softmax scale joins the conversion to dq's dtype (no_grad:
    # out= refuses autograd, and these buffers are results, never differentiated through)
    if fused:  # the kernel wrote dq
        return
    if bwd_dq_convert.takes(dq_acc_rows, dq):
        bwd_dq_convert.scaled_narrow(dq_acc_rows, dq, call.scale, pdl=key[-3].pdl,
                                     reversed_order=plan.reversed_passes[1])
    else:
        with torch.no_grad():
            torch.mul(dq_acc_rows.view(dq.shape), call.scale, out=dq)


def _backward_per_sequence(call: "AttentionCall", dout, out, lse, dq, dk, dv, deterministic):
    """Varlen backward as one dense call per sequence, on views (no copies of q, k, v, grads)."""
    from torch_fa4.call import AttentionCall

    cu_q = call.cu_seqlens_q.tolist() if call.cu_seqlens_q is not None else None
    cu_k = call.cu_seqlens_k.tolist() if call.cu_seqlens_k is not None else None

    def rows(t, cu, b):  # batch b of a packed (T, ...) or dense (B, S, ...) tensor, as (1, S, ...)
        return t[cu[b] : cu[b + 1]].unsqueeze(0) if cu is not None else t[b : b + 1]

    for b in range(call.batch):
        q_b, dout_b, out_b, dq_b = (rows(t, cu_q, b) for t in (call.q, dout, out, dq))
        k_b, v_b, dk_b, dv_b = (rows(t, cu_k, b) for t in (call.k, call.v, dk, dv))
        lse_b = lse[:, cu_q[b] : cu_q[b + 1]].unsqueeze(0) if cu_q is not None else lse[b : b + 1]
        if q_b.shape[1] == 0 or k_b.shape[1] == 0:  # nothing attends: all gradients are zero
            for g in (dq_b, dk_b, dv_b):
                g.zero_()
            continue
        used = call.seqused_k[b : b + 1] if call.seqused_k is not None else None
        sub = AttentionCall(
            q=q_b, k=k_b, v=v_b, scale=call.scale, causal=call.causal,
            window_left=call.window_left, window_right=call.window_right, softcap=call.softcap,
            seqused_k=used, max_seqlen_q=q_b.shape[1], max_seqlen_k=k_b.shape[1],
        )
        backward(sub, dout_b, out_b, lse_b, dq_b, dk_b, dv_b, deterministic)
