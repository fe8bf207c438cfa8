"""Randomized differential testing of the public API: seeded cases drawn from everything
`torch_fa4.attention` / `torch_fa4.flex_attention` advertise, run forward and backward, and compared
with float64 attention.

A case is a `FuzzCase` (one-line repr); `case_from_seed(seed, space)` rebuilds it exactly, and
`build` its tensors (drawn on the device from the seed: a seed replays on the same kind of device).
`check_case` calls the API, computes the float64 oracle and a low-precision eager run with the same
oracle (tests/naive.py: per sequence, FlexAttention's mod semantics, autograd), and compares out,
LSE, dQ, dK and dV, each over the whole tensor:
||x - ref|| <= 2 ||eager - ref|| + floor, NaN never passing.

Mods come from a small generator of random expression graphs over the op set the tracer supports
(`ModGen`), written as Python source so a case prints its mods and replays them exactly; captured
tensors are indexed in range (by h, b, q_idx / kv_idx on tables that long, or by `expr % m`).

Two spaces: `CPU` (the reference path: small shapes, every choice drawn per seed) and `GPU` (kernel
shapes around the tiles; the choices that select a compiled kernel variant are drawn per *family*,
a handful of families per block of 4096 consecutive seeds, so a run reuses its compiled variants).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import torch_fa4

from naive import naive_varlen

# ---- the spaces -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Space:
    name: str
    dtypes: tuple  # ((dtype, weight), ...)
    head_dims: tuple  # ((D, weight), ...)
    dv_pairs: tuple  # (D, Dv) pairs with Dv != D that the space draws now and then
    tiles: tuple  # tile sizes whose edges (t - 1, t, t + 1) lengths are drawn from
    max_len: int  # the usual upper bound of a length
    long_len: int  # now and then up to this
    max_batch: int
    max_heads_kv: int
    max_heads: int
    max_scores: int  # cap on sum over sequences of Hq * Sq * Sk (the oracle's memory)
    block_sizes: tuple  # BLOCK_SIZE choices of block masks
    families: Optional[int]  # kernel-variant families per block of seeds; None: all per seed


CPU = Space(
    name="cpu",
    dtypes=((torch.bfloat16, 0.45), (torch.float16, 0.4), (torch.float32, 0.15)),
    head_dims=((8, 0.15), (16, 0.2), (32, 0.25), (40, 0.1), (64, 0.25), (128, 0.05)),
    dv_pairs=((16, 8), (32, 64), (64, 24), (8, 40), (40, 32)),
    tiles=(64, 128),
    max_len=100,
    long_len=160,
    max_batch=4,
    max_heads_kv=3,
    max_heads=8,
    max_scores=1 << 17,
    block_sizes=((16, 0.3), ((16, 32), 0.2), (128, 0.2), ((32, 8), 0.15), ((24, 40), 0.15)),
    families=None,
)

GPU = Space(
    name="gpu",
    dtypes=((torch.bfloat16, 0.6), (torch.float16, 0.4)),
    head_dims=((64, 0.3), (128, 0.3), (96, 0.14), (192, 0.13), (256, 0.13)),
    # the sm90 backward takes these; the forward runs them on the reference
    dv_pairs=((192, 128), (128, 256), (256, 64), (256, 128), (192, 256), (64, 128), (128, 64)),
    tiles=(64, 80, 112, 128, 192, 256),
    max_len=1100,
    long_len=4200,
    max_batch=4,
    max_heads_kv=4,
    max_heads=16,
    max_scores=1 << 26,
    block_sizes=((128, 0.35), ((128, 128), 0.1), ((256, 128), 0.2), ((128, 64), 0.15), ((64, 64), 0.1),
                 ((64, 128), 0.05), ((96, 48), 0.05)),
    families=6,  # a default GPU run (<= 3000 seeds) meets at most two blocks: <= 12 families to compile
)

# Relative floor of the bound per dtype: a fraction of the output's own rounding error (bf16 rounds
# a normal tensor to 1.7e-3 of its norm, fp16 to 2.1e-4), for the cases where eager's error is ~0.
FLOOR_REL = {torch.bfloat16: 1e-3, torch.float16: 1.5e-4, torch.float32: 1e-6, torch.float64: 1e-12}
# Absolute floor per element (rms), which decides where the float64 value is (nearly) zero: a
# one-token sequence's dQ and dK are exactly zero in float64, and fp32 rounding leaves ~1e-6 there.
FLOOR_ABS = {torch.bfloat16: 2e-4, torch.float16: 5e-5, torch.float32: 1e-5, torch.float64: 1e-12}

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def _weighted(rng: random.Random, pairs):
    values, weights = zip(*pairs)
    return rng.choices(values, weights)[0]


# ---- mods: random expression graphs as Python source ------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """A captured tensor: its dtype and, per dimension, what indexes it: 'h', 'b', 'q' (q_idx),
    'k' (kv_idx) -- the table is as long as what indexes it -- or an int m (an index `expr % m` or
    `clamp(expr, 0, m - 1)`)."""

    name: str
    dtype: torch.dtype
    dims: tuple


@dataclass(frozen=True)
class ModSpec:
    role: str  # "score" | "mask"
    expr: str
    tensors: tuple

    def uses(self, name: str) -> bool:
        return re.search(rf"\b{name}\b", self.expr) is not None

    def __repr__(self) -> str:
        caps = ", ".join(f"{t.name}:{_SHORT.get(t.dtype, str(t.dtype).replace('torch.', ''))}"
                         f"[{','.join(map(str, t.dims))}]" for t in self.tensors if self.uses(t.name))
        return f"<{self.expr}{' | ' + caps if caps else ''}>"

    def source(self) -> str:
        args = "score, b, h, q_idx, kv_idx" if self.role == "score" else "b, h, q_idx, kv_idx"
        names = ", ".join(t.name for t in self.tensors)
        return (f"def make({names}):\n"
                f"    def {self.role}_mod({args}):\n"
                f"        return {self.expr}\n"
                f"    return {self.role}_mod\n")

    def build(self, sizes: dict, gen: torch.Generator, device) -> tuple:
        """(the mod, its float64 twin): closures over freshly drawn tensors (sizes: 'h', 'b', 'q',
        'k' -> length). The twin computes in float64 where the mod computes in its tables' dtypes
        or fp32 (`.float()`), for the float64 oracle; evaluate it under `float64_scalars()`."""
        tensors = [_draw_table(t, sizes, gen) for t in self.tensors]
        namespace = {"torch": torch, "__name__": __name__}  # a mod of this module, as if written here
        exec(compile(self.source(), f"<fuzz {self.role}_mod>", "exec"), namespace)
        twin_source = self.source().replace(".float()", ".double()").replace("torch.float32", "torch.float64")
        twin_namespace = {"torch": torch, "__name__": __name__}
        exec(compile(twin_source, f"<fuzz {self.role}_mod float64>", "exec"), twin_namespace)
        wide = [t.double() if t.is_floating_point() else t for t in tensors]
        return namespace["make"](*tensors), twin_namespace["make"](*wide)


def _draw_table(spec: TensorSpec, sizes: dict, gen: torch.Generator) -> torch.Tensor:
    shape = [max(1, sizes[d]) if isinstance(d, str) else d for d in spec.dims]
    on = dict(generator=gen, device=gen.device)
    if spec.dtype == torch.bool:
        return torch.rand(shape, **on) > 0.3
    if spec.dtype.is_floating_point:
        return (torch.rand(shape, **on) * 2 - 1).to(spec.dtype)  # in [-1, 1]
    if spec.dims and spec.dims[-1] in ("q", "k"):  # document ids along positions: sorted, few
        return torch.randint(0, 4, shape, **on).sort(dim=-1).values.to(spec.dtype)
    return torch.randint(-6, 7, shape, **on).to(spec.dtype)


class ModGen:
    """Random expressions over the supported op set. Ints: b, h, q_idx, kv_idx and what + - * c
    // c % c abs minimum maximum clamp where and int tables make of them. Bools: comparisons,
    & | ^ ~, logical_and/or/not, bool tables. Floats (bounded, no exp of large values): float
    tables, tanh / sigmoid / exp(-|x|) / log(1 + |x|) of ints and floats, where, minimum / maximum.
    The score enters through transformations with bounded slopes."""

    INT_VARS = ("q_idx", "kv_idx", "h", "b")

    def __init__(self, rng: random.Random, role: str, max_tensors: int = 3):
        self.rng, self.role, self.max_tensors = rng, role, max_tensors
        self.tensors: list[TensorSpec] = []
        self._in_index = 0  # inside an index expression: int tables of int32 / int64 only

    # -- captured tensors
    def _table(self, kind: str) -> Optional[str]:
        """An in-range load from a new or reused table of `kind` ('int', 'bool', 'float')."""
        rng = self.rng
        # (PyTorch indexes with int32 / int64 tensors only: an int8 table read inside an index
        # would fail in eager mode, so the tracer's acceptance of it is not part of the space)
        index_ok = (torch.int32, torch.int64)
        same = [t for t in self.tensors if _kind(t.dtype) == kind and (not self._in_index or t.dtype in index_ok)]
        if same and (len(self.tensors) >= self.max_tensors or rng.random() < 0.4):
            spec = rng.choice(same)
        elif len(self.tensors) < self.max_tensors:
            small = () if self._in_index else ((torch.int16, 1), (torch.int8, 1))
            dtype = {
                "int": lambda: _weighted(rng, ((torch.int32, 4), (torch.int64, 2)) + small),
                "bool": lambda: torch.bool,
                "float": lambda: _weighted(rng, ((torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 1))),
            }[kind]()
            rank = rng.choice((1, 1, 2))
            dims = tuple(rng.choice(("h", "b", "q", "k", "k", rng.choice((3, 5, 8, 16)))) for _ in range(rank))
            spec = TensorSpec(f"t{len(self.tensors)}", dtype, dims)
            self.tensors.append(spec)
        else:
            return None
        return f"{spec.name}[{', '.join(self._index(d) for d in spec.dims)}]"

    def _index(self, dim) -> str:
        if dim == "q":
            return "q_idx"
        if dim == "k":
            return "kv_idx"
        if dim in ("h", "b"):
            return dim
        self._in_index += 1
        e = self.int_expr(1)
        self._in_index -= 1
        return f"({e}) % {dim}" if self.rng.random() < 0.7 else f"torch.clamp({e}, 0, {dim - 1})"

    # -- ints
    def int_expr(self, depth: int) -> str:
        rng = self.rng
        if depth <= 0 or rng.random() < 0.3:
            return rng.choice(self.INT_VARS + ("q_idx", "kv_idx"))
        a = self.int_expr(depth - 1)
        r = rng.randrange(12)
        if r == 0:
            return f"({a} + {self.int_expr(depth - 1)})"
        if r == 1:
            return f"({a} - {self.int_expr(depth - 1)})"
        if r == 2:
            return f"({a} * {rng.choice((2, 3, -1))})"
        if r == 3:
            return f"({a} // {rng.choice((2, 3, 7, 16, 64, -3))})"
        if r == 4:
            return f"({a} % {rng.choice((2, 3, 5, 8, 13, -4))})"
        if r == 5:
            return rng.choice((f"torch.abs({a})", f"abs({a})", f"({a}).abs()"))
        if r == 6:
            return f"torch.{rng.choice(('minimum', 'maximum'))}({a}, {self.int_expr(depth - 1)})"
        if r == 7:
            lo = rng.randrange(-3, 10)
            hi = lo + rng.randrange(1, 40)
            return rng.choice((f"torch.clamp({a}, min={lo}, max={hi})", f"({a}).clamp(min={lo})"))
        if r == 8:
            return f"torch.where({self.bool_expr(depth - 1)}, {a}, {self.int_expr(depth - 1)})"
        if r == 9:
            t = self._table("int")
            if t is not None:
                return t
        if r == 10:
            return f"({a} + {rng.randrange(-20, 21)})"
        return f"(-{a})"

    # -- bools
    def bool_expr(self, depth: int) -> str:
        rng = self.rng
        if depth <= 0 or rng.random() < 0.35:
            r = rng.randrange(6)
            if r == 0:
                t = self._table("bool")
                if t is not None:
                    return t
            if r == 1:
                t = self._table("int")
                if t is not None and t.endswith("[q_idx]"):
                    return f"({t} == {t[:-len('[q_idx]')]}[kv_idx])"  # document mask
            if r == 2:
                return f"({self.float_expr(0)} > {rng.choice((-0.3, 0.0, 0.4))})"
            if r == 3:
                return f"(torch.abs(q_idx - kv_idx) <= {rng.choice((0, 1, 3, 17, 70))})"
            op = rng.choice(("<", "<=", "==", "!=", ">", ">="))
            rhs = self.int_expr(depth - 1) if rng.random() < 0.6 else str(rng.randrange(-2, 90))
            return f"({self.int_expr(max(depth - 1, 1))} {op} {rhs})"
        a, b = self.bool_expr(depth - 1), self.bool_expr(depth - 1)
        r = rng.randrange(7)
        if r == 0:
            return f"({a} & {b})"
        if r == 1:
            return f"({a} | {b})"
        if r == 2:
            return f"(~{a})"
        if r == 3:
            return f"({a} ^ {b})"
        if r == 4:
            return f"torch.logical_and({a}, {b})"
        if r == 5:
            return f"torch.logical_or({a}, {b})"
        return f"torch.logical_not({a})"

    # -- bounded floats (no score)
    def float_expr(self, depth: int) -> str:
        rng = self.rng
        c = rng.choice((0.05, 0.1, 0.25, 0.5))
        if depth <= 0 or rng.random() < 0.3:
            r = rng.randrange(6)
            if r == 0:
                t = self._table("float")
                if t is not None:
                    return t
            if r == 1:
                return rng.choice((f"(({self.int_expr(1)}) % {rng.choice((4, 9, 16))}).float() * {c}",
                                   f"(({self.int_expr(1)}) % 7).to(torch.float32) * {c}"))
            if r == 2:
                fn = rng.choice(("tanh", "sigmoid"))
                return rng.choice((f"torch.{fn}(({self.int_expr(1)}).float() * {round(c * 0.2, 4)})",
                                   f"({self.int_expr(1)}).float().{fn}()"))
            if r == 3:
                cond, x, y = self.bool_expr(1), rng.choice((0.5, -1.0, 1.5)), rng.choice((0.0, -0.25, 2.0))
                return f"torch.where({cond}, {x}, {y})"
            if r == 4:
                return f"({self.bool_expr(1)}) * {rng.choice((0.5, -0.75))}"
            t = self._table("int")
            if t is not None:
                return f"{t}.float() * {c}"
            return f"torch.sigmoid((q_idx - kv_idx).float() * {round(c * 0.1, 4)})"
        a = self.float_expr(depth - 1)
        r = rng.randrange(12)
        if r == 0:
            return f"({a} + {self.float_expr(depth - 1)})"
        if r == 1:
            return f"({a} - {self.float_expr(depth - 1)})"
        if r == 2:
            return f"({a} * {rng.choice((0.5, -1.5, 2.0))})"
        if r == 3:
            return rng.choice((f"torch.tanh({a})", f"({a}).tanh()"))
        if r == 4:
            return rng.choice((f"torch.sigmoid({a})", f"({a}).sigmoid()"))
        if r == 5:
            return rng.choice((f"torch.exp(-torch.abs({a}))", f"(-({a}).abs()).exp()"))
        if r == 6:
            return rng.choice((f"torch.log(1 + torch.abs({a}))", f"torch.log(torch.sigmoid({a}))"))
        if r == 7:
            return f"torch.{rng.choice(('minimum', 'maximum'))}({a}, {self.float_expr(depth - 1)})"
        if r == 8:
            return f"torch.where({self.bool_expr(depth - 1)}, {a}, {self.float_expr(depth - 1)})"
        if r == 9:
            return f"({a} / (1 + torch.abs({self.float_expr(depth - 1)})))"
        if r == 10:
            return f"({a} * torch.tanh({self.float_expr(depth - 1)}))"
        return f"torch.exp(torch.tanh({a}))"

    # -- the score: transformations with slopes in about [0, 2]
    def score_expr(self, depth: int) -> str:
        rng = self.rng
        if depth <= 0:
            return "score"
        s = self.score_expr(depth - 1)
        r = rng.randrange(13)
        if r <= 2:
            return f"({s} {rng.choice('+-')} {self.float_expr(rng.randrange(3))})"
        if r == 3:
            return f"({s} * {rng.choice((0.5, 0.75, 1.25, 1.5))})"
        if r == 4:
            return f"({s} * (1 + 0.5 * torch.tanh({self.float_expr(1)})))"
        if r == 5:
            c = rng.choice((2.0, 4.0, 10.0))
            return rng.choice((f"(torch.tanh({s} / {c}) * {c})", f"(({s} / {c}).tanh() * {c})"))
        if r == 6:
            return f"torch.where({self.bool_expr(2)}, {s}, {s} * {rng.choice((0.5, 1.5))})"
        if r == 7:
            return f"torch.where({s} > 0, {s}, {s} * {rng.choice((0.25, 0.5))})"  # continuous at 0
        if r == 8:
            return rng.choice((f"torch.clamp({s}, min={rng.choice((-2.0, -0.5))})",
                               f"torch.minimum({s}, {self.float_expr(1)} + 2)",
                               f"torch.maximum({s}, {s} * 0.5)"))
        if r == 9:
            return f"({s} - torch.log(1 + torch.abs({s})) * 0.5)"
        if r == 10:
            return f"({s} + torch.sigmoid({s}))"
        if r == 11:
            return f"torch.abs({s})"
        return f"torch.where({self.bool_expr(1)}, {s} + {self.float_expr(1)}, {s})"


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


def draw_score_mod(rng: random.Random) -> ModSpec:
    g = ModGen(rng, "score")
    if rng.random() < 0.05:  # a pure bias: no gradient reaches q and k
        expr = g.float_expr(2)
    else:
        expr = g.score_expr(rng.choice((1, 1, 2, 2, 3)))
    return ModSpec("score", expr, tuple(g.tensors))


def draw_mask_mod(rng: random.Random) -> ModSpec:
    g = ModGen(rng, "mask")
    expr = g.bool_expr(rng.choice((1, 2, 2, 3)))
    if rng.random() < 0.4:  # mostly visible: an arbitrary mask or a band around the diagonal
        expr = f"({expr} | (torch.abs(q_idx - kv_idx) <= {rng.choice((0, 2, 30))}))"
    return ModSpec("mask", expr, tuple(g.tensors))


# ---- a case -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockMaskSpec:
    source: str  # "fa4" (torch_fa4.create_block_mask) or "torch" (torch's create_block_mask)
    per_batch: bool  # B given (else None: one mask for every batch)
    per_head: bool
    block_size: Any
    also_mask_mod: bool  # attention(): pass mask_mod= the block mask's own mask_mod as well


@dataclass(frozen=True)
class FuzzCase:
    seed: int
    space: str
    api: str  # "attention" | "flex"
    dtype: torch.dtype
    layout: str  # dense: bshd | bhsd | packed; varlen: thd | packed; flex: bhsd | bshd
    varlen: str  # "" dense | "qk" cu_seqlens_q and _k | "q" cu_seqlens_q with dense (B, Sk) keys
    lens_q: tuple  # per sequence (dense: B equal entries)
    lens_k: tuple
    seqused_k: Optional[tuple]
    give_max_seqlen: bool
    heads: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    scale: Optional[float]
    logit_std: float  # q and k are scaled so the scores' spread is about this (3: peaked rows)
    causal: bool
    window: tuple
    softcap: float
    score_mod: Optional[ModSpec]
    mask_mod: Optional[ModSpec]
    block_mask: Optional[BlockMaskSpec]
    deterministic: bool
    grad: bool

    @property
    def batch(self) -> int:
        return len(self.lens_q)

    def __repr__(self) -> str:
        if self.varlen:
            shape = f"varlen={self.varlen} lens_q={list(self.lens_q)} lens_k={list(self.lens_k)}"
        else:
            sq, sk = (self.lens_q[0], self.lens_k[0]) if self.lens_q else (0, 0)
            shape = f"B={self.batch} Sq={sq} Sk={sk}"
        parts = [f"seed={self.seed}", self.space, self.api, _SHORT[self.dtype], self.layout, shape,
                 f"H={self.heads}/{self.heads_kv}", f"D={self.head_dim}/{self.head_dim_v}"]
        if self.seqused_k is not None:
            parts.append(f"seqused_k={list(self.seqused_k)}")
        if self.varlen and not self.give_max_seqlen:
            parts.append("max_seqlen=None")
        if self.scale is not None:
            parts.append(f"scale={self.scale:g}")
        if self.logit_std != 1:
            parts.append(f"logit_std={self.logit_std:g}")
        if self.causal:
            parts.append("causal")
        if self.window != (None, None):
            parts.append(f"window={self.window}")
        if self.softcap:
            parts.append(f"softcap={self.softcap:g}")
        if self.score_mod:
            parts.append(f"score_mod={self.score_mod!r}")
        if self.mask_mod:
            parts.append(f"mask_mod={self.mask_mod!r}")
        if self.block_mask:
            bm = self.block_mask
            parts.append(f"block_mask={bm.source}(BLOCK_SIZE={bm.block_size}, B={'B' if bm.per_batch else None}, "
                         f"H={'H' if bm.per_head else None}{', +mask_mod' if bm.also_mask_mod else ''})")
        if self.deterministic:
            parts.append("deterministic")
        parts.append("fwd+bwd" if self.grad else "fwd")
        return "FuzzCase(" + " ".join(parts) + ")"


def _family_rng(seed: int, space: Space) -> random.Random:
    """The choices that select a compiled kernel variant: per seed on the CPU; on the GPU shared by
    the seeds of one family (seed % families within each block of 4096 seeds)."""
    if space.families is None:
        return random.Random(f"case:{space.name}:{seed}")
    return random.Random(f"family:{space.name}:{seed >> 12}:{seed % space.families}")


def _draw_len(rng: random.Random, space: Space, zero: float = 0.04, one: float = 0.04) -> int:
    r = rng.random()
    if r < zero:
        return 0
    if r < zero + one:
        return 1
    if r < 0.4:
        t = rng.choice(space.tiles + (2 * space.tiles[-1],))
        return max(0, t + rng.choice((-1, 0, 1)))
    if r < 0.45:
        return 2
    if r < 0.92:
        return rng.randint(3, space.max_len)
    return rng.randint(space.max_len, space.long_len)


def case_from_seed(seed: int, space: Space = CPU) -> FuzzCase:
    fam = _family_rng(seed, space)
    rng = random.Random(f"shape:{space.name}:{seed}")

    # ---- kernel-variant choices (family)
    dtype = _weighted(fam, space.dtypes)
    head_dim = _weighted(fam, space.head_dims)
    head_dim_v = head_dim
    if fam.random() < 0.08:
        head_dim, head_dim_v = fam.choice(space.dv_pairs)
    api = "flex" if fam.random() < 0.2 else "attention"
    causal = api == "attention" and fam.random() < 0.45
    window_kind = "none" if api == "flex" else _weighted(
        fam, (("none", 0.6), ("left", 0.12), ("right", 0.07), ("both", 0.12), ("zero", 0.05), ("huge", 0.04)))
    softcap_on = api == "attention" and fam.random() < 0.15
    varlen = "" if api == "flex" else _weighted(fam, (("", 0.6), ("qk", 0.35), ("q", 0.05)))
    seqused_on = api == "attention" and fam.random() < (0.25 if varlen != "qk" else 0.1)
    score_mod = draw_score_mod(fam) if fam.random() < (0.45 if api == "flex" else 0.3) else None
    mask_mod = draw_mask_mod(fam) if fam.random() < (0.5 if api == "flex" else 0.3) else None
    block_on = mask_mod is not None and varlen != "q" and fam.random() < (0.25 if varlen else 0.5)
    block_size = _weighted(fam, space.block_sizes)
    deterministic = api == "attention" and fam.random() < 0.2

    # ---- shapes, values and the rest (per seed)
    heads_kv = rng.randint(1, space.max_heads_kv)
    group = rng.choice((1, 1, 2, 3, 4, 8))
    while heads_kv * group > space.max_heads:
        group //= 2
    heads = heads_kv * max(group, 1)

    if varlen:
        n = rng.choice((1, 2, 3, 3, 4, 5, 6))
        lens_q = [_draw_len(rng, space, zero=0.15, one=0.15) for _ in range(n)]
        if varlen == "q" or rng.random() >= 0.35:
            lens_k = [_draw_len(rng, space, zero=0.1, one=0.15) for _ in range(n)]
            if varlen == "q":
                lens_k = [max(lens_k)] * n  # dense keys: one length for every sequence
        else:
            lens_k = list(lens_q)
    else:
        b = 0 if rng.random() < 0.02 else rng.randint(1, space.max_batch)
        sq = _draw_len(rng, space)
        sk = sq if rng.random() < 0.3 else _draw_len(rng, space)
        lens_q, lens_k = [sq] * b, [sk] * b
    lens_q, lens_k = _fit(lens_q, lens_k, heads, space.max_scores, dense=not varlen or varlen == "q")

    seqused = None
    if seqused_on and lens_k:
        seqused = tuple(rng.choice((0, 1, n, n, rng.randint(0, n))) if n else 0 for n in lens_k)
        seqused = tuple(min(u, n) for u, n in zip(seqused, lens_k))

    layouts = {"flex": ("bhsd", "bshd"), "": ("bshd", "bhsd", "packed")}.get(api if api == "flex" else varlen,
                                                                             ("thd", "packed"))
    layout = rng.choice(layouts)
    scale = None
    r = rng.random()
    if r < 0.3:
        scale = round(rng.uniform(0.02, 0.5), 4)
    elif r < 0.36:
        scale = -round(rng.uniform(0.05, 0.3), 4)
    logit_std = rng.choice((1.0, 1.0, 1.0, 3.0))
    window = (None, None)
    if window_kind != "none":
        def w():
            return rng.choice((0, 1, 2, rng.randint(3, 40), rng.randint(0, max(lens_k or [0]) + 5)))
        window = {"left": lambda: (w(), rng.choice((None, -1))),
                  "right": lambda: (rng.choice((None, -1)), w()),
                  "both": lambda: (w(), w()),
                  "zero": lambda: (0, 0),
                  "huge": lambda: (10**6, rng.choice((10**6, 0)))}[window_kind]()
    softcap = rng.choice((2.0, 5.0, 30.0, round(rng.uniform(1.0, 50.0), 3))) if softcap_on else 0.0
    give_max = rng.random() < 0.8
    block = None
    if block_on and max(lens_q, default=0) > 0 and max(lens_k, default=0) > 0:  # (over the longest sequence)
        per_batch = mask_mod.uses("b") or rng.random() < 0.3
        per_head = mask_mod.uses("h") or rng.random() < 0.3
        block = BlockMaskSpec("torch" if rng.random() < 0.25 else "fa4", per_batch, per_head, block_size,
                              api == "attention" and rng.random() < 0.2)
    grad = rng.random() < 0.85
    return FuzzCase(seed, space.name, api, dtype, layout, varlen, tuple(lens_q), tuple(lens_k), seqused, give_max,
                    heads, heads_kv, head_dim, head_dim_v, scale, logit_std, causal, window, softcap, score_mod,
                    mask_mod, block, deterministic, grad)


def _fit(lens_q, lens_k, heads, budget, dense):
    """Halve the longest lengths until the oracle's score matrices fit the budget."""
    lens_q, lens_k = list(lens_q), list(lens_k)
    while sum(heads * a * b for a, b in zip(lens_q, lens_k)) > budget:
        if max(lens_q) >= max(lens_k):
            lens_q = [x // 2 if dense or x == max(lens_q) else x for x in lens_q]
        else:
            lens_k = [x // 2 if dense or x == max(lens_k) else x for x in lens_k]
    return lens_q, lens_k


# ---- building a case's tensors and call ---------------------------------------------------------------


@dataclass
class Inputs:
    q: torch.Tensor  # as handed to the API (flex: (B, H, S, D))
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor  # shaped like the API's output
    kwargs: dict
    score_mod: Optional[Callable]
    mask_mod: Optional[Callable]
    score_mod64: Optional[Callable]  # float64 twins (ModSpec.build)
    mask_mod64: Optional[Callable]
    cu_q: Optional[list]
    cu_k: Optional[list]


def _randn(gen, shape, dtype, amp=1.0):
    x = torch.randn(shape, generator=gen, device=gen.device)
    return (x * amp).to(dtype) if amp != 1 else x.to(dtype)


def _offsets(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def build(case: FuzzCase, device) -> Inputs:
    # drawn on the device itself (fast for the GPU's shapes; a seed replays on the same kind of device)
    gen = torch.Generator(device=device).manual_seed(case.seed)
    B, Hq, Hkv, D, Dv = case.batch, case.heads, case.heads_kv, case.head_dim, case.head_dim_v
    dt = case.dtype
    # q.k * scale has spread |scale| amp^2 sqrt(D) for unit normal q and k
    amp = math.sqrt(case.logit_std / (abs(case.scale or D ** -0.5) * math.sqrt(D)))
    need_grad = case.grad

    def leaf(t):
        return t.to(device).requires_grad_(need_grad)

    cu_q = cu_k = None
    if case.varlen:
        cu_q = _offsets(case.lens_q)
        tq = cu_q[-1]
        if case.varlen == "qk":
            cu_k = _offsets(case.lens_k)
            kshape_lead = (cu_k[-1],)
        else:
            kshape_lead = (B, case.lens_k[0] if B else 0)
        qshape_lead = (tq,)
    else:
        sq = case.lens_q[0] if B else 0
        sk = case.lens_k[0] if B else 0
        qshape_lead, kshape_lead = (B, sq), (B, sk)

    if case.api == "flex":
        bq, bk = qshape_lead, kshape_lead
        if case.layout == "bhsd":
            q = leaf(_randn(gen, (bq[0], Hq, bq[1], D), dt, amp))
            k = leaf(_randn(gen, (bk[0], Hkv, bk[1], D), dt, amp))
            v = leaf(_randn(gen, (bk[0], Hkv, bk[1], Dv), dt))
        else:  # (B, S, H, D) storage seen as (B, H, S, D)
            q = leaf(_randn(gen, (*bq, Hq, D), dt, amp)).transpose(1, 2)
            k = leaf(_randn(gen, (*bk, Hkv, D), dt, amp)).transpose(1, 2)
            v = leaf(_randn(gen, (*bk, Hkv, Dv), dt)).transpose(1, 2)
    elif case.layout == "bhsd":  # SDPA's (B, H, S, D) storage seen as (B, S, H, D)
        q = leaf(_randn(gen, (qshape_lead[0], Hq, qshape_lead[1], D), dt, amp)).transpose(1, 2)
        k = leaf(_randn(gen, (kshape_lead[0], Hkv, kshape_lead[-1], D), dt, amp)).transpose(1, 2)
        v = leaf(_randn(gen, (kshape_lead[0], Hkv, kshape_lead[-1], Dv), dt)).transpose(1, 2)
    elif case.layout == "packed":
        q = _randn(gen, (*qshape_lead, Hq, D), dt, amp)
        kv = torch.cat([_randn(gen, (*kshape_lead, Hkv, D), dt, amp), _randn(gen, (*kshape_lead, Hkv, Dv), dt)], -1)
        if qshape_lead == kshape_lead and D == Dv:  # one (.., Hq + 2 Hkv, D) projection output
            qkv = leaf(torch.cat([q, kv[..., :D], kv[..., D:]], -2))
            q, k, v = qkv[..., :Hq, :], qkv[..., Hq:Hq + Hkv, :], qkv[..., Hq + Hkv:, :]
        else:  # k and v halves of one (.., Hkv, D + Dv) tensor
            q, kv = leaf(q), leaf(kv)
            k, v = kv[..., :D], kv[..., D:]
    else:
        q = leaf(_randn(gen, (*qshape_lead, Hq, D), dt, amp))
        k = leaf(_randn(gen, (*kshape_lead, Hkv, D), dt, amp))
        v = leaf(_randn(gen, (*kshape_lead, Hkv, Dv), dt))
    out_shape = (*q.shape[:-1], Dv)
    dout = _randn(gen, out_shape, dt)

    max_q = max(case.lens_q, default=0)
    max_k = max(case.lens_k, default=0)
    # tables along positions are as long as the longer side, so either index may read them
    sizes = {"h": Hq, "b": B, "q": max(max_q, max_k), "k": max(max_q, max_k)}
    score_mod, score_mod64 = case.score_mod.build(sizes, gen, device) if case.score_mod else (None, None)
    mask_mod, mask_mod64 = case.mask_mod.build(sizes, gen, device) if case.mask_mod else (None, None)

    kwargs: dict = {}
    block_mask = None
    if case.block_mask is not None:
        bm = case.block_mask
        b_arg = B if bm.per_batch else None
        h_arg = Hq if bm.per_head else None
        if bm.source == "fa4":
            block_mask = torch_fa4.create_block_mask(mask_mod, b_arg, h_arg, max_q, max_k, device=device,
                                                     BLOCK_SIZE=bm.block_size)
        else:
            from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

            block_mask = torch_create_block_mask(mask_mod, b_arg, h_arg, max_q, max_k, device=device,
                                                 BLOCK_SIZE=bm.block_size)
    if case.api == "flex":
        kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=case.scale,
                      enable_gqa=Hq != Hkv or case.seed % 2 == 0, return_lse=True)
        if block_mask is None:
            kwargs["mask_mod"] = mask_mod
    else:
        kwargs = dict(scale=case.scale, causal=case.causal, window_size=case.window, softcap=case.softcap,
                      score_mod=score_mod, return_lse=True, deterministic=case.deterministic)
        if block_mask is not None:
            kwargs["block_mask"] = block_mask
            if case.block_mask.also_mask_mod:
                kwargs["mask_mod"] = mask_mod
        else:
            kwargs["mask_mod"] = mask_mod
        if case.varlen:
            i32 = dict(dtype=torch.int32, device=device)
            kwargs["cu_seqlens_q"] = torch.tensor(cu_q, **i32)
            if cu_k is not None:
                kwargs["cu_seqlens_k"] = torch.tensor(cu_k, **i32)
            if case.give_max_seqlen:
                kwargs["max_seqlen_q"] = max_q
                kwargs["max_seqlen_k"] = max_k
        if case.seqused_k is not None:
            kwargs["seqused_k"] = torch.tensor(case.seqused_k, dtype=torch.int32, device=device)
    return Inputs(q, k, v, dout, kwargs, score_mod, mask_mod, score_mod64, mask_mod64, cu_q, cu_k)


# ---- running the API and the oracle -----------------------------------------------------------------


@dataclass
class Result:
    """Everything in attention()'s layout: out (B, Sq, H, Dv) or (T, H, Dv); lse (B, H, Sq) or
    (H, T); dq / dk / dv shaped like q / k / v (None without a backward)."""

    out: torch.Tensor
    lse: torch.Tensor
    grads: Optional[tuple] = None
    # float64 oracle only: ||dQ||, ||dK|| of the largest error rounding O to the case's dtype can put
    # into the row sums D (see `oracle`); zero without a backward
    d_rounding: tuple = (0.0, 0.0)


def _to_attention_layout(case: FuzzCase, t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2) if case.api == "flex" else t


def run_api(case: FuzzCase, inp: Inputs) -> Result:
    if case.api == "flex":
        out, lse = torch_fa4.flex_attention(inp.q, inp.k, inp.v, **inp.kwargs)
    else:
        out, lse = torch_fa4.attention(inp.q, inp.k, inp.v, **inp.kwargs)
    grads = None
    if case.grad:
        leaves = (inp.q, inp.k, inp.v)
        grads = torch.autograd.grad(out, leaves, inp.dout, retain_graph=case.deterministic)
        if case.deterministic:
            again = torch.autograd.grad(out, leaves, inp.dout)
            for name, a, b in zip(("dq", "dk", "dv"), grads, again):
                if not torch.equal(a, b) and not (a.isnan().any() or b.isnan().any()):
                    raise AssertionError(f"deterministic backward gave two different {name}")
        grads = tuple(_to_attention_layout(case, g) for g in grads)
    return Result(_to_attention_layout(case, out.detach()), lse, grads)


@contextlib.contextmanager
def float64_scalars(on: bool = True):
    """Python floats a mod turns into tensors (torch.where(c, 0.5, -1.0), bool * 0.5) become float64."""
    if not on:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _row_sums_to_lse_layout(case: FuzzCase, x: torch.Tensor) -> torch.Tensor:
    return x.t() if case.varlen else x.transpose(1, 2)


def oracle(case: FuzzCase, inp: Inputs, dtype: torch.dtype) -> Result:
    """tests/naive.py per sequence, with autograd. dtype float64: the reference. Else a low-precision
    eager attention: q, k and the scores (softcap, score_mod) in `dtype`, the softmax and P V in
    float64 on v's `dtype` values, the results rounded to `dtype`; in the backward dS reaches dQ / dK
    in `dtype` (autograd), and the row sums D_i = dO_i . O_i of dS = P (dP - D) come from the rounded O, as in
    every flash-attention backward.

    That last error dominates dQ / dK on peaked rows and is one rounding's luck per row, so on a
    few rows eager's draw can be far below an implementation's. The float64 run therefore also
    returns the size of a large such error: each D_i off by three standard deviations of its
    rounding error, (u / sqrt(3)) ||dO_i * O_i|| for unit roundoff u, with a sign drawn per row
    (`d_rounding`, which `check_case` adds to the dQ / dK bounds in quadrature)."""
    dev = inp.q.device
    lowp = dtype != torch.float64
    q, k, v = (_to_attention_layout(case, t).detach() for t in (inp.q, inp.k, inp.v))
    q = q.to(dtype).requires_grad_()
    k = k.to(dtype).requires_grad_()
    v = v.to(torch.float64).requires_grad_()
    mods = (inp.score_mod, inp.mask_mod) if lowp else (inp.score_mod64, inp.mask_mod64)
    window = tuple(-1 if w is None else w for w in case.window)
    if case.batch:
        with float64_scalars(not lowp):
            out, lse = naive_varlen(q, k, v, cu_seqlens_q=inp.cu_q, cu_seqlens_k=inp.cu_k,
                                    seqused_k=case.seqused_k, scale=case.scale, causal=case.causal, window=window,
                                    softcap=case.softcap, score_mod=mods[0], mask_mod=mods[1],
                                    differentiable=True, softmax_dtype=torch.float64)
    else:  # no sequence
        out = v.new_zeros(*q.shape[:-1], case.head_dim_v)
        lse = v.new_zeros(case.heads, 0) if case.varlen else v.new_zeros(0, case.heads, 0)
    grads = None
    if case.grad:
        dout = _to_attention_layout(case, inp.dout).to(torch.float64)
        leaves = (q, k, v)
        outputs, grad_outputs = [out], [dout]
        if lowp and lse.requires_grad:
            # D from the rounded O: dS = P (dP - D - eps) with eps_i = dO_i . (round(O_i) - O_i),
            # which is the gradient of -eps_i * lse_i (d lse_i / d s_ij = P_ij)
            eps = (dout * (out.detach().to(dtype).to(torch.float64) - out.detach())).sum(-1)
            outputs.append(lse)
            grad_outputs.append(-_row_sums_to_lse_layout(case, eps))
        if out.requires_grad:
            got = torch.autograd.grad(outputs, leaves, grad_outputs, allow_unused=True, retain_graph=not lowp)
        else:
            got = (None, None, None)
        grads = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(got, leaves))
        if lowp:
            grads = tuple(g.to(dtype) for g in grads)
        elif lse.requires_grad:
            unit = torch.finfo(case.dtype).eps / 2  # round to nearest: half a unit in the last place
            sign = torch.randint(0, 2, lse.shape, generator=torch.Generator(dev).manual_seed(case.seed), device=dev)
            three_sd = math.sqrt(3) * unit * (dout * out.detach()).norm(dim=-1)
            eps = _row_sums_to_lse_layout(case, three_sd) * (2.0 * sign - 1)
            d_q, d_k = torch.autograd.grad(lse, (q, k), eps.nan_to_num(0.0), allow_unused=True)
            d_rounding = tuple(0.0 if g is None else g.norm().item() for g in (d_q, d_k))
            return Result(out.detach(), lse.detach(), grads, d_rounding)
    out = out.detach()
    return Result(out.to(dtype) if lowp else out, lse.detach(), grads)


# ---- comparison ---------------------------------------------------------------------------------------


def compare_tensor(name: str, got: torch.Tensor, ref: torch.Tensor, eager: torch.Tensor, dtype,
                   extra: float = 0.0) -> tuple:
    """(error message or None, measured error): ||got - ref|| <= 2 ||eager - ref|| + floor over the
    whole tensor, an independent `extra` error added in quadrature; the error is relative to ||ref||,
    or absolute (rms) where ref is all zeros."""
    if tuple(got.shape) != tuple(ref.shape):
        return f"{name}: shape {tuple(got.shape)}, want {tuple(ref.shape)}", math.inf
    g, r, e = (t.detach().to(torch.float64) for t in (got, ref, eager))
    if g.isnan().any():
        return f"{name}: {int(g.isnan().sum())} NaN of {g.numel()}", math.inf
    if not torch.isfinite(g).all():
        return f"{name}: {int((~torch.isfinite(g)).sum())} inf of {g.numel()}", math.inf
    err, eager_err, norm = (g - r).norm().item(), (e - r).norm().item(), r.norm().item()
    root_n = math.sqrt(max(g.numel(), 1))
    bound = math.hypot(2 * eager_err, extra) + max(FLOOR_REL[dtype] * norm, FLOOR_ABS[dtype] * root_n)
    per = norm if norm > 0 else root_n  # relative, or rms where ref is all zeros
    if err <= bound:
        return None, err / per
    return (f"{name}: {'rel' if norm > 0 else 'abs rms'} err {err / per:.3e} > bound {bound / per:.3e}"
            f" (eager {_SHORT[dtype]} {eager_err / per:.3e})"), err / per


def compare_lse(got: torch.Tensor, ref: torch.Tensor, eager: torch.Tensor, dtype) -> tuple:
    if tuple(got.shape) != tuple(ref.shape):
        return f"lse: shape {tuple(got.shape)}, want {tuple(ref.shape)}", math.inf
    g, r, e = (t.detach().to(torch.float64) for t in (got, ref, eager))
    if g.isnan().any():
        return f"lse: {int(g.isnan().sum())} NaN of {g.numel()}", math.inf
    alive = torch.isfinite(r)
    if not torch.equal(torch.isfinite(g), alive) or not torch.equal(g[~alive], r[~alive]):
        bad = int((torch.isfinite(g) != alive).sum())
        return f"lse: -inf pattern differs from float64's at {bad} rows (rows with no visible key are -inf)", math.inf
    return compare_tensor("lse", g[alive], r[alive], e[alive], dtype)


@dataclass
class CaseReport:
    case: FuzzCase
    errors: list
    measured: dict

    @property
    def ok(self) -> bool:
        return not self.errors


def check_case(case: FuzzCase, device) -> CaseReport:
    inp = build(case, device)
    got = run_api(case, inp)
    ref = oracle(case, inp, torch.float64)
    eager = oracle(case, inp, case.dtype)
    errors, measured = [], {}
    msg, measured["out"] = compare_tensor("out", got.out, ref.out, eager.out, case.dtype)
    errors += [msg] if msg else []
    if got.out.dtype != case.dtype:
        errors.append(f"out: dtype {got.out.dtype}, want {case.dtype}")
    msg, measured["lse"] = compare_lse(got.lse, ref.lse, eager.lse, case.dtype)
    errors += [msg] if msg else []
    if case.grad:
        extra = (*ref.d_rounding, 0.0)
        for name, g, r, e, x in zip(("dq", "dk", "dv"), got.grads, ref.grads, eager.grads, extra):
            msg, measured[name] = compare_tensor(name, g, r, e, case.dtype, x)
            errors += [msg] if msg else []
    return CaseReport(case, errors, measured)


def run_seed(seed: int, space: Space, device) -> CaseReport:
    """check_case, with an exception raised anywhere in the case reported as its error."""
    case = case_from_seed(seed, space)
    try:
        return check_case(case, device)
    except Exception as e:  # noqa: BLE001 - a fuzz reports every failure, whatever it is
        return CaseReport(case, [f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]], {})


