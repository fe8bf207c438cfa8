"""torch_fa4.kernels comes from the same copy of the code as torch_fa4 (torch_fa4/_kernels_package.py):
a second checkout on PYTHONPATH must not run the kernels of a checkout installed editable."""

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imported_files(pythonpath, cwd):
    code = ("import torch_fa4, torch_fa4.kernels.sm90.fwd_host as h, torch_fa4.kernels.common.masking as m; "
            "print(torch_fa4.__file__); print(h.__file__); print(m.__file__)")
    env = dict(os.environ, PYTHONPATH=pythonpath)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    assert res.returncode == 0, res.stderr
    return [os.path.realpath(line) for line in res.stdout.split()]


def test_a_second_checkout_runs_its_own_kernels(tmp_path):
    # In CI this repository is installed editable (its finder answers for torch_fa4.kernels); a copy
    # on PYTHONPATH must still get the kernels beside its own torch_fa4.
    copy = tmp_path / "checkout"
    for folder in ("torch_fa4", "kernels"):
        shutil.copytree(os.path.join(REPO, folder), copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    files = _imported_files(str(copy), cwd=str(tmp_path))
    root = os.path.realpath(str(copy))
    assert all(f.startswith(root + os.sep) for f in files), files


def test_the_checkout_on_pythonpath_imports_its_kernels(tmp_path):
    files = _imported_files(REPO, cwd=str(tmp_path))
    root = os.path.realpath(REPO)
    assert all(f.startswith(root + os.sep) for f in files), files
