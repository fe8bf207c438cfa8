"""sm90 forward kernel against float64 attention on fresh random inputs.

Every test draws new inputs, poisons out/lse with NaN before the launch, and requires the kernel's
error to be at most twice that of eager attention in the input dtype (both against float64).
"""

import os

import pytest
import torch

from gpu_harness import (SM90_ONLY, causal_documents_call, check_against_float64, check_mods_against_naive,
                         default_variant, launch_poisoned, poison_forward, public as _public,
                         random_document_ids, random_qkv as _qkv)
from naive import naive_attention
from torch_fa4.call import AttentionCall

pytestmark = SM90_ONLY


def _run_kernel(call: AttentionCall, **overrides):
    from torch_fa4.kernels.sm90 import fwd_host

    assert fwd_host.unsupported_reason(call) is None, fwd_host.unsupported_reason(call)
    return launch_poisoned(fwd_host, call, **overrides)


def _check(call: AttentionCall, **overrides):
    out, lse = _run_kernel(call, **overrides)
    return check_against_float64(call, out, lse, empty_lse_exact=True)


def _dense_call(B, Sq, Sk, H, Hkv, D, dtype=torch.bfloat16, **kw):
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype)
    return AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 96, 128, 192, 256])
def test_dense_head_dims(dtype, D):
    _check(_dense_call(2, 300, 517, 4, 4, D, dtype))


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Sq,Sk", [(512, 512), (200, 700), (700, 200), (1, 333)])
def test_causal(D, Sq, Sk):
    _check(_dense_call(2, Sq, Sk, 3, 3, D, causal=True))


@pytest.mark.parametrize("H,Hkv", [(8, 2), (6, 1)])
def test_gqa_mqa(H, Hkv):
    _check(_dense_call(2, 257, 383, H, Hkv, 128, causal=True))


@pytest.mark.parametrize("wl,wr", [(64, 0), (100, 37), (-1, 50), (130, -1)])
def test_window(wl, wr):
    _check(_dense_call(2, 400, 450, 2, 2, 128, window_left=wl, window_right=wr))


def test_window_causal_gqa_d64():
    _check(_dense_call(1, 333, 333, 4, 2, 64, causal=True, window_left=100, window_right=-1))


@pytest.mark.parametrize("D", [64, 96, 128, 192, 256])
def test_window_dynamic_schedule_many_items(D):
    """Windowed calls take items from the counter (fwd_host._dynamic_schedule_pays): more items
    than SMs, causal and two-sided windows, softcap, and varlen sequences."""
    from torch_fa4.kernels.sm90 import fwd_host

    dynamic = dict(persistent=True, dynamic_schedule=True)
    call = _dense_call(3, 1500, 1500, 16, 4, D, causal=True, window_left=300, window_right=-1)
    assert fwd_host.default_config(call).dynamic_schedule
    _check(call, **dynamic)
    _check(_dense_call(2, 900, 1400, 24, 8, D, window_left=200, window_right=77, softcap=15.0), **dynamic)
    lens_q, lens_k = [700, 1, 333, 1029], [650, 40, 333, 1500]
    cu_q, cu_k = (torch.tensor([0] + list(torch.tensor(n).cumsum(0)), dtype=torch.int32, device="cuda")
                  for n in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), 32, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 8, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    call = AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, causal=True, window_left=150, window_right=-1,
                         cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    _check(call, **dynamic)


@pytest.mark.parametrize("D", [64, 128])
def test_softcap(D):
    q = torch.randn(2, 300, 4, D, device="cuda", dtype=torch.bfloat16) * 3
    k = torch.randn(2, 300, 4, D, device="cuda", dtype=torch.bfloat16) * 3
    v = torch.randn(2, 300, 4, D, device="cuda", dtype=torch.bfloat16)
    _check(AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, softcap=5.0, causal=True))


def test_strided_views():
    # (B, H, S, D) tensors viewed as (B, S, H, D): no copies, non-contiguous strides
    B, H, S, D = 2, 4, 333, 128
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kv = torch.randn(B, H, S, 2 * D, device="cuda", dtype=torch.bfloat16)
    k, v = kv[..., :D].transpose(1, 2), kv[..., D:].transpose(1, 2)
    _check(AttentionCall(q=q, k=k, v=v, scale=0.1, causal=True))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_varlen(causal, D):
    lens_q = [1, 130, 257, 64, 500]
    lens_k = [5, 129, 300, 64, 400]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    H, Hkv = 4, 2
    q = torch.randn(sum(lens_q), H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), Hkv, D, device="cuda", dtype=torch.bfloat16)
    _check(AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, causal=causal, cu_seqlens_q=cu_q,
                         cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k)))


def test_seqused_k_dense():
    call = _dense_call(3, 100, 512, 2, 2, 128)
    call.seqused_k = torch.tensor([512, 77, 300], dtype=torch.int32, device="cuda")
    _check(call)


@pytest.mark.parametrize("opts", [
    dict(rescale_threshold=8.0),
    dict(early_o_rescale=True),
    dict(pin_pv_wait=True),
])
def test_softmax_options(opts):
    _check(_dense_call(2, 640, 640, 4, 4, 64, causal=True), **opts)
    _check(_dense_call(2, 300, 900, 4, 4, 128), **opts)


