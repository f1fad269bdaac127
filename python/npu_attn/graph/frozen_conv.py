"""Which algorithm computes the float32 3x3 convolutions of a frozen (``freeze=True``) inductor
graph: oneDNN's direct convolution (inductor's choice) or Winograd F(4x4, 3x3)
(:mod:`npu_attn.graph.winograd`).

Inductor's freezing packs each convolution's weight for oneDNN
(``mkldnn._convolution_pointwise``). :class:`FrozenConvPass` is an inductor post-grad *pre* pass
(it must run before inductor fuses activations and residual adds into those nodes) that replaces
each float32 3x3 / stride 1 / padding 1 / dilation 1 / ungrouped one of static shape by
``npu_attn::winograd_conv3x3`` with its weights transformed once, where that is measured faster
on this machine for the node's shape (``"auto"``), or always (``"winograd"``). ``"direct"``
leaves every convolution to oneDNN.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Optional

import torch

from ..runtime import timing
from ..runtime.timing import interleaved_times
from . import winograd
from .frozen import FrozenGraphPass, add_constant, check_choice, constant, drop_unused_constants

FLOAT32_CONVS = ("auto", "winograd", "direct")

# "auto" takes Winograd only when it is this much faster than the direct convolution: its
# rounding error is a few times larger, and the measurement favours it slightly: in the real
# graph inductor later fuses a following activation or residual add into oneDNN's convolution,
# which the opaque Winograd op cannot take (inductor fuses them into its own kernels instead,
# one more pass over the output).
WINOGRAD_MIN_SPEEDUP = 1.1
# Size of the measurement convolution: the real one, cut towards this many floating-point
# operations per direct call (a 512x512 VAE convolution is 77-300 GFLOP) by taking fewer images,
# then fewer image rows, then fewer columns (whole 4-pixel tiles, never below MIN_MEASURE_EDGE
# of either), so both algorithms still see the real channel counts. Only channel counts so
# large that MIN_MEASURE_EDGE^2 pixels exceed the budget (over ~2000 x 2000) go above it.
MEASURE_FLOP_BUDGET = 16e9
MIN_MEASURE_EDGE = 16
MEASURE_ROUNDS = 5
_ONES = [1, 1]  # padding, stride and dilation of the convolutions Winograd F(4x4, 3x3) computes


def check_float32_convs(value: str) -> str:
    return check_choice("float32_convs", value, FLOAT32_CONVS)


def _is_packed_conv(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    packet = torch.ops.mkldnn._convolution_pointwise
    return node.target in (packet, packet.default)


def _winograd_shape(
    node: torch.fx.Node, weight: torch.Tensor
) -> Optional[tuple[int, int, int, int, int]]:
    """(N, C, K, H, W) if ``node`` is a packed float32 3x3 convolution (``weight``: its frozen
    weight) that Winograd F(4x4, 3x3) computes: stride 1, padding 1, dilation 1, one group, no
    fused activation, static shape. Else None."""
    if len(node.args) != 10 or tuple(weight.shape[2:]) != (3, 3):
        return None
    x, _, _, padding, stride, dilation, groups, attr, _, _ = node.args
    x_val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    out_val = node.meta.get("val")
    if x_val is None or out_val is None or x_val.dtype != torch.float32 or x_val.dim() != 4:
        return None
    if list(padding) != _ONES or list(stride) != _ONES or list(dilation) != _ONES:
        return None
    if groups != 1 or attr != "none" or tuple(out_val.shape[2:]) != tuple(x_val.shape[2:]):
        return None
    shape = tuple(x_val.shape) + (out_val.shape[1],)
    if not all(isinstance(s, int) for s in shape):
        return None  # dynamic shapes: "auto" measures per shape, so static ones only
    n, c, h, w, k = shape
    return n, c, k, h, w


def measure_shape(n: int, c: int, k: int, h: int, w: int) -> tuple[int, int, int]:
    """(images, rows, columns) of the measurement convolution for a real one of this shape."""
    per_pixel = 2 * c * k * winograd.KERNEL * winograd.KERNEL
    budget_pixels = int(MEASURE_FLOP_BUDGET // per_pixel)
    if budget_pixels >= h * w:
        return min(n, budget_pixels // (h * w)), h, w
    rows = min(h, max(MIN_MEASURE_EDGE, _whole_tiles(budget_pixels // w)))
    columns = min(w, max(MIN_MEASURE_EDGE, _whole_tiles(budget_pixels // rows)))
    return 1, rows, columns


def _whole_tiles(pixels: int) -> int:
    return pixels // winograd.OUTPUT_TILE * winograd.OUTPUT_TILE


def time_both(n: int, c: int, k: int, h: int, w: int, rounds: int) -> dict[str, list[float]]:
    """Seconds of oneDNN's prepacked direct convolution ("direct", what a frozen graph runs)
    and of Winograd ("winograd") on random float32 data of this shape, ``rounds`` interleaved
    calls each after a warm-up."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, w, generator=g).to(memory_format=torch.channels_last)
    weight = torch.randn(k, c, 3, 3, generator=g) / (9 * c) ** 0.5
    bias = torch.randn(k, generator=g)
    packed = torch.ops.mkldnn._reorder_convolution_weight(
        weight, _ONES, _ONES, _ONES, 1, list(x.shape)
    )
    transformed = winograd.transform_weight(weight)
    with torch.no_grad():
        return interleaved_times(
            {
                "direct": lambda: torch.ops.mkldnn._convolution_pointwise(
                    x, packed, bias, _ONES, _ONES, _ONES, 1, "none", [], ""
                ),
                "winograd": lambda: winograd.winograd_conv3x3(x, transformed, bias),
            },
            rounds,
        )


