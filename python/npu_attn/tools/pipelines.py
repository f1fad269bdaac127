"""The diffusers pipelines npu_attn's tools run, built from their published configurations
with random weights (nothing is downloaded), or loaded from a local diffusers folder: one set of
builders shared by ``demo``, ``bench --e2e``, ``bench --parallel`` and the web UI (``ui``).

ARCHITECTURES names every built-in architecture: a tiny one of each family (FAMILIES: SD-1.5/2.1,
SDXL, SD3, Flux, HiDream-I1) for tests and quick runs, the full-size SD-1.5, SD-2.1, SDXL and
SD3-medium, and Flux and HiDream-I1 at full width but reduced depth. The last part estimates
what a generation needs before anything is built: parameters, sizes a model takes, memory.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import warnings
from collections.abc import Iterator
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
# Flux's transformer (double-stream then single-stream blocks, rotary positions, packed 2x2
# latents). Fields: (FluxTransformer2DModel config, default size, T5 text width, VAE channels).
FLUX_MODELS = {
    # black-forest-labs/FLUX.1-dev's transformer/config.json at full width with 2 of its 19
    # double-stream and 4 of its 38 single-stream blocks: the whole model (12B parameters) does
    # not fit in 24 GiB, and a step's attention shapes are the full model's.
    "flux": (
        {
            "patch_size": 1,
            "in_channels": 64,
            "num_layers": 2,
            "num_single_layers": 4,
            "attention_head_dim": 128,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "pooled_projection_dim": 768,
            "guidance_embeds": True,
            "axes_dims_rope": (16, 56, 56),
        },
        512,
        4096,
        (128, 256, 512, 512),
    ),
    # the same blocks with the widths of diffusers' own Flux tests
    "tiny-flux": (
        {
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 32,
            "guidance_embeds": True,
            "axes_dims_rope": (4, 4, 8),
        },
        64,
        32,
        (32, 64),
    ),
}
# HiDream-I1 (the base of HiDream-E1): double- and single-stream blocks with mixture-of-experts
# feed-forwards, text from T5 and from several Llama layers. Fields: (HiDreamImageTransformer2DModel
# config, default size, T5 text width, VAE channels).
HIDREAM_MODELS = {
    # HiDream-ai/HiDream-I1-Full's transformer/config.json at full width with 2 of its 16
    # double-stream and 4 of its 32 single-stream blocks (the whole model is 17B parameters);
    # each block reads its own Llama layer.
    "hidream": (
        {
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 16,
            "num_layers": 2,
            "num_single_layers": 4,
            "attention_head_dim": 128,
            "num_attention_heads": 20,
            "caption_channels": (4096, 4096),
            "text_emb_dim": 2048,
            "num_routed_experts": 4,
            "num_activated_experts": 2,
            "axes_dims_rope": (64, 32, 32),
            "max_resolution": (128, 128),
            "llama_layers": tuple(range(6)),
        },
        512,
        4096,
        (128, 256, 512, 512),
    ),
    "tiny-hidream": (
        {
            "patch_size": 2,
            "in_channels": 4,
            "out_channels": 4,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "caption_channels": (8, 4),
            "text_emb_dim": 8,
            "num_routed_experts": 2,
            "num_activated_experts": 2,
            "axes_dims_rope": (4, 2, 2),
            "max_resolution": (32, 32),
            "llama_layers": (0, 1),
        },
        64,
        8,
        (32, 64),
    ),
}
# Text sequence lengths of the transformer families (their pipelines' max_sequence_length):
# SD3 has CLIP's 77 tokens, then T5's 256; Flux T5's 512; HiDream 128 of T5 and of Llama each.
SD3_TEXT_TOKENS = 77 + 256
FLUX_TEXT_TOKENS = 512
HIDREAM_TEXT_TOKENS = 128
# Flux's and HiDream's VAE (FLUX.1-dev's vae/config.json): 16 latent channels, no quant convs.
FLUX_VAE_CONFIG = {
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
# The UNet architectures (``bench --e2e`` builds their UNets alone), the transformer ones, and
# every architecture build_pipeline knows.
UNET_ARCHITECTURES = {**MODELS, **SDXL_MODELS}
TRANSFORMER_ARCHITECTURES = {**SD3_MODELS, **FLUX_MODELS, **HIDREAM_MODELS}
ARCHITECTURES = {**UNET_ARCHITECTURES, **TRANSFORMER_ARCHITECTURES}
# Each architecture's model family: what decides its pipeline, prompt embeddings, the
# accelerations that apply and the sizes it takes.
FAMILIES = {
    **{name: "sd" for name in MODELS},
    **{name: "sdxl" for name in SDXL_MODELS},
    **{name: "sd3" for name in SD3_MODELS},
    **{name: "flux" for name in FLUX_MODELS},
    **{name: "hidream" for name in HIDREAM_MODELS},
}


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


# The denoiser class of each family (diffusers' names).
DENOISER_CLASSES = {
    "sd": "UNet2DConditionModel",
    "sdxl": "UNet2DConditionModel",
    "sd3": "SD3Transformer2DModel",
    "flux": "FluxTransformer2DModel",
    "hidream": "HiDreamImageTransformer2DModel",
}


@contextlib.contextmanager
def seeded_weights(seed: int = 0) -> Iterator[None]:
    """Random weights drawn from ``seed`` inside the block, without moving the caller's global
    RNG: torch's CPU generator is forked for the block (models initialise from it)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_denoiser(model: str):
    """The architecture's UNet or transformer, random weights (seed 0)."""
    import diffusers

    with seeded_weights(0):
        return getattr(diffusers, DENOISER_CLASSES[FAMILIES[model]])(**ARCHITECTURES[model][0])


