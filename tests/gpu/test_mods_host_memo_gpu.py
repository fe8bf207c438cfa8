"""GPU: repeated calls with a document mask_mod and its block mask through
`torch_fa4.flex_attention`, whose host path keeps the op arguments of the mods and block mask per
what decides them (torch_fa4/mods/call_memo.py) and re-lists the block mask once causal is folded
out (mods/block_lists.py), against float64 after each change a memo could miss: the captured
document ids and the block mask's lists written in place, the closure's cell rebound to new ids
with a new block mask; torch_fa4's block masks and torch's own (with full blocks and without).
Outputs are poisoned (NaN) before every launch. A repeated call makes no device synchronisation.
One mod key throughout (one compiled variant)."""

import pytest
import torch

import torch_fa4
from naive import naive_attention, rel_error
from torch_fa4.kernels.sm90 import fwd_host

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs a CUDA sm_90 device",
    ),
]

S = 1024


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every sm90 forward launch first fills out / lse with NaN, and is counted."""
    launches = []
    real = fwd_host.forward

    def forward(call, out, lse, **kw):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        launches.append(call)
        real(call, out, lse, **kw)

    monkeypatch.setattr(fwd_host, "forward", forward)
    return launches


def _ids(cuts):
    ids = torch.zeros(S, dtype=torch.int32, device="cuda")
    for c in cuts:
        ids[c:] += 1
    return ids


def _block_mask(mask_mod, kind):
    """kind: "torch_fa4" (its create_block_mask), "torch" (torch's BlockMask with full blocks) or
    "torch, no full blocks" (every visible tile listed as partial)."""
    bm = torch_fa4.create_block_mask(mask_mod, None, None, S, S, device="cuda")
    if kind == "torch_fa4":
        return bm
    from torch.nn.attention.flex_attention import BlockMask

    if kind == "torch":
        return BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                        BLOCK_SIZE=128, mask_mod=mask_mod, seq_lengths=(S, S))
    from torch_fa4.mods.block_mask import _compress

    num, idx = _compress(bm.tile_classes() > 0)
    return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128, mask_mod=mask_mod, seq_lengths=(S, S))


def _lists(bm):
    return [t for t in (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices) if t is not None]


@pytest.mark.parametrize("kind", ["torch_fa4", "torch", "torch, no full blocks"])
def test_documents_move_between_calls(kind, poisoned):
    q, k, v = (torch.randn(2, 4, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    doc_ids = _ids([256, 512, 768])  # tile-aligned: the tiles below the diagonal are empty

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[q_idx] == doc_ids[kv_idx])

    bm = _block_mask(document_causal, kind)

    def check():
        for _ in range(2):  # the second call: every memo hit
            out, lse = torch_fa4.flex_attention(q, k, v, block_mask=bm, return_lse=True)
            ref, ref_lse = naive_attention(*bshd, mask_mod=document_causal, device="cuda")
            low, _ = naive_attention(*bshd, mask_mod=document_causal, differentiable=True)
            assert rel_error(out.transpose(1, 2), ref) <= 2 * rel_error(low, ref)
            assert (lse.double() - ref_lse).abs().max().item() < 1e-2

    check()
    # the ids and the lists written in place: keys below the diagonal tiles become visible
    doc_ids.copy_(_ids([200, 700]))
    for mine, new in zip(_lists(bm), _lists(_block_mask(document_causal, kind))):
        mine.copy_(new)
    check()
    doc_ids = _ids([100, 333, 900])  # the cell rebound, a new block mask
    bm = _block_mask(document_causal, kind)
    check()
    assert len(poisoned) == 6 and all(call.block_mask and call.causal for call in poisoned)


def test_repeated_call_makes_no_device_synchronisation():
    q, k, v = (torch.randn(2, 4, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    doc_ids = _ids([200, 700])

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[q_idx] == doc_ids[kv_idx])

    bm = torch_fa4.create_block_mask(document_causal, None, None, S, S, device="cuda")
    for _ in range(2):
        torch_fa4.flex_attention(q, k, v, block_mask=bm)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            torch_fa4.flex_attention(q, k, v, block_mask=bm)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_schedule_counters_reused_across_refills(monkeypatch, poisoned):
    """The dynamic schedule's item counters come from a per-stream buffer zeroed once all are used
    (fwd_launch.schedule_counter): with 3 counters a buffer, 10 block-list walks, 8 of them on the
    current stream (two refills) and 2 on a side stream; each output against float64."""
    from torch_fa4.kernels.host import fwd_launch

    monkeypatch.setattr(fwd_launch, "COUNTER_SLOTS", 3)
    monkeypatch.setattr(fwd_launch, "_counter_pools", {})
    q, k, v = (torch.randn(2, 4, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    doc_ids = _ids([200, 700])

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[q_idx] == doc_ids[kv_idx])

    bm = torch_fa4.create_block_mask(document_causal, None, None, S, S, device="cuda")
    ref, _ = naive_attention(*bshd, mask_mod=document_causal, device="cuda")
    low, _ = naive_attention(*bshd, mask_mod=document_causal, differentiable=True)
    side = torch.cuda.Stream()
    outs = []
    for i in range(10):
        if i % 4 == 3:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                outs.append(torch_fa4.flex_attention(q, k, v, block_mask=bm))
            torch.cuda.current_stream().wait_stream(side)
        else:
            outs.append(torch_fa4.flex_attention(q, k, v, block_mask=bm))
    torch.cuda.synchronize()
    assert len(poisoned) == 10 and all(call.block_mask for call in poisoned)
    assert len(fwd_launch._counter_pools) == 2
    for out in outs:
        assert rel_error(out.transpose(1, 2), ref) <= 2 * rel_error(low, ref)
