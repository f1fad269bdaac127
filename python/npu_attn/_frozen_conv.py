"""Which algorithm computes the float32 3x3 convolutions of a frozen (``freeze=True``) inductor
graph: oneDNN's direct convolution (inductor's choice) or Winograd F(4x4, 3x3)
(:mod:`npu_attn.winograd`).

Inductor's freezing packs each convolution's weight for oneDNN
(``mkldnn._convolution_pointwise``). :class:`FrozenConvPass` is an inductor post-grad *pre* pass
(it must run before inductor fuses activations and residual adds into those nodes) that replaces
each float32 3x3 / stride 1 / padding 1 / dilation 1 / ungrouped one by
``npu_attn::winograd_conv3x3`` with its weights transformed once, where that is measured faster
on this machine for the node's shape (``"auto"``), or always (``"winograd"``). ``"direct"``
leaves every convolution to oneDNN.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from typing import Any, Callable, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import _C, winograd
from ._frozen_linear import _constant, _drop_unused_constants, _register_constant
from ._timing import interleaved_medians

FLOAT32_CONVS = ("auto", "winograd", "direct")

# "auto" takes Winograd only when it is this much faster than the direct convolution: its
# rounding error is a few times larger, so a gain within noise is not worth it.
WINOGRAD_MIN_SPEEDUP = 1.1
# Batch of the measurement convolution: the real one, cut so a direct call is at most this
# many floating-point operations (a 1024x1024 VAE convolution would take seconds a call).
MEASURE_FLOP_BUDGET = 16e9
MEASURE_ROUNDS = 5
_UNIT = [1, 1]


def check_float32_convs(value: str) -> str:
    if value not in FLOAT32_CONVS:
        raise ValueError(
            f"float32_convs must be one of {', '.join(repr(v) for v in FLOAT32_CONVS)}, "
            f"got {value!r}"
        )
    return value


def _is_packed_conv(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    packet = torch.ops.mkldnn._convolution_pointwise
    return node.target in (packet, packet.default)


def _winograd_shape(node: torch.fx.Node) -> Optional[tuple[int, int, int, int, int]]:
    """(N, C, K, H, W) if ``node`` is a packed float32 3x3 convolution Winograd F(4x4, 3x3)
    computes (stride 1, padding 1, dilation 1, one group, no fused activation, static shape),
    else None."""
    if len(node.args) != 10:
        return None
    x, _, _, padding, stride, dilation, groups, attr, _, _ = node.args
    x_val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    out_val = node.meta.get("val")
    if x_val is None or out_val is None or x_val.dtype != torch.float32 or x_val.dim() != 4:
        return None
    if list(padding) != _UNIT or list(stride) != _UNIT or list(dilation) != _UNIT:
        return None
    if groups != 1 or attr != "none":
        return None
    shape = tuple(x_val.shape) + (out_val.shape[1],)
    if not all(isinstance(s, int) for s in shape):
        return None  # dynamic shapes: measured per shape, so static only
    n, c, h, w, k = shape
    return n, c, k, h, w


def measure_batch(n: int, c: int, k: int, h: int, w: int) -> int:
    per_image = 2 * c * k * h * w * winograd.KERNEL * winograd.KERNEL
    return min(n, max(1, int(MEASURE_FLOP_BUDGET // per_image)))


@functools.cache
def winograd_speedup(n: int, c: int, k: int, h: int, w: int, threads: int) -> float:
    """oneDNN's prepacked direct convolution time over Winograd's for one float32 3x3
    convolution of this shape on this machine (``threads``: the torch thread count, part of the
    cache key because the answer depends on it)."""
    del threads
    n = measure_batch(n, c, k, h, w)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, w, generator=g).to(memory_format=torch.channels_last)
    weight = torch.randn(k, c, 3, 3, generator=g)
    bias = torch.randn(k, generator=g)
    packed = torch.ops.mkldnn._reorder_convolution_weight(
        weight, _UNIT, _UNIT, _UNIT, 1, list(x.shape)
    )
    transformed = winograd.transform_weight(weight)
    with torch.no_grad():
        seconds = interleaved_medians(
            {
                "direct": lambda: torch.ops.mkldnn._convolution_pointwise(
                    x, packed, bias, _UNIT, _UNIT, _UNIT, 1, "none", [], ""
                ),
                "winograd": lambda: winograd.winograd_conv3x3(x, transformed, bias),
            },
            MEASURE_ROUNDS,
        )
    return seconds["direct"] / seconds["winograd"]


class FrozenConvPass(CustomGraphPass):
    """Post-grad pre-pass for frozen graphs: replaces packed float32 3x3 convolutions by
    ``npu_attn::winograd_conv3x3`` per shape where ``choice`` says so, and frees the
    oneDNN-packed weights it no longer needs.

    ``then`` is a pass that runs after this one (the user's own
    ``torch._inductor.config.post_grad_custom_pre_pass``, if any). ``counts`` accumulates how
    many 3x3 convolutions went to each algorithm over every graph compiled.
    """

    def __init__(self, choice: str, then: Optional[Callable] = None) -> None:
        self.choice = check_float32_convs(choice)
        self.then = then
        self.counts: Counter = Counter()

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.choice != "direct":
            self._assign_algorithms(graph)
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> Optional[Any]:
        then_uuid = None
        if self.then is not None:
            then_uuid = self.then.uuid() if hasattr(self.then, "uuid") else None
            if then_uuid is None:  # a pass that cannot be identified: no caching at all
                return None
        # "auto" decides by measuring: a graph cached on this CPU keeps its decisions.
        extra = f"{self.choice}|{_C.cpu_info()['model']}|{torch.get_num_threads()}|{then_uuid}"
        return get_hash_for_files((__file__, winograd.__file__), extra=extra)

    def _wants_winograd(self, shape: tuple[int, int, int, int, int]) -> bool:
        if self.choice != "auto":
            return self.choice == "winograd"
        return winograd_speedup(*shape, torch.get_num_threads()) >= WINOGRAD_MIN_SPEEDUP

    def _assign_algorithms(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        orphan_candidates = []
        for node in [n for n in graph.nodes if _is_packed_conv(n)]:
            shape = _winograd_shape(node)
            packed = _constant(module, node.args[1])
            if shape is None or packed is None:
                continue  # not a 3x3 convolution Winograd computes: not counted
            if not self._wants_winograd(shape):
                self.counts["direct"] += 1
                continue
            transformed = _shared(winograd.transform_weight(packed.to_dense()))
            name = _register_constant(module, transformed, "_npu_attn_winograd_weight")
            x, packed_node, bias = node.args[:3]
            with graph.inserting_before(node):
                weight_node = graph.create_node("get_attr", name)
                conv = graph.call_function(
                    torch.ops.npu_attn.winograd_conv3x3.default, (x, weight_node, bias)
                )
            conv.meta.update(node.meta)
            conv.meta["val"] = _output_value(x.meta["val"], shape)
            node.replace_all_uses_with(conv)
            graph.erase_node(node)
            orphan_candidates.append(packed_node)
            self.counts["winograd"] += 1
        _drop_unused_constants(graph, orphan_candidates)


# Transformed weights of the graphs compiled so far, by shape. A module compiled again (another
# attention strategy, a recompile after a guard failure) gets new frozen constants with the same
# values; sharing the transformed tensors keeps one copy of weights 4x the size of the 3x3
# kernels they come from. Weak references: a tensor goes when its last graph does.
_TRANSFORMED: dict[tuple[int, ...], list[weakref.ref]] = {}


def _shared(transformed: torch.Tensor) -> torch.Tensor:
    """An already registered tensor equal to ``transformed`` if there is one, else it."""
    refs = _TRANSFORMED.setdefault(tuple(transformed.shape), [])
    refs[:] = [r for r in refs if r() is not None]
    for ref in refs:
        existing = ref()
        if existing is not None and torch.equal(existing, transformed):
            return existing
    refs.append(weakref.ref(transformed))
    return transformed


def _output_value(x_val: torch.Tensor, shape: tuple[int, int, int, int, int]) -> torch.Tensor:
    """The fake output tensor of the Winograd node (what its fake implementation returns), in
    the fake mode the graph was traced with."""
    n, _, k, h, w = shape
    with x_val.fake_mode:
        return torch.empty(
            (n, k, h, w), dtype=x_val.dtype, device=x_val.device, memory_format=torch.channels_last
        )