@functools.cache
def winograd_speedup(n: int, c: int, k: int, h: int, w: int, threads: int) -> float:
    """oneDNN's prepacked direct convolution time over Winograd's for one float32 3x3
    convolution of this shape on this machine, fastest call against fastest call: it is
    measured while inductor compiles, when its worker processes may be starting, and other work
    only ever adds time (``threads``: the torch thread count, part of the cache key because the
    answer depends on it)."""
    del threads
    n, h, w = measure_shape(n, c, k, h, w)
    times = time_both(n, c, k, h, w, MEASURE_ROUNDS)
    return min(times["direct"]) / min(times["winograd"])


# Shapes (with the thread count) whose measurement raised: not measured, nor warned about, again.
_FAILED_MEASUREMENTS: set[tuple[int, ...]] = set()


class FrozenConvPass(FrozenGraphPass):
    """Post-grad pre-pass for frozen graphs: replaces packed float32 3x3 convolutions by
    ``npu_attn::winograd_conv3x3`` per shape where ``choice`` says so, and frees the
    oneDNN-packed weights it no longer needs. ``counts``: how many of the convolutions Winograd
    could compute went to each algorithm."""

    OPTION = "float32_convs"
    CHOICES = FLOAT32_CONVS
    FILES = (__file__, winograd.__file__, timing.__file__)

    def _wants_winograd(self, shape: tuple[int, int, int, int, int]) -> bool:
        if self.choice != "auto":
            return self.choice == "winograd"
        key = (*shape, torch.get_num_threads())
        if key in _FAILED_MEASUREMENTS:
            return False
        try:
            speedup = winograd_speedup(*key)
        except RuntimeError as error:  # e.g. out of memory: the direct convolution stays
            _FAILED_MEASUREMENTS.add(key)  # (functools.cache does not keep exceptions)
            warnings.warn(
                f"npu_attn.compile: could not time Winograd for convolution shape {shape} "
                f"(N, C, K, H, W), keeping oneDNN's: {error}",
                stacklevel=2,
            )
            return False
        return speedup >= WINOGRAD_MIN_SPEEDUP

    def rewrite(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        orphan_candidates = []
        for node in [n for n in graph.nodes if _is_packed_conv(n)]:
            packed = constant(module, node.args[1])
            shape = None if packed is None else _winograd_shape(node, packed)
            if shape is None:
                continue  # not a convolution Winograd computes: not counted
            if not self._wants_winograd(shape):
                self.counts["direct"] += 1
                continue
            transformed = _shared(winograd.transform_weight(packed.to_dense()))
            x, packed_node, bias = node.args[:3]
            with graph.inserting_before(node):
                weight_node = add_constant(
                    graph, transformed, "_npu_attn_winograd_weight", x.meta["val"].fake_mode
                )
                conv = graph.call_function(
                    torch.ops.npu_attn.winograd_conv3x3.default, (x, weight_node, bias)
                )
            conv.meta.update({k: v for k, v in node.meta.items() if k != "tensor_meta"})
            conv.meta["val"] = _fake_output(conv)
            node.replace_all_uses_with(conv)
            graph.erase_node(node)
            orphan_candidates.append(packed_node)
            self.counts["winograd"] += 1
        drop_unused_constants(graph, orphan_candidates)


def _fake_output(conv: torch.fx.Node) -> torch.Tensor:
    """The Winograd node's output as its fake implementation gives it, in the graph's fake
    mode (from its inputs' fake values)."""
    x, weight, bias = (a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in conv.args)
    with x.fake_mode:
        return torch.ops.npu_attn.winograd_conv3x3.default(x, weight, bias)


# Transformed weights of the graphs compiled so far, by shape. A module compiled again (another
# attention strategy, a recompile after a guard failure) gets new frozen constants with the same
# values; sharing the transformed tensors keeps one copy of weights 4x the size of the 3x3
# kernels they come from. Weak references: a tensor goes when its last graph does. Candidates
# are compared on a sample of their values first, so a compile compares few tensors in full.
_TRANSFORMED: dict[tuple[int, ...], list[weakref.ref]] = {}
_SAMPLE_VALUES = 4096


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return flat[:: max(1, flat.numel() // _SAMPLE_VALUES)]


def _shared(transformed: torch.Tensor) -> torch.Tensor:
    """An already registered tensor equal to ``transformed`` if there is one, else it."""
    for shape in [s for s, refs in _TRANSFORMED.items() if all(r() is None for r in refs)]:
        del _TRANSFORMED[shape]
    refs = _TRANSFORMED.setdefault(tuple(transformed.shape), [])
    sample = _sample(transformed)
    for ref in refs:
        existing = ref()
        if (
            existing is not None
            and torch.equal(_sample(existing), sample)
            and torch.equal(existing, transformed)
        ):
            return existing
    refs[:] = [r for r in refs if r() is not None] + [weakref.ref(transformed)]
    return transformed
