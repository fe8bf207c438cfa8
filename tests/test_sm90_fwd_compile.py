"""CPU: every advertised sm90 forward variant compiles for sm_90a and its SASS uses HGMMA.

CuTe DSL produces real cubins without a GPU (CUTE_DSL_ARCH=sm_90a); nvdisasm (nvidia-cuda-nvdisasm)
shows whether the matmuls became warpgroup MMAs, and that nothing spilled to local memory.
One compile per variant (a few seconds each). Mod variants (score_mod / mask_mod with captured
tensors, block-sparse) compile the same way from mods traced on CPU tensors; the host-side block-mask
mapping and refusals, the launch argument list and the opt-in kernel disk cache are checked too.
"""

import os
from dataclasses import replace

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from _fwd_host_checks import check_variant_reuse, cpu_launch_error, mod_variant_config  # noqa: E402
from _mod_cases import alibi_abs  # noqa: E402
from sass import (cuda_major, exps_after_pv_wait, issued_when_ready, key_loops, sass_of,  # noqa: E402
                  spills_between_matmuls, without_addresses)
from torch_fa4.call import AttentionCall  # noqa: E402


def _call(D, dtype=torch.bfloat16, **kw):
    q = torch.empty(1, 8, 2, D, dtype=dtype)  # shapes are symbolic in the kernel: any will do
    return AttentionCall(q=q, k=q, v=q, scale=D ** -0.5, **kw)


def _mod_call(D, score_mod=None, mask_mod=None, block_size=None, S=256, H=4, **kw):
    """An AttentionCall with traced mods (captured tensors on CPU: only dtype and rank matter here)
    and, with block_size, a block mask built from mask_mod."""
    from torch_fa4 import mods as M
    from torch_fa4.mods import registry

    q = torch.empty(1, S, H, D, dtype=torch.bfloat16)
    key, aux = M.prepare(score_mod, mask_mod)
    extra = {}
    if block_size is not None:
        bm = M.create_block_mask(mask_mod, None, None, S, S, device="cpu", BLOCK_SIZE=block_size)
        extra = dict(block_mask=tuple(bm.as_tensors()), block_mask_q=bm.BLOCK_SIZE[0], block_mask_kv=bm.BLOCK_SIZE[1])
    return AttentionCall(q=q, k=q, v=q, scale=D ** -0.5, mod_key=key, mods=registry.lookup(key),
                         aux_tensors=tuple(aux), **extra, **kw)


def _alibi(H=4):
    from torch_fa4 import mods as M

    return M.alibi(M.alibi_slopes(H))


def _alibi_abs(H=4):
    from torch_fa4 import mods as M

    return alibi_abs(M.alibi_slopes(H))


def _bias_table(H=4, S=256):
    from torch_fa4 import mods as M

    return M.relative_bias(torch.randn(H, S, S))


def _doc_mask(S=256):
    from torch_fa4 import mods as M

    return M.document_mask(torch.randint(0, 3, (S,), dtype=torch.int32).sort().values)


# name -> builder of an AttentionCall with mods (built lazily: tracing needs the mods package)
MOD_VARIANTS = {
    "d128_alibi": lambda: _mod_call(128, score_mod=_alibi()),
    "d128_alibi_softcap_causal": lambda: _mod_call(128, score_mod=_alibi(), softcap=20.0, causal=True),
    # causal score_mod-only calls run the dynamic schedule's persistent loop (fwd_host._dynamic_schedule_pays)
    "d128_alibi_causal": lambda: _mod_call(128, score_mod=_alibi(), causal=True),
    "d64_bias_table_causal": lambda: _mod_call(64, score_mod=_bias_table(), causal=True),
    "d128_document_mask": lambda: _mod_call(128, mask_mod=_doc_mask()),
    "d128_document_block_mask": lambda: _mod_call(128, mask_mod=_doc_mask(), block_size=128),
    # D=256 key tiles shrink to 64 under a 128-key block mask: two kernel tiles per block-mask tile
    "d256_document_block_mask_varlen": lambda: _mod_call(256, mask_mod=_doc_mask(), block_size=128),
    "d64_alibi_document_block_256x128": lambda: _mod_call(64, score_mod=_alibi(), mask_mod=_doc_mask(),
                                                          block_size=(256, 128)),
    # past 2048 queries a D64 score_mod alone runs the 192-row tile (fwd_host._tiles), causal on the
    # dynamic schedule, otherwise one CTA per item with three K/V stages; abs: three sign branches
    "d64_alibi_abs_causal_192_rows": lambda: _mod_call(64, score_mod=_alibi_abs(), S=4096, causal=True),
    "d64_alibi_abs_192_rows": lambda: _mod_call(64, score_mod=_alibi_abs(), S=4096),
}


