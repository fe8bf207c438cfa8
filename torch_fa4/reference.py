"""Exact attention in plain PyTorch: the CPU path, the fallback on GPUs, and the test oracle.

Memory stays O(S·D): queries and keys are walked in chunks and the softmax is computed online
(running max and row sum, as the kernels do), so no S×S matrix is ever materialised for long
sequences. Arithmetic is fp32 for half-precision and fp32 inputs and fp64 for fp64 inputs.

Every feature of the public API is implemented here with the semantics of docs/INTERNALS.md:
scale, softcap, score_mod, causal (bottom-right aligned), sliding window, mask_mod, GQA/MQA and
variable-length batches (cu_seqlens_q/k, seqused_k) and paged KV caches (any page size: each
sequence's used pages are gathered into contiguous keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from torch_fa4.call import AttentionCall, empty_laid_out_like

# Elements of one score chunk (rows × keys × batch × heads). 2**24 fp32 scores = 64 MiB.
_CHUNK_ELEMENTS = 1 << 24


@dataclass
class _Segment:
    """One dense piece of work: a batch (or one varlen sequence) in (B, H, S, D) layout."""

    q: torch.Tensor  # (B, Hq, Sq, D), compute dtype
    k: torch.Tensor  # (B, Hkv, Sk, D)
    v: torch.Tensor  # (B, Hkv, Sk, Dv)
    batch_index: torch.Tensor  # (B, 1, 1, 1) int64: the `b` a mod sees


def _segments(call: AttentionCall):
    """Yield (segment, q_slice) pairs covering the call; q_slice locates its rows in the output."""
    cdt = call.lse_dtype  # the compute dtype as well
    dev = call.q.device

    def to_bhsd(x):
        return x.transpose(-3, -2).to(cdt)  # (..., S, H, D) -> (..., H, S, D)

    if not call.is_varlen and call.seqused_k is None and call.page_table is None:
        b = torch.arange(call.q.shape[0], device=dev).view(-1, 1, 1, 1)
        yield _Segment(to_bhsd(call.q), to_bhsd(call.k), to_bhsd(call.v), b), None
        return

    cu_q = call.cu_seqlens_q.tolist() if call.is_varlen else None
    cu_k = call.cu_seqlens_k.tolist() if call.cu_seqlens_k is not None else None
    used = call.seqused_k.tolist() if call.seqused_k is not None else None
    for bi in range(call.batch):
        rows = slice(cu_q[bi], cu_q[bi + 1]) if cu_q is not None else bi
        keys = slice(cu_k[bi], cu_k[bi + 1]) if cu_k is not None else bi
        if call.page_table is not None:
            n = used[bi] if used is not None else call.kv_len
            k, v = (_gathered_pages(x, call.page_table[bi], n).unsqueeze(0) for x in (call.k, call.v))
        else:
            k, v = call.k[keys].unsqueeze(0), call.v[keys].unsqueeze(0)
            if used is not None:
                k, v = k[:, : used[bi]], v[:, : used[bi]]
        q = call.q[rows].unsqueeze(0)
        b = torch.full((1, 1, 1, 1), bi, device=dev, dtype=torch.int64)
        yield _Segment(to_bhsd(q), to_bhsd(k), to_bhsd(v), b), rows


def _gathered_pages(cache: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    """The first n keys of a sequence whose pages are `pages` (its page-table row): (n, Hkv, D).
    Only the ceil(n / page_size) pages it uses are read."""
    page_size = cache.shape[1]
    used = pages[: -(-n // page_size)].long()
    return cache[used].flatten(0, 1)[:n]


def _expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    group = num_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _chunk_sizes(batch: int, heads: int, sq: int, sk: int) -> tuple[int, int]:
    per_row = max(1, batch * heads)
    kv_chunk = min(max(sk, 1), 1024)
    q_chunk = max(1, min(max(sq, 1), _CHUNK_ELEMENTS // (per_row * kv_chunk)))
    return q_chunk, kv_chunk


class _ScoreBlock:
    """Scores and visibility of one (query chunk, key chunk) pair, before the softmax."""

    def __init__(self, call: AttentionCall, seg: _Segment, q0: int, q1: int, k0: int, k1: int):
        self.call, self.seg = call, seg
        dev = seg.q.device
        self.q_idx = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
        self.kv_idx = torch.arange(k0, k1, device=dev).view(1, 1, 1, -1)
        self.h_idx = torch.arange(seg.q.shape[1], device=dev).view(1, -1, 1, 1)
        self.visible = self._visibility(seg.q.shape[2], seg.k.shape[2])

    def raw_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.matmul(q, k.transpose(-1, -2)) * self.call.scale

    def modded_scores(self, s: torch.Tensor) -> torch.Tensor:
        """softcap then score_mod."""
        if self.call.softcap > 0:
            s = self.call.softcap * torch.tanh(s / self.call.softcap)
        return self._score_mod(s)

    def _score_mod(self, s: torch.Tensor) -> torch.Tensor:
        mods = self.call.mods
        if mods is None:
            return s
        return mods.score_torch(s, self.seg.batch_index, self.h_idx, self.q_idx, self.kv_idx,
                                self.call.score_aux)

    def scores_and_vjp(self, raw: torch.Tensor):
        """modded_scores(raw) and a function mapping dL/ds to dL/draw (elementwise chain rule).

        Op implementations run below the autograd dispatch key, so the derivative is computed
        without autograd: softcap's analytically, score_mod's by torch.func (functorch's own
        transform, which works there) from the traced graph.
        """
        s, cap_grad = raw, None
        if self.call.softcap > 0:
            t = torch.tanh(raw / self.call.softcap)
            s, cap_grad = self.call.softcap * t, 1 - t * t
        mods = self.call.mods
        if mods is not None and mods.score_graph is not None:
            s, mod_vjp = torch.func.vjp(self._score_mod, s)
        else:
            mod_vjp = None

        def vjp(ds):
            if mod_vjp is not None:
                (ds,) = mod_vjp(ds)
            return ds if cap_grad is None else ds * cap_grad

        return s, vjp

    def _visibility(self, sq: int, sk: int) -> Optional[torch.Tensor]:
        call = self.call
        vis = None
        diag = self.q_idx + (sk - sq)  # bottom-right alignment
        right = 0 if call.causal else call.window_right
        if call.causal or call.window_right >= 0:
            vis = self.kv_idx <= diag + right
        if call.window_left >= 0:
            left = self.kv_idx >= diag - call.window_left
            vis = left if vis is None else vis & left
        mods = call.mods
        if mods is not None and mods.mask_graph is not None:
            m = mods.mask_torch(self.seg.batch_index, self.h_idx, self.q_idx, self.kv_idx, call.mask_aux).bool()
            vis = m if vis is None else vis & m
        return vis

    def masked(self, s: torch.Tensor) -> torch.Tensor:
        return s if self.visible is None else s.masked_fill(~self.visible, -math.inf)


def forward(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (out, lse) with the shapes and dtypes of the torch_fa4::fwd op."""
    out = empty_laid_out_like(call.q, call.out_shape())
    lse = torch.empty(call.lse_shape(), dtype=call.lse_dtype, device=call.q.device)
    for seg, rows in _segments(call):
        o, l = _forward_segment(call, seg)  # (B, H, Sq, Dv), (B, H, Sq)
        o = o.transpose(1, 2).to(out.dtype)
        if rows is None:
            out.copy_(o)
            lse.copy_(l)
        else:  # a varlen slice of total_q (lse (H, total_q)) or a dense batch index
            out[rows] = o[0]
            lse[(slice(None), rows) if isinstance(rows, slice) else rows] = l[0]
    return out, lse