@pytest.mark.parametrize("sk", [9000, 700])
@pytest.mark.parametrize("causal", [False, True])
def test_d128_default_takes_the_conditional_rescale(causal, sk):
    """D128 plain and causal calls run the conditional rescale by default (fwd_host), long and
    short walks (the short causal one on the dynamic schedule with Q released early)."""
    from torch_fa4.kernels.sm90 import fwd_host

    call = _dense_call(1, 300, sk, 2, 1, 128, causal=causal)
    assert fwd_host.default_config(call).rescale_threshold == 8.0
    _check(call)


@pytest.mark.parametrize("D", [64, 128])
def test_conditional_rescale_when_the_max_keeps_growing(D):
    """Keys whose norms grow along the sequence push every row's max up by far more than the
    threshold (8 in log2) on many key tiles, so the conditional rescale moves O in the middle of
    the walk, not only at its first tile."""
    call = _dense_call(2, 300, 1100, 2, 2, D)
    growth = torch.linspace(1.0, 12.0, 1100, device="cuda").view(1, -1, 1, 1)
    call.k = (call.k.float() * growth).to(call.k.dtype)
    _check(call, rescale_threshold=8.0)


@pytest.mark.parametrize("shape", [
    (2, 1000, 1500, 4, 2, 128),  # persistent, 8 query tiles per head
    (1, 300, 700, 3, 3, 128),  # 3 query tiles: the pair's rounding tile lies past the end
    (2, 2500, 2100, 2, 1, 64),  # the 192-row tile, one CTA per item, 14 tiles, GQA
    (1, 100, 333, 2, 2, 64),  # one query tile: its partner only loads
    (2, 700, 900, 4, 2, 192),  # 112-key tiles, a ragged last one
])
def test_kv_multicast(shape):
    """CTA pairs sharing each K / V tile through TMA multicast (FwdConfig.kv_multicast)."""
    _check(_dense_call(*shape), kv_multicast=True)


def test_kv_multicast_seqused_k():
    call = _dense_call(3, 400, 512, 2, 2, 128)
    call.seqused_k = torch.tensor([512, 77, 300], dtype=torch.int32, device="cuda")
    _check(call, kv_multicast=True)


@pytest.mark.parametrize("max_ctas", [1, 5, 7, 10_000])
def test_persistent_grid_covers_every_item(monkeypatch, max_ctas):
    """A persistent grid of `max_ctas` CTAs (rounds alternating direction, a last partial round)
    writes every work item exactly once: 3 x 5 heads x 7 query tiles = 105 items. Outputs start
    as NaN, so a skipped item fails; 10_000 CTAs is more than items (a single partial round)."""
    from torch_fa4.kernels.host import fwd_launch

    monkeypatch.setattr(fwd_launch, "max_ctas", lambda call: max_ctas)
    call = _dense_call(3, 833, 900, 5, 5, 128, causal=True)
    _check(call, persistent=True)
    _check(_dense_call(2, 300, 517, 4, 2, 64), persistent=True)


@pytest.mark.parametrize("max_ctas", [1, 7, 10_000])
@pytest.mark.parametrize("shape", ["128x128", "192x128", "d192", "d96_192x112"])
def test_dynamic_schedule_covers_every_item(monkeypatch, max_ctas, shape):
    """Persistent CTAs taking items from the counter (tile_mailbox): every item written once, with
    fewer CTAs than items (each CTA loops over many, in the order the counter hands them out) and
    with more. Causal items of unequal length, ragged query and key tiles, GQA; NaN-poisoned
    outputs fail a skipped item. Two calls in a row: the counter starts from zero each time."""
    from torch_fa4.kernels.host import fwd_launch

    monkeypatch.setattr(fwd_launch, "max_ctas", lambda call: max_ctas)
    tiles = {"192x128": dict(tile_m=192, tile_n=128), "d96_192x112": dict(tile_m=192, tile_n=112)}.get(shape, {})
    D = {"128x128": 128, "192x128": 64, "d192": 192, "d96_192x112": 96}[shape]
    for causal in (True, False):
        _check(_dense_call(3, 833, 900, 4, 2, D, causal=causal), persistent=True, dynamic_schedule=True,
               **tiles)
    _check(_dense_call(1, 2100, 2500, 2, 1, D, causal=True), persistent=True, dynamic_schedule=True, **tiles)


