"""Measurement-only timers around library functions (compile_time.py, bwd_host_parts.py)."""

from __future__ import annotations

import time


def wrap_timed(owner, name: str, label: str, acc: dict) -> None:
    """Replace owner.name with a wrapper that adds each call's inclusive seconds to acc[label]."""
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label] = acc.get(label, 0.0) + time.perf_counter() - t

    setattr(owner, name, timed)
