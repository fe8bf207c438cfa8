"""Randomized differential tests on the CPU: the public API (the exact reference path) against
float64 attention over the whole advertised space (tests/fuzz_space.py), and randomly corrupted
arguments, each of which must raise a clear error.

Every failure prints its seed; `python -m pytest tests/test_fuzz.py::<test> --fuzz-seed S
--fuzz-cases 1` replays it. `--fuzz-cases N` runs longer.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter

import pytest
import torch

import fuzz_space as F
import torch_fa4
from torch_fa4.mods import ModTraceError

DIFFERENTIAL_CASES = 1500  # about a minute on two idle cores
CORRUPTED_CASES = 1000


def test_reference_matches_float64(request):
    first, count, _ = F.first_seed_and_count(request.config, DIFFERENTIAL_CASES)
    failures = [r for r in (F.run_seed(s, F.CPU, "cpu") for s in range(first, first + count)) if not r.ok]
    assert not failures, F.failure_report(failures, count, first, request.node.nodeid)


# ---- the generator itself ------------------------------------------------------------------------------


def test_case_from_seed_rebuilds_the_case_and_its_tensors():
    for seed in (3, 77, 12345):
        a, b = F.case_from_seed(seed, F.CPU), F.case_from_seed(seed, F.CPU)
        assert a == b and repr(a) == repr(b) and "\n" not in repr(a)
        x, y = F.build(a, "cpu"), F.build(b, "cpu")
        for s, t in zip((x.q, x.k, x.v, x.dout), (y.q, y.k, y.v, y.dout)):
            assert torch.equal(s, t)
    assert F.case_from_seed(3, F.CPU) != F.case_from_seed(4, F.CPU)


def _reaches(space, seeds):
    """Which features `seeds` cases of `space` reach (configurations only: no tensors)."""
    seen = Counter()
    tiles = {t + d for t in space.tiles for d in (-1, 0, 1)}
    for seed in seeds:
        c = F.case_from_seed(seed, space)
        seen[c.api, c.layout] += 1
        seen[c.dtype] += 1
        lens = set(c.lens_q) | set(c.lens_k)
        seen.update(f"len{n}" for n in lens & ({0, 1, 2} | tiles))
        if c.lens_q and not c.varlen and c.lens_q[0] != c.lens_k[0]:
            seen["Sq>Sk" if c.lens_q[0] > c.lens_k[0] else "Sq<Sk"] += 1
        if c.varlen == "qk" and len(c.lens_q) > 1:
            for i, n in enumerate(c.lens_q):
                where = "first" if i == 0 else "last" if i == len(c.lens_q) - 1 else "middle"
                seen[f"packed len{n} at {where}"] += n in (0, 1)
        seen["varlen " + (c.varlen or "none")] += 1
        seen["seqused_k"] += c.seqused_k is not None
        seen["gqa"] += c.heads != c.heads_kv
        seen["mqa"] += c.heads_kv == 1 and c.heads > 1
        seen["Dv!=D"] += c.head_dim != c.head_dim_v
        seen["causal"] += c.causal
        seen["window 0"] += 0 in c.window
        seen["window"] += c.window != (None, None)
        seen["softcap"] += c.softcap > 0
        seen["negative scale"] += (c.scale or 0) < 0
        seen["score_mod"] += c.score_mod is not None
        seen["mask_mod"] += c.mask_mod is not None
        if c.block_mask:
            seen["block_mask " + c.block_mask.source] += 1
            seen["block_mask varlen"] += bool(c.varlen)
        seen["deterministic"] += c.deterministic
        seen["forward only"] += not c.grad
    return seen


@pytest.mark.parametrize("space", [F.CPU, F.GPU], ids=lambda s: s.name)
def test_generator_reaches_the_whole_space(space):
    seen = _reaches(space, range(0, 4000 * 257, 257))  # spread over many blocks of GPU families
    want = ([("attention", lay) for lay in ("bshd", "bhsd", "packed", "thd")] + [("flex", "bhsd"), ("flex", "bshd")]
            + [d for d, _ in space.dtypes] + ["len0", "len1", "len2"]
            + [f"len{t + d}" for t in space.tiles for d in (-1, 0, 1)] + ["Sq>Sk", "Sq<Sk"]
            + [f"packed len{n} at {p}" for n in (0, 1) for p in ("first", "middle", "last")]
            + ["varlen qk", "varlen q", "seqused_k", "gqa", "mqa", "Dv!=D", "causal", "window 0", "window",
               "softcap", "negative scale", "score_mod", "mask_mod", "block_mask fa4", "block_mask torch",
               "block_mask varlen", "deterministic", "forward only"])
    missing = [w for w in want if not seen[w]]
    assert not missing, f"the {space.name} space never draws {missing}"


def test_generated_mods_use_the_whole_op_set():
    rng = random.Random(0)
    sources = " ".join(F.draw_score_mod(rng).expr + " " + F.draw_mask_mod(rng).expr for _ in range(400))
    ops = [" + ", " - ", " * ", " / ", " // ", " % ", " == ", " != ", " < ", " <= ", " > ", " >= ", " & ", " | ",
           " ^ ", "~", "torch.where(", "abs(", ".abs()", "torch.exp(", ".exp()", "torch.log(", "torch.tanh(",
           ".tanh()", "torch.sigmoid(", ".sigmoid()", "torch.minimum(", "torch.maximum(", "torch.clamp(",
           ".clamp(", ".float()", ".to(torch.float32)", "torch.logical_and(", "torch.logical_or(",
           "torch.logical_not(", "t0[", "[h]", "[b", "[q_idx", "[kv_idx"]
    missing = [op for op in ops if op not in sources]
    assert not missing, f"generated mods never use {missing}"


def test_gpu_space_repeats_kernel_variants():
    """GPU cases draw the choices that select a compiled kernel from a few families per block of
    seeds, so a run of consecutive seeds reuses its compiled variants."""
    def variant(c):
        return (c.dtype, c.head_dim, c.head_dim_v, c.causal, c.window != (None, None), c.softcap > 0,
                c.varlen, c.seqused_k is not None, c.score_mod, c.mask_mod, c.deterministic)

    cases = [F.case_from_seed(s, F.GPU) for s in range(5000, 5600)]
    assert len({(c.dtype, c.head_dim, c.score_mod, c.mask_mod) for c in cases}) <= 2 * F.GPU.families
    assert len({variant(c) for c in cases}) <= 4 * F.GPU.families  # seqused and block masks vary per shape
    assert len({c.lens_q for c in cases}) > 300  # while the shapes vary freely


# ---- corrupted arguments -------------------------------------------------------------------------------


class _Call:
    """A valid attention call, then corrupted in place."""

    def __init__(self, rng: random.Random, varlen: bool):
        self.fn = torch_fa4.attention
        b, hkv, g = rng.randint(1, 3), rng.randint(1, 3), rng.choice((1, 2, 4))
        self.hq, self.hkv, self.d = hkv * g, hkv, rng.choice((16, 32, 64))
        self.varlen = varlen
        if self.varlen:
            lens_q = [rng.randint(0, 9) for _ in range(b)]
            lens_k = [rng.randint(0, 9) for _ in range(b)]
            self.cu_q, self.cu_k = F._offsets(lens_q), F._offsets(lens_k)
            lead_q, lead_k = (self.cu_q[-1],), (self.cu_k[-1],)
        else:
            sq, sk = rng.randint(1, 9), rng.randint(1, 9)
            lead_q, lead_k = (b, sq), (b, sk)
        self.b = b
        self.args = {"q": torch.randn(*lead_q, self.hq, self.d), "k": torch.randn(*lead_k, hkv, self.d),
                     "v": torch.randn(*lead_k, hkv, self.d)}
        self.kwargs = {}
        if self.varlen:
            self.kwargs.update(cu_seqlens_q=torch.tensor(self.cu_q, dtype=torch.int32),
                               cu_seqlens_k=torch.tensor(self.cu_k, dtype=torch.int32),
                               max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
        self.seq_k = None if self.varlen else lead_k[1]

    def __call__(self):
        return self.fn(self.args["q"], self.args["k"], self.args["v"], **self.kwargs)


def _dtype(rng, c):
    name = rng.choice("qkv")
    dt = rng.choice((torch.int64, torch.int32, torch.bool, torch.uint8, torch.complex64, torch.float8_e4m3fn))
    c.args[name] = c.args[name].to(dt)
    return TypeError, rf"{name} has dtype"


def _mixed_dtypes(rng, c):
    name = rng.choice("kv")
    c.args[name] = c.args[name].to(rng.choice((torch.float64, torch.float16, torch.bfloat16)))
    return TypeError, "share one dtype"


def _not_a_tensor(rng, c):
    name = rng.choice("qkv")
    c.args[name] = rng.choice((c.args[name].tolist(), c.args[name].numpy()))
    return TypeError, rf"{name} must be a torch.Tensor"


def _rank(rng, c):
    name = rng.choice("qkv")
    c.args[name] = rng.choice((c.args[name].unsqueeze(0), c.args[name].flatten(0, 1)))
    return ValueError, rf"{name} must be \d-D"


def _last_dim_strided(rng, c):
    name = rng.choice("qkv")
    t = c.args[name]
    c.args[name] = torch.randn(*t.shape[:-1], 2 * t.shape[-1])[..., ::2]
    return ValueError, "last dimension .* must be contiguous"


def _head_dim_mismatch(rng, c):
    c.args["k"] = c.args["k"][..., : c.d - 8]
    return ValueError, "same head dim"


def _unsupported_head_dim(rng, c):
    d = rng.choice((4, 12, 36, 100, 264, 512))
    for name in "qkv":
        t = c.args[name]
        c.args[name] = torch.randn(*t.shape[:-1], d)
    return ValueError, f"head dim of q/k is {d}"


def _unsupported_head_dim_v(rng, c):
    dv = rng.choice((4, 20, 260))
    c.args["v"] = torch.randn(*c.args["v"].shape[:-1], dv)
    return ValueError, f"head dim of v is {dv}"


def _k_v_disagree(rng, c):
    v = c.args["v"]
    shape = list(v.shape)
    shape[-2 if rng.random() < 0.5 else 0] += 1
    c.args["v"] = torch.randn(*shape)
    return ValueError, "k and v must agree"


def _heads_not_a_multiple(rng, c):
    q = c.args["q"]
    if c.hkv > 1 and rng.random() < 0.7:
        c.args["q"] = torch.randn(*q.shape[:-2], c.hkv * rng.randint(1, 3) + 1, c.d)
    else:  # no KV heads at all
        c.args["k"], c.args["v"] = c.args["k"][..., :0, :], c.args["v"][..., :0, :]
    return ValueError, "must be a multiple of the number of KV heads"


def _batch_mismatch(rng, c):
    q = c.args["q"]
    c.args["q"] = torch.randn(q.shape[0] + rng.choice((1, -1)) if q.shape[0] > 1 else 2, *q.shape[1:])
    return ValueError, "same batch size"


def _cu_dtype(rng, c):
    name = rng.choice(("cu_seqlens_q", "cu_seqlens_k"))
    t = c.kwargs[name]
    c.kwargs[name] = rng.choice((t.long(), t.float(), t.view(1, -1), t.tolist()))
    if isinstance(c.kwargs[name], list):
        return TypeError, f"{name} must be a torch.Tensor"
    return TypeError, f"{name} must be a 1-D int32 tensor"


def _cu_length(rng, c):
    cu = c.cu_k
    c.kwargs["cu_seqlens_k"] = torch.tensor(cu + [cu[-1]] if rng.random() < 0.5 else cu[:-1], dtype=torch.int32)
    return ValueError, "cu_seqlens_k must have"


def _cu_order(rng, c):
    name, cu = rng.choice((("cu_seqlens_q", c.cu_q), ("cu_seqlens_k", c.cu_k)))
    cu = list(cu)
    if rng.random() < 0.4 or len(cu) < 3:
        cu[0] = rng.choice((1, -1))  # must start at 0
    else:
        i = rng.randrange(1, len(cu) - 1)
        cu[i] = cu[i + 1] + 1  # decreasing
    c.kwargs[name] = torch.tensor(cu, dtype=torch.int32)
    return ValueError, f"{name} must start at 0 and never decrease"


def _cu_last(rng, c):
    name, cu = rng.choice((("cu_seqlens_q", c.cu_q), ("cu_seqlens_k", c.cu_k)))
    cu = list(cu)
    cu[-1] += rng.choice((1, 2, 5))
    c.kwargs[name] = torch.tensor(cu, dtype=torch.int32)
    return ValueError, rf"{name}\[-1\] is {cu[-1]} but the tensor holds"


def _cu_k_alone(rng, c):
    if c.varlen:
        del c.kwargs["cu_seqlens_q"]
        c.args["q"] = c.args["q"][None]
    else:
        c.args["k"], c.args["v"] = c.args["k"].flatten(0, 1), c.args["v"].flatten(0, 1)
        c.kwargs["cu_seqlens_k"] = torch.tensor([0, c.args["k"].shape[0]], dtype=torch.int32)
    return ValueError, "cu_seqlens_k needs cu_seqlens_q"


def _offsets_elsewhere(rng, c):
    if c.varlen:
        name = rng.choice(("cu_seqlens_q", "cu_seqlens_k"))
    else:
        name = "seqused_k"
        c.kwargs[name] = torch.zeros(c.b, dtype=torch.int32)
    c.kwargs[name] = c.kwargs[name].to("meta")
    return ValueError, f"{name} is on meta but q is on cpu"


def _no_offsets(rng, c):
    c.kwargs["cu_seqlens_q"] = torch.zeros(0, dtype=torch.int32)
    return ValueError, "cu_seqlens_q must have at least one entry"


def _seqused_range(rng, c):
    batch = c.b
    cap = 9 if c.varlen else c.seq_k
    used = [rng.randint(0, min(cap, 3)) for _ in range(batch)]
    used[rng.randrange(batch)] = rng.choice((-1, -5, cap + 1 + 20 * c.varlen))
    c.kwargs["seqused_k"] = torch.tensor(used, dtype=torch.int32)
    return ValueError, "seqused_k entries must lie in"


def _seqused_dtype(rng, c):
    c.kwargs["seqused_k"] = rng.choice((torch.zeros(c.b, dtype=torch.int64), torch.zeros(c.b),
                                        torch.zeros(c.b, 1, dtype=torch.int32)))
    return TypeError, "seqused_k must be a 1-D int32 tensor"


def _seqused_length(rng, c):
    c.kwargs["seqused_k"] = torch.zeros(c.b + rng.choice((1, 2)), dtype=torch.int32)
    return ValueError, f"seqused_k must have {c.b} entries"


def _window(rng, c):
    c.kwargs["window_size"] = rng.choice(((-2, 0), (0, -7), (1.5, 2), (3, 2.0), (True, 0), (0, False), (1, 2, 3),
                                          (None,), 5, "ab", (-1, -100)))
    return ValueError, "window_size"


def _softcap(rng, c):
    c.kwargs["softcap"] = rng.choice((-1.0, -1e-3, math.nan, math.inf, "3", torch.tensor(3.0), None))
    return ValueError, "softcap must be a finite number"


def _scale(rng, c):
    c.kwargs["scale"] = rng.choice((math.nan, math.inf, -math.inf, "0.1", [0.1], torch.tensor(0.3)))
    return ValueError, "scale must be a finite number"


def _device_mismatch(rng, c):
    name = rng.choice("kv")
    c.args[name] = c.args[name].to("meta")
    return ValueError, "q, k, v must be on one device"


def _block_mask_type(rng, c):
    c.kwargs["block_mask"] = rng.choice((torch.ones(3), {"kv_num_blocks": 1}, (1, 2), "causal"))
    return TypeError, "block_mask must be a BlockMask"


def _two_masks(rng, c):
    if c.varlen:
        sq, sk = max(c.cu_q[i + 1] - c.cu_q[i] for i in range(c.b)), max(c.cu_k[i + 1] - c.cu_k[i] for i in range(c.b))
    else:
        sq, sk = c.args["q"].shape[1], c.seq_k
    bm = torch_fa4.create_block_mask(torch_fa4.mods.causal_mask, None, None, max(sq, 1), max(sk, 1), device="cpu",
                                     BLOCK_SIZE=8)
    c.kwargs.update(block_mask=bm, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    return ValueError, "pass either mask_mod or a block_mask built from it"


def _max_seqlen(rng, c):
    lens = {"max_seqlen_q": c.cu_q, "max_seqlen_k": c.cu_k}
    name = rng.choice(sorted(lens))
    longest = max(b - a for a, b in zip(lens[name], lens[name][1:]))
    c.kwargs[name] = rng.choice((-1, longest - 1 if longest else -2, "eight"))
    return (ValueError, TypeError), name


def _mod_not_callable(rng, c):
    name = rng.choice(("score_mod", "mask_mod"))
    c.kwargs[name] = rng.choice((3, "alibi", torch.ones(2)))
    return TypeError, name


def _mod_arity(rng, c):
    if rng.random() < 0.5:
        c.kwargs["score_mod"] = lambda score, b, h, q_idx: score
        return TypeError, "score_mod"
    c.kwargs["mask_mod"] = lambda score, b, h, q_idx, kv_idx: q_idx >= kv_idx
    return TypeError, "mask_mod"


_TABLE = torch.randn(4)
_TABLE2 = torch.randn(4, 4)


def _mod_unsupported(rng, c):
    mods = [
        ("score_mod", lambda s, b, h, q, k: torch.sin(s), "unsupported operation.*torch.sin"),
        ("score_mod", lambda s, b, h, q, k: s ** 2, r"unsupported operation.*\*\*"),
        ("score_mod", lambda s, b, h, q, k: s.cumsum(0), "unsupported operation.*cumsum"),
        ("score_mod", lambda s, b, h, q, k: s if q > k else -s, "control flow"),
        ("score_mod", lambda s, b, h, q, k: s // 2, "supported on integer values only"),
        ("score_mod", lambda s, b, h, q, k: s + _TABLE, "index it down"),
        ("score_mod", lambda s, b, h, q, k: s + _TABLE2[h], "rank 2 was indexed with 1"),
        ("score_mod", lambda s, b, h, q, k: s + _TABLE[s], "indexed by integer values"),
        ("score_mod", lambda s, b, h, q, k: q > k, "must return a number"),
        ("score_mod", lambda s, b, h, q, k: None, "must return one value per score element"),
        ("score_mod", lambda s, b, h, q, k: s + torch.arange(3)[0], "not captured|tensors created inside"),
        ("mask_mod", lambda b, h, q, k: (q - k) * 0.5, "must return a boolean"),
        ("mask_mod", lambda b, h, q, k: (q & k) > 0, "boolean values only"),
        ("mask_mod", lambda b, h, q, k: range(q), r"unsupported operation"),
    ]
    name, fn, pattern = rng.choice(mods)
    c.kwargs[name] = fn
    return ModTraceError, pattern


def _mod_tensor(rng, c):
    r = rng.random()
    if r < 0.6:
        t = torch.zeros(c.hq, device="meta")
        c.kwargs["score_mod"] = lambda s, b, h, q, k: s + t[h]
        return ValueError, "captured by score_mod/mask_mod is on meta"
    t = torch.zeros(c.hq, dtype=torch.complex64)
    c.kwargs["score_mod"] = lambda s, b, h, q, k: s + t[h]
    return ModTraceError, "dtype torch.complex64 are not supported"


def _flex(rng, c):
    q, k, v = (torch.randn(c.b, h, 8, c.d) for h in (c.hq, c.hkv, c.hkv))
    if c.hq != c.hkv and rng.random() < 0.6:
        c.fn, c.args, c.kwargs = torch_fa4.flex_attention, {"q": q, "k": k, "v": v}, {}
        return ValueError, "pass enable_gqa=True"
    c.fn, c.kwargs = torch_fa4.flex_attention, {"enable_gqa": True}
    name = rng.choice("qkv")
    c.args = {"q": q, "k": k, "v": v}
    c.args[name] = c.args[name][0]
    return ValueError, rf"flex_attention's {dict(q='query', k='key', v='value')[name]} must be a 4-D"


def _create_block_mask(rng, c):
    args = rng.choice(((8, 8, 0), (0, 8, 16), (8, -1, 16), (8, 8, (16, 0))))
    c.fn = lambda *_, **__: torch_fa4.create_block_mask(torch_fa4.mods.causal_mask, None, None, args[0], args[1],
                                                         device="cpu", BLOCK_SIZE=args[2])
    return ValueError, "lengths and BLOCK_SIZE must be positive"


NEEDS_VARLEN = {_cu_dtype, _cu_length, _cu_order, _cu_last, _no_offsets, _max_seqlen}
NEEDS_DENSE = {_batch_mismatch}
CORRUPTIONS = [
    _dtype, _mixed_dtypes, _not_a_tensor, _rank, _last_dim_strided, _head_dim_mismatch, _unsupported_head_dim,
    _unsupported_head_dim_v, _k_v_disagree, _heads_not_a_multiple, _batch_mismatch, _cu_dtype, _cu_length,
    _cu_order, _cu_last, _cu_k_alone, _offsets_elsewhere, _no_offsets, _seqused_range, _seqused_dtype,
    _seqused_length, _window, _softcap, _scale, _device_mismatch, _block_mask_type, _two_masks, _max_seqlen,
    _mod_not_callable, _mod_arity, _mod_unsupported, _mod_tensor, _flex, _create_block_mask,
]


def corrupted_call(seed: int):
    """(name of the corruption, the call, exception type(s), pattern its message must match)."""
    rng = random.Random(f"corrupt:{seed}")
    corruption = rng.choice(CORRUPTIONS)
    varlen = corruption in NEEDS_VARLEN or (corruption not in NEEDS_DENSE and rng.random() < 0.4)
    call = _Call(rng, varlen)
    exc, pattern = corruption(rng, call)
    return corruption.__name__.lstrip("_"), call, exc, pattern


def check_corrupted(seed: int):
    """None if the corrupted call raised the expected clear error, else what happened."""
    name, call, exc, pattern = corrupted_call(seed)
    torch.manual_seed(seed)
    try:
        call()
    except exc as e:
        if re.search(pattern, str(e), re.IGNORECASE | re.DOTALL):
            return None
        return name, f"{type(e).__name__} without /{pattern}/ in its message: {str(e)[:300]}"
    except Exception as e:  # noqa: BLE001 - any other exception is the finding
        return name, f"{type(e).__name__} (wanted {exc}): {str(e)[:300]}"
    return name, f"returned a result (wanted {exc} matching /{pattern}/)"


def test_corrupted_arguments_raise_clear_errors(request):
    first, count, _ = F.first_seed_and_count(request.config, CORRUPTED_CASES)
    failures = {}
    for seed in range(first, first + count):
        bad = check_corrupted(seed)
        if bad is not None:
            failures.setdefault(bad[0], []).append((seed, bad[1]))
    report = [f"{sum(map(len, failures.values()))} of {count} corrupted calls (seeds {first}..{first + count - 1}) "
              "did not raise a clear error:"]
    for name, cases in sorted(failures.items()):
        report.append(f"  {name} ({len(cases)}x):")
        shown = {}
        for seed, what in cases:  # one example of each distinct outcome
            shown.setdefault(re.sub(r"\d+", "N", what)[:80], (seed, what))
        for seed, what in list(shown.values())[:4]:
            report.append(f"      seed {seed}: {what}\n        replay: {F.replay_command(request.node.nodeid, seed)}")
    assert not failures, "\n".join(report)


def test_every_corruption_is_drawn():
    drawn = {corrupted_call(seed)[0] for seed in range(2000)}
    assert drawn == {c.__name__.lstrip("_") for c in CORRUPTIONS}
