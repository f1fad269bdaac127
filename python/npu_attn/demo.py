"""``python -m npu_attn demo``: a real diffusers pipeline, every attention strategy, one table.

By default it builds the full Stable Diffusion 1.5 architecture (UNet, VAE) from its
configuration with RANDOM WEIGHTS (nothing is downloaded, so the image is noise; the point is
the attention work, which is the same as with trained weights), picks the device and dtype with
:class:`~npu_attn.DeviceManager` and switches the pipeline to ``set_attention_strategy(pipe,
"auto")``. ``auto`` denoises twice: the first run measures every attention shape it has not
seen before (its one-time cost is printed under the table), the second is its steady state.
The same denoising then runs under each available strategy, and each run's final latents are
decoded once by the VAE (without autograd, as the pipeline itself decodes).

The table, one row per strategy:

- s / step: seconds per denoising step (for ``auto`` the steady state, without measuring);
- attention share: time inside the attention calls over the denoising loop ("-" when
  diffusers' own ``AttnProcessor`` ran, which is not timed);
- peak extra memory: growth of the process's peak resident memory during the loop;
- latents rel. error vs sdpa: ||latents - sdpa's latents|| / ||sdpa's latents||;
- image PSNR vs sdpa: of the decoded image (pixels in [0, 1]) against the ``sdpa`` run's
  image, in dB; higher is closer, "identical" when equal.

In a 16-bit dtype a last row, ``sdpa, float32``, repeats the ``sdpa`` run in float32 with the
same weights and inputs. Its distance from the 16-bit ``sdpa`` run is what the dtype's own
rounding does to the result (random weights amplify it step after step): a strategy whose
deviation is of that size differs from ``sdpa`` only by rounding. The image, a PNG chart of the
table and ``results.json`` (the same columns) are written to the output folder.

``--model`` picks another architecture (SD-2.1, SDXL, SD3 medium: ARCHITECTURES), ``--weights
DIR`` a real local diffusers model folder (with ``--prompt``). ``--tome``, ``--deepcache`` (UNet
pipelines) and ``--block-cache`` (SD3) add one lossy row: ``auto`` with those step
accelerations (:func:`~npu_attn.accelerate`), checked against the model before anything runs.
While the demo runs, diffusers' and transformers' configuration and deprecation warnings are
silenced (set DIFFUSERS_VERBOSITY or TRANSFORMERS_VERBOSITY to see them); npu_attn's own log
lines and errors are shown.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
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


# Libraries whose configuration chatter the demo silences (see quiet_third_party_warnings).
THIRD_PARTY_LIBRARIES = ("diffusers", "transformers")
FLOAT32_REFERENCE_LABEL = "sdpa, float32"


@dataclass
class RunResult:
    """One denoising run under one attention strategy (and, once decoded, its image)."""

    strategy: str
    label: str  # the table's row name
    dtype: str
    seconds: float  # the whole denoising loop
    steps: int
    peak_memory_bytes: int
    latents: Any  # float32, on CPU
    attention_share: Optional[float] = None
    image: Any = None  # decoded, float32 in [0, 1], on CPU

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / self.steps


@dataclass
class AutoCost:
    """``auto``'s one-time cost: its first run (which measures) against its steady state."""

    first_run: RunResult
    shapes_measured: int
    cache_path: Path

    def measuring_seconds(self, steady: RunResult) -> float:
        # Warm-up of the very first run in the process is included: it is one-time as well.
        return max(0.0, self.first_run.seconds - steady.seconds)


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


def _time_runner(strategy: str):
    """Replaces the strategy's runner by a timed one; returns (seconds list, restore)."""
    from . import strategies

    spent = [0.0, 0]  # seconds, calls
    original = strategies.RUNNERS[strategy]

    def timed(*args, **kwargs):
        spent[1] += 1
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    strategies.RUNNERS[strategy] = timed
    return spent, lambda: strategies.RUNNERS.__setitem__(strategy, original)