VARIANTS = {
    **{f"d{D}{'_causal' if c else ''}": (dict(D=D, causal=c), {}) for D in (64, 96, 128, 192, 256) for c in (False, True)},
    "d128_fp16": (dict(D=128, dtype=torch.float16), {}),
    # windowed calls run the dynamic schedule's persistent loop (fwd_host._dynamic_schedule_pays)
    "d128_window": (dict(D=128, window_left=64, window_right=0), {}),
    "d128_window_one_shot": (dict(D=128, window_left=64, window_right=0), dict(persistent=False)),
    "d64_softcap_window_two_sided": (dict(D=64, softcap=30.0, window_left=200, window_right=100), {}),
    "d192_window": (dict(D=192, causal=True, window_left=512), {}),
    "d128_softcap_causal": (dict(D=128, softcap=10.0, causal=True), {}),
    "d64_varlen_causal": (dict(D=64, causal=True), dict(varlen_q=True, varlen_k=True)),
    "d128_seqused": (dict(D=128), dict(has_seqused_k=True)),
    # D <= 128 defaults to the persistent grid; the one-shot grid stays selectable
    "d128_causal_one_shot": (dict(D=128, causal=True), dict(persistent=False)),
    # 192 rows, three consumer warpgroups at 160 registers, 96-key tiles
    "d64_192x96_causal": (dict(D=64, causal=True), dict(tile_m=192, tile_n=96, persistent=False)),
    # 192 x 128 (flash-attn-4's D64 shape) fits 160 registers once P is converted by packed pairs
    # (kernels/common/convert.py), persistent loop too
    "d64_192x128": (dict(D=64), dict(tile_m=192, tile_n=128, persistent=False)),
    # D96's 192-row tile past 2048 queries (fwd_host._D96_WIDE; 128-key tiles spill there)
    "d96_192x112": (dict(D=96), dict(tile_m=192, tile_n=112, persistent=False)),
    "d96_192x112_causal": (dict(D=96, causal=True), dict(tile_m=192, tile_n=112, persistent=False)),
    "d64_192x128_causal": (dict(D=64, causal=True), dict(tile_m=192, tile_n=128, persistent=False)),
    "d64_192x128_persistent": (dict(D=64), dict(tile_m=192, tile_n=128, persistent=True)),
    "d64_192x128_causal_persistent": (dict(D=64, causal=True), dict(tile_m=192, tile_n=128, persistent=True)),
    # the shapes here are short, so causal calls and D256 default to the dynamic schedule's
    # persistent loop (fwd_host._dynamic_schedule_pays); long plain D256 ones run one CTA per item
    "d256_one_shot": (dict(D=256), dict(persistent=False)),
    "d256_causal_one_shot": (dict(D=256, causal=True), dict(persistent=False)),
    # D256 past 2048 keys splits its key loop by mask (fwd_host._tiles)
    "d256_causal_split": (dict(D=256, causal=True), dict(split_mask_loops=True)),
    "d256_softcap_window_split": (dict(D=256, causal=True, softcap=30.0, window_left=512), dict(split_mask_loops=True)),
    # the D64 default past 2048 queries without causal masking (fwd_host._tiles): three K/V stages
    "d64_192x128_3_stages": (dict(D=64), dict(tile_m=192, tile_n=128, persistent=False, num_stages=3)),
    # the D128 default for plain and causal calls (fwd_host._d128_cond_rescale_pays), persistent and causal
    "d128_cond_rescale": (dict(D=128), dict(rescale_threshold=8.0)),
    "d128_causal_cond_rescale": (dict(D=128, causal=True), dict(rescale_threshold=8.0, persistent=False)),
    # CTA pairs multicasting each K / V tile (FwdConfig.kv_multicast; fwd_host._kv_multicast_pays)
    "d128_kv_multicast": (dict(D=128), dict(kv_multicast=True)),
    "d128_kv_multicast_one_shot": (dict(D=128), dict(kv_multicast=True, persistent=False)),
    "d96_kv_multicast": (dict(D=96), dict(kv_multicast=True)),
    "d256_kv_multicast": (dict(D=256), dict(kv_multicast=True, persistent=False, dynamic_schedule=False)),
    "d64_192x128_kv_multicast": (dict(D=64), dict(tile_m=192, tile_n=128, persistent=False, num_stages=3,
                                                  kv_multicast=True)),
    "d128_fp16_seqused_kv_multicast": (dict(D=128, dtype=torch.float16), dict(has_seqused_k=True, kv_multicast=True)),
    # the grid's last items split along the keys (kernels/common/split_tail.py): persistent with
    # multicast, one CTA per item with multicast, the 192-row tile, the persistent 128-row D64 tile
    "d128_kv_multicast_split": (dict(D=128), dict(kv_multicast=True, split_ways=5)),
    "d96_kv_multicast_split": (dict(D=96), dict(kv_multicast=True, split_ways=8)),
    "d256_kv_multicast_split": (dict(D=256), dict(kv_multicast=True, persistent=False, dynamic_schedule=False,
                                                  split_ways=5)),
    "d64_192x128_split": (dict(D=64), dict(tile_m=192, tile_n=128, persistent=False, num_stages=3, split_ways=3)),
    "d64_split": (dict(D=64), dict(split_ways=2)),
    # persistent CTAs taking items from a counter (kernels/common/tile_mailbox.py)
    "d128_causal_dynamic": (dict(D=128, causal=True), dict(persistent=True, dynamic_schedule=True)),
    "d64_192x128_causal_dynamic": (dict(D=64, causal=True),
                                   dict(tile_m=192, tile_n=128, persistent=True, dynamic_schedule=True)),
}


def _compile_and_check_sass(cfg, tmp_path):
    from torch_fa4.kernels.sm90 import fwd_host

    fwd_host.compile_fwd(cfg, dump_dir=str(tmp_path))  # bypasses the cache: always a fresh cubin
    sass = sass_of(tmp_path)
    assert "HGMMA" in sass, "matmuls did not become warpgroup MMAs"
    # An accumulator spilling shows up as hundreds of spill instructions in the key loop (D=64 at
    # 192 rows had 329, D=128 with 176-key tiles 512), which this catches. A few scalar spills there
    # are tolerated (d128 causal: 2). Outside the loop the persistent kernel keeps the epilogue's
    # shared-memory addresses across work items and ptxas parks some of them in local memory
    # (d96: ~50 instructions, once per work item), hence the looser bound on the whole kernel.
    loop_spills = spills_between_matmuls(sass)
    assert loop_spills <= 8, f"{loop_spills} local-memory spill instructions in the key loop"
    spills = sass.count("LDL") + sass.count("STL")
    assert spills <= 160, f"{spills} local-memory spill instructions"
    # ptxas serializes the wgmmas when it runs short of registers (advisory C7512): a wait then
    # follows every HGMMA (33 waits at D128) instead of one per committed group (9 with the three
    # key loops)
    waits = sass.count("WARPGROUP.DEPBAR")
    assert waits <= 16, f"{waits} wgmma waits: ptxas serialized the matmuls"
    assert "SETMAXNREG" in sass.upper() or "USETMAXREG" in sass, "no register reallocation"
    return sass


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_compiles_to_hgmma(name, tmp_path):
    from torch_fa4.kernels.sm90 import fwd_host

    call_kw, cfg_kw = VARIANTS[name]
    cfg = fwd_host.default_config(_call(**call_kw), **cfg_kw)
    _compile_and_check_sass(cfg, tmp_path)


@pytest.mark.parametrize("name", list(MOD_VARIANTS))
def test_mod_variant_compiles_to_hgmma(name, tmp_path):
    from torch_fa4.kernels.sm90 import fwd_host

    cfg = mod_variant_config(fwd_host, MOD_VARIANTS[name]())
    if name.endswith("_varlen"):
        cfg = replace(cfg, varlen_q=True, varlen_k=True)
    sass = _compile_and_check_sass(cfg, tmp_path)
    # captured tensors (slopes, document ids) and block-mask indices are read with global loads
    assert "LDG" in sass, "no global loads: captured tensors not read"


