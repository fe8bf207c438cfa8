"""Device and architecture -> backend: the one place that picks who computes a call.

CUDA devices of compute capability 9.x go to `torch_fa4.kernels.sm90`; 8.x and 12.x to the
portable kernels (`torch_fa4.kernels.portable`: warp-level MMA, every GPU since Ampere); 10.x to
`torch_fa4.kernels.sm100.pair` (two CTAs per matmul), else `torch_fa4.kernels.sm100`, and where
that cannot take a call (or fails its self-check) to the portable kernels. Packages are imported
on first use (CuTe DSL stays out of `import torch_fa4`). A
kernel that cannot take a call says why through `unsupported_reason`, and the call runs on the
next family of the list, at the end on the exact reference (warned once per reason, unless the
family's package sets `QUIET_REFUSALS`: a specialised family whose next family is no slower). Everything
else (CPU, older GPUs, float32/float64) runs on the reference. `TORCH_FA4_BACKEND=reference` forces
the reference everywhere, `TORCH_FA4_BACKEND=portable` the portable kernels on any CUDA GPU.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

from torch_fa4 import reference, self_check
from torch_fa4.call import AttentionCall, empty_laid_out_like
from torch_fa4.kernels.host import shape_memo

_SM90 = "torch_fa4.kernels.sm90"
_SM100 = "torch_fa4.kernels.sm100"
_SM100_PAIR = "torch_fa4.kernels.sm100.pair"
PORTABLE = "torch_fa4.kernels.portable"
# kernel families per compute capability major, tried in order (each may refuse a call)
_ARCH_PACKAGES = {8: (PORTABLE,), 9: (_SM90,), 10: (_SM100_PAIR, _SM100, PORTABLE), 12: (PORTABLE,)}
_warned: set[str] = set()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, asked of the driver once per device."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


_modules: dict[tuple[str, str], object] = {}


def _kernel_module(name: str, direction: str):
    """The module holding `direction`'s kernel of architecture package `name`, or None. Looked up
    once: this sits on every call's path."""
    key = (name, direction)
    if key not in _modules:
        try:  # the forward lives in the architecture package itself, the backward in `<pkg>.bwd`
            _modules[key] = importlib.import_module(name if direction == "forward" else name + ".bwd")
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith(name):
                raise
            _modules[key] = None
    return _modules[key]


def on_gpu(call: AttentionCall) -> bool:
    return call.q.device.type == "cuda"


def kernel_for(call: AttentionCall, direction: str, warn: bool = True, deterministic: bool = False):
    """Return the kernel module that runs `call` ("forward" or "backward"), or None for the reference.

    On a capability where the kernel family is not verified, its variant runs only once it has
    passed its first-use self-check (torch_fa4/self_check.py). With warn=False (SDPA routing,
    which falls back to PyTorch's own kernel instead) a refusal is neither warned about nor
    remembered as warned. The choice for a call without mods or block mask is kept per layout
    (`_plain_layout`): decode steps and SDPA calls repeat it on every call; with mods or a block
    mask the key also holds what the families read of them (shape_memo.mods_layout).
    """
    backend = os.environ.get("TORCH_FA4_BACKEND", "").lower()
    if backend == "reference":
        return None
    if not on_gpu(call) or call.q.numel() == 0 or call.k.shape[-3] == 0 or call.batch == 0:
        return None
    layout = _plain_layout(call)
    if layout is not None:
        key = (layout, backend, direction, warn, deterministic)
        found = _chosen.get(key, _UNKNOWN)
        if found is not _UNKNOWN:
            return found
    cap = capability(call.q.device)
    module = _choose(call, direction, warn, deterministic, cap, backend)
    if layout is not None and not self_check.needed(cap):  # (a self-check's verdict may be pending)
        if len(_chosen) >= shape_memo.CAPACITY:
            _chosen.clear()
        _chosen[key] = module
    return module


_UNKNOWN = object()
_chosen = shape_memo.table()  # (_plain_layout, backend, direction, warn, deterministic) -> module


