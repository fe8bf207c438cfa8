"""The "fa4" entry of Transformers' AttentionMaskInterface: what a model's mask builder hands to
`transformers_attention.fa4_attention_forward` as `attention_mask`.

Never a dense (B, 1, Sq, Sk) mask. The causal or sliding-window pattern reaches the attention
function through `module.is_causal` and its `sliding_window` argument, so the mask only has to say
which key slots hold real tokens: a (B, M) bool tensor, M <= the number of key slots, where key slot
j is a real token iff j < M and mask[b, j], and the queries are the last Sq of those M columns (the
convention of Transformers' flash-attention masks), or None when every slot is real. When
Transformers finds packed sequences (position_ids restarting within a row, no cache), the mask is
instead the (B, S) int32 document index of each token, which the attention turns into
variable-length sequences.

Mask functions are inspected, not evaluated: a model that asks for a pattern torch_fa4 cannot
express this way (chunked attention, bidirectional image-token overlays, custom functions) gets an
error naming that feature instead of a silently wrong result.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from torch_fa4.integrations.transformers_attention import is_noted, note_padding, note_real_prefix, refuse

# Transformers' mask building blocks (masking_utils, by qualified name) that `fa4_mask` represents
# faithfully: causality and windows travel as attention arguments, padding as the 2-D mask, packed
# sequences as document ids, offsets as the cache alignment.
_SERVED = {
    "causal_mask_function",
    "bidirectional_mask_function",
    "sliding_window_overlay.<locals>.inner_mask",
    "sliding_window_bidirectional_overlay.<locals>.inner_mask",
    "and_masks.<locals>.and_mask",
    "padding_mask_function.<locals>.inner_mask",
    "packed_sequence_mask_function.<locals>.inner_mask",
    "remap_positions_for_packed_sequence.<locals>.inner_mask",
    "add_offsets_to_mask_function.<locals>.inner_mask",
}
# Blocks torch_fa4 cannot express through the attention arguments, with the feature to name.
_UNSERVED = {
    "or_masks.<locals>.or_mask": "a mask overlay that widens attention (or_mask_function, e.g. bidirectional "
                                 "attention over image tokens)",
    "chunked_overlay.<locals>.inner_mask": "chunked attention (attention_chunk_size, e.g. Llama 4)",
    "blockwise_overlay.<locals>.inner_mask": "block-wise bidirectional attention (block_sequence_ids)",
}


def _mask_pieces(mask_function: Optional[Callable]):
    """Every function a composed Transformers mask function is made of (walking closures)."""
    stack, seen = [] if mask_function is None else [mask_function], set()
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        yield fn
        # Combinators and overlays keep the functions they wrap in their closure.
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            items = value if isinstance(value, (tuple, list)) else (value,)
            stack.extend(item for item in items if callable(item) and not isinstance(item, torch.Tensor))


def _qualname(fn) -> str:
    # (from the code object: under torch.compile, Dynamo cannot read a function's __qualname__)
    code = getattr(fn, "__code__", None)
    if code is None:
        return type(fn).__name__
    return getattr(code, "co_qualname", None) or fn.__qualname__  # (Python 3.10: no co_qualname)


def _transformers_name(fn) -> Optional[str]:
    """The qualified name of a masking_utils building block; None for any other function."""
    return _qualname(fn) if getattr(fn, "__module__", "") == "transformers.masking_utils" else None


def unserved_mask_feature(mask_function: Optional[Callable]) -> Optional[str]:
    """The model feature a mask function asks for that "fa4" cannot serve, or None."""
    for fn in _mask_pieces(mask_function):
        name = _transformers_name(fn)
        if name in _UNSERVED:
            return _UNSERVED[name]
        if name not in _SERVED:
            return f"a custom attention mask function ({getattr(fn, '__module__', '?')}.{_qualname(fn)})"
    return None


def packed_sequence_ids(mask_function: Optional[Callable]) -> Optional[torch.Tensor]:
    """The (B, S) document index per token when Transformers decided the batch holds packed
    sequences (it wraps the mask function with one reading that tensor), else None."""
    for fn in _mask_pieces(mask_function):
        if _transformers_name(fn) == "packed_sequence_mask_function.<locals>.inner_mask":
            cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
            if "packed_sequence_mask" in cells:
                return cells["packed_sequence_mask"].cell_contents
    return None


def fa4_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
             mask_function: Optional[Callable] = None, attention_mask: Optional[torch.Tensor] = None,
             device=None, **kwargs) -> Optional[torch.Tensor]:
    """AttentionMaskInterface function for "fa4" (same keyword arguments as Transformers' own)."""
    feature = unserved_mask_feature(mask_function)
    if feature is not None:
        refuse(feature)
    packed = packed_sequence_ids(mask_function)
    if packed is not None:
        # Several documents per row (no padding, no cache): their ids, as int32 (see module doc).
        return packed.to(torch.int32)
    if q_length == 1 and torch.compiler.is_compiling():
        return _decoding_step_in_a_graph(batch_size, kv_length, q_offset, kv_offset, attention_mask, device)
    if q_length == 1 and isinstance(q_offset, torch.Tensor):
        # A one-token step on a static cache (whose query offset is a tensor). generate() builds this
        # mask outside its compiled step and hands it in, so it takes the step's fixed shape here too:
        # a mask growing by a column per step would be a new graph input shape every step (and a new
        # CUDA graph). Eager calls are told how to read it without a mask_mod where they can.
        if attention_mask is not None and attention_mask.shape[-1] == kv_length and is_noted(attention_mask):
            return attention_mask  # (built here already: generate() hands it to the step)
        mask = _decoding_step_in_a_graph(batch_size, kv_length, q_offset, kv_offset, attention_mask, device)
        if attention_mask is None:
            note_real_prefix(mask, min(int(q_offset) + 1 - kv_offset, kv_length))  # (one device read)
        elif bool(attention_mask.all()):  # (one device read per forward)
            note_real_prefix(mask, min(attention_mask.shape[-1], kv_length))
        else:
            note_padding(mask, True)
        return mask
    if attention_mask is not None:
        # Padding: keep the columns of the cached keys (sliding-window caches hold the last ones).
        mask = attention_mask.to(dtype=torch.bool)[:, -kv_length:]
        padded = not bool(mask.all())  # one device read per forward, not one per layer
        if not padded and mask.shape[1] == kv_length:
            return None
        note_padding(mask, padded)
        return mask
    # No padding. A cache with free slots (a static cache) still needs the count of real keys, so
    # the attention does not read the unwritten tail.
    seen = int(q_offset) + q_length - kv_offset  # q_offset is a tensor for static caches: one read
    if seen >= kv_length:
        return None
    mask = torch.ones((batch_size, max(seen, 0)), dtype=torch.bool, device=device)
    note_padding(mask, False)
    return mask


def _decoding_step_in_a_graph(batch_size, kv_length, q_offset, kv_offset, attention_mask, device):
    """Under torch.compile, a one-token step (generate() compiles those for static caches): a
    (B, kv_length) mask of the real, written slots, the same shape every step and read from the
    device never, so one graph serves every step. The one query follows every written slot, so
    bottom-right causality over the whole cache hides none of them, and the mask hides the rest."""
    if attention_mask is None:
        written = torch.arange(kv_length, device=device) < q_offset + 1 - kv_offset
        return written.repeat(batch_size, 1)
    mask = attention_mask.to(dtype=torch.bool)[:, -kv_length:]
    return torch.nn.functional.pad(mask, (0, kv_length - mask.shape[1]), value=False)
