"""Eager-mode autograd for `torch_fa4.attention`: one small autograd.Function around the two ops.

The `torch_fa4::fwd` op carries its own autograd (ops.py, `register_autograd`), and that is what
torch.compile and direct op callers use. In eager mode that generic wrapper is costly on the host:
because the op takes `list[Tensor]` arguments, torch wraps its autograd.Function to flatten and
rebuild all 19 arguments through pytree on every forward and backward, and the bwd op's own entry
and exit add more. On the GPU host one `autograd.grad` through it took ~570 us, of which the
backward op call was ~220 us (benchmarks/NOTES.md "Session 8"): at 1k tokens the host then fell
behind the kernels.

This Function saves the same tensors and calls the same forward op (below autograd, so its wrapper
is not entered); its backward runs the bwd op's implementation directly unless something could
intercept the op (a dispatch mode, a tensor subclass), then the op itself. Eager and compiled runs
compute the same thing; only the bookkeeping differs.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from torch_fa4 import ops


class AttentionFunction(torch.autograd.Function):
    """apply(q, k, v, rest) -> (out, lse); `rest` is the tuple of op arguments after v."""

    @staticmethod
    def forward(ctx, q, k, v, rest):
        out, lse = torch.ops.torch_fa4.fwd(q, k, v, *rest)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rest = rest
        ctx.mark_non_differentiable(lse)  # the API returns LSE detached
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse on every backward
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        if grad_out is None:  # nothing reached `out` (grads are not materialized)
            return None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if _plain(grad_out, q, k, v):
            # what the bwd op's kernel does, without the op's entry and exit (~80 us on the host)
            dq, dk, dv = ops.bwd_impl(grad_out, q, k, v, out, lse, *ctx.rest)
        else:  # a dispatch mode or tensor subclass must see the op
            dq, dk, dv = torch.ops.torch_fa4.bwd(grad_out, q, k, v, out, lse, *ctx.rest)
        return dq, dk, dv, None


def _plain(*tensors) -> bool:
    """Plain tensors and no torch dispatch mode: nothing would intercept the bwd op."""
    return _get_current_dispatch_mode() is None and all(type(t) is torch.Tensor for t in tensors)


def use_function(q, k, v) -> bool:
    """Whether this call goes through AttentionFunction: eager, with autograd to record. Under
    torch.compile or functorch transforms the op's own autograd runs (they trace it)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
