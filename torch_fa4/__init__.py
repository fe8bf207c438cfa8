"""torch_fa4: FlashAttention-4 as a PyTorch-native drop-in.

Importing this package registers the `torch_fa4::fwd` / `torch_fa4::bwd` ops and nothing heavier:
CuTe DSL kernels load on the first CUDA call, and no CUDA context is created here.
"""

import sys

from torch_fa4 import _kernels_package

_kernels_package.ensure_importable()  # (before ops: dispatch keeps its memo in torch_fa4.kernels.host)
from torch_fa4 import ops as _ops  # noqa: F401  (registers the torch.library ops)
from torch_fa4.api import attention, flex_attention
from torch_fa4.integrations import sdpa, transformers as _transformers

sys.modules[__name__ + ".sdpa"] = sdpa  # so that `import torch_fa4.sdpa` finds the same module

# Both are light: neither imports CuTe DSL or Transformers, and neither activates anything unasked.
sdpa.setup_on_import()  # lists "torch_fa4" among SDPA's flash providers; enabled only by TORCH_FA4_SDPA=1
_transformers.register_if_available()  # attn_implementation="fa4", at once or when Transformers loads

__version__ = "0.1.0"
__all__ = ["attention", "flex_attention", "create_block_mask", "BlockMask", "mods", "sdpa", "__version__"]


def __getattr__(name):
    if name in ("create_block_mask", "BlockMask", "mods"):  # mods pull in their tracer: loaded on use
        import importlib  # not `from torch_fa4 import mods`: that asks this __getattr__ for "mods" again

        mods = importlib.import_module("torch_fa4.mods")
        return mods if name == "mods" else getattr(mods, name)
    raise AttributeError(f"module 'torch_fa4' has no attribute {name!r}")
