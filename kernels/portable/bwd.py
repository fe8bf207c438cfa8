"""Portable backward entry point (every NVIDIA GPU since Ampere: warp-level MMA, ldmatrix, cp.async).

`backward(call, dout, out, lse, dq, dk, dv, deterministic)` fills dq, dk, dv in place:

1. row statistics: lse2 = lse * log2 e (a row that sees no key, lse = -inf, becomes +inf so that
   its P is 0) and dpsum = rowsum(dO * O) in fp32, both (B, Hq, Sq) (varlen: one batch of packed
   rows), by the sm90 backward's row-statistics kernel (no Hopper instructions where compiled for
   sm_8x), which zeroes the fp32 dQ buffer on the way; torch for what it refuses;
2. the main kernel (bwd_kernel.py, variant from bwd_config.py, compiled by bwd_compile.py): one
   CTA per key tile and KV head, writing dK, dV and adding dS K into an fp32 dQ buffer (atomics,
   or in key-tile order behind per-tile counters when `deterministic`);
3. dq = dQ buffer * softmax scale, narrowed to dq's dtype.

Takes: fp16/bf16; head dims 64/96/128/192/256 (Dv may differ, same set; 256 where a block may
have more than 99 KB of shared memory: sm_80, sm_87, Hopper, sm_100); causal (bottom-right),
sliding windows, softcap; GQA/MQA (each CTA walks every query head of its KV group, so dK/dV are
reduced in registers, deterministic by construction); varlen (cu_seqlens on both sides) and
seqused_k; deterministic dQ; score_mod (its traced derivative joins dS) and mask_mod, inlined per
element; block masks (which come with their mask_mod, deciding every element): their empty (key tile,
query tile) steps are skipped (bwd_sparse.py; deterministic and varlen calls walk densely).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Optional

import torch

from torch_fa4.kernels.host import bwd_operands
from torch_fa4.kernels.portable import bwd_sparse
from torch_fa4.kernels.portable.bwd_config import SUPPORTED_HEAD_DIMS, make_variant, most_stages, smem_limit

if TYPE_CHECKING:
    from torch_fa4.call import AttentionCall

LOG2E = math.log2(math.e)
MAX_AUX = 8  # captured mod tensors the kernel takes (kernels/common/mod_lowering.MAX_AUX)
UNBOUNDED = 1 << 30  # a window side without a bound (bwd_kernel.UNBOUNDED)
MAX_GRID_YZ = 65535

__all__ = ["SUPPORTED_HEAD_DIMS", "backward", "unsupported_reason", "variant", "variant_of"]


def unsupported_reason(call: "AttentionCall") -> Optional[str]:
    q = call.q
    if (reason := bwd_operands.operand_reason(call, "portable", SUPPORTED_HEAD_DIMS)) is not None:
        return reason
    if call.mods is not None:
        if len(call.aux_tensors) > MAX_AUX:
            return f"mods capture {len(call.aux_tensors)} tensors (portable backward: at most {MAX_AUX})"
        if any(t.requires_grad for t in call.score_aux):
            return "gradients for tensors captured by score_mod are not supported"
    if call.block_mask and (call.mods is None or call.mods.mask_graph is None):
        return "a block mask without its mask_mod"
    if (call.cu_seqlens_q is None) != (call.cu_seqlens_k is None):
        return "portable backward takes cu_seqlens on both sides or neither"
    if call.num_heads_kv > MAX_GRID_YZ or call.batch > MAX_GRID_YZ:
        return "batch or KV heads beyond the grid's y/z limit (65535)"
    if q.is_cuda:
        need = make_variant(q.dtype, call.head_dim, call.head_dim_v).smem_bytes()
        have = smem_limit(torch.cuda.get_device_capability(q.device))
        if need > have:
            return (f"portable backward for D={call.head_dim}, Dv={call.head_dim_v} needs {need} bytes of "
                    f"shared memory per block; this GPU has {have}")
    return None


def _window(call: "AttentionCall") -> tuple[bool, int, int]:
    """(bounded, left, right) key limits relative to the diagonal: key j of row i is visible when
    i + shift - left <= j <= i + shift + right (shift = Sk - Sq)."""
    left = call.window_left if call.window_left >= 0 else UNBOUNDED
    right = call.window_right if call.window_right >= 0 else UNBOUNDED
    if call.causal:
        right = min(right, 0)
    bounded = call.causal or call.window_left >= 0 or call.window_right >= 0
    return bounded, left, right


def variant_of(call: "AttentionCall", deterministic: bool, stages: Optional[int] = None,
               large_tiles: Optional[bool] = None, tuning: Optional[dict] = None):
    """The kernel variant for `call`: the large tiles and two Q / dO buffers where the GPU's shared
    memory holds them, dQ's paired atomics from sm_90 on (`stages`, `large_tiles`: given choices
    instead; `tuning`: BwdVariant fields to replace, the benchmarks' A/B)."""
    bounded, _, _ = _window(call)
    capability = torch.cuda.get_device_capability(call.q.device) if call.q.is_cuda else (8, 0)
    limit = smem_limit(capability) if call.q.is_cuda else 0

    def make(large):
        v = make_variant(call.q.dtype, call.head_dim, call.head_dim_v, bounded=bounded,
                         softcap=bool(call.softcap), deterministic=deterministic, varlen=call.is_varlen,
                         seqused_k=call.seqused_k is not None,
                         mods_key=call.mods.key if call.mods is not None else "", large_tiles=large,
                         dq_pair_adds=capability[0] >= 9)
        return dataclasses.replace(v, sparse=sparse, **(tuning or {}))

    sparse = bool(call.block_mask) and bwd_sparse.walk_reason(call, deterministic) is None

    v = make(large_tiles)
    if large_tiles is None:
        v = make(True)
        if v.smem_bytes() > limit:
            v = make(False)
    if stages is not None:
        return dataclasses.replace(v, stages=stages)
    return most_stages(v, limit)


