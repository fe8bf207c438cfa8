"""ModSet registry: mod_key -> the traced score_mod / mask_mod graphs.

The ops carry only `mod_key` (a string) and the captured tensors; everything else about a mod lives
here. A key is a structural hash of the graphs (ops, constants, captured-tensor dtypes and ranks),
never an object id, so it is the same in every process and can key the on-disk kernel cache.

A key can be looked up in a process that never traced the mod (a torch.compile'd graph loaded from a
cache, a kernel cache warmed elsewhere): every registration also writes the graphs as JSON under
`$TORCH_FA4_CACHE_DIR/mods` (default `~/.cache/torch_fa4/mods`), and `lookup` falls back to that
file. Without it, lookup raises a KeyError that says how to fix it. A file is read only if it and
its folder are private to this user and its graphs hash to its name (torch_fa4/private_cache.py;
anything else is skipped with a warning), since a swapped graph would make a cached key compute
something else.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from torch_fa4 import private_cache
from torch_fa4.mods import lower_torch
from torch_fa4.mods.graph import ModGraph

_LOCK = threading.Lock()
_REGISTRY: dict[str, "ModSet"] = {}


@dataclass(eq=False)
class ModSet:
    key: str
    score_graph: Optional[ModGraph]
    mask_graph: Optional[ModGraph]

    @property
    def num_score_aux(self) -> int:
        return len(self.score_graph.aux) if self.score_graph is not None else 0

    @property
    def num_mask_aux(self) -> int:
        return len(self.mask_graph.aux) if self.mask_graph is not None else 0

    @functools.cached_property
    def score_grad_graph(self) -> Optional[ModGraph]:
        """d score_mod / d score as a graph over the same inputs and captured tensors (for backward)."""
        if self.score_graph is None:
            return None
        from torch_fa4.mods.derivative import score_derivative

        return score_derivative(self.score_graph)

    @functools.cached_property
    def load_derivatives(self):
        """d score_mod / d (each loaded captured value), with the loads' indices (for the gradients
        of captured tensors: torch_fa4/mods/capture_grad.py); None without a score_mod."""
        if self.score_graph is None:
            return None
        from torch_fa4.mods.derivative import load_derivatives

        return load_derivatives(self.score_graph)

    def score_torch(self, score: torch.Tensor, b, h, q_idx, kv_idx, score_aux: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.score_graph is None:
            return score
        return lower_torch.score_torch(self.score_graph, score, b, h, q_idx, kv_idx, score_aux)

    def mask_torch(self, b, h, q_idx, kv_idx, mask_aux: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.mask_graph is None:
            raise ValueError(f"ModSet {self.key} has no mask_mod")
        return lower_torch.mask_torch(self.mask_graph, b, h, q_idx, kv_idx, mask_aux)

    def to_json(self) -> str:
        graphs = {"score": self.score_graph, "mask": self.mask_graph}
        return json.dumps({role: g.to_json() if g is not None else None for role, g in graphs.items()})


def key_for(score_graph: Optional[ModGraph], mask_graph: Optional[ModGraph]) -> str:
    text = (score_graph.to_json() if score_graph else "-") + "|" + (mask_graph.to_json() if mask_graph else "-")
    return "mods_" + hashlib.sha256(text.encode()).hexdigest()[:24]


def _cache_dir() -> Path:
    root = os.environ.get("TORCH_FA4_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_fa4")
    return Path(root) / "mods"


def _persist(mods: ModSet) -> None:
    try:  # best effort: a read-only home must not break attention calls
        d = _cache_dir()
        path = d / f"{mods.key}.json"
        if path.exists() and private_cache.untrusted_reason(path) is None:
            return  # the key is the graphs' hash: an existing private file holds the same graphs
        if private_cache.make_private_dir(d):  # never write into a folder others can change
            private_cache.atomic_write(path, mods.to_json().encode())
    except OSError:
        pass


def register(score_graph: Optional[ModGraph], mask_graph: Optional[ModGraph]) -> ModSet:
    key = key_for(score_graph, mask_graph)
    with _LOCK:
        mods = _REGISTRY.get(key)
        if mods is None:
            mods = ModSet(key, score_graph, mask_graph)
            _REGISTRY[key] = mods
            _persist(mods)
    return mods


def _load(key: str) -> Optional[ModSet]:
    d = _cache_dir()
    path = d / f"{key}.json"
    if not (path.exists() and private_cache.trusted_dir(d) and private_cache.trusted_file(path)):
        return None
    try:
        doc = json.loads(path.read_text())
        score = ModGraph.from_json(doc["score"]) if doc["score"] else None
        mask = ModGraph.from_json(doc["mask"]) if doc["mask"] else None
    except Exception as e:  # noqa: BLE001  (any malformed document)
        problem = f"is not a readable mod graph file ({type(e).__name__}: {e})"
    else:
        if key_for(score, mask) == key:
            return ModSet(key, score, mask)
        problem = "holds graphs whose hash is not its name (damaged or replaced)"
    private_cache.warn_once(path, problem, f"It is ignored; after `rm {path}` the next eager call with these "
                            "mods writes it again.")
    return None


def lookup(mod_key: str) -> ModSet:
    mods = _REGISTRY.get(mod_key)
    if mods is not None:
        return mods
    mods = _load(mod_key)
    if mods is None:
        raise KeyError(
            f"torch_fa4: unknown mod key {mod_key!r}. Keys are created when torch_fa4.mods.prepare traces a "
            f"score_mod/mask_mod in this process, and saved to {_cache_dir()} for other processes; this one was "
            "not found there (cache directory cleared, read-only, or a different TORCH_FA4_CACHE_DIR). Call the "
            "attention function once eagerly with the same mods, or keep the cache directory."
        )
    with _LOCK:
        return _REGISTRY.setdefault(mod_key, mods)