def _plain_layout(call: AttentionCall):
    """What a family's `unsupported_reason` reads of a call without mods or block mask: dtypes,
    shapes, strides, 16-byte alignment, the scalars, which of the offsets / seqused_k / page table
    come and their shapes (never their values), and with mods or a block mask `mods_layout`;
    None where that is None (the choice is then made every time)."""
    mods = None
    if call.mods is not None or call.aux_tensors or call.block_mask or call.mod_key:
        if (mods := shape_memo.mods_layout(call)) is None:
            return None
    q, k, v, table = call.q, call.k, call.v, call.page_table
    return (q.device, q.dtype, k.dtype, v.dtype, q.shape, k.shape, v.shape, q.stride(), k.stride(),
            v.stride(), (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16, call.causal, call.window_left,
            call.window_right, call.softcap, call.scale < 0, call.max_seqlen_q, call.max_seqlen_k,
            *(None if t is None else t.shape for t in (call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k)),
            None if table is None else (table.shape, table.stride()), mods)


def _choose(call: AttentionCall, direction: str, warn: bool, deterministic: bool, cap: tuple, backend: str):
    names = (PORTABLE,) if backend == "portable" else _ARCH_PACKAGES.get(cap[0], ())
    for i, name in enumerate(names):
        module = _kernel_module(name, direction)
        if module is None or getattr(module, direction, None) is None:
            reason = f"no {direction} kernel for this architecture yet"
        else:
            reason = module.unsupported_reason(call)
        if reason is not None:
            quiet = getattr(_kernel_module(name, "forward"), "QUIET_REFUSALS", False)
            if warn and not quiet and reason not in _warned:
                _warned.add(reason)
                fallback = (f"the {names[i + 1].rsplit('.', 1)[-1]} kernels" if i + 1 < len(names)
                            else "the PyTorch reference")
                family = name.rsplit('.', 1)[-1]
                warnings.warn(f"torch_fa4: {family} {direction} falls back to {fallback}: {reason}",
                              stacklevel=4)
            continue
        if self_check.needed(cap) and not self_check.trusted(_kernel_module(name, "forward"), module, call,
                                                               direction, deterministic, cap):
            continue
        return module
    return None


def host_checks(call: AttentionCall) -> None:
    """What every backend needs checked on the host before it runs: a mod's captured-tensor indices
    in range (torch_fa4.mods.index_bounds; a kernel cannot raise, so both paths check here)."""
    if call.mods is not None:
        _index_bounds().check_call(call)


@functools.lru_cache(maxsize=None)
def _index_bounds():
    """torch_fa4.mods.index_bounds, imported on first use (mods stay out of `import torch_fa4`) and
    then found without the import statement's cost on every call."""
    from torch_fa4.mods import index_bounds

    return index_bounds


def forward(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    host_checks(call)
    kernel = kernel_for(call, "forward")
    if kernel is None:
        return reference.forward(call)
    return run_forward(kernel, call)


def run_forward(kernel, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernel` (from kernel_for) runs the call's forward: its output buffers, then the launch."""
    out = empty_laid_out_like(call.q, call.out_shape())
    lse = torch.empty(call.lse_shape(), dtype=torch.float32, device=call.q.device)
    kernel.forward(call, out, lse)
    return out, lse


def backward(call: AttentionCall, dout, out, lse, deterministic: bool):
    host_checks(call)
    kernel = kernel_for(call, "backward", deterministic=deterministic)
    if kernel is None:
        return reference.backward(call, dout, out, lse)
    return run_backward(kernel, call, dout, out, lse, deterministic)


def run_backward(kernel, call: AttentionCall, dout, out, lse, deterministic: bool):
    """`kernel` (from kernel_for) runs the call's backward: the gradient buffers, then the launch."""
    dq = torch.empty(call.q.shape, dtype=call.q.dtype, device=call.q.device)
    dk = torch.empty(call.k.shape, dtype=call.k.dtype, device=call.k.device)
    dv = torch.empty(call.v.shape, dtype=call.v.dtype, device=call.v.device)
    kernel.backward(call, dout, out, lse, dq, dk, dv, deterministic)
    return dq, dk, dv
