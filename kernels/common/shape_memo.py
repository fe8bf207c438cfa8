"""Per-shape memos of the host path: what a call's shapes, flags and knobs decide, derived once.

The launch records (kernels/sm90/fwd_launch_record.py, bwd_launch_record.py) and the backward's
launch plans keep one entry per key in a plain dict, bounded at CAPACITY entries: past it the
table is cleared (a bound for programs that meet ever-new shapes, not an eviction policy).
Tables made by `table()` are known to `clear_all`, which the tests call between tests so that a
derivation they patched does not reach the next one. No CuTe DSL here.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

NOT_RECORDED = object()  # a derivation's answer for "this shape takes the general path every time"
CAPACITY = 4096
_tables: list = []


def table() -> dict:
    """A new memo table, known to clear_all."""
    made: dict = {}
    _tables.append(made)
    return made


def lookup(memo: dict, key: Hashable, derive: Callable[[], Any]) -> Any:
    """memo[key], derived (and kept) on the first call with this key."""
    value = memo.get(key)
    if value is None:
        value = derive()
        if len(memo) >= CAPACITY:
            memo.clear()
        memo[key] = value
    return value


def clear_all() -> None:
    for memo in _tables:
        memo.clear()
