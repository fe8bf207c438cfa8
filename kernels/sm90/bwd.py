"""sm90 backward entry point: which calls the kernel takes, and running it.

`backward` = row statistics (lse in log2 units, rowsum(dO * O): bwd_row_stats.py, one fused pass
in bwd_prepare.py that also zeroes the fp32 dQ buffer) -> the CuTe DSL kernel (bwd_kernel.py, the
variant bwd_variant.py picks, compiled by bwd_compile.py) -> dQ fp32 -> dtype (bwd_dq_convert.py,
which applies the softmax scale the kernel leaves out; or the kernel writes dq itself, `fused_dq`).
Repeated dense calls replay a launch record (bwd_launch_record.py).

Takes: fp16/bf16, head dims 64/96/128/192/256 (Dv may differ), causal, sliding window, softcap,
GQA/MQA, seqused_k, any 16-byte-aligned strides, deterministic dQ, varlen (one launch of the
packed-rows variant; one dense launch per sequence with one side packed: `runs_per_sequence`),
score_mod/mask_mod (lowered into the kernel, derivative from the traced graph; the gradients of
tensors a score_mod captures accumulated by the kernel where captured_grad_reason allows) and block masks
(driving the walk where bwd_sparse.sparse_walk_reason allows; else the mask_mod is evaluated on
every tile of the dense walk: slower, same result).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from torch_fa4.kernels.host import bwd_operands
from torch_fa4.kernels.sm90 import bwd_dq_convert, bwd_launch_record, bwd_prepare
from torch_fa4.kernels.sm90.bwd_buffers import (dq_buffer, dq_buffer_shape, persistent_buffers, persistent_shapes,
                                                writes_dq_directly)
from torch_fa4.kernels.sm90.bwd_compile import MAX_AUX, MAX_CAPTURE_GRADS, compile_variant
from torch_fa4.kernels.sm90.bwd_row_stats import row_statistics
from torch_fa4.kernels.sm90.bwd_variant import (DEFAULT_TUNING, BwdTuning, launch_plan, runs_per_sequence,
                                                variant_key, window)

if TYPE_CHECKING:
    from torch_fa4.call import AttentionCall

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)

__all__ = ["SUPPORTED_HEAD_DIMS", "BwdTuning", "backward", "captured_grad_reason", "compile_variant",
           "launch_plan", "runs_per_sequence", "unsupported_reason", "variant_key"]


def unsupported_reason(call: "AttentionCall", tuning: BwdTuning = DEFAULT_TUNING) -> str | None:
    q, k, v = call.q, call.k, call.v
    if (reason := bwd_operands.operand_reason(call, "sm90", SUPPORTED_HEAD_DIMS)) is not None:
        return reason
    if call.mods is not None:
        if call.is_varlen != (call.cu_seqlens_k is not None):
            return "sm90 backward takes score_mod/mask_mod with cu_seqlens on both sides or neither"
        if call.is_varlen and not tuning.varlen_kernel:
            # the per-sequence launches would see each sequence as batch 0
            return "score_mod/mask_mod with varlen need the packed-rows backward"
        if len(call.aux_tensors) > MAX_AUX:
            return f"mods capture {len(call.aux_tensors)} tensors (sm90 backward: at most {MAX_AUX})"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not tma_compatible(t):
            return f"{name} is not TMA-compatible (last dim contiguous, 16-byte strides/pointer)"
    return None


def captured_grad_reason(call: "AttentionCall", slots, deterministic: bool,
                         tuning: BwdTuning = DEFAULT_TUNING) -> str | None:
    """Why the kernel does not accumulate the gradients of the captured tensors at `slots` (score_mod
    slots) itself, or None where it does (`backward(..., capture=)`; bwd_scores.CapturedGrads).
    Elsewhere torch_fa4/mods/capture_grad.py computes them."""
    reason = unsupported_reason(call, tuning)
    if reason is not None:
        return reason
    if deterministic:
        return "deterministic mode: fp32 atomics add in no fixed order"
    if call.mods is None or call.mods.score_graph is None:
        return "no score_mod"
    if not slots or len(slots) > MAX_CAPTURE_GRADS:
        return f"gradients for {len(slots)} captured tensors (the kernel takes 1 to {MAX_CAPTURE_GRADS})"
    if runs_per_sequence(call, deterministic, tuning):
        return "one launch per sequence"
    for slot in slots:
        if not (0 <= slot < call.mods.num_score_aux and call.aux_tensors[slot].is_floating_point()):
            return f"captured tensor {slot} is not a floating tensor of the score_mod"
    return None


# TMA reads rows as the fused row-statistics pass does: a unit last stride, 16-byte-multiple strides
# and a 16-byte base
tma_compatible = bwd_prepare._vector_ready

# the same view with size-1 dims given 16-byte-multiple strides, as the compiled signature wants
_tma_view = bwd_prepare._packed_size_one_strides


def backward(call: "AttentionCall", dout, out, lse, dq, dk, dv, deterministic: bool,
             tuning: BwdTuning = DEFAULT_TUNING, capture=None) -> None:
    """dq, dk, dv of `call` for output gradient dout (out, lse: the forward's). `tuning`: the
    tests' non-default launch choices (bwd_variant.BwdTuning). `capture`: (score_mod slots, fp32
    buffers shaped like those captured tensors (0-d: (1,)), contiguous and zeroed), where
    captured_grad_reason allows: the kernel adds the slots' gradients into the buffers."""
    if capture is None and bwd_launch_record.run(call, dout, out, lse, dq, dk, dv, deterministic, tuning):
        return  # a repeated dense call: replayed from its launch record
    if runs_per_sequence(call, deterministic, tuning):
        assert call.mods is None, "mods on per-sequence launches (unsupported_reason refuses them)"
        _backward_per_sequence(call, dout, out, lse, dq, dk, dv, deterministic, tuning)
        return
    key = variant_key(call, deterministic)
    grads = [None] * MAX_CAPTURE_GRADS
    if capture is not None:
        slots, buffers = capture
        assert captured_grad_reason(call, slots, deterministic, tuning) is None
        key = dataclasses.replace(key, capture_slots=tuple(slots))
        grads[: len(buffers)] = buffers
    plan = launch_plan(call, key, tuning)
    key = plan.key
    fn = compile_variant(key)
    tile_m = key.tile_m  # queries per step: row statistics, dQ buffer, semaphores pad to it
    q, k, v = call.q, call.k, call.v
    lists = [None] * 4
    min_rows = 0
    if key.sparse is not None:
        from . import bwd_sparse

        lists = bwd_sparse.transposed_lists(call)
        min_rows = bwd_sparse.padded_rows(call)
    if not tma_compatible(dout):  # autograd may hand over expanded or odd-strided gradients
        dout = dout.contiguous()
    counter, split_ws, split_cnt = persistent_buffers(persistent_shapes(call, plan), q.device)
    dq_acc_rows, dq_acc = dq_buffer(dq_buffer_shape(call), call.is_varlen, q.device)
    lse2, dpsum, _ = row_statistics(call, dout, out, lse, min_rows, tile_m, zero_dq=dq_acc_rows)
    sem = counter  # the persistent kernel's tile counter (bwd_kernel._persistent_roles)
    if deterministic:
        sem = torch.zeros((call.batch, call.num_heads, math.ceil(plan.max_q / tile_m)), dtype=torch.int32,
                          device=q.device)
    # (cu_seqlens on both sides or neither here: runs_per_sequence took the others)
    seqused, cu_q, cu_k = (t.to(torch.int32).contiguous() if t is not None else None
                           for t in (call.seqused_k, call.cu_seqlens_q, call.cu_seqlens_k))

    q, k, v, dout, dk, dv = map(_tma_view, (q, k, v, dout, dk, dv))
    dq_out = None
    if key.fused_dq:  # (dq is ours: contiguous, 16-byte aligned)
        assert writes_dq_directly(dq) and dq.data_ptr() % 16 == 0
        dq_out = _tma_view(dq)
    aux = [None] * MAX_AUX
    if call.mods is not None:
        from torch_fa4.kernels.common import mod_lowering

        aux = mod_lowering.kernel_aux_tensors(call.aux_tensors, MAX_AUX)
    fn(
        q, k, v, dout, lse2, dpsum, dq_acc, dk, dv, dq_out,
        cu_q, cu_k, seqused, sem, split_ws, split_cnt, *lists,
        *main_scalars(call, plan), *aux, *grads,
    )
    # the kernel accumulates dS K; the softmax scale joins the conversion to dq's dtype (no_grad:
    # out= refuses autograd, and these buffers are results, never differentiated through)
    if key.fused_dq:
        return
    if bwd_dq_convert.takes(dq_acc_rows, dq):
        bwd_dq_convert.scaled_narrow(dq_acc_rows, dq, call.scale)
    else:
        with torch.no_grad():
            torch.mul(dq_acc_rows.view(dq.shape), call.scale, out=dq)


