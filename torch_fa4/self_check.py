"""First-use self-check: a kernel never run on an architecture is tried before it is trusted there.

A kernel family counts as verified on a compute capability only where its GPU tests run
(`VERIFIED`). On any other capability, the first call that would run a variant (a forward or a
backward kernel, as the kernel family names it through `variant(call, direction, deterministic)`)
first runs that variant on a small problem with the same features: fresh random inputs, the same
dtype, head dims, GQA ratio, causal / window / softcap, varlen and `seqused_k`, the same mods with a
block mask rebuilt for the small shape. It compares the result with the reference on the same
device (forward: out and LSE; backward: dQ, dK, dV from the reference's out and LSE). The small
problem is the smallest of a few candidate shapes for which the family picks the same variant;
where none does, the call's own shape is used.

A variant that fails (a wrong value, a NaN, an exception) is reported by one warning naming the
variant and the device, and that variant's calls take the dispatcher's next path from then on (the
next kernel family for the architecture, at the end the reference); the
call itself returns the right answer. A verdict is kept for the process and on disk under
`$TORCH_FA4_CACHE_DIR/self_check` (private folder, as the kernel cache), keyed by the device name
and capability, the driver version, the package's source and CuTe DSL's version, the direction
and the variant, so later processes skip the check.

`TORCH_FA4_SELF_CHECK=0` turns the check off; `=1` checks every variant on every capability,
verified ones included, once per process, without reading stored verdicts.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import time
import warnings
from dataclasses import replace
from typing import Hashable, Optional

import torch

from torch_fa4 import private_cache, reference
from torch_fa4.call import AttentionCall

ENV = "TORCH_FA4_SELF_CHECK"
VERIFIED = frozenset({(9, 0)})  # where the kernel families' GPU tests run: H100, H200

# relative norm error allowed, in units of the dtype's epsilon: a correct kernel stays below 2
# (its error and the reference's rounding), a wrong tile or layout costs far more than 8
_TOLERANCE_EPS = 8.0
_LENGTHS = (130, 700)  # candidate small query lengths: one tile and a bit, a few tiles

_verdicts: dict[tuple, bool] = {}
_warned: set[tuple] = set()
checks_run = 0  # how many checks this process ran (tests read it)


class SelfCheckWarning(UserWarning):
    """A kernel variant gave wrong results in its first-use self-check and is not used."""


def mode() -> str:
    """"off", "force" or "auto" from TORCH_FA4_SELF_CHECK ("0", "1", unset)."""
    value = os.environ.get(ENV, "").strip().lower()
    return {"0": "off", "off": "off", "1": "force", "force": "force"}.get(value, "auto")


def needed(capability: tuple[int, int]) -> bool:
    m = mode()
    return m == "force" or (m == "auto" and tuple(capability) not in VERIFIED)


def variant_of(family, call: AttentionCall, direction: str, deterministic: bool) -> Hashable:
    """The kernel family's name for the variant that would run `call`; the call's features where
    the family names none."""
    named = getattr(family, "variant", None)
    if named is not None:
        return named(call, direction, deterministic)
    return _features(call, direction, deterministic)


def _features(call: AttentionCall, direction: str, deterministic: bool) -> tuple:
    return (direction, str(call.q.dtype), call.head_dim, call.head_dim_v,
            call.num_heads // call.num_heads_kv > 1, call.causal, call.window_left >= 0,
            call.window_right >= 0, call.softcap > 0, call.is_varlen, call.seqused_k is not None,
            call.mod_key, bool(call.block_mask), direction == "backward" and deterministic)


def trusted(family, module, call: AttentionCall, direction: str, deterministic: bool, capability) -> bool:
    """Whether `module` (the `direction` kernels of kernel family `family`, an architecture package)
    may run `call` on this device: True without a check where the capability is verified, else the
    variant's verdict (checked now if no verdict is known)."""
    if not needed(capability):
        return True
    variant = variant_of(family, call, direction, deterministic)
    name = getattr(family, "__name__", type(family).__name__)
    key = (name, direction, repr(variant), _device_identity(call.q.device))
    verdict = _verdicts.get(key)
    if verdict is None:
        stored = None if mode() == "force" else _load(key)
        if stored is None:
            ok, detail = _check(family, module, call, direction, deterministic, variant)
            _store(key, ok, detail)
        else:
            ok, detail = stored
        verdict = _verdicts[key] = ok
        if not ok and key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"torch_fa4: the {name.rsplit('.', 1)[-1]} {direction} variant {variant!r} gave wrong "
                f"results on {key[3][0]} (compute capability {key[3][1]}) in its first-use "
                f"self-check ({detail}); its calls run on the next kernel family (at the end the PyTorch "
                f"reference) instead. "
                f"Please report it with this message.", SelfCheckWarning, stacklevel=4)
    return verdict


