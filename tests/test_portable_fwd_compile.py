"""CPU: the portable forward compiles for sm_80, sm_86, sm_89 and sm_120a; its SASS uses HMMA
(mma.sync), ldmatrix and cp.async and nothing spills to local memory (except, bounded, the
measured D=128 row of 32 rows per warp: tiles.py); every tile row fits its
architecture's shared memory; dispatch routes compute capabilities 8.x / 12.x (and any GPU under
TORCH_FA4_BACKEND=portable) to it.

A representative matrix, not every variant: head dims and tile rows across the architectures,
each mask kind, varlen with seqused_k, a score_mod and a block-sparse mask_mod.
"""

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from _mod_call_fields import mod_call_fields  # noqa: E402
from sass import sass_of, spills  # noqa: E402
from torch_fa4 import reference, self_check  # noqa: E402
from torch_fa4.call import AttentionCall  # noqa: E402
from torch_fa4.kernels.portable import fwd_host, tiles  # noqa: E402


def _call(D, dtype=torch.bfloat16, Hkv=2, varlen=False, seqused=False, **kw):
    if varlen:
        q = torch.empty(16, 4, D, dtype=dtype)
        kv = torch.empty(16, Hkv, D, dtype=dtype)
        cu = torch.tensor([0, 8, 16], dtype=torch.int32)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=8)
    else:
        q = torch.empty(2, 8, 4, D, dtype=dtype)  # shapes are symbolic in the kernel: any will do
        kv = torch.empty(2, 8, Hkv, D, dtype=dtype)
    if seqused:
        kw["seqused_k"] = torch.tensor([8, 3], dtype=torch.int32)
    return AttentionCall(q=q, k=kv, v=kv, scale=D ** -0.5, **kw)


def _mod_call(D, score_mod=None, mask_mod=None, block_size=None, S=256, H=4, **kw):
    q = torch.empty(1, S, H, D, dtype=torch.bfloat16)
    return AttentionCall(q=q, k=q, v=q, scale=D ** -0.5,
                         **mod_call_fields(score_mod, mask_mod, block_size, S, S, device="cpu"), **kw)


def _alibi(H=4):
    from torch_fa4 import mods as M

    return M.alibi(M.alibi_slopes(H))


def _doc_mask(S=256):
    from torch_fa4 import mods as M

    return M.document_mask(torch.randint(0, 3, (S,), dtype=torch.int32).sort().values)


SPILL_BOUND_D128 = 48  # measured on sm_80: 27-35 spill instructions, 15-17 of them in the key loop

# (arch, name) -> builder of the call; every architecture gets a head dim of each tile row kind
VARIANTS = {
    ("sm_80", "d64"): lambda: _call(64),
    ("sm_80", "d128_causal_gqa"): lambda: _call(128, Hkv=1, causal=True),
    ("sm_80", "d256_varlen_seqused_causal"): lambda: _call(256, varlen=True, seqused=True, causal=True),
    ("sm_80", "d128_alibi_causal"): lambda: _mod_call(128, score_mod=_alibi(), causal=True),
    ("sm_80", "d128_document_block_mask"): lambda: _mod_call(128, mask_mod=_doc_mask(), block_size=128),
    ("sm_86", "d96_window_softcap_fp16"): lambda: _call(96, torch.float16, window_left=100, window_right=0,
                                                        softcap=10.0),
    ("sm_86", "d256_causal"): lambda: _call(256, causal=True),
    ("sm_89", "d192_causal"): lambda: _call(192, causal=True),
    ("sm_89", "d64_varlen_window"): lambda: _call(64, varlen=True, window_left=64, window_right=64),
    ("sm_120a", "d128_causal"): lambda: _call(128, causal=True),
    ("sm_120a", "d256"): lambda: _call(256),
}