def _forward_segment(call: AttentionCall, seg: _Segment):
    B, H, sq, _ = seg.q.shape
    sk, dv = seg.k.shape[2], seg.v.shape[3]
    k, v = _expand_kv_heads(seg.k, H), _expand_kv_heads(seg.v, H)
    out = seg.q.new_zeros(B, H, sq, dv)
    lse = seg.q.new_full((B, H, sq), -math.inf)
    q_chunk, kv_chunk = _chunk_sizes(B, H, sq, sk)
    for q0 in range(0, sq, q_chunk):
        q1 = min(sq, q0 + q_chunk)
        q = seg.q[:, :, q0:q1]
        row_max = q.new_full((B, H, q1 - q0), -math.inf)
        row_sum = q.new_zeros(B, H, q1 - q0)
        acc = q.new_zeros(B, H, q1 - q0, dv)
        for k0 in range(0, sk, kv_chunk):
            k1 = min(sk, k0 + kv_chunk)
            blk = _ScoreBlock(call, seg, q0, q1, k0, k1)
            s = blk.masked(blk.modded_scores(blk.raw_scores(q, k[:, :, k0:k1])))
            new_max = torch.maximum(row_max, s.amax(-1))
            safe_max = torch.where(new_max == -math.inf, 0.0, new_max)  # all-masked rows stay 0
            p = torch.exp(s - safe_max.unsqueeze(-1))
            correction = torch.exp(row_max - safe_max)
            row_sum = row_sum * correction + p.sum(-1)
            acc = acc * correction.unsqueeze(-1) + torch.matmul(p, v[:, :, k0:k1])
            row_max = new_max
        alive = row_sum > 0
        out[:, :, q0:q1] = torch.where(alive.unsqueeze(-1), acc / row_sum.clamp_min(1e-30).unsqueeze(-1), 0.0)
        safe_max = torch.where(alive, row_max, 0.0)
        lse[:, :, q0:q1] = torch.where(alive, safe_max + torch.log(row_sum.clamp_min(1e-30)), -math.inf)
    return out, lse