def variant(call: "AttentionCall", deterministic: bool):
    """The compiled variant that runs `call` (what the first-use self-check verifies)."""
    return variant_of(call, deterministic)


def _rows_ready(t: torch.Tensor) -> torch.Tensor:
    """t with a unit last stride and 16-byte strides / base (cp.async reads 16-byte vectors),
    size-1 dims given strides that meet the compiled divisibility (they never address anything)."""
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
        s % 8 == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n > 1)
    if not ok:
        t = t.contiguous()
    if 1 in t.shape[:-1]:
        strides = list(t.stride())
        for i in range(t.dim() - 2, -1, -1):
            if t.shape[i] == 1:
                strides[i] = max(8, strides[i + 1] * t.shape[i + 1])
        t = t.as_strided(t.shape, strides)
    return t


def backward(call: "AttentionCall", dout, out, lse, dq, dk, dv, deterministic: bool,
             stages: Optional[int] = None, large_tiles: Optional[bool] = None,
             tuning: Optional[dict] = None) -> None:
    """dq, dk, dv of `call` for output gradient dout (out, lse: the forward's), in place.
    stages, large_tiles: the tests' and benchmarks' choices of Q / dO buffers and tiles (None: as
    many / as large as the GPU's shared memory holds); tuning: BwdVariant fields replaced (A/B)."""
    from torch_fa4.kernels.portable.bwd_compile import compile_variant

    q, k, v = call.q, call.k, call.v
    varlen = call.is_varlen
    dout_rows = dout  # as the ops hand it (varlen: 3-d)
    if varlen:
        batch = call.cu_seqlens_q.numel() - 1
        # (the grid and the deterministic counters are sized by these: measured when not given)
        max_q, max_k = int(call.max_seqlen_q), int(call.max_seqlen_k)
        if batch and not (max_q and max_k):
            max_q = max_q or int((call.cu_seqlens_q[1:] - call.cu_seqlens_q[:-1]).max())
            max_k = max_k or int((call.cu_seqlens_k[1:] - call.cu_seqlens_k[:-1]).max())
        q, k, v, dout = (t.unsqueeze(0) for t in (q, k, v, dout))
        dk4, dv4 = dk.unsqueeze(0), dv.unsqueeze(0)
    else:
        batch = q.shape[0]
        max_q, max_k = q.shape[1], k.shape[1]
        dk4, dv4 = dk, dv
    if varlen or call.seqused_k is not None:
        # key rows past a sequence's used keys (or outside every sequence) get no tile's write
        dk.zero_()
        dv.zero_()
    if dq.numel() == 0 or k.shape[1] == 0 or batch == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return

    lse2, dpsum, dq_acc = _row_statistics(dout_rows, out, lse, q.shape[:3] + (call.head_dim,))
    variant = variant_of(call, deterministic, stages, large_tiles, tuning)
    fn = compile_variant(variant, arch=_arch(q.device))
    sem = None
    if deterministic:
        tiles_q = max(1, math.ceil(max_q / variant.tile_m))
        sem = torch.zeros((batch, call.num_heads, tiles_q), dtype=torch.int32, device=q.device)
    cu_q, cu_k, used = (t.to(torch.int32).contiguous() if t is not None else None
                        for t in (call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k))
    _, left, right = _window(call)
    q, k, v, dout, dk4, dv4 = map(_rows_ready, (q, k, v, dout, dk4, dv4))
    assert dk4.data_ptr() == dk.data_ptr() and dv4.data_ptr() == dv.data_ptr(), "dk / dv must be contiguous"
    visits = bwd_sparse.tile_visits(call, variant.tile_m, variant.tile_n) if variant.sparse else None
    fn(q, k, v, dout, lse2, dpsum, _rows_ready(dq_acc), dk4, dv4, cu_q, cu_k, used, sem, visits,
       float(call.scale), float(call.scale * LOG2E), float(call.softcap or 1.0), int(left), int(right),
       int(batch), int(max_k), *_aux(call))
    with torch.no_grad():
        torch.mul(dq_acc.view(dq.shape), call.scale, out=dq)


