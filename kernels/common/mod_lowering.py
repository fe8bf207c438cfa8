"""Apply a traced score_mod / mask_mod inside CuTe DSL kernels.

For kernel engineers. A mod arrives as a `ModGraph` (torch_fa4.mods.graph) in the `ModSet` that
`AttentionCall.mods` holds: `mods.score_graph`, `mods.mask_graph`, and for backward
`mods.score_grad_graph` (d score_mod / d score, derived symbolically). Each is a small list of
scalar ops; the functions here *inline* those ops at the call site while the DSL traces your
`@cute.jit` / `@cute.kernel` code, so a mod costs exactly its arithmetic, per element, in registers.

API (all are plain Python helpers called from inside jit code; graphs are compile-time constants):

    score = score_mod_value(graph, score, b, h, q_idx, kv_idx, score_aux)  -> Float32
    keep  = mask_mod_value(graph, b, h, q_idx, kv_idx, mask_aux)           -> Boolean
    dsds  = score_grad_value(grad_graph, score, b, h, q_idx, kv_idx, score_aux) -> Float32

These are per element. Kernels applying mods to a whole score fragment should use
`mod_fragment` (FragmentEmitter, apply_mods_to_tile; `tile_mods.TileMods` for the attention
kernels), which emits the same ops hoisted by dependence (mod_hoisting.py): once per tile of work,
per row, per column, and only the rest per element, with exact fp32 rewrites of int -> float.

- `score` is the fp32 score *after* scale and softcap (docs/INTERNALS.md "Semantics"), in natural
  units: if the kernel keeps scores pre-multiplied by log2(e), divide before and multiply after.
- `b`, `h` (query head), `q_idx`, `kv_idx`: Int32, positions within the (per-batch) sequence.
- `score_aux` / `mask_aux`: tuples of `cute.Tensor` in global memory, in ModSet order
  (`call.score_aux` / `call.mask_aux`). Compile against `fake_aux_tensor(spec.dtype, spec.ndim)` for
  each `AuxSpec` in `graph.aux` (symbolic shapes), launch with `kernel_aux_tensors(call.aux_tensors)`
  (bool -> uint8 view, 0-d -> (1,)): only dtype and rank are part of the compiled kernel, so new
  values never recompile. The host @cute.jit should take them as separate optional arguments
  (MAX_AUX of them, None when unused: TVM-FFI rejects one tuple of tensors of different ranks) and
  hand tuples to the @cute.kernel, as `ModProbeKernel` below does. An access `t[h, q_idx]` is
  one global load (cached by L1/L2; for large tables consider staging in shared memory).
- Indices follow PyTorch: i in [-size, -1] reads element i + size. An index that may be negative
  (torch_fa4.mods.index_sign) gets a compare and a select; provably non-negative ones (slopes[h],
  doc[q_idx]) are emitted as they are. No index is checked here: the host refuses calls whose
  indices may leave [-size, size - 1] before launching (torch_fa4.mods.index_bounds), and kernels
  must keep q_idx / kv_idx inside the sequence (clamp padded rows and keys) for that to hold.
- Include `mods.key` in the kernel's compile-cache key: it determines the inlined code.
- Value kinds: "float" nodes are Float32 (bf16/fp16/fp64 tensors are converted on load), "int"
  nodes Int32 (int64 tensors are narrowed on load), "bool" nodes Boolean. `//` and `%` use Python's
  floor semantics, as the PyTorch lowering does; `exp`, `log`, `tanh` are emitted with fastmath
  off (exp still becomes `ex2.approx` after range scaling, a few ulp), so scores match the PyTorch
  lowering to fp32 rounding (relative ~1e-6) and masks match exactly.
- `mod_graph_is_identity_grad(grad_graph)` tells backward when d score_mod / d score == 1
  everywhere (e.g. ALiBi, biases), so it can skip the multiply.

This module imports CuTe DSL; only kernel modules import it (never `import torch_fa4`).
"""

from __future__ import annotations

from typing import Any, Sequence

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32

from torch_fa4.mods.graph import BOOL, FLOAT, INT, ModGraph
from torch_fa4.mods.index_sign import KEEP, SHIFT, index_wraps

