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

import torch

from ..runtime import timing
from ..runtime.timing import interleaved_medians
from .frozen import FrozenGraphPass, add_constant, check_choice, constant, drop_unused_constants

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
    return check_choice("float32_linears", value, FLOAT32_LINEARS)


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


class FrozenLinearPass(FrozenGraphPass):
    """Post-grad pass for frozen graphs: replaces ``mkl._mkl_linear`` nodes (float32 linears
    with MKL-packed weights) by ``mkldnn._linear_pointwise`` with oneDNN-packed weights, per
    shape where ``choice`` says so, and frees the MKL-packed constants it no longer needs.
    ``counts``: how many linears went to each library."""

    OPTION = "float32_linears"
    CHOICES = FLOAT32_LINEARS
    FILES = (__file__, timing.__file__)

    def _wants_onednn(self, rows: int, weight: torch.Tensor) -> bool:
        if self.choice != "auto":
            return self.choice == "onednn"
        out_features, in_features = weight.shape
        speedup = onednn_speedup(rows, in_features, out_features, torch.get_num_threads())
        return speedup >= ONEDNN_MIN_SPEEDUP

    def rewrite(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        orphan_candidates = []
        for node in [n for n in graph.nodes if _is_mkl_linear(n)]:
            x, mkl_packed, weight_node, bias, rows = node.args
            weight = constant(module, weight_node)
            if weight is None or weight.dim() != 2 or not isinstance(rows, int):
                self.counts["mkl"] += 1  # not a frozen linear of a known shape: leave it
                continue
            if not self._wants_onednn(rows, weight):
                self.counts["mkl"] += 1
                continue
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
            with graph.inserting_before(node):
                packed_node = add_constant(graph, packed, "_npu_attn_onednn_weight")
                linear = graph.call_function(
                    torch.ops.mkldnn._linear_pointwise.default,
                    (x, packed_node, bias, "none", [], ""),
                )
            linear.meta.update(node.meta)
            node.replace_all_uses_with(linear)
            graph.erase_node(node)
            orphan_candidates += [mkl_packed, weight_node]
            self.counts["onednn"] += 1
        drop_unused_constants(graph, orphan_candidates)