def test_public_causal_calls_run_the_causal_variants():
    """torch_fa4.attention and the SDPA route pass causal calls with window_right = 0 (flash-attn's
    convention). That is no window: they get the variant a causal call without it gets (NOTES
    "Experiment 91")."""
    from torch_fa4.kernels.sm90 import fwd_host

    for D, S in ((64, 4096), (128, 16384), (256, 1024)):
        q = torch.empty(1, S, 2048 // D, D, dtype=torch.bfloat16)
        direct = AttentionCall(q=q, k=q, v=q, scale=0.1, causal=True)
        public = AttentionCall(q=q, k=q, v=q, scale=0.1, causal=True, window_right=0)
        assert not public.has_window
        assert fwd_host.default_config(public) == fwd_host.default_config(direct)
        assert AttentionCall(q=q, k=q, v=q, scale=0.1, causal=True, window_left=100, window_right=0).has_window
        assert AttentionCall(q=q, k=q, v=q, scale=0.1, window_right=0).has_window  # not causal: a window


def test_d128_takes_the_conditional_rescale():
    """D128 plain and causal calls: FA4's conditional rescale at every length (NOTES
    "Experiment 130"); other head dims keep theirs."""
    from torch_fa4.kernels.sm90 import fwd_host

    def cfg(D, Sq, Sk, **kw):
        q = torch.empty(1, Sq, 2, D, dtype=torch.bfloat16)
        k = torch.empty(1, Sk, 2, D, dtype=torch.bfloat16)
        return fwd_host.default_config(AttentionCall(q=q, k=k, v=k, scale=0.1, **kw))

    for causal in (False, True):
        for s in (1024, 4096, 16384):
            assert (cfg(128, s, s, causal=causal).rescale_threshold, cfg(128, s, s, causal=causal).early_o_rescale) \
                == (8.0, False)
    assert cfg(128, 128, 16384).rescale_threshold == 8.0
    assert cfg(128, 16384, 128).rescale_threshold == 8.0
    assert cfg(64, 16384, 16384).rescale_threshold is None
    assert cfg(256, 16384, 16384).rescale_threshold == 8.0  # (D256's own default)
    # only the measured rows: no mods, softcap or window
    assert cfg(128, 16384, 16384, softcap=30.0).rescale_threshold is None
    assert cfg(128, 16384, 16384, causal=True, window_left=1024).rescale_threshold is None
    # an override of the rescale keeps the other option coherent
    assert fwd_host.default_config(AttentionCall(q=torch.empty(1, 16384, 2, 128, dtype=torch.bfloat16),
                                                 k=torch.empty(1, 16384, 2, 128, dtype=torch.bfloat16),
                                                 v=torch.empty(1, 16384, 2, 128, dtype=torch.bfloat16),
                                                 scale=0.1), rescale_threshold=None).early_o_rescale


def test_d64_wide_tile_takes_two_max_chains(tmp_path):
    """The row max as two chains on D64's 192-row tile for calls without mods (NOTES "Experiment
    148"); the 128-row tile of short calls, score_mods and other head dims keep one chain. The
    option reaches the code: the two-chain key loop has the one-chain loop's FMNMX count in
    another order."""
    from torch_fa4.kernels.sm90 import fwd_host

    def chains(D, S, **kw):
        q = torch.empty(1, S, 2, D, dtype=torch.bfloat16)
        return fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1, **kw)).max_chains

    for S in (4096, 16384):
        assert chains(64, S) == chains(64, S, causal=True) == 2
        assert chains(128, S) == chains(256, S) == 1
    assert chains(64, 1024) == chains(64, 1024, causal=True) == 1
    score = _mod_call(64, score_mod=_alibi(), S=4096)
    assert fwd_host.default_config(score).tile_m == 192 and fwd_host.default_config(score).max_chains == 1
    q = torch.empty(1, 16384, 32, 64, dtype=torch.bfloat16)  # the grid's D64 S16k row
    cfg = fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.125))
    loops = {}
    for n in (1, 2):
        (tmp_path / str(n)).mkdir()
        sass = _compile_and_check_sass(replace(cfg, max_chains=n), tmp_path / str(n))
        loops[n] = without_addresses(_unmasked_key_loop(sass, cfg))
    assert loops[1] != loops[2]
    assert sum("FMNMX" in x for x in loops[1]) == sum("FMNMX" in x for x in loops[2])


def test_o_rescale_order_per_head_dim():
    """Where O is rescaled (fwd_host): after the P V wait at D64 (NOTES "Experiment 118") and on
    plain D96 calls of 4096 keys or more ("Experiment 120"); just before P V is issued (the early
    rescale) elsewhere with always-rescale; an override wins."""
    from torch_fa4.kernels.sm90 import fwd_host

    def early(D, S, overrides=None, **kw):
        q = torch.empty(1, S, 2, D, dtype=torch.bfloat16)
        return fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1, **kw),
                                       **(overrides or {})).early_o_rescale

    for S in (1024, 4096, 16384):
        assert not early(64, S) and not early(64, S, causal=True)
    assert not early(96, 4096) and not early(96, 16384)
    assert early(96, 2048) and early(96, 4096, causal=True) and early(96, 4096, softcap=10.0)
    assert not early(128, 4096) and not early(128, 1024, causal=True)  # the conditional rescale
    assert early(128, 4096, softcap=10.0) and early(128, 4096, causal=True, window_left=256)
    assert early(96, 4096, overrides=dict(early_o_rescale=True))
    # an early rescale asked for at D128 drops the default conditional one (the two exclude each other)
    q = torch.empty(1, 4096, 2, 128, dtype=torch.bfloat16)
    forced = fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1), early_o_rescale=True)
    assert (forced.early_o_rescale, forced.rescale_threshold) == (True, None)


def test_kv_multicast_variants_multicast_their_loads(tmp_path):
    """Under kv_multicast the K and V loads are multicast TMA copies (and Q's stays a plain one)."""
    from torch_fa4.kernels.sm90 import fwd_host

    cfg = fwd_host.default_config(_call(D=128), kv_multicast=True)
    sass = _compile_and_check_sass(cfg, tmp_path)
    loads = [line for line in sass.splitlines() if "UTMALDG" in line]
    assert any("MULTICAST" in line for line in loads), "no multicast TMA load"
    assert any("MULTICAST" not in line for line in loads), "Q should load into its own CTA only"


def test_plain_long_calls_take_kv_multicast():
    """Plain calls of D96 / D128 / D192 / D256 with 4096 keys or more run CTA pairs sharing their
    K / V loads (NOTES "Experiments 99, 137"); masks, varlen, mods, softcap, D64 and short walks
    do not, nor does a single query tile (its pair's partner would have no rows)."""
    from torch_fa4.kernels.sm90 import fwd_host

    def cfg(D, Sq, Sk, **kw):
        q = torch.empty(1, Sq, 2, D, dtype=torch.bfloat16)
        k = torch.empty(1, Sk, 2, D, dtype=torch.bfloat16)
        return fwd_host.default_config(AttentionCall(q=q, k=k, v=k, scale=0.1, **kw))

    for D in (96, 128, 192, 256):
        if D == 96:  # past 2048 queries D96 runs 192-row tiles (multicast level there, Exp. 138)
            assert not cfg(D, 4096, 4096).kv_multicast
            assert cfg(D, 2048, 4096).kv_multicast
        else:
            assert cfg(D, 4096, 4096).kv_multicast
            assert cfg(D, 16384, 16384).kv_multicast
        assert cfg(D, 200, 8192).kv_multicast  # the walk's length decides: the keys
        assert not cfg(D, 100, 8192).kv_multicast  # one query tile: nothing to pair it with
        assert not cfg(D, 16384, 16384, causal=True).kv_multicast
        assert not cfg(D, 16384, 16384, window_left=512, window_right=512).kv_multicast
        assert not cfg(D, 16384, 16384, softcap=30.0).kv_multicast
    assert not cfg(128, 1024, 1024).kv_multicast
    assert not cfg(64, 16384, 16384).kv_multicast
    q = torch.empty(1, 16384, 2, 128, dtype=torch.bfloat16)  # an override wins
    assert not fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1), kv_multicast=False).kv_multicast


def test_d64_score_mod_alone_takes_the_192_row_tile():
    """D64 past 2048 queries: plain calls and calls whose only mod is a score_mod run 192 x 128
    tiles (NOTES "Experiment 90"); a mask_mod or softcap keeps the 128-row tile."""
    from torch_fa4.kernels.sm90 import fwd_host

    def shape(**kw):
        cfg = fwd_host.default_config(_mod_call(64, S=4096, **kw))
        return cfg.tile_m, cfg.num_stages, cfg.persistent, cfg.dynamic_schedule

    assert shape(score_mod=_alibi_abs(), causal=True) == (192, 2, True, True)
    assert shape(score_mod=_alibi()) == (192, 3, False, False)
    assert shape(score_mod=_alibi(), mask_mod=_doc_mask())[0] == 128
    assert shape(score_mod=_alibi(), softcap=20.0)[0] == 128
    assert fwd_host.default_config(_mod_call(64, score_mod=_alibi(), S=2048)).tile_m == 128