_AUX_DSL_DTYPES = {
    "torch.float32": "Float32", "torch.float16": "Float16", "torch.bfloat16": "BFloat16",
    "torch.float64": "Float64", "torch.int32": "Int32", "torch.int64": "Int64", "torch.int16": "Int16",
    "torch.int8": "Int8", "torch.uint8": "Uint8",
    "torch.bool": "Uint8",  # bool tensors travel as uint8 views (kernel_aux_tensors): 0 / 1 bytes
}


def aux_dsl_dtype(torch_dtype_name: str):
    """The CuTe DSL element type for a captured tensor's torch dtype (e.g. for fake tensors)."""
    return getattr(cutlass, _AUX_DSL_DTYPES[torch_dtype_name])


def kernel_aux_tensors(aux: Sequence, max_aux: int | None = None) -> list:
    """Captured torch tensors as the kernels take them: bool as uint8 views, 0-d as shape (1,),
    padded with None to `max_aux` entries when given (no copies; call on the host side)."""
    import torch

    out = []
    for t in aux:
        if t.dtype == torch.bool:
            t = t.view(torch.uint8)
        out.append(t.reshape(1) if t.dim() == 0 else t)
    if max_aux is not None:
        out += [None] * (max_aux - len(out))
    return out


def mod_graph_is_identity_grad(grad_graph: ModGraph) -> bool:
    out = grad_graph.nodes[grad_graph.output]
    return out.op == "const" and out.attr == 1.0


def _as_kind(x: Any, kind: str):
    """Python constants and DSL values -> the DSL type of the node kind."""
    if kind == FLOAT:
        return x if isinstance(x, Float32) else Float32(x)
    if kind == INT:
        return x if isinstance(x, Int32) else Int32(x)
    return x if isinstance(x, Boolean) else Boolean(x)


def _select(cond, a, b, kind: str):
    return _as_kind(cutlass.select_(cond, _as_kind(a, kind), _as_kind(b, kind)), kind)


def _sigmoid(x):
    # 1 / (1 + e^-x); exp overflows to inf for very negative x and the quotient is then 0, as torch.
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x, fastmath=False))


def _floor_quotient_remainder(a, b):
    """Python/torch floor division and modulo of Int32 values: (a // b, a % b).

    Measured on an H200 (CuTe DSL 4.8.1): Int32 `//` on device values truncates toward zero
    ((0 - 40) // 7 gave -5, not -6), although it is emitted as arith.floordivsi. So correct
    whatever `//` gives: a nonzero remainder whose sign differs from the divisor's means the
    quotient was rounded toward zero, one step too high. Exact for floor semantics too, so this
    stays right if the lowering changes.
    """
    q = a // b
    r = a - q * b
    fix = (r != Int32(0)) & ((r < Int32(0)) != (b < Int32(0)))
    q = Int32(cutlass.select_(fix, q - Int32(1), q))
    r = Int32(cutlass.select_(fix, r + b, r))
    return q, r


def _floordiv(a, b):
    return _floor_quotient_remainder(a, b)[0]


def _mod(a, b):
    return _floor_quotient_remainder(a, b)[1]


def _wrap_index(i, size, how: int):
    """PyTorch's index rule: i in [-size, -1] reads element i + size (the host check keeps every
    index in [-size, size - 1]; torch_fa4.mods.index_sign decides which indices need this)."""
    if how == SHIFT:
        return i + size
    return _select(i < Int32(0), i + size, i, INT)


