"""The comparison of two greedy generate() runs (Transformers, return_dict_in_generate) that the
integration tests make: ours against a reference attention implementation."""

import torch


def assert_same_greedy_decoding(our_steps, ref_steps, our_tokens, ref_tokens, tol, ref_name):
    """Step by step, the per-step scores / logits (our_steps, ref_steps) agree to `tol`; the tokens
    (the runs' sequences) agree unless the reference's own top two were within `tol` (a near-tie that
    rounding may break either way), after which the inputs differ and nothing further is compared."""
    start = ref_tokens.shape[1] - len(ref_steps)
    for step, (a, b) in enumerate(zip(our_steps, ref_steps)):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        got, want = our_tokens[:, start + step], ref_tokens[:, start + step]
        if not torch.equal(got, want):
            rows = (got != want).nonzero().flatten()
            gap = b[rows, want[rows]] - b[rows, got[rows]]
            assert (gap <= tol).all(), f"step {step}: fa4 chose a token {ref_name} scored {gap.max():.2e} lower"
            return
