"""Attention throughput: torch_fa4 against its peers, one GPU run, one table.

Rows: D in {64, 128, 256} x S in {1k, 4k, 16k} x causal, 16k tokens per row (B = 16384 / S),
H * D = 2048, bf16; extra forward rows at D128 S4k (softcap, window 1024, ALiBi score_mod); backward
rows (autograd through torch_fa4.attention) at D in {64, 128}. Peers: SDPA (cuDNN and flash
backends), FlexAttention compiled (on D128 S4k causal and the mod rows: each of its rows is a fresh
torch.compile), flash-attn-4 (flash_attn.cute, benchmarking only).
FLOPs: fwd = 4 B H Sq Sk D (halved when causal), bwd = 2.5 x fwd. Medians of
triton.testing.do_bench (CUDA events) after warm-up. Writes results.json and a PNG to --out.

    python benchmarks/bench.py --out bench_out [--quick]

--quick: a subset that finishes in about two minutes including compiles (fwd D64 S16k, D128 S4k,
D128 S16k causal, D256 S4k, the softcap / window / ALiBi / block-sparse document-mask rows at
D128 S4k; bwd D128 S4k and causal when the torch_fa4 backward kernel takes them), peers
flash-attn-4, cuDNN and FlexAttention (compiled); same table format.

--sweep NAME: torch_fa4 variants side by side with flash-attn-4, then stop (forward: _SWEEPS;
backward: _BWD_SWEEPS, e.g. `--sweep bwd-tiles`: D64 backward with 64 vs 128 queries per step).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F


_BENCH_MS = {"warmup": 50, "rep": 200}  # --quick halves both

_GRID = [(D, S, c) for D in (64, 128, 256) for S in (1024, 4096, 16384) for c in (False, True)]
_BWD_GRID = [(D, S, c) for D in (64, 128) for S in (1024, 4096, 16384) for c in (False, True)]

# Sweep options that are launch arguments, not FwdConfig fields: the L2 size the (batch, head)
# grouping assumes (fwd_host.L2_BYTES), and grouping by it without a causal / window mask too
# (fwd_launch.l2_group_bytes; one pair per group otherwise)
_LAUNCH_OPTS = ("l2_bytes", "l2_group_all", "causal_as_window")

# a sweep row's optional fourth element: the window, as the grid's "window 1024" row has it
_WINDOW_1024 = (1024, 0)

# --sweep NAME: (torch_fa4 forward config overrides per column, rows (D, S, causal[, window or the
# name of a score_mod in _named_score_mods])); NOTES.md has the results
_SWEEPS = {
    "options": ({"default": {}, "rescale8": dict(rescale_threshold=8.0), "emu4": dict(exp2_emulate_every=4),
                 "emu2": dict(exp2_emulate_every=2),
                 "rescale8+emu4": dict(rescale_threshold=8.0, exp2_emulate_every=4),
                 "no-pingpong": dict(pingpong=False)},
                [(D, S, c) for D in (64, 128, 256) for S in (4096, 16384) for c in (False, True)]),
    "tiles": ({"128x128": dict(tile_m=128, tile_n=128),
               "192x96": dict(tile_m=192, tile_n=96, persistent=False),
               "192x128": dict(tile_m=192, tile_n=128, persistent=False),
               "192x128p": dict(tile_m=192, tile_n=128, persistent=True),
               "192x128s3": dict(tile_m=192, tile_n=128, persistent=False, num_stages=3)},
              [(64, S, c) for S in (1024, 4096, 16384) for c in (False, True)]),
    "exp2": ({"hardware": {}, "emu8": dict(exp2_emulate_every=8), "emu4": dict(exp2_emulate_every=4),
              "emu3": dict(exp2_emulate_every=3)},
             [(64, S, c) for S in (4096, 16384) for c in (False, True)]),
    # the same at D128 on the current kernel (last measured there in the first session: -4 to -10%)
    "exp2-d128": ({"hardware": {}, "emu8": dict(exp2_emulate_every=8), "emu4": dict(exp2_emulate_every=4)},
                  [(128, S, c) for S in (4096, 16384) for c in (False, True)]),
    "d256": ({"one loop": dict(split_mask_loops=False), "split": dict(split_mask_loops=True),
              "split+persistent": dict(split_mask_loops=True, persistent=True)},
             [(256, S, c) for S in (1024, 4096, 16384) for c in (False, True)]),
    # where O is rescaled: before P V is issued (the D <= 128 default since Experiment 19), after
    # the P V wait (flash-attn-4's place at D128), or only when the max grows by > 8 (log2)
    "rescale": ({"before P V": dict(early_o_rescale=True, rescale_threshold=None),
                 "after P V": dict(early_o_rescale=False, rescale_threshold=None),
                 "cond8": dict(rescale_threshold=8.0)},
                [(D, S, c) for D in (64, 128) for S in (4096, 16384) for c in (False, True)]),
    # the wide D64 tile (192 x 128, three consumer warpgroups) and D128's: turn-taking, FA4's
    # softmax options
    "wide": ({"default": {}, "no-pingpong": dict(pingpong=False), "emu4": dict(exp2_emulate_every=4),
              "rescale8": dict(rescale_threshold=8.0)},
             [(64, S, c) for S in (4096, 16384) for c in (False, True)] + [(128, S, False) for S in (4096, 16384)]),
    "stages": ({"2 stages": dict(num_stages=2), "3 stages": dict(num_stages=3), "4 stages": dict(num_stages=4)},
               [(64, S, c) for S in (1024, 16384) for c in (False, True)]),
    # the wide D64 tile (192 x 128) one-shot against persistent, with two and three K/V stages
    "wide-persistent": ({"one-shot s3": dict(persistent=False, num_stages=3),
                         "persistent s3": dict(persistent=True, num_stages=3),
                         "persistent s2": dict(persistent=True, num_stages=2)},
                        [(64, S, False) for S in (4096, 16384)]),
    # D128: two K/V stages and a separate O tile, or three stages with O staged over Q
    "d128-stages": ({"2 stages": dict(num_stages=2), "3 stages": dict(num_stages=3)},
                    [(D, S, c) for D in (128, 64) for S in (1024, 4096, 16384) for c in (False, True)]),
    "sched": ({"one-shot": dict(persistent=False), "persistent": dict(persistent=True)},
              [row for row in _GRID if row[0] <= 128]),
    # D256 turn-taking and rescale placement: ours (pingpong, conditional rescale after P V) against
    # flash-attn-4's sm90 choices at D > 128 (no turn-taking, every tile's rescale before P V)
    "d256-turns": ({"default": {}, "no-pingpong": dict(pingpong=False),
                    "no-pp+early": dict(pingpong=False, rescale_threshold=None, early_o_rescale=True),
                    "early": dict(rescale_threshold=None, early_o_rescale=True)},
                   [(256, S, c) for S in (1024, 4096, 16384) for c in (False, True)]),
    # the K release predicated on the row sums so ptxas keeps the P V wait after the softmax
    "pin-pv-wait": ({"default": {}, "pinned": dict(pin_pv_wait=True)}, _GRID),
    # the softmax's exponentials and O's rescales as row vectors (a shorter compile; the
    # exponentials lose their side-effect pin, so the schedule moves): NOTES "Experiment 166"
    "vector-softmax": ({"default": {}, "vector": dict(vector_softmax=True)}, _GRID),
    "d256-turns-pinned": ({"pinned": dict(pin_pv_wait=True),
                           "pinned no-pp": dict(pin_pv_wait=True, pingpong=False),
                           "pinned no-pp+early": dict(pin_pv_wait=True, pingpong=False, rescale_threshold=None,
                                                      early_o_rescale=True)},
                          [(256, S, c) for S in (1024, 4096, 16384) for c in (False, True)]),
    "sched-s1k": ({"one-shot": dict(persistent=False), "persistent": dict(persistent=True)},
                  [(D, 1024, c) for D in (64, 128) for c in (False, True)]),
    # (batch, head) pairs per L2 group (common.tile_scheduler), through the L2 size it assumes:
    # 50 MB (default), 25 MB, and one pair per group
    # (l2_group_all: groups of half the given L2 with or without masks, the rule of that time)
    "l2-group": ({"50MB": dict(l2_group_all=True), "25MB": dict(l2_bytes=25 << 20, l2_group_all=True),
                  "one pair": dict(l2_bytes=1, l2_group_all=True)},
                 [(128, 4096, False), (128, 16384, False), (128, 4096, True), (128, 16384, True),
                  (64, 4096, False), (64, 16384, False), (64, 16384, True), (256, 16384, False)]),
    "sched-d128": ({"one-shot": dict(persistent=False), "persistent": dict(persistent=True)},
                   [(128, S, False) for S in (4096, 16384)] + [(128, 4096, True)]),
    # persistent CTAs taking items from a counter (kernels/common/tile_mailbox.py) against the
    # static round-robin, or one CTA per item where the grid policy picks it (long causal walks,
    # the 192-row D64 tile); NOTES "Experiment 63"
    "dyn-sched": ({"static": dict(dynamic_schedule=False), "dynamic": dict(persistent=True, dynamic_schedule=True)},
                  [row for row in _GRID if row[0] <= 128] + [(256, 1024, True), (256, 4096, True)]),
    # the 192-row D64 tile with three K/V stages under causal masks (its default there is two),
    # one CTA per item and on the dynamic schedule
    "wide-causal-stages": ({"default": {}, "s3": dict(num_stages=3),
                            "dynamic s3": dict(persistent=True, dynamic_schedule=True, num_stages=3),
                            "dynamic s2": dict(persistent=True, dynamic_schedule=True, num_stages=2)},
                           [(64, S, True) for S in (4096, 16384)]),
    # the causal rows past the dynamic schedule's 8192-key limit, with it
    "dyn-s16k": ({"default": {}, "dynamic": dict(persistent=True, dynamic_schedule=True)},
                 [(D, 16384, True) for D in (64, 128, 256)]),
    # Q's buffer released after the walk's last Q K^T instead of after the last P V
    "early-q": ({"late-q": dict(early_q_release=False), "early-q": dict(early_q_release=True)},
                [(D, S, c) for D in (64, 128) for S in (1024, 4096, 16384) for c in (False, True)]),
    # the unmasked key loop unrolled twice: ptxas places the P V wait after ~26 of 66
    # exponentials there instead of ~4 (NOTES "Experiment 64")
    "unroll": ({"default": {}, "unroll2": dict(unroll_unmasked=2)},
               [(D, S, c) for D in (64, 128) for S in (4096, 16384) for c in (False, True)]),
    # the D64 rows of the 192-row tile without a mask, whose rounds spread widest (NOTES "Experiment
    # 71"): two / three K/V stages one CTA per item, three on the dynamic schedule, all in the L2
    # groups of that time (half of L2), and one (batch, head) pair per group (the default since)
    "d64-spread": ({"s3": dict(l2_group_all=True), "s2": dict(num_stages=2, l2_group_all=True),
                    "dynamic s3": dict(persistent=True, dynamic_schedule=True, l2_group_all=True),
                    "one pair": {}},
                   [(64, S, False) for S in (4096, 16384)]),
    # (batch, head) pairs per L2 group through the L2 size the grouping assumes (groups hold half
    # of it, with or without masks: the rule before Experiment 71): the concurrent CTAs' K / V
    # working set (NOTES "Experiment 71")
    "l2-working-set": ({name: dict(l2_bytes=size, l2_group_all=True)
                        for name, size in (("1 pair", 1), ("4MB", 4 << 20), ("8MB", 8 << 20), ("16MB", 16 << 20),
                                           ("50MB", 50 << 20))},
                       [(64, 4096, False), (64, 16384, False), (64, 16384, True), (128, 4096, False),
                        (128, 16384, False)]),
    # one (batch, head) pair per L2 group without masks (the default since Experiment 71) against
    # groups filling half of L2 (before)
    "l2-order": ({"one pair": {}, "L2 groups": dict(l2_group_all=True)},
                 [(D, S, False) for D in (64, 128, 256) for S in (1024, 4096, 16384)]),
    # causal rows with groups of K / V of 25 MB (half of L2: before Experiment 72), 8 MB (a sixth:
    # the default since), 2 MB and one pair per group (through the L2 size the rule is given)
    "l2-causal": ({"25MB groups": dict(l2_bytes=150 << 20), "8MB groups": {}, "2MB groups": dict(l2_bytes=12 << 20),
                   "1 pair": dict(l2_bytes=1)},
                  [(D, S, True) for D in (64, 128, 256) for S in (1024, 4096, 16384)]),
    # a warpgroup whose rows of an item all lie past the sequence's end issues no matmul
    # (fwd._idle_item): 4096 and 16384 are not multiples of the 192-row D64 tile
    "skip-idle": ({"default": dict(skip_idle_rows=False), "skip": dict(skip_idle_rows=True)},
                  [(64, S, c) for S in (1024, 4096, 16384) for c in (False, True)]),
    # the row where "skip-idle" read lower twice, columns in the other order (NOTES "Experiment 77")
    "skip-idle-s16k": ({"skip": dict(skip_idle_rows=True), "default": dict(skip_idle_rows=False)},
                       [(64, 16384, True), (64, 16384, False)]),
    # L2 eviction priorities on the loads: K / V evict-last, Q evict-first (kernels/common/l2_hints.py)
    "l2-hints": ({"none": dict(kv_evict_last=False, q_evict_first=False),
                  "kv-last": dict(kv_evict_last=True, q_evict_first=False),
                  "kv-last+q-first": dict(kv_evict_last=True, q_evict_first=True)},
                 [(D, S, c) for D in (64, 128, 256) for S in (4096, 16384) for c in (False, True)]),
    # FA4's conditional rescale on the rows still below flash-attn-4 at D64 (last measured on the
    # D64 tile of session 3)
    "d64-rescale": ({"default": {}, "rescale8": dict(rescale_threshold=8.0)},
                    [(64, 4096, False), (64, 16384, False), (64, 4096, True), (64, 16384, True)]),
    # the grid's window row (D128 S4k, 1024 keys to the left): one CTA per item (the default until
    # NOTES "Experiment 73": the persistent loop had serialized the wgmmas when windows were added),
    # static persistent (which _grid_ctas launches one CTA per item past 2048 keys), the dynamic
    # schedule (the default since), and one (batch, head) pair per L2 group, one CTA per item
    "window": ({"one-shot": dict(persistent=False, dynamic_schedule=False),
                "persistent": dict(persistent=True, dynamic_schedule=False),
                "dynamic": dict(persistent=True, dynamic_schedule=True),
                "1 pair": dict(l2_bytes=1, persistent=False, dynamic_schedule=False)},
               [(128, 4096, True, _WINDOW_1024), (64, 4096, True, _WINDOW_1024), (128, 16384, True, _WINDOW_1024)]),
    # the window rows the first "window" sweep left out: D256 (one CTA per item by default), S1k
    # (the walk's keys all inside the window for most rows), D64 S16k
    "window-more": ({"one-shot": dict(persistent=False, dynamic_schedule=False), "static": dict(persistent=True, dynamic_schedule=False),
                     "dynamic": dict(persistent=True, dynamic_schedule=True)},
                    [(256, 4096, True, _WINDOW_1024), (256, 16384, True, _WINDOW_1024), (128, 1024, True, _WINDOW_1024),
                     (64, 1024, True, _WINDOW_1024), (64, 16384, True, _WINDOW_1024)]),
    # D192 windows, one CTA per item (the default until measured here) and the dynamic schedule
    "window-d192": ({"one-shot": dict(persistent=False, dynamic_schedule=False),
                     "dynamic": dict(persistent=True, dynamic_schedule=True)},
                    [(192, S, True, _WINDOW_1024) for S in (1024, 4096, 16384)]),
    # the D64 rows below flash-attn-4 on the dynamic schedule (192-row tile; causal S16k is past the
    # dynamic schedule's 8192-key limit), in the one-pair L2 order of Experiment 71
    "d64-dynamic": ({"default": {}, "dynamic": dict(persistent=True, dynamic_schedule=True),
                     "dynamic s2": dict(persistent=True, dynamic_schedule=True, num_stages=2)},
                    [(64, 4096, False), (64, 16384, False), (64, 16384, True)]),
    # ring waits that peek before waiting (kernels/common/ring_waits.py) on every grid row; CPU
    # compile only so far (NOTES "Experiment 78": the key loop's issued instructions per key tile
    # fall at D64 / D128, D256 causal, and rise slightly at D256 without a mask)
    "peek-waits": ({"plain": dict(peek_waits=False), "peek": dict(peek_waits=True)},
                   [(D, S, c) for D in (64, 128, 256) for S in (1024, 4096, 16384) for c in (False, True)]),
    # D64 calls with a score_mod alone: the 192-row tile (the default past 2048 queries since NOTES
    # "Experiment 90") against the 128-row tile they ran before
    "d64-mods": ({"default": {}, "128": dict(tile_m=128, num_stages=2)},
                 [(64, S, c, "alibi") for S in (4096, 16384) for c in (True, False)] + [(64, 4096, True)]),
    # what the public API's causal calls ran before session 19 (window_right = 0 counted as a window,
    # so the windowed variants; NOTES "Experiment 91") against the causal variants they run now
    "causal-window": ({"causal only": {}, "causal as window": dict(causal_as_window=True)},
                      [(D, S, True, (-1, 0)) for D in (64, 128, 256) for S in (1024, 4096, 16384)]),
    # the consumer warpgroups taking turns at the tensor cores or issuing freely (NOTES "Experiment 94")
    "d128-pingpong": ({"pingpong": {}, "free": dict(pingpong=False)},
                      [(128, S, c) for S in (1024, 4096, 16384) for c in (False, True)] + [(96, 16384, False), (256, 16384, False)]),
    # D128 key tiles wider than 128 (no spills since packed P conversion; 160 and 176 stage O over
    # Q's buffer): NOTES "Experiment 93"
    "d128-wide-n": ({f"128x{n}": dict(tile_n=n) for n in (128, 144, 160, 176)},
                    [(128, S, c) for S in (4096, 16384) for c in (False, True)]),
    # CTA pairs multicasting each K / V tile (half the L2-to-SM traffic of the ring), plain rows
    "kv-multicast": ({"default": {}, "multicast": dict(kv_multicast=True)},
                     [(D, S, False) for D in (64, 128, 256) for S in (1024, 4096, 16384)] + [(96, 16384, False)]),
    # ALiBi's bias as one fma per distinct offset (with abs: after the run-time sign branch) against
    # an add and a multiply per offset; the no-mod rows are what the grid's ALiBi row is read against
    "alibi": ({"fma": {}, "no-fma": dict(mod_affine_fma=False)},
              [(128, 4096, True), (128, 4096, True, "alibi"), (128, 4096, True, "alibi-kv-q"),
               (128, 4096, False), (128, 4096, False, "alibi"), (64, 4096, True), (64, 4096, True, "alibi")]),
}


def _named_score_mods(heads: int, device: str = "cuda") -> dict:
    """Score_mods by the names sweep rows use: "alibi" is the grid's ALiBi row (with abs),
    "alibi-kv-q" the library's slope * (kv_idx - q_idx), which needs no sign branch."""
    from torch_fa4 import mods as M

    slopes = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], device=device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    return {"alibi": alibi, "alibi-kv-q": M.alibi(slopes)}

