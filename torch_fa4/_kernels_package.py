"""Make the top-level kernels/ folder importable as torch_fa4.kernels in every kind of checkout.

pyproject.toml maps it (package-dir) for regular and modern editable installs. Older installers
(a legacy `setup.py develop`-style editable install, or a bare PYTHONPATH pointing at the
repository) lose that mapping, so when the name does not resolve and the folder sits beside this
package, register it by hand. Never a top-level `kernels` module: that would shadow the `kernels`
package Transformers imports.
"""

import importlib.util
import os
import sys


def ensure_importable() -> None:
    if "torch_fa4.kernels" in sys.modules or importlib.util.find_spec("torch_fa4.kernels") is not None:
        return
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    init = os.path.join(folder, "__init__.py")
    if not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location("torch_fa4.kernels", init, submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules["torch_fa4.kernels"] = module
    spec.loader.exec_module(module)  # kernels/__init__.py is empty: no CuTe DSL import here