def denoise(pipe, strategy: str, args, embeds, dm, label: Optional[str] = None) -> RunResult:
    """The denoising loop (no VAE decode) under `strategy`: time, attention share, peak memory
    and final latents. The pipeline keeps `strategy` afterwards."""
    import torch

    from ._memory import measure_peak
    from .diffusers_integration import set_attention_strategy

    label = label or strategy
    pipe.set_progress_bar_config(desc=f"{label:>7} denoising")
    # Processors look their runner up when created, so the timer goes in before switching.
    spent, restore = _time_runner(strategy)
    set_attention_strategy(pipe, strategy)
    try:
        with measure_peak() as memory, torch.no_grad():
            start = time.perf_counter()
            latents = pipe(
                **embeds,
                num_inference_steps=args.steps,
                guidance_scale=7.5,
                height=args.size,
                width=args.size,
                output_type="latent",
                generator=dm.create_generator(args.seed),
            ).images
            dm.synchronize()
            elapsed = time.perf_counter() - start
    finally:
        restore()
    # None when attention did not go through the runner (vanilla on classic Attention modules
    # is diffusers' own AttnProcessor), so the share is unknown rather than zero.
    share = spent[0] / elapsed if elapsed > 0 and spent[1] else None
    dtype = str(latents.dtype).replace("torch.", "")
    return RunResult(
        strategy,
        label,
        dtype,
        elapsed,
        args.steps,
        memory.extra_bytes,
        latents.float().cpu(),
        share,
    )


def decode(pipe, latents):
    """The VAE's image of `latents`: float32 in [0, 1], on CPU. Under no_grad, as the pipeline
    decodes: with autograd on, ``auto`` would time (and choose for) forward + backward, and
    every strategy would keep activations for a backward that never comes."""
    import torch

    vae = pipe.vae
    shift = vae.config.shift_factor or 0.0  # SD3's latents are shifted as well as scaled
    with torch.no_grad():
        scaled = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor + shift
        image = vae.decode(scaled).sample
        return pipe.image_processor.postprocess(image, output_type="pt").float().cpu()


def run_strategy(pipe, strategy: str, args, embeds, dm, label: Optional[str] = None) -> RunResult:
    """Denoise under `strategy`, then decode the latents with the same strategy in the VAE."""
    result = denoise(pipe, strategy, args, embeds, dm, label)
    result.image = decode(pipe, result.latents)
    return result


def run_auto(pipe, args, embeds, dm) -> tuple[RunResult, AutoCost]:
    """``auto`` twice: the first run measures each attention shape not cached yet, the second
    (decoded) is the steady state a user gets from then on. Returns (steady, one-time cost)."""
    from . import strategies

    selector = strategies.auto_selector
    before = selector.measurements
    first = denoise(pipe, "auto", args, embeds, dm, label="auto, first run")
    cost = AutoCost(first, selector.measurements - before, selector.cache_path())
    steady = run_strategy(pipe, "auto", args, embeds, dm, label="auto (steady state)")
    return steady, cost


def requested_accelerations(args) -> dict[str, Any]:
    """The step accelerations the flags ask for, as :func:`~npu_attn.accelerate` options."""
    requested = {
        "token_merging": args.tome,
        "deep_cache": args.deepcache,
        "block_cache": args.block_cache,
    }
    return {method: value for method, value in requested.items() if value is not None}


def check_accelerations(pipe, args) -> Optional[str]:
    """The error message when a requested acceleration is invalid or does not apply to the
    model (e.g. DeepCache on SD3), checked before anything runs; else None."""
    from .acceleration import check_acceleration

    options = requested_accelerations(args)
    if not options:
        return None
    try:
        check_acceleration(pipe, **options)
    except (TypeError, ValueError) as e:
        return f"{args.model if args.weights is None else args.weights}: {e}"
    return None


