"""The diffusers pipelines npu_attn's tools run, built from their published configurations
with random weights (nothing is downloaded), or loaded from a local diffusers folder: one set of
builders shared by ``demo``, ``bench --e2e`` and ``bench --parallel``.

ARCHITECTURES names every built-in architecture: tiny ones for tests and quick runs, and the
full-size SD-1.5, SD-2.1, SDXL and SD3-medium.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

MODELS = {
    # name: (UNet config overrides, default size, cross-attention dim, VAE block channels)
    "sd15": ({"cross_attention_dim": 768}, 512, 768, (128, 256, 512, 512)),
    "sd21": (
        {
            "attention_head_dim": (5, 10, 20, 20),
            "cross_attention_dim": 1024,
            "use_linear_projection": True,
        },
        768,
        1024,
        (128, 256, 512, 512),
    ),
    "tiny": (
        {
            "block_out_channels": (32, 64),
            "layers_per_block": 1,
            "cross_attention_dim": 32,
            "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
            "attention_head_dim": 8,
            "norm_num_groups": 8,
            "sample_size": 32,
        },
        64,
        32,
        (32, 64),
    ),
}

# SDXL's architecture, for the demo and ``bench --e2e``. Same fields as MODELS; the UNet takes
# SDXL's added text/time conditions (prompt_embeddings gives the pooled embeddings), whose
# pooled text width is
# projection_class_embeddings_input_dim - 6 * addition_time_embed_dim (6 time ids).
SDXL_MODELS = {
    # stabilityai/stable-diffusion-xl-base-1.0's unet/config.json (2.6B parameters; its other
    # fields are diffusers' defaults) and its VAE's channels
    "sdxl": (
        {
            "block_out_channels": (320, 640, 1280),
            "layers_per_block": 2,
            "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            "transformer_layers_per_block": (1, 2, 10),
            "attention_head_dim": (5, 10, 20),
            "cross_attention_dim": 2048,
            "use_linear_projection": True,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 256,
            "projection_class_embeddings_input_dim": 2816,
            "sample_size": 128,
        },
        1024,
        2048,
        (128, 256, 512, 512),
    ),
    # the same structure (no attention at full resolution, transformer depth growing with
    # depth, linear projections, added conditions) with tiny widths, for tests
    "tiny-sdxl": (
        {
            "block_out_channels": (32, 64, 64),
            "layers_per_block": 1,
            "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            "transformer_layers_per_block": (1, 1, 2),
            "attention_head_dim": (2, 4, 4),
            "cross_attention_dim": 32,
            "use_linear_projection": True,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 8,
            "projection_class_embeddings_input_dim": 6 * 8 + 32,
            "norm_num_groups": 8,
            "sample_size": 32,
        },
        64,
        32,
        (32, 64),
    ),
}
# Stable Diffusion 3's MMDiT, for the demo's transformer path (First Block Cache, --block-cache).
# Fields: (SD3Transformer2DModel config, default size, joint text width, VAE block channels).
SD3_MODELS = {
    # stabilityai/stable-diffusion-3-medium-diffusers' transformer/config.json (2B parameters).
    # The demo's default is 512px: SD3's native 1024px has 4x the image tokens, ~4x a step.
    "sd3": (
        {
            "sample_size": 128,
            "patch_size": 2,
            "in_channels": 16,
            "num_layers": 24,
            "attention_head_dim": 64,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 1536,
            "pooled_projection_dim": 2048,
            "out_channels": 16,
            "pos_embed_max_size": 192,
        },
        512,
        4096,
        (128, 256, 512, 512),
    ),
    # the same blocks (joint attention, the last block context_pre_only) with tiny widths
    "tiny-sd3": (
        {
            "sample_size": 32,
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "joint_attention_dim": 32,
            "caption_projection_dim": 32,
            "pooled_projection_dim": 64,
            "out_channels": 4,
        },
        64,
        32,
        (32, 64),
    ),
}
# SD3's text sequence: CLIP's 77 tokens, then T5's 256 (its pipelines' max_sequence_length).
SD3_TEXT_TOKENS = 77 + 256
# The UNet architectures (``bench --e2e`` builds their UNets alone) and every architecture
# build_pipeline knows.
UNET_ARCHITECTURES = {**MODELS, **SDXL_MODELS}
ARCHITECTURES = {**UNET_ARCHITECTURES, **SD3_MODELS}


def pooled_text_dim(unet_config) -> Optional[int]:
    """The width of the pooled text embedding an SDXL-style UNet takes (from its config);
    None for SD-1.5/2.1."""
    if unet_config.get("addition_embed_type") != "text_time":
        return None
    return (
        unet_config["projection_class_embeddings_input_dim"]
        - 6 * unet_config["addition_time_embed_dim"]
    )


def vae_scale_factor(model: str) -> int:
    """Image pixels per latent pixel of the architecture's VAE."""
    return 2 ** (len(ARCHITECTURES[model][3]) - 1)


def denoiser(pipe):
    """The pipeline's denoising model: its UNet, or its transformer (SD3)."""
    return pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer


def build_vae(model: str, latent_channels: int, **config):
    """The architecture's AutoencoderKL (its block channels from ARCHITECTURES; 1 layer per block
    and 8 groups for the tiny ones, else SD's 2 and 32), random weights; `config` adds the
    model family's own fields (latent scale, shift...)."""
    from diffusers import AutoencoderKL

    vae_channels = ARCHITECTURES[model][3]
    tiny = model.startswith("tiny")
    n = len(vae_channels)
    return AutoencoderKL(
        block_out_channels=vae_channels,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        latent_channels=latent_channels,
        layers_per_block=1 if tiny else 2,
        norm_num_groups=8 if tiny else 32,
        **config,
    )


