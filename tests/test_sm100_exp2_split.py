"""CPU: the sm100 forward's softmax options, FA4's exponent split and conditional rescale.

- exp2 on the FMA pipe (kernels/common/exp2_emulation.py): its PTX, step by step in float32 numpy
  with the very constants the kernel inlines, matches 2^x within the polynomial's 8.6e-5 over the
  range the softmax produces, and gives 0 (never NaN) for masked scores;
- kernels/sm100/packed_softmax.py's packed pair computes the same arithmetic: same constants;
- the variant defaults: a share of the exponentials on the FMA pipe where MUFU.EX2 would take as
  long as the matmuls (D <= 128 without mods), none where the matmuls dominate, and the
  conditional rescale at 8 (log2 units) everywhere.
"""

import re

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass")

from torch_fa4.call import AttentionCall  # noqa: E402


def _constants():
    from torch_fa4.kernels.common import exp2_emulation

    hexes = re.findall(r"0f([0-9A-F]{8})", exp2_emulation._PTX)
    clamp, magic, _, c3, c2, c1, one = (np.uint32(int(h, 16)).view(np.float32) for h in hexes)
    return clamp, magic, c3, c2, c1, one


def _exp2_fma(x: np.ndarray) -> np.ndarray:
    """The PTX of exp2_fma in float32 (fma's single rounding only differs in the last bit)."""
    clamp, magic, c3, c2, c1, one = _constants()
    f32 = np.float32
    xc = np.maximum(x, clamp).astype(f32)
    t = (np.floor(xc) + magic).astype(f32)  # add.rm: exact floor for |x| < 2^22
    j = (t - magic).astype(f32)
    f = (xc - j).astype(f32)
    p = (f * c3 + c2).astype(f32)
    p = (p * f + c1).astype(f32)
    p = (p * f + one).astype(f32)
    bits = (p.view(np.uint32).astype(np.uint64) + ((t.view(np.uint32).astype(np.uint64) << 23) & 0xFFFFFFFF))
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(f32)


def test_fma_exp2_matches_exp2_over_the_softmax_range():
    x = np.concatenate([np.linspace(-126, 9, 400_001), np.random.uniform(-30, 8, 100_000)]).astype(np.float32)
    got = _exp2_fma(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    assert not np.isnan(got).any()
    assert (np.abs(got - want) / want).max() < 1e-4  # bf16's step is 3.9e-3
    masked = _exp2_fma(np.float32([-np.inf, -1e30, -500.0, -127.0]))
    assert not np.isnan(masked).any() and (masked >= 0).all() and (masked < 1e-37).all()


def test_the_packed_pair_uses_the_same_constants():
    from torch_fa4.kernels.sm100 import packed_softmax as P

    clamp, magic, c3, c2, c1, one = _constants()
    pair = (P.EXP2_CLAMP, P.EXP2_MAGIC, P.EXP2_C3, P.EXP2_C2, P.EXP2_C1, 1.0)
    assert tuple(np.float32(v) for v in pair) == (clamp, magic, c3, c2, c1, one)


def _call(D, **kw):
    q = torch.empty(1, 8, 2, D, dtype=torch.bfloat16)
    return AttentionCall(q=q, k=q, v=q, scale=D ** -0.5, **kw)


def test_softmax_option_defaults():
    from torch_fa4 import mods as M
    from torch_fa4.kernels.sm100 import fwd_host
    from torch_fa4.mods import registry

    for D in fwd_host.SUPPORTED_HEAD_DIMS:
        cfg = fwd_host.default_config(_call(D))
        assert cfg.rescale_threshold == 8.0
        assert cfg.exp2_emulate_every == (5 if D <= 128 else 0), D
    key, aux = M.prepare(M.alibi(M.alibi_slopes(2)), None)
    mod_call = _call(128, mod_key=key, mods=registry.lookup(key), aux_tensors=tuple(aux))
    assert fwd_host.default_config(mod_call).exp2_emulate_every == 0
    assert not fwd_host.default_config(mod_call).packed_f32x2
    softcap = fwd_host.default_config(_call(128, softcap=30.0))
    assert softcap.exp2_emulate_every == 0 and not softcap.packed_f32x2
    assert fwd_host.default_config(_call(128)).packed_f32x2
    # both are plain fields of the variant: a test or a tuning run overrides them
    tuned = fwd_host.default_config(_call(64), exp2_emulate_every=4, rescale_threshold=None)
    assert (tuned.exp2_emulate_every, tuned.rescale_threshold) == (4, None)
