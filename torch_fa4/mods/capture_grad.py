"""Gradients of tensors captured by a score_mod: learnable ALiBi slopes, bias tables, per-head biases.

What is computed. A score_mod reads captured tensors through `load` nodes at computed indices
(`aux[idx(b, h, q, kv)]`). With `s_in` the score the mod receives (scale, then softcap, applied),
`s = score_mod(s_in, b, h, q, kv)` its output, and `dS = dL/ds = P * (dP - delta)` (P the softmax
of the masked `s`, recomputed from the saved LSE; `dP = dO V^T`; `delta = rowsum(dO * O)`), the
gradient of a captured tensor is

    grad_aux[idx(e)] += dS(e) * d score_mod / d (value loaded at e)      for every score element e

summed over every load of that tensor. The scale and the softcap act before the mod, so they are
not on this chain (they are on dQ's and dK's). Masked elements have P = 0 and add nothing.
The derivatives come from `derivative.load_derivatives` (forward mode over the ModGraph, one seed
per load: the graph, not the user's callable, is differentiated, exactly as the kernels apply
`score_derivative`), so the same graph serves any backend that wants a fused version.

Design. The gradient is exact and backend-independent: dQ, dK and dV come from the backend's own
backward as before (captured tensors are constants for them), and the captured gradients from the
`torch_fa4::bwd_captured` op, whose body is this module: a chunked recomputation in PyTorch over
(query chunk, key chunk) blocks of every (batch, head), memory bounded by the chunk size, key
chunks outside the causal / window band skipped. Half-precision CUDA inputs form S and dP by
`torch.bmm(..., out_dtype=float32)`: the kernels' own tensor-core arithmetic (half operands, fp32
sums). Every other case computes in the reference's dtype (fp32, or fp64 for fp64 inputs). The sums
over score elements collapse the dimensions a load's index does not depend on first (`slopes[h]`
sums whole rows before touching memory), and then add into an fp32 (fp64) buffer with
`index_add_`, or `index_put_(accumulate=True)` in deterministic mode (sorted, same order on every
run). A fused path inside a kernel family is optional: it may take over where it is faster, this
module stays the definition and the path for every family that has none. The sm90 backward has
one (`fused_backward`: its kernel adds dS times each load's derivative into fp32 buffers,
kernels/sm90/bwd_scores.CapturedGrads), taken by the `torch_fa4::bwd_and_captured` op where its
module's `captured_grad_reason` allows, and by `torch_fa4::bwd_captured` too (dQ, dK, dV then
dropped: one kernel run costs far less than the recomputation here).

What gets a gradient: floating tensors captured by the score_mod. Tensors captured by a mask_mod
get none (a mask's output is a boolean: its derivative is 0 wherever it exists, and autograd
returns None, as for torch's comparisons); integer tensors cannot require grad; a captured tensor
used as an index is an integer tensor. A floating tensor that the score_mod reads only through
comparisons or indices gets zeros.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from torch_fa4.call import AttentionCall
from torch_fa4.mods import lower_torch

# Elements of one score block (batch × heads × rows × keys): a handful of fp32 / int64 temporaries of
# this size live at once (2**23 elements: 32 MiB each in fp32).
_CHUNK_ELEMENTS = 1 << 23
_KV_CHUNK = 1024
_HALF = (torch.float16, torch.bfloat16)


def gradient_slots(call_mods, needs_grad: Sequence[bool]) -> list[int]:
    """The captured-tensor slots that get a gradient, given which inputs autograd wants one for:
    the score_mod's (the first `num_score_aux`); the mask_mod's never have one."""
    n = call_mods.num_score_aux if call_mods is not None else 0
    return [i for i, wanted in enumerate(needs_grad) if wanted and i < n]


def captured_grads(call: AttentionCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   slots: Sequence[int], deterministic: bool) -> list[torch.Tensor]:
    """The gradients of the captured tensors at `slots` (score_mod slots), in that order, each shaped
    and typed like its tensor."""
    aux = call.aux_tensors
    n_score = call.mods.num_score_aux if call.mods is not None else 0
    for slot in slots:
        if not 0 <= slot < n_score:
            raise ValueError(f"torch_fa4: captured tensor {slot} is not read by the score_mod: it has no "
                             "gradient")
        if not aux[slot].is_floating_point():
            raise TypeError(f"torch_fa4: captured tensor {slot} has dtype {aux[slot].dtype}: only floating "
                            "tensors have gradients")
    from torch_fa4 import dispatch

    dispatch.host_checks(call)  # indices in range, as before any backend runs
    acc_dtype = {slot: torch.float64 if torch.float64 in (aux[slot].dtype, call.lse_dtype) else torch.float32
                 for slot in slots}
    accs = {slot: torch.zeros(aux[slot].numel(), dtype=acc_dtype[slot], device=aux[slot].device)
            for slot in slots}
    derivs = call.mods.load_derivatives if slots else None
    loads = [d for d in derivs.loads if d.slot in accs] if derivs is not None else []
    if loads and call.q.numel() and call.k.numel():
        for seg in _segments(call, dout, out, lse):
            _accumulate_segment(call, derivs.graph, loads, seg, accs, deterministic)
    return [accs[slot].view(aux[slot].shape).to(aux[slot].dtype) for slot in slots]


def fused_backward(call: AttentionCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   slots: Sequence[int], deterministic: bool):
    """(dq, dk, dv, [gradients of the captured tensors at `slots`]) from one run of the backend's
    backward kernel, where its family accumulates captured gradients itself (its module's
    `captured_grad_reason` is None for the call); else None (then `captured_grads` computes them)."""
    from torch_fa4 import dispatch

    slots = tuple(slots)
    kernel = dispatch.kernel_for(call, "backward", deterministic=deterministic)
    reason_for = getattr(kernel, "captured_grad_reason", None)
    if reason_for is None or reason_for(call, slots, deterministic) is not None:
        return None
    dispatch.host_checks(call)
    aux = call.aux_tensors
    buffers = [torch.zeros(aux[s].shape if aux[s].dim() else (1,), dtype=torch.float32, device=aux[s].device)
               for s in slots]
    dq = torch.empty(call.q.shape, dtype=call.q.dtype, device=call.q.device)
    dk = torch.empty(call.k.shape, dtype=call.k.dtype, device=call.k.device)
    dv = torch.empty(call.v.shape, dtype=call.v.dtype, device=call.v.device)
    kernel.backward(call, dout, out, lse, dq, dk, dv, deterministic, capture=(slots, buffers))
    return dq, dk, dv, [b.view(aux[s].shape).to(aux[s].dtype) for s, b in zip(slots, buffers)]


def backward_and_captured(call: AttentionCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                          slots: Sequence[int], deterministic: bool):
    """(dq, dk, dv, captured gradients): the fused kernel where the family has one for the call,
    else the backend's backward and `captured_grads`."""
    found = fused_backward(call, dout, out, lse, slots, deterministic)
    if found is not None:
        return found
    from torch_fa4 import dispatch

    dq, dk, dv = dispatch.backward(call, dout, out, lse, deterministic)
    return dq, dk, dv, captured_grads(call, dout, out, lse, slots, deterministic)