# --sweep NAME for the backward: (environment per column, rows); each column times autograd through
# torch_fa4.attention with those variables set around every backward call (kernels/sm90/bwd.py reads
# TORCH_FA4_BWD_TILE_M / _PASSES / _DQ_WARP / _DQ_FIRST on every call). "bwd-tiles": 64 vs 128
# queries per step at D64, the latter in the three ways of forming dS. "bwd-dq-4way": the dQ TMA adds
# from the consumer leader warps or the dedicated writer warp, each with dK or dQ issued first
# (NOTES Experiments 24-26; the pairwise sweeps of Experiments 24 and 25 are its columns).
_PERSISTENT_AB = {"grid": {"TORCH_FA4_BWD_PERSISTENT": "0"}, "persistent": {"TORCH_FA4_BWD_PERSISTENT": "1"}}
_BWD_SWEEPS = {
    # a score_mod in the backward through the fragment emitter (hoisted, exact fp32 index arithmetic,
    # one fma per offset) against the per-element lowering (an int -> float conversion per element)
    "bwd-mods": ({"fragment": {"TORCH_FA4_BWD_MOD_FRAGMENT": "1"}, "per element": {"TORCH_FA4_BWD_MOD_FRAGMENT": "0"}},
                 [(128, 4096, True, "alibi"), (128, 4096, False, "alibi"), (128, 4096, True, "alibi-kv-q"),
                  (64, 4096, True, "alibi"), (128, 4096, True)]),
    "bwd-tiles": ({"tm64": {"TORCH_FA4_BWD_TILE_M": "64"},
                   "tm128-two": {"TORCH_FA4_BWD_TILE_M": "128", "TORCH_FA4_BWD_PASSES": "two"},
                   "tm128-one": {"TORCH_FA4_BWD_TILE_M": "128", "TORCH_FA4_BWD_PASSES": "one"},
                   "tm128-split": {"TORCH_FA4_BWD_TILE_M": "128", "TORCH_FA4_BWD_PASSES": "split"}},
                  [(64, S, c) for S in (1024, 4096, 16384) for c in (False, True)]),
    # queries per step at D128 without masks: 64, or 80 (dQ as dQ^T = K^T dS^T)
    "bwd-d128-tile": ({"tm64": {"TORCH_FA4_BWD_D128_TILE_M": "64"},
                       "tm80-one": {"TORCH_FA4_BWD_D128_TILE_M": "80", "TORCH_FA4_BWD_D128_PASSES": "one"},
                       "tm80-two": {"TORCH_FA4_BWD_D128_TILE_M": "80", "TORCH_FA4_BWD_D128_PASSES": "two"}},
                      [(128, S, False) for S in (1024, 4096, 16384)]),
    "bwd-dq-4way": ({"lead/dk": {"TORCH_FA4_BWD_DQ_WARP": "0", "TORCH_FA4_BWD_DQ_FIRST": "0"},
                     "writer/dk": {"TORCH_FA4_BWD_DQ_WARP": "1", "TORCH_FA4_BWD_DQ_FIRST": "0"},
                     "lead/dq": {"TORCH_FA4_BWD_DQ_WARP": "0", "TORCH_FA4_BWD_DQ_FIRST": "1"},
                     "writer/dq": {"TORCH_FA4_BWD_DQ_WARP": "1", "TORCH_FA4_BWD_DQ_FIRST": "1"}},
                    [(128, S, c) for S in (1024, 4096, 16384) for c in (False, True)]
                    + [(64, S, c) for S in (4096, 16384) for c in (False, True)]),
    # every k-th column of P from the FMA-pipe polynomial instead of MUFU ex2
    "bwd-exp2": ({f"emu{k}": {"TORCH_FA4_BWD_EXP2_EMU": str(k)} for k in (0, 4, 3, 2)},
                 [(D, S, c) for D in (128, 64) for S in (4096, 16384) for c in (False, True)]),
    # dP^T's accumulator from -dPsum (one multiply per dS element) or from zero
    # programmatic dependent launch between the backward's three kernels, off / on
    "bwd-pdl": ({"off": {"TORCH_FA4_BWD_PDL": "0"}, "on": {"TORCH_FA4_BWD_PDL": "1"}},
                [(D, S, c) for D in (128, 64) for S in (1024, 4096) for c in (False, True)]),
    # separate ring barriers for Q + LSE and dO + dPsum on the 128-query (D64) variant
    "bwd-split-ring": ({"one": {"TORCH_FA4_BWD_SPLIT_RING": "0"}, "split": {"TORCH_FA4_BWD_SPLIT_RING": "1"}},
                       [(64, S, c) for S in (1024, 4096, 16384) for c in (False, True)]),
    "bwd-fold": ({"zero": {"TORCH_FA4_BWD_FOLD_DPSUM": "0"}, "-dPsum": {"TORCH_FA4_BWD_FOLD_DPSUM": "1"}},
                 [(D, S, c) for D in (128, 64) for S in (1024, 4096, 16384) for c in (False, True)]),
    # D64 step order (bwd_kernel `passes`, `dv_after_ds`): P / dS in one pass or P under dP^T, dV
    # issued before or after the dS^T stores
    "bwd-dv-order": ({f"{p}{'-dv-after' if a == '1' else ''}": {"TORCH_FA4_BWD_PASSES": p, "TORCH_FA4_BWD_DV_AFTER_DS": a}
                      for p in ("one", "split") for a in ("0", "1")},
                     [(64, S, c) for S in (1024, 4096, 16384) for c in (False, True)]),
    # the persistent epilogue's dV staged in the dS^T slots after dK, or in a buffer of its own
    # (bwd_kernel `own_dv_stage`; the 64-query variants)
    "bwd-own-dv": ({"shared": {"TORCH_FA4_BWD_OWN_DV_STAGE": "0"}, "own": {"TORCH_FA4_BWD_OWN_DV_STAGE": "1"}},
                   [(128, S, c) for S in (1024, 4096, 16384) for c in (True, False)]),
    # one CTA per work tile against the persistent kernel (bwd_kernel `persistent`)
    "bwd-persistent": (_PERSISTENT_AB, [(D, S, c) for D in (64, 128) for S in (1024, 4096, 16384)
                                        for c in (False, True)]),
    "bwd-persistent-d64": (_PERSISTENT_AB, [(64, S, c) for S in (4096, 16384) for c in (False, True)]),
    # CTA order (bwd_kernel._cta_coords): key tiles of groups of G (kv head, batch) pairs, longest first
    "bwd-cta-group": ({f"G{g}": {"TORCH_FA4_BWD_CTA_GROUP": str(g)} for g in (1, 4, 8, 16, 1024)},
                      [(D, S, c) for D in (128, 64) for S in (1024, 4096, 16384) for c in (True, False)
                       if c or S == 4096]),
    # CTA order (bwd_kernel._cta_coords): the last T (kv head, batch) pairs as one group
    "bwd-cta-tail": ({f"T{t}": {"TORCH_FA4_BWD_CTA_TAIL": str(t)} for t in (1, 2, 4, 8, 16)},
                     [(D, S, True) for D in (64, 128) for S in (1024, 4096, 16384)]),
    # the plain order against the default tail group (bwd.cta_tail; "" = the default)
    "bwd-cta-tail-auto": ({"T1": {"TORCH_FA4_BWD_CTA_TAIL": "1"}, "auto": {"TORCH_FA4_BWD_CTA_TAIL": ""}},
                          [(D, S, True) for D in (64, 128) for S in (1024, 4096, 16384)]),
    # the causal rows whose run-to-run scatter is in question: with --rounds N, N alternating timings
    "bwd-causal": ({"torch_fa4": {}}, [(128, 1024, True), (64, 1024, True), (128, 16384, True)]),
    # L2 eviction priorities: Q / dO / statistics (and, "all", the dQ adds) evict-last, K / V evict-first
    "bwd-l2-hints": ({"none": {"TORCH_FA4_BWD_L2_HINTS": "0"}, "all": {"TORCH_FA4_BWD_L2_HINTS": "1"},
                      "loads": {"TORCH_FA4_BWD_L2_HINTS": "loads"}, "last": {"TORCH_FA4_BWD_L2_HINTS": "last"}},
                     [(D, S, c) for D in (64, 128) for S in (1024, 4096, 16384) for c in (False, True)]),
    # the passes around the main kernel in its order or the reverse (bwd.PASS_ORDER_ENV)
    "bwd-pass-order": ({o: {"TORCH_FA4_BWD_PASS_ORDER": o} for o in ("natural", "prepare", "convert", "both")},
                       [(D, S, c) for D in (64, 128) for S in (1024, 4096) for c in (False, True)]),
    # causal walks from the last query tile down to the diagonal (bwd_q_walk.DenseQWalk): the CTAs
    # in flight read the same Q / dO tiles at once
    "bwd-descending": ({"ascending": {"TORCH_FA4_BWD_DESCENDING": "0"}, "descending": {"TORCH_FA4_BWD_DESCENDING": "1"}},
                       [(D, S, True) for D in (64, 128) for S in (1024, 4096, 16384)]),
    # dQ = dS K (64-bit slab stores, bank conflicts) against dQ^T = K^T dS^T (32-bit stores), D128
    # at 64 queries per step and D64 at 128 (bwd_kernel `dq_transposed`)
    "bwd-dq-t": ({"dQ": {"TORCH_FA4_BWD_DQ_T": "0"}, "dQ^T": {"TORCH_FA4_BWD_DQ_T": "1"}},
                 [(D, S, c) for D in (128, 64) for S in (1024, 4096, 16384) for c in (False, True)]),
    # the row statistics read as 16-byte vectors (bwd_stats_layout.py), alone and with dQ^T at D64
    # (written before dQ^T became the D64 default: since session 18 "default" has it too)
    "bwd-stats-t": ({"default": {}, "stats": {"TORCH_FA4_BWD_STATS_T": "1"},
                     "stats+dQ^T": {"TORCH_FA4_BWD_STATS_T": "1", "TORCH_FA4_BWD_DQ_T": "1"}},
                    [(64, 4096, False), (64, 4096, True), (64, 16384, False), (64, 16384, True),
                     (128, 4096, False), (128, 16384, True)]),
    # the causal walk's order and schedule once more, with dQ^T everywhere: the default (descending,
    # persistent, automatic tail group) against ascending walks, one pair per tail group and one CTA
    # per tile
    "bwd-causal-order": ({"default": {}, "ascending": {"TORCH_FA4_BWD_DESCENDING": "0"},
                          "T1": {"TORCH_FA4_BWD_CTA_TAIL": "1"}, "grid": {"TORCH_FA4_BWD_PERSISTENT": "0"}},
                         [(D, S, True) for D in (64, 128) for S in (4096, 16384)]),
    # the six D64 grid rows: dQ = dS K against dQ^T (the default since session 18), and dQ^T with
    # the vector statistics
    "bwd-d64": ({"dQ": {"TORCH_FA4_BWD_DQ_T": "0"}, "dQ^T": {},
                 "stats+dQ^T": {"TORCH_FA4_BWD_STATS_T": "1"}},
                [(64, S, c) for S in (1024, 4096, 16384) for c in (False, True)]),
}


