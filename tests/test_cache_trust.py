"""CPU: the on-disk caches use only entries private to this user and intact.

The compiled-kernel cache (kernels/disk_cache.py) is driven through compile_cache.get_or_compile
with its two CuTe DSL / TVM-FFI steps replaced: `_link` writes a fixed library image instead of
exporting and linking a kernel, and `_open_library` records which bytes would be loaded instead of
loading them. Everything between (folders, ownership and permission checks, hashes, atomic
writes, the fall back to compiling) is the real code. The mod registry's graph files are checked
the same way (torch_fa4/mods/registry.py)."""

import json
import os
import stat
import threading
import warnings

import pytest
import torch

from torch_fa4 import private_cache
from torch_fa4.kernels import compile_cache, disk_cache
from torch_fa4.private_cache import CacheTrustWarning

LIBRARY = bytes(range(256)) * 2048  # 512 KB, the size of a small linked kernel
JIT = "compiled with the JIT engines"
OTHER_UID = 4321


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


class Kernels:
    """A cache folder under tmp_path, builds and loads counted; new_process() forgets this
    process's compiled kernels (what a fresh process starts with)."""

    def __init__(self, root, monkeypatch):
        self.root, self.dir = root, root / "kernels"
        self.builds, self.opened = [], []
        monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(root))
        monkeypatch.delenv(disk_cache.ENV, raising=False)
        monkeypatch.setattr(private_cache, "_warned", set())
        monkeypatch.setattr(disk_cache, "_compiler", lambda: "cc")
        monkeypatch.setattr(disk_cache, "_link", self._link)
        monkeypatch.setattr(disk_cache, "_open_library", self._open)
        for name in ("_compiled", "_compile_seconds"):
            monkeypatch.setattr(compile_cache, name, {})
        monkeypatch.setattr(compile_cache, "_from_disk", set())

    @staticmethod
    def _link(compiled, folder):
        so = os.path.join(folder, "k.so")
        with open(so, "wb") as f:  # mode 0666 & ~umask, as a linker writes it
            f.write(compiled)
        return so, []

    def _open(self, lib):
        data = lib.read_bytes()
        self.opened.append(data)
        return ("loaded", data)

    def build(self, jit=True):
        self.builds.append(jit)
        return JIT if jit else LIBRARY

    def get(self, key=("trust", 1)):
        return compile_cache.get_or_compile(key, self.build, persist=True)

    def new_process(self):
        compile_cache._compiled.clear()
        compile_cache._from_disk.clear()

    def entry(self, key=("trust", 1)):
        meta_path = self.dir / f"{disk_cache.digest(key)}.json"
        meta = json.loads(meta_path.read_text())
        return meta_path, self.dir / meta["library"], meta

    def files(self) -> dict:
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in self.dir.iterdir()}


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    return Kernels(tmp_path / "cache", monkeypatch)


def _stored_then_new_process(kernels):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheTrustWarning)
        assert kernels.get() == ("loaded", LIBRARY)
    kernels.new_process()
    kernels.builds.clear()


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_ordinary_path_stores_privately_and_loads(kernels, umask):
    """A new variant is built once without the JIT engines, stored in 0700 folders as private
    files (even under a group-writable umask) with its SHA-256, and loaded by a later process
    without building and without a warning."""
    old = os.umask(umask)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheTrustWarning)
            assert kernels.get() == ("loaded", LIBRARY)
            assert kernels.builds == [False]
            meta_path, lib, meta = kernels.entry()
            assert _mode(kernels.root) == _mode(kernels.dir) == 0o700
            assert _mode(meta_path) == 0o600 and _mode(lib) == 0o700
            assert meta["sha256"] == private_cache.sha256_file(lib) and lib.read_bytes() == LIBRARY
            assert sorted(p.name for p in kernels.dir.iterdir()) == sorted([meta_path.name, lib.name])

            kernels.new_process()
            assert kernels.get() == ("loaded", LIBRARY)
            assert kernels.builds == [False] and compile_cache.stats()["from_disk"] == 1
    finally:
        os.umask(old)


def test_an_existing_root_keeps_its_mode(tmp_path, monkeypatch):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o755)
    kernels = Kernels(root, monkeypatch)
    assert kernels.get() == ("loaded", LIBRARY)
    assert _mode(root) == 0o755 and _mode(kernels.dir) == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777])
def test_folder_writable_by_others_is_neither_read_nor_written(kernels, mode):
    _stored_then_new_process(kernels)
    os.chmod(kernels.dir, mode)
    before = kernels.files()
    with pytest.warns(CacheTrustWarning) as record:
        assert kernels.get() == JIT
        assert kernels.get(("trust", 2)) == JIT  # another variant: no second warning
    assert kernels.builds == [True, True]  # compiled as usual, nothing stored
    assert len(record) == 1
    message = str(record[0].message)
    assert str(kernels.dir) in message and "writable by" in message and f"chmod 700 {kernels.dir}" in message
    assert kernels.files() == before
    assert kernels.opened == [LIBRARY]  # only the first process's load


@pytest.mark.parametrize("which", ["library", "entry"])
def test_file_owned_by_another_user_is_refused_and_rebuilt(kernels, which):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    _stored_then_new_process(kernels)
    meta_path, lib, _ = kernels.entry()
    target = lib if which == "library" else meta_path
    os.chown(target, OTHER_UID, -1)
    with pytest.warns(CacheTrustWarning, match=f"owned by uid {OTHER_UID}"):
        assert kernels.get() == ("loaded", LIBRARY)
    assert kernels.builds == [False]  # compiled again, stored over the foreign file, loaded
    assert os.stat(target).st_uid == os.geteuid()