@pytest.mark.parametrize("D", [64, 128, 192, 256])
def test_long_causal_walks_take_the_counter(D):
    """Causal calls without mods take items from the counter at every length (fwd_host
    ._dynamic_schedule_pays; NOTES "Experiment 139"): the defaults past 8192 keys, Sq < Sk (the
    bottom-right diagonal), ragged last tiles, GQA."""
    from torch_fa4.kernels.sm90 import fwd_host

    call = _dense_call(1, 2100, 8400, 4, 2, D, causal=True)
    cfg = fwd_host.default_config(call)
    assert cfg.persistent and cfg.dynamic_schedule
    _check(call)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_l2_groups_of_every_size(monkeypatch, group):
    """Work items grouped by `group` (batch, head) pairs (common.tile_scheduler; 15 pairs, so 2 and
    4 leave a partial last group): every item written once on the one-shot grid, the static and
    the dynamic persistent grid, causal (longest first) and not. The L2 size is set so
    fwd_launch.l2_group_bytes gives `group` pairs; non-causal calls are grouped the same way
    (their default is one pair per group)."""
    from torch_fa4.kernels.host import fwd_launch
    from torch_fa4.kernels.sm90 import fwd_host

    kv_bytes = 900 * (128 + 128) * 2  # one pair's K and V (Sk = 900, D = 128, bf16)
    monkeypatch.setattr(fwd_host, "L2_BYTES", 6 * kv_bytes * group + 1)  # groups: a sixth of L2
    monkeypatch.setattr(fwd_launch, "l2_group_bytes", lambda call, l2_bytes: l2_bytes // 3)
    monkeypatch.setattr(fwd_launch, "max_ctas", lambda call: 7)
    for causal in (True, False):
        call = _dense_call(3, 833, 900, 5, 5, 128, causal=causal)
        assert fwd_launch.heads_per_l2_group(call, 900, fwd_host.L2_BYTES // 3) == group
        _check(call, persistent=False)
        _check(call, persistent=True)
        _check(call, persistent=True, dynamic_schedule=True)


@pytest.mark.parametrize("tail", [1, 3, 4, 15])
def test_tail_groups(monkeypatch, tail):
    """The last `tail` (batch, head) pairs as one group after groups of 2 (common.tile_scheduler
    .grouped_order; 15 pairs: a tail of 1, 3 or 4 leaves a partial ordinary group before it, 15
    makes one group of all): every item written once on the one-shot grid and the static and
    dynamic persistent grids, causal (longest first) and not."""
    from torch_fa4.kernels.host import fwd_launch

    monkeypatch.setattr(fwd_launch, "heads_per_l2_group", lambda call, seqlen_k, l2_bytes: 2)
    monkeypatch.setattr(fwd_launch, "tail_pairs", lambda call, seqlen_q, seqlen_k, tile_m, group, num_sms: tail)
    monkeypatch.setattr(fwd_launch, "max_ctas", lambda call: 7)
    for causal in (True, False):
        call = _dense_call(3, 833, 900, 5, 5, 128, causal=causal)
        _check(call, persistent=False)
        _check(call, persistent=True)
        _check(call, persistent=True, dynamic_schedule=True)
    _check(_dense_call(3, 2100, 2100, 5, 1, 64, causal=True), tile_m=192, tile_n=128, persistent=False)


@pytest.mark.parametrize("split", [(5, 3), (36, 2), (6, 8), (4, 9)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_split_tail(monkeypatch, split):
    """The last r items split into k pieces along the keys, merged by the last piece to finish
    (kernels/common/split_tail.py), forced through fwd_host.split_plan: a few items, every item,
    one key tile per piece, and more pieces than key tiles (empty pieces). Sk = 900 leaves a
    partial last key tile (masked in the last piece). On a persistent grid of 7 CTAs, one CTA per
    item, K / V multicast (r even) and the 192-row D64 tile with an idle warpgroup in each head's
    last tile; fp16 once. Every row written once: outputs start as NaN."""
    from torch_fa4.kernels.host import fwd_launch
    from torch_fa4.kernels.sm90 import fwd_host

    r, k = split
    monkeypatch.setattr(fwd_launch, "max_ctas", lambda call: 7)
    monkeypatch.setattr(fwd_host, "split_plan", lambda cfg, call: (r, k))
    call = _dense_call(2, 700, 900, 3, 3, 128)  # 6 query tiles x 6 (batch, head) pairs = 36 items
    assert fwd_host.default_config(call).split_ways == k
    _check(call, persistent=True, kv_multicast=False)
    _check(call, persistent=False, kv_multicast=False)
    if r % 2 == 0:
        _check(call, persistent=True, kv_multicast=True)
    _check(_dense_call(2, 700, 900, 3, 1, 64, dtype=torch.float16), persistent=True)
    if r <= 12:  # 1990 = 10 x 192 + 70 rows: the third warpgroup idle in each head's last tile
        _check(_dense_call(1, 1990, 1990, 2, 2, 64), tile_m=192, tile_n=128, persistent=False)


@pytest.mark.parametrize("tiles", [dict(), dict(tile_m=192, tile_n=128)], ids=["128x128", "192x128"])
def test_early_q_release(monkeypatch, tiles):
    """Q's buffer released after the walk's last Q K^T (`early_q_release`): walks of many tiles,
    of one tile (Sk <= 128), and empty ones (causal, Sq > Sk: the first query rows see no key), on
    a persistent grid of 5 CTAs (static and dynamic) so the next items' Q loads early."""
    from torch_fa4.kernels.host import fwd_launch

    monkeypatch.setattr(fwd_launch, "max_ctas", lambda call: 5)
    D = 64 if tiles else 128
    for dynamic in (False, True):
        opts = dict(tiles, early_q_release=True, persistent=True, dynamic_schedule=dynamic)
        _check(_dense_call(2, 700, 650, 4, 2, D, causal=True), **opts)
        _check(_dense_call(2, 517, 900, 3, 3, D), **opts)
        _check(_dense_call(2, 300, 100, 2, 1, D), **opts)
        _check(_dense_call(1, 900, 200, 2, 2, D, causal=True), **opts)


@pytest.mark.parametrize("causal", [False, True])
def test_three_consumer_warpgroups(causal):
    # 192-row tiles (three consumer warpgroups taking turns), 96-key tiles: not a default yet
    _check(_dense_call(2, 700, 650, 4, 2, 64, causal=causal), tile_m=192, tile_n=96, persistent=False)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_three_consumer_warpgroups_128_key_tiles(monkeypatch, causal, persistent):
    # 192 x 128 tiles at D64 (flash-attn-4's shape there, our default past 2048 queries), one-shot and persistent.
    # Sk = 650 leaves a ragged last key tile; 700 query rows a ragged last query tile. Persistent:
    # 5 CTAs, so each loops over several work items (32 and 6 items here).
    if persistent:
        from torch_fa4.kernels.host import fwd_launch

        monkeypatch.setattr(fwd_launch, "max_ctas", lambda call: 5)
    _check(_dense_call(2, 700, 650, 4, 2, 64, causal=causal), tile_m=192, tile_n=128, persistent=persistent)
    _check(_dense_call(1, 333, 1100, 3, 1, 64, dtype=torch.float16, causal=causal), tile_m=192, tile_n=128,
           persistent=persistent)


@pytest.mark.parametrize("D", [192, 256])
def test_split_mask_loops_and_persistent_above_d128(D):
    # since P is converted by packed pairs these compile without wgmma serialization; measured in
    # bench.py --sweep d256 before becoming defaults
    _check(_dense_call(2, 700, 650, 4, 2, D, causal=True), split_mask_loops=True)
    _check(_dense_call(1, 333, 1100, 3, 1, D, causal=True, window_left=200, window_right=30, softcap=20.0),
           split_mask_loops=True)
    _check(_dense_call(2, 517, 900, 4, 4, D), split_mask_loops=True, persistent=True)


def _varlen_causal_d64_call():
    """Five causal D64 sequences of mixed lengths (one of a single token), GQA 4 / 2: items of
    several lengths, ragged 192-row tiles and one-tile walks in one launch."""
    lens = [100, 257, 1, 1000, 70]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return AttentionCall(q=q, k=k, v=v, scale=0.125, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                         max_seqlen_q=max(lens), max_seqlen_k=max(lens))


@pytest.mark.parametrize("grid", ["one-shot", "persistent", "dynamic"])
def test_idle_warpgroups_skip_their_matmuls(grid):
    """In the last query tile of a sequence, warpgroups whose 64 rows all lie past
    its end issue no matmul (fwd._idle_item) but keep the ring and the turns in step. 192-row
    tiles with one and two idle warpgroups, 128-row tiles at D128 and D256 (O staged over Q), GQA,
    causal / window / varlen, and items of several lengths in one persistent CTA."""
    grids = {"one-shot": dict(persistent=False), "persistent": dict(persistent=True, dynamic_schedule=False),
             "dynamic": dict(persistent=True, dynamic_schedule=True)}[grid]
    wide = dict(tile_m=192, tile_n=128, **grids)
    for S, causal in ((1000, False), (257, True), (4096 + 100, True), (200, False)):
        _check(_dense_call(2, S, S, 8, 2, 64, causal=causal), **wide)
    _check(_dense_call(1, 333, 1100, 3, 1, 64, causal=True, window_left=300, window_right=20), **wide)
    _check(_varlen_causal_d64_call(), **wide)
    if grid != "dynamic":  # (D256 on the dynamic schedule is its default at these lengths: test_causal)
        _check(_dense_call(2, 300, 300, 4, 4, 256, causal=True), **grids)
    _check(_dense_call(2, 300, 700, 6, 3, 128), **grids)


def test_warpgroups_skip_a_fully_masked_first_tile():
    """skip_masked_first: a warpgroup whose rows see no key of the walk's first (rightmost) tile
    skips its Q K^T and softmax, P zero. Cases where that happens: the 192-row D64 tile on the
    diagonal (one or two warpgroups, by the tile's parity), D192's 112- and D256's 80-key tiles,
    Sq < Sk and Sq > Sk causal offsets (rows with no key at all), windows, GQA, varlen, one-tile
    walks, persistent CTAs, the early O rescale."""
    skip = dict(skip_masked_first=True)
    wide = dict(tile_m=192, tile_n=128, **skip)
    for Sq, Sk in ((1000, 1000), (700, 650), (333, 1100), (900, 200), (64, 64)):
        _check(_dense_call(2, Sq, Sk, 4, 2, 64, causal=True), persistent=False, **wide)
    _check(_dense_call(2, 700, 650, 4, 2, 64, causal=True), persistent=False, early_o_rescale=True, **wide)
    _check(_dense_call(1, 333, 1100, 3, 1, 64, causal=True, window_left=300, window_right=20), **wide)
    _check(_dense_call(1, 1000, 1000, 3, 3, 64, window_left=-1, window_right=10), **wide)
    for D in (128, 192, 256):
        _check(_dense_call(2, 700, 700, 4, 2, D, causal=True), **skip)
        _check(_dense_call(2, 300, 900, 2, 2, D, causal=True), persistent=True, **skip)
        _check(_dense_call(2, 900, 300, 2, 1, D, causal=True), **skip)
    _check(_varlen_causal_d64_call(), **wide)


def test_early_o_rescale_three_consumer_warpgroups():
    _check(_dense_call(2, 700, 650, 4, 2, 64, causal=True), tile_m=192, tile_n=128, persistent=False,
           early_o_rescale=True)


@pytest.mark.parametrize("causal", [False, True])
def test_d64_default_past_2048_queries(causal):
    # the default shape of long plain D64 calls (fwd_host._tiles): 192 x 128, three K/V stages
    # without causal masking; Sq = 2100 leaves a ragged last query tile, Sk = 2500 a key tile
    from torch_fa4.kernels.sm90 import fwd_host

    call = _dense_call(1, 2100, 2500, 4, 2, 64, causal=causal)
    cfg = fwd_host.default_config(call)
    assert (cfg.tile_m, cfg.tile_n, cfg.num_stages, cfg.max_chains) == (192, 128, 2 if causal else 3, 2)
    _check(call)


@pytest.mark.parametrize("chains", [1, 3, 4])
@pytest.mark.parametrize("D, causal", [(64, False), (64, True), (128, True)])
def test_row_max_chains_change_no_bit(chains, D, causal):
    """The row max as several FMNMX chains (FwdConfig.max_chains) is the same max: every output
    bit equals the one-chain kernel's, on a ragged shape, after the usual float64 check."""
    call = _dense_call(2, 2300, 2100, 4, 2, D, causal=causal)
    _check(call, max_chains=chains)
    out, lse = _run_kernel(call, max_chains=chains)
    ref_out, ref_lse = _run_kernel(call, max_chains=2 if chains == 1 else 1)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("causal", [False, True])
def test_d96_192_row_tiles(causal):
    """192 x 112 tiles at D96 (fwd_host._D96_WIDE: three consumer warpgroups): ragged query and key
    tiles, GQA, fp16, Sq < Sk, and the defaults that take them past 2048 queries (causal walks on
    the dynamic schedule)."""
    from torch_fa4.kernels.sm90 import fwd_host

    wide = dict(tile_m=192, tile_n=112, persistent=False)
    _check(_dense_call(2, 700, 650, 4, 2, 96, causal=causal), **wide)
    _check(_dense_call(1, 333, 1100, 3, 1, 96, dtype=torch.float16, causal=causal), **wide)
    for sk in (2500, 8300):
        call = _dense_call(1, 2100, sk, 2, 1, 96, causal=causal)
        cfg = fwd_host.default_config(call)
        assert (cfg.tile_m, cfg.tile_n) == (192, 112)
        assert cfg.dynamic_schedule == causal
        _check(call)


def test_d96_long_plain_default():
    """D96 plain calls of 4096 keys or more (on the 128-row tile: up to 2048 queries): O rescaled
    after the P V wait, with K / V multicast to CTA pairs (fwd_host defaults); ragged last query
    and key tiles, GQA."""
    from torch_fa4.kernels.sm90 import fwd_host

    call = _dense_call(1, 2000, 4200, 4, 2, 96)
    cfg = fwd_host.default_config(call)
    assert not cfg.early_o_rescale and cfg.kv_multicast
    _check(call)


def test_one_shot_grid():
    # what long causal calls and long D256 calls run (short ones in these tests default to the
    # dynamic schedule's persistent grid)
    _check(_dense_call(3, 833, 900, 5, 5, 128, causal=True), persistent=False)
    _check(_dense_call(2, 700, 650, 4, 2, 256, causal=True), persistent=False)
    _check(_dense_call(2, 517, 900, 4, 4, 256), persistent=False)


# ---- score_mod / mask_mod / block sparsity, through the public API ------------------------------------
#
# Every call goes through torch_fa4.attention / flex_attention, so argument handling and dispatch are
# exercised; a wrapper around the kernel's host entry poisons out/lse with NaN before the launch and
# records the kernel variant, so each test also proves the kernel (not the reference) ran, with or
# without block sparsity as intended. The oracle is tests/naive.py (float64, full score matrix, mods
# evaluated on CPU index grids with CPU copies of the captured tensors); the bound is twice the error
# of an eager computation in the input dtype (bf16 matmuls, fp32 softmax, P rounded to bf16).

import torch_fa4  # noqa: E402
from torch_fa4 import mods as M  # noqa: E402

from _mod_cases import alibi_abs  # noqa: E402


@pytest.fixture
def sm90_fwd_variants(monkeypatch):
    from torch_fa4.kernels.sm90 import fwd_host

    return poison_forward(monkeypatch, fwd_host, default_variant(fwd_host))


def _check_against_naive(out, lse, q, k, v, mods_gpu, mods_cpu, **kw):
    """out (B, S, H, Dv), lse (B, H, S) of one dense call; mods_*: (score_mod, mask_mod) built on that
    device; rows with nothing visible must be exactly zero with LSE -inf."""
    check_mods_against_naive(out, lse, q, k, v, mods_gpu, mods_cpu, empty_lse_exact=True, empty_rows_zero=True,
                             **kw)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_alibi_score_mod(sm90_fwd_variants, D, causal):
    B, S, H = 2, 333, 4
    q, k, v = _qkv(B, S, S, H, H, D)
    slopes = M.alibi_slopes(H, device="cuda")
    out, lse = _public(torch_fa4.attention, q, k, v, causal=causal, score_mod=M.alibi(slopes), return_lse=True)
    assert len(sm90_fwd_variants) == 1 and sm90_fwd_variants[0].mod_key
    _check_against_naive(out, lse, q, k, v, (M.alibi(slopes), None), (M.alibi(slopes.cpu()), None), causal=causal)


def _alibi_abs_case(B, Sq, Sk, H, Hkv, D, causal):
    """One call with slope * |q_idx - kv_idx| through the public API on fresh inputs, checked
    against float64."""
    q, k, v = _qkv(B, Sq, Sk, H, Hkv, D)
    slopes = M.alibi_slopes(H, device="cuda")
    out, lse = _public(torch_fa4.attention, q, k, v, causal=causal, score_mod=alibi_abs(slopes), return_lse=True)
    _check_against_naive(out, lse, q, k, v, (alibi_abs(slopes), None), (alibi_abs(slopes.cpu()), None),
                         causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(517, 517), (200, 517), (517, 200)])
def test_alibi_abs_every_sign_branch(sm90_fwd_variants, Sq, Sk, causal):
    """slope * |q_idx - kv_idx| runs on three paths chosen per key tile and thread (q_idx - kv_idx
    >= 0, <= 0, or mixed; mod_fragment.emit_score_mod). 517 positions: tiles on both sides of the
    diagonal and on it; Sq != Sk shifts the causal diagonal (bottom-right) off q_idx == kv_idx, so
    unmasked tiles of either sign occur too."""
    _alibi_abs_case(2, Sq, Sk, 4, 4, 128, causal)
    assert len(sm90_fwd_variants) == 1 and sm90_fwd_variants[0].mod_key


@pytest.mark.parametrize("D", [64, 128])
def test_long_causal_score_mod_takes_the_counter(sm90_fwd_variants, D):
    """Causal calls whose only mod is a score_mod take items from the counter past 8192 keys too
    (fwd_host._dynamic_schedule_pays, NOTES "Experiment 140"): 8400 keys, 2100 queries (a
    bottom-right diagonal far from q_idx == kv_idx, ragged last tiles), GQA."""
    _alibi_abs_case(1, 2100, 8400, 4, 2, D, True)
    assert len(sm90_fwd_variants) == 1 and sm90_fwd_variants[0].dynamic_schedule


@pytest.mark.parametrize("causal", [False, True])
def test_d64_score_mod_on_192_row_tiles(sm90_fwd_variants, causal):
    """D64 past 2048 queries with a score_mod alone: 192-row tiles (three consumer warpgroups),
    causal on the dynamic schedule, three K/V stages without a mask; 2100 queries leave a ragged
    last tile, 2500 keys a ragged last key tile and a bottom-right diagonal off q_idx == kv_idx."""
    _alibi_abs_case(1, 2100, 2500, 2, 2, 64, causal)
    assert len(sm90_fwd_variants) == 1 and sm90_fwd_variants[0].tile_m == 192


def test_alibi_flex_attention_gqa(sm90_fwd_variants):
    B, H, Hkv, S, D = 2, 8, 2, 300, 128
    q, k, v = _qkv(B, S, S, H, Hkv, D)
    slopes = M.alibi_slopes(H, device="cuda")
    out, lse = _public(torch_fa4.flex_attention, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       score_mod=M.alibi(slopes), enable_gqa=True, return_lse=True)
    assert len(sm90_fwd_variants) == 1
    _check_against_naive(out.transpose(1, 2), lse, q, k, v, (M.alibi(slopes), None), (M.alibi(slopes.cpu()), None))


@pytest.mark.parametrize("with_softcap_arg", [False, True])
def test_softcap_score_mod(sm90_fwd_variants, with_softcap_arg):
    # softcap as a score_mod (on top of the built-in softcap argument, which runs first)
    B, S, H, D = 2, 300, 4, 128
    q, k, v = _qkv(B, S, S, H, H, D)
    q, k = q * 3, k * 3
    cap = 30.0 if with_softcap_arg else 0.0
    mod = M.softcap_score(5.0)
    out, lse = _public(torch_fa4.attention, q, k, v, softcap=cap, score_mod=mod, causal=True, return_lse=True)
    # alone, the tanh score_mod is the built-in softcap (torch_fa4/mods/idioms.py); after the
    # built-in one, it stays a score_mod
    cfg, = sm90_fwd_variants
    assert cfg.softcap and bool(cfg.mod_key) == with_softcap_arg
    _check_against_naive(out, lse, q, k, v, (mod, None), (mod, None), softcap=cap, causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_per_head_bias_table(sm90_fwd_variants, dtype):
    B, S, H, D = 2, 257, 4, 128
    q, k, v = _qkv(B, S, S, H, H, D, dtype)
    bias = torch.randn(H, S, S, device="cuda") * 2
    out, lse = _public(torch_fa4.attention, q, k, v, score_mod=M.relative_bias(bias), return_lse=True)
    assert len(sm90_fwd_variants) == 1
    _check_against_naive(out, lse, q, k, v, (M.relative_bias(bias), None), (M.relative_bias(bias.cpu()), None))


@pytest.mark.parametrize("D", [64, 128, 192, 256])
@pytest.mark.parametrize("block_mask", [False, True])
def test_document_mask(sm90_fwd_variants, D, block_mask):
    out, lse, q, k, v, mask, cpu_mask = causal_documents_call(D, block_mask)
    assert len(sm90_fwd_variants) == 1 and sm90_fwd_variants[0].block_sparse == block_mask
    _check_against_naive(out, lse, q, k, v, (None, mask), (None, cpu_mask))


@pytest.mark.parametrize("block_size", [128, (256, 128), (128, 64)])
def test_sliding_window_mask_with_block_mask(sm90_fwd_variants, block_size):
    # a window per head: a mask only the block mask's tile map speeds up
    B, S, H, D = 2, 1000, 4, 64
    q, k, v = _qkv(B, S, S, H, H, D)

    def mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= 200 - 40 * h) & (kv_idx <= q_idx)

    bm = torch_fa4.create_block_mask(mask, None, H, S, S, device="cuda", BLOCK_SIZE=block_size)
    out, lse = _public(torch_fa4.attention, q, k, v, block_mask=bm, return_lse=True)
    assert len(sm90_fwd_variants) == 1 and sm90_fwd_variants[0].block_sparse
    _check_against_naive(out, lse, q, k, v, (None, mask), (None, mask))


def test_a_sliding_window_mask_runs_as_the_window_argument(sm90_fwd_variants):
    # the same window for every head is the built-in window (torch_fa4/mods/idioms.py)
    B, S, H, D = 2, 1000, 4, 64
    q, k, v = _qkv(B, S, S, H, H, D)
    mask = M.sliding_window_mask(200)
    bm = torch_fa4.create_block_mask(mask, None, None, S, S, device="cuda")
    out, lse = _public(torch_fa4.attention, q, k, v, block_mask=bm, return_lse=True)
    assert len(sm90_fwd_variants) == 1
    assert not sm90_fwd_variants[0].block_sparse and not sm90_fwd_variants[0].mod_key
    _check_against_naive(out, lse, q, k, v, (None, mask), (None, mask))


def test_block_mask_per_batch_and_head_with_score_mod(sm90_fwd_variants):
    # a block mask with real B and H dims (no broadcast), a mask that depends on b and h, ALiBi on top
    B, S, H, Hkv, D = 2, 520, 4, 2, 128
    q, k, v = _qkv(B, S, S, H, Hkv, D)
    widths = torch.tensor([[40, 300, 90, 7], [500, 1, 60, 200]], device="cuda", dtype=torch.int32)

    def banded(w):
        return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= w[b, h]) & (kv_idx <= q_idx)

    slopes = M.alibi_slopes(H, device="cuda")
    bm = torch_fa4.create_block_mask(banded(widths), B, H, S, S, device="cuda")
    out, lse = _public(torch_fa4.attention, q, k, v, block_mask=bm, score_mod=M.alibi(slopes), return_lse=True)
    assert len(sm90_fwd_variants) == 1 and sm90_fwd_variants[0].block_sparse
    _check_against_naive(out, lse, q, k, v, (M.alibi(slopes), banded(widths)),
                         (M.alibi(slopes.cpu()), banded(widths.cpu())))


def test_block_mask_with_empty_rows_and_causal_flag(sm90_fwd_variants):
    # queries before position 150 see nothing (whole query tiles with no listed key tile), and the
    # causal argument (bottom-right, Sq < Sk) cuts into tiles the block mask calls full
    B, Sq, Sk, H, D = 1, 400, 600, 2, 128
    q, k, v = _qkv(B, Sq, Sk, H, H, D)

    def late(b, h, q_idx, kv_idx):
        return q_idx >= 150

    bm = torch_fa4.create_block_mask(late, None, None, Sq, Sk, device="cuda")
    out, lse = _public(torch_fa4.attention, q, k, v, block_mask=bm, causal=True, return_lse=True)
    assert len(sm90_fwd_variants) == 1 and sm90_fwd_variants[0].block_sparse
    _check_against_naive(out, lse, q, k, v, (None, late), (None, late), causal=True)
    assert torch.isinf(lse[:, :, :150]).all() and (out[:, :150] == 0).all()


def test_torch_block_mask(sm90_fwd_variants):
    # a BlockMask built by torch's own create_block_mask is read the same way
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    B, S, H, D = 1, 640, 2, 128
    q, k, v = _qkv(B, S, S, H, H, D)
    ids = random_document_ids(S, "cuda")
    mask = M.document_mask(ids)
    bm = flex.create_block_mask(mask, None, None, S, S, device="cuda")
    out = _public(torch_fa4.flex_attention, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm)
    assert len(sm90_fwd_variants) == 1 and sm90_fwd_variants[0].block_sparse
    ref, _ = naive_attention(q, k, v, mask_mod=M.document_mask(ids.cpu()))
    err = (out.transpose(1, 2).double().cpu() - ref).abs().max().item()
    assert not out.isnan().any() and err < 2e-2, err


@pytest.mark.parametrize("block_mask", [False, True])
def test_mods_varlen_causal_gqa(sm90_fwd_variants, block_mask):
    # packed sequences of lengths that are not multiples of the tile; mods see per-sequence positions
    # and the sequence index as b
    lens_q = [1, 130, 257, 64, 300]
    lens_k = [5, 129, 300, 64, 400]
    B, H, Hkv, D = len(lens_q), 8, 2, 128
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), Hkv, D, device="cuda", dtype=torch.bfloat16)
    slopes = M.alibi_slopes(H, device="cuda")
    period = torch.randint(2, 6, (B,), device="cuda", dtype=torch.int32)

    def thinned(per):
        return lambda b, h, q_idx, kv_idx: ((kv_idx % per[b]) != 1) | (kv_idx == 0)

    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
              causal=True, score_mod=M.alibi(slopes), return_lse=True)
    if block_mask:
        kw["block_mask"] = torch_fa4.create_block_mask(thinned(period), B, None, max(lens_q), max(lens_k), device="cuda")
    else:
        kw["mask_mod"] = thinned(period)
    out, lse = _public(torch_fa4.attention, q, k, v, **kw)
    assert len(sm90_fwd_variants) == 1 and sm90_fwd_variants[0].varlen_q
    assert sm90_fwd_variants[0].block_sparse == block_mask
    assert not out.isnan().any() and not lse.isnan().any()
    slopes_cpu, period_cpu = slopes.cpu(), period.cpu()
    for b in range(B):
        qs, ks = slice(cu_q[b].item(), cu_q[b + 1].item()), slice(cu_k[b].item(), cu_k[b + 1].item())
        qb, kb, vb = q[qs][None], k[ks][None], v[ks][None]

        def shift(fn, n):  # the sequence's own batch index for the single-sequence references
            return lambda *a: fn(*a[:-4], a[-4] + n, *a[-3:])

        mods_gpu = (shift(M.alibi(slopes), b), shift(thinned(period), b))
        mods_cpu = (shift(M.alibi(slopes_cpu), b), shift(thinned(period_cpu), b))
        _check_against_naive(out[qs][None], lse[:, qs][None], qb, kb, vb, mods_gpu, mods_cpu, causal=True)


