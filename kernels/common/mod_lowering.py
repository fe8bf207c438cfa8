"""Apply a traced score_mod / mask_mod inside CuTe DSL kernels.

A mod arrives as a `ModGraph` (torch_fa4.mods.graph) in the `ModSet` that `AttentionCall.mods`
holds: `score_graph`, `mask_graph`, and for backward `score_grad_graph` (d score_mod / d score,
derived symbolically). The functions here *inline* its scalar ops at the call site while the DSL
traces the kernel, so a mod costs exactly its arithmetic, per element, in registers.

API (plain Python helpers called from inside jit code; graphs are compile-time constants):

    score = score_mod_value(graph, score, b, h, q_idx, kv_idx, score_aux)  -> Float32
    keep  = mask_mod_value(graph, b, h, q_idx, kv_idx, mask_aux)           -> Boolean
    dsds  = score_grad_value(grad_graph, score, b, h, q_idx, kv_idx, score_aux) -> Float32

These are per element; `mod_fragment` emits the same ops (`emit_op`, from the one op table
`CUTE_OPS`) over a whole score fragment, hoisted by dependence (mod_hoisting.py).

- `score` is the fp32 score *after* scale and softcap (docs/INTERNALS.md "Semantics"), in natural
  units: if the kernel keeps scores pre-multiplied by log2(e), divide before and multiply after.
- `b`, `h` (query head), `q_idx`, `kv_idx`: Int32, positions within the (per-batch) sequence.
- `score_aux` / `mask_aux`: tuples of `cute.Tensor` in global memory, in ModSet order
  (`call.score_aux` / `call.mask_aux`). Compile against `fake_aux_tensor(spec.dtype, spec.ndim)` for
  each `AuxSpec` in `graph.aux`, launch with `kernel_aux_tensors(call.aux_tensors)`: only dtype and
  rank are part of the compiled kernel. The host @cute.jit takes them as separate optional
  arguments (MAX_AUX of them, None when unused: TVM-FFI rejects one tuple of tensors of different
  ranks). An access `t[h, q_idx]` is one global load.
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
- `mod_graph_is_identity_grad(grad_graph)`: d score_mod / d score == 1 everywhere (ALiBi, biases).
- `backward_mods(mods)`: the graphs and captured-tensor counts a backward kernel inlines.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32

from torch_fa4.kernels.host.fwd_launch import fake_packed
from torch_fa4.mods.graph import BOOL, FLOAT, INT, PYTHON_OPERATORS, ModGraph
from torch_fa4.mods.index_sign import KEEP, SHIFT, index_wraps

_AUX_DSL_DTYPES = {
    "torch.float32": "Float32", "torch.float16": "Float16", "torch.bfloat16": "BFloat16",
    "torch.float64": "Float64", "torch.int32": "Int32", "torch.int64": "Int64", "torch.int16": "Int16",
    "torch.int8": "Int8", "torch.uint8": "Uint8",
    "torch.bool": "Uint8",  # bool tensors travel as uint8 views (kernel_aux_tensors): 0 / 1 bytes
}


MAX_AUX = 8  # captured tensors per call the kernels take


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


def backward_mods(mods) -> tuple:
    """What a backward kernel inlines of a ModSet (or None): (score graph, mask graph, d score_mod /
    d score's graph (None where it is 1 everywhere), the score_mod's captured tensors, all of them)."""
    if mods is None:
        return None, None, None, 0, 0
    grad = mods.score_grad_graph
    if mods.score_graph is None or mod_graph_is_identity_grad(grad):
        grad = None
    return mods.score_graph, mods.mask_graph, grad, mods.num_score_aux, mods.num_score_aux + mods.num_mask_aux


def fake_aux_tensor(dtype_name: str, ndim: int):
    """A fake (symbolic-shape) cute tensor standing for a captured tensor, for cute.compile.
    0-d captured tensors are passed as shape-(1,) views."""
    dtype = getattr(cutlass, _AUX_DSL_DTYPES[dtype_name])
    # element alignment holds for any view of a torch tensor; less would split loads into bytes
    return fake_packed(dtype, max(ndim, 1), align=max(1, dtype.width // 8))


# ---- the op table: each op's CuTe DSL code -------------------------------------------------------

def as_kind(x: Any, kind: str):
    """Python constants and DSL values -> the DSL type of the node kind."""
    dsl_type = {FLOAT: Float32, INT: Int32}.get(kind, Boolean)
    return x if isinstance(x, dsl_type) else dsl_type(x)


def select(cond, a, b, kind: str):
    return as_kind(cutlass.select_(cond, as_kind(a, kind), as_kind(b, kind)), kind)


def _floor_quotient_remainder(a, b):
    """Python/torch floor division and modulo of Int32 values: (a // b, a % b).

    Int32 `//` on device values truncates toward zero in CuTe DSL 4.8 ((0 - 40) // 7 gives -5, not
    -6), although it is emitted as arith.floordivsi. So correct whatever `//` gives: a nonzero
    remainder whose sign differs from the divisor's means the quotient was rounded toward zero, one
    step too high. Exact for floor semantics too, so this stays right if the lowering changes.
    """
    q = a // b
    r = a - q * b
    fix = (r != Int32(0)) & ((r < Int32(0)) != (b < Int32(0)))
    q = Int32(cutlass.select_(fix, q - Int32(1), q))
    r = Int32(cutlass.select_(fix, r + b, r))
    return q, r


def select_min_max(a, b, kind: str, is_min: bool):
    """min / max by one compare and a select: right for ints and for floats that are never NaN."""
    return select(a < b if is_min else a > b, a, b, kind)


def _min_max(is_min: bool):
    def emit(kind, a, b):
        if kind != FLOAT:
            return select_min_max(a, b, kind, is_min)
        # NaN-propagating like torch.minimum / maximum: a NaN in b falls through the compare to
        # b, a NaN in a is picked by the second select
        r = select_min_max(a, b, FLOAT, is_min)
        return select(a != a, a, r, FLOAT)
    return emit


def _to_float(kind, x):
    if isinstance(x, Boolean):  # a select, not an int -> float conversion (I2F is quarter rate)
        return select(x, 1.0, 0.0, FLOAT)
    return x if isinstance(x, Float32) else x.to(Float32)


# op -> emit(kind of the result, *argument values): the CuTe DSL side of graph.OPS
CUTE_OPS: dict[str, Callable] = {
    **{op: (lambda f: lambda kind, *a: f(*a))(f) for op, f in PYTHON_OPERATORS.items()},
    "abs": lambda kind, x: cute.math.abs(x) if kind == FLOAT else select(x < 0, -x, x, INT),
    "exp": lambda kind, x: cute.math.exp(x, fastmath=False),
    "log": lambda kind, x: cute.math.log(x, fastmath=False),
    "tanh": lambda kind, x: cute.math.tanh(x, fastmath=False),
    # for very negative x, exp overflows to inf and the quotient is 0, as in torch
    "sigmoid": lambda kind, x: Float32(1.0) / (Float32(1.0) + cute.math.exp(-x, fastmath=False)),
    "not": lambda kind, x: select(x, False, True, BOOL),
    "to_float": _to_float,
    "floordiv": lambda kind, a, b: _floor_quotient_remainder(a, b)[0],
    "mod": lambda kind, a, b: _floor_quotient_remainder(a, b)[1],
    "minimum": _min_max(True),
    "maximum": _min_max(False),
    "and": lambda kind, a, b: select(a, b, False, BOOL),
    "or": lambda kind, a, b: select(a, True, b, BOOL),
    "where": lambda kind, c, a, b: select(c, a, b, kind),
}


def _wrap_index(i, size, how: int):
    """PyTorch's index rule: i in [-size, -1] reads element i + size (see the module docstring)."""
    if how == SHIFT:
        return i + size
    return select(i < Int32(0), i + size, i, INT)


def _load(n, a: list, aux: Sequence, wraps: tuple):
    t = aux[n.attr]
    if wraps:
        a = [x if how == KEEP else _wrap_index(x, t.shape[d], how) for d, (x, how) in enumerate(zip(a, wraps))]
    v = t[tuple(a) if len(a) > 1 else a[0]] if a else t[0]
    if n.kind == BOOL:
        return v.to(Int32) != Int32(0)  # bool tensors arrive as uint8
    return v.to(Float32 if n.kind == FLOAT else Int32)


def emit_op(n, a: list, aux: Sequence, wraps: tuple = ()):
    """The DSL value of one non-input node `n` from its argument values `a`. For a load, `wraps`
    is `index_wraps(graph).get(node)`: how each index is wrapped (empty: none is negative)."""
    if n.op == "const":
        return as_kind(n.attr, n.kind)
    if n.op == "load":
        return _load(n, a, aux, wraps)
    return CUTE_OPS[n.op](n.kind, *a)


def emit_nodes(graph: ModGraph, inputs: dict, aux: Sequence, nodes=None) -> dict:
    """node -> DSL value for `nodes` (every node when None; each node's arguments among them), in
    graph order, each inlined once."""
    wraps = index_wraps(graph)
    env: dict = {}
    for i in range(len(graph.nodes)) if nodes is None else sorted(nodes):
        n = graph.nodes[i]
        if n.op == "input":
            env[i] = as_kind(inputs[n.attr], n.kind)
        else:
            env[i] = emit_op(n, [env[a] for a in n.args], aux, wraps.get(i, ()))
    return env


# ---- per element --------------------------------------------------------------------------------

def score_mod_value(graph: ModGraph, score, b, h, q_idx, kv_idx, score_aux: Sequence) -> Float32:
    env = emit_nodes(graph, {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}, score_aux)
    return as_kind(env[graph.output], FLOAT)


score_grad_value = score_mod_value  # (grad_graph, score, b, h, q_idx, kv_idx, score_aux): the same inlining


def mask_mod_value(graph: ModGraph, b, h, q_idx, kv_idx, mask_aux: Sequence) -> Boolean:
    env = emit_nodes(graph, {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}, mask_aux)
    return as_kind(env[graph.output], BOOL)