def document_mask(S: int, doc_len: int = 512, device: str = "cuda"):
    """The grid's document-mask row: (mask_mod, flops) for S tokens in documents of doc_len, the
    flops counting only the visible pairs under causal masking."""
    doc_ids = torch.arange(S, device=device, dtype=torch.int32) // doc_len

    def document(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]

    def doc_flops(B, H, S, D, causal=True, bwd=False):  # S / doc_len causal doc_len x doc_len blocks
        return 4.0 * B * H * (S // doc_len) * doc_len * (doc_len + 1) / 2 * D * (2.5 if bwd else 1.0)

    return document, doc_flops


def rotated(items: list, turn: int) -> list:
    """items starting `turn` places along (a b c, b c a, ...): each round or turn of a timing loop
    puts a different implementation first, so the clock after a pause is not always the same one's."""
    k = turn % len(items) if items else 0
    return items[k:] + items[:k]


def upper_median(values):
    """The middle value, the upper one of an even count (of two: the larger); None when empty."""
    values = sorted(values)
    return values[len(values) // 2] if values else None


def _time_ms(fn) -> float:
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=_BENCH_MS["warmup"], rep=_BENCH_MS["rep"], return_mode="median"))
    except ImportError:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]


def _flops(B, H, S, D, causal, bwd=False):
    f = 4.0 * B * H * S * S * D / (2 if causal else 1)
    return f * (2.5 if bwd else 1.0)


