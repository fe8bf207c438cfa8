"""Custom masks with torch_fa4: document (packed-sequence) masking plus ALiBi in a compiled module.

The mods are plain PyTorch callables, exactly as for FlexAttention. The mask_mod is a closure over
the per-batch document ids and the score_mod reads the module's ALiBi slopes; both are traced once,
fused into the kernels on a GPU (the exact reference runs them on a CPU), and under torch.compile
the captured tensors are graph inputs: a new batch with new document boundaries reuses the same
compiled graph.

    python examples/custom_masks.py
"""

import torch

import torch_fa4
from torch_fa4 import mods

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32


class PackedAlibiAttention(torch.nn.Module):
    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(heads * head_dim, 3 * heads * head_dim, bias=False)
        self.register_buffer("slopes", mods.alibi_slopes(heads))

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, self.head_dim).unbind(2)
        slopes = self.slopes

        def alibi(score, b, h, q_idx, kv_idx):  # linear distance penalty per head
            return score + slopes[h] * (kv_idx - q_idx)

        def same_document_causal(b, h, q_idx, kv_idx):  # no attention across packed documents
            return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

        out = torch_fa4.attention(q, k, v, score_mod=alibi, mask_mod=same_document_causal)
        return out.reshape(B, S, -1)


def random_packing(B: int, S: int) -> torch.Tensor:
    """(B, S) document ids: each row is several documents of random lengths packed back to back."""
    cuts = torch.sort(torch.randint(1, S, (B, 3)), dim=1).values
    return (torch.arange(S).view(1, S, 1) >= cuts.view(B, 1, 3)).sum(-1).to(torch.int32)


def plain_pytorch(model: PackedAlibiAttention, x: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """The same computation written out densely, for comparison."""
    B, S, _ = x.shape
    H, D = model.heads, model.head_dim
    q, k, v = model.qkv(x).float().view(B, S, 3, H, D).unbind(2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / D ** 0.5
    i = torch.arange(S, device=x.device)
    scores = scores + model.slopes.view(1, H, 1, 1) * (i.view(1, S) - i.view(S, 1))
    keep = (doc_ids[:, None, :, None] == doc_ids[:, None, None, :]) & (i.view(S, 1) >= i.view(1, S))
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).reshape(B, S, -1)


def main():
    torch.manual_seed(0)
    B, S, H, D = 2, 512, 8, 64
    model = PackedAlibiAttention(H, D).to(device=device, dtype=dtype)
    compiled = torch.compile(model, fullgraph=True)

    for step in range(3):  # new inputs and new document boundaries every step: compiled once
        x = torch.randn(B, S, H * D, device=device, dtype=dtype)
        doc_ids = random_packing(B, S).to(device)
        out = compiled(x, doc_ids)
        want = plain_pytorch(model, x, doc_ids)
        err = ((out.float() - want).norm() / want.norm()).item()
        docs = [len(torch.unique(r)) for r in doc_ids]
        print(f"step {step}: documents per row {docs}, relative difference to dense PyTorch {err:.1e}")
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4)

    # The same masks as reusable built-ins, with a block mask that skips empty tiles.
    doc_ids = random_packing(1, S)[0].to(device)
    mask = mods.and_masks(mods.document_mask(doc_ids), mods.causal_mask)
    block_mask = torch_fa4.create_block_mask(mask, None, None, S, S, device=device)
    print(f"block mask: {block_mask}")
    q, k, v = (torch.randn(1, H, S, D, device=device, dtype=dtype) for _ in range(3))
    out = torch_fa4.flex_attention(q, k, v, score_mod=mods.alibi(model.slopes), block_mask=block_mask)
    print(f"flex_attention with built-ins: out {tuple(out.shape)}, finite: {bool(out.isfinite().all())}")


if __name__ == "__main__":
    main()
