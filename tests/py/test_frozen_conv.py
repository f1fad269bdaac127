"""Frozen graphs: which algorithm computes the float32 3x3 convolutions (npu_attn.compile's
``float32_convs``). The graph inductor lowers is read with a post-grad pre-pass of the test's
own, set where a user would set one (``torch._inductor.config.post_grad_custom_pre_pass``):
npu_attn's pass runs first and hands over to it, so the test also checks that a user's pass
still runs."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import npu_attn
from frozen_helpers import frozen_and_eager, recording
from npu_attn.graph import frozen_conv

DIRECT, WINOGRAD = "mkldnn._convolution_pointwise.default", "npu_attn.winograd_conv3x3.default"


class ConvRecorder(CustomGraphPass):
    """Records the convolution ops of each graph inductor lowers, and the module buffers no
    node reads (constants left behind)."""

    def __init__(self) -> None:
        self.convs: list[str] = []
        self.unread_buffers: set[str] = set()
        self.winograd_weights: list[torch.Tensor] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        for node in graph.nodes:
            if node.op == "call_function" and str(node.target) in (DIRECT, WINOGRAD):
                self.convs.append(str(node.target))
                if str(node.target) == WINOGRAD:
                    # (strong references: the identity checks need the tensors alive)
                    self.winograd_weights.append(getattr(module, node.args[1].target))
        read = {n.target for n in graph.nodes if n.op == "get_attr"}
        self.unread_buffers |= {name for name, _ in module.named_buffers()} - read

    def uuid(self):
        return None  # no caching: every compile lowers (and records) its graph


@pytest.fixture
def recorder():
    with recording(ConvRecorder(), "post_grad_custom_pre_pass") as pass_:
        yield pass_


class ConvNet(torch.nn.Module):
    """Two Winograd-eligible 3x3 convolutions (one feeding an activation, one a residual add)
    and four that are not, three of them with padding 1 (3x3 stride 2; 1x1 and 5x5, which
    change the image size; 1x1 without padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.second = torch.nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.down = torch.nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.project = torch.nn.Conv2d(16, 4, 1)
        self.grow = torch.nn.Conv2d(4, 4, 1, padding=1)
        self.shrink = torch.nn.Conv2d(4, 4, 5, padding=1)

    def forward(self, x):
        h = torch.nn.functional.silu(self.first(x))
        h = h + self.second(h)
        return self.shrink(self.grow(self.project(self.down(h))))


def conv_net(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return ConvNet().eval().to(dtype)


@pytest.mark.parametrize("choice", ["winograd", "direct"])
def test_frozen_float32_convs_run_on_the_chosen_algorithm(choice, recorder, capsys):
    x = torch.randn(2, 8, 18, 13)
    compiled, eager = frozen_and_eager(conv_net(), x, float32_convs=choice)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    eligible = WINOGRAD if choice == "winograd" else DIRECT
    assert sorted(recorder.convs) == sorted([eligible] * 2 + [DIRECT] * 4)
    # the replaced convolutions' oneDNN-packed weights are gone from the graph's module
    assert recorder.unread_buffers == set()
    moved = 2 if choice == "winograd" else 0
    line = f"3x3 stride-1 convolutions: {moved} Winograd, {2 - moved} direct ({choice})"
    assert line in capsys.readouterr().err


def test_auto_takes_winograd_for_the_shapes_measured_faster(recorder, monkeypatch, capsys):
    """ "auto" follows the measurement per shape: faked here (one shape 2x faster with
    Winograd, one only 5% faster, under the 10% bar), because which wins is the machine's."""
    seen = []

    def fake_speedup(n, c, k, h, w, threads):
        seen.append((n, c, k, h, w, threads))
        return 2.0 if c == 8 else 1.05

    monkeypatch.setattr(frozen_conv, "winograd_speedup", fake_speedup)
    x = torch.randn(3, 8, 10, 10)
    compiled, eager = frozen_and_eager(conv_net(), x)  # float32_convs="auto" by default
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert recorder.convs.count(WINOGRAD) == 1 and recorder.convs.count(DIRECT) == 5
    threads = torch.get_num_threads()
    assert sorted(seen) == [(3, 8, 16, 10, 10, threads), (3, 16, 16, 10, 10, threads)]
    assert "3x3 stride-1 convolutions: 1 Winograd, 1 direct (auto)" in capsys.readouterr().err


def test_winograd_speedup_is_measured_once_per_shape():
    frozen_conv.winograd_speedup.cache_clear()
    first = frozen_conv.winograd_speedup(1, 16, 24, 12, 12, 1)
    assert math.isfinite(first) and first > 0
    assert frozen_conv.winograd_speedup(1, 16, 24, 12, 12, 1) == first
    info = frozen_conv.winograd_speedup.cache_info()
    assert (info.hits, info.misses) == (1, 1)


def test_measurement_keeps_one_call_small_but_representative():
    shape = frozen_conv.measure_shape
    assert shape(2, 320, 320, 64, 64) == (2, 64, 64)  # a SD-1.5 UNet convolution: as it is
    per_image = 2 * 320 * 320 * 32 * 32 * 9
    assert shape(16, 320, 320, 32, 32) == (int(16e9 // per_image), 32, 32) == (8, 32, 32)
    # a 512x512 VAE convolution (77 GFLOP): one image, fewer rows (whole tiles), same width
    rows = int(16e9 // (2 * 128 * 128 * 9)) // 512 // 4 * 4
    assert shape(1, 128, 128, 512, 512) == (1, rows, 512) and rows < 512
    # huge channel counts: the rows' floor, then fewer columns, then the columns' floor
    n, rows, columns = shape(1, 1024, 1024, 64, 512)
    assert (n, rows) == (1, 16) and columns % 4 == 0 and 16 <= columns < 512
    assert 2 * 1024 * 1024 * 9 * rows * columns <= 16e9
    assert shape(1, 4096, 4096, 64, 512) == (1, 16, 16)


def test_a_failed_measurement_keeps_the_direct_convolution(recorder, monkeypatch):
    """Warned about once per shape, not measured again for the next graph."""
    calls = []

    def out_of_memory(*key):
        calls.append(key)
        raise RuntimeError("not enough memory")

    monkeypatch.setattr(frozen_conv, "winograd_speedup", out_of_memory)
    monkeypatch.setattr(frozen_conv, "_FAILED_MEASUREMENTS", set())
    x = torch.randn(1, 8, 8, 8)
    # pytest.warns re-emits what it records but did not match from this file, where the
    # configuration's filter for torch's own deprecations (a lazy torch.jit one fires on a
    # process's first compile) no longer applies: those are kept out of the record.
    expected = "could not time Winograd .* keeping oneDNN's"
    with pytest.warns(UserWarning, match=expected), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch")
        compiled, eager = frozen_and_eager(conv_net(), x)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    frozen_and_eager(conv_net(), x)  # a second graph: the failures are remembered
    assert len(calls) == 2  # the two eligible shapes, once each
    assert WINOGRAD not in recorder.convs


def test_recompiling_shares_the_transformed_weights(recorder):
    """A second frozen graph of the same weights (here: another module sharing their values)
    holds the same transformed tensors, not a second copy 4x the kernels' size; other weights
    get their own."""
    first, same, other = conv_net(), conv_net(), conv_net()
    same.load_state_dict(first.state_dict())
    with torch.no_grad():
        other.second.weight.mul_(2)
    x = torch.randn(1, 8, 12, 12)
    for model in (first, same, other):
        frozen_and_eager(model, x, float32_convs="winograd")
    weights = recorder.winograd_weights
    assert len(weights) == 6
    assert weights[0] is weights[2] and weights[1] is weights[3]  # first and same
    assert weights[4] is weights[0]  # other's first convolution: unchanged
    assert weights[5] is not weights[1] and not torch.equal(weights[5], weights[1])


def test_user_passes_of_every_form_still_run(monkeypatch):
    """A user's post-grad pre-pass given as a list, or inference-aware, runs after npu_attn's
    (it sees the Winograd nodes) with its own calling convention."""
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass

    class InferenceAwareRecorder(CustomInferenceAwareGraphPass):
        def __init__(self) -> None:
            self.calls: list[tuple[bool, int]] = []

        def __call__(self, graph, is_inference):
            winograd_nodes = [n for n in graph.nodes if str(n.target) == WINOGRAD]
            self.calls.append((is_inference, len(winograd_nodes)))

        def uuid(self):
            return None

    for form in ("list", "tuple", "single"):
        torch._dynamo.reset()
        recorder, aware = ConvRecorder(), InferenceAwareRecorder()
        user_setting = {"list": [aware, recorder], "tuple": (aware, recorder)}.get(form, aware)
        with inductor_config.patch(post_grad_custom_pre_pass=user_setting):
            frozen_and_eager(conv_net(), torch.randn(1, 8, 8, 8), float32_convs="winograd")
            assert inductor_config.post_grad_custom_pre_pass is user_setting  # left as it was
        assert aware.calls == [(True, 2)], form
        if form != "single":
            assert recorder.convs.count(WINOGRAD) == 2, form
    torch._dynamo.reset()


def test_training_calls_are_not_rewritten(recorder):
    """Calls with gradients enabled compile without freezing: nothing is frozen, so the pass
    leaves the graph alone and backward works."""
    model = conv_net().train()
    npu_attn.compile(model, None, freeze=True, float32_convs="winograd", show_progress=False)
    x = torch.randn(1, 8, 8, 8, requires_grad=True)
    model(x).sum().backward()
    npu_attn.reset_compile(model)
    assert WINOGRAD not in recorder.convs
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_dynamic_shapes_keep_the_direct_convolution(recorder):
    x = torch.randn(1, 8, 12, 12)
    compiled, eager = frozen_and_eager(conv_net(), x, float32_convs="winograd", dynamic=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert WINOGRAD not in recorder.convs


def test_bfloat16_convs_are_left_to_onednn(recorder, capsys):
    x = torch.randn(2, 8, 12, 12, dtype=torch.bfloat16)
    compiled, eager = frozen_and_eager(conv_net(torch.bfloat16), x, float32_convs="winograd")
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=3e-2, atol=3e-2)
    assert WINOGRAD not in recorder.convs
    assert "3x3 stride-1 convolutions" not in capsys.readouterr().err


def test_float32_convs_is_validated():
    with pytest.raises(ValueError, match="float32_convs must be one of 'auto', 'winograd'"):
        npu_attn.compile(conv_net(), None, freeze=True, float32_convs="fft")
    with pytest.raises(ValueError, match="float32_convs='direct' applies to frozen graphs only"):
        npu_attn.compile(conv_net(), None, float32_convs="direct")


def test_a_frozen_unet_and_vae_decoder_with_winograd_match_eager(recorder):
    """A real diffusers UNet (tiny config, encoder attention mask, tiled attention) and VAE
    decoder, every eligible float32 3x3 convolution by Winograd: compiled equals eager within
    the float32 rounding Winograd adds."""
    from diffusers import AutoencoderKL

    from tiny_models import tiny_unet, unet_inputs

    model = tiny_unet()
    inputs = unet_inputs(masks=True)
    npu_attn.set_attention_strategy(model, "tiled")
    with torch.no_grad():
        eager = model(**inputs).sample
    npu_attn.compile(model, "tiled", freeze=True, float32_convs="winograd", show_progress=False)
    with torch.no_grad():
        compiled = model(**inputs).sample
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert WINOGRAD in recorder.convs

    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=16,
    ).eval()
    latents = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        eager = vae.decode(latents).sample
    recorder.convs.clear()
    npu_attn.compile(vae.decoder, None, freeze=True, float32_convs="winograd", show_progress=False)
    with torch.no_grad():
        compiled = vae.decode(latents).sample
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert WINOGRAD in recorder.convs
