"""GPU: mods recognised as built-ins (causal, windows, tanh softcap; torch_fa4/mods/idioms.py) and
near misses that must keep their mods, forward and backward on the sm_90 kernels against float64
computed from the user's own callables. Also the common mods that run their own fast paths: clamped
relative biases (a clamp saturated over a whole fragment is a constant there:
mod_hoisting.saturation_split), ALiBi, and block masks (document, prefix-LM, chunked) on the
persistent schedule that D128 block-list walks take."""

import pytest
import torch

import torch_fa4
from gpu_harness import SM90_ONLY
from naive import naive_attention, rel_error

pytestmark = SM90_ONLY

MODS = {
    "causal": dict(mask_mod=lambda b, h, q, kv: q >= kv),
    "causal, near miss": dict(mask_mod=lambda b, h, q, kv: q > kv),
    "window": dict(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < 100)),
    "window, near miss": dict(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < 100) & (q - kv != 7)),
    "band": dict(mask_mod=lambda b, h, q, kv: (q - kv).abs() <= 33),
    "softcap": dict(score_mod=lambda s, b, h, q, kv: 30 * torch.tanh(s / 30)),
    "softcap, near miss": dict(score_mod=lambda s, b, h, q, kv: 30 * torch.tanh(s / 29)),
    "softcap and causal": dict(score_mod=lambda s, b, h, q, kv: 10 * torch.tanh(s / 10),
                               mask_mod=lambda b, h, q, kv: q >= kv),
    # saturated on tiles at least 64 away from the diagonal, on either side
    "relative bias, clamped": dict(score_mod=lambda s, b, h, q, kv: s - 0.01 * (q - kv).abs().clamp(max=64)),
    "relative bias, clamped, causal": dict(
        score_mod=lambda s, b, h, q, kv: s - 0.01 * (q - kv).abs().clamp(max=64),
        mask_mod=lambda b, h, q, kv: q >= kv),
    # a different constant on each side; the upper bound is not a multiple of a tile
    "two-sided clamp": dict(score_mod=lambda s, b, h, q, kv: s + 0.05 * (q - kv + 3).clamp(-100, 37).float()),
    # a clamp of something not affine in the positions: no split, the general code
    "clamp, not affine": dict(
        score_mod=lambda s, b, h, q, kv: s - 0.01 * ((q * kv) % 97).clamp(max=50).float()),
    "alibi with abs, causal": dict(
        score_mod=lambda s, b, h, q, kv: s - (h + 1) * 0.0625 * (q - kv).abs().float(),
        mask_mod=lambda b, h, q, kv: q >= kv),
}