def family_vae(model: str):
    """The architecture's VAE with its family's latent channels, scale and shift."""
    family, config = FAMILIES[model], ARCHITECTURES[model][0]
    if family == "sdxl":  # its own latent scale, decoded in float32 when run in float16
        return build_vae(model, latent_channels=4, scaling_factor=0.13025, force_upcast=True)
    if family == "sd3":  # stable-diffusion-3-medium-diffusers' vae/config.json
        return build_vae(
            model,
            latent_channels=config["in_channels"],
            scaling_factor=1.5305,
            shift_factor=0.0609,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
    if family == "flux":  # the transformer takes 2x2 patches of latents packed in its channels
        return build_vae(model, latent_channels=config["in_channels"] // 4, **FLUX_VAE_CONFIG)
    if family == "hidream":
        return build_vae(model, latent_channels=config["in_channels"], **FLUX_VAE_CONFIG)
    return build_vae(model, latent_channels=4)


def build_sd3_pipeline(model: str):
    """StableDiffusion3Pipeline with the named SD3_MODELS architecture, SD3's VAE layout (its
    latent scale and shift, no quant convs) and flow-matching scheduler, random weights."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(
        transformer=build_denoiser(model),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # SD3's scheduler config
        vae=family_vae(model),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )


def build_flux_pipeline(model: str):
    """FluxPipeline with the named FLUX_MODELS architecture, Flux's VAE and its flow-matching
    scheduler with resolution-dependent shift, random weights."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler config
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        shift=3.0,
        use_dynamic_shifting=True,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=family_vae(model),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=build_denoiser(model),
    )


def build_hidream_pipeline(model: str):
    """HiDreamImagePipeline with the named HIDREAM_MODELS architecture, Flux's VAE (as
    HiDream-I1's) and a flow-matching scheduler, random weights."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline

    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=family_vae(model),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
        text_encoder_4=None,
        tokenizer_4=None,
        transformer=build_denoiser(model),
    )
    fit_size(pipe, ARCHITECTURES[model][1])
    return pipe


def fit_size(pipe, size: int) -> None:
    """Prepares `pipe` to generate `size` x `size` images. HiDream's pipeline rescales every
    request to the area of its default sample size, so that size is set to the request's;
    the other pipelines take the size as given."""
    if pipeline_family(pipe) == "hidream":
        pipe.default_sample_size = size // pipe.vae_scale_factor


def build_pipeline(model: str = "sd15"):
    """A pipeline with the named architecture (ARCHITECTURES) and random weights, its models
    in inference mode as from_pretrained leaves them (HiDream's mixture-of-experts routing and
    output layout differ in training mode). The text encoders are omitted: prompts are given
    as embeddings (prompt_embeddings)."""
    if model not in ARCHITECTURES:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(ARCHITECTURES)}")
    with seeded_weights(0):  # the same weights in every process, the caller's RNG untouched
        pipe = build_architecture(model)
    for component in pipe.components.values():
        if hasattr(component, "eval"):
            component.eval()
    return pipe


def build_architecture(model: str):
    """A pipeline with the named architecture (MODELS: StableDiffusionPipeline with DDIM;
    SDXL_MODELS: StableDiffusionXLPipeline with SDXL's Euler scheduler; SD3_MODELS:
    StableDiffusion3Pipeline; FLUX_MODELS: FluxPipeline; HIDREAM_MODELS: HiDreamImagePipeline)
    with random weights (no download) and no text encoders."""
    from diffusers import (
        DDIMScheduler,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
    )

    transformer_builders = {
        "sd3": build_sd3_pipeline,
        "flux": build_flux_pipeline,
        "hidream": build_hidream_pipeline,
    }
    if FAMILIES[model] in transformer_builders:
        return transformer_builders[FAMILIES[model]](model)
    sdxl = model in SDXL_MODELS
    unet, vae = build_denoiser(model), family_vae(model)
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


def read_model_index(directory: Path) -> dict:
    """A diffusers model folder's model_index.json; ValueError naming what is wrong if there is
    none or it is not JSON (cheap: callers check a folder before giving up a loaded model)."""
    if not (directory / "model_index.json").is_file():
        raise ValueError(
            f"{directory} is not a diffusers model folder: no model_index.json (save one with "
            "pipe.save_pretrained(DIR) or download a diffusers-format model)"
        )
    try:
        return json.loads((directory / "model_index.json").read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{directory}/model_index.json is not valid JSON: {e}") from e


def load_pipeline(directory: Path, torch_dtype=None):
    """A real local diffusers model folder (must contain model_index.json), its weights loaded
    in ``torch_dtype`` when given: a bfloat16 run of a float32 folder then never holds a float32
    copy of the model (without it diffusers loads float32 and a cast doubles the peak)."""
    from diffusers import DiffusionPipeline

    index = read_model_index(directory)
    # Components listed but not saved (e.g. a folder saved without its text encoder) load as
    # None; prompts then fall back to random embeddings.
    absent = {
        name: None
        for name, spec in index.items()
        if not name.startswith("_") and isinstance(spec, list) and not (directory / name).exists()
    }
    # Code shipped in the folder (custom pipelines or models) is never run.
    if torch_dtype is not None:
        absent["torch_dtype"] = torch_dtype
    return DiffusionPipeline.from_pretrained(
        str(directory), local_files_only=True, trust_remote_code=False, **absent
    )


def pipeline_family(pipe) -> Optional[str]:
    """The model family of a pipeline, from its denoiser: "sd" (SD-1.5/2.1-style UNet), "sdxl",
    "sd3", "flux", "hidream"; None for any other model."""
    model = denoiser(pipe)
    if getattr(pipe, "unet", None) is not None:
        return "sdxl" if pooled_text_dim(model.config) is not None else "sd"
    by_class = {
        "SD3Transformer2DModel": "sd3",
        "FluxTransformer2DModel": "flux",
        "HiDreamImageTransformer2DModel": "hidream",
    }
    return by_class.get(type(model).__name__)


def random_embedding_shapes(pipe) -> dict[str, tuple[int, ...]]:
    """The prompt embedding keyword arguments of the pipeline's family and their shapes (for
    one prompt; each ``negative_`` twin has the same shape)."""
    config = denoiser(pipe).config
    family = pipeline_family(pipe)
    if family == "sd3":  # joint text tokens (CLIP + T5) and the pooled CLIP embedding
        text = (1, SD3_TEXT_TOKENS, config.joint_attention_dim)
        return {"prompt_embeds": text, "pooled_prompt_embeds": (1, config.pooled_projection_dim)}
    if family == "flux":  # T5's tokens and CLIP's pooled embedding
        text = (1, FLUX_TEXT_TOKENS, config.joint_attention_dim)
        return {"prompt_embeds": text, "pooled_prompt_embeds": (1, config.pooled_projection_dim)}
    if family == "hidream":  # T5's tokens, one hidden state per Llama layer read, pooled CLIPs
        t5_width, llama_width = config.caption_channels
        llama_layers = max(config.llama_layers) + 1
        return {
            "prompt_embeds_t5": (1, HIDREAM_TEXT_TOKENS, t5_width),
            "prompt_embeds_llama3": (llama_layers, 1, HIDREAM_TEXT_TOKENS, llama_width),
            "pooled_prompt_embeds": (1, config.text_emb_dim),
        }
    shapes = {"prompt_embeds": (1, 77, config.cross_attention_dim)}
    pooled = pooled_text_dim(config)
    if pooled is not None:  # SDXL
        shapes["pooled_prompt_embeds"] = (1, pooled)
    return shapes


def negative_name(name: str) -> str:
    """``prompt_embeds`` -> ``negative_prompt_embeds`` (diffusers' naming of each family)."""
    return f"negative_{name}"


def prompt_embeddings(pipe, dtype, device, prompt: Optional[str] = None) -> dict[str, Any]:
    """The prompt as the pipeline's keyword arguments: its family's prompt embeddings and their
    ``negative_`` twins (random_embedding_shapes). Encoded with the pipeline's text encoders
    when it has them and a prompt is given (Flux and HiDream encode the prompt themselves),
    else random (seeded) embeddings of the model's widths."""
    import torch

    family = pipeline_family(pipe)
    if prompt is not None and getattr(pipe, "text_encoder", None) is not None:
        if family in ("flux", "hidream"):
            return {"prompt": prompt, "negative_prompt": ""}
        return encoded_prompt(pipe, family, device, prompt)
    g = torch.Generator().manual_seed(1234)
    embeds = {}
    for name, shape in random_embedding_shapes(pipe).items():
        for key in (name, negative_name(name)):
            embeds[key] = torch.randn(*shape, generator=g).to(device, dtype)
    return embeds


def encoded_prompt(pipe, family: Optional[str], device, prompt: str) -> dict[str, Any]:
    """SD, SDXL and SD3 prompts through the pipeline's own encode_prompt, as embeddings."""
    names = ["prompt_embeds", "negative_prompt_embeds"]
    if family in ("sdxl", "sd3"):
        names += ["pooled_prompt_embeds", "negative_pooled_prompt_embeds"]
    # SD3 has a prompt per text encoder; None repeats the first
    per_encoder = {"prompt_2": None, "prompt_3": None} if family == "sd3" else {}
    encoded = pipe.encode_prompt(
        prompt=prompt,
        **per_encoder,
        device=device,
        num_images_per_prompt=1,
        do_classifier_free_guidance=True,
        negative_prompt="",
    )
    return dict(zip(names, encoded))


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


# --------------------------------------------------------------------------- sizes and memory
def size_limits(family: Optional[str], config, vae_scale: int) -> tuple[int, int, Optional[int]]:
    """(multiple, smallest, largest or None) image size in pixels a model takes: latents are
    image / vae_scale pixels; a UNet halves them once per extra level, a transformer cuts them
    into patches (Flux packs 2x2); SD3's positions and HiDream's sequence have a maximum.
    (Not every UNet size fits the levels exactly: diffusers forwards the upsampling sizes.)"""
    get = config.get
    if family in ("sd", "sdxl") or family is None:
        levels = len(get("block_out_channels", (0,)))
        # Stable Diffusion's pipelines take multiples of 8 pixels only, whatever their VAE.
        multiple = max(8, vae_scale)
        return multiple, max(multiple, vae_scale * 2 ** (levels - 1)), None
    patch = 2 if family == "flux" else get("patch_size", 1)
    multiple = vae_scale * patch
    largest = None
    if family == "sd3" and get("pos_embed_max_size"):
        largest = get("pos_embed_max_size") * multiple
    if family == "hidream":
        largest = get("max_resolution")[0] * vae_scale
    return multiple, multiple, largest


def size_problem(family: Optional[str], config, vae_scale: int, size: int) -> Optional[str]:
    """Why the model cannot generate `size` x `size` images (size_limits), or None."""
    multiple, smallest, largest = size_limits(family, config, vae_scale)
    if size < smallest or size % multiple:
        return f"size {size} px: this model takes multiples of {multiple} px from {smallest} px"
    if largest is not None and size > largest:
        return f"size {size} px: this model takes at most {largest} px"
    return None


def architecture_summary(model: str) -> tuple[int, Any]:
    """(parameters of the denoiser and VAE, the denoiser's full config) of the architecture,
    from models built on the meta device (no memory, no weights); cached."""
    return _summary(model)[:2]


def vae_summary(model: str) -> tuple[int, bool]:
    """(parameters of the architecture's VAE, whether its pipeline decodes in float32 when run
    in float16: decodes_in_float32)."""
    return _summary(model)[2:]


def _summary(model: str) -> tuple[int, Any, int, bool]:
    if model not in _SUMMARIES:
        import torch

        with torch.device("meta"):
            denoiser_model, vae = build_denoiser(model), family_vae(model)
        vae_count = sum(p.numel() for p in vae.parameters())
        count = vae_count + sum(p.numel() for p in denoiser_model.parameters())
        upcast = decodes_in_float32(FAMILIES[model], vae.config)
        _SUMMARIES[model] = (count, denoiser_model.config, vae_count, upcast)
    return _SUMMARIES[model]


def decodes_in_float32(family: Optional[str], vae_config) -> bool:
    """Whether the family's pipeline, run in float16, converts its VAE to float32 for the
    decode: diffusers' SDXL pipelines do where the VAE's config sets force_upcast (SDXL's VAE
    overflows in float16); the others decode in the pipeline's dtype."""
    return family == "sdxl" and bool(vae_config.get("force_upcast", False))


def parameter_count(model: str) -> int:
    """Parameters of the architecture's denoiser and VAE."""
    return architecture_summary(model)[0]


_SUMMARIES: dict[str, tuple[int, Any, int, bool]] = {}
# Hidden-state-sized tensors alive at once inside a block (residual, norm, q, k, v, attention
# output, the MLP's 4x-wide hidden...): a rough, generous count for the memory estimate.
LIVE_HIDDEN_COPIES = 16


def attention_geometry(family: Optional[str], config, latent: int) -> tuple[int, int, int]:
    """(tokens, width, heads) of the model's largest self-attention at `latent` x `latent`
    latent pixels, text tokens included for the joint-attention transformers."""
    get = config.get
    if family in ("sd", "sdxl") or family is None:
        down = list(get("down_block_types", ("CrossAttnDownBlock2D",)))
        level = next((i for i, t in enumerate(down) if "CrossAttn" in t), 0)
        width = get("block_out_channels", (320,))[level]
        # diffusers' legacy naming: without num_attention_heads, UNet configs give the head
        # count as attention_head_dim (SD-1.5: 8 heads of 40), per level or for all levels.
        heads = get("num_attention_heads") or get("attention_head_dim") or max(1, width // 64)
        if isinstance(heads, (list, tuple)):
            heads = heads[level]
        return (latent // 2**level) ** 2, width, heads
    text = {"sd3": SD3_TEXT_TOKENS, "flux": FLUX_TEXT_TOKENS, "hidream": 2 * HIDREAM_TEXT_TOKENS}
    patch = 2 if family == "flux" else get("patch_size", 1)
    heads = get("num_attention_heads")
    tokens = (latent // patch) ** 2 + text[family]
    return tokens, heads * get("attention_head_dim"), heads


# Bytes per element of the dtypes a generation runs in.
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def decoder_elements(vae_channels, size, images) -> int:
    """The VAE decoder's full-resolution feature maps (a few alive at once), in elements."""
    return images * vae_channels[0] * size * size * 4


def step_activation_bytes(family, config, vae_channels, vae_scale, size, element_bytes, images):
    """A rough upper bound of one step's activations: the largest attention's hidden states
    (LIVE_HIDDEN_COPIES of them) and score matrix, for the guidance batch (2 per image; Flux's
    guidance is distilled, 1), plus the VAE decoder's full-resolution feature maps."""
    batch = images * (1 if family == "flux" else 2)
    tokens, width, heads = attention_geometry(family, config, size // vae_scale)
    hidden = batch * tokens * width * LIVE_HIDDEN_COPIES
    scores = batch * heads * tokens * tokens
    decoder = decoder_elements(vae_channels, size, images)
    return (hidden + scores + decoder) * element_bytes


def float32_decode_bytes(dtype, upcasts, vae_params, vae_channels, size, images) -> int:
    """What decoding in float32 adds to a float16 run whose pipeline does it (`upcasts`:
    decodes_in_float32): the VAE's weights and decoder feature maps at 4 bytes instead of 2."""
    if dtype != "float16" or not upcasts:
        return 0
    return 2 * (vae_params + decoder_elements(vae_channels, size, images))


def estimated_memory_bytes(model: str, size: int, dtype: str = "float32", images: int = 1) -> int:
    """The memory a generation with the built-in architecture needs in `dtype`, estimated before
    anything is built: parameters x bytes per element plus one step's activations at `size`
    (and the float32 decode of SDXL in float16: float32_decode_bytes)."""
    config, vae_channels = architecture_summary(model)[1], ARCHITECTURES[model][3]
    element_bytes = ELEMENT_BYTES[dtype]
    activations = step_activation_bytes(
        FAMILIES[model], config, vae_channels, vae_scale_factor(model), size, element_bytes, images
    )
    vae_params, upcasts = vae_summary(model)
    decode = float32_decode_bytes(dtype, upcasts, vae_params, vae_channels, size, images)
    return parameter_count(model) * element_bytes + activations + decode


# Libraries whose configuration chatter the tools silence (quiet_third_party_warnings).
THIRD_PARTY_LIBRARIES = ("diffusers", "transformers")


@contextlib.contextmanager
def quiet_third_party_warnings():
    """Silences diffusers' and transformers' configuration chatter while a tool runs.

    Their warnings are about config files, dtype casts and optional packages ("The config
    attributes ... were passed to ..., but are not expected", "should be kept in float32",
    FutureWarnings), not about the user's run, and they bury the tool's tables. Their loggers keep
    errors; their FutureWarning and DeprecationWarning are ignored. npu_attn's logger and every
    other warning are untouched, and levels and filters are restored on exit, so a program that
    calls a tool's ``main`` keeps its own settings. A library whose ``<NAME>_VERBOSITY`` is set is
    left as the user asked.
    """
    saved_levels = {}
    with warnings.catch_warnings():
        for name in THIRD_PARTY_LIBRARIES:
            if os.environ.get(f"{name.upper()}_VERBOSITY"):
                continue
            for category in (FutureWarning, DeprecationWarning):
                warnings.filterwarnings("ignore", category=category, module=rf"{name}(\.|$)")
            try:
                # Importing configures the library's logger, which would reset a level set
                # earlier; diffusers imports transformers for Stable Diffusion anyway.
                importlib.import_module(name)
            except ImportError:
                continue
            logger = logging.getLogger(name)
            saved_levels[name] = logger.level
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for name, level in saved_levels.items():
                logging.getLogger(name).setLevel(level)