def _window_flops(window):
    """FLOPs of a causal call whose queries see `window[0]` keys to their left (and themselves)."""
    def flops(B, H, S, D, causal):
        return 4.0 * B * H * S * min(S, window[0] + 1) * D
    return flops


# ------------------------------------------------------------------ forward implementations
def ours_fwd(q, k, v, causal, softcap=0.0, window=(-1, -1), score_mod=None, mask_mod=None, cfg_opts=None):
    """q, k, v (B, S, H, D). Calls without mods or overrides go through the public
    torch_fa4.attention, as flash-attn-4's row goes through its flash_attn_func (session 42: the
    rows used to launch fwd_host.forward directly, which left our API's host time unmeasured).
    With mods, the mods are traced once here and the kernel is launched directly, so the row times
    the kernel, not the per-call capture of the public API. cfg_opts: FwdConfig overrides (sweeps)."""
    if score_mod is None and mask_mod is None and not cfg_opts:
        import torch_fa4

        return lambda: torch_fa4.attention(q, k, v, causal=causal, softcap=softcap, window_size=window)
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90 import fwd_host

    mods = {}
    if score_mod is not None or mask_mod is not None:
        from torch_fa4 import mods as M
        from torch_fa4.mods import registry

        if mask_mod is not None and causal:  # the block mask then also drops the tiles above the diagonal
            mask_mod = M.and_masks(mask_mod, M.causal_mask)
        key, aux = M.prepare(score_mod, mask_mod)
        mods = dict(mod_key=key, mods=registry.lookup(key), aux_tensors=tuple(aux))
        if mask_mod is not None:  # block-sparse: skip the tiles the mask empties
            S = q.shape[1]
            bm = M.create_block_mask(mask_mod, None, None, S, S, device=q.device)
            mods.update(block_mask=tuple(bm.as_tensors()), block_mask_q=bm.BLOCK_SIZE[0],
                        block_mask_kv=bm.BLOCK_SIZE[1])
    call = AttentionCall(q=q, k=k, v=v, scale=q.shape[-1] ** -0.5, causal=causal, softcap=softcap,
                         window_left=window[0], window_right=window[1], **mods)
    reason = fwd_host.unsupported_reason(call)
    if reason:
        raise RuntimeError(reason)
    out = torch.empty_like(q)
    lse = torch.empty(call.lse_shape(), dtype=torch.float32, device=q.device)
    return lambda: fwd_host.forward(call, out, lse, **(cfg_opts or {}))