def _unmasked_key_loop(sass: str, cfg) -> list:
    """The unmasked key loop of a forward variant: the shortest (in instructions issued when its
    stages have landed) of the loops that issue one key tile's matmuls, S = Q K^T then P V, over
    k-steps of 16."""
    mmas_per_tile = cfg.head_dim // 16 + cfg.tile_n // 16
    full = [loop for loop in key_loops(sass) if sum("HGMMA" in x for x in loop) == mmas_per_tile]
    assert full, "no key loop issuing one key tile's matmuls"
    return min(full, key=issued_when_ready)


def test_pinned_pv_wait_follows_the_softmax(tmp_path):
    """With `pin_pv_wait` (the D256 default) no exponential of a key-loop softmax comes after the
    P V wait; without it ptxas hoisted that wait to just after the row max (NOTES "Experiment 57"),
    which this also checks, so the test notices when a ptxas update makes the option moot."""
    from torch_fa4.kernels.sm90 import fwd_host

    pinned = fwd_host.default_config(_call(256))
    assert pinned.pin_pv_wait
    for sub in ("pinned", "loose"):
        (tmp_path / sub).mkdir()
    counts = exps_after_pv_wait(_compile_and_check_sass(pinned, tmp_path / "pinned"))
    assert counts and all(c == 0 for c in counts), counts
    loose = exps_after_pv_wait(_compile_and_check_sass(replace(pinned, pin_pv_wait=False), tmp_path / "loose"))
    assert loose and max(loose) > 0, loose


@pytest.mark.parametrize("causal", [False, True])
def test_d64_pv_wait_with_the_late_rescale(causal, tmp_path):
    """D64's 192-row default rescales O after the P V wait (flash-attn-4's order at D64), and
    ptxas then puts that wait ahead of (nearly) all of the step's exponentials; with the early
    rescale (before the next P V) CUDA 12's ptxas puts it among them. The late order won on the
    GPU (NOTES "Experiment 118"), and with the early one, moving the wait to either end lost
    ("Experiment 111"). A change that moves either placement shows up here before it costs a GPU
    run."""
    from torch_fa4.kernels.sm90 import fwd_host

    q = torch.empty(4, 4096, 32, 64, dtype=torch.bfloat16)  # the grid's D64 S4k row
    cfg = fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.125, causal=causal))
    assert (cfg.tile_m, cfg.tile_n, cfg.early_o_rescale, cfg.pin_pv_wait) == (192, 128, False, False)
    counts = {}
    for early in (False, True):
        (tmp_path / str(early)).mkdir()
        variant = replace(cfg, early_o_rescale=early)
        unmasked = _unmasked_key_loop(_compile_and_check_sass(variant, tmp_path / str(early)), variant)
        exps = sum("MUFU.EX2" in x for x in unmasked)
        # the loop twice over: the next iteration's first HGMMA closes this iteration's softmax
        after = exps_after_pv_wait("\n".join(unmasked + unmasked))
        assert len(after) == 1, after
        counts[early] = (after[0], exps)
    print(f"causal={causal}: exponentials after the P V wait, late / early rescale: {counts}")
    (late_after, late_exps), (early_after, early_exps) = counts[False], counts[True]
    # ahead of all but at most 5 (the two-chain row max, NOTES "Experiment 148", leaves a few of the
    # causal loop's behind it)
    assert late_after >= late_exps - 5, counts
    if cuda_major() >= 13:
        # CUDA 13's ptxas hoists the wait ahead of every exponential in the early order too (NOTES
        # "Experiment 170"): the orders differ in placement with CUDA 12's only
        return
    assert 0 < early_after < early_exps - 2, counts  # among them (2 of the 66 are the rescale factors)


def test_l2_grouping_policy():
    """Causal / windowed calls group (batch, head) pairs so a group's K and V take a sixth of L2;
    the others run one pair per group (NOTES "Experiments 71, 72"). The group size is the launch
    argument after max_q."""
    from torch_fa4.kernels.host import fwd_launch

    def heads_per_group(**kw):
        q = torch.empty(4, 4096, 32, 64, dtype=torch.bfloat16)  # K + V: 1 MB per (batch, head)
        call = AttentionCall(q=q, k=q, v=q, scale=0.1, **kw)
        args = fwd_launch.leading_args(call, torch.empty_like(q), None, 50 << 20, 1, 128)
        return args[14]

    assert heads_per_group() == 1
    assert heads_per_group(causal=True) == heads_per_group(window_left=256) == 8  # 50 MB / 6


