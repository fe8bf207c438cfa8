"""The mods the sm90 and sm100 backward tests share: factories (slopes, doc) -> (score_mod, mask_mod)
over captured tensors, the (factory, causal) cases of their test_mods, and the captured tensors
those cases draw.

The factories keep their leading underscore: pytest names a parametrized case by the function's
__name__, so the test ids read test_mods[_alibi-True] as they always have.
"""

import torch


def _alibi(slopes, doc):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return score_mod, None


def _tanh_bias(slopes, doc):  # a score_mod with a non-trivial derivative
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score * 0.5) * 2.0 + torch.where(q_idx >= kv_idx, 0.25, -0.5)

    return score_mod, None


def _documents(slopes, doc):  # a mask_mod over a captured tensor
    def mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return None, mask_mod


def _tanh_bias_documents(slopes, doc):
    return _tanh_bias(slopes, doc)[0], _documents(slopes, doc)[1]


MOD_CASES = [(_alibi, True), (_tanh_bias, False), (_documents, False), (_tanh_bias_documents, True)]


def slopes_and_documents(heads=4, keys=300, docs=4):
    """Fresh per-head slopes (heads,) and sorted document ids (keys,) of up to `docs` documents."""
    slopes = torch.rand(heads, device="cuda")
    doc = torch.sort(torch.randint(0, docs, (keys,), device="cuda")).values.to(torch.int32)
    return slopes, doc