def test_mods_new_values_reuse_the_kernel(sm90_fwd_variants):
    from torch_fa4.kernels import compile_cache

    B, S, H, D = 1, 200, 4, 128
    q, k, v = _qkv(B, S, S, H, H, D)
    _public(torch_fa4.attention, q, k, v, score_mod=M.alibi(torch.rand(H, device="cuda")))
    entries = compile_cache.stats()["entries"]
    slopes = torch.rand(H, device="cuda")
    out, lse = _public(torch_fa4.attention, q, k, v, score_mod=M.alibi(slopes), return_lse=True)
    assert compile_cache.stats()["entries"] == entries
    assert sm90_fwd_variants[0] == sm90_fwd_variants[1]
    _check_against_naive(out, lse, q, k, v, (M.alibi(slopes), None), (M.alibi(slopes.cpu()), None))


_DISK_CACHE_GPU_SCRIPT = r"""
import sys, torch
sys.path.append(sys.argv[2])  # tests/
from naive import naive_attention
from torch_fa4 import mods as M
from torch_fa4.mods import registry
from torch_fa4.call import AttentionCall
from torch_fa4.kernels import compile_cache
from torch_fa4.kernels.sm90 import fwd_host
torch.manual_seed(int(sys.argv[1]))
B, S, H, D = 2, 300, 4, 128
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
slopes = M.alibi_slopes(H, device="cuda")
key, aux = M.prepare(M.alibi(slopes), None)
worst = 0.0
for mods in ({}, dict(mod_key=key, mods=registry.lookup(key), aux_tensors=tuple(aux))):
    call = AttentionCall(q=q, k=k, v=v, scale=D ** -0.5, causal=True, **mods)
    out = torch.full(call.out_shape(), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full(call.lse_shape(), float("nan"), device="cuda")
    fwd_host.forward(call, out, lse)
    torch.cuda.synchronize()
    ref, _ = naive_attention(q, k, v, scale=D ** -0.5, causal=True,
                             score_mod=M.alibi(slopes) if mods else None, device="cuda")
    worst = max(worst, float((out.double() - ref).abs().max()), float("inf") if out.isnan().any() or lse.isnan().any() else 0.0)
print("RESULT", worst, compile_cache.stats()["from_disk"], "cutlass" in sys.modules)
"""


