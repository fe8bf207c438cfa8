"""Backward of attention whose score_mod reads a learnable tensor, against FlexAttention (compiled, Triton).

    python benchmarks/mod_grad_bench.py [--b 4 --h 16 --s 4096 --d 128]

bf16, causal. Rows: a relative-position bias table `table[h, clamp(q - kv, -R, R) + R]` (R = 128)
and learnable ALiBi slopes `slopes[h] * |q - kv|`. Each row times the backward alone (the forward's
graph kept): torch_fa4 with the captured tensor's gradient (on sm_90 the kernel accumulates it:
kernels/sm90/bwd_scores.CapturedGrads), torch_fa4 with the captured tensor frozen (dQ / dK / dV
only: what the captured gradient adds is the difference), torch_fa4 with the captured gradient
from the PyTorch recomputation (torch_fa4/mods/capture_grad.captured_grads, the path of every
family without a fused one), and FlexAttention compiled with a causal block mask and the same
score_mod, gradients for q, k, v and the captured tensor. Where FlexAttention's default backward
configuration does not compile (D128 needs more shared memory than an H200 has), it runs with
smaller backward blocks (`FLEX_SMALL_BLOCKS`); the row says which. Milliseconds (median of
triton.testing.do_bench); the last column is FlexAttention's time over torch_fa4's.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import torch_fa4

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench import _time_ms  # noqa: E402

RADIUS = 128


def relative_table(table):
    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(q_idx - kv_idx, -RADIUS, RADIUS) + RADIUS]
    return mod


def alibi(slopes):
    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return mod


def captured(name, H):
    if name == "relative bias table":
        return relative_table, torch.randn(H, 2 * RADIUS + 1, device="cuda") * 0.1
    return alibi, torch.rand(H, device="cuda") * 0.05


def ours(make_mod, param, q, k, v, learn: bool):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    p = param.detach().requires_grad_(learn)
    out = torch_fa4.flex_attention(q, k, v, score_mod=make_mod(p))
    dout = torch.randn_like(out)
    inputs = (q, k, v, p) if learn else (q, k, v)
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def ours_pytorch_path(make_mod, param, q, k, v):
    """torch_fa4 with the captured gradient from the PyTorch recomputation: the fused path made
    unavailable (capture_grad.fused_backward finds none) while the backward runs."""
    from torch_fa4.mods import capture_grad

    run = ours(make_mod, param, q, k, v, True)
    fused = capture_grad.fused_backward

    def backward():
        capture_grad.fused_backward = lambda *args: None
        try:
            return run()
        finally:
            capture_grad.fused_backward = fused
    return backward


_flex = None
# FlexAttention's backward blocks where its default configuration needs more shared memory than the
# device has (kernel_options of torch.nn.attention.flex_attention), tried in this order
FLEX_SMALL_BLOCKS = ({"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64},
                     {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32})


def flex(make_mod, param, q, k, v, kernel_options=None):
    global _flex
    import torch._functorch.config
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # The compiled backward donates its saved buffers unless told not to, and then refuses the
    # retain_graph=True that times the backward alone over one forward (as for torch_fa4)
    torch._functorch.config.donated_buffer = False
    if _flex is None:
        _flex = torch.compile(flex_attention)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    p = param.detach().requires_grad_()
    S = q.shape[2]
    bm = create_block_mask(lambda b, h, i, j: j <= i, None, None, S, S)
    out = _flex(q, k, v, score_mod=make_mod(p), block_mask=bm, kernel_options=kernel_options)
    dout = torch.randn_like(out)
    run = lambda: torch.autograd.grad(out, (q, k, v, p), dout, retain_graph=True)  # noqa: E731
    run()  # compiles the backward here: a configuration that does not fit fails now
    return run


def flex_any(make_mod, param, q, k, v, note: list):
    """flex() with its default configuration, else with the first of FLEX_SMALL_BLOCKS that
    compiles (note says which ran)."""
    for options in (None, *FLEX_SMALL_BLOCKS):
        try:
            fn = flex(make_mod, param, q, k, v, options)
            note.append(("default blocks" if options is None else f"blocks {options}", options))
            return fn
        except Exception as e:  # noqa: BLE001
            print(f"  flex, {options or 'default blocks'}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            torch._dynamo.reset()
            globals()["_flex"] = None
    raise RuntimeError("no FlexAttention configuration compiled")


def flex_fwd_bwd_minus_fwd(make_mod, param, q, k, v, options):
    """FlexAttention's backward as (forward + backward) - forward, each timed alone: a check on
    the retained-graph timing that needs no graph kept across calls."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    p = param.detach().requires_grad_()
    S = q.shape[2]
    bm = create_block_mask(lambda b, h, i, j: j <= i, None, None, S, S)
    dout = torch.randn_like(q)

    def fwd():
        return _flex(q, k, v, score_mod=make_mod(p), block_mask=bm, kernel_options=options)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), (q, k, v, p), dout)

    fwd_bwd()
    return _time_ms(fwd_bwd) - _time_ms(fwd)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    B, H, S, D = args.b, args.h, args.s, args.d
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    rows = []
    print(f"B {B}, H {H}, S {S}, D {D}, bf16, causal; backward ms ({torch.cuda.get_device_name()})")
    print("| score_mod | torch_fa4 (fused) | torch_fa4, frozen | torch_fa4, PyTorch path | FlexAttention "
          "| Flex / torch_fa4 | Flex configuration |")
    print("|---|---|---|---|---|---|---|")
    for name in ("relative bias table", "ALiBi slopes"):
        make_mod, param = captured(name, H)
        row = {"row": name}
        note = []
        for label, make in (("torch_fa4", lambda: ours(make_mod, param, q, k, v, True)),
                            ("torch_fa4 frozen", lambda: ours(make_mod, param, q, k, v, False)),
                            ("pytorch path", lambda: ours_pytorch_path(make_mod, param, q, k, v)),
                            ("flex", lambda: flex_any(make_mod, param, q, k, v, note))):
            try:
                row[label] = _time_ms(make())
            except Exception as e:  # noqa: BLE001  (a peer that cannot run this row: say why, go on)
                row[label] = None
                print(f"  {label}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            torch.cuda.empty_cache()
        if row.get("flex") is not None:  # the same backward timed the other way
            try:
                row["flex (fwd+bwd - fwd)"] = flex_fwd_bwd_minus_fwd(make_mod, param, q, k, v, note[-1][1])
                print(f"  flex, (forward + backward) - forward: {row['flex (fwd+bwd - fwd)']:.2f} ms",
                      file=sys.stderr)
            except Exception as e:  # noqa: BLE001
                print(f"  flex fwd+bwd: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        ratio = (row["flex"] / row["torch_fa4"]) if row.get("flex") and row.get("torch_fa4") else None
        cells = [f"{row[c]:.2f}" if row[c] is not None else "-" for c in
                 ("torch_fa4", "torch_fa4 frozen", "pytorch path", "flex")]
        cells.append(f"{ratio:.2f}" if ratio is not None else "-")
        row["flex configuration"] = note[-1][0] if note else None
        cells.append(note[-1][0] if note else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
