"""The torch.library ops: torch_fa4::fwd and torch_fa4::bwd, their fake kernels and autograd, and
torch_fa4::fwd_paged, the forward over paged KV caches (inference only: no autograd).

Everything torch.compile, FakeTensor and autograd need to know about attention lives here; the
work itself is handed to `dispatch`, which picks a kernel by device and architecture. Mods arrive
as a key into the mod registry plus the tensors they captured (a callable cannot be an op argument).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torch_fa4 import dispatch
from torch_fa4.call import AttentionCall, empty_laid_out_like


def make_call(q, k, v, aux_tensors, cu_seqlens_q, cu_seqlens_k, seqused_k, block_mask, max_seqlen_q,
              max_seqlen_k, scale, causal, window_left, window_right, softcap, mod_key, block_mask_q,
              block_mask_kv, page_table=None) -> AttentionCall:
    mods = None
    if mod_key:
        from torch_fa4.mods import registry

        mods = registry.lookup(mod_key)
    return AttentionCall(
        q=q, k=k, v=v, scale=scale, causal=causal, window_left=window_left, window_right=window_right,
        softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, mod_key=mod_key, mods=mods,
        aux_tensors=tuple(aux_tensors), block_mask=tuple(block_mask), block_mask_q=block_mask_q,
        block_mask_kv=block_mask_kv, page_table=page_table,
    )


def fwd_impl(
    q: Tensor, k: Tensor, v: Tensor, aux_tensors: list[Tensor], cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor], block_mask: list[Tensor],
    max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, mod_key: str, block_mask_q: int, block_mask_kv: int,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """Attention forward: returns (out, lse), out laid out like q (call.empty_laid_out_like).

    The fwd op's body (eager_autograd calls it directly when nothing could intercept the op).
    `deterministic` is kept for the backward. Explicit parameters: `*args` re-packing costs host time."""
    return dispatch.forward(make_call(q, k, v, aux_tensors, cu_seqlens_q, cu_seqlens_k, seqused_k, block_mask,
                                      max_seqlen_q, max_seqlen_k, scale, causal, window_left, window_right,
                                      softcap, mod_key, block_mask_q, block_mask_kv))


fwd = torch.library.custom_op("torch_fa4::fwd", fwd_impl, mutates_args=())


@fwd.register_fake
def _fwd_fake(q, k, v, aux_tensors, cu_seqlens_q, *rest):
    call = AttentionCall(q, k, v, scale=0.0, cu_seqlens_q=cu_seqlens_q)  # for its shapes and dtypes
    return empty_laid_out_like(q, call.out_shape()), q.new_empty(call.lse_shape(), dtype=call.lse_dtype)


def bwd_impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux_tensors: list[Tensor],
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
    block_mask: list[Tensor], max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, mod_key: str, block_mask_q: int,
    block_mask_kv: int, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention backward: returns (dq, dk, dv), contiguous, shaped like q, k, v (the sm_90 backward
    is compiled for gradients with packed heads). The bwd op's body (eager_autograd calls it
    directly when nothing could intercept the op)."""
    call = make_call(q, k, v, aux_tensors, cu_seqlens_q, cu_seqlens_k, seqused_k, block_mask, max_seqlen_q,
                     max_seqlen_k, scale, causal, window_left, window_right, softcap, mod_key, block_mask_q,
                     block_mask_kv)
    return dispatch.backward(call, dout, out, lse, deterministic)


bwd = torch.library.custom_op("torch_fa4::bwd", bwd_impl, mutates_args=())


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, *args):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def bwd_captured_impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux_tensors: list[Tensor],
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
    block_mask: list[Tensor], max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, mod_key: str, block_mask_q: int,
    block_mask_kv: int, deterministic: bool, grad_slots: list[int],
) -> list[Tensor]:
    """Gradients of the captured tensors at `grad_slots` (score_mod slots), shaped and typed like
    them, on every backend (torch_fa4/mods/capture_grad.py says how)."""
    from torch_fa4.mods import capture_grad

    call = make_call(q, k, v, aux_tensors, cu_seqlens_q, cu_seqlens_k, seqused_k, block_mask, max_seqlen_q,
                     max_seqlen_k, scale, causal, window_left, window_right, softcap, mod_key, block_mask_q,
                     block_mask_kv)
    fused = capture_grad.fused_backward(call, dout, out, lse, grad_slots, deterministic)
    if fused is not None:  # the backend's kernel accumulates them (its dq, dk, dv are not wanted here)
        return fused[3]
    return capture_grad.captured_grads(call, dout, out, lse, grad_slots, deterministic)


bwd_captured = torch.library.custom_op("torch_fa4::bwd_captured", bwd_captured_impl, mutates_args=())


@bwd_captured.register_fake
def _bwd_captured_fake(dout, q, k, v, out, lse, aux_tensors, *args):
    return [torch.empty_like(aux_tensors[i], memory_format=torch.contiguous_format) for i in args[-1]]


