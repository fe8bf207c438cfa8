"""The forward's repeated calls: a launch record per shape, so a repeated call only allocates
its per-launch buffers and launches (bwd_launch_record.py does the same for the backward).

A record is keyed on everything fwd_host.forward's derivation (variant, L2 grouping, grid, split
plan) reads: shapes, strides and dtypes of q, k, v, out and lse, device, scale, causal / window /
softcap; with mods, block masks or variable lengths also the mods' key, the captured tensors'
dtypes and ranks, the block mask's tile sizes, the given maxima and the offsets' shapes; with a
page table its shape. Not recorded: packed varlen calls without max_seqlen_q (the derivation reads
the offsets), overrides, a negative scale without softcap (it runs on -q, made per call) and paged
calls whose page size runs on a gathered copy. Dispatch checked alignment.
"""

from typing import NamedTuple, Optional

import torch

from torch_fa4.kernels.host import fwd_launch, shape_memo


class LaunchRecord(NamedTuple):
    kernel: object  # the compiled kernel (TVM-FFI callable)
    scalars: tuple  # leading_args after the tensors: scales, window, batch, max_q, groups, grid
    cfg: object  # the variant (FwdConfig): its per-launch buffers come from fwd_host
    split: Optional[tuple]  # (workspace shape, counter slots, split items); None: no split tail


_records = shape_memo.table()


def run(call, out: torch.Tensor, lse: torch.Tensor) -> bool:
    """Launch the forward of `call` from its record and return True, or return False for
    fwd_host.forward's general path."""
    if call.is_varlen and not call.max_seqlen_q:  # (the derivation would read the offsets)
        return False
    q, k, v = call.q, call.k, call.v
    mods = call.mods
    memo = (q.dtype, q.device, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), k.dtype, v.dtype,
            out.shape, out.stride(), out.dtype, lse.shape, lse.stride(), lse.dtype,
            call.scale, call.causal, call.window_left, call.window_right, call.softcap)
    paged = call.page_table is not None
    if (mods is not None or call.block_mask or call.is_varlen or call.cu_seqlens_k is not None
            or call.seqused_k is not None or paged):
        memo += (call.page_table.shape if paged else None, mods.key if mods is not None else None,
                 tuple((t.dtype, t.dim()) for t in call.aux_tensors),
                 bool(call.block_mask), call.block_mask_q, call.block_mask_kv, call.max_seqlen_q, call.max_seqlen_k,
                 *(None if t is None else (t.shape, t.dtype) for t in (call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k)))
    record = shape_memo.lookup(_records, memo, lambda: _derive(call, out, lse))
    if record is shape_memo.NOT_RECORDED:
        return False
    from torch_fa4.kernels.sm90 import fwd_host

    fwd_host.launch(record.kernel, record.cfg, call,
                    (q, k, v, out, lse, call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k, *record.scalars),
                    record.split)
    return True


def _derive(call, out, lse):
    """The LaunchRecord of this call's shape (with fwd_host's own functions), or NOT_RECORDED."""
    from torch_fa4.kernels.sm90 import fwd_host

    if fwd_launch.nonnegative_scale(call) is not call:  # (runs on -q, made per call)
        return shape_memo.NOT_RECORDED
    cfg = fwd_host.default_config(call)
    if call.page_table is not None and not cfg.page_box:  # (a gathered copy per call)
        return shape_memo.NOT_RECORDED
    args = fwd_launch.leading_args(call, out, lse, fwd_host.L2_BYTES, fwd_host._grid_ctas(cfg, call), cfg.tile_m)
    if args is None:  # no query rows: the general path returns without a launch
        return shape_memo.NOT_RECORDED
    own = (call.q, call.k, call.v, out, lse, call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k)
    if any(a is not b for a, b in zip(args[:8], own)):
        return shape_memo.NOT_RECORDED  # (a launch that does not pass the call's own tensors)
    return LaunchRecord(fwd_host.compile_fwd(cfg), tuple(args[8:]), cfg,
                        fwd_host.split_spec(cfg, call))