def _aux(call: "AttentionCall") -> list:
    """The mods' captured tensors as the kernel takes them (MAX_AUX slots, None when unused)."""
    if call.mods is None:
        return [None] * MAX_AUX
    from torch_fa4.kernels.common import mod_lowering

    return mod_lowering.kernel_aux_tensors(call.aux_tensors, MAX_AUX)


def _row_statistics(dout, out, lse, dq_shape):
    """(lse2, dpsum, zeroed fp32 dQ buffer of dq_shape), the statistics (B, Hq, S) (varlen: (1, Hq, T)).

    One pass of the sm90 backward's row-statistics kernel (it compiles for any arch; see
    kernels/sm90/bwd_prepare.py), which also zeroes the dQ buffer; torch where it refuses."""
    from torch_fa4.kernels.sm90 import bwd_prepare

    dq_acc = torch.empty(dq_shape, dtype=torch.float32, device=dout.device)
    if bwd_prepare.unsupported_reason(dout, out, lse) is None and bwd_prepare.dq_zeroing_takes(dq_acc, dout):
        fn = bwd_prepare.compile_kernel(dout.dtype, dout.shape[-1], arch=_arch(dout.device),
                                        d_zero=dq_shape[-1])
        stats = torch.empty((2, *lse.shape[:-1], lse.shape[-1]), dtype=torch.float32, device=dout.device)
        bwd_prepare.launch(fn, dout, out, lse, stats[0], stats[1], dq_acc)
        lse2, dpsum = stats[0], stats[1]
    else:
        with torch.no_grad():
            lse2 = torch.where(lse == -math.inf, math.inf, lse.float() * LOG2E)
            dpsum = (dout.float() * out.float()).sum(-1)  # (B, S, Hq) or (T, Hq)
            dpsum = dpsum.transpose(-1, -2)
        dq_acc.zero_()
    if dout.dim() == 3:  # varlen: one batch of packed rows
        lse2, dpsum = lse2.unsqueeze(0), dpsum.unsqueeze(0)
    return lse2.contiguous(), dpsum.contiguous(), dq_acc


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    if major == 9:
        return "sm_90a"
    if major >= 10:
        return f"sm_{major}{minor}a"
    return f"sm_{major}{minor}"
