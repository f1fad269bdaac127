"""Which library computes the float32 linears of a frozen (``freeze=True``) inductor graph.

Inductor's freezing prepacks every float32 linear for MKL (``mkl._mkl_linear``) and keeps oneDNN
(``mkldnn._linear_pointwise``) for bfloat16/float16 and dynamic shapes. Which of the two is
faster depends on the CPU: on an AMD Zen 4 (2 threads, the SD-1.5 UNet's linear shapes) MKL's
single-precision GEMM runs at 120-160 GFLOP/s and oneDNN's at 145-220, so a frozen float32 UNet
step spends ~0.5 s more in MKL. :class:`FrozenLinearPass` is an inductor post-grad pass that,
after freezing, moves each float32 linear to oneDNN where that is measured faster on the machine
at hand (``"auto"``), or always (``"onednn"``). Both libraries compute the same float32 product
(summation order aside), so outputs agree to float32 rounding.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import _C
from ._timing import interleaved_medians

FLOAT32_LINEARS = ("auto", "onednn", "mkl")

# "auto" moves a linear to oneDNN only when it is this much faster than MKL: the two are within
# noise on many CPUs, and MKL is what inductor chose.
ONEDNN_MIN_SPEEDUP = 1.05
# Rows of the measurement GEMM: the real row count, cut so one call is at most this many
# floating-point operations (a Flux linear would take ~1 s a call), but never below
# MIN_MEASURE_ROWS, where both libraries' blocking is already what it is for large inputs.
MEASURE_FLOP_BUDGET = 2e9
MIN_MEASURE_ROWS = 256
MEASURE_ROUNDS = 5


def check_float32_linears(value: str) -> str:
    if value not in FLOAT32_LINEARS:
        raise ValueError(
            f"float32_linears must be one of {', '.join(repr(v) for v in FLOAT32_LINEARS)}, "
            f"got {value!r}"
        )
    return value


def _is_mkl_linear(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not hasattr(torch.ops, "mkl"):
        return False
    packet = torch.ops.mkl._mkl_linear
    return node.target in (packet, packet.default)


def measure_rows(rows: int, in_features: int, out_features: int) -> int:
    cap = int(MEASURE_FLOP_BUDGET // (2 * in_features * out_features))
    return min(rows, max(MIN_MEASURE_ROWS, cap))


@functools.cache
def onednn_speedup(rows: int, in_features: int, out_features: int, threads: int) -> float:
    """MKL's time over oneDNN's for one float32 linear of this shape on this machine, both with
    prepacked weights as in a frozen graph (``threads``: the torch thread count, part of the
    cache key because the answer depends on it)."""
    del threads
    rows = measure_rows(rows, in_features, out_features)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    mkl_weight = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    onednn_weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    with torch.no_grad():
        seconds = interleaved_medians(
            {
                "mkl": lambda: torch.ops.mkl._mkl_linear(x, mkl_weight, weight, bias, rows),
                "onednn": lambda: torch.ops.mkldnn._linear_pointwise(
                    x, onednn_weight, bias, "none", [], ""
                ),
            },
            MEASURE_ROUNDS,
        )
    return seconds["mkl"] / seconds["onednn"]


class FrozenLinearPass(CustomGraphPass):
    """Post-grad pass for frozen graphs: replaces ``mkl._mkl_linear`` nodes (float32 linears
    with MKL-packed weights) by ``mkldnn._linear_pointwise`` with oneDNN-packed weights, per
    shape where ``choice`` says so, and frees the MKL-packed constants it no longer needs.

    ``then`` is a post-grad pass that runs after this one (the user's own
    ``torch._inductor.config.post_grad_custom_post_pass``, if any), so it sees the final graph.
    ``counts`` accumulates how many linears went to each library over every graph compiled.
    """

    def __init__(self, choice: str, then: Optional[Callable] = None) -> None:
        self.choice = check_float32_linears(choice)
        self.then = then
        self.counts: Counter = Counter()

    def __call__(self, graph: torch.fx.Graph) -> None:
        self._assign_libraries(graph)
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
        return get_hash_for_files((__file__,), extra=extra)

    def _wants_onednn(self, rows: int, weight: torch.Tensor) -> bool:
        if self.choice != "auto":
            return self.choice == "onednn"
        out_features, in_features = weight.shape
        speedup = onednn_speedup(rows, in_features, out_features, torch.get_num_threads())
        return speedup >= ONEDNN_MIN_SPEEDUP

    def _assign_libraries(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        orphan_candidates = []
        for node in [n for n in graph.nodes if _is_mkl_linear(n)]:
            x, mkl_packed, weight_node, bias, rows = node.args
            weight = _constant(module, weight_node)
            if weight is None or weight.dim() != 2 or not isinstance(rows, int):
                self.counts["mkl"] += 1  # not a frozen linear of a known shape: leave it
                continue
            if not self._wants_onednn(rows, weight):
                self.counts["mkl"] += 1
                continue
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
            name = _register_constant(module, packed)
            with graph.inserting_before(node):
                packed_node = graph.create_node("get_attr", name)
                linear = graph.call_function(
                    torch.ops.mkldnn._linear_pointwise.default,
                    (x, packed_node, bias, "none", [], ""),
                )
            linear.meta.update(node.meta)
            node.replace_all_uses_with(linear)
            graph.erase_node(node)
            orphan_candidates += [mkl_packed, weight_node]
            self.counts["onednn"] += 1
        _drop_unused_constants(graph, orphan_candidates)


def _constant(module: torch.nn.Module, node: Any) -> Optional[torch.Tensor]:
    """The tensor a get_attr node reads (None for anything else)."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = getattr(module, node.target, None)
    return value if isinstance(value, torch.Tensor) else None


def _register_constant(
    module: torch.nn.Module, tensor: torch.Tensor, prefix: str = "_npu_attn_onednn_weight"
) -> str:
    """Register ``tensor`` on the frozen graph's module as inductor's constant folding does
    (a buffer, marked as a frozen parameter) under a fresh name starting with ``prefix``."""
    from torch._inductor.freezing_utils import maybe_set_is_frozen_param

    index = 0
    while hasattr(module, f"{prefix}{index}"):
        index += 1
    name = f"{prefix}{index}"
    module.register_buffer(name, tensor)
    maybe_set_is_frozen_param(tensor)
    return name


def _drop_unused_constants(graph: torch.fx.Graph, candidates: list) -> None:
    """Remove those of ``candidates`` (get_attr nodes of replaced linears: the MKL-packed and
    the original weights) that nothing reads any more, and the module attributes behind them,
    so their memory is freed."""
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
