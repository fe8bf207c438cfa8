"""Compiled-kernel cache: one `cute.compile` per kernel variant per process.

The key is everything that changes generated code (a frozen config dataclass plus the target
arch); tensor shapes and strides are symbolic in the compiled kernels, so new sizes reuse it.
Across processes CuTe DSL keeps its own on-disk cache (CUTE_DSL_CACHE_DIR); this layer only
avoids re-tracing within a process. `stats()` lets tests check that a second call compiles nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Hashable

_lock = threading.Lock()
_compiled: dict[Hashable, Any] = {}
_compile_seconds: dict[Hashable, float] = {}


def get_or_compile(key: Hashable, build: Callable[[], Any]) -> Any:
    fn = _compiled.get(key)
    if fn is not None:
        return fn
    with _lock:  # two threads asking for one variant compile it once
        fn = _compiled.get(key)
        if fn is None:
            t0 = time.perf_counter()
            fn = build()
            _compile_seconds[key] = time.perf_counter() - t0
            _compiled[key] = fn
    return fn


def stats() -> dict[str, Any]:
    return {"entries": len(_compiled), "compile_seconds": dict(_compile_seconds)}


def clear() -> None:
    with _lock:
        _compiled.clear()
        _compile_seconds.clear()
