"""create_block_mask: tile classes (empty / partial / full) against brute force on the dense mask,
including lengths that are not tile multiples, analytic built-ins and grid-evaluated mods."""

import pytest
import torch

from torch_fa4 import mods as M
from torch_fa4.mods import block_mask as bm_module
from torch_fa4.mods.prepare import trace_graphs


@pytest.fixture(autouse=True)
def _private_mod_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "torch_fa4_cache"))


def brute_classes(mask_mod, B, H, Q, K, bq, bkv):
    mods, aux = trace_graphs(None, mask_mod)
    b = torch.arange(B).view(-1, 1, 1, 1)
    h = torch.arange(H).view(1, -1, 1, 1)
    q = torch.arange(Q).view(1, 1, -1, 1)
    k = torch.arange(K).view(1, 1, 1, -1)
    dense = torch.broadcast_to(mods.mask_torch(b, h, q, k, aux), (B, H, Q, K))
    nq, nk = -(-Q // bq), -(-K // bkv)
    out = torch.empty(B, H, nq, nk, dtype=torch.int8)
    for i in range(nq):
        for j in range(nk):
            t = dense[:, :, i * bq:(i + 1) * bq, j * bkv:(j + 1) * bkv].flatten(2)
            out[:, :, i, j] = torch.where(t.all(-1), 2, torch.where(t.any(-1), 1, 0))
    return out


def check(mask_mod, B, H, Q, K, bq, bkv):
    bm = M.create_block_mask(mask_mod, B, H, Q, K, device="cpu", BLOCK_SIZE=(bq, bkv))
    want = brute_classes(mask_mod, B or 1, H or 1, Q, K, bq, bkv)
    assert torch.equal(bm.tile_classes(), want)
    # layout contract: int32, counts (B,H,nq), indices (B,H,nq,nkv) ascending, padding after
    for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        assert num.dtype == torch.int32 and idx.dtype == torch.int32
        assert num.shape == want.shape[:3] and idx.shape == want.shape
        for row_n, row_i in zip(num.flatten().tolist(), idx.flatten(0, 2).tolist()):
            assert row_i[:row_n] == sorted(row_i[:row_n])
    assert bm.BLOCK_SIZE == (bq, bkv) and bm.seq_lengths == (Q, K) and bm.mask_mod is mask_mod
    return bm


SHAPES = [(256, 256, 64, 64), (200, 313, 64, 32), (77, 45, 16, 64), (1, 130, 128, 128)]


@pytest.mark.parametrize("Q,K,bq,bkv", SHAPES)
def test_analytic_builtins_match_brute_force(Q, K, bq, bkv):
    for mask in (M.causal_mask, M.sliding_window_mask(37, 0), M.sliding_window_mask(None, 20),
                 M.sliding_window_mask(5, 70), M.prefix_lm_mask(int(torch.randint(0, K, ()))),
                 M.chunked_mask(int(torch.randint(1, 100, ())))):
        assert bm_module._analytic(mask) is not None
        check(mask, None, None, Q, K, bq, bkv)


@pytest.mark.parametrize("Q,K,bq,bkv", SHAPES)
def test_grid_evaluated_mods_match_brute_force(Q, K, bq, bkv):
    B, H = 2, 3
    doc = torch.randint(0, 4, (B, max(Q, K))).sort(dim=1).values
    per_head = torch.randint(0, K + 1, (H,))

    def head_limit(b, h, q_idx, kv_idx):
        return kv_idx < per_head[h]

    if Q == K:  # document masking is self-attention over one packed sequence
        check(M.document_mask(doc[:, :Q]), B, None, Q, K, bq, bkv)
    check(head_limit, None, H, Q, K, bq, bkv)
    check(M.and_masks(M.causal_mask, head_limit), B, H, Q, K, bq, bkv)
    check(M.or_masks(M.sliding_window_mask(3, 3), M.prefix_lm_mask(torch.randint(0, K, (B,)))), B, H, Q, K, bq, bkv)


def test_bounded_memory_banding_is_exact(monkeypatch):
    # a tiny budget forces one tile pair per band: same answer as one big evaluation
    doc = torch.randint(0, 5, (300,)).sort().values
    mask = M.and_masks(M.document_mask(doc), M.causal_mask)
    whole = M.create_block_mask(mask, None, 2, 300, 300, device="cpu", BLOCK_SIZE=64).tile_classes()
    monkeypatch.setattr(bm_module, "_GRID_BUDGET", 1)
    banded = check(mask, None, 2, 300, 300, 64, 64).tile_classes()
    assert torch.equal(whole, banded)


def test_torch_block_mask_is_converted():
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    tbm = torch_create_block_mask(causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=128)
    ours = M.as_block_mask(tbm)
    assert ours.BLOCK_SIZE == (128, 128) and ours.mask_mod is tbm.mask_mod
    assert torch.equal(ours.tile_classes(), brute_classes(causal, 1, 1, 256, 256, 128, 128))
    with pytest.raises(TypeError, match="BlockMask"):
        M.as_block_mask(object())


def test_rejects_non_bool_mask():
    with pytest.raises(M.ModTraceError, match="boolean"):
        M.create_block_mask(lambda b, h, q, k: q - k, None, None, 8, 8, device="cpu")