# ---- the check ------------------------------------------------------------------------------------

def _check(family, module, call, direction, deterministic, variant) -> tuple[bool, str]:
    global checks_run
    checks_run += 1
    start = time.perf_counter()
    try:
        small = _small_call(family, call, direction, deterministic, variant)
        if direction == "forward":
            detail = _check_forward(module, small)
        else:
            detail = _check_backward(module, small, deterministic)
    except Exception as e:  # noqa: BLE001  (a variant that raises is a variant that failed)
        detail = f"raised {type(e).__name__}: {e}"
    seconds = time.perf_counter() - start
    return detail is None, detail or f"passed in {seconds:.2f} s"


def _tolerance(dtype: torch.dtype) -> float:
    return _TOLERANCE_EPS * torch.finfo(dtype).eps


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> Optional[str]:
    got, want = got.double(), want.double()
    if torch.isnan(got).any():
        return f"{name} has NaN"
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite], want[~finite]):
        return f"{name} differs where the reference is infinite"
    err = (got[finite] - want[finite]).norm() / want[finite].norm().clamp_min(1e-30)
    return f"{name} relative error {err.item():.3g} > {tol:.3g}" if err > tol else None


def _compare_lse(got: torch.Tensor, want: torch.Tensor, tol: float) -> Optional[str]:
    """LSE by absolute error: an error e in it scales the row's output by exp(e) ~ 1 + e."""
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    if torch.isnan(got).any() or not torch.equal(got[~finite], want[~finite]):
        return "lse has NaN or differs where the reference is infinite"
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    return f"lse error {err:.3g} > {tol:.3g}" if err > tol else None


def _check_forward(module, call: AttentionCall) -> Optional[str]:
    want_out, want_lse = reference.forward(call)
    out = torch.full_like(want_out, math.nan)
    lse = torch.full(call.lse_shape(), math.nan, dtype=torch.float32, device=call.q.device)
    module.forward(call, out, lse)
    tol = _tolerance(call.q.dtype)
    return _compare("out", out, want_out, tol) or _compare_lse(lse, want_lse, tol)


def _check_backward(module, call: AttentionCall, deterministic: bool) -> Optional[str]:
    out, lse = reference.forward(call)
    dout = torch.randn_like(out)
    want = reference.backward(call, dout, out, lse)
    got = [torch.full_like(t, math.nan) for t in (call.q, call.k, call.v)]
    module.backward(call, dout, out, lse, *got, deterministic)
    tol = _tolerance(call.q.dtype)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        problem = _compare(name, g, w, tol)
        if problem:
            return problem
    return None


# ---- the small problem ----------------------------------------------------------------------------

def _small_call(family, call: AttentionCall, direction, deterministic, variant) -> AttentionCall:
    """The smallest candidate problem the family runs with `variant`, else the call's own shape."""
    candidates = [_shrunk(call, length) for length in _LENGTHS] + [_shrunk(call, None)]
    for small in candidates:
        if variant_of(family, small, direction, deterministic) == variant:
            return small
    return _fresh(call, call.q.shape, call.k.shape, call.v.shape, call.cu_seqlens_q, call.cu_seqlens_k,
                  call.seqused_k, call.max_seqlen_q, call.max_seqlen_k)


def _lengths(call: AttentionCall) -> tuple[list[int], list[int]]:
    if call.is_varlen:
        return torch.diff(call.cu_seqlens_q).tolist(), torch.diff(call.cu_seqlens_k).tolist()
    return [call.q.shape[1]] * call.batch, [call.k.shape[1]] * call.batch


