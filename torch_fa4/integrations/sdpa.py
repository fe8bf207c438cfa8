"""Route `F.scaled_dot_product_attention`'s flash backend to torch_fa4 (opt-in).

`import torch_fa4` lists "torch_fa4" among PyTorch's flash-attention providers
(`torch.nn.attention`); nothing changes until `enable()`, activating "torch_fa4" through torch, or
TORCH_FA4_SDPA=1 at import. Once enabled, the CUDA kernels of
`aten::_scaled_dot_product_flash_attention` and its backward (what SDPA's flash backend calls,
eagerly and from torch.compile'd code alike) are replaced: a call torch_fa4's GPU kernels take
(`forward_reason` / `backward_reason`) runs on them, reading SDPA's (B, H, S, D) tensors as
(B, S, H, D) views without copies; any other call (dropout, fp32, sm_80, a head dim the kernels
lack, ...) runs exactly what PyTorch's own kernel runs, `aten::_flash_attention_forward` /
`_backward`. Both keep PyTorch's conventions (LSE (B, H, Sq) float32 in natural log, output
strides of `empty_like(query)`, as the meta kernels promise torch.compile), so a forward run by
one provider and a backward by the other agree.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from typing import Optional

import torch
from torch.nn import attention as torch_attention

from torch_fa4 import dispatch, ops
from torch_fa4.checks import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM

SDPA_IMPL_NAME = "torch_fa4"
ENV_VAR = "TORCH_FA4_SDPA"

# Compute-capability majors torch_fa4 has kernels for: 9 = Hopper (sm_90), 10 = Blackwell (sm_100).
SUPPORTED_MAJORS = (9, 10)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def _transposed(*tensors) -> tuple:
    """Views with dims 1 and 2 swapped: SDPA's (B, H, S, D) as torch_fa4's (B, S, H, D), and back."""
    return tuple(t.transpose(1, 2) for t in tensors)


# ---- Routing: which calls torch_fa4 takes. Pure functions of tensor metadata (unit-tested on CPU);
# `forward_reason` / `backward_reason` add the device and kernel checks.


def input_reason(query, key, value, dropout_p: float = 0.0, return_debug_mask: bool = False) -> Optional[str]:
    """Why torch_fa4 cannot take these SDPA inputs regardless of the device (None: it can)."""
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p} (torch_fa4 has no dropout)"
    if return_debug_mask:
        return "return_debug_mask=True"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t is None or t.dim() != 4:
            return f"{name} is not a dense 4-D (B, H, S, D) tensor"
        if t.is_nested:
            return f"{name} is a nested tensor"
        if t.dtype not in KERNEL_DTYPES:
            return f"{name} has dtype {t.dtype} (kernels take float16/bfloat16)"
        if t.stride(-1) != 1:
            return f"{name}'s head dim is not contiguous"
    if not (query.dtype == key.dtype == value.dtype):
        return "query, key and value dtypes differ"
    b, hq, sq, d = query.shape
    if key.shape[0] != b or value.shape[0] != b:
        return "batch sizes differ"
    if key.shape[:3] != value.shape[:3]:
        return "key and value shapes differ beyond the head dim"
    if key.shape[-1] != d:
        return "query and key head dims differ"
    hkv = key.shape[1]
    if hkv == 0 or hq % hkv:
        return f"{hq} query heads is not a multiple of {hkv} KV heads"
    for name, dim in (("query/key", d), ("value", value.shape[-1])):
        if dim == 0 or dim > MAX_HEAD_DIM or dim % HEAD_DIM_MULTIPLE:
            return f"{name} head dim {dim} (needs a multiple of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM})"
    if sq == 0 or key.shape[2] == 0 or b == 0 or hq == 0:
        return "empty input"
    return None


def arch_reason(capability: tuple[int, int]) -> Optional[str]:
    """Why a GPU of this compute capability is not served (None: it is)."""
    if capability[0] not in SUPPORTED_MAJORS:
        return f"compute capability sm_{capability[0]}{capability[1]} (torch_fa4 runs on sm_90 and sm_100)"
    return None


def device_reason(*tensors) -> Optional[str]:
    """Why these tensors' device is not served (None: one sm_90/sm_100 CUDA device)."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        return "tensors are on several devices"
    (device,) = devices
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    return arch_reason(dispatch.capability(device))


