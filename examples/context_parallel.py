"""Context parallelism: one long causal sequence split across GPUs, attention on torch_fa4.

PyTorch's `torch.distributed.tensor.experimental.context_parallel` shards the sequence dimension of
the buffers it is given across a device mesh and runs `F.scaled_dot_product_attention` as ring
attention: each rank keeps its queries, the key/value shards travel round the ring, and the partial
results are merged by their log-sum-exp. Every ring step is one call of SDPA's flash op, so once
`torch_fa4.sdpa.enable()` has routed that op, all the attention work runs on torch_fa4's kernels.

Run on a machine with 2 or more GPUs:

    torchrun --nproc-per-node 2 examples/context_parallel.py [--seq 16384] [--steps 20]

The unsharded output and gradients are checked against one GPU's float32 attention (the error must
stay within twice that of one GPU's PyTorch bf16 attention) and, with `--steps`, the script times a forward + backward step on torch_fa4 and on cuDNN through the same engine.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import context_parallel_unshard
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_fa4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=16384, help="whole sequence length (split across ranks)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=0, help="timed forward+backward steps per backend (0: none)")
    p.add_argument("--profile", action="store_true", help="with --steps: rank 0 prints where a step's time goes")
    return p.parse_args(argv)


def cp_step(mesh, q, k, v, dout, backend):
    """One forward + backward of causal attention with the sequence split across `mesh`.

    q, k, v, dout: the whole (B, H, S, D) tensors, identical on every rank. Returns the unsharded
    output and gradients (in the original token order)."""
    q, k, v, dout = (t.clone() for t in (q, k, v, dout))
    with sdpa_kernel([backend]), context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
        out.backward(dout)
        return context_parallel_unshard(mesh, [out.detach(), ql.grad, kl.grad, vl.grad], [2, 2, 2, 2])


def timed_steps(mesh, q, k, v, dout, backend, steps, profile=False):
    """Median milliseconds of a sharded forward + backward step (sharding and unsharding excluded)."""
    q, k, v, dout = (t.clone() for t in (q, k, v, dout))
    times = []
    with sdpa_kernel([backend]), context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        for i in range(steps + 3):  # three warm-up steps
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            start.record()
            out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
            out.backward(dout)
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
            ql.grad = kl.grad = vl.grad = None
        if profile:
            with torch.profiler.profile() as prof:
                out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
                out.backward(dout)
                torch.cuda.synchronize()
            if dist.get_rank() == 0:
                print(f"--- one step on {backend.name}")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
                print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
    times.sort()
    return times[len(times) // 2]


def rel_error(x, ref):
    x, ref = x.float(), ref.float()
    assert not x.isnan().any(), "NaN in the context-parallel result"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def errors_vs_float32(mesh, batch, heads, seq, head_dim):
    """Relative errors of the context-parallel output and gradients (torch_fa4 through SDPA) against
    one GPU's float32 attention on the same whole tensors. Returns the tensors too, for timing."""
    torch.manual_seed(0)  # the same whole tensors on every rank
    shape = (batch, heads, seq, head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    ref.backward(dout.float())
    want = (ref.detach(), q32.grad, k32.grad, v32.grad)
    del q32, k32, v32, ref
    got = cp_step(mesh, q, k, v, dout, SDPBackend.FLASH_ATTENTION)
    errors = {name: rel_error(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    return errors, (q, k, v, dout), want


def eager_bf16_errors(tensors, want):
    """The same errors for one GPU's PyTorch bf16 attention (memory-efficient kernel): the yardstick."""
    q, k, v, dout = (t.detach().clone().requires_grad_() for t in tensors)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(dout)
    return {name: rel_error(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), want)}


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    mesh = init_device_mesh("cuda", (world,))
    if args.seq % (2 * world):
        raise SystemExit(f"--seq {args.seq} must be a multiple of 2 x {world} ranks (the causal load balancer)")
    torch_fa4.sdpa.enable()
    try:
        errors, tensors, want = errors_vs_float32(mesh, args.batch, args.heads, args.seq, args.head_dim)
        eager = eager_bf16_errors(tensors, want)
        ok = all(errors[n] <= 2 * eager[n] for n in errors)
        if rank == 0:
            shown = ", ".join(f"{n} {errors[n]:.1e} (eager bf16 {eager[n]:.1e})" for n in errors)
            print(f"context parallel over {world} GPUs, B {args.batch} H {args.heads} S {args.seq} "
                  f"D {args.head_dim} causal bf16: relative error vs one GPU's float32: {shown}")
        if args.steps:
            ours = timed_steps(mesh, *tensors, SDPBackend.FLASH_ATTENTION, args.steps, args.profile)
            cudnn = timed_steps(mesh, *tensors, SDPBackend.CUDNN_ATTENTION, args.steps, args.profile)
            if rank == 0:
                print(f"step (fwd+bwd) median of {args.steps}: torch_fa4 {ours:.2f} ms, cuDNN {cudnn:.2f} ms "
                      f"(cuDNN / torch_fa4 = {cudnn / ours:.3f}) on {torch.cuda.get_device_name()}")
    finally:
        torch_fa4.sdpa.disable()
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
