"""Environment variables read on every call's path, at a fraction of `os.environ.get`'s cost.

The kernels' tuning knobs (TORCH_FA4_BWD_*, TORCH_FA4_FWD_*) are read per call, not once per
process: the benchmarks set them around single calls. `os.environ.get` encodes the name and goes
through the Mapping machinery on every read, ~0.7 us on the GPU machine's host and ~2 us here;
the backward read ~27 of them per call (NOTES session 41). This module reads the same table
(os.environ's own dict of encoded names, which every write to os.environ updates in place) with
the names encoded once. Where that table is not there (another platform's os module), it falls
back to os.environ.get.
"""

from __future__ import annotations

import os

_encoded: dict[str, object] = {}


def _table():
    data = getattr(os.environ, "_data", None)  # read each time: os.environ may be replaced
    return data if isinstance(data, dict) else None


def _key(name: str):
    key = _encoded.get(name)
    if key is None:
        key = _encoded[name] = os.environ.encodekey(name)
    return key


def get(name: str, default: str | None = None) -> str | None:
    """os.environ.get(name, default)."""
    data = _table()
    if data is None:
        return os.environ.get(name, default)
    value = data.get(_key(name))
    return default if value is None else os.environ.decodevalue(value)


class Snapshot:
    """Snapshot(names)() -> the raw values of `names` (None where unset), for memo keys: equal
    tuples mean equal settings. Not decoded (a memo only compares them); the names are encoded
    once, on the first call."""

    def __init__(self, names):
        self.names = tuple(names)
        self._keys = None

    def __call__(self) -> tuple:
        data = _table()
        if data is None:
            return tuple(os.environ.get(name) for name in self.names)
        if self._keys is None:
            self._keys = tuple(map(_key, self.names))
        return tuple(map(data.get, self._keys))