def fa4_fwd(q, k, v, causal, softcap=0.0, window=(-1, -1), score_mod=None, mask_mod=None):
    from flash_attn.cute.interface import flash_attn_func

    kw = dict(causal=causal)
    if softcap:
        kw["softcap"] = softcap
    if window != (-1, -1):
        kw["window_size"] = (None if window[0] < 0 else window[0], None if window[1] < 0 else window[1])
    if score_mod is not None or mask_mod is not None:
        raise RuntimeError("score_mod/mask_mod peer not wired")
    return lambda: flash_attn_func(q, k, v, **kw)


def _sdpa(backend):
    def make(q, k, v, causal, softcap=0.0, window=(-1, -1), score_mod=None, mask_mod=None):
        if softcap or window != (-1, -1) or score_mod is not None or mask_mod is not None:
            raise RuntimeError("n/a")
        from torch.nn.attention import sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        return fn

    return make


_flex_compiled = None


def flex_fwd(q, k, v, causal, softcap=0.0, window=(-1, -1), score_mod=None, mask_mod=None):
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    S = q.shape[1]
    conds = []
    if causal:
        conds.append(lambda b, h, i, j: j <= i)
    if window != (-1, -1):
        wl = window[0]
        conds.append(lambda b, h, i, j: (i - j <= wl) & (j <= i))
    if mask_mod is not None:
        conds.append(mask_mod)
    mask_mod = None
    if conds:
        def mask_mod(b, h, i, j):
            m = conds[0](b, h, i, j)
            for c in conds[1:]:
                m = m & c(b, h, i, j)
            return m
    bm = create_block_mask(mask_mod, None, None, S, S) if mask_mod else None
    if softcap:
        def sm(s, b, h, i, j):
            return softcap * torch.tanh(s / softcap)
    else:
        sm = score_mod
    return lambda: _flex_compiled(qt, kt, vt, score_mod=sm, block_mask=bm)