@pytest.mark.parametrize("name", list(MODS))
@pytest.mark.parametrize("sq, sk, d", [(513, 513, 128), (700, 300, 64), (129, 1000, 64)])
def test_recognised_and_near_miss_mods_against_float64(name, sq, sk, d):
    mods = MODS[name]
    q = torch.randn(2, sq, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, sk, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = torch_fa4.attention(q, k, v, **mods)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = lambda dtype: [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]  # noqa: E731
    refs, lows = leaves(torch.float64), leaves(torch.bfloat16)
    ref, _ = naive_attention(*refs, **mods, differentiable=True)
    low, _ = naive_attention(*lows, **mods, differentiable=True)
    ref_grads = torch.autograd.grad(ref, refs, dout.double())
    low_grads = torch.autograd.grad(low, lows, dout)
    assert rel_error(out, ref) <= 2 * rel_error(low, ref)
    for g, r, lg in zip(grads, ref_grads, low_grads):
        assert rel_error(g, r) <= 2 * rel_error(lg, r)


def _block_masks(S: int, device):
    """name -> mask_mod over S positions: documents of uneven lengths, alone and causal; prefix-LM;
    chunked attention."""
    lengths = [S // 3 + 17, S // 5, 1, S // 4 + 128]
    lengths.append(S - sum(lengths))
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(lengths, device=device)).to(torch.int32)
    return {
        "document": lambda b, h, q, kv: doc[q] == doc[kv],
        "document, causal": lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv),
        "prefix-LM 300": lambda b, h, q, kv: (kv <= 300) | (q >= kv),
        "chunked 256, causal": lambda b, h, q, kv: (q // 256 == kv // 256) & (q >= kv),
    }


@pytest.mark.parametrize("name", ["document", "document, causal", "prefix-LM 300", "chunked 256, causal"])
@pytest.mark.parametrize("S", [1000, 2048])
@pytest.mark.parametrize("score", [None, "relative bias"])
def test_block_masks_against_float64(name, S, score):
    """D128 block-list walks: the dynamic persistent schedule (mask_mod alone) and the per-item
    grid (with a score_mod); forward output and LSE."""
    mask_mod = _block_masks(S, "cuda")[name]
    score_mod = None if score is None else (lambda s, b, h, q, kv: s - 0.01 * (q - kv).abs().clamp(max=64))
    bm = torch_fa4.create_block_mask(mask_mod, None, None, S, S, device="cuda")
    q, k, v = (torch.randn(2, 4, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch_fa4.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    ref, ref_lse = naive_attention(*bshd, score_mod=score_mod, mask_mod=mask_mod, device="cuda")
    low, _ = naive_attention(*bshd, score_mod=score_mod, mask_mod=mask_mod, differentiable=True)
    assert rel_error(out.transpose(1, 2), ref) <= 2 * rel_error(low, ref)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2


@pytest.mark.parametrize("S", [700, 2048])
def test_document_and_causal_without_a_block_mask(S):
    """`doc & causal` as a mask_mod alone: causal runs as the built-in (tiles above the diagonal
    never visited), the document test as the mask_mod; and the near miss `q > kv` that keeps the
    whole mask."""
    doc = (torch.arange(S, device="cuda") * 7 // S).to(torch.int32)
    for mask_mod in (lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv),
                     lambda b, h, q, kv: (doc[q] == doc[kv]) & (q > kv)):
        q, k, v = (torch.randn(2, S, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch_fa4.attention(q, k, v, mask_mod=mask_mod)
        ref, _ = naive_attention(q, k, v, mask_mod=mask_mod, device="cuda")
        low, _ = naive_attention(q, k, v, mask_mod=mask_mod, differentiable=True)
        # (the first row of each document sees nothing under q > kv: out 0 there, in both)
        assert rel_error(out, ref) <= 2 * rel_error(low, ref)


@pytest.mark.parametrize("name", ["document, causal", "chunked 256, causal"])
def test_folded_block_mask_backward_against_float64(name):
    """The backward of a block mask whose causal part runs as the built-in: the re-listed full
    tiles (mods/block_lists.py) still get the causal limit there."""
    S = 1000
    mask_mod = _block_masks(S, "cuda")[name]
    bm = torch_fa4.create_block_mask(mask_mod, None, None, S, S, device="cuda")
    q, k, v = (torch.randn(2, 4, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = torch_fa4.flex_attention(q, k, v, block_mask=bm)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    def leaves(dtype):
        return [t.detach().transpose(1, 2).to(dtype).requires_grad_() for t in (q, k, v)]

    refs, lows = leaves(torch.float64), leaves(torch.bfloat16)
    ref, _ = naive_attention(*refs, mask_mod=mask_mod, differentiable=True)
    low, _ = naive_attention(*lows, mask_mod=mask_mod, differentiable=True)
    d = dout.transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, refs, d.double())
    low_grads = torch.autograd.grad(low, lows, d)
    assert rel_error(out.transpose(1, 2), ref) <= 2 * rel_error(low, ref)
    for g, r, lg in zip(grads, ref_grads, low_grads):
        assert rel_error(g.transpose(1, 2), r) <= 2 * rel_error(lg, r)
