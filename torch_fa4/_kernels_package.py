"""Make the top-level kernels/ folder importable as torch_fa4.kernels, from the same copy of the
code as torch_fa4 itself.

pyproject.toml maps it (package-dir) for regular and modern editable installs. Older installers
(a legacy `setup.py develop`-style editable install, a bare PYTHONPATH pointing at the repository)
lose that mapping, so when the name does not resolve and the folder sits beside this package,
register it by hand. That folder also wins over another checkout's editable install, whose finder
would otherwise answer for torch_fa4.kernels when this checkout comes from PYTHONPATH (a git
worktree, say) and run the other checkout's kernels without a word. Never a top-level `kernels`
module: that would shadow the `kernels` package Transformers imports.
"""

import importlib.util
import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_BESIDE = os.path.join(os.path.dirname(_PACKAGE_DIR), "kernels")  # a source checkout's kernels/


def _ours(spec) -> bool:
    """Whether spec is the kernels package of this copy: installed inside torch_fa4/ (regular
    install) or the checkout's kernels/ beside it (editable install of this checkout)."""
    origin = os.path.realpath(spec.origin or "")
    return any(os.path.dirname(origin) == os.path.realpath(folder)
               for folder in (os.path.join(_PACKAGE_DIR, "kernels"), _BESIDE))


def _is_checkout_kernels(folder: str) -> bool:
    # sm90/ tells torch_fa4's kernels from an unrelated `kernels` package in the same directory
    return os.path.isfile(os.path.join(folder, "__init__.py")) and os.path.isdir(os.path.join(folder, "sm90"))


def ensure_importable() -> None:
    if "torch_fa4.kernels" in sys.modules:
        return
    spec = importlib.util.find_spec("torch_fa4.kernels")
    if (spec is not None and _ours(spec)) or not _is_checkout_kernels(_BESIDE):
        return
    spec = importlib.util.spec_from_file_location("torch_fa4.kernels", os.path.join(_BESIDE, "__init__.py"),
                                                  submodule_search_locations=[_BESIDE])
    module = importlib.util.module_from_spec(spec)
    sys.modules["torch_fa4.kernels"] = module
    spec.loader.exec_module(module)  # kernels/__init__.py is empty: no CuTe DSL import here