def _op_args(q, k, scale: Optional[float], is_causal: bool) -> tuple:
    """The trailing `torch_fa4::fwd` / `::bwd` arguments for a plain SDPA call on (B, S, H, D) views
    (normalised as `torch_fa4.attention` does: a causal call has window_right = 0)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return (
        [], None, None, None, [], q.shape[1], k.shape[1], float(scale), bool(is_causal),
        -1, 0 if is_causal else -1, 0.0, "", 128, 128,
    )


def _kernel_for(query, key, value, scale, is_causal, direction: str, deterministic: bool = False) -> tuple:
    """(call, kernel): the AttentionCall on (B, S, H, D) views and the GPU kernel module that
    would run it (None: the slow reference would). Not warned about: PyTorch's own kernel runs a
    call torch_fa4 has no kernel for."""
    q, k, v = _transposed(query, key, value)
    call = ops.make_call(q, k, v, *_op_args(q, k, scale, is_causal))
    return call, dispatch.kernel_for(call, direction, warn=False, deterministic=deterministic)


def _kernel_reason(query, key, value, scale, is_causal, direction: str) -> Optional[str]:
    """Why no torch_fa4 GPU kernel (only the slow reference) would run the call (None: one would)."""
    if _kernel_for(query, key, value, scale, is_causal, direction)[1] is None:
        return f"torch_fa4 has no {direction} kernel for this call"
    return None


def forward_reason(query, key, value, dropout_p=0.0, return_debug_mask=False, is_causal=False, scale=None):
    """Why this SDPA flash forward call goes to PyTorch's kernel (None: torch_fa4 takes it)."""
    return (input_reason(query, key, value, dropout_p, return_debug_mask)
            or device_reason(query, key, value)
            or _kernel_reason(query, key, value, scale, is_causal, "forward"))


def backward_reason(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, scale=None,
                    check_kernel: bool = True):
    """Why this SDPA flash backward call goes to PyTorch's kernel (None: torch_fa4 takes it;
    check_kernel=False: leaves out the kernel question, which the caller asks itself)."""
    reason = input_reason(query, key, value, dropout_p) or device_reason(query, key, value, grad_out, out, logsumexp)
    if reason is not None:
        return reason
    b, hq, sq, _ = query.shape
    if grad_out is None or out is None or grad_out.shape != out.shape or out.shape[:3] != query.shape[:3]:
        return "grad_out/out shapes do not match the query"
    if logsumexp is None or logsumexp.dtype != torch.float32 or tuple(logsumexp.shape) != (b, hq, sq):
        return "logsumexp is not (B, H, Sq) float32"
    return _kernel_reason(query, key, value, scale, is_causal, "backward") if check_kernel else None


# ---- The two kernels installed into aten's CUDA dispatch key, and their halves.


@functools.lru_cache(maxsize=256)
def _empty_like_strides(shape: tuple, stride: tuple) -> tuple:
    # Meta tensors cost no memory; the cache keeps this off the per-call path.
    return torch.empty_like(torch.empty_strided(shape, stride, device="meta")).stride()


