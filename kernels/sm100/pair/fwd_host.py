"""Host side of the two-CTA sm100 forward: which calls a pair of CTAs sharing each matmul takes,
and its variant (kernels/sm100/fwd.py with Sm100FwdConfig.two_cta; launch, compile cache and
everything else are the one-CTA forward's host code, kernels/sm100/fwd_host.py).

A pair (a cluster of two CTAs, tcgen05 cta_group::2) computes each S = Q K^T and O += P V as one
M = 256 matmul: each CTA holds its own 128-row query tile(s) and half of each K and V tile, so
each CTA reads half the K/V bytes per key tile from shared memory (and from L2) that a lone CTA
does, the tensor core's operand traffic that limits the large head dims. The calls taken are the
ones FlashAttention-4 runs this way on sm_100:

    D = Dv = 256, any masks / softcap / varlen / seqused_k;
    D = Dv = 128 without a causal or sliding-window mask and without packed (varlen) queries
    (a pair walks one key list for its 512 rows: under such a mask it would walk keys that half
    of them never see);

neither with mods or a block mask (those stay on the one-CTA kernel, whose variants are
compile-checked with them), and only where the longest query sequence fills more than one CTA's
rows (else the second CTA would hold only padding; one CTA does the same work).

A call refused here is no fallback: the one-CTA forward takes it, so the dispatcher does not warn
about it (`QUIET_REFUSALS` in the package). Compile-verified only, like the one-CTA kernel: no
Blackwell GPU has run it, and the first-use self-check stands guard (a failing pair variant runs
on the one-CTA kernel).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from torch_fa4.call import AttentionCall
from torch_fa4.kernels.sm100 import fwd_host
from torch_fa4.kernels.sm100.fwd_config import SMEM_LIMIT, TMEM_COLUMNS, Sm100FwdConfig

# K/V ring stages per head dim: a CTA holds half a K or V tile per stage, so the one-CTA kernel's
# shared memory holds twice as many. D=256: 64 KB of Q + 4 x 32 KB; D=128: 64 KB of Q (two tiles)
# + 8 x 16 KB (fwd_config.SMEM_LIMIT). Not yet tuned on a Blackwell GPU.
_KV_STAGES = {128: 8, 256: 4}
SUPPORTED_HEAD_DIMS = tuple(_KV_STAGES)


def unsupported_reason(call: AttentionCall) -> Optional[str]:
    reason = fwd_host.unsupported_reason(call)
    if reason is not None:
        return reason
    if call.head_dim != call.head_dim_v or call.head_dim not in SUPPORTED_HEAD_DIMS:
        return "head dims other than 128 and 256"
    if call.mods is not None or call.aux_tensors or call.block_mask:
        return "mods and block masks"
    if call.head_dim == 128:
        if call.causal or call.window_left >= 0 or call.window_right >= 0:
            return "causal or sliding-window masks at head dim 128"
        if call.is_varlen:
            return "packed (varlen) sequences at head dim 128"
    # (packed sequences: by max_seqlen_q where given; reading the offsets would cost a device sync,
    # and the dispatcher keeps its choice per layout, never per offset values)
    max_q = call.max_seqlen_q if call.is_varlen else call.q.shape[1]
    if 0 < max_q <= fwd_host.default_config(call).cta_tile_m:
        return "queries that fit one CTA"
    return None


def default_config(call: AttentionCall) -> Sm100FwdConfig:
    cfg = replace(fwd_host.default_config(call), two_cta=True, kv_stages=_KV_STAGES[call.head_dim])
    assert cfg.tmem_columns()["used"] <= TMEM_COLUMNS and cfg.smem_bytes() <= SMEM_LIMIT, cfg
    return cfg


def forward(call: AttentionCall, out: torch.Tensor, lse: torch.Tensor) -> None:
    cfg = default_config(call)
    fwd_host.forward(call, out, lse, two_cta=True, kv_stages=cfg.kv_stages)