def build_sd3_pipeline(model: str):
    """StableDiffusion3Pipeline with the named SD3_MODELS architecture, SD3's VAE layout (its
    latent scale and shift, no quant convs) and flow-matching scheduler, random weights."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    overrides = SD3_MODELS[model][0]
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(**overrides)
    vae = build_vae(
        model,
        latent_channels=overrides["in_channels"],
        # stable-diffusion-3-medium-diffusers' vae/config.json
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # SD3's scheduler config
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )


def build_pipeline(model: str = "sd15"):
    """A pipeline with the named architecture (MODELS: StableDiffusionPipeline with DDIM;
    SDXL_MODELS: StableDiffusionXLPipeline with SDXL's Euler scheduler; SD3_MODELS:
    StableDiffusion3Pipeline) and random weights (no download). The text encoders are omitted:
    prompts are given as embeddings."""
    import torch
    from diffusers import (
        DDIMScheduler,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )

    if model not in ARCHITECTURES:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(ARCHITECTURES)}")
    if model in SD3_MODELS:
        return build_sd3_pipeline(model)
    overrides = ARCHITECTURES[model][0]
    sdxl = model in SDXL_MODELS
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**overrides)
    # SDXL's VAE config: its own latent scale, decoded in float32 when run in float16
    sdxl_vae = {"scaling_factor": 0.13025, "force_upcast": True} if sdxl else {}
    vae = build_vae(model, latent_channels=4, **sdxl_vae)
    if sdxl:
        scheduler = EulerDiscreteScheduler(  # SDXL base 1.0's scheduler config
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            steps_offset=1,
            timestep_spacing="leading",
            prediction_type="epsilon",
        )
        return StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=None,
            text_encoder_2=None,
            tokenizer=None,
            tokenizer_2=None,
            unet=unet,
            scheduler=scheduler,
            add_watermarker=False,
        )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,  # as SD-1.5's and 2.1's own scheduler configs (0 draws a FutureWarning)
        prediction_type="v_prediction" if model == "sd21" else "epsilon",
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return pipe


def load_pipeline(directory: Path):
    """A real local diffusers model folder (must contain model_index.json)."""
    from diffusers import DiffusionPipeline

    if not (directory / "model_index.json").is_file():
        raise ValueError(
            f"{directory} is not a diffusers model folder: no model_index.json (save one with "
            "pipe.save_pretrained(DIR) or download a diffusers-format model)"
        )
    try:
        index = json.loads((directory / "model_index.json").read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{directory}/model_index.json is not valid JSON: {e}") from e
    # Components listed but not saved (e.g. a folder saved without its text encoder) load as
    # None; prompts then fall back to random embeddings.
    absent = {
        name: None
        for name, spec in index.items()
        if not name.startswith("_") and isinstance(spec, list) and not (directory / name).exists()
    }
    return DiffusionPipeline.from_pretrained(str(directory), local_files_only=True, **absent)


def prompt_embeddings(pipe, dtype, device, prompt: Optional[str] = None) -> dict[str, Any]:
    """The prompt as the pipeline's embedding keyword arguments: ``prompt_embeds`` and
    ``negative_prompt_embeds``, plus the pooled pair when the model takes them (SDXL, SD3).
    Encoded with the pipeline's text encoders when it has them and a prompt is given, else
    random (seeded) embeddings of the model's widths."""
    import torch

    config = denoiser(pipe).config
    sd3 = getattr(pipe, "unet", None) is None
    if sd3:  # joint text tokens (CLIP + T5) and the pooled CLIP embedding
        tokens, width = SD3_TEXT_TOKENS, config.joint_attention_dim
        pooled = config.pooled_projection_dim
    else:
        tokens, width, pooled = 77, config.cross_attention_dim, pooled_text_dim(config)
    names = ["prompt_embeds", "negative_prompt_embeds"]
    if pooled is not None:
        names += ["pooled_prompt_embeds", "negative_pooled_prompt_embeds"]
    if prompt is not None and getattr(pipe, "text_encoder", None) is not None:
        # SD3 has a prompt per text encoder; None repeats the first
        per_encoder = {"prompt_2": None, "prompt_3": None} if sd3 else {}
        encoded = pipe.encode_prompt(
            prompt=prompt,
            **per_encoder,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=True,
            negative_prompt="",
        )
        return dict(zip(names, encoded))
    g = torch.Generator().manual_seed(1234)
    shapes = [(1, tokens, width)] * 2 + [(1, pooled)] * (len(names) - 2)
    return {
        name: torch.randn(*shape, generator=g).to(device, dtype)
        for name, shape in zip(names, shapes)
    }


def relative_error(values, reference) -> float:
    """||values - reference|| / ||reference|| (Euclidean over all elements, in float64)."""
    import torch

    values, reference = values.double(), reference.double()
    norm = torch.linalg.vector_norm(reference)
    distance = torch.linalg.vector_norm(values - reference)
    if norm == 0:
        return 0.0 if distance == 0 else math.inf
    return float(distance / norm)


def psnr_db(image, reference) -> float:
    """Peak signal-to-noise ratio in dB of `image` against `reference`, pixels in [0, 1]
    (peak 1); infinite when they are equal."""
    mse = float(((image.double() - reference.double()) ** 2).mean())
    return math.inf if mse == 0 else 10.0 * math.log10(1.0 / mse)