def _with_layout_of(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` with the strides `torch.empty_like(like)` has: what aten's kernels return and what the
    meta kernels promise torch.compile. No copy in the usual case (SDPA views of (B, S, H, D) memory)."""
    if t.stride() == _empty_like_strides(tuple(like.shape), tuple(like.stride())):
        return t
    return torch.empty_like(like).copy_(t)


def fa4_sdpa_forward(query, key, value, is_causal=False, scale=None, deterministic=False):
    """torch_fa4's half of `_scaled_dot_product_flash_attention`: (B, H, S, D) in, aten's 9 outputs
    out. It runs the fwd op's body: an aten kernel is already below autograd and any mode."""
    q, k, v = _transposed(query, key, value)
    out, lse = ops.fwd_impl(q, k, v, *_op_args(q, k, scale, is_causal), bool(deterministic))
    return _forward_outputs(query, key, out, lse)


def _forward_outputs(query, key, out, lse) -> tuple:
    """aten's 9 outputs from torch_fa4's (B, S, H, D) output and LSE."""
    out = _with_layout_of(out.transpose(1, 2), query)
    lse = lse.float()  # aten's contract is float32 whatever the path (no-op for the kernels' LSE)
    # Seed and offset only matter with dropout, which torch_fa4 never takes: the meta kernel's shapes
    # and dtypes, left uninitialised (nothing reads them).
    seed = torch.empty((2,), dtype=torch.uint64, device=query.device)
    offset = torch.empty((), dtype=torch.uint64, device=query.device)
    debug_mask = torch.empty((0,), dtype=query.dtype, device=query.device)
    return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, debug_mask


def fa4_sdpa_backward(grad_out, query, key, value, out, logsumexp, is_causal=False, scale=None,
                      deterministic=False):
    """torch_fa4's half of `_scaled_dot_product_flash_attention_backward`: (dq, dk, dv) shaped and
    strided like query, key, value. The kernels read strided dO and O (the backward copies only a
    layout its loads cannot take), so any memory order of SDPA's tensors is passed as a view."""
    q, k, v, dout, o = _transposed(query, key, value, grad_out, out)
    grads = ops.bwd_impl(dout, q, k, v, o, logsumexp.contiguous(), *_op_args(q, k, scale, is_causal),
                         bool(deterministic))
    return _backward_outputs(grads, query, key, value)


def _backward_outputs(grads, query, key, value) -> tuple:
    return tuple(_with_layout_of(g.transpose(1, 2), like) for g, like in zip(grads, (query, key, value)))


def _routed_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                    scale=None):
    """CUDA kernel of `_scaled_dot_product_flash_attention`: torch_fa4's kernel when it takes the
    call, else what PyTorch's own kernel computes. The call is built and its kernel found once,
    then launched directly (this is every routed call's host path)."""
    if (input_reason(query, key, value, dropout_p, return_debug_mask) or device_reason(query, key, value)) is None:
        call, kernel = _kernel_for(query, key, value, scale, is_causal, "forward")
        if kernel is not None:
            out, lse = dispatch.run_forward(kernel, call)
            return _forward_outputs(query, key, out, lse)
    q, k, v = _transposed(query, key, value)
    sq, sk = q.shape[1], k.shape[1]
    out, lse, seed, offset, debug_mask = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, sq, sk, dropout_p, is_causal, return_debug_mask, scale=scale
    )
    return out.transpose(1, 2), lse, None, None, sq, sk, seed, offset, debug_mask


def _routed_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                     dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    """CUDA kernel of `_scaled_dot_product_flash_attention_backward`, routed as `_routed_forward`."""
    if backward_reason(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale,
                       check_kernel=False) is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
        call, kernel = _kernel_for(query, key, value, scale, is_causal, "backward", deterministic)
        if kernel is not None:
            _, _, _, dout, o = _transposed(query, key, value, grad_out, out)
            grads = dispatch.run_backward(kernel, call, dout, o, logsumexp.contiguous(), deterministic)
            return _backward_outputs(grads, query, key, value)
    q, k, v, o, dout = _transposed(query, key, value, out, grad_out)
    grads = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, o, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
        philox_seed, philox_offset, scale=scale,
    )
    return _transposed(*grads)


# ---- Installing and removing the kernels; the registry entry; enable() / disable().


class _Installed:
    """The handle torch's registry keeps while torch_fa4 is active: `remove()` restores aten's
    kernels and SDPA's backend priority order."""

    def __init__(self, library: torch.library.Library, priority_before: Optional[list]):
        self._library, self._priority_before = library, priority_before

    def remove(self) -> None:
        if self._library is not None:
            self._library._destroy()  # deregister now, not whenever the garbage collector runs
        if self._priority_before is not None:
            torch._C._set_sdp_priority_order(self._priority_before)
        self._library = self._priority_before = None


def flash_before_cudnn(order: list, flash: int, cudnn: int) -> Optional[list]:
    """`order` with flash moved just ahead of cuDNN, or None when flash already comes first."""
    if flash not in order or cudnn not in order or order.index(flash) < order.index(cudnn):
        return None
    moved = [b for b in order if b != flash]
    moved.insert(moved.index(cudnn), flash)
    return moved


def _put_flash_before_cudnn() -> Optional[list]:
    """Move SDPA's flash backend ahead of cuDNN; return the order to restore, or None if unchanged.

    PyTorch puts cuDNN first on Hopper and Blackwell (sdp_utils.cpp, check_prefer_cudnn_attention),
    so an enabled torch_fa4 would otherwise never see a call that names no backend. PyTorch fixes
    its default order lazily, at the first CUDA SDPA call, overwriting any order set before; so make
    one tiny call first (with aten's own kernels, before ours are installed).
    """
    if not torch.cuda.is_available():
        return None
    tiny = torch.zeros(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        torch.nn.functional.scaled_dot_product_attention(tiny, tiny, tiny)
    before = list(torch._C._get_sdp_priority_order())
    backends = torch_attention.SDPBackend
    order = flash_before_cudnn(before, int(backends.FLASH_ATTENTION), int(backends.CUDNN_ATTENTION))
    if order is None:
        return None
    torch._C._set_sdp_priority_order(order)
    return before


def install_kernels(dispatch_key: str = "CUDA", forward=_routed_forward, backward=_routed_backward) -> _Installed:
    """Put `forward`/`backward` in place of aten's SDPA flash kernels for `dispatch_key`: with the
    defaults, the registry's activation function (tests install on CPU to exercise the wiring)."""
    priority_before = _put_flash_before_cudnn() if dispatch_key == "CUDA" else None
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    with warnings.catch_warnings():
        # Replacing aten's kernel is the point; PyTorch's one-time "Overriding a previously
        # registered kernel" warning would only alarm users.
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*previously registered kernel.*")
        library.impl("_scaled_dot_product_flash_attention", forward, dispatch_key)
        library.impl("_scaled_dot_product_flash_attention_backward", backward, dispatch_key)
    return _Installed(library, priority_before)


def register() -> None:
    """List "torch_fa4" among torch's flash-attention providers (activates nothing). Idempotent."""
    torch_attention.register_flash_attention_impl(SDPA_IMPL_NAME, register_fn=install_kernels)


def enable() -> None:
    """Route SDPA's flash backend to torch_fa4 (replacing any other active provider)."""
    register()
    torch_attention.activate_flash_attention_impl(SDPA_IMPL_NAME)


def disable() -> None:
    """Give SDPA's flash backend back to PyTorch, if torch_fa4 has it."""
    if is_enabled():
        torch_attention.restore_flash_attention_impl()


def is_enabled() -> bool:
    return torch_attention.current_flash_attention_impl() == SDPA_IMPL_NAME


@contextlib.contextmanager
def enabled():
    """`with torch_fa4.sdpa.enabled(): ...` routes SDPA to torch_fa4 inside the block, then restores
    whichever provider was active before."""
    previous = torch_attention.current_flash_attention_impl()
    enable()
    try:
        yield
    finally:
        if previous is None:
            disable()
        elif previous != SDPA_IMPL_NAME:
            torch_attention.activate_flash_attention_impl(previous)


def env_requests_enable(environ=os.environ) -> bool:
    return environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def setup_on_import() -> None:
    """What `import torch_fa4` does: list the provider; enable it only if TORCH_FA4_SDPA asks."""
    register()
    if env_requests_enable():
        enable()