def _emit_op(n, a: list, aux: Sequence, wraps: tuple = ()):
    """The DSL value of one non-input node `n` from its argument values `a`. For a load, `wraps`
    is `index_wraps(graph).get(node)`: how each index is wrapped (empty: none is negative)."""
    op = n.op
    if op == "const":
        return _as_kind(n.attr, n.kind)
    if op == "load":
        t = aux[n.attr]
        if wraps:
            a = [x if how == KEEP else _wrap_index(x, t.shape[d], how) for d, (x, how) in enumerate(zip(a, wraps))]
        coord = tuple(a) if len(a) > 1 else (a[0] if a else 0)
        v = t[coord] if a else t[0]
        if n.kind == FLOAT:
            return v.to(Float32)
        if n.kind == INT:
            return v.to(Int32)
        return v.to(Int32) != Int32(0)  # bool tensors arrive as uint8
    if op == "to_float":
        if isinstance(a[0], Boolean):  # a select, not an int -> float conversion (I2F is quarter rate)
            return _select(a[0], 1.0, 0.0, FLOAT)
        return a[0].to(Float32) if not isinstance(a[0], Float32) else a[0]
    if op == "neg":
        return -a[0]
    if op == "abs":
        return cute.math.abs(a[0]) if n.kind == FLOAT else _select(a[0] < 0, -a[0], a[0], INT)
    if op == "exp":
        return cute.math.exp(a[0], fastmath=False)
    if op == "log":
        return cute.math.log(a[0], fastmath=False)
    if op == "tanh":
        return cute.math.tanh(a[0], fastmath=False)
    if op == "sigmoid":
        return _sigmoid(a[0])
    if op == "not":
        return _select(a[0], False, True, BOOL)
    if op == "add":
        return a[0] + a[1]
    if op == "sub":
        return a[0] - a[1]
    if op == "mul":
        return a[0] * a[1]
    if op == "div":
        return a[0] / a[1]
    if op == "floordiv":
        return _floordiv(a[0], a[1])
    if op == "mod":
        return _mod(a[0], a[1])
    if op == "minimum":
        # NaN-propagating like torch.minimum: a < b picks a, a NaN in b falls through to b
        return _select(a[0] < a[1], a[0], a[1], n.kind) if n.kind == INT else _fminmax(a[0], a[1], True)
    if op == "maximum":
        return _select(a[0] > a[1], a[0], a[1], n.kind) if n.kind == INT else _fminmax(a[0], a[1], False)
    if op in _COMPARE:
        return _COMPARE[op](a[0], a[1])
    if op == "and":
        return _select(a[0], a[1], False, BOOL)
    if op == "or":
        return _select(a[0], True, a[1], BOOL)
    if op == "where":
        return _select(a[0], a[1], a[2], n.kind)
    raise NotImplementedError(f"mod_lowering: no CuTe DSL lowering for op {op!r}")


