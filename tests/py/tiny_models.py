"""Tiny, randomly initialised diffusers models of every family (configs from diffusers' own
tests; no downloads)."""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    FluxTransformer2DModel,
    HiDreamImageTransformer2DModel,
    SD3Transformer2DModel,
    UNet2DConditionModel,
)


def tiny_unet():
    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(4, 8),
        layers_per_block=1,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=8,
        norm_num_groups=2,
    ).eval()


def tiny_vae():
    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(8, 16),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=4,
    ).eval()


def tiny_sd3():
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=32,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    ).eval()


def tiny_flux():
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    ).eval()


def tiny_hidream():
    torch.manual_seed(0)
    return HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_channels=[8, 4],
        text_emb_dim=8,
        num_routed_experts=2,
        num_activated_experts=2,
        axes_dims_rope=(4, 2, 2),
        max_resolution=(32, 32),
        llama_layers=(0, 1),
    ).eval()