def backward(call: AttentionCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """Return (dq, dk, dv) for the torch_fa4::bwd op, recomputing scores chunk by chunk."""
    dq, dk, dv = (torch.zeros_like(x, memory_format=torch.contiguous_format)
                  for x in (call.q, call.k, call.v))
    grad_call = AttentionCall(**{**call.__dict__, "q": dout})  # same segmentation, walks dout
    out_call = AttentionCall(**{**call.__dict__, "q": out})
    segs = zip(_segments(call), _segments(grad_call), _segments(out_call))
    cu_k = call.cu_seqlens_k.tolist() if call.cu_seqlens_k is not None else None
    for bi, ((seg, rows), (gseg, _), (oseg, _)) in enumerate(segs):
        if rows is None:
            seg_lse = lse
        else:  # varlen: lse is (H, total_q)
            seg_lse = (lse[:, rows] if isinstance(rows, slice) else lse[rows]).unsqueeze(0)
        grads = _backward_segment(call, seg, gseg.q, oseg.q, seg_lse.to(seg.q.dtype))
        gq, gk, gv = (g.transpose(1, 2) for g in grads)
        if rows is None:
            dq.copy_(gq)
            dk.copy_(gk)
            dv.copy_(gv)
            continue
        dq[rows] = gq[0].to(dq.dtype)  # rows: a varlen slice or a dense batch index
        n = gk.shape[1]  # the keys used (seqused_k)
        keys = slice(cu_k[bi], cu_k[bi] + n) if cu_k is not None else (bi, slice(0, n))
        dk[keys] += gk[0].to(dk.dtype)
        dv[keys] += gv[0].to(dv.dtype)
    return dq, dk, dv


def _backward_segment(call: AttentionCall, seg: _Segment, dout, out, lse):
    B, H, sq, _ = seg.q.shape
    Hkv, sk = seg.k.shape[1], seg.k.shape[2]
    k, v = _expand_kv_heads(seg.k, H), _expand_kv_heads(seg.v, H)
    dead = lse == -math.inf
    lse = torch.where(dead, 0.0, lse)  # dead rows have every p = 0 below
    delta = (dout * out).sum(-1)  # (B, H, Sq): the dO·O row sum
    dq, dk, dv = map(torch.zeros_like, (seg.q, k, v))
    q_chunk, kv_chunk = _chunk_sizes(B, H, sq, sk)
    for q0 in range(0, sq, q_chunk):
        q1 = min(sq, q0 + q_chunk)
        q, do = seg.q[:, :, q0:q1], dout[:, :, q0:q1]
        for k0 in range(0, sk, kv_chunk):
            k1 = min(sk, k0 + kv_chunk)
            blk = _ScoreBlock(call, seg, q0, q1, k0, k1)
            raw = blk.raw_scores(q, k[:, :, k0:k1])
            s, score_vjp = blk.scores_and_vjp(raw)
            p = torch.exp(blk.masked(s) - lse[:, :, q0:q1].unsqueeze(-1))
            dv[:, :, k0:k1] += torch.matmul(p.transpose(-1, -2), do)
            dp = torch.matmul(do, v[:, :, k0:k1].transpose(-1, -2))
            # chain rule through score_mod and softcap, elementwise
            ds = score_vjp(p * (dp - delta[:, :, q0:q1].unsqueeze(-1))) * call.scale
            dq[:, :, q0:q1] += torch.matmul(ds, k[:, :, k0:k1])
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), q)
    if H != Hkv:  # GQA: sum the gradients of the query heads that share a KV head
        # explicit sizes: a -1 cannot be inferred when the segment has no keys
        dk = dk.view(B, Hkv, H // Hkv, sk, dk.shape[-1]).sum(2)
        dv = dv.view(B, Hkv, H // Hkv, sk, dv.shape[-1]).sum(2)
    return dq, dk, dv
