"""Winograd F(4x4, 3x3) convolution for float32 3x3 / stride 1 / padding 1 convolutions on CPU.

Why: a diffusion UNet's float32 step on CPU is about half 3x3 convolutions, and oneDNN's direct
convolution already runs them near the FMA peak (~215 GFLOP/s on a 2-core Zen 4), so only fewer
multiplications make them faster. Winograd's minimal filtering algorithm (Lavin & Gray, "Fast
Algorithms for Convolutional Neural Networks", 2015) computes each 4x4 output tile from a 6x6
input tile with 36 multiplications per input/output channel pair instead of 144: the
convolution becomes 36 independent GEMMs of (tiles x C) by (C x K), plus linear
transforms of the input tiles (B^T d B), the weights (G g G^T, once, when the weights are
frozen) and the products (A^T m A).

Measured on a 2-core AMD Zen 4 against oneDNN's prepacked direct convolution (what a frozen
inductor graph runs), the SD-1.5 UNet's shapes at 512x512 with CFG batch 2: 1.5-2.4x faster at
64x64, 32x32 and 16x16 latents, 0.75-0.8x at 8x8 (there the 4x larger transformed weights make
the GEMMs bandwidth-bound); ``npu_attn.compile(..., freeze=True)`` measures each shape and uses
it only where it wins (see ``_frozen_conv``).

Numerics: the result is exact in exact arithmetic; in float32 the transforms (entries up to 5
and 8) add rounding error. On unit-variance data at a UNet's channel counts (320-2560 input
channels) the root-mean-square error is ~3e-6 of the output's and the largest ~1e-5 of its
largest magnitude: about 3x (rms) to 5x (max) the error of oneDNN's direct convolution it
replaces, and three orders of magnitude below bfloat16's rounding (4e-3). The weight transform
is computed in float64. This is the trade cuDNN makes when its autotuner picks a Winograd
algorithm; ``float32_convs="direct"`` keeps the direct convolution.

Memory: the transformed weights are 36/9 = 4x the size of the 3x3 kernels they replace (in a
frozen graph they take the place of oneDNN's prepacked copy). The SD-1.5 UNet's 3x3 stride-1
kernels are 522M of its 860M parameters.

The op is ``torch.ops.npu_attn.winograd_conv3x3`` (``torch.library.custom_op`` with a fake
implementation, so it is one opaque node in compiled graphs). Its GEMMs run on torch's
``bmm``; the transforms are GEMMs with the Kronecker products of the transform matrices.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

# Output tile edge, input tile edge (= OUTPUT_TILE + 3 - 1) and kernel edge of F(4x4, 3x3).
OUTPUT_TILE = 4
INPUT_TILE = 6
KERNEL = 3
POSITIONS = INPUT_TILE * INPUT_TILE  # independent GEMMs, one per transformed tile position
# Intermediates of one chunk of tile rows: ~7x the input and output activations if computed at
# once, so large images (a VAE decoder at 1024x1024: 128 channels x 1024 x 1024) go in chunks.
# Small enough to bound that, large enough that each chunk's GEMMs have a thousand-odd rows.
# (Outside the bound: one zero-padded channels-last copy of the input, ~1x its size.)
WORKSPACE_BYTES = 128 << 20

# Lavin & Gray's F(4, 3) matrices with interpolation points 0, +-1, +-2 and infinity.
_B_T = (
    (4, 0, -5, 0, 1, 0),
    (0, -4, -4, 1, 1, 0),
    (0, 4, -4, -1, 1, 0),
    (0, -2, -1, 2, 1, 0),
    (0, 2, -1, -2, 1, 0),
    (0, 4, 0, -5, 0, 1),
)
_G = (
    (1 / 4, 0, 0),
    (-1 / 6, -1 / 6, -1 / 6),
    (-1 / 6, 1 / 6, -1 / 6),
    (1 / 24, 1 / 12, 1 / 6),
    (1 / 24, -1 / 12, 1 / 6),
    (0, 0, 1),
)
_A_T = (
    (1, 1, 1, 1, 1, 0),
    (0, 1, -1, 2, -2, 0),
    (0, 1, 1, 4, 4, 0),
    (0, 1, -1, 8, -8, 1),
)


def _kron_square(matrix) -> Tensor:
    m = torch.tensor(matrix, dtype=torch.float64)
    return torch.kron(m, m)


# The 2-D transforms as one matrix each, acting on a tile flattened row-major:
# vec(B^T d B) = kron(B^T, B^T) vec(d), vec(A^T m A) = kron(A^T, A^T) vec(m).
_INPUT_TRANSFORM = _kron_square(_B_T).float()  # (36, 36)
_OUTPUT_TRANSFORM = _kron_square(_A_T).float()  # (16, 36)
_WEIGHT_TRANSFORM = _kron_square(_G)  # (36, 9), float64: applied once per frozen weight


def transform_weight(weight: Tensor) -> Tensor:
    """The Winograd-domain weights (36, C, K) of a (K, C, 3, 3) convolution weight: G g G^T per
    (output, input) channel pair, computed in float64, returned in float32."""
    if weight.dim() != 4 or tuple(weight.shape[2:]) != (KERNEL, KERNEL):
        raise ValueError(f"weight must have shape (K, C, 3, 3), got {tuple(weight.shape)}")
    out_channels, in_channels = weight.shape[:2]
    # One GEMM: vec(G g G^T) = kron(G, G) vec(g) for every (c, k) kernel g at once, with the
    # kernels as columns in (c, k) order so the product is already (36, C, K).
    kernels = weight.detach().double().permute(2, 3, 1, 0).reshape(KERNEL * KERNEL, -1)
    transformed = (_WEIGHT_TRANSFORM @ kernels).float()
    return transformed.view(POSITIONS, in_channels, out_channels)


def _check(x: Tensor, weight_winograd: Tensor, bias: Optional[Tensor]) -> None:
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D (N, C, H, W), got shape {tuple(x.shape)}")
    if x.dtype != torch.float32 or weight_winograd.dtype != torch.float32:
        raise TypeError(
            "winograd_conv3x3 computes in float32 only: got x "
            f"{x.dtype} and weight_winograd {weight_winograd.dtype}"
        )
    if weight_winograd.dim() != 3 or weight_winograd.shape[0] != POSITIONS:
        raise ValueError(
            "weight_winograd must have shape (36, C, K) (from transform_weight), got "
            f"{tuple(weight_winograd.shape)}"
        )
    if weight_winograd.shape[1] != x.shape[1]:
        raise ValueError(
            f"weight_winograd has {weight_winograd.shape[1]} input channels, x has {x.shape[1]}"
        )
    if bias is not None and tuple(bias.shape) != (weight_winograd.shape[2],):
        raise ValueError(
            f"bias must have shape ({weight_winograd.shape[2]},), got {tuple(bias.shape)}"
        )
    if bias is not None and bias.dtype != torch.float32:
        raise TypeError(f"bias must be float32 like x, got {bias.dtype}")
    for name, tensor in (("weight_winograd", weight_winograd), ("bias", bias)):
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")


def _padded_nhwc(x: Tensor, tiles_h: int, tiles_w: int) -> Tensor:
    """x as (N, H', W', C), channels innermost (the GEMMs' operand layout), with one zero row and
    column of padding before and as many after as the last tiles need: H' = 4 * tiles_h + 2."""
    _, _, h, w = x.shape
    bottom = OUTPUT_TILE * tiles_h + 1 - h
    right = OUTPUT_TILE * tiles_w + 1 - w
    return F.pad(x.permute(0, 2, 3, 1), (0, 0, 1, right, 1, bottom))


def _tile_rows_per_chunk(n: int, c: int, k: int, tiles_w: int) -> int:
    """Tile rows computed together, so that the intermediates (input tiles, their transform, the
    products, the output tiles) stay within WORKSPACE_BYTES."""
    floats_per_tile = 2 * POSITIONS * c + POSITIONS * k + OUTPUT_TILE * OUTPUT_TILE * k
    return max(1, WORKSPACE_BYTES // (4 * floats_per_tile * n * tiles_w))


def _output_tiles(padded_rows: Tensor, weight_winograd: Tensor) -> Tensor:
    """The 4x4 output tiles (N, rows, 4, tiles_w, 4, K) of the tile rows whose padded input rows
    (N, 4 * rows + 2, W', C) are given."""
    n, _, _, c = padded_rows.shape
    k = weight_winograd.shape[2]
    tiles = padded_rows.unfold(1, INPUT_TILE, OUTPUT_TILE).unfold(2, INPUT_TILE, OUTPUT_TILE)
    rows, tiles_w = tiles.shape[1:3]
    count = n * rows * tiles_w
    # (N, rows, tiles_w, C, 6, 6) -> (36, tiles * C): tile position major, channels innermost.
    gathered = tiles.permute(4, 5, 0, 1, 2, 3).reshape(POSITIONS, -1)
    transformed = (_INPUT_TRANSFORM @ gathered).view(POSITIONS, count, c)
    products = torch.bmm(transformed, weight_winograd)  # (36, tiles, K)
    outputs = _OUTPUT_TRANSFORM @ products.view(POSITIONS, count * k)
    # (4, 4, N, rows, tiles_w, K) -> (N, rows, 4, tiles_w, 4, K): the tiles in image order.
    return outputs.view(OUTPUT_TILE, OUTPUT_TILE, n, rows, tiles_w, k).permute(2, 3, 0, 4, 1, 5)


def _conv(x: Tensor, weight_winograd: Tensor, bias: Optional[Tensor]) -> Tensor:
    n, c, h, w = x.shape
    k = weight_winograd.shape[2]
    out = torch.empty(
        (n, k, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last
    )
    if out.numel() == 0:
        return out
    tiles_h = -(-h // OUTPUT_TILE)
    tiles_w = -(-w // OUTPUT_TILE)
    padded = _padded_nhwc(x, tiles_h, tiles_w)
    out_nhwc = out.permute(0, 2, 3, 1)
    chunk = _tile_rows_per_chunk(n, c, k, tiles_w)
    for first in range(0, tiles_h, chunk):
        last = min(tiles_h, first + chunk)
        top, bottom = OUTPUT_TILE * first, OUTPUT_TILE * last
        blocks = _output_tiles(padded[:, top : bottom + 2], weight_winograd)
        rows = min(bottom, h) - top
        if rows == bottom - top and w == OUTPUT_TILE * tiles_w:
            target = out_nhwc[:, top:bottom].view(
                n, last - first, OUTPUT_TILE, tiles_w, OUTPUT_TILE, k
            )
            source = blocks
        else:  # ragged edge: crop the last tiles
            target = out_nhwc[:, top : top + rows]
            source = blocks.reshape(n, bottom - top, OUTPUT_TILE * tiles_w, k)[:, :rows, :w]
        if bias is None:
            target.copy_(source)
        else:
            torch.add(source, bias, out=target)
    return out


@torch.library.custom_op("npu_attn::winograd_conv3x3", mutates_args=(), device_types="cpu")
def winograd_conv3x3(x: Tensor, weight_winograd: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.conv2d(x, weight, bias, stride=1, padding=1)`` for a 3x3 ``weight`` given as
    ``transform_weight(weight)``, by Winograd F(4x4, 3x3). float32 (N, C, H, W) in any layout;
    the output is channels-last (N, K, H, W). Inference only: the op has no gradient."""
    _check(x, weight_winograd, bias)
    return _conv(x, weight_winograd, bias)


@winograd_conv3x3.register_fake
def _(x, weight_winograd, bias):
    n, _, h, w = x.shape
    k = weight_winograd.shape[2]
    return torch.empty(
        (n, k, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last
    )


def conv2d_3x3(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """Convenience: ``F.conv2d(x, weight, bias, padding=1)`` by Winograd, transforming
    ``weight`` on each call (frozen graphs transform it once). Inference only (no gradient)."""
    return winograd_conv3x3(x, transform_weight(weight), bias)
