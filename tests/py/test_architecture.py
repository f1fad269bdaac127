"""The package's shape: a folder per concern, imports point one way through the layers of
folders below, with no cycles, and a backend is added with one module and one registration line.

Layers, bottom to top (a module may import only from its own folder, or from a folder of a
lower layer): the kernel runtime -> the components reader -> attention -> accelerations ->
diffusers integration (strategy switching applies the accelerations named in the environment)
-> graph mode and scale-out -> the DeviceManager -> the tools -> the package's front
(``__init__``, ``__main__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import npu_attn
from conftest import max_err, reference_sdpa
from npu_attn.attention.backends import registry
from npu_attn.attention.backends.base import AttentionCall, Backend

PACKAGE = Path(npu_attn.__file__).parent

# folder (or top-level module) -> layer
LAYERS = [
    {"_C", "_version", "_compat", "runtime"},
    {"components"},
    {"attention"},
    {"accel"},
    {"integration"},
    {"graph", "parallel"},
    {"device"},
    {"tools"},
    {"__init__", "__main__"},
]
LAYER_OF = {folder: i for i, layer in enumerate(LAYERS) for folder in layer}


def folder_of(module: str) -> str:
    return module.split(".")[0]


def _module_name(path: Path) -> tuple[str, bool]:
    """Dotted name in the package ('__init__' for the package itself), and whether it is a
    package's ``__init__``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        return ".".join(parts[:-1]), True
    return ".".join(parts), parts == ("__init__",)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom, modules: set) -> list[str]:
    """Package-internal modules an ``from ... import ...`` statement names (lazy ones too)."""
    if node.level == 0:
        if not (node.module or "").startswith("npu_attn"):
            return []
        base = node.module.split(".")[1:]
    else:
        package = [] if importer == "__init__" else importer.split(".")
        if not is_package:
            package = package[:-1]
        base = package[: len(package) - (node.level - 1)] + (
            node.module.split(".") if node.module else []
        )
    targets = []
    for alias in node.names:
        candidate = ".".join([*base, alias.name])
        targets.append(candidate if candidate in modules else ".".join(base) or "__init__")
    return targets


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (``_C``, the compiled extension, included)."""
    sources = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = {name for name, _ in sources} | {"_C"}
    graph = {}
    for (name, is_package), path in sources.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                edges.update(t for t in _resolve(name, is_package, node, modules) if t != name)
        graph[name] = edges
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{importer} ({folder_of(importer)}, layer {LAYER_OF[folder_of(importer)]}) imports "
        f"{target} ({folder_of(target)}, layer {LAYER_OF[folder_of(target)]})"
        for importer, targets in graph.items()
        for target in targets
        if LAYER_OF[folder_of(target)] > LAYER_OF[folder_of(importer)]
    ]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for importer, targets in graph.items():
        edges = folders.setdefault(folder_of(importer), set())
        edges |= {folder_of(t) for t in targets} - {folder_of(importer)}
    return folders


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node, path):
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if state.get(target) is None:
                found = visit(target, [*path, target])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if state.get(node) is None:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_every_module_is_in_a_layered_folder():
    unplaced = {m for m in import_graph() if folder_of(m) not in LAYER_OF}
    assert not unplaced, unplaced


def test_imports_point_down_the_layers():
    upward = upward_imports(import_graph())
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("level", ["modules", "folders"])
def test_no_import_cycles(level):
    graph = import_graph()
    cycle = first_cycle(graph if level == "modules" else folder_graph(graph))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_layer_check_fails_on_an_upward_import():
    """An attention module that imported the diffusers integration would be reported."""
    graph = {**import_graph(), "attention.functional": {"integration.processors"}}
    assert upward_imports(graph) == [
        "attention.functional (attention, layer 2) imports integration.processors "
        "(integration, layer 4)"
    ]


def test_the_cycle_check_fails_on_a_cycle():
    modules = {"a.x": {"b.y"}, "b.y": {"a.x"}}
    assert first_cycle(modules) == ["a.x", "b.y", "a.x"]
    assert first_cycle(folder_graph({"a.x": {"b.y"}, "b.z": {"a.w"}})) == ["a", "b", "a"]


def test_only_the_runtime_imports_the_extension():
    importers = sorted(m for m, targets in import_graph().items() if "_C" in targets)
    assert importers == ["runtime.extension"]


def test_the_components_reader_imports_nothing_from_the_package():
    """components serves attention switching, the accelerations, graph mode and parallel/,
    which may import it only as long as it imports none of them."""
    assert import_graph()["components"] == set()


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