def _shrunk(call: AttentionCall, length: Optional[int]) -> AttentionCall:
    """At most two sequences and one KV head's group of query heads, of query length at most
    `length` (keys scaled alike; None keeps the lengths)."""
    q_lens, k_lens = _lengths(call)
    keep = max(range(len(q_lens)), key=lambda i: (q_lens[i], k_lens[i]))  # the longest sequence
    picks = sorted({0, keep})
    q_lens, k_lens = [q_lens[i] for i in picks], [k_lens[i] for i in picks]
    if length is not None:
        k_lens = [min(k, max(1, round(k * length / max(q, 1)))) for q, k in zip(q_lens, k_lens)]
        q_lens = [min(q, length) for q in q_lens]
    group = call.num_heads // call.num_heads_kv
    d, dv = call.head_dim, call.head_dim_v
    used = None
    if call.seqused_k is not None:
        full = call.seqused_k[picks].tolist()
        used = torch.tensor([min(u, k) for u, k in zip(full, k_lens)], dtype=torch.int32,
                            device=call.q.device)
    if call.is_varlen:
        cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                       device=call.q.device)
        return _fresh(call, (sum(q_lens), group, d), (sum(k_lens), 1, d), (sum(k_lens), 1, dv),
                      cu(q_lens), cu(k_lens), used, max(q_lens), max(k_lens))
    b = len(picks)
    return _fresh(call, (b, q_lens[0], group, d), (b, k_lens[0], 1, d), (b, k_lens[0], 1, dv), None, None,
                  used, 0, 0)


def _fresh(call: AttentionCall, q_shape, k_shape, v_shape, cu_q, cu_k, used, max_q, max_k) -> AttentionCall:
    dev, dtype = call.q.device, call.q.dtype
    q, k, v = (torch.randn(s, device=dev, dtype=dtype) for s in (q_shape, k_shape, v_shape))
    small = replace(call, q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used,
                    max_seqlen_q=max_q, max_seqlen_k=max_k)
    if call.block_mask:
        small = replace(small, block_mask=_block_mask_for(small))
    return small


def _block_mask_for(call: AttentionCall) -> tuple:
    """The call's mask as a block mask for its (small) shape, batch and heads kept broadcast
    where the call's own block mask broadcasts them."""
    from torch_fa4.mods.block_mask import _compress, _evaluate_tiles

    batch = 1 if call.block_mask[0].shape[0] == 1 else call.batch
    heads = 1 if call.block_mask[0].shape[1] == 1 else call.num_heads
    sq = call.max_seqlen_q if call.is_varlen else call.q.shape[1]
    sk = call.max_seqlen_k if call.is_varlen else call.k.shape[1]
    if call.mods is not None and call.mods.mask_graph is not None:
        any_, all_ = _evaluate_tiles(call.mods, call.mask_aux, batch, heads, sq, sk, call.block_mask_q,
                                     call.block_mask_kv, call.q.device)
    else:
        shape = (batch, heads, -(-sq // call.block_mask_q), -(-sk // call.block_mask_kv))
        any_ = all_ = torch.ones(shape, dtype=torch.bool, device=call.q.device)
    return (*_compress(any_ & ~all_), *_compress(any_ & all_))


# ---- verdicts on disk -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _device_identity(device: torch.device) -> tuple:
    if device.type != "cuda":
        return (device.type, "-", "-")
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return (props.name, f"{props.major}.{props.minor}", _driver_version())


def _driver_version() -> str:
    try:
        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return str(version.value)
    except (OSError, AttributeError):
        return "?"


def _path(key: tuple):
    from torch_fa4.kernels import disk_cache

    return disk_cache.cache_dir().parent / "self_check" / f"{disk_cache.digest(('self_check',) + key)}.json"


def _load(key: tuple) -> Optional[tuple[bool, str]]:
    path = _path(key)
    if not path.exists() or not (private_cache.trusted_dir(path.parent) and private_cache.trusted_file(path)):
        return None
    try:
        entry = json.loads(path.read_text())
        return bool(entry["ok"]), str(entry["detail"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store(key: tuple, ok: bool, detail: str) -> None:
    path = _path(key)
    if not private_cache.make_private_dir(path.parent):
        return
    entry = {"ok": ok, "detail": detail, "module": key[0], "direction": key[1], "variant": key[2],
             "device": list(key[3])}
    try:
        private_cache.atomic_write(path, json.dumps(entry).encode())
    except OSError:
        pass  # best effort: a later process checks again
