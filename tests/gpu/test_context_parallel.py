"""Context parallelism on 2 GPUs: PyTorch's ring attention (`context_parallel`) with SDPA routed to
torch_fa4 matches one GPU's float32 attention, forward and backward, and every ring step ran on
torch_fa4's kernels (examples/context_parallel.py is the program under test)."""

import importlib.util
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from gpu_harness import dispatch_spy
from torch_fa4 import sdpa

served = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in sdpa.SUPPORTED_MAJORS
two = served and torch.cuda.device_count() >= 2 and torch.distributed.is_nccl_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not two, reason="needs 2 CUDA sm_90/sm_100 devices and NCCL")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "context_parallel.py"


def _example():
    spec = importlib.util.spec_from_file_location("context_parallel_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker(rank, world, port, shape, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torch_fa4 import dispatch

    example = _example()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    picked = []
    original = dispatch.kernel_for
    dispatch.kernel_for = dispatch_spy(original, picked)
    try:
        with sdpa.enabled():
            errors, tensors, want = example.errors_vs_float32(init_device_mesh("cuda", (world,)), *shape)
        ran = list(picked)
        results[rank] = (errors, example.eager_bf16_errors(tensors, want), ran)
    finally:
        dispatch.kernel_for = original
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("shape", [(1, 16, 8192, 128), (2, 4, 2048, 64)], ids=["h16_s8k_d128", "b2_s2k_d64"])
def test_context_parallel_matches_one_gpu(shape):
    import torch.multiprocessing as mp

    world = 2
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(world, _free_port(), shape, results), nprocs=world, join=True)
    for rank in range(world):
        errors, eager, picked = results[rank]
        assert all(errors[n] <= 2 * eager[n] for n in errors), (rank, errors, eager)
        directions = {d for d, _ in picked}
        assert directions == {"forward", "backward"}, picked
        assert all(m is not None for _, m in picked), f"a ring step fell back: {picked}"
