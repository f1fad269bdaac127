"""Frozen graphs: which library computes the float32 linears (npu_attn.compile's
``float32_linears``). The graph inductor lowers is read with a post-grad pass of the test's own,
set where a user would set one (``torch._inductor.config.post_grad_custom_post_pass``): npu_attn's
pass runs first and hands over to it, so the test also checks that a user's pass still runs."""

from __future__ import annotations

import math

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import npu_attn
from frozen_helpers import frozen_and_eager, recording
from npu_attn.graph import frozen_linear

MKL, ONEDNN = "mkl._mkl_linear", "mkldnn._linear_pointwise.default"


class LinearRecorder(CustomGraphPass):
    """Records the linear ops of each graph inductor lowers, and the module buffers no node
    reads (constants left behind)."""

    def __init__(self) -> None:
        self.linears: list[str] = []
        self.unread_buffers: set[str] = set()

    def __call__(self, graph: torch.fx.Graph) -> None:
        targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
        self.linears += [t for t in targets if t in (MKL, ONEDNN)]
        read = {n.target for n in graph.nodes if n.op == "get_attr"}
        self.unread_buffers |= {name for name, _ in graph.owning_module.named_buffers()} - read

    def uuid(self):
        return None  # no caching: every compile lowers (and records) its graph


@pytest.fixture
def recorder():
    with recording(LinearRecorder(), "post_grad_custom_post_pass") as pass_:
        yield pass_


def mlp(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 48, bias=False)]
    return torch.nn.Sequential(*layers).eval().to(dtype)


@pytest.mark.parametrize("choice", ["onednn", "mkl"])
def test_frozen_float32_linears_run_on_the_chosen_library(choice, recorder, capsys):
    x = torch.randn(2, 300, 64)
    compiled, eager = frozen_and_eager(mlp(), x, float32_linears=choice)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    expected = ONEDNN if choice == "onednn" else MKL
    assert recorder.linears == [expected, expected]
    # the replaced linears' MKL-packed weights are gone from the graph's module
    assert recorder.unread_buffers == set()
    moved = 2 if choice == "onednn" else 0
    line = f"float32 linears: {moved} on oneDNN, {2 - moved} on MKL ({choice})"
    assert line in capsys.readouterr().err


def test_auto_moves_the_shapes_measured_faster_on_onednn(recorder, monkeypatch, capsys):
    """ "auto" follows the measurement per shape: faked here (one shape 2x faster on oneDNN,
    one only 2% faster, under the 5% bar), because which library wins is the machine's."""
    seen = []

    def fake_speedup(rows, in_features, out_features, threads):
        seen.append((rows, in_features, out_features, threads))
        return 2.0 if in_features == 64 else 1.02

    monkeypatch.setattr(frozen_linear, "onednn_speedup", fake_speedup)
    x = torch.randn(3, 100, 64)
    compiled, eager = frozen_and_eager(mlp(), x)  # float32_linears="auto" by default
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert recorder.linears == [ONEDNN, MKL]
    threads = torch.get_num_threads()
    assert sorted(seen) == [(300, 64, 256, threads), (300, 256, 48, threads)]
    assert "float32 linears: 1 on oneDNN, 1 on MKL (auto)" in capsys.readouterr().err


def test_onednn_speedup_is_measured_once_per_shape():
    frozen_linear.onednn_speedup.cache_clear()
    first = frozen_linear.onednn_speedup(200, 64, 96, 1)
    assert math.isfinite(first) and first > 0
    assert frozen_linear.onednn_speedup(200, 64, 96, 1) == first
    info = frozen_linear.onednn_speedup.cache_info()
    assert (info.hits, info.misses) == (1, 1)


def test_measurement_rows_keep_one_call_small_but_representative():
    rows = frozen_linear.measure_rows
    assert rows(100, 320, 320) == 100  # small inputs: the real row count
    assert rows(8192, 320, 2560) == int(2e9 // (2 * 320 * 2560))  # cut to the FLOP budget
    assert rows(8192, 3072, 12288) == frozen_linear.MIN_MEASURE_ROWS  # never below the floor


def bf16_linears_packed_by_inductor(packs_bf16: bool) -> list[str]:
    """What the recorder sees for the bfloat16 MLP's two linears: inductor packs them for oneDNN
    only where oneDNN has bfloat16 hardware (AVX512-BF16, AMX); elsewhere they stay plain
    matmuls. MKL packs only float32, so it never appears."""
    return [ONEDNN] if packs_bf16 else []


def check_bfloat16_linears_are_left_to_inductor(recorder, capsys, packs_bf16: bool):
    """Inductor decides bfloat16 linears itself; the pass finds nothing to change."""
    x = torch.randn(2, 50, 64, dtype=torch.bfloat16)
    compiled, eager = frozen_and_eager(mlp(torch.bfloat16), x, float32_linears="onednn")
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=3e-2, atol=3e-2)
    # (the first linear may be fused with the GELU into a lowering of its own)
    assert sorted(set(recorder.linears)) == bf16_linears_packed_by_inductor(packs_bf16)
    assert "float32 linears" not in capsys.readouterr().err


def test_bfloat16_linears_are_left_to_inductor_on_this_cpu(recorder, capsys):
    packs_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    check_bfloat16_linears_are_left_to_inductor(recorder, capsys, packs_bf16)


@pytest.mark.parametrize("packs_bf16", [True, False], ids=["bf16-hardware", "no-bf16-hardware"])
def test_bfloat16_linears_are_left_to_inductor_on_either_cpu_class(
    packs_bf16, recorder, capsys, monkeypatch
):
    """Each CPU class's branch, chosen by flipping inductor's own capability check (it reads
    CPUID, so masking npu_attn's detector would not change it). The packed branch cannot be
    forced on a CPU without bfloat16 units: oneDNN then refuses to pack the weights."""
    from torch._inductor.fx_passes import mkldnn_fusion

    if packs_bf16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip(
            "oneDNN packs bfloat16 linear weights only with AVX512-BW/VL/DQ or AVX-NE-CONVERT, "
            "which this CPU lacks"
        )
    monkeypatch.setattr(mkldnn_fusion, "is_mkldnn_bf16_supported", lambda device: packs_bf16)
    check_bfloat16_linears_are_left_to_inductor(recorder, capsys, packs_bf16)


def test_float32_linears_is_validated():
    with pytest.raises(ValueError, match="float32_linears must be one of 'auto', 'onednn'"):
        npu_attn.compile(mlp(), None, freeze=True, float32_linears="fastest")
    with pytest.raises(ValueError, match="applies to frozen graphs only: pass freeze=True"):
        npu_attn.compile(mlp(), None, float32_linears="onednn")


def test_a_frozen_unet_with_onednn_linears_matches_eager(recorder):
    """A real diffusers UNet (tiny config, encoder attention mask), tiled attention, every
    float32 linear on oneDNN: the compiled output equals the eager one to float32 rounding."""
    from tiny_models import tiny_unet, unet_inputs

    model = tiny_unet()
    inputs = unet_inputs(masks=True)
    npu_attn.set_attention_strategy(model, "tiled")
    with torch.no_grad():
        eager = model(**inputs).sample
    npu_attn.compile(model, "tiled", freeze=True, float32_linears="onednn", show_progress=False)
    with torch.no_grad():
        compiled = model(**inputs).sample
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert ONEDNN in recorder.linears and MKL not in recorder.linears
