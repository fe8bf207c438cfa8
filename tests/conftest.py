import os
import random
import sys
import zlib

import tempfile

import pytest

# Traced mod graphs are written to a cache folder (so a key resolves in a new process); keep the
# suite's out of the user's ~/.cache. Set before torch_fa4 is imported by any test.
os.environ.setdefault("TORCH_FA4_CACHE_DIR", tempfile.mkdtemp(prefix="torch_fa4_test_cache_"))

import torch  # noqa: E402

# Without a GPU, CuTe DSL compiles for the architecture named here; the compile tests then also
# check host-side launch plumbing against a kernel built for sm_90a (tests name sm_100a explicitly).
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# tests/ on sys.path so tests/gpu/* can `from naive import naive_attention` too.
sys.path.insert(0, os.path.dirname(__file__))

# A new base seed every run (fresh inputs), printed so a failure can be replayed with
# TORCH_FA4_TEST_SEED=<seed>.
_BASE_SEED = int(os.environ.get("TORCH_FA4_TEST_SEED", random.randrange(2**31)))


def pytest_addoption(parser):
    group = parser.getgroup("torch_fa4 fuzz", "the randomized differential tests (tests/fuzz_space.py)")
    group.addoption("--fuzz-cases", type=int, default=None,
                    help="run this many fuzz cases (default: each fuzz test's own budget)")
    group.addoption("--fuzz-seed", type=int, default=None,
                    help="the first fuzz case's seed (default: the run's test seed, printed in the header)")


def pytest_report_header(config):
    return f"torch_fa4 test seed: {_BASE_SEED} (replay with TORCH_FA4_TEST_SEED={_BASE_SEED})"


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    torch.manual_seed(_BASE_SEED ^ zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture(autouse=True)
def _no_launch_records_across_tests():
    """Launch records and plans (kernels/host/shape_memo.py) keep what a call shape launched: a
    test that patched the derivation (a stub kernel, a forced split) must not hand its record to
    the next test with the same shapes."""
    shape_memo = sys.modules.get("torch_fa4.kernels.host.shape_memo")
    if shape_memo is not None:
        shape_memo.clear_all()
    yield


@pytest.fixture
def op_args(monkeypatch):
    """The torch_fa4::fwd op's arguments after q, k, v, one tuple per public call (the calls still
    run): what the API turned the call's mods, block mask and flags into."""
    from torch_fa4 import api

    seen = []
    real = api.ops.fwd_impl

    def spy(q, k, v, *rest):
        seen.append(rest)
        return real(q, k, v, *rest)

    monkeypatch.setattr(api.ops, "fwd_impl", spy)
    return seen