def test_tail_group_policy(monkeypatch):
    """A causal call's last pairs run as one group (common.tile_scheduler), the launch argument
    after the group size: the fewest pairs whose work holds TAIL_FILL times every SM's share of the
    longest walk, unless their K and V would pass TAIL_MAX_BYTES; none where that is no more than
    an ordinary group, without a causal mask or with a left window."""
    from torch_fa4.kernels.host import fwd_launch

    monkeypatch.setattr(fwd_launch, "_sm_count_of", lambda call: 132)

    def args(S, D, tile_m, **kw):
        q = torch.empty(16384 // S, S, 2048 // D, D, dtype=torch.bfloat16)
        call = AttentionCall(q=q, k=q, v=q, scale=0.1, **kw)
        a = fwd_launch.leading_args(call, torch.empty_like(q), None, 50 << 20, 1, tile_m)
        return a[14], a[15], call.batch * call.num_heads

    tails = {}
    for S, D, tile_m in ((1024, 64, 128), (4096, 64, 192), (16384, 64, 192), (1024, 128, 128),
                         (16384, 128, 128), (1024, 256, 128), (4096, 256, 128), (16384, 256, 128)):
        group, tail, pairs = args(S, D, tile_m, causal=True)
        tails[D, S] = tail
        # a pair's work in query-tile x key units (causal: each tile sees the keys up to its last row)
        pair_work = sum(min((m + 1) * tile_m, S) for m in range(-(-S // tile_m)))
        need = fwd_launch.TAIL_FILL * 132 * S
        kv_bytes = S * 2 * D * 2
        fewest = next(t for t in range(1, pairs + 1) if t * pair_work >= need or t == pairs)
        expected = min(fewest, fwd_launch.TAIL_MAX_BYTES // kv_bytes)
        assert tail == (expected if expected > group else 0), (S, D, group, tail, fewest)
        assert tail * kv_bytes <= fwd_launch.TAIL_MAX_BYTES
        assert args(S, D, tile_m)[1] == 0
        assert args(S, D, tile_m, causal=True, window_left=512)[1] == 0
    # the rows measured (NOTES Experiment 121): D256 S4k and S1k get one, D256 S16k none
    assert tails[256, 4096] == 8 and tails[256, 1024] > 8


def test_grid_policy(monkeypatch):
    """D <= 128 and plain D192 calls compile the persistent loop; causal calls take items from
    the counter at every length (with mods: where the loop fits, a score_mod alone)."""
    from torch_fa4.kernels.host import fwd_launch
    from torch_fa4.kernels.sm90 import fwd_host

    monkeypatch.setattr(fwd_launch, "max_ctas", lambda call: 132)

    def ctas(S, D=128, **kw):
        q = torch.empty(1, S, 2, D, dtype=torch.bfloat16)
        call = AttentionCall(q=q, k=q, v=q, scale=0.1, **kw)
        return fwd_host._grid_ctas(fwd_host.default_config(call), call)

    assert ctas(16384) == ctas(1024, causal=True) == 132
    # causal walks of any length, and D=256 up to 2048 keys: persistent, items from the counter
    assert ctas(4096, causal=True) == ctas(8192, D=256, causal=True) == ctas(1024, D=256) == 132
    assert ctas(16384, causal=True) == ctas(16384, D=64, causal=True) == ctas(32768, D=96, causal=True) == 132
    for kw in (dict(S=4096, causal=True), dict(S=8192, D=64, causal=True), dict(S=2048, D=256),
               dict(S=16384, D=64, causal=True), dict(S=16384, D=256, causal=True)):
        q = torch.empty(1, kw.pop("S"), 2, kw.get("D", 128), dtype=torch.bfloat16)
        kw.pop("D", None)
        assert fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1, **kw)).dynamic_schedule
    assert not fwd_host.default_config(_call(128)).dynamic_schedule
    # a causal call with a score_mod takes the counter at every length too (NOTES Experiment 140)
    assert fwd_host.default_config(_mod_call(128, score_mod=_alibi(), S=8192, causal=True)).dynamic_schedule
    assert fwd_host.default_config(_mod_call(128, score_mod=_alibi(), S=16384, causal=True)).dynamic_schedule
    # ... where the persistent loop fits: a mask_mod keeps one CTA per item
    assert not fwd_host.default_config(_mod_call(128, mask_mod=_doc_mask(16384), S=16384, causal=True)).persistent
    # windowed walks of any length take items from the counter, at every head dim
    assert ctas(16384, window_left=100) == ctas(16384, D=64, causal=True, window_left=1024) == 132
    assert ctas(16384, D=256, causal=True, window_left=1024) == ctas(4096, D=192, window_left=100) == 132
    assert fwd_host.default_config(_call(128, window_left=100)).dynamic_schedule
    # plain D192 calls on the static persistent loop (fwd_host._tiles)
    assert ctas(4096, D=192) == 132
    q = torch.empty(1, 4096, 2, 256, dtype=torch.bfloat16)
    assert not fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1)).persistent
    assert ctas(4096, D=256) == fwd_launch.ONE_CTA_PER_ITEM
    assert ctas(16384, D=256, causal=True) == 132
    # D192 causal walks take the counter too
    assert ctas(4096, D=192, causal=True) == ctas(16384, D=192, causal=True) == 132
    # an override to one CTA per item drops the dynamic schedule with the persistent loop
    q = torch.empty(1, 4096, 2, 128, dtype=torch.bfloat16)
    cfg = fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1, causal=True), persistent=False)
    assert not cfg.persistent and not cfg.dynamic_schedule


def test_ptxas_options_reach_ptxas(tmp_path):
    """D64 compiles with ptxas's register-usage level 10 (fwd_host._DEFAULT_OPTIONS; NOTES
    "Experiment 134"), except plain calls on the
    192-row tile, whose hand-built descriptors take level 0 (NOTES "Experiment 156"). The flag goes
    through cute.compile's --ptxas-options: the same variant without it (ptxas's default, level 5)
    schedules differently, so a flag that was dropped on the way (or that ptxas ignored) fails
    here."""
    from torch_fa4.kernels.sm90 import fwd_host

    q = torch.empty(1, 16384, 32, 64, dtype=torch.bfloat16)  # the grid's D64 S16k row
    causal = fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.125, causal=True))
    assert causal.ptxas_options == "--register-usage-level=10"
    cfg = fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.125))
    assert cfg.ptxas_options == "--register-usage-level=0"
    q128 = torch.empty(1, 16384, 16, 128, dtype=torch.bfloat16)
    assert fwd_host.default_config(AttentionCall(q=q128, k=q128, v=q128, scale=0.1)).ptxas_options == ""
    loops = {}
    for flags in (cfg.ptxas_options, ""):
        (tmp_path / str(bool(flags))).mkdir()
        sass = _compile_and_check_sass(replace(cfg, ptxas_options=flags), tmp_path / str(bool(flags)))
        # instructions without their addresses (code elsewhere moving would shift those alone)
        loops[flags] = without_addresses(_unmasked_key_loop(sass, cfg))
    assert loops[cfg.ptxas_options] != loops[""], "the ptxas flag did not change the key loop"


def test_d64_tile_policy():
    """Long plain D64 calls take 192 x 128 tiles (3 K/V stages unless causal); short ones, other
    head dims and the features that shape has not been measured or tested with keep 128 x 128."""
    from torch_fa4.kernels.sm90 import fwd_host

    def shape(S, D=64, **kw):
        q = torch.empty(1, S, 2, D, dtype=torch.bfloat16)
        cfg = fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1, **kw))
        return cfg.tile_m, cfg.tile_n, cfg.num_stages, cfg.persistent

    assert shape(4096) == (192, 128, 3, False)
    # causal: the dynamic schedule's persistent loop
    assert shape(16384, causal=True) == shape(4096, causal=True) == (192, 128, 2, True)
    assert shape(2048) == (128, 128, 2, True)
    assert shape(4096, D=128) == (128, 128, 2, True)
    assert shape(4096, softcap=30.0)[:2] == (128, 128)
    assert shape(4096, causal=True, window_left=256)[:2] == (128, 128)


def test_d96_tile_policy():
    """D96 takes 192 x 112 tiles past 2048 queries for plain and causal calls (NOTES "Experiment
    138"), causal walks on the dynamic schedule; short calls, mods and windows keep the 128-row
    tile."""
    from torch_fa4.kernels.sm90 import fwd_host

    def shape(Sq, Sk=None, **kw):
        q = torch.empty(1, Sq, 2, 96, dtype=torch.bfloat16)
        k = torch.empty(1, Sk or Sq, 2, 96, dtype=torch.bfloat16)
        cfg = fwd_host.default_config(AttentionCall(q=q, k=k, v=k, scale=0.1, **kw))
        return cfg.tile_m, cfg.tile_n, cfg.persistent, cfg.kv_multicast

    assert shape(4096) == shape(16384) == (192, 112, False, False)
    # causal: the dynamic schedule's persistent loop
    assert shape(16384, causal=True) == shape(2100, 8300, causal=True) == (192, 112, True, False)
    assert shape(4096, causal=True) == (192, 112, True, False)
    assert shape(2048) == (128, 128, True, False)
    assert shape(4096, window_left=256)[:2] == (128, 128)
    assert fwd_host.default_config(_mod_call(96, score_mod=_alibi(), S=4096)).tile_m == 128


