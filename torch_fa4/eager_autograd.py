"""Eager-mode autograd for `torch_fa4.attention`: one small autograd.Function around the two ops.

The `torch_fa4::fwd` op carries its own autograd (ops.py, `register_autograd`), and that is what
torch.compile and direct op callers use. In eager mode that generic wrapper is costly on the host:
because the op takes `list[Tensor]` arguments, torch wraps its autograd.Function to flatten and
rebuild all 19 arguments through pytree on every forward and backward, and the bwd op's own entry
and exit add more: at short sequences the host falls behind the kernels.

This Function saves the same tensors and runs the same forward (below autograd, so its wrapper is
not entered); its backward runs the bwd op's implementation directly unless something could
intercept the op (a dispatch mode, a tensor subclass), then the op itself. Eager calls with no
autograd to record skip the fwd op's entry the same way (`route`). Eager and compiled runs compute
the same thing; only the bookkeeping differs.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from torch_fa4 import ops


class AttentionFunction(torch.autograd.Function):
    """apply(q, k, v, rest) -> (out, lse); `rest` is the tuple of op arguments after v.

    When a captured tensor (rest[0]) requires grad, `apply` also passes the captured tensors as
    inputs of their own, so that autograd asks for their gradients (torch_fa4/mods/capture_grad.py);
    the common call passes only q, k, v."""

    @classmethod
    def apply(cls, q, k, v, rest):
        aux = rest[0]
        if aux and torch.is_grad_enabled() and any(t.requires_grad for t in aux):
            return super().apply(q, k, v, rest, *aux)
        return super().apply(q, k, v, rest)

    @staticmethod
    def forward(ctx, q, k, v, rest, *aux):
        if _plain(q, k, v, *_tensors(rest)):
            out, lse = ops.fwd_impl(q, k, v, *rest)
        else:
            out, lse = torch.ops.torch_fa4.fwd(q, k, v, *rest)
        # captured tensors that require grad are saved too: one changed in place before the
        # backward is then autograd's error, not a gradient of other values
        ctx.save_for_backward(q, k, v, out, lse, *aux)
        ctx.rest = rest
        ctx.mark_non_differentiable(lse)  # the API returns LSE detached
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse on every backward
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        needs = ctx.needs_input_grad
        aux_grads = [None] * (len(needs) - 4)  # the captured tensors, when apply passed them
        if grad_out is None:  # nothing reached `out` (grads are not materialized)
            return None, None, None, None, *aux_grads
        q, k, v, out, lse, *aux = ctx.saved_tensors
        rest = (aux, *ctx.rest[1:]) if aux else ctx.rest
        grad_out = grad_out.contiguous()
        plain = _plain(grad_out, q, k, v)
        dq = dk = dv = None
        qkv = needs[0] or needs[1] or needs[2]
        slots = ops.captured_slots(rest, needs[4:]) if aux_grads else []
        found = []
        if slots:
            plain = plain and _plain(*aux)
            if qkv:  # one op: one kernel run where the family fuses the captured gradients
                op = ops.bwd_and_captured_impl if plain else torch.ops.torch_fa4.bwd_and_captured
                dq, dk, dv, found = op(grad_out, q, k, v, out, lse, *rest, slots)
                dq, dk, dv = (g if wanted else None for g, wanted in zip((dq, dk, dv), needs[:3]))
            else:
                op = ops.bwd_captured_impl if plain else torch.ops.torch_fa4.bwd_captured
                found = op(grad_out, q, k, v, out, lse, *rest, slots)
        elif qkv:
            if plain:
                # what the bwd op's kernel does, without the op's entry and exit (~80 us on the host)
                dq, dk, dv = ops.bwd_impl(grad_out, q, k, v, out, lse, *rest)
            else:  # a dispatch mode or tensor subclass must see the op
                dq, dk, dv = torch.ops.torch_fa4.bwd(grad_out, q, k, v, out, lse, *rest)
        for slot, g in zip(slots, found):
            aux_grads[slot] = g
        return dq, dk, dv, None, *aux_grads


def _plain(*tensors) -> bool:
    """Plain tensors, none on the meta device, and no torch dispatch or function mode: nothing
    would intercept the op (a mode, a subclass, the meta device's fake kernel)."""
    return (_get_current_dispatch_mode() is None and torch._C._len_torch_function_stack() == 0
            and all(type(t) is torch.Tensor and t.device.type != "meta" for t in tensors))


def _tensors(rest) -> list:
    """The tensors among the op arguments after v: the captured tensors (rest[0]), the varlen
    offsets and seqused_k (rest[1:4]) and the block mask's (rest[4]); the others are scalars."""
    aux, cu_seqlens_q, cu_seqlens_k, seqused_k, block_mask = rest[:5]
    found = [*aux, *block_mask]
    for t in (cu_seqlens_q, cu_seqlens_k, seqused_k):
        if t is not None:
            found.append(t)
    return found


def route(q, k, v, rest) -> str:
    """How an eager API call reaches the fwd op (this sits on every call's path): "function"
    (AttentionFunction: eager, with autograd to record), "direct" (the op's body, ~40 us less host
    time: no autograd to record, and nothing that could intercept the op, `_plain`) or "op" (the op
    itself: under torch.compile or functorch, which trace it, or when something could intercept).
    A captured tensor that requires grad takes "function" too (AttentionFunction.apply)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return "op"  # they trace the op itself
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "function"
    extra = _tensors(rest)
    if torch.is_grad_enabled() and any(t.requires_grad for t in extra):
        return "function"  # a captured tensor requires grad (only they can: the others are integers)
    return "direct" if _plain(q, k, v, *extra) else "op"
