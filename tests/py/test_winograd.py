"""Winograd F(4x4, 3x3) convolution (torch.ops.npu_attn.winograd_conv3x3) against a float64
reference: odd and tiny spatial sizes (ragged last tiles, 1x1 images), single channels, every
input layout, with and without bias, and the error bound npu_attn.compile's docs state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from npu_attn.graph import winograd

# (N, C, K, H, W): ragged tiles (7x9, 13x17, 5x4), one pixel, one output channel, a tile-exact
# 16x16 and a SD-1.5-like channel count.
SHAPES = [
    (1, 3, 5, 7, 9),
    (2, 4, 1, 1, 1),
    (2, 16, 8, 5, 4),
    (1, 40, 24, 13, 17),
    (2, 64, 48, 16, 16),
    (1, 320, 32, 8, 12),
    (2, 8, 8, 8, 9),  # tile-exact height, ragged width
]
# The documented bound: largest error over the output's largest magnitude, unit-variance data.
RELATIVE_ERROR_BOUND = 2e-5


def layouts(x: torch.Tensor) -> dict[str, torch.Tensor]:
    n, c, h, w = x.shape
    wide = torch.randn(n, 2 * c, h, w)[:, ::2]  # every other channel: no dense layout at all
    wide.copy_(x)
    return {
        "contiguous": x.contiguous(),
        "channels_last": x.to(memory_format=torch.channels_last),
        "strided_channels": wide,
    }


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.double() - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_matches_the_float64_convolution(shape, with_bias):
    n, c, k, h, w = shape
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(n, c, h, w, generator=g)
    weight = torch.randn(k, c, 3, 3, generator=g) / (9 * c) ** 0.5
    bias = torch.randn(k, generator=g) if with_bias else None
    reference = F.conv2d(
        x.double(), weight.double(), None if bias is None else bias.double(), padding=1
    )
    transformed = winograd.transform_weight(weight)
    for name, layout in layouts(x).items():
        before = layout.clone()
        out = winograd.winograd_conv3x3(layout, transformed, bias)
        assert out.shape == (n, k, h, w) and out.dtype == torch.float32, name
        assert out.is_contiguous(memory_format=torch.channels_last), name
        assert relative_error(out, reference) < RELATIVE_ERROR_BOUND, name
        assert torch.equal(layout, before), f"{name}: the input was modified"


def rms_relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.double() - reference).pow(2).mean() / reference.pow(2).mean()).sqrt().item()


def test_error_at_unet_channel_counts_is_a_few_times_the_direct_convolutions():
    """At a UNet's channel counts (the error grows with the reduction length): within the
    documented bound, and a few times the error of what it replaces in a frozen graph
    (oneDNN's direct convolution on a channels-last input). A wrong tile offset or transform
    entry would show as an O(1) error."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 1280, 16, 16, generator=g).to(memory_format=torch.channels_last)
    weight = torch.randn(640, 1280, 3, 3, generator=g) / (9 * 1280) ** 0.5
    reference = F.conv2d(x.double(), weight.double(), padding=1)
    direct = F.conv2d(x, weight, padding=1)
    ours = winograd.conv2d_3x3(x, weight)
    assert relative_error(ours, reference) < RELATIVE_ERROR_BOUND
    assert rms_relative_error(ours, reference) < 8 * rms_relative_error(direct, reference)


@pytest.mark.parametrize(
    ("shape", "rows_per_chunk"),
    [((2, 16, 8, 20, 16), 1), ((1, 8, 12, 21, 10), 1), ((2, 8, 8, 20, 13), 2)],
    ids=["tile_exact", "ragged", "two_rows_short_last_chunk"],
)
def test_large_images_go_in_chunks_of_tile_rows(shape, rows_per_chunk, monkeypatch):
    """Intermediates are bounded by computing a few tile rows at a time: the same result in
    chunks as for the whole image at once (ragged edges and a shorter last chunk included)."""
    n, c, k, h, w = shape
    x = torch.randn(n, c, h, w)
    transformed = winograd.transform_weight(torch.randn(k, c, 3, 3))
    bias = torch.randn(k)
    whole = winograd.winograd_conv3x3(x, transformed, bias)
    tiles_w = -(-w // 4)
    per_row = winograd.WORKSPACE_BYTES // winograd._tile_rows_per_chunk(n, c, k, tiles_w)
    monkeypatch.setattr(winograd, "WORKSPACE_BYTES", rows_per_chunk * per_row)
    assert winograd._tile_rows_per_chunk(n, c, k, tiles_w) == rows_per_chunk
    chunked = winograd.winograd_conv3x3(x, transformed, bias)
    # (the GEMMs' blocking differs with their row count: equal up to rounding)
    scale = whole.abs().max().item()
    torch.testing.assert_close(chunked, whole, rtol=0, atol=RELATIVE_ERROR_BOUND * scale)


def test_empty_inputs_give_empty_outputs():
    transformed = winograd.transform_weight(torch.randn(4, 3, 3, 3))
    for x in (torch.randn(0, 3, 8, 8), torch.randn(2, 3, 8, 0)):
        out = winograd.winograd_conv3x3(x, transformed, torch.randn(4))
        assert out.shape == (x.shape[0], 4, 8, x.shape[3])


def test_weights_transform_in_float64():
    weight = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    transformed = winograd.transform_weight(weight)
    assert transformed.shape == (36, 3, 4) and transformed.dtype == torch.float32
    g = torch.tensor(winograd._G, dtype=torch.float64)
    expected = (g @ weight[2, 1] @ g.T).reshape(36)  # output channel 2, input channel 1
    torch.testing.assert_close(transformed[:, 1, 2].double(), expected, rtol=1e-6, atol=1e-7)


def test_registered_op_is_consistent_with_its_fake_implementation():
    x = torch.randn(2, 8, 9, 6).to(memory_format=torch.channels_last)
    transformed = winograd.transform_weight(torch.randn(5, 8, 3, 3))
    torch.library.opcheck(torch.ops.npu_attn.winograd_conv3x3, (x, transformed, torch.randn(5)))
    torch.library.opcheck(torch.ops.npu_attn.winograd_conv3x3, (x, transformed, None))


def test_bad_input_is_named():
    x = torch.randn(1, 8, 6, 6)
    transformed = winograd.transform_weight(torch.randn(4, 8, 3, 3))
    op = winograd.winograd_conv3x3
    with pytest.raises(TypeError, match="float32 only: got x torch.bfloat16"):
        op(x.bfloat16(), transformed, None)
    with pytest.raises(ValueError, match=r"x must be 4-D \(N, C, H, W\)"):
        op(x[0], transformed, None)
    with pytest.raises(ValueError, match=r"weight_winograd must have shape \(36, C, K\)"):
        op(x, transformed[:16], None)
    with pytest.raises(ValueError, match="weight_winograd has 8 input channels, x has 3"):
        op(x[:, :3], transformed, None)
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        op(x, transformed, torch.randn(5))
    with pytest.raises(TypeError, match="bias must be float32 like x, got torch.float64"):
        op(x, transformed, torch.randn(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"weight must have shape \(K, C, 3, 3\)"):
        winograd.transform_weight(torch.randn(4, 8, 5, 5))