def test_dynamic_schedule_with_mods_policy():
    """A causal call whose only mod is a score_mod takes the dynamic schedule; softcap beside it,
    a mask_mod or a block mask keep one CTA per item."""
    from torch_fa4.kernels.sm90 import fwd_host

    def dynamic(call):
        return fwd_host.default_config(call).dynamic_schedule

    assert dynamic(MOD_VARIANTS["d128_alibi_causal"]()) and dynamic(MOD_VARIANTS["d64_bias_table_causal"]())
    assert not dynamic(MOD_VARIANTS["d128_alibi_softcap_causal"]())
    assert not dynamic(_mod_call(128, mask_mod=_doc_mask(), causal=True))
    assert not dynamic(_mod_call(256, score_mod=_alibi(), causal=True))
    assert not dynamic(MOD_VARIANTS["d128_alibi"]())  # no causal mask: the static rules (one-shot with mods)


def test_early_q_release_policy():
    """Q's buffer is released early for walks up to 2048 keys only."""
    from torch_fa4.kernels.sm90 import fwd_host

    def early(S, D=128, **kw):
        q = torch.empty(1, S, 2, D, dtype=torch.bfloat16)
        return fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1, **kw)).early_q_release

    assert early(1024) and early(2048, causal=True) and early(1024, D=64)
    assert not early(4096) and not early(4096, causal=True) and not early(16384, D=64)


def test_split_mask_loops_policy():
    from torch_fa4.kernels.sm90 import fwd_host

    def split(S, D):
        q = torch.empty(1, S, 2, D, dtype=torch.bfloat16)
        return fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1, causal=True)).split_mask_loops

    assert split(1024, 64) and split(1024, 128) and split(4096, 256) and split(1024, 192)
    assert not split(1024, 256)


def test_compile_cache_reuses_variants():
    from torch_fa4.kernels.sm90 import fwd_host

    check_variant_reuse(fwd_host, _call(128), 128)


def test_mods_are_part_of_the_variant():
    """Mods change the generated code, so they key the compile cache; their values do not."""
    from torch_fa4 import mods as M
    from torch_fa4.kernels.sm90 import fwd_host

    plain = fwd_host.default_config(_call(128))
    assert plain.mod_key == "" and plain.aux_specs == () and not plain.block_sparse
    alibi = fwd_host.default_config(_mod_call(128, score_mod=_alibi()))
    alibi_other_values = fwd_host.default_config(_mod_call(128, score_mod=M.alibi(torch.rand(4))))
    doc = fwd_host.default_config(_mod_call(128, mask_mod=_doc_mask()))
    assert alibi == alibi_other_values
    assert len({plain, alibi, doc}) == 3
    assert alibi.aux_specs == (("torch.float32", 1),)
    # the same mask with int64 ids is another variant (dtype is part of the key)
    doc64 = fwd_host.default_config(_mod_call(128, mask_mod=M.document_mask(torch.zeros(256, dtype=torch.int64))))
    assert doc64 != doc and doc64.aux_specs == (("torch.int64", 1),)


def test_block_mask_tile_mapping():
    from torch_fa4.kernels.sm90 import fwd_host

    cfg = fwd_host.default_config(_mod_call(128, mask_mod=_doc_mask(), block_size=128))
    assert (cfg.tile_m, cfg.tile_n, cfg.bm_tiles_m, cfg.bm_tiles_n) == (128, 128, 1, 1)
    cfg = fwd_host.default_config(_mod_call(128, mask_mod=_doc_mask(), block_size=(256, 64)))
    assert (cfg.tile_m, cfg.tile_n, cfg.bm_tiles_m, cfg.bm_tiles_n) == (128, 64, 2, 1)
    cfg = fwd_host.default_config(_mod_call(256, mask_mod=_doc_mask(), block_size=128))
    assert (cfg.tile_n, cfg.bm_tiles_n) == (64, 2)
    cfg = fwd_host.default_config(_mod_call(192, mask_mod=_doc_mask(448), block_size=(128, 224), S=448))
    assert (cfg.tile_n, cfg.bm_tiles_n) == (112, 2)
    # a block mask only matters with a mask_mod: without one the kernel walks every tile
    call = _mod_call(128, score_mod=_alibi())
    call.block_mask = _mod_call(128, mask_mod=_doc_mask(), block_size=128).block_mask
    assert fwd_host.unsupported_reason(call) is None
    assert not fwd_host.default_config(call).block_sparse


@pytest.mark.parametrize("case,reason", [
    ("q_tile", "not a multiple of the kernel's 128-row tile"),
    ("kv_tile", "not a multiple of 64"),
    ("short", "covers"),
    ("heads", "do not broadcast"),
    ("dtype", "int32"),
])
def test_block_mask_refusals_name_the_reason(case, reason):
    from torch_fa4.kernels.sm90 import fwd_host

    if case == "q_tile":
        call = _mod_call(128, mask_mod=_doc_mask(), block_size=(64, 128))
    elif case == "kv_tile":
        call = _mod_call(128, mask_mod=_doc_mask(288), block_size=(128, 96), S=288)
    elif case == "short":  # a block mask for 256 positions used on 512
        call = _mod_call(128, mask_mod=_doc_mask(), block_size=128)
        call.q = call.k = call.v = torch.empty(1, 512, 4, 128, dtype=torch.bfloat16)
    elif case == "heads":
        call = _mod_call(128, mask_mod=_doc_mask(), block_size=128)
        num, idx, fnum, fidx = call.block_mask
        call.block_mask = (num.expand(1, 3, -1), idx.expand(1, 3, -1, -1), fnum.expand(1, 3, -1), fidx.expand(1, 3, -1, -1))
    else:
        call = _mod_call(128, mask_mod=_doc_mask(), block_size=128)
        call.block_mask = tuple(t.long() for t in call.block_mask)
    got = fwd_host.unsupported_reason(call)
    assert got is not None and reason in got, got


def test_launch_arguments_match_the_compiled_signature():
    """forward() builds the launch argument list (block mask, captured tensors) the compiled kernel
    expects: with CPU tensors the call gets past the arity check and stops at the device check of
    argument #0, so a missing or extra argument would show up here as a TypeError."""
    from torch_fa4 import mods as M
    from torch_fa4.kernels.sm90 import fwd_host

    call = _mod_call(128, score_mod=_alibi(), mask_mod=M.and_masks(_doc_mask(), M.causal_mask), block_size=128)
    call.q = call.k = call.v = torch.randn(1, 256, 4, 128).bfloat16()
    text = cpu_launch_error(fwd_host, call)
    assert "device_type=cuda" in text, text
    assert "mBmNum: Tensor([n" in text and "mBmFullIdx: Tensor([n" in text  # the block mask is bound
    assert "aux0: Tensor([n" in text and "aux1: Tensor([n" in text and "aux2: None" in text


