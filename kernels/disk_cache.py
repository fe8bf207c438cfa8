"""Compiled kernels kept on disk, so a new process loads a variant instead of compiling it.

`cute.compile` traces and compiles again in every process (seconds per variant) and CuTe DSL's own
file cache does not cover it. So a freshly compiled kernel is exported as an object file
(`export_to_c`), linked with the system C compiler into a shared library against the CuTe DSL and
TVM-FFI runtime libraries, and stored under `$TORCH_FA4_CACHE_DIR/kernels` (default
`~/.cache/torch_fa4/kernels`); a later process loads it with TVM-FFI alone in about a millisecond,
without importing CuTe DSL. On unless `TORCH_FA4_KERNEL_CACHE=0`.

Entry names are a digest of the variant key, the CuTe DSL and TVM-FFI versions and the text of
every source file of the package, so an edited kernel or an upgraded DSL never loads a stale
binary. An entry is `<digest>.json`, naming its library `<digest>-<sha>.so` and recording its
SHA-256; the library is written first and the JSON last, both atomically, so a reader that finds
the JSON finds the whole library and concurrent writers never mix their files. A library loads
only if the folder, the JSON and the library belong to this user, are not writable by group or
others, and the library hashes to the recorded SHA-256 (torch_fa4/private_cache.py); anything else
is skipped with a warning and the kernel compiled as usual (a folder that is not private is neither
read nor written; folders are created 0700). Everything else is best effort too: no compiler, a
read-only folder or a library that no longer resolves mean "compile as usual".
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Hashable, Optional

from torch_fa4 import private_cache

_FUNCTION = "torch_fa4_kernel"  # the exported TVM-FFI function's name inside each library
_loaded_modules: list = []  # keep loaded libraries alive for the process
ENV = "TORCH_FA4_KERNEL_CACHE"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() != "0"


def cache_dir() -> Path:
    root = os.environ.get("TORCH_FA4_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_fa4")
    return Path(root) / "kernels"


def _source_roots() -> list[Path]:
    """The kernels' folder and the torch_fa4 package's (the mods' tracing keys): installed,
    kernels/ is torch_fa4/kernels/; in a checkout it sits beside torch_fa4/."""
    kernels = Path(__file__).resolve().parent
    if kernels.parent.name == "torch_fa4":
        return [kernels.parent]
    package = kernels.parent / "torch_fa4"
    return [kernels] + ([package] if package.is_dir() else [])


@functools.lru_cache(maxsize=None)
def _sources() -> str:
    h = hashlib.sha256()
    for root in _source_roots():
        for path in sorted(root.rglob("*.py")):
            h.update(f"{root.name}/{path.relative_to(root)}".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _version(dist: str) -> str:
    try:  # once per process (~0.5 ms a look-up)
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def digest(key: Hashable) -> str:
    text = "|".join([repr(key), _version("nvidia-cutlass-dsl"), _version("apache-tvm-ffi"), _sources()])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _open_library(lib: Path) -> Any:
    """The kernel's TVM-FFI function from a checked library (raises if it does not load)."""
    # resolve every symbol now: a library that no longer links fails here, not inside a launch
    ctypes.CDLL(str(lib), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    import tvm_ffi

    module = tvm_ffi.load_module(str(lib))
    fn = module[_FUNCTION]
    _loaded_modules.append(module)
    return fn


def load(key: Hashable) -> Optional[Any]:
    """The stored kernel for key as a TVM-FFI function, or None (not stored, or refused)."""
    d = cache_dir()
    meta_path = d / f"{digest(key)}.json"
    if not (meta_path.exists() and private_cache.trusted_dir(d) and private_cache.trusted_file(meta_path)):
        return None
    try:
        meta = json.loads(meta_path.read_text())
        name, expected = meta["library"], meta["sha256"]
        if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(".so"):
            raise ValueError(f"not a library file name: {name!r}")
        lib = d / name
    except (OSError, ValueError, KeyError, TypeError) as e:
        private_cache.warn_once(meta_path, f"is not a readable cache entry ({e})",
                                f"It is ignored and rebuilt; `rm {meta_path}` clears it.")
        return None
    if not (private_cache.trusted_file(lib) and private_cache.matches_sha256(lib, expected, meta_path)):
        return None
    try:
        return _open_library(lib)
    except Exception:  # noqa: BLE001  (a library that no longer resolves: compile instead)
        return None


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def can_store() -> bool:
    """Whether store() has a C compiler to link with and a private cache folder it can write."""
    if _compiler() is None:
        return False
    try:
        d = cache_dir()
        return private_cache.make_private_dir(d) and os.access(d, os.W_OK)
    except OSError:
        return False


def _link(compiled: Any, folder: str) -> tuple[str, list[str]]:
    """(shared library linked from `compiled` in folder, the runtime libraries it links against)."""
    from cutlass.runtime import find_runtime_libraries

    libs = [p for p in find_runtime_libraries(enable_tvm_ffi=True) if os.path.exists(p)]
    obj, so = os.path.join(folder, "k.o"), os.path.join(folder, "k.so")
    compiled.export_to_c(obj, function_name=_FUNCTION)
    rpaths = [f"-Wl,-rpath,{os.path.dirname(p)}" for p in libs]
    subprocess.run([_compiler(), "-shared", "-o", so, obj, *libs, *rpaths], check=True, capture_output=True, timeout=60)
    ctypes.CDLL(so, mode=os.RTLD_NOW | os.RTLD_LOCAL)  # every symbol resolves
    return so, libs


def store(key: Hashable, compiled: Any) -> bool:
    """Export, link and store a compiled kernel; whether it was stored (best effort: never raises)."""
    if not can_store():
        return False
    try:
        d = cache_dir()
        name = digest(key)
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            so, libs = _link(compiled, tmp)
            sha = private_cache.sha256_file(Path(so))
            # named by its content: a concurrent writer of another build never replaces it under a reader
            library = f"{name}-{sha[:16]}.so"
            private_cache.publish(Path(so), d / library, mode=0o700)
        meta = {"key": repr(key), "library": library, "sha256": sha, "libraries": libs}
        private_cache.atomic_write(d / f"{name}.json", json.dumps(meta).encode())  # last: marks it complete
    except Exception:  # noqa: BLE001
        return False
    return True
