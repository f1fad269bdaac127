"""``python -m npu_attn demo``: a real diffusers pipeline, every attention strategy, one table.

By default it builds the full Stable Diffusion 1.5 architecture (UNet, VAE) from its
configuration with RANDOM WEIGHTS (nothing is downloaded, so the image is noise; the point is
the attention work, which is the same as with trained weights), picks the device and dtype with
:class:`~npu_attn.DeviceManager`, switches the pipeline to ``set_attention_strategy(pipe,
"auto")`` and denoises with a progress bar. It then repeats the same denoising under each
available strategy and prints seconds per step, peak memory and the largest difference of the
final latents from the ``sdpa`` run, and writes the image and a PNG chart to the output folder.

``--weights DIR`` uses a real local diffusers model folder instead (with ``--prompt``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
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


@dataclass
class RunResult:
    strategy: str
    seconds_per_step: float
    peak_memory_bytes: int
    latents: Any
    attention_share: Optional[float] = None


def build_pipeline(model: str = "sd15"):
    """A StableDiffusionPipeline with the named architecture and random weights (no download).
    The text encoder is omitted: prompts are given as embeddings."""
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )

    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    overrides, _, _, vae_channels = MODELS[model]
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**overrides)
    n = len(vae_channels)
    vae = AutoencoderKL(
        block_out_channels=vae_channels,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        latent_channels=4,
        layers_per_block=2 if model != "tiny" else 1,
        norm_num_groups=32 if model != "tiny" else 8,
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
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


def prompt_embeddings(pipe, cross_dim: int, dtype, device, prompt: Optional[str]):
    import torch

    if prompt is not None and getattr(pipe, "text_encoder", None) is not None:
        embeds, negative = pipe.encode_prompt(prompt, device, 1, True, "")
        return embeds, negative
    g = torch.Generator().manual_seed(1234)
    embeds = torch.randn(1, 77, cross_dim, generator=g).to(device, dtype)
    negative = torch.randn(1, 77, cross_dim, generator=g).to(device, dtype)
    return embeds, negative


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


def denoise(pipe, strategy: str, args, embeds, dm, show_progress: bool) -> RunResult:
    import torch

    from ._memory import measure_peak
    from .diffusers_integration import set_attention_strategy

    pipe.set_progress_bar_config(disable=not show_progress, desc=f"{strategy:>7} denoising")
    # Processors look their runner up when created, so the timer goes in before switching.
    spent, restore = _time_runner(strategy)
    set_attention_strategy(pipe, strategy)
    try:
        with measure_peak() as memory, torch.no_grad():
            start = time.perf_counter()
            latents = pipe(
                prompt_embeds=embeds[0],
                negative_prompt_embeds=embeds[1],
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
    return RunResult(
        strategy, elapsed / args.steps, memory.extra_bytes, latents.float().cpu(), share
    )


def write_chart(results: list[RunResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.strategy for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    ax1.bar(names, [r.seconds_per_step for r in results], color="#4477aa")
    ax1.set_ylabel("seconds per denoising step")
    ax2.bar(names, [r.peak_memory_bytes / 2**20 for r in results], color="#cc6677")
    ax2.set_ylabel("peak extra memory (MiB)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m npu_attn demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="sd15",
        choices=sorted(MODELS),
        help="architecture built from config with random weights (default sd15)",
    )
    parser.add_argument("--weights", type=Path, help="a local diffusers model folder instead")
    parser.add_argument("--prompt", help="prompt (with --weights; random embeddings otherwise)")
    parser.add_argument("--steps", type=int, default=3, help="denoising steps (default 3)")
    parser.add_argument("--size", type=int, help="image size in pixels (default: model's)")
    parser.add_argument(
        "--strategies",
        default="vanilla,sdpa,tiled",
        help="comma-separated strategies to compare (unavailable ones are skipped)",
    )
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("npu_attn_out/demo"),
        help="output folder (default npu_attn_out/demo)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("npu_attn").setLevel(logging.INFO)

    import torch

    from . import _runtime, strategies
    from .device import DeviceManager

    if args.threads:
        torch.set_num_threads(args.threads)
        _runtime.set_num_threads(args.threads)
    dm = DeviceManager()
    if args.weights is not None:
        try:
            pipe = load_pipeline(args.weights)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        cross_dim = pipe.unet.config.cross_attention_dim
        latent_size = pipe.unet.config.sample_size or 64
        args.size = args.size or latent_size * pipe.vae_scale_factor
        source = f"weights from {args.weights}"
    else:
        pipe = build_pipeline(args.model)
        _, default_size, cross_dim, _ = MODELS[args.model]
        args.size = args.size or default_size
        source = f"{args.model} architecture, RANDOM weights (the image is noise)"
    pipe = pipe.to(dm.device, dm.dtype)
    embeds = prompt_embeddings(pipe, cross_dim, dm.dtype, dm.device, args.prompt)
    threads = _runtime.get_num_threads()
    print(
        f"npu_attn demo: {source}; {args.size}x{args.size}, {args.steps} steps, batch 2 (CFG); "
        f"device {dm.device}, dtype {str(dm.dtype).replace('torch.', '')}, {threads} threads, "
        f"kernel {_runtime.active_isa()}"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    auto = denoise(pipe, "auto", args, embeds, dm, show_progress=True)
    image = pipe.vae.decode(
        auto.latents.to(dm.device, dm.dtype) / pipe.vae.config.scaling_factor
    ).sample
    pil = pipe.image_processor.postprocess(image.detach(), output_type="pil")[0]
    image_path = args.out / "image.png"
    pil.save(image_path)
    chosen = sorted(set(strategies.auto_selector.choices().values()))
    print(f"auto chose: {', '.join(chosen) or '(cached choices)'}")

    wanted = [s.strip() for s in args.strategies.split(",") if s.strip()]
    results = []
    for name in wanted:
        reason = strategies.unavailable_reason(name, dm.device)
        if reason is not None:
            print(f"skipping {name}: {reason}")
            continue
        results.append(denoise(pipe, name, args, embeds, dm, show_progress=True))
    reference = next((r for r in results if r.strategy == "sdpa"), None)
    print()
    print("| strategy | s / step | attention share | peak extra memory | max |latents - sdpa| |")
    print("|---|---|---|---|---|")
    table = []
    for r in results + [auto]:
        diff = float((r.latents - reference.latents).abs().max()) if reference else float("nan")
        share = f"{100 * r.attention_share:.0f}%" if r.attention_share is not None else "-"
        print(
            f"| {r.strategy} | {r.seconds_per_step:.2f} | {share} | "
            f"{r.peak_memory_bytes / 2**20:,.0f} MiB | {diff:.2e} |"
        )
        table.append(
            {
                "strategy": r.strategy,
                "seconds_per_step": r.seconds_per_step,
                "attention_share": r.attention_share,
                "peak_memory_bytes": r.peak_memory_bytes,
                "max_diff_vs_sdpa": diff,
            }
        )
    chart_path = args.out / "strategies.png"
    write_chart(
        results + [auto],
        chart_path,
        f"{source.split(',')[0]} {args.size}px, {args.steps} steps, {threads} threads",
    )
    (args.out / "results.json").write_text(json.dumps(table, indent=1), encoding="utf-8")
    print(f"\nwrote {image_path}, {chart_path} and {args.out / 'results.json'}")
    return 0