def test_disk_cache_across_processes(tmp_path):
    """TORCH_FA4_KERNEL_CACHE=1 (the default): a second process loads the kernels the first stored and
    gets the same correct results without importing CuTe DSL."""
    from _fresh_process import result_fields

    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TORCH_FA4_KERNEL_CACHE="1", TORCH_FA4_CACHE_DIR=str(tmp_path))
    results = []
    for seed in torch.randint(0, 2**31, (2,)).tolist():
        worst, from_disk, dsl = result_fields(_DISK_CACHE_GPU_SCRIPT, env, str(seed), tests_dir)
        results.append((float(worst), int(from_disk), dsl == "True"))
    assert results[0][1:] == (0, True), results
    assert results[1][1:] == (2, False), results
    for worst, _, _ in results:
        assert worst < 2e-2, results  # bf16 output vs float64 (a wrong kernel is off by O(0.1-1))


@pytest.mark.parametrize("D", [64, 96])
def test_item_grid(D):
    """One-shot plain calls launch a (query tile, head, batch) grid (FwdConfig.grid3d): every item
    runs (outputs start as NaN), with the same bits as the flat grid's decode. Ragged last query
    tile, GQA, several batches; the 192-row tile's calls."""
    from torch_fa4.kernels.sm90 import fwd_host

    call = _dense_call(3, 2300, 2500, 4, 2, D)
    cfg = fwd_host.default_config(call)
    assert cfg.grid3d and not cfg.persistent and cfg.tile_m == 192
    _check(call)
    out, lse = _run_kernel(call)
    flat_out, flat_lse = _run_kernel(call, grid3d=False)
    assert torch.equal(out, flat_out) and torch.equal(lse, flat_lse)


@pytest.mark.parametrize("case", ["plain", "causal", "fp16", "window", "short", "softcap"])
def test_hand_descriptors(case):
    """The key loop's matmuls from hand-built descriptors (FwdConfig.hand_descriptors,
    kernels/common/wgmma_desc.py; the default of plain calls on D64's 192-row tile): exact against
    float64 on poisoned outputs and bit-identical to cute.gemm's descriptors, on the 192-row D64
    tile (one-shot and causal, with the masked loops), the 128-row tile of short calls
    (persistent: Q's descriptor kept across items), fp16, windows and softcap; ragged lengths,
    GQA."""
    kw = dict(plain={}, causal=dict(causal=True), fp16={}, window=dict(window_left=300, window_right=40),
              short={}, softcap=dict(softcap=20.0))[case]
    dtype = torch.float16 if case == "fp16" else torch.bfloat16
    Sq, Sk = (700, 900) if case == "short" else (2300, 2500)
    call = _dense_call(3, Sq, Sk, 4, 2, 64, dtype, **kw)
    _check(call, hand_descriptors=True)
    out, lse = _run_kernel(call, hand_descriptors=True)
    ref_out, ref_lse = _run_kernel(call, hand_descriptors=False)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