def run_accelerated(pipe, args, embeds, dm) -> RunResult:
    """``auto`` with the step accelerations asked for (--tome, --deepcache, --block-cache),
    then undone: its accuracy columns show what the lossy methods cost against the exact
    ``sdpa`` run."""
    from .acceleration import accelerate, reset_acceleration
    from .block_cache import block_cache_of

    applied = accelerate(pipe, **requested_accelerations(args))
    names = {
        "token_merging": f"ToMe {args.tome}",
        "deep_cache": f"DeepCache {args.deepcache}",
        "block_cache": f"First Block Cache {args.block_cache}",
    }
    label = "auto + " + " + ".join(names[m] for m in applied)
    try:
        result = run_strategy(pipe, "auto", args, embeds, dm, label=label)
        if "block_cache" in applied:
            print(block_cache_line(block_cache_of(pipe)))
        return result
    finally:
        reset_acceleration(pipe)


def block_cache_line(state: dict[str, Any]) -> str:
    """How often First Block Cache skipped the blocks after the first (a threshold too low
    for the run skips nothing, and the row then equals ``auto``'s)."""
    return (
        f"First Block Cache (threshold {state['threshold']}): the blocks after the first were "
        f"skipped on {state['skipped_calls']} of {state['calls']} transformer calls"
    )


def float32_reference(pipe, args, embeds, dm) -> RunResult:
    """The ``sdpa`` run again in float32, same weights and inputs (upcast, so they are exactly
    the 16-bit ones): its distance from the 16-bit ``sdpa`` run is the dtype's rounding."""
    import torch

    pipe = pipe.to(dtype=torch.float32)  # the last run: the pipeline is not cast back
    embeds32 = {name: e.float() for name, e in embeds.items()}
    return run_strategy(pipe, "sdpa", args, embeds32, dm, label=FLOAT32_REFERENCE_LABEL)


def strategies_to_compare(requested: str, device) -> list[str]:
    """The requested strategies that can run on `device`, always with ``sdpa``: it is the
    reference the accuracy columns compare with."""
    from . import strategies

    names = []
    for name in (s.strip() for s in requested.split(",")):
        if not name or name in names:
            continue
        reason = strategies.unavailable_reason(name, device)
        if reason is not None:
            print(f"skipping {name}: {reason}")
            continue
        names.append(name)
    if "sdpa" not in names:
        print("adding sdpa: it is the reference of the accuracy columns")
        names.append("sdpa")
    return names


# --------------------------------------------------------------------------- accuracy
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


def accuracy(row: RunResult, reference: RunResult) -> dict:
    """How far `row` is from the reference run: final latents and decoded image."""
    return {
        "latents_relative_error_vs_sdpa": relative_error(row.latents, reference.latents),
        "image_psnr_db_vs_sdpa": psnr_db(row.image, reference.image),
        # The former column, kept for bench/make_benchmarks_md.py.
        "max_diff_vs_sdpa": float((row.latents - reference.latents).abs().max()),
    }


# --------------------------------------------------------------------------- report
TABLE_HEADER = (
    "| strategy | s / step | attention share | peak extra memory | "
    "latents rel. error vs sdpa | image PSNR vs sdpa |"
)


def table_line(row: RunResult, measures: dict, is_reference: bool) -> str:
    """One Markdown table row."""
    share = f"{100 * row.attention_share:.0f}%" if row.attention_share is not None else "-"
    if is_reference:
        error = psnr = "reference"
    else:
        error = f"{measures['latents_relative_error_vs_sdpa']:.1e}"
        value = measures["image_psnr_db_vs_sdpa"]
        psnr = "identical" if math.isinf(value) else f"{value:.1f} dB"
    return (
        f"| {row.label} | {row.seconds_per_step:.2f} | {share} | "
        f"{row.peak_memory_bytes / 2**20:,.0f} MiB | {error} | {psnr} |"
    )


def record(row: RunResult, measures: dict) -> dict:
    """One results.json entry: the table's columns (PSNR null when the images are equal)."""
    psnr = measures["image_psnr_db_vs_sdpa"]
    return {
        "strategy": row.strategy,
        "label": row.label,
        "dtype": row.dtype,
        "seconds_per_step": row.seconds_per_step,
        "attention_share": row.attention_share,
        "peak_memory_bytes": row.peak_memory_bytes,
        **measures,
        "image_psnr_db_vs_sdpa": None if math.isinf(psnr) else psnr,
    }


