"""CPU: how the compiled-kernel cache (kernels/compile_cache.py) uses the disk cache
(kernels/disk_cache.py) in the process that compiles a variant. Across processes:
test_sm90_fwd_compile.py / test_sm90_bwd_compile.py here, tests/gpu/* on the GPU."""

import json
import stat

import pytest
import torch

from torch_fa4 import private_cache

cutlass = pytest.importorskip("cutlass")
tvm_ffi = pytest.importorskip("tvm_ffi")


def _convert_builder(reversed_order: bool):
    """A persist builder for the dq conversion kernel (the cheapest to compile)."""
    from torch_fa4.kernels.sm90 import bwd_dq_convert

    return lambda jit=True: bwd_dq_convert._compile(torch.bfloat16, "sm_90a", None, jit)


def test_export_without_the_jit_engines_is_the_same_object(tmp_path, monkeypatch):
    """compile_cache stores a new variant from a compile without CuTe DSL's host JIT engines; the
    object file it exports must be the one the usual compile exports (whose library ran on the
    GPU), for the forward as for the backward's kernels."""
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels import compile_cache
    from torch_fa4.kernels.sm90 import bwd, bwd_prepare, fwd_host

    def exported(build) -> list:
        objects = []
        for jit in (True, False):
            path = tmp_path / f"k{len(list(tmp_path.iterdir()))}.o"
            build(jit=jit).export_to_c(str(path), function_name="torch_fa4_kernel")
            objects.append(path.read_bytes())
        return objects

    builds = [_convert_builder(False),
              lambda jit=True: bwd_prepare._compile(torch.bfloat16, 64, "sm_90a", None, 64, jit)]
    # the forward's and the main backward kernel's own builders, taken from the cache's call
    monkeypatch.setattr(compile_cache, "get_or_compile", lambda key, build, persist=False: builds.append(build))
    q = torch.empty(1, 256, 2, 64, dtype=torch.bfloat16)
    call = AttentionCall(q=q, k=q, v=q, scale=0.125, causal=True)
    fwd_host.compile_fwd(fwd_host.default_config(call))
    bwd.compile_variant(bwd.variant_key(call, False))
    assert len(builds) == 4
    for build in builds:
        with_engines, without = exported(build)
        assert with_engines == without


def test_new_variant_is_loaded_back_from_its_stored_library(tmp_path, monkeypatch):
    """With the disk cache on and a C compiler, the compiling process runs the stored library's
    function (what a later process loads); without a compiler it keeps CuTe DSL's JIT-compiled
    function and stores nothing. Either binds the launch's arguments (up to TVM-FFI's device
    check of these CPU tensors)."""
    from torch_fa4.kernels import compile_cache, disk_cache

    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(disk_cache.ENV, raising=False)
    src, dst = torch.empty(64), torch.empty(64, dtype=torch.bfloat16)
    for compiler, reversed_order in ((True, False), (False, True)):
        if not compiler:
            monkeypatch.setattr(disk_cache, "_compiler", lambda: None)
        key = ("test_disk_cache", compiler, reversed_order)
        fn = compile_cache.get_or_compile(key, _convert_builder(reversed_order), persist=True)
        assert compile_cache.get_or_compile(key, _convert_builder(reversed_order), persist=True) is fn
        stored = list((tmp_path / "cache" / "kernels").glob("*.so")) if (tmp_path / "cache").exists() else []
        if compiler:
            assert isinstance(fn, tvm_ffi.Function) and len(stored) == 1
            # the real linker's output: private, and recorded by its hash (tests/test_cache_trust.py)
            meta = json.loads(next(stored[0].parent.glob("*.json")).read_text())
            assert meta["library"] == stored[0].name and meta["sha256"] == private_cache.sha256_file(stored[0])
            assert stat.S_IMODE(stored[0].stat().st_mode) == 0o700
        else:
            assert not isinstance(fn, tvm_ffi.Function) and len(stored) == 1  # (the first one only)
        with pytest.raises(ValueError, match="device_type=cuda"):
            fn(src, dst, 1.0)
