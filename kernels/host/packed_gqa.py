"""Packed GQA: the query heads that share a KV head, as query rows of one head.

With one query row per sequence (decode), the Hq / Hkv query heads of one KV head's group see the
same keys under the same mask, so they can be `group` rows of one head: a kernel then reads each
K/V tile once per KV head instead of once per query head, and a query tile holds `group` busy
rows instead of one. The packed call views the same memory: q (B, 1, Hq, D) as (B, group, Hkv, D),
out alike, lse (B, Hq, 1) as (B, Hkv, group); nothing is copied. The one query row sits on the
diagonal of the last used key, so a causal mask or a right window hides nothing: the packed rows
(whose diagonals would differ) go without them. A left window, a score_mod, a block mask or a
mask_mod that reads the query's head or position keep the call unpacked; a mask_mod of the batch
and key alone (a KV cache's padding) sees every packed row alike and packs. Paged KV caches pack
the same way (the page table and the caches pass through untouched: only q, out and lse are
viewed).

Continuous batching hands decode steps over as packed queries (cu_seqlens_q) over a paged cache,
one row per sequence. Such a call (`single_rows`: as many query rows as sequences, at most one
each, so exactly one each) is the dense call with q (B, 1, Hq, D) (`as_dense`: a view), so it
takes the same packing and the split of the keys; only its LSE, (Hq, B) where the kernel writes
(B, Hq, 1), is written to a buffer and copied back.
"""

from __future__ import annotations

import torch

from torch_fa4.call import AttentionCall
from torch_fa4.kernels.host.mod_hoisting import live_nodes


def single_rows(call: AttentionCall) -> bool:
    """Packed queries over a paged cache, one row per sequence (decode under continuous batching):
    max_seqlen_q 1 and as many rows as sequences (cu_seqlens_q's last entry is the row count, which
    eager calls check), no block mask (its tiles follow the packed layout)."""
    return (call.is_varlen and call.page_table is not None and call.max_seqlen_q == 1
            and call.q.shape[0] == call.batch and not call.block_mask)


def as_dense(call: AttentionCall, out: torch.Tensor,
             lse: torch.Tensor) -> tuple[AttentionCall, torch.Tensor, torch.Tensor]:
    """A `single_rows` call as the dense call with one query row per sequence: (call, out, lse),
    q and out views of the packed ones ((B, Hq, X) -> (B, 1, Hq, X)); lse a new (B, Hq, 1) buffer
    of the packed (Hq, B) `lse`'s dtype, whose transpose that LSE is."""
    dense = object.__new__(AttentionCall)
    dense.__dict__.update(call.__dict__)
    dense.q, dense.cu_seqlens_q = call.q.unsqueeze(1), None
    rows = torch.empty((call.batch, call.num_heads, 1), dtype=lse.dtype, device=lse.device)
    return dense, out.unsqueeze(1), rows


def applies(call: AttentionCall) -> bool:
    return (not call.is_varlen and call.q.shape[1] == 1 and call.num_heads > call.num_heads_kv
            and (call.mods is None or _rows_alike(call.mods)) and not call.block_mask
            and call.window_left < 0)


_ROWS_ALIKE: dict[str, bool] = {}  # mod key -> verdict


def _rows_alike(mods) -> bool:
    """A mask_mod alone whose value depends on neither `h` nor `q_idx`."""
    verdict = _ROWS_ALIKE.get(mods.key)
    if verdict is None:
        graph = mods.mask_graph
        verdict = mods.score_graph is None and graph is not None and all(
            graph.nodes[i].attr in ("b", "kv_idx") for i in live_nodes(graph) if graph.nodes[i].op == "input")
        _ROWS_ALIKE[mods.key] = verdict
    return verdict


# (one as_strided view and a shallow copy of the call: this runs on every decode step, where
# slicing + unflatten + transpose and dataclasses.replace cost more host time than the kernel)

def _rows(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """(B, 1, Hq, X) -> (B, group, Hkv, X), a view."""
    b, _, hq, x = t.shape
    sb, _, sh, sx = t.stride()
    group = hq // heads_kv
    return t.as_strided((b, group, heads_kv, x), (sb, sh, group * sh, sx))


def pack(call: AttentionCall) -> AttentionCall:
    """The call with its query heads packed as rows (q a view of the same tensor)."""
    hkv = call.num_heads_kv
    packed = object.__new__(AttentionCall)
    packed.__dict__.update(call.__dict__)
    packed.q, packed.causal, packed.window_right = _rows(call.q, hkv), False, -1
    packed.max_seqlen_q = call.num_heads // hkv if call.max_seqlen_q else 0
    return packed


def pack_results(out: torch.Tensor, lse: torch.Tensor, heads_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, 1, Hq, Dv) and lse (B, Hq, 1) as the packed call's (views)."""
    b, hq, _ = lse.shape
    sb, sh, _ = lse.stride()
    group = hq // heads_kv
    return _rows(out, heads_kv), lse.as_strided((b, heads_kv, group), (sb, group * sh, sh))