# ---- running many seeds -------------------------------------------------------------------------------


def first_seed_and_count(config, default_cases: int) -> tuple[int, int, bool]:
    """(first seed, number of cases, whether --fuzz-cases was given) from the pytest options
    --fuzz-seed (default: the run's test seed, which the report header prints) and --fuzz-cases."""
    seed = config.getoption("--fuzz-seed")
    if seed is None:
        seed = getattr(sys.modules.get("conftest"), "_BASE_SEED", None)
    if seed is None:
        seed = int(os.environ.get("TORCH_FA4_TEST_SEED", random.randrange(1 << 31)))
    cases = config.getoption("--fuzz-cases")
    return seed, (default_cases if cases is None else cases), cases is not None


def replay_command(test_path: str, seed: int) -> str:
    return f"python -m pytest {test_path} --fuzz-seed {seed} --fuzz-cases 1"


def failure_report(failures: list, ran: int, first: int, test_path: str) -> str:
    lines = [f"{len(failures)} of {ran} fuzz cases failed (seeds {first}..{first + ran - 1}):"]
    for r in failures:
        lines.append(f"  {r.case!r}")
        lines += [f"      {e}" for e in r.errors]
        lines.append(f"      replay: {replay_command(test_path, r.case.seed)}")
    return "\n".join(lines)
