"""Compiled-kernel cache: one `cute.compile` per kernel variant per process.

The key is everything that changes generated code (a frozen config plus the target arch); shapes
and strides are symbolic in the compiled kernels. Callers that pass `persist=True` (the sm_90
kernels, TVM-FFI launches) also use `disk_cache` across processes. `stats()` lets tests check that
a second call compiles nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Hashable

_lock = threading.Lock()
_compiled: dict[Hashable, Any] = {}
_compile_seconds: dict[Hashable, float] = {}
_from_disk: set = set()


def extra_options(dump_dir: str | None, ptxas_options: str = "") -> str:
    """The cute.compile options every kernel's builder appends: keep the cubin and PTX in dump_dir,
    and extra ptxas flags."""
    options = ""
    if dump_dir is not None:
        options += f" --keep-cubin --keep-ptx --dump-dir {dump_dir}"
    if ptxas_options:
        options += f" --ptxas-options '{ptxas_options}'"
    return options


def get_or_compile(key: Hashable, build: Callable[..., Any], persist: bool = False) -> Any:
    """The kernel for key: this process's, the disk cache's, or compiled now.

    build() compiles and returns a callable kernel; `persist` builders also take jit=False:
    compiled only to be exported, without CuTe DSL's host JIT engines (most of a second per
    variant; the exported object is the same byte for byte). With the disk cache on and a C
    compiler at hand, a new variant is compiled that way, stored, and loaded back from its
    library, as any later process loads it; otherwise it is compiled with the engines."""
    fn = _compiled.get(key)
    if fn is not None:
        return fn
    with _lock:  # two threads asking for one variant compile it once
        fn = _compiled.get(key)
        if fn is None:
            from torch_fa4.kernels import disk_cache

            use_disk = persist and disk_cache.enabled()
            t0 = time.perf_counter()
            fn = disk_cache.load(key) if use_disk else None
            if fn is not None:
                _from_disk.add(key)
            elif use_disk and disk_cache.can_store() and disk_cache.store(key, build(jit=False)):
                fn = disk_cache.load(key)
            if fn is None:
                fn = build()
            _compile_seconds[key] = time.perf_counter() - t0
            _compiled[key] = fn
    return fn


def stats() -> dict[str, Any]:
    return {"entries": len(_compiled), "compile_seconds": dict(_compile_seconds), "from_disk": len(_from_disk)}


def clear() -> None:
    with _lock:
        _compiled.clear()
        _compile_seconds.clear()
        _from_disk.clear()