PEERS = {
    "torch_fa4": ours_fwd,
    "flash-attn-4": fa4_fwd,
    "sdpa-cudnn": None,
    "sdpa-flash": None,
    "flex": flex_fwd,
}


def _peers():
    from torch.nn.attention import SDPBackend

    p = dict(PEERS)
    p["sdpa-cudnn"] = _sdpa(SDPBackend.CUDNN_ATTENTION)
    p["sdpa-flash"] = _sdpa(SDPBackend.FLASH_ATTENTION)
    return p


# ------------------------------------------------------------------ backward implementations
def ours_bwd(q, k, v, causal, score_mod=None):
    import torch_fa4

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch_fa4.attention(q, k, v, causal=causal, score_mod=score_mod)
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)


def with_env(make, env: dict):
    """An implementation maker whose every call runs with the environment variables `env` set (a
    few microseconds): launch-time overrides such as TORCH_FA4_BWD_CTA_TAIL, read per call."""
    def make_with_env(*args, **kwargs):
        fn = make(*args, **kwargs)

        def run():
            saved = {name: os.environ.get(name) for name in env}
            os.environ.update(env)
            try:
                return fn()
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
        return run
    return make_with_env


def variant_makers(specs, backward: bool, error) -> dict:
    """The probes' `--variant NAME=JSON` options as implementation makers: torch_fa4 with the
    JSON's "env" settings (set around every call) and, forward only, the rest of it as FwdConfig
    overrides; `error(message)` reports a backward variant with overrides."""
    makers = {}
    for spec in specs:
        name, opts = spec.split("=", 1)
        opts = json.loads(opts)
        env = opts.pop("env", {})
        if backward:
            if opts:
                error("--variant with --backward takes only \"env\" (FwdConfig overrides are forward only)")
            makers[name] = with_env(ours_bwd, env)
        else:
            makers[name] = with_env((lambda o: lambda q, k, v, c, **kw: ours_fwd(q, k, v, c, cfg_opts=o, **kw))(opts), env)
    return makers