def test_split_tail_launch_arguments(monkeypatch):
    """A split-tail launch passes the pieces' workspace, its zeroed counters and the split item
    count the compiled kernel expects (checked as in test_launch_arguments_match_the_compiled_signature),
    sized for the plan: (items x warpgroups x ways) slots of Dv / 2 + 4 values for 128 threads."""
    from torch_fa4.kernels.host import fwd_launch
    from torch_fa4.kernels.sm90 import fwd_host

    # the plan for a D128 S16k grid (2048 items on 132 SMs)
    monkeypatch.setattr(fwd_launch, "max_ctas", lambda call: 132)
    big = torch.empty(1, 16384, 16, 128, dtype=torch.bfloat16)
    big_call = AttentionCall(q=big, k=big, v=big, scale=0.1)
    assert fwd_host.split_plan(fwd_host.default_config(big_call, split_ways=0), big_call) == (68, 5)
    # short walks (S4k: 32 key tiles) and the 192-row D64 tile: none (NOTES Experiment 122)
    for shape in ((4, 4096, 16, 128), (1, 16384, 32, 64)):
        t = torch.empty(*shape, dtype=torch.bfloat16)
        c = AttentionCall(q=t, k=t, v=t, scale=0.1)
        assert fwd_host.split_plan(fwd_host.default_config(c, split_ways=0), c) == (0, 1)

    monkeypatch.setattr(fwd_host, "split_plan", lambda cfg, call: (6, 3))
    q = torch.randn(1, 256, 4, 128).bfloat16()
    call = AttentionCall(q=q, k=q, v=q, scale=0.1)
    cfg = fwd_host.default_config(call)
    assert cfg.split_ways == 3
    ws, counters, items = fwd_host.split_buffers(fwd_host.split_spec(cfg, call), call.q.device)
    assert items == 6 and ws.shape == (6 * 2 * 3, 128 // 2 + 4, 128) and counters.shape == (12,)
    assert not counters.any()
    assert fwd_host.default_config(call, split_ways=0).split_ways == 0  # overrides win
    text = cpu_launch_error(fwd_host, call)
    assert "device_type=cuda" in text, text
    assert "mSplitWs: Tensor([n" in text and "mSplitCount: Tensor([n" in text


def test_split_plan():
    """kernels/host/split_plan.choose: a split only where it shortens the last round by at least
    min_gain of an item, counting each piece's fixed cost; pieces of at least min_tiles key tiles;
    an even item count for multicast pairs; nothing when the grid divides evenly."""
    from torch_fa4.kernels.host.split_plan import choose

    assert choose(2048, 132, 128) == (68, 7)  # D128 S16k: 15.5 rounds of work in 16
    assert choose(2048, 132, 32) == (68, 5)  # D128 S4k: shorter items, fewer pieces pay
    assert choose(1980, 132, 128) == (0, 1)  # 15 whole rounds
    assert choose(100, 132, 128) == (0, 1)  # one round: nothing waits behind it
    assert choose(2752, 132, 128) == (0, 1)  # 112 items left: 85% of a round, little to gain
    assert choose(2048 + 1, 132, 128, pair=2) == (0, 1)  # an odd remainder cannot pair
    for items, ctas, tiles in ((2048, 132, 128), (2816, 132, 32), (4096, 132, 8), (1024, 132, 52)):
        r, k = choose(items, ctas, tiles)
        if r:
            assert r == items % ctas and tiles >= 4 * k
            last = -(-(r * k) // ctas) * (1 / k + 2 / tiles)
            assert last <= 0.85, (items, ctas, tiles, r, k, last)


def test_captured_tensors_as_launched():
    from torch_fa4.kernels.sm90 import fwd_host

    flags = torch.rand(10) > 0.5
    strided = torch.arange(20, dtype=torch.int32).view(10, 2)[:, 1]  # last-dim stride 2
    scalar = torch.tensor(3.0)
    call = _call(128)
    call.aux_tensors = (flags, strided, scalar)
    cfg = replace(fwd_host.default_config(call), aux_specs=(("torch.bool", 1), ("torch.int32", 1), ("torch.float32", 0)))
    from torch_fa4.kernels.host import fwd_launch

    launched = fwd_launch.launch_aux(call, len(cfg.aux_specs), fwd_host.MAX_AUX)
    assert len(launched) == fwd_host.MAX_AUX and all(t is None for t in launched[3:])
    assert launched[0].dtype == torch.uint8 and torch.equal(launched[0].bool(), flags)
    assert launched[1].stride(-1) == 1 and torch.equal(launched[1], strided)
    assert launched[2].shape == (1,) and launched[2].item() == 3.0


_DISK_CACHE_SCRIPT = r"""
import sys, torch
from torch_fa4 import mods as M
from torch_fa4.mods import registry
from torch_fa4.call import AttentionCall
from torch_fa4.kernels import compile_cache
from torch_fa4.kernels.sm90 import fwd_host
q = torch.randn(1, 256, 4, 128).bfloat16()
key, aux = M.prepare(M.alibi(torch.rand(4)), None)
call = AttentionCall(q=q, k=q, v=q, scale=0.1, mod_key=key, mods=registry.lookup(key), aux_tensors=tuple(aux))
try:
    fwd_host.forward(call, torch.empty_like(q), torch.empty(call.lse_shape()))
    result = "no error"
except ValueError as e:
    result = "device check" if "device_type=cuda" in str(e) else str(e)[:200]
print("RESULT", result, compile_cache.stats()["from_disk"], "cutlass" in sys.modules)
"""


def test_disk_cache_loads_in_a_new_process_without_the_dsl(tmp_path):
    """The disk cache (TORCH_FA4_KERNEL_CACHE=1 here, as by default): the first process compiles
    and stores the kernel, the second loads it (no CuTe DSL import, no compile) and its launch
    binds the same arguments."""
    from _fresh_process import result_fields

    env = dict(os.environ, TORCH_FA4_KERNEL_CACHE="1", TORCH_FA4_CACHE_DIR=str(tmp_path), CUTE_DSL_ARCH="sm_90a")
    results = [result_fields(_DISK_CACHE_SCRIPT, env) for _ in range(2)]
    assert results[0] == ["device", "check", "0", "True"], results[0]  # compiled, then stored
    assert results[1] == ["device", "check", "1", "False"], results[1]  # loaded; DSL never imported
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1


def test_mods_refuse_positions_past_the_exact_fp32_range():
    """The mod lowering does index arithmetic in fp32 where it is exact: positions below 2^23.
    Longer sequences with mods go to the reference path with a reason, never to a kernel that
    would round them."""
    from torch_fa4.kernels.sm90 import fwd_host

    call = _mod_call(64, score_mod=_alibi(1), H=1)
    assert fwd_host.unsupported_reason(call) is None
    long = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16).expand(1, fwd_host.MOD_MAX_POSITION + 1, 1, 64)
    call.q = call.k = call.v = long
    assert "longer than" in fwd_host.unsupported_reason(call)
    call.mods, call.mod_key, call.aux_tensors = None, "", ()
    assert "longer than" not in (fwd_host.unsupported_reason(call) or "")


@pytest.mark.parametrize("D,S,causal", [(256, 1024, False), (256, 1024, True), (256, 4096, True), (256, 4000, True)])
def test_persistent_d256_key_loops_keep_uniform_descriptors(D, S, causal, tmp_path):
    """The wgmma descriptors of the key loops stay in uniform registers, no per-thread copy (R2UR)
    before each wgmma: the D256 persistent kernels had 67 per loop while the ring position after
    an item came out of the idle / compute branch (S = 4000: a ragged last tile, the idle path
    compiled in)."""
    from torch_fa4.kernels.sm90 import fwd_host

    q = torch.empty(1, S, 2, D, dtype=torch.bfloat16)
    cfg = fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1, causal=causal))
    assert cfg.persistent
    fwd_host.compile_fwd(cfg, dump_dir=str(tmp_path))
    loops = key_loops(sass_of(tmp_path))
    assert loops
    for loop in loops[:2]:
        assert sum("R2UR" in line for line in loop) <= 2