def auto_cost_fields(steady: RunResult, cost: AutoCost) -> dict:
    """results.json's extra fields for the auto row: its one-time cost, apart."""
    return {
        "first_run_seconds_per_step": cost.first_run.seconds_per_step,
        "one_time_measuring_seconds": cost.measuring_seconds(steady),
        "shapes_measured": cost.shapes_measured,
    }


def auto_cost_line(steady: RunResult, cost: AutoCost) -> str:
    """The line under the table with auto's one-time measuring cost."""
    if cost.shapes_measured:
        what = (
            f"it measured {cost.shapes_measured} new attention shapes and cached the choices "
            f"in {cost.cache_path}, so later runs skip this"
        )
    else:
        what = f"every shape's choice was already cached in {cost.cache_path}"
    return (
        f"auto's one-time measuring cost: {cost.measuring_seconds(steady):.2f} s (its first run "
        f"took {cost.first_run.seconds_per_step:.2f} s / step against "
        f"{steady.seconds_per_step:.2f} in the steady state above; {what})"
    )


def accuracy_note(dtype: str, has_float32_row: bool) -> str:
    """How to read the accuracy columns (and, in 16-bit runs, the float32 row)."""
    note = (
        "rel. error = ||latents - sdpa's|| / ||sdpa's||; PSNR of the decoded image against "
        "sdpa's (pixels in [0, 1], higher is closer)."
    )
    if has_float32_row:
        note += (
            f" '{FLOAT32_REFERENCE_LABEL}' is the same sdpa run in float32: its distance is "
            f"{dtype}'s own rounding (amplified over the steps by the random weights), so "
            "deviations of that size are rounding, not errors."
        )
    return note


def chart_name(label: str) -> str:
    """A table label on two short lines: "auto (steady state)" -> "auto\nsteady state"."""
    return label.replace(" (", "\n").replace(")", "").replace(", ", "\n")


def write_chart(rows: list[RunResult], psnrs: list[float], path: Path, title: str) -> None:
    """Seconds per step, peak memory and image PSNR vs sdpa: one bar per table row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [chart_name(r.label) for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(12, 3.8))
    ax1.bar(names, [r.seconds_per_step for r in rows], color="#4477aa")
    ax1.set_ylabel("seconds per denoising step")
    ax2.bar(names, [r.peak_memory_bytes / 2**20 for r in rows], color="#cc6677")
    ax2.set_ylabel("peak extra memory (MiB)")
    ax3.bar(names, [p if math.isfinite(p) else 0.0 for p in psnrs], color="#228833")
    for i, p in enumerate(psnrs):  # the reference itself (or an equal image) has no finite bar
        if not math.isfinite(p):
            ax3.text(i, 0, " = sdpa", ha="center", va="bottom", rotation=90, fontsize=8)
    ax3.set_ylabel("image PSNR vs sdpa (dB, higher = closer)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_image(pipe, image, path: Path) -> None:
    """Writes a decoded image (float, [0, 1]) as PNG."""
    processor = pipe.image_processor
    processor.numpy_to_pil(processor.pt_to_numpy(image))[0].save(path)


def report(rows, reference, auto_steady, cost, args, title) -> None:
    """Prints the table and auto's one-time cost; writes results.json and the chart."""
    measures = [accuracy(r, reference) for r in rows]
    print()
    print(TABLE_HEADER)
    print("|---|---|---|---|---|---|")
    for row, m in zip(rows, measures):
        print(table_line(row, m, row is reference))
    print()
    has_float32_row = rows[-1].label == FLOAT32_REFERENCE_LABEL
    print(accuracy_note(reference.dtype, has_float32_row))
    print(auto_cost_line(auto_steady, cost))

    records = [record(r, m) for r, m in zip(rows, measures)]
    for row, entry in zip(rows, records):
        if row is auto_steady:
            entry.update(auto_cost_fields(auto_steady, cost))
    (args.out / "results.json").write_text(json.dumps(records, indent=1), encoding="utf-8")
    psnrs = [m["image_psnr_db_vs_sdpa"] for m in measures]
    write_chart(rows, psnrs, args.out / "strategies.png", title)


