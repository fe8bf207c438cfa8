"""Public API: `attention` (flash-attn style, B S H D) and `flex_attention` (torch flex, B H S D).

Both normalise their arguments, check them (`checks`), turn mods into a registry key plus captured
tensors (`torch_fa4.mods.prepare`) and call the `torch_fa4::fwd` op, which autograd and
torch.compile understand (eager calls that record autograd reach the same op through
`eager_autograd`, whose bookkeeping is cheaper).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from torch_fa4 import checks, eager_autograd, ops
from torch_fa4.kernels.host import shape_memo

ScoreMod = Callable[..., torch.Tensor]
MaskMod = Callable[..., torch.Tensor]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[Optional[int], Optional[int]] = (None, None),
    softcap: float = 0.0,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    block_mask=None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    seqused_k: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    deterministic: bool = False,
):
    """Exact softmax attention over (B, S, H, D) tensors, flash-attn style.

    q: (B, Sq, Hq, D), or (total_q, Hq, D) with `cu_seqlens_q` (int32, B + 1 offsets).
    k, v: (B, Sk, Hkv, D) / (B, Sk, Hkv, Dv), or (total_k, Hkv, D) with `cu_seqlens_k`.
    Hq must be a multiple of Hkv (GQA/MQA). Any strides work as long as the last dim is contiguous.

    scale: defaults to 1/sqrt(D). causal: bottom-right aligned when Sq != Sk (flash-attn).
    window_size: (left, right) keys visible around the aligned diagonal; None or -1 = unbounded.
    softcap: s -> softcap * tanh(s / softcap) before score_mod (0 disables).
    score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx, kv_idx): FlexAttention-style
    callables, fused into the kernel. block_mask: a `torch_fa4.create_block_mask` result (its
    mask_mod is applied, its tile map lets kernels skip empty tiles).
    seqused_k: (B,) int32, keys used per batch (KV caches).
    page_table: (B, max_pages) int32, for paged KV caches (inference: forward only). k and v are
    then caches of pages, (num_pages, page_size, Hkv, D) / (..., Dv), and sequence b's keys are
    the rows of pages page_table[b, 0], page_table[b, 1], ... in order; seqused_k gives each
    sequence's length (without it every sequence has max_pages * page_size keys). Entries past a
    sequence's last used page are never read. q may be packed (cu_seqlens_q); cu_seqlens_k may
    not come with a page table. return_lse: also return the
    log-sum-exp (float32, (B, Hq, Sq) or (Hq, total_q); natural log; -inf for fully masked rows;
    detached: no gradient flows through it). deterministic: deterministic backward.

    Returns out, shaped like q with head dim Dv (and lse if return_lse).
    """
    paged = page_table is not None
    checks.check_qkv(q, k, v, varlen_q=cu_seqlens_q is not None,
                     varlen_k=cu_seqlens_k is not None and not paged, paged=paged)
    if paged:
        recorded = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        checks.check_page_table(q, k, page_table, cu_seqlens_q, cu_seqlens_k, recorded)
    checks.check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, paged=paged)
    checks.check_max_seqlen(max_seqlen_q, max_seqlen_k)
    window_left, window_right = checks.check_scalars(scale, softcap, window_size)
    if causal:
        window_right = 0  # causal bounds the right side at the diagonal (flash-attn's convention)
    if not torch.compiler.is_compiling():
        checks.check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                                   page_table)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])

    keys = page_table.shape[1] * k.shape[1] if paged else k.shape[-3]  # per sequence (dense, paged)
    if score_mod is None and mask_mod is None and block_mask is None:
        mod_key, aux_tensors, bm_tensors, bm_q, bm_kv = "", [], [], 128, 128
    else:
        varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        (mod_key, aux_tensors, bm_tensors, bm_q, bm_kv, causal, window_left, window_right,
         softcap) = _mod_arguments(score_mod, mask_mod, block_mask, q, keys, varlen, seqused_k is not None,
                                   causal, window_left, window_right, softcap)

    max_seqlen_q = _max_seqlen(max_seqlen_q, cu_seqlens_q, q)
    max_seqlen_k = keys if paged else _max_seqlen(max_seqlen_k, cu_seqlens_k, k)
    if paged:
        paged_rest = (aux_tensors, cu_seqlens_q, seqused_k, bm_tensors, max_seqlen_q, max_seqlen_k,
                      float(scale), bool(causal), window_left, window_right, float(softcap), mod_key, bm_q, bm_kv)
        return _paged(q, k, v, page_table, paged_rest, return_lse)
    rest = (aux_tensors, cu_seqlens_q, cu_seqlens_k, seqused_k, bm_tensors, max_seqlen_q, max_seqlen_k,
            float(scale), bool(causal), window_left, window_right, float(softcap), mod_key, bm_q, bm_kv,
            bool(deterministic))
    route = eager_autograd.route(q, k, v, rest)
    if route == "function":  # the same op, without its generic autograd wrapper
        out, lse = eager_autograd.AttentionFunction.apply(q, k, v, rest)
    elif route == "direct":  # eager, no autograd: the op's body, without its entry
        out, lse = ops.fwd_impl(q, k, v, *rest)
    else:
        out, lse = torch.ops.torch_fa4.fwd(q, k, v, *rest)
    return (out, lse.detach()) if return_lse else out


def _paged(q, k_cache, v_cache, page_table, rest, return_lse):
    """The torch_fa4::fwd_paged op (forward only), or in eager mode where nothing could intercept
    it, its body (no op entry on a decode step's path)."""
    aux_tensors, cu_seqlens_q, seqused_k, bm_tensors = rest[:4]
    tensors = (aux_tensors, cu_seqlens_q, None, seqused_k, bm_tensors)  # as route reads the fwd op's
    route = eager_autograd.route(q, k_cache, v_cache, tensors)
    if route == "direct" and type(page_table) is torch.Tensor:
        out, lse = ops.fwd_paged_impl(q, k_cache, v_cache, page_table, *rest)
    else:
        out, lse = torch.ops.torch_fa4.fwd_paged(q, k_cache, v_cache, page_table, *rest)
    return (out, lse) if return_lse else out


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Optional[ScoreMod] = None,
    block_mask=None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    *,
    mask_mod: Optional[MaskMod] = None,
):
    """torch.nn.attention.flex_attention's signature on (B, H, S, D) tensors, run by torch_fa4.

    The mask comes from `block_mask` (built by `torch_fa4.create_block_mask`, or torch's own
    `create_block_mask`), as in FlexAttention; `mask_mod` may be given directly instead.
    Returns out (B, Hq, Sq, Dv) (and lse (B, Hq, Sq), natural log, if return_lse).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"torch_fa4: flex_attention's {name} must be a 4-D (B, H, S, D) tensor, got {shape}")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"torch_fa4: query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True for GQA/MQA"
        )
    result = attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        scale=scale, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, return_lse=return_lse,
    )
    if return_lse:
        out, lse = result
        return out.transpose(1, 2), lse
    return result.transpose(1, 2)


def _max_seqlen(given, cu_seqlens, t):
    if given is not None:
        return int(given)
    if cu_seqlens is None:
        return t.shape[1] if t.dim() == 4 else t.shape[0]
    if cu_seqlens.numel() < 2:
        return 0
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def _mod_arguments(score_mod, mask_mod, block_mask, q, keys, varlen, has_seqused, causal, window_left, window_right,
                   softcap):
    """The op arguments of a call's mods and block mask: (mod key, captured tensors, block mask
    tensors, block q, block kv, causal, window_left, window_right, softcap), after folding what
    is a built-in (`_as_builtins`). Eager calls keep all but the tracing key per what decides it
    (mods/call_memo.py); `prepare` runs on every call."""
    compiling = torch.compiler.is_compiling()
    lists = None
    if block_mask is not None and not compiling:
        lists = _call_memo().block_mask_lists(block_mask)
    if compiling or (block_mask is not None and lists is None):
        # traced (the steps go into the graph), or not a block mask (as_block_mask names the error)
        mask_mod, bm_tensors, bm_q, bm_kv = _unpack_block_mask(block_mask, mask_mod)
        mod_key, aux = _prepare_mods(score_mod, mask_mod)
        _check_aux_tensors(aux, q.device)
        return _folded(mod_key, aux, bm_tensors, bm_q, bm_kv, q, keys, varlen, has_seqused, causal, window_left,
                       window_right, softcap)[:9]
    bm_q, bm_kv = 128, 128
    bm_tensors = ()
    if lists is not None:
        bm_mask_mod, bm_tensors, (bm_q, bm_kv) = lists
        _check_one_mask(mask_mod, bm_mask_mod)
        mask_mod = bm_mask_mod
    mod_key, aux = "", []
    if score_mod is not None or mask_mod is not None:
        mod_key, aux = _call_memo().prepare(score_mod, mask_mod)
    tensors = (*bm_tensors, *aux)
    extra = (mod_key, bm_q, bm_kv, q.shape[1], q.device, keys, varlen, has_seqused, causal, window_left, window_right,
             softcap)
    memo = _call_memo().MOD_ARGUMENTS
    found = memo.get(tensors, extra)
    if found is None:
        _check_aux_tensors(aux, q.device)
        found = _folded(mod_key, aux, list(bm_tensors), bm_q, bm_kv, q, keys, varlen, has_seqused, causal,
                        window_left, window_right, softcap)
        # (the entry keeps the captured tensors as a slice of the call's and its own block mask as
        # "keep": no tensor of the caller; re-listed lists themselves)
        memo.put(tensors, extra, (found[0], None, found[2] if found[10] == "rest" else None, *found[3:]))
        return found[:9]
    key, _, relisted, bm_q, bm_kv, causal, window_left, window_right, softcap, (aux_from, aux_to), bm_mode = found
    bm = list(bm_tensors) if bm_mode == "keep" else relisted if bm_mode == "rest" else []
    return key, list(aux[aux_from:aux_to]), bm, bm_q, bm_kv, causal, window_left, window_right, softcap


_call_memo_module = None


def _call_memo():
    """torch_fa4.mods.call_memo, imported on first use (mods stay out of `import torch_fa4`)."""
    global _call_memo_module
    if _call_memo_module is None:
        from torch_fa4.mods import call_memo

        _call_memo_module = call_memo
    return _call_memo_module


def _check_one_mask(mask_mod, bm_mask_mod):
    if mask_mod is not None and mask_mod is not bm_mask_mod:
        raise ValueError("torch_fa4: pass either mask_mod or a block_mask built from it, not two different masks")


def _folded(mod_key, aux, bm_tensors, bm_q, bm_kv, q, keys, varlen, has_seqused, causal, window_left, window_right,
            softcap):
    """`_mod_arguments`' answer from the traced key on: (mod key, captured tensors, block mask
    tensors, block q, block kv, causal, window_left, window_right, softcap, (from, to) of the
    captured tensors kept, block mask "keep" / "drop" / "rest")."""
    if mod_key:
        fold = _fold(mod_key, q.shape[1], keys, varlen, has_seqused, window_left, window_right, softcap)
        if fold is not None:
            new_key, aux_from, aux_to, mask_folded, window_left, window_right, softcap, bm_mode, found = fold
            if bm_mode == "rest":
                bm_tensors = _rest_block_mask(found, aux, bm_tensors, bm_q, bm_kv, q.shape[1], keys)
            elif bm_mode == "drop":
                bm_tensors = []
            if mask_folded:
                causal = window_right == 0
            if not bm_tensors:
                bm_q, bm_kv = 128, 128
                bm_mode = "drop"
            return (new_key, list(aux[aux_from:aux_to]), bm_tensors, bm_q, bm_kv, causal, window_left, window_right,
                    softcap, (aux_from, aux_to), bm_mode)
    if not bm_tensors:
        bm_q, bm_kv = 128, 128
    return (mod_key, list(aux), bm_tensors, bm_q, bm_kv, causal, window_left, window_right, softcap, (None, None),
            "keep" if bm_tensors else "drop")


def _unpack_block_mask(block_mask, mask_mod):
    if block_mask is None:
        return mask_mod, [], 128, 128
    from torch_fa4.mods import as_block_mask

    bm = as_block_mask(block_mask)
    _check_one_mask(mask_mod, bm.mask_mod)
    bq, bkv = bm.BLOCK_SIZE
    return bm.mask_mod, list(bm.as_tensors()), int(bq), int(bkv)


def _prepare_mods(score_mod, mask_mod):
    if score_mod is None and mask_mod is None:
        return "", []
    from torch_fa4.mods import prepare

    return prepare(score_mod, mask_mod)


def _as_builtins(mod_key, aux, q, k_len, varlen, has_seqused, window_left, window_right, softcap, bm_tensors,
                 bm_q, bm_kv):
    """Mods that are causal, a sliding window or a tanh softcap, as the built-in arguments
    (torch_fa4.mods.idioms): (mod_key, aux, mask folded, window_left, window_right, softcap,
    block mask tensors), or None where nothing folds. A mask `causal & rest` keeps `rest` and its
    block mask, whose tiles partial only along the diagonal become full (mods.block_lists).
    What folds depends on the mod key, the lengths and the scalars only: eager calls keep it per
    those (`_FOLDS`); the captured tensors and block mask of each call are then sliced / re-listed."""
    fold = _fold(mod_key, q.shape[1], k_len, varlen, has_seqused, window_left, window_right, softcap)
    if fold is None:
        return None
    new_key, aux_from, aux_to, mask_folded, window_left, window_right, softcap, block_mask, found = fold
    if block_mask == "keep":
        bm = bm_tensors
    elif block_mask == "drop":
        bm = []
    else:
        bm = _rest_block_mask(found, aux, bm_tensors, bm_q, bm_kv, q.shape[1], k_len)
    return new_key, list(aux[aux_from:aux_to]), mask_folded, window_left, window_right, softcap, bm


def _fold(mod_key, q_len, k_len, varlen, has_seqused, window_left, window_right, softcap):
    """`_fold_of`, kept per its arguments in eager mode."""
    if torch.compiler.is_compiling():
        return _fold_of(mod_key, q_len, k_len, varlen, has_seqused, window_left, window_right, softcap, True)
    key = (mod_key, q_len, k_len, varlen, has_seqused, window_left, window_right, softcap)
    fold = _FOLDS.get(key, _UNKNOWN)
    if fold is _UNKNOWN:
        fold = _fold_of(mod_key, q_len, k_len, varlen, has_seqused, window_left, window_right, softcap, False)
        if len(_FOLDS) >= shape_memo.CAPACITY:  # a bound, not an eviction policy
            _FOLDS.clear()
        _FOLDS[key] = fold
    return fold


_UNKNOWN = object()
_FOLDS = shape_memo.table()  # (mod key, Sq, Sk, varlen, seqused_k given, window, softcap) -> _fold_of's answer


def _fold_of(mod_key, q_len, k_len, varlen, has_seqused, window_left, window_right, softcap, compiling):
    """How the mods of `mod_key` fold into built-in arguments for a call of these lengths and
    scalars: (mod key, captured tensors kept as a slice (from, to), mask folded, window_left,
    window_right, softcap, block mask "keep" / "drop" / "rest", idioms.Builtins), or None."""
    from torch_fa4.mods.idioms import builtins_of, window_for

    found = builtins_of(mod_key)
    if found is None:
        return None
    window = rest_window = None
    one_diagonal = not varlen and not has_seqused  # one diagonal for the whole call
    if found.band is not None and one_diagonal:
        window = window_for(found.band, q_len, k_len, window_left, window_right)
    if found.rest_band is not None and one_diagonal and not compiling:
        # (causal only: the block-sparse kernels' walks are measured and tested with it)
        if window_for(found.rest_band, q_len, k_len, window_left, window_right) == (-1, 0):
            rest_window = (-1, 0)
    fold_cap = bool(found.softcap) and not softcap  # (a built-in softcap already comes first)
    if window is not None and fold_cap:
        return "", 0, 0, True, *window, found.softcap, "drop", found
    if window is not None:
        return found.key_without_mask, None, found.score_aux, True, *window, softcap, "drop", found
    if rest_window is not None:
        return found.key_with_rest, None, None, True, *rest_window, softcap, "rest", found
    if not fold_cap:
        return None
    return (found.key_without_score, found.score_aux, None, False, window_left, window_right, found.softcap,
            "keep", found)


def _rest_block_mask(found, aux, bm_tensors, bm_q, bm_kv, q_len, k_len):
    if not bm_tensors:
        return []
    from torch_fa4.mods import block_lists
    from torch_fa4.mods.registry import lookup

    return block_lists.without_band(bm_tensors, bm_q, bm_kv, found.rest_band, lookup(found.key_with_rest),
                                    list(aux[found.score_aux:]), q_len, k_len)


def _check_aux_tensors(aux_tensors, device) -> None:
    # Captured tensors may require grad: the score_mod's get gradients (torch_fa4/mods/capture_grad.py),
    # the mask_mod's none (a boolean output has no derivative), as torch autograd's comparisons.
    for t in aux_tensors:
        # A kernel reads captured tensors through raw device pointers: a host tensor would be garbage.
        if t.device != device:
            raise ValueError(
                f"torch_fa4: a tensor captured by score_mod/mask_mod is on {t.device} but q is on {device}; "
                "create it on q's device"
            )
