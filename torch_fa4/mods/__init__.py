"""FlexAttention-style score_mod / mask_mod for torch_fa4.

Users write mods as plain PyTorch callables, exactly as for FlexAttention:

    score_mod(score, b, h, q_idx, kv_idx) -> score      mask_mod(b, h, q_idx, kv_idx) -> bool

closures over tensors included. Each mod is traced once into a ModGraph (trace.py; the supported
op set is `SUPPORTED_OPS_DOC`), keyed by a structural hash (registry.py), lowered to PyTorch for
the reference path and the block-mask builder (lower_torch.py) and to CuTe DSL inside the kernels
(torch_fa4.kernels.common.mod_lowering).
"""

from torch_fa4.mods.block_mask import BlockMask, as_block_mask, create_block_mask
from torch_fa4.mods.index_bounds import ModIndexError
from torch_fa4.mods.library import (alibi, alibi_slopes, and_masks, causal_mask, chunked_mask,
                                    document_ids_from_lengths, document_mask, or_masks, prefix_lm_mask,
                                    relative_bias, sliding_window_mask, softcap_score)
from torch_fa4.mods.prepare import prepare
from torch_fa4.mods.trace import SUPPORTED_OPS_DOC, ModTraceError

__all__ = [
    "BlockMask", "create_block_mask", "as_block_mask", "prepare", "ModTraceError", "ModIndexError",
    "SUPPORTED_OPS_DOC",
    "causal_mask", "sliding_window_mask", "document_mask", "document_ids_from_lengths", "prefix_lm_mask",
    "chunked_mask", "and_masks", "or_masks", "alibi", "alibi_slopes", "softcap_score", "relative_bias",
]
