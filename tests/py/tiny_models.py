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


def tiny_sd3(layers: int = 1):
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=32,
        patch_size=1,
        in_channels=4,
        num_layers=layers,
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


def tiny_hidream(layers: int = 1):
    """``layers`` double-stream and ``layers`` single-stream blocks (MoE feed-forwards), a
    Llama layer per block."""
    torch.manual_seed(0)
    return HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=layers,
        num_single_layers=layers,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_channels=[8, 4],
        text_emb_dim=8,
        num_routed_experts=2,
        num_activated_experts=2,
        axes_dims_rope=(4, 2, 2),
        max_resolution=(32, 32),
        llama_layers=(0, 1) * layers,
    ).eval()


# --------------------------------------------------------------------------- inputs
def unet_inputs(masks: bool):
    g = torch.Generator().manual_seed(1)
    inputs = {
        "sample": torch.randn(2, 4, 32, 32, generator=g),
        "timestep": torch.tensor(10),
        "encoder_hidden_states": torch.randn(2, 9, 8, generator=g),
    }
    if masks:
        # Key padding on the text tokens (second prompt shorter), diffusers' 1 = keep.
        inputs["encoder_attention_mask"] = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    return inputs


def run_unet(model, masks=False, **kwargs):
    return model(**unet_inputs(masks), **kwargs).sample


def run_vae(model, masks=False):
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    return model(x).sample


def run_sd3(model, masks=False):
    g = torch.Generator().manual_seed(3)
    return model(
        hidden_states=torch.randn(2, 4, 16, 16, generator=g),
        encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
        pooled_projections=torch.randn(2, 64, generator=g),
        timestep=torch.tensor([1, 2]),
    ).sample


def run_flux(model, masks=False):
    g = torch.Generator().manual_seed(4)
    b, h, w, t = 2, 8, 8, 7
    kwargs = {}
    if masks:  # joint (text + image) sequence mask: hide the last two text tokens of sample 1
        keep = torch.ones(b, t + h * w, dtype=torch.bool)
        keep[1, t - 2 : t] = False
        kwargs["joint_attention_kwargs"] = {"attention_mask": keep[:, None, None, :]}
    return model(
        hidden_states=torch.randn(b, h * w, 4, generator=g),
        encoder_hidden_states=torch.randn(b, t, 32, generator=g),
        pooled_projections=torch.randn(b, 32, generator=g),
        timestep=torch.tensor([0.5, 0.5]),
        img_ids=torch.randn(h * w, 3, generator=g),
        txt_ids=torch.zeros(t, 3),
        **kwargs,
    ).sample


def run_hidream(model, masks=False):
    g = torch.Generator().manual_seed(5)
    return model(
        hidden_states=torch.randn(2, 4, 16, 16, generator=g),
        timesteps=torch.tensor([10, 20]),
        encoder_hidden_states_t5=torch.randn(2, 6, 8, generator=g),
        encoder_hidden_states_llama3=torch.randn(2, 2, 5, 4, generator=g),
        pooled_embeds=torch.randn(2, 8, generator=g),
    ).sample


FAMILIES = {
    "unet": (tiny_unet, run_unet, True),
    "vae": (tiny_vae, run_vae, False),
    "sd3": (tiny_sd3, run_sd3, False),
    "flux": (tiny_flux, run_flux, True),
    "hidream": (tiny_hidream, run_hidream, False),
}


def call_in_dtype(args: tuple, kwargs: dict, dtype) -> tuple[tuple, dict]:
    """A captured model call's floating-point tensors converted to ``dtype``."""

    def cast(v):
        return v.to(dtype) if isinstance(v, torch.Tensor) and torch.is_floating_point(v) else v

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
