"""ModGraph: the traced form of one score_mod or mask_mod.

A ModGraph is a small SSA list of nodes over scalar values, the same shape of program whether it is
later evaluated on broadcast index grids in PyTorch (lower_torch.py) or per score element inside a
CuTe DSL kernel (torch_fa4.kernels.common.mod_lowering). Keeping our own IR (rather than a raw
torch.fx graph) lets the op set be closed and checked at trace time, gives one canonical text that
is hashed into the mod key, and makes the graph serialisable so a key can be resolved again in a
new process (registry.py).

Every node has a *kind*: "float" (fp32 in kernels, float32 in the reference), "int" (int32 in
kernels; index values), or "bool".
"""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass
from typing import Any

FLOAT, INT, BOOL = "float", "int", "bool"

SCORE_INPUTS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_INPUTS = ("b", "h", "q_idx", "kv_idx")
INPUT_KINDS = {"score": FLOAT, "b": INT, "h": INT, "q_idx": INT, "kv_idx": INT}

# The closed op set, op name -> arity ("input", "const" and "load" are the leaves). Each lowering
# (lower_torch._OPS, kernels/common/mod_lowering.CUTE_OPS) covers exactly these; the tests check it.
OPS = {
    "neg": 1, "abs": 1, "exp": 1, "log": 1, "tanh": 1, "sigmoid": 1, "not": 1, "to_float": 1,
    "add": 2, "sub": 2, "mul": 2, "div": 2, "floordiv": 2, "mod": 2, "minimum": 2, "maximum": 2,
    "eq": 2, "ne": 2, "lt": 2, "le": 2, "gt": 2, "ge": 2, "and": 2, "or": 2,
    "where": 3,
}
# The ops that mean the Python operator on the values of either lowering (torch tensors and
# numbers, CuTe DSL values): both take them from here.
PYTHON_OPERATORS = {
    "neg": operator.neg, "add": operator.add, "sub": operator.sub, "mul": operator.mul,
    "div": operator.truediv, "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge,
}

# The torch dtypes a captured tensor may have, by the kind a load of it yields.
AUX_DTYPE_KINDS = {
    "torch.float32": FLOAT, "torch.float16": FLOAT, "torch.bfloat16": FLOAT, "torch.float64": FLOAT,
    "torch.int32": INT, "torch.int64": INT, "torch.int16": INT, "torch.int8": INT,
    "torch.uint8": INT, "torch.bool": BOOL,
}


@dataclass(frozen=True)
class Node:
    op: str
    args: tuple[int, ...] = ()
    attr: Any = None  # input: name; const: Python number; load: aux slot
    kind: str = FLOAT


@dataclass(frozen=True)
class AuxSpec:
    """What a mod's key depends on for a captured tensor: dtype and rank, never values or sizes."""

    dtype: str
    ndim: int


def _const_to_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}  # JSON has no inf/nan
    return value


def _const_from_json(value: Any) -> Any:
    return float(value["float"]) if isinstance(value, dict) else value


@dataclass(frozen=True)
class ModGraph:
    role: str  # "score" or "mask" (or "score_grad" for a derived graph)
    nodes: tuple[Node, ...]
    output: int
    aux: tuple[AuxSpec, ...]

    # ---- canonical forms -------------------------------------------------------------------
    def to_json(self) -> str:
        doc = {
            "role": self.role,
            "aux": [[a.dtype, a.ndim] for a in self.aux],
            "nodes": [[n.op, list(n.args), _const_to_json(n.attr), n.kind] for n in self.nodes],
            "output": self.output,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "ModGraph":
        doc = json.loads(text)
        nodes = tuple(
            Node(op, tuple(args), _const_from_json(attr), kind) for op, args, attr, kind in doc["nodes"]
        )
        aux = tuple(AuxSpec(d, n) for d, n in doc["aux"])
        return ModGraph(doc["role"], nodes, doc["output"], aux)

    def text(self) -> str:
        """Readable listing (kept as golden text in the tests)."""
        aux = ", ".join(f"aux{i}: {a.dtype.replace('torch.', '')}[{a.ndim}d]" for i, a in enumerate(self.aux))
        inputs = MASK_INPUTS if self.role == "mask" else SCORE_INPUTS
        lines = [f"{self.role}_mod({', '.join(inputs)}){' with ' + aux if aux else ''}"]
        for i, n in enumerate(self.nodes):
            if n.op == "input":
                rhs = n.attr
            elif n.op == "const":
                rhs = repr(n.attr)
            elif n.op == "load":
                rhs = f"aux{n.attr}[{', '.join(f'%{a}' for a in n.args)}]"
            else:
                rhs = f"{n.op}({', '.join(f'%{a}' for a in n.args)})"
            lines.append(f"  %{i}: {n.kind} = {rhs}")
        lines.append(f"  return %{self.output}")
        return "\n".join(lines) + "\n"

    __str__ = text


def ancestors(graph: ModGraph, roots) -> set[int]:
    """The nodes `roots` (node indices) and every node they depend on."""
    seen, stack = set(), list(roots)
    while stack:
        i = stack.pop()
        if i not in seen:
            seen.add(i)
            stack.extend(graph.nodes[i].args)
    return seen
