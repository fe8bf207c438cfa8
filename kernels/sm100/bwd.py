"""sm100 backward entry point: which calls the Blackwell backward takes, and running it.

`backward` = row statistics and the zeroed fp32 dQ buffer (the sm90 backward's fused pass,
kernels/sm90/bwd_prepare.py, compiled for sm_100a) -> the tcgen05 kernel (bwd_kernel.py) -> dQ
fp32 -> dtype with the softmax scale (kernels/sm90/bwd_dq_convert.py, compiled for sm_100a). Both
passes are architecture-neutral CuTe DSL (plain loads / stores, programmatic dependent launch,
which sm_100 has).

Compile-verified only: no Blackwell GPU has run this kernel, so `unsupported_reason` accepts
exactly the kinds of variants tests/test_sm100_bwd_compile.py compiles for sm_100a: fp16 / bf16,
D and Dv in (64, 96, 128), causal, sliding window, softcap, GQA / MQA, seqused_k, varlen with
cu_seqlens on both sides, deterministic dQ, score_mod / mask_mod (lowered into the kernel, the
derivative from the traced graph, as on sm90) and block masks (driving the walk where their tiles
are whole 128 x 128 kernel tiles and the mode is not deterministic; else the mask_mod runs on every
tile of the dense walk). It refuses (the call runs on the next kernel family) head dims above 128
(S^T, dP^T, dK and dV of a 128-key tile take 256 + D + Dv of the 512 tensor-memory columns),
cu_seqlens on one side only and a block mask without its mask_mod.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

from torch_fa4.kernels.host import bwd_operands
from torch_fa4.kernels.sm90 import bwd_dq_convert
from torch_fa4.kernels.sm90.bwd import main_scalars, tma_compatible
from torch_fa4.kernels.sm90.bwd_buffers import dq_buffer, dq_buffer_shape
from torch_fa4.kernels.sm90.bwd_compile import (MAX_AUX, cached_compile, compile_with_stream, cute_dtype,
                                                kernel_args)
from torch_fa4.kernels.sm90.bwd_config import BwdConfig
from torch_fa4.kernels.sm90.bwd_variant import LaunchPlan, window
from torch_fa4.kernels.sm100.bwd_config import TILE_M, TILE_N

if TYPE_CHECKING:
    from torch_fa4.call import AttentionCall

ARCH = "sm_100a"
SUPPORTED_HEAD_DIMS = (64, 96, 128)


def unsupported_reason(call: "AttentionCall", head_dims: tuple = SUPPORTED_HEAD_DIMS) -> Optional[str]:
    """Why this backward cannot take `call` (None: it can); head_dims: the CTA-pair backward's."""
    q, k, v = call.q, call.k, call.v
    if q.is_cuda and torch.cuda.get_device_capability(q.device) != (10, 0):
        major, minor = torch.cuda.get_device_capability(q.device)
        return f"sm_{major}{minor} (sm100 backward compiled and checked for sm_100a only)"
    if (reason := bwd_operands.operand_reason(call, "sm100", head_dims)) is not None:
        return reason
    if call.mods is not None and len(call.aux_tensors) > MAX_AUX:
        return f"mods capture {len(call.aux_tensors)} tensors (sm100 backward: at most {MAX_AUX})"
    if call.block_mask and (call.mods is None or call.mods.mask_graph is None):
        return "a block mask without its mask_mod"
    if call.is_varlen != (call.cu_seqlens_k is not None):
        return "sm100 backward takes cu_seqlens on both sides or neither"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not tma_compatible(t):
            return f"{name} is not TMA-compatible (last dim contiguous, 16-byte strides/pointer)"
    return None


def variant_key(call: "AttentionCall", deterministic: bool) -> BwdConfig:
    """The compiled variant that runs `call` (the sm90 backward's key, read by bwd_config.py)."""
    from torch_fa4.kernels.sm90.bwd_sparse import ratios, sparse_walk_reason

    right, left = window(call)
    # a block mask drives the walk where its tiles are whole kernel tiles (else the mask_mod runs
    # on every tile of the dense walk: slower, same result)
    sparse = None
    if sparse_walk_reason(call, deterministic, TILE_N, TILE_M) is None:
        sparse = ratios(call, TILE_N, TILE_M)
    return BwdConfig(
        dtype=call.q.dtype, head_dim=call.head_dim, head_dim_v=call.head_dim_v,
        group=call.num_heads // call.num_heads_kv, has_right=right is not None, has_left=left is not None,
        softcap=call.softcap > 0, varlen=call.is_varlen, seqused_k=call.seqused_k is not None,
        deterministic=bool(deterministic), mods_key=call.mods.key if call.mods is not None else "",
        sparse=sparse, tile_n=TILE_N, tile_m=TILE_M,
        persistent=False, fused_dq=False, split_tail=False,
        mask_key_tail=not call.is_varlen and call.seqused_k is None and call.k.shape[1] % TILE_N != 0,
    )


