"""Lower a ModGraph to PyTorch: evaluate it on broadcastable index tensors.

Used by the reference attention (on KV chunks: score (B,H,Sq,chunk), b (B,1,1,1), h (1,H,1,1),
q_idx (1,1,Sq,1), kv_idx (1,1,1,chunk)) and by the block-mask builder (on tile grids). Float values
are float32 (captured low-precision or float64 tensors are converted on load), matching the fp32
arithmetic of the kernels; index values keep whatever integer dtype came in (int64 here, int32 in
kernels: the same numbers for any realistic length).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Sequence

import torch

from torch_fa4.mods.graph import FLOAT, PYTHON_OPERATORS, ModGraph

Value = Any  # a torch.Tensor or a Python number (constants stay Python numbers: weak dtype promotion)


def _is_py(x: Value) -> bool:
    return not isinstance(x, torch.Tensor)


def _py_sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _py_exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _py_log(x: float) -> float:
    if x < 0 or math.isnan(x):
        return math.nan
    return math.log(x) if x > 0 else -math.inf


def _minmax(pick: Callable, torch_fn: Callable) -> Callable:
    def apply(a: Value, b: Value) -> Value:
        if _is_py(a) and _is_py(b):
            return pick(a, b)
        ref = a if isinstance(a, torch.Tensor) else b
        a = a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=ref.dtype, device=ref.device)
        b = b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=ref.dtype, device=ref.device)
        return torch_fn(a, b)
    return apply


_OPS: dict[str, Callable] = {
    **PYTHON_OPERATORS,
    "abs": abs,
    "exp": lambda x: _py_exp(x) if _is_py(x) else torch.exp(x),
    "log": lambda x: _py_log(x) if _is_py(x) else torch.log(x),
    "tanh": lambda x: math.tanh(x) if _is_py(x) else torch.tanh(x),
    "sigmoid": lambda x: _py_sigmoid(x) if _is_py(x) else torch.sigmoid(x),
    "not": lambda x: (not x) if _is_py(x) else torch.logical_not(x),
    "to_float": lambda x: float(x) if _is_py(x) else x.float(),
    "floordiv": operator.floordiv,  # floor semantics in both Python and torch, as the kernels do
    "mod": operator.mod,  # sign of the divisor, as Python
    "minimum": _minmax(min, torch.minimum),
    "maximum": _minmax(max, torch.maximum),
    "and": operator.and_,
    "or": operator.or_,
    "where": lambda c, a, b: (a if c else b) if _is_py(c) else torch.where(c, a, b),
}


def evaluate(graph: ModGraph, inputs: dict[str, Value], aux: Sequence[torch.Tensor]) -> Value:
    """Run the graph's nodes in order; returns a tensor or a Python number."""
    return evaluate_nodes(graph, inputs, aux)[graph.output]


def evaluate_nodes(graph: ModGraph, inputs: dict[str, Value], aux: Sequence[torch.Tensor]) -> list[Value]:
    """Run the graph's nodes in order; returns every node's value (for graphs with several results,
    such as derivative.load_derivatives')."""
    if len(aux) != len(graph.aux):
        raise ValueError(f"{graph.role}_mod expects {len(graph.aux)} captured tensors, got {len(aux)}")
    env: list[Value] = []
    for n in graph.nodes:
        if n.op == "input":
            env.append(inputs[n.attr])
        elif n.op == "const":
            env.append(n.attr)
        elif n.op == "load":
            t = aux[n.attr]
            idx = tuple(env[a] for a in n.args)
            v = t[idx] if idx else t
            if n.kind == FLOAT and v.dtype != torch.float32:
                v = v.float()
            env.append(v)
        else:
            env.append(_OPS[n.op](*(env[a] for a in n.args)))
    return env


def score_torch(graph: ModGraph, score: torch.Tensor, b: Value, h: Value, q_idx: Value, kv_idx: Value,
                aux: Sequence[torch.Tensor]) -> torch.Tensor:
    out = evaluate(graph, {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}, aux)
    if _is_py(out):
        out = torch.tensor(out, dtype=torch.float32, device=score.device)
    return torch.broadcast_to(out.to(score.dtype), score.shape)


def mask_torch(graph: ModGraph, b: Value, h: Value, q_idx: Value, kv_idx: Value,
               aux: Sequence[torch.Tensor]) -> torch.Tensor:
    out = evaluate(graph, {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}, aux)
    if _is_py(out):
        device = next((x.device for x in (b, h, q_idx, kv_idx) if isinstance(x, torch.Tensor)), None)
        out = torch.tensor(bool(out), device=device)
    return out
