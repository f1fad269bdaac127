"""The package's shape: imports point one way, through the layers below, with no cycles, and a
backend is added with one module and one registration line.

Layers, bottom to top (a module may import only from its own layer or below):
  kernel runtime -> ops -> backends -> functional -> strategies -> diffusers integration ->
  device -> command-line tools
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import npu_attn
from conftest import max_err, reference_sdpa
from npu_attn._backends import registry
from npu_attn._backends.base import AttentionCall, Backend

PACKAGE = Path(npu_attn.__file__).parent

LAYERS = [
    {"_config", "_counts", "_memory", "_runtime", "_timing", "_variant_choice", "_version", "_C"},
    {"ops", "winograd"},
    {
        "_backends",
        "_backends.base",
        "_backends.torch_sdpa",
        "_backends.vanilla",
        "_backends.tiled",
        "_backends.npu",
        "_backends.registry",
    },
    {"functional"},
    {"_auto", "strategies"},
    {
        "_targets",
        "_redirect",
        "diffusers_integration",
        "diffusers_backend",
        "graph_mode",
        "_frozen_linear",
        "_frozen_conv",
        "_frozen_graph",
        "token_merging",
        "deep_cache",
        "acceleration",
        "block_cache",
        "channels_last",
        "parallel",
        "parallel._group",
        "parallel._inputs",
        "parallel._layout",
        "parallel.cfg",
        "parallel.context",
        "parallel.ring",
        "parallel.scaling",
        "parallel.ulysses",
    },
    {"device"},
    {
        "doctor",
        "bench",
        "bench_e2e",
        "bench_parallel",
        "bench_report",
        "demo",
        "__main__",
        "__init__",
    },
]
LAYER_OF = {module: i for i, layer in enumerate(LAYERS) for module in layer}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)


def _resolve(importer: str, node: ast.ImportFrom) -> list[str]:
    """Package-internal modules an ``from ... import ...`` statement names (lazy ones too)."""
    if node.level == 0:
        if not (node.module or "").startswith("npu_attn"):
            return []
        base = node.module.split(".")[1:]
    else:
        package = importer.split(".")[:-1] if "." in importer else []
        if importer in ("_backends", "parallel"):  # a package's own __init__
            package = [importer]
        base = package[: len(package) - (node.level - 1)] + (
            node.module.split(".") if node.module else []
        )
    targets = []
    for alias in node.names:
        candidate = ".".join([*base, alias.name])
        targets.append(candidate if candidate in LAYER_OF else ".".join(base) or "__init__")
    return targets


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                edges.update(t for t in _resolve(name, node) if t != name)
        graph[name] = edges
    return graph


def test_every_module_has_a_layer():
    assert set(import_graph()) <= set(LAYER_OF), set(import_graph()) - set(LAYER_OF)


def test_imports_point_down_the_layers():
    upward = [
        f"{importer} (layer {LAYER_OF[importer]}) imports {target} (layer {LAYER_OF[target]})"
        for importer, targets in import_graph().items()
        for target in targets
        if target in LAYER_OF and LAYER_OF[target] > LAYER_OF[importer]
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node, path):
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if state.get(target) is None:
                visit(target, [*path, target])
        state[node] = 2

    for module in sorted(graph):
        if state.get(module) is None:
            visit(module, [module])


def test_the_shared_target_helpers_import_nothing_from_the_package():
    """_targets serves every module of its layer (the accelerations and parallel/), which
    may import it only as long as it imports none of them."""
    assert import_graph()["_targets"] == set()


def test_the_cycle_check_can_fail(monkeypatch):
    graph = {"a": {"b"}, "b": {"a"}}
    monkeypatch.setattr(__import__(__name__), "import_graph", lambda: graph)
    with pytest.raises(pytest.fail.Exception, match="import cycle: a -> b -> a"):
        test_no_import_cycles()


def test_no_module_peeks_at_another_through_sys_modules():
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if 'sys.modules.get("npu_attn' in path.read_text(encoding="utf-8")
    ]
    assert not offenders


class ScaledCopyBackend(Backend):
    """A tiny example backend: the attention of the vanilla backend, times one (so it is exact),
    only for float32 CPU tensors without masks. It exists to prove the recipe in
    docs/architecture.md: one class, one register() line."""

    name = "example"
    description = "test-only example backend"
    devices = ("cpu",)
    dtypes = (torch.float32,)
    calls = 0

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = super().not_supported_reasons(call)
        if call.attn_mask is not None:
            reasons.append("no attn_mask support")
        return reasons

    def forward(self, call: AttentionCall) -> torch.Tensor:
        type(self).calls += 1
        return registry.get("vanilla").forward(call) * 1.0


@pytest.fixture
def example_backend():
    registry.register(ScaledCopyBackend())
    yield registry.get("example")
    registry.unregister("example")


def test_a_new_backend_is_one_class_and_one_registration(example_backend):
    q, k, v = torch.randn(2, 3, 20, 16), torch.randn(2, 3, 30, 16), torch.randn(2, 3, 30, 16)
    before = ScaledCopyBackend.calls
    out = npu_attn.scaled_dot_product_attention(q, k, v, backend="example")
    assert ScaledCopyBackend.calls == before + 1
    assert max_err(out, reference_sdpa(q, k, v)) <= 1e-5
    assert any(b["name"] == "example" for b in npu_attn.backends())
    with pytest.raises(ValueError, match="backend 'example' cannot run this call: no attn_mask"):
        npu_attn.scaled_dot_product_attention(q, k, v, torch.ones(20, 30) > 0, backend="example")
    with pytest.raises(ValueError, match=r"dtype float64 not supported \(supports float32\)"):
        npu_attn.scaled_dot_product_attention(q.double(), k.double(), v.double(), backend="example")


def test_the_call_object_resolves_the_scale_once():
    q = torch.randn(1, 2, 4, 16)
    assert AttentionCall.of(q, q, q).scale == pytest.approx(0.25)
    assert AttentionCall.of(q, q, q, scale=0.5).scale == 0.5
    with pytest.raises(AttributeError):
        AttentionCall.of(q, q, q).is_causal = True  # frozen
