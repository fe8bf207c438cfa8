"""Compiled kernels kept on disk, so a new process loads a variant instead of compiling it.

`cute.compile` traces and compiles again in every process (2.4-4.9 s per variant on two CPU cores,
after ~0.5-2 s to import CuTe DSL); CuTe DSL's own file cache does not cover `cute.compile`. So a
freshly compiled kernel is exported as an object file (`export_to_c`), linked with the system C
compiler into a shared library against the CuTe DSL and TVM-FFI runtime libraries (0.2-0.5 s, in
the process that compiled it), and stored under `$TORCH_FA4_CACHE_DIR/kernels` (default
`~/.cache/torch_fa4/kernels`). A later process loads it with TVM-FFI alone in about a
millisecond: no CuTe DSL import, no tracing, no compile. The compiling process itself compiles
such a variant without CuTe DSL's host JIT engines (0.4-0.9 s saved) and runs the stored library
too (compile_cache.get_or_compile). On by default; `TORCH_FA4_KERNEL_CACHE=0` turns it off (every
process compiles).

The file name is a digest of the variant key, the CuTe DSL and TVM-FFI versions and the text of
every source file of the package (the kernels, and the mod tracing whose keys they are built
from), so an edited kernel or an upgraded DSL never loads a stale binary. Everything is best
effort: no compiler, a read-only directory, a damaged file or a library that no longer resolves
all mean "compile as usual". The load path is checked on the GPU for the forward
(tests/gpu/test_sm90_fwd.py::test_disk_cache_across_processes) and the backward's three kernels
(tests/gpu/test_sm90_bwd.py::test_disk_cache_across_processes).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Hashable, Optional

_FUNCTION = "torch_fa4_kernel"  # the exported TVM-FFI function's name inside each library
_loaded_modules: list = []  # keep loaded libraries alive for the process
_source_digest: list[str] = []


ENV = "TORCH_FA4_KERNEL_CACHE"


def enabled() -> bool:
    """On unless TORCH_FA4_KERNEL_CACHE=0."""
    return os.environ.get(ENV, "1").strip() != "0"


def cache_dir() -> Path:
    root = os.environ.get("TORCH_FA4_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_fa4")
    return Path(root) / "kernels"


def _source_roots() -> list[Path]:
    """The kernels' folder and the torch_fa4 package's (the mods' tracing and lowering keys), found
    without importing either: installed, kernels/ is torch_fa4/kernels/; in a checkout (editable
    install) it sits beside torch_fa4/."""
    kernels = Path(__file__).resolve().parent
    if kernels.parent.name == "torch_fa4":
        return [kernels.parent]
    package = kernels.parent / "torch_fa4"
    return [kernels] + ([package] if package.is_dir() else [])


def _sources() -> str:
    if not _source_digest:
        h = hashlib.sha256()
        for root in _source_roots():
            for path in sorted(root.rglob("*.py")):
                h.update(f"{root.name}/{path.relative_to(root)}".encode())
                h.update(path.read_bytes())
        _source_digest.append(h.hexdigest())
    return _source_digest[0]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def digest(key: Hashable) -> str:
    text = "|".join([repr(key), _version("nvidia-cutlass-dsl"), _version("apache-tvm-ffi"), _sources()])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load(key: Hashable) -> Optional[Any]:
    """The stored kernel for key as a TVM-FFI function, or None."""
    base = cache_dir() / digest(key)
    lib, meta = base.with_suffix(".so"), base.with_suffix(".json")
    try:
        if not lib.exists():
            return None
        json.loads(meta.read_text())  # written last: its presence marks a complete entry
        # resolve every symbol now: a library that no longer links fails here, not inside a launch
        ctypes.CDLL(str(lib), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        import tvm_ffi

        module = tvm_ffi.load_module(str(lib))
        fn = module[_FUNCTION]
    except Exception:  # noqa: BLE001  (any failure: compile instead)
        return None
    _loaded_modules.append(module)
    return fn


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def can_store() -> bool:
    """Whether store() has a C compiler to link with and a cache folder it can write."""
    if _compiler() is None:
        return False
    try:
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        return os.access(d, os.W_OK)
    except OSError:
        return False


def store(key: Hashable, compiled: Any) -> bool:
    """Export, link and store a compiled kernel; whether it was stored (best effort: never raises)."""
    cc = _compiler()
    if cc is None:
        return False
    try:
        from cutlass.runtime import find_runtime_libraries

        libs = [p for p in find_runtime_libraries(enable_tvm_ffi=True) if os.path.exists(p)]
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        base = d / digest(key)
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            obj, so = os.path.join(tmp, "k.o"), os.path.join(tmp, "k.so")
            compiled.export_to_c(obj, function_name=_FUNCTION)
            rpaths = [f"-Wl,-rpath,{os.path.dirname(p)}" for p in libs]
            subprocess.run([cc, "-shared", "-o", so, obj, *libs, *rpaths], check=True, capture_output=True, timeout=60)
            ctypes.CDLL(so, mode=os.RTLD_NOW | os.RTLD_LOCAL)  # every symbol resolves
            os.replace(so, base.with_suffix(".so"))
        meta = {"key": repr(key), "libraries": libs}
        tmp_meta = base.with_suffix(f".{os.getpid()}.tmp")
        tmp_meta.write_text(json.dumps(meta))
        os.replace(tmp_meta, base.with_suffix(".json"))
    except Exception:  # noqa: BLE001
        return False
    return True