def bwd_and_captured_impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux_tensors: list[Tensor],
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
    block_mask: list[Tensor], max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, mod_key: str, block_mask_q: int,
    block_mask_kv: int, deterministic: bool, grad_slots: list[int],
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """bwd's (dq, dk, dv) and bwd_captured's gradients in one: one kernel run where the backend's
    family accumulates captured gradients itself (capture_grad.fused_backward), else the two."""
    from torch_fa4.mods import capture_grad

    call = make_call(q, k, v, aux_tensors, cu_seqlens_q, cu_seqlens_k, seqused_k, block_mask, max_seqlen_q,
                     max_seqlen_k, scale, causal, window_left, window_right, softcap, mod_key, block_mask_q,
                     block_mask_kv)
    return capture_grad.backward_and_captured(call, dout, out, lse, grad_slots, deterministic)


bwd_and_captured = torch.library.custom_op("torch_fa4::bwd_and_captured", bwd_and_captured_impl,
                                           mutates_args=())


@bwd_and_captured.register_fake
def _bwd_and_captured_fake(dout, q, k, v, out, lse, aux_tensors, *args):
    captured = _bwd_captured_fake(dout, q, k, v, out, lse, aux_tensors, *args)
    return (*_bwd_fake(dout, q, k, v, out, lse), captured)


def captured_slots(rest, needs_aux) -> list[int]:
    """The captured tensors (`rest[0]`) that get a gradient: the score_mod's that autograd asks for."""
    if not rest[0] or not any(needs_aux):
        return []
    from torch_fa4.mods import capture_grad, registry

    return capture_grad.gradient_slots(registry.lookup(rest[12]), needs_aux)


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse = output
    # the captured tensors too: one changed in place before the backward is then autograd's error,
    # not a gradient of other values
    ctx.save_for_backward(q, k, v, out, lse, *inputs[3])
    ctx.rest = inputs[3:]


def _backward(ctx, grad_out, grad_lse):
    # The API returns LSE detached, so no gradient reaches it through torch_fa4's public functions.
    q, k, v, out, lse, *aux = ctx.saved_tensors
    rest = (aux, *ctx.rest[1:])
    grad_out = grad_out.contiguous()
    needs = ctx.needs_input_grad  # with the inputs' structure: the captured tensors' is a list
    dq = dk = dv = None
    # Autograd wants one entry per input with the input's structure: lists get lists of None.
    grads = [[None] * len(x) if isinstance(x, (list, tuple)) else None for x in rest]
    slots = captured_slots(rest, needs[3])
    found = []
    if slots and (needs[0] or needs[1] or needs[2]):  # one op: one kernel run where the family fuses them
        dq, dk, dv, found = torch.ops.torch_fa4.bwd_and_captured(grad_out, q, k, v, out, lse, *rest, slots)
        dq, dk, dv = (g if wanted else None for g, wanted in zip((dq, dk, dv), needs[:3]))
    elif needs[0] or needs[1] or needs[2]:
        dq, dk, dv = torch.ops.torch_fa4.bwd(grad_out, q, k, v, out, lse, *rest)
    elif slots:
        found = torch.ops.torch_fa4.bwd_captured(grad_out, q, k, v, out, lse, *rest, slots)
    for slot, g in zip(slots, found):
        grads[0][slot] = g
    return (dq, dk, dv, *grads)


torch.library.register_autograd("torch_fa4::fwd", _backward, setup_context=_setup_context)


def fwd_paged_impl(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, aux_tensors: list[Tensor],
    cu_seqlens_q: Optional[Tensor], seqused_k: Optional[Tensor], block_mask: list[Tensor],
    max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, mod_key: str, block_mask_q: int, block_mask_kv: int,
) -> tuple[Tensor, Tensor]:
    """Attention forward over paged KV caches (call.py says how a page table reads): returns
    (out, lse) as `fwd_impl`. k_cache / v_cache: (num_pages, page_size, Hkv, D / Dv); page_table
    (B, max_pages) int32. Keys are never packed (no cu_seqlens_k); queries may be."""
    return dispatch.forward(make_call(q, k_cache, v_cache, aux_tensors, cu_seqlens_q, None, seqused_k,
                                      block_mask, max_seqlen_q, max_seqlen_k, scale, causal, window_left,
                                      window_right, softcap, mod_key, block_mask_q, block_mask_kv,
                                      page_table=page_table))


fwd_paged = torch.library.custom_op("torch_fa4::fwd_paged", fwd_paged_impl, mutates_args=())


@fwd_paged.register_fake
def _fwd_paged_fake(q, k_cache, v_cache, page_table, aux_tensors, cu_seqlens_q, *rest):
    call = AttentionCall(q, k_cache, v_cache, scale=0.0, cu_seqlens_q=cu_seqlens_q)  # shapes and dtypes
    return empty_laid_out_like(q, call.out_shape()), q.new_empty(call.lse_shape(), dtype=call.lse_dtype)


def _paged_backward(ctx, grad_out, grad_lse):
    raise NotImplementedError(
        "torch_fa4: attention over a paged KV cache (page_table) is forward-only: no gradient flows "
        "through it (run it under torch.no_grad() / inference_mode, or detach q, k_cache and v_cache)")


def _paged_setup_context(ctx, inputs, output):
    pass


torch.library.register_autograd("torch_fa4::fwd_paged", _paged_backward, setup_context=_paged_setup_context)
