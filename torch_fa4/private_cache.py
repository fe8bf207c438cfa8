"""Cache folders that only their owner can change, and entries checked before they are used.

The compiled-kernel cache (kernels/disk_cache.py) loads shared libraries from disk and the mod
registry (torch_fa4/mods/registry.py) reads traced graphs from it; whoever can write there can run
code in, or change the results of, every process that uses the cache. So every folder this package
creates is 0700; an entry is used only if it and its folder belong to this user (the effective uid)
and neither is writable by group or others, and otherwise it is skipped (the work is done as if
there were no cache) with one warning per folder or file and reason that says what is wrong and
how to fix it. Files are written under a unique temporary name in the same folder and renamed into
place (`os.replace`, atomic on POSIX), so concurrent processes writing one entry leave one complete
copy and readers never see half of one. `sha256_file` lets callers record what they wrote and check
it before loading it again: a truncated or replaced file is refused. The folder's ownership is what
keeps a checked file from being swapped between the check and the load: only this user can rename
files in it.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

DIR_MODE = 0o700
FILE_MODE = 0o600

_warned: set = set()
_warned_lock = threading.Lock()


class CacheTrustWarning(UserWarning):
    """A cache folder or entry was skipped because it is not private to this user or is damaged."""


def _uid() -> Optional[int]:
    geteuid = getattr(os, "geteuid", None)  # POSIX only; elsewhere ownership is not checked
    return geteuid() if geteuid is not None else None


def untrusted_reason(path: Path, st: Optional[os.stat_result] = None) -> Optional[str]:
    """Why path may not be trusted (another owner, writable by group or others), or None.
    Follows symbolic links: what counts is the file or folder that would be read."""
    uid = _uid()
    if uid is None:
        return None
    if st is None:
        st = os.stat(path)
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    loose = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if loose:
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if loose & bit)
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def warn_once(path: Path, problem: str, fix: str) -> None:
    """One CacheTrustWarning per (path, problem) per process."""
    with _warned_lock:
        if (str(path), problem) in _warned:
            return
        _warned.add((str(path), problem))
    warnings.warn(f"torch_fa4: not using {path}: it {problem}. {fix}", CacheTrustWarning, stacklevel=2)


def _dir_fix(path: Path, reason: str) -> str:
    steps = f"chmod 700 {path}" if reason.startswith("is writable") else f"sudo chown -R $(id -u) {path} && chmod 700 {path}"
    return (f"Anyone who can write there could run code in this process, so the cache is bypassed. Fix: `{steps}`, "
            "or set TORCH_FA4_CACHE_DIR to a folder of your own.")


def _trusted(path: Path, fix) -> bool:
    try:
        reason = untrusted_reason(path)
    except OSError:
        return False
    if reason is not None:
        warn_once(path, reason, fix(reason))
    return reason is None


def trusted_dir(path: Path) -> bool:
    """Whether the folder exists and is private to this user; warns once if it exists but is not."""
    return _trusted(path, lambda reason: _dir_fix(path, reason))


def trusted_file(path: Path) -> bool:
    """Whether the file exists and is private to this user (call after trusted_dir on its folder);
    warns once if it exists but is not."""
    return _trusted(path, lambda reason: f"It is ignored and rebuilt; `rm {path}` clears it.")


def make_private_dir(path: Path) -> bool:
    """Create path (and any missing parents) as 0700 folders; whether path is then private to this
    user (a folder that already existed keeps its mode and is checked: trusted_dir)."""
    missing = []
    p = Path(path)
    while not p.exists() and p.parent != p:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            p.mkdir(mode=DIR_MODE)
        except FileExistsError:  # another process made it first: checked below like any folder
            continue
        os.chmod(p, DIR_MODE)  # the umask cannot widen 0700, but an odd one could narrow it
    return trusted_dir(path)


def publish(src: Path, dest: Path, mode: int = FILE_MODE) -> None:
    """Move a finished file from the same folder into place atomically, private to this user."""
    os.chmod(src, mode)
    os.replace(src, dest)


def atomic_write(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Write path's whole content at once: readers see the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        publish(Path(tmp), path, mode)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        if hasattr(hashlib, "file_digest"):
            return hashlib.file_digest(f, "sha256").hexdigest()
        h = hashlib.sha256()  # Python 3.10
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        return h.hexdigest()


def matches_sha256(path: Path, expected: object, recorded_in: Path) -> bool:
    """Whether path's SHA-256 is the one recorded for it; warns once if not (truncated, replaced)."""
    try:
        actual = sha256_file(path)
    except OSError:
        return False
    if actual != expected:
        warn_once(path, f"does not match the SHA-256 recorded in {recorded_in} (truncated or replaced)",
                  f"It is ignored and rebuilt; `rm {path} {recorded_in}` clears it.")
        return False
    return True
