"""Old module paths, kept importable after the package was reorganised into subpackages.

Each old path is the *same module object* as its new home (not a copy), so models, pipelines
and functions pickled or ``torch.save``d under an old path still load, and anything patched
through one name is seen through the other. Importing an old path warns once with a
``DeprecationWarning`` that names the new one. One table, one finder on ``sys.meta_path``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old path -> new path (both under npu_attn)
MOVED = {
    "_runtime": "runtime.controls",
    "_counts": "runtime.counts",
    "_memory": "runtime.memory",
    "_timing": "runtime.timing",
    "_variant_choice": "runtime.variant_choice",
    "_config": "attention.config",
    "functional": "attention.functional",
    "ops": "attention.ops",
    "strategies": "attention.strategies",
    "_auto": "attention.auto",
    "_backends": "attention.backends",
    "_backends.base": "attention.backends.base",
    "_backends.npu": "attention.backends.npu",
    "_backends.registry": "attention.backends.registry",
    "_backends.tiled": "attention.backends.tiled",
    "_backends.torch_sdpa": "attention.backends.torch_sdpa",
    "_backends.vanilla": "attention.backends.vanilla",
    "diffusers_integration": "integration.processors",
    "diffusers_backend": "integration.dispatcher",
    "_redirect": "integration.redirect",
    "_targets": "components",
    "acceleration": "accel.registry",
    "token_merging": "accel.token_merging",
    "deep_cache": "accel.deep_cache",
    "block_cache": "accel.block_cache",
    "channels_last": "accel.channels_last",
    "graph_mode": "graph.mode",
    "_frozen_graph": "graph.frozen",
    "_frozen_linear": "graph.frozen_linear",
    "_frozen_conv": "graph.frozen_conv",
    "winograd": "graph.winograd",
    "parallel._group": "parallel.group",
    "parallel._inputs": "parallel.inputs",
    "parallel._layout": "parallel.layout",
    "doctor": "tools.doctor",
    "bench": "tools.bench",
    "bench_e2e": "tools.bench_e2e",
    "bench_parallel": "tools.bench_parallel",
    "bench_report": "tools.bench_report",
    "demo": "tools.demo",
}
PACKAGE = __name__.rpartition(".")[0]


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path."""

    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec):
        old = spec.name
        warnings.warn(
            f"{old} moved to {self.new_name}; the old path will be removed in a future release",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new_name)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # Already executed. The import system has just set the module's __spec__ to the old
        # path's; give it back its own, which its relative imports are resolved against.
        module.__spec__ = self.own_spec


class OldPathFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix = PACKAGE + "."
        if not fullname.startswith(prefix) or fullname[len(prefix) :] not in MOVED:
            return None
        new_name = prefix + MOVED[fullname[len(prefix) :]]
        is_package = new_name.endswith(".backends")  # the one package among the moved paths
        return importlib.util.spec_from_loader(fullname, _Alias(new_name), is_package=is_package)


def install() -> None:
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, OldPathFinder())  # before the path finder, which would
        # load a second copy of a module found under an old package path (_backends)