def _segments(call: AttentionCall, dout, out, lse):
    """(b, q, k, v, dout, out, lse) per dense piece of the call, in (B, H, S, D) views of the given
    dtype; b is the (B, 1, 1, 1) batch index a mod sees. Varlen and seqused_k go one sequence at a time."""
    def bhsd(x):
        return x.transpose(-3, -2)

    dev = call.q.device
    if not call.is_varlen and call.seqused_k is None:
        b = torch.arange(call.q.shape[0], device=dev).view(-1, 1, 1, 1)
        yield b, *(bhsd(x) for x in (call.q, call.k, call.v, dout, out)), lse
        return
    cu_q = call.cu_seqlens_q.tolist() if call.is_varlen else None
    cu_k = call.cu_seqlens_k.tolist() if call.cu_seqlens_k is not None else None
    used = call.seqused_k.tolist() if call.seqused_k is not None else None
    for bi in range(call.batch):
        rows = slice(cu_q[bi], cu_q[bi + 1]) if cu_q is not None else bi
        keys = slice(cu_k[bi], cu_k[bi + 1]) if cu_k is not None else bi
        k, v = call.k[keys].unsqueeze(0), call.v[keys].unsqueeze(0)
        if used is not None:
            k, v = k[:, : used[bi]], v[:, : used[bi]]
        seg_lse = lse[:, rows] if cu_q is not None else lse[rows]  # (H, total_q) varlen, (B, H, Sq) dense
        b = torch.full((1, 1, 1, 1), bi, device=dev, dtype=torch.int64)
        q, do, o = (bhsd(x[rows].unsqueeze(0)) for x in (call.q, dout, out))
        yield b, q, bhsd(k), bhsd(v), do, o, seg_lse.unsqueeze(0)


