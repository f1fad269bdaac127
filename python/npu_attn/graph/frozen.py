"""What npu_attn's inductor passes for frozen (``freeze=True``) graphs share: the base class
(an inference-aware custom graph pass with a user-facing choice, per-target counts and a cache
id) and the helpers that read, add and drop the frozen graph's constants.

The passes (``_frozen_linear.FrozenLinearPass``, ``_frozen_conv.FrozenConvPass``) are installed
next to the user's own passes of the same kind: ``graph_mode`` puts them first in a tuple, which
inductor runs in order, so the user's passes see the rewritten graph and inductor handles each
pass's own calling convention and cache id.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import torch
from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass, get_hash_for_files

from ..runtime import controls as _runtime


def check_choice(option: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(
            f"{option} must be one of {', '.join(repr(v) for v in choices)}, got {value!r}"
        )
    return value


class FrozenGraphPass(CustomInferenceAwareGraphPass):
    """A rewrite of frozen inference graphs, driven by a user-facing ``choice`` (one of
    ``CHOICES``; ``"auto"`` decides per shape by measuring on this machine). Training graphs
    (``is_inference`` false) are left alone: nothing in them is frozen. ``counts`` accumulates
    what the rewrite chose, per target, over every graph compiled."""

    OPTION = ""  # the npu_attn.compile argument, for messages
    CHOICES: tuple[str, ...] = ()
    FILES: tuple[str, ...] = ()  # the sources whose code decides the rewrite

    def __init__(self, choice: str) -> None:
        self.choice = check_choice(self.OPTION, choice, self.CHOICES)
        self.counts: Counter = Counter()

    def __call__(self, graph: torch.fx.Graph, is_inference: bool) -> None:
        if is_inference:
            self.rewrite(graph)

    def rewrite(self, graph: torch.fx.Graph) -> None:
        raise NotImplementedError

    def uuid(self) -> Optional[Any]:
        # Part of inductor's FX-graph cache key. "auto" decides by measuring, so the CPU and
        # the thread count are in it: a graph cached on this CPU keeps its decisions. (Graphs
        # holding oneDNN-packed constants are not cached by inductor today; the id keeps a
        # cached graph correct if they ever are.)
        extra = f"{self.choice}|{_runtime.cpu_identity()}|{torch.get_num_threads()}"
        return get_hash_for_files(self.FILES + (__file__,), extra=extra)


def constant(module: torch.nn.Module, node: Any) -> Optional[torch.Tensor]:
    """The tensor a get_attr node reads (None for anything else)."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = getattr(module, node.target, None)
    return value if isinstance(value, torch.Tensor) else None


def add_constant(
    graph: torch.fx.Graph, tensor: torch.Tensor, prefix: str, fake_mode: Any = None
) -> torch.fx.Node:
    """Register ``tensor`` on the frozen graph's module as inductor's constant folding does (a
    buffer, marked as a frozen parameter) under a fresh name starting with ``prefix``, and
    return a get_attr node reading it (inserted at the graph's current insertion point), with
    its fake value in ``fake_mode`` (default: the graph's)."""
    from torch._inductor.freezing_utils import maybe_set_is_frozen_param

    module = graph.owning_module
    index = 0
    while hasattr(module, f"{prefix}{index}"):
        index += 1
    name = f"{prefix}{index}"
    module.register_buffer(name, tensor)
    maybe_set_is_frozen_param(tensor)
    node = graph.create_node("get_attr", name)
    fake_mode = fake_mode if fake_mode is not None else _fake_mode(graph)
    if fake_mode is not None:
        node.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True)
    return node


def _fake_mode(graph: torch.fx.Graph):
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode"):
            return val.fake_mode
    return None


def drop_unused_constants(graph: torch.fx.Graph, candidates: list) -> None:
    """Remove those of ``candidates`` (get_attr nodes of replaced ops' weights) that nothing
    reads any more, and the module attributes behind them, so their memory is freed."""
    module = graph.owning_module
    unused = {n for n in candidates if isinstance(n, torch.fx.Node) and n.op == "get_attr"}
    for node in unused:
        if node.users:
            continue
        target = node.target
        graph.erase_node(node)
        still_read = any(n.op == "get_attr" and n.target == target for n in graph.nodes)
        if not still_read and hasattr(module, target):
            delattr(module, target)
