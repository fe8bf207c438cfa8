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

from typing import Optional

import torch

from torch_fa4.call import AttentionCall
from torch_fa4.kernels.sm100 import fwd_host
from torch_fa4.kernels.sm100.fwd_config import Sm100FwdConfig

# Per head dim, what differs from the one-CTA variant. K/V ring stages: a CTA holds half a K or V
# tile per stage, so the same shared memory holds twice as many: D=256 64 KB of Q + 4 x 32 KB;
# D=128 64 KB of Q (two tiles) + 8 x 16 KB (fwd_config.SMEM_LIMIT); not yet tuned on a Blackwell
# GPU. D=256 (one query tile) also keeps two S buffers in tensor memory (2 x 128 + 256 O = 512
# columns): the next key tile's S = Q K^T runs under this one's softmax, as in FA4's 2-CTA D=256
# kernel (the one-CTA D=256 variant, this one's fallback, keeps one buffer)
_PAIR_FIELDS = {128: dict(kv_stages=8, s_stages=1), 256: dict(kv_stages=4, s_stages=2)}
SUPPORTED_HEAD_DIMS = tuple(_PAIR_FIELDS)


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
    # (fwd_host.default_config checks the tensor- and shared-memory budgets of the result)
    return fwd_host.default_config(call, two_cta=True, **_PAIR_FIELDS[call.head_dim])


def forward(call: AttentionCall, out: torch.Tensor, lse: torch.Tensor) -> None:
    fwd_host.forward(call, out, lse, two_cta=True, **_PAIR_FIELDS[call.head_dim])