def test_skip_masked_first_policy_and_code(tmp_path):
    """D192 / D256 calls under causal / window masks skip a warpgroup's Q K^T and softmax on a
    first key tile it cannot see (fwd_host._skip_masked_first_pays; NOTES "Experiment 135");
    other head dims, unmasked calls and calls with mods do not. The option must reach the code (the
    SASS differs) without duplicating a matmul or serializing them (_compile_and_check_sass); the
    GPU tests check the results."""
    from torch_fa4.kernels.sm90 import fwd_host

    def cfg_of(D, **kw):
        q = torch.empty(4, 4096, 2048 // D, D, dtype=torch.bfloat16)
        return fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1, **kw))

    assert cfg_of(256, causal=True).skip_masked_first
    assert cfg_of(192, causal=True).skip_masked_first
    assert cfg_of(256, window_left=512, window_right=0).skip_masked_first
    assert not cfg_of(256).skip_masked_first
    assert not cfg_of(64, causal=True).skip_masked_first
    assert not cfg_of(128, causal=True).skip_masked_first
    assert not fwd_host.default_config(_mod_call(256, score_mod=_alibi(), causal=True)).skip_masked_first
    cfg = cfg_of(256, causal=True)
    code = {}
    for skip in (True, False):
        (tmp_path / str(skip)).mkdir()
        sass = _compile_and_check_sass(replace(cfg, skip_masked_first=skip), tmp_path / str(skip))
        code[skip] = without_addresses(sass.splitlines())
    assert code[True] != code[False], "skip_masked_first did not reach the kernel"
    hgmma = {skip: sum("HGMMA" in x for x in lines) for skip, lines in code.items()}
    assert hgmma[True] == hgmma[False], hgmma


def test_one_shot_plain_grids_take_their_item_from_the_grid(tmp_path):
    """One-shot calls without a causal / window mask launch a (query tile, head, batch) grid
    (FwdConfig.grid3d): the work item is the grid index, so the integer divisions that decode a
    flat grid's item (I2F.RP starts each) are gone, but for the GQA head ratio's two; the key loop
    keeps its length to within ptxas's scheduling. Persistent, causal, windowed and multicast calls
    keep the flat grid."""
    from torch_fa4.kernels.sm90 import fwd_host

    q = torch.empty(1, 16384, 32, 64, dtype=torch.bfloat16)  # the grid's D64 S16k row
    cfg = fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.125))
    assert cfg.grid3d and not cfg.persistent
    sass = {}
    for g in (True, False):
        (tmp_path / str(g)).mkdir()
        sass[g] = _compile_and_check_sass(replace(cfg, grid3d=g), tmp_path / str(g))
    assert sass[True].count("I2F.RP") <= 2 < sass[False].count("I2F.RP")
    assert abs(issued_when_ready(_unmasked_key_loop(sass[True], cfg)) - issued_when_ready(
        _unmasked_key_loop(sass[False], cfg))) <= 2

    def grid3d(D, S, **kw):
        q = torch.empty(16384 // S, S, 2048 // D, D, dtype=torch.bfloat16)
        return fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1, **kw)).grid3d

    assert not grid3d(64, 16384, causal=True) and not grid3d(64, 16384, window_left=512)
    assert not grid3d(128, 16384)  # persistent
    assert not grid3d(256, 16384)  # K / V multicast to CTA pairs
    many = torch.empty(1, 4096, 2, 64, dtype=torch.bfloat16).expand(70000, -1, -1, -1)
    assert not fwd_host.default_config(AttentionCall(q=many, k=many, v=many, scale=0.1)).grid3d  # y, z <= 65535


def test_d64_plain_calls_take_hand_built_descriptors(tmp_path):
    """D64's 192-row tile, plain calls: the key loop's matmuls from hand-built descriptors at
    ptxas's register-usage level 0 (kernels/common/wgmma_desc.py; NOTES "Experiment 156").
    Causal calls, mods, the 128-row tile and other head dims keep cute.gemm's descriptors. The
    option reaches the code: the unmasked key loop no longer derives descriptors from shared-memory
    addresses (the 14-bit address mask, a per-thread descriptor moved to a uniform register), and
    a head dim whose rows are not 128 bytes is refused at trace time."""
    from torch_fa4.kernels.sm90 import fwd_host

    def cfg(D, S, **kw):
        q = torch.empty(16384 // S, S, 2048 // D, D, dtype=torch.bfloat16)
        return fwd_host.default_config(AttentionCall(q=q, k=q, v=q, scale=0.1, **kw))

    for S in (4096, 16384):
        plain = cfg(64, S)
        assert plain.hand_descriptors and plain.ptxas_options == "--register-usage-level=0"
        causal = cfg(64, S, causal=True)
        assert not causal.hand_descriptors and causal.ptxas_options == "--register-usage-level=10"
        assert not cfg(64, S, softcap=20.0).hand_descriptors
        assert not cfg(128, S).hand_descriptors
    assert not cfg(64, 1024).hand_descriptors  # (the 128-row tile)
    assert not fwd_host.default_config(_mod_call(64, score_mod=_alibi(), S=4096)).hand_descriptors

    plain = cfg(64, 16384)
    loops = {}
    for hand in (False, True):
        (tmp_path / str(hand)).mkdir()
        sass = _compile_and_check_sass(replace(plain, hand_descriptors=hand), tmp_path / str(hand))
        loops[hand] = _unmasked_key_loop(sass, plain)
    masks = {hand: sum("0x3fc0" in x for x in loop) for hand, loop in loops.items()}
    assert masks[False] > 0 and masks[True] == 0, masks
    assert not any("R2UR" in x for x in loops[True])
    assert issued_when_ready(loops[True]) < issued_when_ready(loops[False])
    with pytest.raises(AssertionError, match="128-byte rows"):
        fwd_host.compile_fwd(replace(cfg(128, 4096), hand_descriptors=True), dump_dir=str(tmp_path / "d128"))


def test_config_changes_copy_only_what_changes():
    """default_config's late decisions (fwd_host._with) keep the config object where a decision
    leaves its field as it is, and copy it like dataclasses.replace where it changes it."""
    from dataclasses import replace

    from torch_fa4.kernels.sm90 import fwd_host

    cfg = fwd_host.default_config(_call(D=128))
    assert fwd_host._with(cfg, grid3d=cfg.grid3d, split_ways=cfg.split_ways) is cfg
    changed = fwd_host._with(cfg, grid3d=not cfg.grid3d)
    assert changed == replace(cfg, grid3d=not cfg.grid3d) and changed is not cfg