def main_scalars(call: "AttentionCall", plan) -> tuple:
    """The main kernel's scalar arguments: scale, scale * log2 e, softcap (1.0: none), the window,
    the longest key sequence, the CTA order (groups of 1 pair, the last `cta_tail` pairs one
    group: bwd_kernel._cta_coords), the persistent grid and the split tail's plan."""
    right, left = window(call)
    return (float(call.scale), float(call.scale * math.log2(math.e)), float(call.softcap or 1.0),
            int(left or 0), int(right or 0), int(plan.max_k), 1, plan.cta_tail, plan.ctas,
            plan.split_items, plan.ways)


def _backward_per_sequence(call: "AttentionCall", dout, out, lse, dq, dk, dv, deterministic, tuning):
    """Varlen backward as one dense call per sequence, on views (no copies of q, k, v, grads)."""
    from torch_fa4.call import AttentionCall

    cu_q, cu_k = (cu.tolist() if cu is not None else None for cu in (call.cu_seqlens_q, call.cu_seqlens_k))

    def rows(t, cu, b):  # batch b of a packed (T, ...) or dense (B, S, ...) tensor, as (1, S, ...)
        return t[cu[b] : cu[b + 1]].unsqueeze(0) if cu is not None else t[b : b + 1]

    for b in range(call.batch):
        q_b, dout_b, out_b, dq_b = (rows(t, cu_q, b) for t in (call.q, dout, out, dq))
        k_b, v_b, dk_b, dv_b = (rows(t, cu_k, b) for t in (call.k, call.v, dk, dv))
        lse_b = lse[:, cu_q[b] : cu_q[b + 1]].unsqueeze(0) if cu_q is not None else lse[b : b + 1]
        if q_b.shape[1] == 0 or k_b.shape[1] == 0:  # nothing attends: all gradients are zero
            for g in (dq_b, dk_b, dv_b):
                g.zero_()
            continue
        used = call.seqused_k[b : b + 1] if call.seqused_k is not None else None
        sub = AttentionCall(
            q=q_b, k=k_b, v=v_b, scale=call.scale, causal=call.causal,
            window_left=call.window_left, window_right=call.window_right, softcap=call.softcap,
            seqused_k=used, max_seqlen_q=q_b.shape[1], max_seqlen_k=k_b.shape[1],
        )
        backward(sub, dout_b, out_b, lse_b, dq_b, dk_b, dv_b, deterministic, tuning)
