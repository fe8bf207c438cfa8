"""Transformers integration: `attn_implementation="fa4"` for from_pretrained, from_config and
set_attn_implementation.

Registering adds "fa4" to Transformers' AttentionInterface (the attention call,
`transformers_attention.fa4_attention_forward`) and AttentionMaskInterface (the mask a model builds
for it, `transformers_mask.fa4_mask`), and "paged|fa4" to AttentionInterface (continuous batching,
`transformers_paged.fa4_paged_attention_forward`; continuous batching builds no mask for it).
Importing Transformers takes seconds, so `import torch_fa4` never does: `register_if_available()`
registers at once if Transformers is already loaded, and otherwise leaves a hook in `sys.meta_path`
that registers each half the moment Transformers finishes loading the module defining its
interface. Whatever the import order, "fa4" is there
before any model can ask for it; a program that never imports Transformers pays one `find_spec`.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

ATTN_IMPLEMENTATION = "fa4"
PAGED_ATTN_IMPLEMENTATION = "paged|fa4"

# module that defines an interface -> (the interface, [(name, our entry: a module of this package, a
# function)])
_ENTRIES = {
    "transformers.modeling_utils": ("AttentionInterface", [
        (ATTN_IMPLEMENTATION, "transformers_attention", "fa4_attention_forward"),
        (PAGED_ATTN_IMPLEMENTATION, "transformers_paged", "fa4_paged_attention_forward"),
    ]),
    "transformers.masking_utils": ("AttentionMaskInterface", [
        (ATTN_IMPLEMENTATION, "transformers_mask", "fa4_mask"),
    ]),
}


def _register_in(module) -> None:
    interface, entries = _ENTRIES[module.__name__]
    for name, source, function in entries:
        entry = getattr(importlib.import_module(f"{__package__}.{source}"), function)
        getattr(module, interface).register(name, entry)


def is_registered() -> bool:
    """Whether "fa4" is in each interface Transformers has loaded, with the hook waiting for the
    others (False when Transformers is not loaded at all)."""
    if not any(name in sys.modules for name in _ENTRIES):
        return False
    for name, (interface, entries) in _ENTRIES.items():
        module = sys.modules.get(name)
        if module is not None:
            if any(entry[0] not in getattr(module, interface)._global_mapping for entry in entries):
                return False
        elif _hook is None or _hook not in sys.meta_path or name not in _hook.pending:
            return False
    return True


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the watched modules it asks the other finders, then makes the
    loader register our entry once the module has executed."""

    def __init__(self, names: set[str]):
        self.pending = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        self.pending.discard(fullname)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            try:
                _register_in(module)
            except Exception as e:  # never break the user's `import transformers`
                warnings.warn(f'torch_fa4: could not register attn_implementation="{ATTN_IMPLEMENTATION}" '
                              f"with Transformers: {e!r}")

        spec.loader.exec_module = exec_module  # this loader instance serves this one module
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        return spec


_hook: _RegisterAfterImport | None = None


def register_if_available() -> None:
    """What `import torch_fa4` does: register "fa4" now if Transformers is loaded, when it loads if
    it is installed, never if it is not. Idempotent."""
    global _hook
    if importlib.util.find_spec("transformers") is None:
        return
    pending = set()
    for name in _ENTRIES:
        spec = getattr(sys.modules.get(name), "__spec__", None)
        # a module in sys.modules may still be executing (we are imported from inside it)
        if spec is not None and not getattr(spec, "_initializing", False):
            _register_in(sys.modules[name])
        else:
            pending.add(name)
    if not pending or (_hook is not None and _hook in sys.meta_path):
        return
    _hook = _RegisterAfterImport(pending)
    sys.meta_path.insert(0, _hook)