@pytest.mark.parametrize("arch,name", list(VARIANTS), ids=[f"{a}-{n}" for a, n in VARIANTS])
def test_variant_compiles_to_hmma_without_spills(tmp_path, arch, name):
    call = VARIANTS[(arch, name)]()
    assert fwd_host.unsupported_reason(call) is None
    cfg = fwd_host.default_config(call, arch)
    assert (cfg.tile_m, cfg.tile_n, cfg.num_warps) == tiles.tile_shape(arch, call.head_dim)
    assert cfg.smem_bytes() <= tiles.smem_budget(arch)
    fwd_host.compile_fwd(cfg, arch, dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    assert "HMMA.16816.F32" in sass, "the matmuls are not warp-level MMAs"
    assert "LDSM" in sass and "LDGSTS" in sass, "no ldmatrix / cp.async"
    total, in_loops = spills(sass)
    if call.head_dim == 128 and cfg.num_warps == 4:
        # the large-memory parts' D=128 row: 32 rows per warp spill in the key loop, measured
        # faster than the spill-free 8-warp row (tiles.py); bounded so that growth is caught
        assert total <= SPILL_BOUND_D128, f"{total} local-memory (spill) instructions"
    else:
        assert total == 0, f"{total} local-memory (spill) instructions ({in_loops} in loops)"
    assert "HGMMA" not in sass and "UTMALDG" not in sass, "Hopper-only instructions in portable code"


@pytest.mark.parametrize("arch", sorted(tiles.TABLES))
def test_every_tile_row_fits_its_shared_memory(arch):
    for head_dim, (tile_m, tile_n, num_warps, _) in tiles.table_of(arch).items():
        call = _call(head_dim)
        cfg = fwd_host.default_config(call, arch)
        assert cfg.smem_bytes() <= tiles.smem_budget(arch), (arch, head_dim)
        assert tile_m % (16 * num_warps) == 0 and tile_n % 16 == 0


def test_arch_of_capability():
    assert tiles.arch_of((8, 0)) == "sm_80" and tiles.arch_of((8, 6)) == "sm_86"
    assert tiles.arch_of((8, 9)) == "sm_89" and tiles.arch_of((12, 0)) == "sm_120a"
    assert tiles.arch_of((9, 0)) == "sm_90a" and tiles.arch_of((10, 0)) == "sm_100a"
    # sm_90 and sm_100 take the sm_80 row, consumer Blackwell the 99 KB one
    assert tiles.table_of("sm_90a") is tiles.table_of("sm_80")
    assert tiles.table_of("sm_121a") is tiles.table_of("sm_86")


def test_refusals_name_the_problem():
    assert "head_dim 80" in fwd_host.unsupported_reason(_call(80))
    assert "float16/bfloat16" in fwd_host.unsupported_reason(_call(64, torch.float32))
    q = torch.empty(2, 8, 4, 64, dtype=torch.bfloat16)
    kv = torch.empty(2, 8, 64, 2, dtype=torch.bfloat16).transpose(-1, -2)
    assert "last dim not contiguous" in fwd_host.unsupported_reason(AttentionCall(q=q, k=kv, v=kv, scale=0.1))
    bm = _mod_call(128, mask_mod=_doc_mask(), block_size=(128, 96))
    assert "kv=96" in fwd_host.unsupported_reason(bm)


# ---- dispatch ------------------------------------------------------------------------------------------

def _stand_in(monkeypatch, module, launches):
    """module.forward replaced by the reference (nothing launches on a CPU), recording its calls."""
    def forward(call, out, lse):
        launches.append(call)
        o, l = reference.forward(call)
        out.copy_(o)
        lse.copy_(l)

    monkeypatch.setattr(module, "forward", forward)


def _faked_gpu(monkeypatch, tmp_path, cap):
    """Calls on CPU tensors dispatch as on a GPU of compute capability `cap`, the portable forward
    built for its architecture; no self-check verdicts yet (they go to tmp_path)."""
    from torch_fa4 import dispatch

    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(self_check, "_verdicts", {})
    monkeypatch.setattr(dispatch, "on_gpu", lambda call: True)
    monkeypatch.setattr(dispatch, "capability", lambda device: cap)
    monkeypatch.setattr(fwd_host, "device_arch", lambda device: tiles.arch_of(cap))


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9), (12, 0)])
def test_dispatch_routes_ampere_ada_and_consumer_blackwell_to_portable(monkeypatch, tmp_path, cap):
    """Unverified capabilities: the portable variant is self-checked first, then runs the call."""
    import torch_fa4
    from torch_fa4.kernels import portable

    _faked_gpu(monkeypatch, tmp_path, cap)
    monkeypatch.setattr(self_check, "checks_run", 0)
    launches = []
    _stand_in(monkeypatch, portable, launches)
    q, k, v = (torch.randn(2, 300, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    out = torch_fa4.attention(q, k, v, causal=True)
    assert len(launches) == 2 and self_check.checks_run == 1, "one check, then the call's own launch"
    assert launches[1].q is q
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), causal=True)
    assert (out.double() - ref).abs().max() < 0.05


