"""Per-shape memos of the host path (launch records, the backward's launch plans): one entry per
key in a plain dict, cleared past CAPACITY entries (a bound for programs that meet ever-new
shapes, not an eviction policy). `clear_all` empties every `table()`: the tests call it between
tests so that a derivation they patched does not reach the next one.
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