# --------------------------------------------------------------------------- command line
@contextlib.contextmanager
def quiet_third_party_warnings():
    """Silences diffusers' and transformers' configuration chatter while the demo runs.

    Their warnings are about config files, dtype casts and optional packages ("The config
    attributes ... were passed to ..., but are not expected", "should be kept in float32",
    FutureWarnings), not about the user's run, and they bury the table. Their loggers keep
    errors; their FutureWarning and DeprecationWarning are ignored. npu_attn's logger and every
    other warning are untouched, and levels and filters are restored on exit, so a program that
    calls :func:`main` keeps its own settings. A library whose ``<NAME>_VERBOSITY`` is set is
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m npu_attn demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="sd15",
        choices=sorted(ARCHITECTURES),
        help="architecture built from config with random weights (default sd15; sdxl is SDXL "
        "base 1.0's UNet, VAE and scheduler, 1024px by default; sd3 is SD3 medium's transformer, "
        "VAE and scheduler, 512px by default; the tiny ones are for tests)",
    )
    parser.add_argument("--weights", type=Path, help="a local diffusers model folder instead")
    parser.add_argument("--prompt", help="prompt (with --weights; random embeddings otherwise)")
    parser.add_argument("--steps", type=int, default=3, help="denoising steps (default 3)")
    parser.add_argument("--size", type=int, help="image size in pixels (default: model's)")
    parser.add_argument(
        "--strategies",
        default="vanilla,sdpa,tiled",
        help="comma-separated strategies to compare (unavailable ones are skipped; sdpa, the "
        "accuracy reference, is always run)",
    )
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tome",
        type=float,
        metavar="RATIO",
        help="also run auto with Token Merging at this ratio (lossy; e.g. 0.5)",
    )
    parser.add_argument(
        "--deepcache",
        type=int,
        metavar="N",
        help="also run auto with DeepCache, a full UNet every N steps (lossy; e.g. 3)",
    )
    parser.add_argument(
        "--block-cache",
        type=float,
        metavar="THRESHOLD",
        help="also run auto with First Block Cache at this threshold on a transformer model "
        "(--model sd3; lossy; e.g. 0.1)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("npu_attn_out/demo"),
        help="output folder (default npu_attn_out/demo)",
    )
    parser.add_argument(
        "--parallel",
        choices=["cfg"],
        help="under torchrun: the guidance batch split across the processes (CFG-parallel), "
        "against one process; e.g. torchrun --nproc-per-node 2 -m npu_attn demo --parallel cfg",
    )
    return parser


def prepare_pipeline(args):
    """(pipeline, source description); sets args.size. ValueError or OSError for a --weights
    folder that cannot be loaded."""
    if args.weights is not None:
        pipe = load_pipeline(args.weights)
        latent_size = denoiser(pipe).config.sample_size or 64
        args.size = args.size or latent_size * pipe.vae_scale_factor
        return pipe, f"weights from {args.weights}"
    pipe = build_pipeline(args.model)
    args.size = args.size or ARCHITECTURES[args.model][1]
    return pipe, f"{args.model} architecture, RANDOM weights (the image is noise)"


def run_parallel(args) -> int:
    """``--parallel cfg`` (under torchrun): the denoising loop CFG-parallel over the processes,
    then the same generation in each process alone as the reference; rank 0 prints the table
    and saves the image. Every rank checks it returned the same latents."""
    import torch
    import torch.distributed as dist

    from . import _runtime
    from .device import DeviceManager
    from .parallel import (
        disable_cfg_parallel,
        enable_cfg_parallel,
        init_distributed,
        shutdown_distributed,
    )

    try:
        rank, world = init_distributed()
    except RuntimeError as e:  # not started by torchrun: say how
        print(f"error: {e}", file=sys.stderr)
        return 2
    say = print if rank == 0 else (lambda *_: None)
    try:
        dm = DeviceManager()
        pipe, source = prepare_pipeline(args)
        pipe = pipe.to(dm.device, dm.dtype)
        embeds = prompt_embeddings(pipe, dm.dtype, dm.device, args.prompt)
        strategy = "tiled" if dm.device.type == "cpu" else "auto"
        threads = _runtime.get_num_threads()
        say(
            f"npu_attn demo: CFG-parallel over {world} processes x {threads} threads; {source}; "
            f"{args.size}x{args.size}, {args.steps} steps, {str(dm.dtype)[6:]}, strategy {strategy}"
        )
        enable_cfg_parallel(pipe)
        split = denoise(pipe, strategy, args, embeds, dm, f"CFG-parallel, {world} processes")
        gathered = [torch.empty_like(split.latents) for _ in range(world)]
        dist.all_gather(gathered, split.latents)
        same = all(torch.equal(g, split.latents) for g in gathered)
        disable_cfg_parallel(pipe)
        alone = denoise(pipe, strategy, args, embeds, dm, "one process alone (reference)")
        say("\n| run | s / step | latents rel. error vs one process |\n|---|---|---|")
        say(
            f"| {split.label} | {split.seconds_per_step:.2f} | "
            f"{relative_error(split.latents, alone.latents):.1e} |"
        )
        say(f"| {alone.label} | {alone.seconds_per_step:.2f} | reference |")
        say(
            "(each process has the same threads in both rows; `python -m npu_attn bench "
            "--parallel` compares 1 process x N threads with N processes x 1 thread)"
        )
        if not same:
            print(f"rank {rank}: the ranks returned DIFFERENT latents", file=sys.stderr)
            return 1
        say("every rank returned the same latents")
        if rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            save_image(pipe, decode(pipe, split.latents), args.out / "image.png")
            say(f"wrote {args.out / 'image.png'}")
        return 0
    finally:
        shutdown_distributed()


def run(args) -> int:
    """The demo itself (see the module docstring); 0 on success, 2 for an unusable --weights."""
    import torch

    from . import _runtime, strategies
    from .device import DeviceManager

    if args.threads:
        torch.set_num_threads(args.threads)
        _runtime.set_num_threads(args.threads)
    if args.parallel:
        return run_parallel(args)
    dm = DeviceManager()
    try:
        pipe, source = prepare_pipeline(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pipe = pipe.to(dm.device, dm.dtype)
    problem = check_accelerations(pipe, args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    embeds = prompt_embeddings(pipe, dm.dtype, dm.device, args.prompt)
    threads = _runtime.get_num_threads()
    dtype = str(dm.dtype).replace("torch.", "")
    print(
        f"npu_attn demo: {source}; {args.size}x{args.size}, {args.steps} steps, batch 2 (CFG); "
        f"device {dm.device}, dtype {dtype}, {threads} threads, "
        f"kernel {_runtime.active_isa(dtype)}"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    auto, cost = run_auto(pipe, args, embeds, dm)
    image_path = args.out / "image.png"
    save_image(pipe, auto.image, image_path)
    chosen = sorted(set(strategies.auto_selector.choices().values()))
    print(f"auto chose: {', '.join(chosen) or '(cached choices)'}")

    names = strategies_to_compare(args.strategies, dm.device)
    results = [run_strategy(pipe, name, args, embeds, dm) for name in names]
    reference = next(r for r in results if r.strategy == "sdpa")
    rows = results + [auto]
    if requested_accelerations(args):
        rows.append(run_accelerated(pipe, args, embeds, dm))
    if dm.dtype in (torch.float16, torch.bfloat16):
        rows.append(float32_reference(pipe, args, embeds, dm))
    title = f"{source.split(',')[0]} {args.size}px, {dtype}, {args.steps} steps, {threads} threads"
    report(rows, reference, auto, cost, args, title)
    print(f"\nwrote {image_path}, {args.out / 'strategies.png'} and {args.out / 'results.json'}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("npu_attn").setLevel(logging.INFO)
    with quiet_third_party_warnings():
        return run(args)