def test_backend_portable_on_a_verified_hopper(monkeypatch):
    """TORCH_FA4_BACKEND=portable: the portable forward on sm_90 too, without a self-check (9.0 is
    where its GPU tests run); unset, sm_90 runs the sm90 kernels."""
    import torch_fa4
    from torch_fa4 import dispatch
    from torch_fa4.kernels import portable, sm90

    monkeypatch.setattr(self_check, "checks_run", 0)
    monkeypatch.setattr(dispatch, "on_gpu", lambda call: True)
    monkeypatch.setattr(dispatch, "capability", lambda device: (9, 0))
    launches, hopper = [], []
    _stand_in(monkeypatch, portable, launches)
    _stand_in(monkeypatch, sm90, hopper)
    q, k, v = (torch.randn(1, 100, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    monkeypatch.setenv("TORCH_FA4_BACKEND", "portable")
    torch_fa4.attention(q, k, v)
    assert len(launches) == 1 and not hopper and self_check.checks_run == 0
    monkeypatch.delenv("TORCH_FA4_BACKEND")
    torch_fa4.attention(q, k, v)
    assert len(launches) == 1 and len(hopper) == 1


def test_blackwell_calls_the_sm100_forward_refuses_run_portable(monkeypatch, tmp_path):
    """On 10.0 a call the sm100 forward cannot take runs on the portable forward, after its
    self-check, with a warning naming the fallback."""
    import torch_fa4
    from torch_fa4 import dispatch
    from torch_fa4.kernels import portable, sm100

    _faked_gpu(monkeypatch, tmp_path, (10, 0))
    monkeypatch.setattr(dispatch, "_warned", set())
    launches = []
    _stand_in(monkeypatch, portable, launches)
    monkeypatch.setattr(sm100, "unsupported_reason", lambda call: "a feature it lacks")
    q, k, v = (torch.randn(1, 200, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    with pytest.warns(UserWarning, match="sm100 forward falls back to the portable kernels"):
        torch_fa4.attention(q, k, v)
    assert len(launches) == 2 and launches[1].q is q


def test_blackwell_sm100_failing_its_check_runs_portable(monkeypatch, tmp_path):
    """On 10.0 an sm100 variant that fails its first-use self-check hands the call to the portable
    forward (checked in turn), not to the reference."""
    import torch_fa4
    from torch_fa4.kernels import portable, sm100

    _faked_gpu(monkeypatch, tmp_path, (10, 0))
    monkeypatch.setattr(self_check, "_warned", set())
    wrong = []

    def wrong_forward(call, out, lse):
        wrong.append(call)
        out.zero_()
        lse.zero_()

    monkeypatch.setattr(sm100, "forward", wrong_forward)
    launches = []
    _stand_in(monkeypatch, portable, launches)
    q, k, v = (torch.randn(1, 200, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    with pytest.warns(self_check.SelfCheckWarning, match="sm100 forward variant"):
        out = torch_fa4.attention(q, k, v)
    assert len(wrong) == 1, "the sm100 variant ran its check only"
    assert len(launches) == 2 and launches[1].q is q, "the portable check, then the call"
    ref = torch_fa4.attention(q.double(), k.double(), v.double())
    assert (out.double() - ref).abs().max() < 0.05