_COMPARE = {"eq": lambda x, y: x == y, "ne": lambda x, y: x != y, "lt": lambda x, y: x < y,
            "le": lambda x, y: x <= y, "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y}


def _emit(graph: ModGraph, inputs: dict, aux: Sequence):
    env: list = []
    wraps = index_wraps(graph)
    for i, n in enumerate(graph.nodes):
        if n.op == "input":
            env.append(_as_kind(inputs[n.attr], n.kind))
        else:
            env.append(_emit_op(n, [env[a] for a in n.args], aux, wraps.get(i, ())))
    return env[graph.output]


def _fminmax(x, y, is_min: bool):
    # torch.minimum/maximum propagate NaN from either side
    pick = x < y if is_min else x > y
    r = _select(pick, x, y, FLOAT)
    r = _select(x != x, x, r, FLOAT)
    return r


def score_mod_value(graph: ModGraph, score, b, h, q_idx, kv_idx, score_aux: Sequence) -> Float32:
    return _as_kind(_emit(graph, {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}, score_aux), FLOAT)


def score_grad_value(grad_graph: ModGraph, score, b, h, q_idx, kv_idx, score_aux: Sequence) -> Float32:
    return score_mod_value(grad_graph, score, b, h, q_idx, kv_idx, score_aux)


def mask_mod_value(graph: ModGraph, b, h, q_idx, kv_idx, mask_aux: Sequence) -> Boolean:
    return _as_kind(_emit(graph, {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}, mask_aux), BOOL)


# ---- a small probe kernel: the lowered mods on every element of a (B, H, M, N) grid ------------------

MAX_AUX = 8  # captured tensors per ModSet the probe (and the host entry pattern below) accepts


class ModProbeKernel:
    """Evaluates score_mod and mask_mod for every (b, h, q_idx, kv_idx) of a grid, one element per
    thread: out[b,h,q,kv] = score_mod(score[b,h,q,kv], b, h, q, kv) and keep[...] = mask_mod(...).
    The tests compare it with the PyTorch lowering (and compile it on CPU); it is also the pattern
    for passing captured tensors: the host @cute.jit takes them as separate optional arguments
    (TVM-FFI rejects one tuple of tensors of different ranks), the @cute.kernel as tuples."""

    threads = 128

    def __init__(self, score_graph, mask_graph):
        self.score_graph = score_graph
        self.mask_graph = mask_graph
        self.num_score_aux = len(score_graph.aux) if score_graph is not None else 0
        self.num_aux = self.num_score_aux + (len(mask_graph.aux) if mask_graph is not None else 0)
        if self.num_aux > MAX_AUX:
            raise NotImplementedError(f"mods capture {self.num_aux} tensors; the kernels take at most {MAX_AUX}")

    @cute.jit
    def __call__(self, score: cute.Tensor, out: cute.Tensor, keep: cute.Tensor,
                 aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7, stream):
        aux = (aux0, aux1, aux2, aux3, aux4, aux5, aux6, aux7)[: self.num_aux]
        score_aux, mask_aux = aux[: self.num_score_aux], aux[self.num_score_aux:]
        B, H, M, N = score.shape
        grid = ((M * N + self.threads - 1) // self.threads, H, B)
        self.kernel(score, out, keep, score_aux, mask_aux).launch(grid=grid, block=(self.threads, 1, 1),
                                                                   stream=stream)

    @cute.kernel
    def kernel(self, score: cute.Tensor, out: cute.Tensor, keep: cute.Tensor, score_aux, mask_aux):
        tidx, _, _ = cute.arch.thread_idx()
        bx, h, b = cute.arch.block_idx()
        M, N = score.shape[2], score.shape[3]
        idx = bx * self.threads + tidx
        if idx < M * N:
            q_idx = idx // N
            kv_idx = idx - q_idx * N
            s = score[b, h, q_idx, kv_idx]
            if cutlass.const_expr(self.score_graph is not None):
                s = score_mod_value(self.score_graph, s, b, h, q_idx, kv_idx, score_aux)
            out[b, h, q_idx, kv_idx] = s
            if cutlass.const_expr(self.mask_graph is not None):
                k = mask_mod_value(self.mask_graph, b, h, q_idx, kv_idx, mask_aux)
                keep[b, h, q_idx, kv_idx] = _as_kind(cutlass.select_(k, Int32(1), Int32(0)), INT)


def fake_aux_tensor(dtype_name: str, ndim: int):
    """A fake (symbolic-shape) cute tensor standing for a captured tensor, for cute.compile.
    0-d captured tensors are passed as shape-(1,) views."""
    rank = max(ndim, 1)
    dtype = aux_dsl_dtype(dtype_name)
    # element alignment holds for any view of a torch tensor; less would split loads into bytes
    align = max(1, dtype.width // 8)
    return cute.runtime.make_fake_tensor(
        dtype, tuple(cute.sym_int() for _ in range(rank)),
        tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,), assumed_align=align)


def compile_probe(score_graph, mask_graph, arch: str = "sm_90a", dump_dir: str | None = None):
    """cute.compile the probe for these graphs (fake tensors: shapes stay symbolic). Call the result
    as fn(score, out, keep, *aux) with aux padded by None to MAX_AUX entries."""
    def fake(dt):
        return cute.runtime.make_fake_tensor(dt, tuple(cute.sym_int() for _ in range(4)),
                                             tuple(cute.sym_int64() for _ in range(3)) + (1,), assumed_align=4)

    probe = ModProbeKernel(score_graph, mask_graph)
    specs = [a for g in (score_graph, mask_graph) if g is not None for a in g.aux]
    aux = [fake_aux_tensor(a.dtype, a.ndim) for a in specs] + [None] * (MAX_AUX - len(specs))
    from torch_fa4.kernels.common.fwd_launch import compile_options

    options = compile_options(arch, dump_dir)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(probe, fake(Float32), fake(Float32), fake(Int32), *aux, stream, options=options)