def ours_bwd_with_env(env):
    """ours_bwd with environment variables set around each backward call."""
    return with_env(ours_bwd, env)


def fa4_bwd(q, k, v, causal, score_mod=None):
    from flash_attn.cute.interface import flash_attn_func

    if score_mod is not None:
        raise RuntimeError("score_mod peer not wired")

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attn_func(q, k, v, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)


def sdpa_bwd(backend):
    def make(q, k, v, causal):
        from torch.nn.attention import sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        g = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (qt, kt, vt), g, retain_graph=True)

    return make


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="a ~2-minute subset (see the module docstring)")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--no-fwd", action="store_true", help="backward rows only")
    ap.add_argument("--sweep", choices=sorted(_SWEEPS) + sorted(_BWD_SWEEPS),
                    help="torch_fa4 variants side by side with flash-attn-4 (see _SWEEPS, _BWD_SWEEPS), then stop")
    ap.add_argument("--peers", default=None,
                    help="comma-separated; default all (--quick: torch_fa4,flash-attn-4,sdpa-cudnn,flex)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every implementation of a row this many times in turn; report the upper median")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    t_start = time.perf_counter()
    peer_names = args.peers or ("torch_fa4,flash-attn-4,sdpa-cudnn,flex" if args.quick
                                else "torch_fa4,flash-attn-4,sdpa-cudnn,sdpa-flash,flex")
    peers = {k: v for k, v in _peers().items() if k in peer_names.split(",")}
    if args.quick:
        _BENCH_MS.update(warmup=25, rep=100)
    tokens, width = 16384, 2048
    if args.quick:
        fwd_rows = [(64, 16384, False), (128, 4096, False), (128, 4096, True), (128, 16384, True), (256, 4096, False)]
    else:
        fwd_rows = _GRID
    if args.no_fwd:
        fwd_rows = []
    rows = []

    def measure(label, D, S, causal, flops, makers, extra=None):
        B, H = tokens // S, width // D
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        row = {"row": label, "D": D, "S": S, "causal": causal}
        fns = {}
        for name, make in makers.items():
            try:
                fns[name] = make(q, k, v, causal, **(extra or {}))
            except Exception as e:  # a peer that cannot run this row is reported, not fatal
                row[name] = None
                row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"
        # --rounds N: every implementation timed N times in turn (a, b, a, b, ...); the row keeps
        # the upper median round (with 2: the better one) and the spread, so slow drift of the
        # machine hits all alike. Each round starts one implementation further along (a b c,
        # b c a, ...): the H100 runs these kernels at its power limit and its clock moves within
        # a fraction of a second, so whoever runs first after a pause would otherwise always
        # meet the same clock
        samples = {name: [] for name in fns}
        for rnd in range(args.rounds):
            for name, fn in rotated(list(fns.items()), rnd):
                if name in row:  # failed in an earlier round
                    continue
                try:
                    samples[name].append(flops(B, H, S, D, causal) / _time_ms(fn) / 1e9)
                except Exception as e:
                    row[name] = None
                    row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"
        for name, vals in samples.items():
            if name not in row and vals:
                row[name] = upper_median(vals)
                if len(vals) > 1:
                    row.setdefault("spread", {})[name] = (min(vals), max(vals))
        rows.append(row)
        _print_row(row, list(makers))

    if args.sweep in _BWD_SWEEPS:
        variants, sweep_rows = _BWD_SWEEPS[args.sweep]
        print(f"torch_fa4 bwd variants ({args.sweep}) TFLOP/s")
        makers = {k: ours_bwd_with_env(env) for k, env in variants.items()}
        if "flash-attn-4" in peers:
            makers["flash-attn-4"] = fa4_bwd
        for D, S, causal, *mod in sweep_rows:  # (a fourth element: a score_mod's name, _named_score_mods)
            extra = dict(score_mod=_named_score_mods(width // D)[mod[0]]) if mod else None
            measure(f"{args.sweep} D{D} S{S // 1024}k{' ' + mod[0] if mod else ''}{' causal' if causal else ''}",
                    D, S, causal, lambda *a: _flops(*a, bwd=True), makers, extra)
        _dump(rows, args.out)
        return
    if args.sweep:
        variants, sweep_rows = _SWEEPS[args.sweep]

        def with_opts(opts):
            def make(q, k, v, causal, window=(-1, -1), score_mod=None):
                if score_mod is not None:  # a mod row: FwdConfig overrides only
                    return ours_fwd(q, k, v, causal, window=window, score_mod=score_mod, cfg_opts=opts)
                from torch_fa4.call import AttentionCall
                from torch_fa4.kernels.sm90 import fwd_host

                call = AttentionCall(q=q, k=k, v=v, scale=q.shape[-1] ** -0.5, causal=causal,
                                     window_left=window[0], window_right=window[1])
                out = torch.empty_like(q)
                lse = torch.empty(call.lse_shape(), dtype=torch.float32, device=q.device)
                from torch_fa4.kernels.common import fwd_launch

                cfg_opts = {k: v for k, v in opts.items() if k not in _LAUNCH_OPTS}
                if any(k in opts for k in _LAUNCH_OPTS):  # launch arguments: patched around the call
                    def run():
                        saved = fwd_host.L2_BYTES, fwd_launch.l2_group_bytes, AttentionCall.has_window
                        fwd_host.L2_BYTES = opts.get("l2_bytes", fwd_host.L2_BYTES)
                        if opts.get("l2_group_all"):
                            fwd_launch.l2_group_bytes = lambda call, l2_bytes: l2_bytes
                        if opts.get("causal_as_window"):  # before session 19: window_right = 0 was a window
                            AttentionCall.has_window = property(lambda c: c.window_left >= 0 or c.window_right >= 0)
                        try:
                            fwd_host.forward(call, out, lse, **cfg_opts)
                        finally:
                            fwd_host.L2_BYTES, fwd_launch.l2_group_bytes, AttentionCall.has_window = saved
                    return run
                return lambda: fwd_host.forward(call, out, lse, **cfg_opts)
            return make

        print(f"torch_fa4 fwd variants ({args.sweep}) TFLOP/s")
        makers = {k: with_opts(v) for k, v in variants.items()}
        if "flash-attn-4" in peers:
            makers["flash-attn-4"] = peers["flash-attn-4"]
        for D, S, causal, *window in sweep_rows:
            if window and isinstance(window[0], str):  # a named score_mod (_named_score_mods)
                measure(f"{args.sweep} D{D} S{S // 1024}k {window[0]}{' causal' if causal else ''}", D, S, causal,
                        _flops, makers, dict(score_mod=_named_score_mods(width // D)[window[0]]))
            elif window:
                flops = _window_flops(window[0]) if window[0][0] >= 0 else _flops  # (-1, 0): causal only
                measure(f"{args.sweep} D{D} S{S // 1024}k{' causal' if causal else ''} window {window[0]}", D, S,
                        causal, flops, makers, dict(window=window[0]))
            else:
                measure(f"{args.sweep} D{D} S{S // 1024}k{' causal' if causal else ''}", D, S, causal, _flops, makers)
        _dump(rows, args.out)
        return
    print("fwd TFLOP/s")
    for D, S, causal in fwd_rows:
        row_peers = peers
        if (D, S, causal) != (128, 4096, True):
            # each FlexAttention row is a fresh torch.compile (10-20 s), which would not fit the
            # GPU machine's 10-minute call: it runs on one plain row and on the mod rows below,
            # where it is the peer that matters
            row_peers = {k: v for k, v in peers.items() if k != "flex"}
        measure(f"fwd D{D} S{S // 1024}k{' causal' if causal else ''}", D, S, causal, _flops, row_peers)
    print(f"  ({time.perf_counter() - t_start:.0f} s elapsed)", flush=True)
    alibi = _named_score_mods(width // 128)["alibi"]
    document, doc_flops = document_mask(4096)
    mod_rows = (
        ("softcap 30", dict(softcap=30.0), _flops),
        ("window 1024", dict(window=_WINDOW_1024), _window_flops(_WINDOW_1024)),
        ("alibi score_mod", dict(score_mod=alibi), _flops),
        ("document mask_mod, block-sparse", dict(mask_mod=document), doc_flops),
    )
    for label, extra, flops in ([] if args.no_fwd else mod_rows):
        measure(f"fwd D128 S4k {label} causal", 128, 4096, True, flops, peers, extra)
        print(f"  ({time.perf_counter() - t_start:.0f} s elapsed)", flush=True)
    if not args.no_bwd:
        from torch.nn.attention import SDPBackend

        bpeers = {"torch_fa4": ours_bwd, "flash-attn-4": fa4_bwd,
                  "sdpa-cudnn": sdpa_bwd(SDPBackend.CUDNN_ATTENTION),
                  "sdpa-flash": sdpa_bwd(SDPBackend.FLASH_ATTENTION)}
        bpeers = {k: v for k, v in bpeers.items() if k in peers}
        print("bwd TFLOP/s")
        if args.quick:
            bwd_rows = [(128, 4096, False), (128, 4096, True)]
        else:
            bwd_rows = _BWD_GRID
        for D, S, causal in bwd_rows:
            reason = _our_bwd_refusal(D, S, causal)
            if reason is not None:  # the reference backward would take minutes: say so, skip the row
                print(f"bwd D{D} S{S // 1024}k{' causal' if causal else ''}: torch_fa4 backward kernel "
                      f"refuses ({reason}); row skipped", flush=True)
                continue
            measure(f"bwd D{D} S{S // 1024}k{' causal' if causal else ''}", D, S, causal,
                    lambda *a: _flops(*a, bwd=True), bpeers)
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)
    _dump(rows, args.out)
    _plot(rows, list(peers), os.path.join(args.out, "bench.png"))


def _dump(rows, out):
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def _our_bwd_refusal(D, S, causal):
    """Why torch_fa4's backward kernel would not take this row (None: it would)."""
    from torch_fa4.call import AttentionCall

    try:
        from torch_fa4.kernels.sm90 import bwd
    except ImportError as e:
        return f"no sm90 backward module ({e})"
    B, H = 16384 // S, 2048 // D
    q = torch.empty(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    return bwd.unsupported_reason(AttentionCall(q=q, k=q, v=q, scale=D ** -0.5, causal=causal))


def _print_row(row, names):
    ref = row.get("flash-attn-4")
    cells = []
    for n in names:
        v = row.get(n)
        cells.append(f"{n}={v:6.1f}" if v else f"{n}=   n/a")
        lo_hi = row.get("spread", {}).get(n)
        if lo_hi:
            cells[-1] += f" [{lo_hi[0]:.0f}-{lo_hi[1]:.0f}]"
    ours = row.get("torch_fa4", row.get(names[0])) or 0
    ratio = ours / ref if ref else float("nan")
    print(f"{row['row']:<34} " + "  ".join(cells) + f"  ratio_vs_fa4={ratio:.3f}", flush=True)


def _plot(rows, names, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.6), 5))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([r + i * w for r in range(len(rows))], [row.get(n) or 0 for row in rows], w, label=n)
    ax.set_xticks([r + 0.4 for r in range(len(rows))])
    ax.set_xticklabels([row["row"] for row in rows], rotation=75, fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