def _accumulate_segment(call: AttentionCall, graph, loads, seg, accs, deterministic: bool) -> None:
    b_idx, q, k, v, dout, out, lse = seg
    B, H, sq, _ = q.shape
    Hkv, sk = k.shape[1], k.shape[2]
    if sq == 0 or sk == 0:
        return
    cdt = call.lse_dtype  # the reference's compute dtype
    lse = torch.where(lse == -math.inf, 0.0, lse.to(cdt))  # rows with no visible key: every P is 0 below
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1)  # (B, H, Sq)
    matmul = _matmul_for(q)
    dev = q.device
    h_idx = torch.arange(H, device=dev).view(1, -1, 1, 1)
    kv_chunk = min(sk, _KV_CHUNK)
    q_chunk = max(1, min(sq, _CHUNK_ELEMENTS // (B * H * kv_chunk)))
    aux = call.score_aux
    for q0 in range(0, sq, q_chunk):
        q1 = min(sq, q0 + q_chunk)
        lo, hi = _key_range(call, sq, sk, q0, q1)
        q_idx = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
        qc, doc = q[:, :, q0:q1], dout[:, :, q0:q1]
        lse_c, delta_c = lse[:, :, q0:q1, None], delta[:, :, q0:q1, None]
        for k1 in range(hi, lo, -kv_chunk):  # from the band's right end: no chunk sticks out past it
            k0 = max(lo, k1 - kv_chunk)
            kv_idx = torch.arange(k0, k1, device=dev).view(1, 1, 1, -1)
            kc, vc = _expand_heads(k[:, :, k0:k1], H), _expand_heads(v[:, :, k0:k1], H)
            s = matmul(qc, kc).mul_(call.scale)
            if call.softcap > 0:
                s = s.div_(call.softcap).tanh_().mul_(call.softcap)
            env = lower_torch.evaluate_nodes(graph, {"score": s, "b": b_idx, "h": h_idx, "q_idx": q_idx,
                                                     "kv_idx": kv_idx}, aux)
            # P = exp(masked score_mod output - LSE), written in place into fresh tensors only (a
            # node's value may be shared with others: the input score, a derivative)
            p = torch.broadcast_to(torch.as_tensor(env[graph.output], device=dev).to(cdt), s.shape) - lse_c
            inside = _inside_band(call, sq, sk, q0, q1, k0, k1)
            visible = _visibility(call, b_idx, h_idx, q_idx, kv_idx, sq, sk, band=not inside)
            if visible is not None:
                p.masked_fill_(~visible, -math.inf)
            p.exp_()
            ds = matmul(doc, vc).sub_(delta_c).mul_(p)  # dL / d(score_mod's output)
            del p
            for load in loads:
                index = [env[i] for i in load.index]
                _add_at(accs[load.slot], call.aux_tensors[load.slot].shape, ds, env[load.derivative], index,
                        deterministic)


def _matmul_for(like: torch.Tensor):
    """x @ y^T in the compute dtype, for (B, H, n, D) x and y."""
    if like.device.type == "cuda" and like.dtype in _HALF and hasattr(torch.ops.aten.bmm, "dtype"):
        def half_to_fp32(x, y):  # half operands, fp32 sums: the kernels' tensor-core arithmetic
            B, H = x.shape[:2]
            r = torch.bmm(x.reshape(B * H, *x.shape[2:]), y.reshape(B * H, *y.shape[2:]).transpose(1, 2),
                          out_dtype=torch.float32)
            return r.view(B, H, x.shape[2], y.shape[2])
        return half_to_fp32
    # (half inputs on a torch without bmm's out_dtype: fp32 operands hold them exactly)
    cdt = torch.float64 if like.dtype == torch.float64 else torch.float32
    return lambda x, y: torch.matmul(x.to(cdt), y.to(cdt).transpose(-1, -2))


def _expand_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    group = num_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _key_range(call: AttentionCall, sq: int, sk: int, q0: int, q1: int) -> tuple[int, int]:
    """Keys [lo, hi) that rows [q0, q1) may see under the causal / window band (bottom-right aligned)."""
    offset = sk - sq
    lo, hi = 0, sk
    right = 0 if call.causal else call.window_right
    if call.causal or call.window_right >= 0:
        hi = max(0, min(sk, q1 - 1 + offset + right + 1))
    if call.window_left >= 0:
        lo = max(0, min(sk, q0 + offset - call.window_left))
    return lo, max(lo, hi)


def _inside_band(call: AttentionCall, sq: int, sk: int, q0: int, q1: int, k0: int, k1: int) -> bool:
    """Whether every (row, key) of the block lies inside the causal / window band."""
    offset = sk - sq
    right = 0 if call.causal else call.window_right
    if (call.causal or call.window_right >= 0) and k1 - 1 > q0 + offset + right:
        return False
    return not (call.window_left >= 0 and k0 < q1 - 1 + offset - call.window_left)


def _visibility(call: AttentionCall, b, h, q_idx, kv_idx, sq: int, sk: int, band: bool = True
                ) -> Optional[torch.Tensor]:
    """docs/INTERNALS.md's masks (keys past seqused_k are already cut off by the segment); `band`:
    False where the block lies inside the causal / window band (only the mask_mod can hide keys)."""
    vis = None
    diag = q_idx + (sk - sq)
    right = 0 if call.causal else call.window_right
    if band and (call.causal or call.window_right >= 0):
        vis = kv_idx <= diag + right
    if band and call.window_left >= 0:
        left = kv_idx >= diag - call.window_left
        vis = left if vis is None else vis & left
    mods = call.mods
    if mods is not None and mods.mask_graph is not None:
        m = mods.mask_torch(b, h, q_idx, kv_idx, call.mask_aux).bool()
        vis = m if vis is None else vis & m
    return vis


def _add_at(acc: torch.Tensor, shape, ds: torch.Tensor, derivative, index, deterministic: bool) -> None:
    """acc (the flat gradient of a tensor of `shape`) [index] += ds * derivative, `index` being one
    value per dimension (a broadcastable integer tensor or a Python int; negative counts from the
    end) and `derivative` a broadcastable tensor or a number."""
    linear, stride = 0, 1
    for d in range(len(shape) - 1, -1, -1):
        i, n = index[d], shape[d]
        if isinstance(i, torch.Tensor):
            i = i.long()
            i = torch.where(i < 0, i + n, i)
        elif i < 0:
            i += n
        linear = linear + i * stride
        stride *= n
    rank = ds.dim()
    linear_shape = _aligned(linear, rank)
    derivative_shape = _aligned(derivative, rank)
    # Sum over the dimensions the index does not vary along before touching memory, and over those
    # the derivative does not vary along either before multiplying by it.
    fold = [d for d in range(rank) if linear_shape[d] == 1 and ds.shape[d] != 1]
    first = [d for d in fold if derivative_shape[d] == 1]
    grad = ds.sum(first, keepdim=True) if first else ds
    if isinstance(derivative, torch.Tensor) or derivative != 1.0:
        grad = grad * derivative
    rest = [d for d in fold if d not in first]
    if rest:
        grad = grad.sum(rest, keepdim=True)
    if not isinstance(linear, torch.Tensor):
        acc[linear] += grad.sum().to(acc.dtype)
        return
    linear, grad = torch.broadcast_tensors(linear.reshape(linear_shape), grad)
    linear, grad = linear.reshape(-1), grad.reshape(-1).to(acc.dtype)
    if deterministic:
        acc.index_put_((linear,), grad, accumulate=True)
    else:
        acc.index_add_(0, linear, grad)


def _aligned(x, rank: int) -> tuple[int, ...]:
    """The shape `x` broadcasts with at `rank` dimensions (a number: all ones)."""
    if not isinstance(x, torch.Tensor):
        return (1,) * rank
    return (1,) * (rank - x.dim()) + tuple(x.shape)