def test_folder_of_another_user_is_refused(kernels, monkeypatch):
    """Without root, the owner check is exercised by a different effective uid: then the folder
    itself belongs to someone else."""
    _stored_then_new_process(kernels)
    monkeypatch.setattr(private_cache.os, "geteuid", lambda: OTHER_UID)
    with pytest.warns(CacheTrustWarning, match=f"owned by uid .*not by this user \\(uid {OTHER_UID}\\)") as record:
        assert kernels.get() == JIT
    assert "chown" in str(record[0].message) and kernels.builds == [True]


def test_group_writable_library_is_refused_and_rebuilt(kernels):
    _stored_then_new_process(kernels)
    _, lib, _ = kernels.entry()
    os.chmod(lib, 0o770)
    with pytest.warns(CacheTrustWarning, match="writable by group"):
        assert kernels.get() == ("loaded", LIBRARY)
    assert kernels.builds == [False] and _mode(lib) == 0o700


def test_wrong_recorded_hash_is_refused_and_rebuilt(kernels):
    _stored_then_new_process(kernels)
    meta_path, lib, meta = kernels.entry()
    meta["sha256"] = "0" * 64
    meta_path.write_text(json.dumps(meta))
    with pytest.warns(CacheTrustWarning, match="SHA-256"):
        assert kernels.get() == ("loaded", LIBRARY)
    assert kernels.builds == [False]
    assert kernels.entry()[2]["sha256"] == private_cache.sha256_file(lib)
    assert kernels.opened == [LIBRARY, LIBRARY]  # the stored one, then the rebuilt one


@pytest.mark.parametrize("damage", ["truncated", "replaced"])
def test_damaged_library_is_never_opened(kernels, damage):
    _stored_then_new_process(kernels)
    _, lib, _ = kernels.entry()
    bad = LIBRARY[: len(LIBRARY) // 3] if damage == "truncated" else bytes(len(LIBRARY))
    lib.write_bytes(bad)
    with pytest.warns(CacheTrustWarning, match="does not match the SHA-256"):
        assert kernels.get() == ("loaded", LIBRARY)
    assert kernels.builds == [False] and bad not in kernels.opened
    assert lib.read_bytes() == LIBRARY


def test_unreadable_entry_is_refused_and_rebuilt(kernels):
    _stored_then_new_process(kernels)
    meta_path, _, meta = kernels.entry()
    meta["library"] = "../elsewhere.so"
    meta_path.write_text(json.dumps(meta))
    with pytest.warns(CacheTrustWarning, match="not a readable cache entry"):
        assert kernels.get() == ("loaded", LIBRARY)
    assert kernels.builds == [False]


def test_concurrent_writers_leave_one_complete_file(tmp_path):
    """Writers of one file never leave a reader half of one, nor temporary files behind."""
    path = tmp_path / "entry.so"
    size = 1 << 21
    payloads = [bytes([i]) * size for i in range(4)]
    private_cache.atomic_write(path, payloads[0])
    stop, seen = threading.Event(), []

    def read():
        while not stop.is_set():
            data = path.read_bytes()
            seen.append(len(data) == size and data in payloads)

    def write(payload):
        for _ in range(10):
            private_cache.atomic_write(path, payload)

    reader = threading.Thread(target=read)
    writers = [threading.Thread(target=write, args=(p,)) for p in payloads]
    reader.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert seen and all(seen)
    assert path.read_bytes() in payloads and [p.name for p in tmp_path.iterdir()] == ["entry.so"]
    assert _mode(path) == 0o600


# --- the mod registry's graph files ------------------------------------------------------------

@pytest.fixture
def mod_files(tmp_path, monkeypatch):
    from torch_fa4 import mods as M
    from torch_fa4.mods import registry
    from torch_fa4.mods.prepare import trace_graphs

    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(private_cache, "_warned", set())
    mods, _ = trace_graphs(M.alibi(M.alibi_slopes(4)), M.document_mask(torch.tensor([0, 0, 1, 1])))
    registry._persist(mods)
    return registry, mods, tmp_path / "cache" / "mods" / f"{mods.key}.json"


def test_mod_graphs_are_written_privately_and_read_back(mod_files):
    registry, mods, path = mod_files
    assert _mode(path.parent) == 0o700 and _mode(path) == 0o600
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheTrustWarning)
        loaded = registry._load(mods.key)
    assert loaded.to_json() == mods.to_json()


def test_mod_folder_writable_by_others_is_neither_read_nor_written(mod_files):
    registry, mods, path = mod_files
    os.chmod(path.parent, 0o777)
    with pytest.warns(CacheTrustWarning, match="writable by group and others"):
        assert registry._load(mods.key) is None
    path.unlink()
    registry._persist(mods)
    assert not path.exists()


def test_mod_file_owned_by_another_user_is_refused_and_rewritten(mod_files):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    registry, mods, path = mod_files
    os.chown(path, OTHER_UID, -1)
    with pytest.warns(CacheTrustWarning, match=f"owned by uid {OTHER_UID}"):
        assert registry._load(mods.key) is None
    registry._persist(mods)
    assert os.stat(path).st_uid == os.geteuid() and registry._load(mods.key) is not None


def test_swapped_mod_graphs_are_refused(mod_files):
    """A file holding another mod's graphs under this key (a cached key computing something else)."""
    from torch_fa4 import mods as M
    from torch_fa4.mods.prepare import trace_graphs

    registry, mods, path = mod_files
    other, _ = trace_graphs(M.alibi(M.alibi_slopes(4)), None)
    path.write_text(other.to_json())
    with pytest.warns(CacheTrustWarning, match="hash is not its name"):
        assert registry._load(mods.key) is None
    path.write_text("{not json")
    with pytest.warns(CacheTrustWarning, match="not a readable mod graph file"):
        assert registry._load(mods.key) is None