def compile_variant(config: BwdConfig, arch: str = ARCH, dump_dir: Optional[str] = None):
    """Compile one variant against symbolic shapes (no GPU needed); dump_dir: also write the cubin
    there (always compiles, bypassing the cache)."""

    def build(dump, jit=True):
        from torch_fa4.kernels.sm100.bwd_kernel import Sm100AttentionBackward

        mods = None
        if config.mods_key:
            from torch_fa4.mods import registry

            mods = registry.lookup(config.mods_key)
        kernel = Sm100AttentionBackward(cute_dtype(config.dtype), config, mods)
        return compile_with_stream(kernel, kernel_args(config, mods, with_captured_grads=False), arch, dump, jit)

    return cached_compile(("sm100_bwd", arch, config), build, dump_dir)


def backward(call: "AttentionCall", dout, out, lse, dq, dk, dv, deterministic: bool) -> None:
    """dq, dk, dv of `call` for output gradient dout (out, lse: the forward's)."""
    key = variant_key(call, deterministic)
    run_variant(call, key, compile_variant(key), dout, out, lse, dq, dk, dv)


def run_variant(call: "AttentionCall", key: BwdConfig, fn, dout, out, lse, dq, dk, dv) -> None:
    """The backward's passes around kernel `fn` (compiled for `key`; the CTA-pair backward's too,
    kernels/sm100/pair/bwd.py: the same arguments and the same 128-query statistics)."""
    from torch_fa4.kernels.host import fwd_launch
    from torch_fa4.kernels.sm90.bwd import _tma_view

    deterministic = key.deterministic
    q, k, v = call.q, call.k, call.v
    if not tma_compatible(dout):  # autograd may hand over expanded or odd-strided gradients
        dout = dout.contiguous()
    dq_acc_rows, dq_acc = dq_buffer(dq_buffer_shape(call), call.is_varlen, q.device)
    lists = [None] * 4
    min_rows = 0
    if key.sparse is not None:
        from torch_fa4.kernels.sm90 import bwd_sparse

        lists = bwd_sparse.transposed_lists(call)
        min_rows = bwd_sparse.padded_rows(call)
    lse2, dpsum = _row_statistics(call, dout, out, lse, dq_acc_rows, min_rows)
    max_q, max_k = fwd_launch.max_seqlens(call)
    sem = None
    if deterministic:
        sem = torch.zeros((call.batch, call.num_heads, max(math.ceil(max_q / TILE_M), 1)), dtype=torch.int32,
                          device=q.device)
    seqused, cu_q, cu_k = (t.to(torch.int32).contiguous() if t is not None else None
                           for t in (call.seqused_k, call.cu_seqlens_q, call.cu_seqlens_k))
    q, k, v, dout, dk, dv = map(_tma_view, (q, k, v, dout, dk, dv))
    plan = LaunchPlan(key, 0, 1, 1, 1, max_q, max_k)
    aux = [None] * MAX_AUX
    if call.mods is not None:
        from torch_fa4.kernels.common import mod_lowering

        aux = mod_lowering.kernel_aux_tensors(call.aux_tensors, MAX_AUX)
    fn(q, k, v, dout, lse2, dpsum, dq_acc, dk, dv, None, cu_q, cu_k, seqused, sem, None, None,
       *lists, *main_scalars(call, plan), *aux)
    # the kernel accumulates dS K; the softmax scale joins the conversion to dq's dtype
    if bwd_dq_convert.takes(dq_acc_rows, dq):
        bwd_dq_convert.compile_kernel(dq.dtype, ARCH)(dq_acc_rows.view(-1), dq.view(-1), float(call.scale))
    else:
        with torch.no_grad():
            torch.mul(dq_acc_rows.view(dq.shape), call.scale, out=dq)


def _row_statistics(call: "AttentionCall", dout, out, lse, dq_acc_rows, min_rows: int = 0) -> tuple:
    """(lse * log2 e, rowsum(dO * O)) padded to whole 128-query tiles (varlen: at tile-aligned
    sequence offsets), and the dQ buffer zeroed: the sm90 backward's fused pass compiled for
    sm_100a (it is architecture-neutral), else bwd_row_stats' torch path."""
    from torch_fa4.kernels.sm90 import bwd_prepare, bwd_row_stats

    if not (dout.is_cuda and bwd_prepare.unsupported_reason(dout, out, lse) is None):
        lse2, dpsum, _ = bwd_row_stats.row_statistics(call, dout, out, lse, min_rows, TILE_M,
                                                      zero_dq=dq_acc_rows)
        return lse2, dpsum
    rows = bwd_row_stats.stat_rows(call, TILE_M, min_rows)
    fused_zero = bwd_prepare.dq_zeroing_takes(dq_acc_rows, dout)
    stats = torch.empty((2, *lse.shape[:-1], rows), dtype=torch.float32, device=dout.device)
    fn = bwd_prepare.compile_kernel(dout.dtype, dout.shape[-1], arch=ARCH,
                                    d_zero=dq_acc_rows.shape[-1] if fused_zero else 0)
    bwd_prepare.launch(fn, dout, out, lse, stats[0], stats[1], dq_acc_rows if fused_zero else None)
    if not fused_zero:
        dq_acc_rows.zero_()
    if call.is_varlen:
        return bwd_row_stats.varlen_stat_layout(call, stats, TILE_M)
    return stats[0], stats[1]
