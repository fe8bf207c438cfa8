"""CPU: with compute capability 10.0 faked, every feature the sm100 forward advertises reaches it,
each variant after its first-use self-check (torch_fa4/self_check.py).

The sm100 forward is stood in by the reference (nothing launches on a CPU); what is tested is the
route: the public call -> dispatch -> `kernels.sm100.unsupported_reason` accepts it -> the
self-check launches the variant once on a small problem of the same features -> the call's own
launch, whose variant (`fwd_host.default_config`) is built for these exact features. The kernels
themselves are compile-checked in tests/test_sm100_fwd_compile.py.
"""

import pytest
import torch

import torch_fa4
from torch_fa4 import mods as M
from torch_fa4 import reference, self_check

BLACKWELL = (10, 0)


@pytest.fixture(autouse=True)
def fresh_verdicts(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(self_check.ENV, raising=False)
    monkeypatch.setattr(self_check, "_verdicts", {})
    monkeypatch.setattr(self_check, "_warned", set())
    monkeypatch.setattr(self_check, "checks_run", 0)


@pytest.fixture
def launches(monkeypatch):
    """The calls the sm100 forward receives (computed by the reference), with their variants."""
    from torch_fa4 import dispatch
    from torch_fa4.kernels import sm100
    from torch_fa4.kernels.sm100 import fwd_host

    seen = []

    def stand_in(call, out, lse):
        seen.append((call, fwd_host.default_config(call)))
        o, l = reference.forward(call)
        out.copy_(o)
        lse.copy_(l)

    monkeypatch.setattr(dispatch, "on_gpu", lambda call: True)
    monkeypatch.setattr(dispatch, "capability", lambda device: BLACKWELL)
    monkeypatch.setattr(sm100, "forward", stand_in)
    return seen


def _qkv(D=64, S=600, H=4, Hkv=2, B=2, dtype=torch.bfloat16):
    q = torch.randn(B, S, H, D, dtype=dtype)
    k, v = (torch.randn(B, S, Hkv, D, dtype=dtype) for _ in range(2))
    return q, k, v


def _check_route(launches, out, ref, **variant):
    """One self-check launch, then the call's own; both variants have `variant`'s fields."""
    assert len(launches) == 2 and self_check.checks_run == 1, "one check, then the call's own launch"
    (check, check_cfg), (real, real_cfg) = launches
    for name, value in variant.items():
        assert getattr(real_cfg, name) == value, (name, getattr(real_cfg, name), value)
    # the small problem keeps the features: same variant but for nothing the features decide
    assert (check_cfg.mod_key, check_cfg.block_sparse, check_cfg.q_tiles, check_cfg.head_dim) == (
        real_cfg.mod_key, real_cfg.block_sparse, real_cfg.q_tiles, real_cfg.head_dim)
    assert (out.double() - ref).abs().max() < 0.05


@pytest.mark.parametrize("D, features", [
    (192, dict(causal=True)),
    (256, dict(softcap=15.0)),
    (256, dict(window_size=(100, 20))),
])
def test_large_head_dims_reach_the_sm100_forward(launches, D, features):
    q, k, v = _qkv(D=D, S=300)
    out = torch_fa4.attention(q, k, v, **features)
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), **features)
    _check_route(launches, out, ref, head_dim=D, q_tiles=2 if D == 192 else 1, tile_n=64 if D == 192 else 128)


def test_score_mod_reaches_the_sm100_forward(launches):
    q, k, v = _qkv(D=128)
    slopes = M.alibi_slopes(4)
    out = torch_fa4.attention(q, k, v, causal=True, score_mod=M.alibi(slopes))
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), causal=True, score_mod=M.alibi(slopes))
    call, cfg = launches[-1]
    assert cfg.mod_key == call.mod_key != "" and cfg.aux_specs == (("torch.float32", 1),)
    _check_route(launches, out, ref, q_tiles=2, block_sparse=False)


def test_mask_mod_reaches_the_sm100_forward(launches):
    q, k, v = _qkv(D=64)
    doc = torch.randint(0, 3, (600,)).sort().values
    out = torch_fa4.attention(q, k, v, mask_mod=M.document_mask(doc))
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), mask_mod=M.document_mask(doc))
    _check_route(launches, out, ref, q_tiles=1, block_sparse=False)  # (a gathering mask_mod: one tile)


def _causal_stripes(b, h, q_idx, kv_idx):
    """A mask_mod without captured tensors that is no built-in mask (a causal mask alone would run
    as causal=True)."""
    return (q_idx >= kv_idx) & (kv_idx % 4 != 3)


@pytest.mark.parametrize("block", [128, (256, 128)])
def test_block_mask_reaches_the_sm100_forward(launches, block):
    q, k, v = _qkv(D=128, S=512)
    bm = M.create_block_mask(_causal_stripes, None, None, 512, 512, device="cpu", BLOCK_SIZE=block)
    out = torch_fa4.attention(q, k, v, block_mask=bm)
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), block_mask=bm)
    q_tiles = 2 if block == (256, 128) else 1
    _check_route(launches, out, ref, block_sparse=True, q_tiles=q_tiles, bm_tiles_m=1, bm_tiles_n=1)


def test_varlen_with_mods_reaches_the_sm100_forward(launches):
    q = torch.randn(900, 4, 96, dtype=torch.float16)
    k, v = (torch.randn(900, 2, 96, dtype=torch.float16) for _ in range(2))
    cu = torch.tensor([0, 200, 900], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=700, max_seqlen_k=700,
              score_mod=M.alibi(M.alibi_slopes(4)), causal=True, softcap=30.0)
    out = torch_fa4.attention(q, k, v, **kw)
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), **kw)
    assert launches[-1][1].mod_key and launches[-1][1].softcap
    _check_route(launches, out, ref, varlen_q=True, varlen_k=True, causal=True, q_tiles=2)


def test_a_block_mask_the_kernel_cannot_walk_falls_back_with_its_reason(launches):
    q, k, v = _qkv(D=64, S=256)
    bm = M.create_block_mask(_causal_stripes, None, None, 256, 256, device="cpu", BLOCK_SIZE=(64, 128))
    with pytest.warns(UserWarning, match="BLOCK_SIZE"):
        out = torch_fa4.attention(q, k, v, block_mask=bm)
    assert not launches and self_check.checks_run == 0
    ref = torch_fa4.attention(q.double(), k.double(), v.double(), block_mask=bm)
    assert (out.double() - ref).abs().max() < 0.05
