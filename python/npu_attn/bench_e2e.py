"""``python -m npu_attn bench --e2e``: seconds per denoising step of a full-size UNet.

Attention is only part of a CPU denoising step, so this section measures what users feel: one
UNet call of the full Stable Diffusion 1.5 architecture (random weights, nothing downloaded) at
512x512 with classifier-free guidance (batch 2), for

- ``eager sdpa``: the diffusers default (torch's SDPA, original processors), the baseline;
- ``eager tiled``: npu_attn's kernel, eager;
- ``compiled sdpa`` / ``compiled tiled``: ``torch.compile`` (inductor) of the same UNet with
  that strategy compiled in;
- ``openvino``: the same UNet converted with ``openvino.convert_model`` and compiled for the
  CPU with the run's precision as its inference-precision hint (when ``openvino`` is installed:
  ``pip install "npu_attn[bench]"`` or ``pip install openvino==2026.4.1``), the runtime CPU
  users of diffusion often pick instead.

Every competitor runs in this process on the same inputs with the same thread count,
interleaved (round-robin) after a warm-up; compile and conversion times are reported
separately; the table gives medians and ratios to the baseline and names the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

BASELINE = "eager sdpa"


def build_unet(model: str = "sd15"):
    """The full-size UNet of ``model`` (demo.MODELS) with random weights, in float32."""
    import torch
    from diffusers import UNet2DConditionModel

    from .demo import MODELS

    torch.manual_seed(0)
    return UNet2DConditionModel(**MODELS[model][0]).eval()


def make_inputs(unet, size: int, dtype) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    latent = size // 8
    return {
        "sample": torch.randn(2, unet.config.in_channels, latent, latent, generator=g).to(dtype),
        "timestep": torch.tensor(500),
        "encoder_hidden_states": torch.randn(
            2, 77, unet.config.cross_attention_dim, generator=g
        ).to(dtype),
    }


def openvino_runner(unet, inputs: dict, dtype, threads: int) -> tuple[Callable, float]:
    """(one inference, seconds to convert and compile) of ``unet`` (float32, original
    processors) in OpenVINO with ``dtype`` as its inference precision."""
    import openvino as ov
    import torch

    class Positional(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, sample, timestep, encoder_hidden_states):
            return self.inner(sample, timestep, encoder_hidden_states, return_dict=False)[0]

    start = time.perf_counter()
    example = tuple(
        v.float() if torch.is_floating_point(v) else v
        for v in (inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"])
    )
    with torch.no_grad():
        model = ov.convert_model(Positional(unet), example_input=example)
    hint = "bf16" if dtype == torch.bfloat16 else "f32"
    compiled = ov.Core().compile_model(
        model,
        "CPU",
        {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": str(threads)},
    )
    request = compiled.create_infer_request()
    arrays = [t.numpy() for t in example]
    seconds = time.perf_counter() - start
    return (lambda: request.infer(arrays)), seconds


def torch_runner(unet, inputs: dict, strategy: str, compiled: bool, compiled_unet):
    """One UNet call with ``strategy`` (``sdpa`` = diffusers' own processors)."""
    import torch

    import npu_attn

    def run():
        if strategy == "sdpa":
            npu_attn.reset_attention_strategy(unet)
        else:
            npu_attn.set_attention_strategy(unet, strategy)
        with torch.no_grad():
            (compiled_unet if compiled else unet)(**inputs)

    return run


def run(args) -> dict:
    import torch
    from tqdm import tqdm

    from . import _runtime
    from .bench_report import machine_info

    dtype = getattr(torch, args.dtype)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    _runtime.set_num_threads(threads)
    unet = build_unet(args.model)
    inputs = make_inputs(unet, args.size, dtype)
    runners: dict[str, Callable] = {}
    setup_seconds: dict[str, float] = {}
    if not args.no_openvino:
        try:
            runners["openvino"], setup_seconds["openvino"] = openvino_runner(
                unet, inputs, dtype, threads
            )
        except ImportError:
            print(
                'openvino is not installed (pip install "openvino==2026.4.1"): skipped',
                file=sys.stderr,
            )
    unet = unet.to(dtype)
    compiled_unet = torch.compile(unet, mode=args.mode)
    for strategy in ("sdpa", "tiled"):
        runners[f"eager {strategy}"] = torch_runner(unet, inputs, strategy, False, None)
        runners[f"compiled {strategy}"] = torch_runner(unet, inputs, strategy, True, compiled_unet)
    order = [BASELINE, "eager tiled", "compiled sdpa", "compiled tiled", "openvino"]
    names = [n for n in order if n in runners]
    for name in tqdm(names, desc="warm-up (compiles)", unit="competitor"):
        start = time.perf_counter()
        runners[name]()
        if name.startswith("compiled"):  # the first call compiles
            setup_seconds[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in tqdm(range(args.repeats), desc="interleaved rounds", unit="round"):
        for name in names:
            start = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - start)
    medians = {n: statistics.median(t) for n, t in times.items()}
    return {
        "machine": machine_info(threads),
        "model": args.model,
        "size": args.size,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "seconds_per_step": medians,
        "all_seconds": times,
        "setup_seconds": setup_seconds,
        "speedup_vs_baseline": {n: medians[BASELINE] / m for n, m in medians.items()},
    }


# --------------------------------------------------------------------------- whole images
# (label, attention strategy, Token Merging ratio, DeepCache interval); the first is the baseline.
IMAGE_CONFIGS = (
    ("sdpa (diffusers default)", "sdpa", None, None),
    ("tiled", "tiled", None, None),
    ("ToMe 0.5", "sdpa", 0.5, None),
    ("DeepCache 3", "sdpa", None, 3),
    ("ToMe 0.5 + DeepCache 3", "sdpa", 0.5, 3),
    ("ToMe 0.5 + DeepCache 3 + tiled", "tiled", 0.5, 3),
)


def run_images(args) -> dict:
    """Seconds per image (``--images N`` denoising steps + VAE decode) of a full-size SD-1.5
    pipeline under each configuration, interleaved, and each image's distance from the exact
    baseline image (PSNR, pixels in [0, 1]; lossy methods deviate, exact ones do not)."""
    import torch
    from tqdm import tqdm

    from . import _runtime
    from .acceleration import accelerate, reset_acceleration
    from .bench_report import machine_info
    from .demo import MODELS, build_pipeline, psnr_db
    from .diffusers_integration import reset_attention_strategy, set_attention_strategy

    dtype = getattr(torch, args.dtype)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    _runtime.set_num_threads(threads)
    pipe = build_pipeline(args.model).to(dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1234)
    cross = MODELS[args.model][2]
    embeds = [torch.randn(1, 77, cross, generator=g).to(dtype) for _ in range(2)]

    def image(config):
        _, strategy, tome, deep_cache = config
        reset_acceleration(pipe)
        if strategy == "sdpa":
            reset_attention_strategy(pipe)
        else:
            set_attention_strategy(pipe, strategy)
        if tome is not None or deep_cache is not None:
            accelerate(pipe, token_merging=tome, deep_cache=deep_cache)
        start = time.perf_counter()
        with torch.no_grad():
            out = pipe(
                prompt_embeds=embeds[0],
                negative_prompt_embeds=embeds[1],
                num_inference_steps=args.images,
                height=args.size,
                width=args.size,
                output_type="pt",
                generator=torch.Generator().manual_seed(0),
            ).images
        return time.perf_counter() - start, out.float()

    times = {c[0]: [] for c in IMAGE_CONFIGS}
    images = {}
    for _ in tqdm(range(args.repeats), desc="interleaved rounds", unit="round"):
        for config in IMAGE_CONFIGS:
            seconds, out = image(config)
            times[config[0]].append(seconds)
            images.setdefault(config[0], out)
    reset_acceleration(pipe)
    reset_attention_strategy(pipe)
    baseline = IMAGE_CONFIGS[0][0]
    medians = {n: statistics.median(t) for n, t in times.items()}
    return {
        "machine": machine_info(threads),
        "model": args.model,
        "size": args.size,
        "dtype": args.dtype,
        "steps": args.images,
        "repeats": args.repeats,
        "seconds_per_image": medians,
        "all_seconds": times,
        "speedup_vs_baseline": {n: medians[baseline] / m for n, m in medians.items()},
        "psnr_db_vs_baseline": {
            n: (None if n == baseline else psnr_db(images[n], images[baseline])) for n in images
        },
    }


def images_markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['threads']} threads; torch {m['torch']}; {m['date']}. "
        f"{report['model']} pipeline (random weights), {report['size']}x{report['size']}, "
        f"{report['steps']} steps + VAE decode, CFG, {report['dtype']}; medians of "
        f"{report['repeats']} interleaved rounds.",
        "",
        "| configuration | s / image | vs diffusers default | image PSNR vs default |",
        "|---|---|---|---|",
    ]
    for name, seconds in report["seconds_per_image"].items():
        psnr = report["psnr_db_vs_baseline"][name]
        psnr_text = (
            "reference"
            if psnr is None
            else ("identical" if psnr == float("inf") else f"{psnr:.1f} dB")
        )
        lines.append(
            f"| {name} | {seconds:.1f} | {report['speedup_vs_baseline'][name]:.2f}x | {psnr_text} |"
        )
    return "\n".join(lines)


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['threads']} threads; torch {m['torch']}; {m['date']}. "
        f"{report['model']} UNet, {report['size']}x{report['size']}, batch 2 (CFG), "
        f"{report['dtype']}; medians of {report['repeats']} interleaved rounds.",
        "",
        "| competitor | s / step | vs eager sdpa (diffusers default) | compile / convert s |",
        "|---|---|---|---|",
    ]
    for name, seconds in report["seconds_per_step"].items():
        setup = report["setup_seconds"].get(name)
        lines.append(
            f"| {name} | {seconds:.2f} | {report['speedup_vs_baseline'][name]:.2f}x | "
            f"{'-' if setup is None else f'{setup:.0f}'} |"
        )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["seconds_per_step"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(names, [report["seconds_per_step"][n] for n in names], color="#4477aa")
    ax.set_ylabel("seconds per UNet step")
    ax.set_title(
        f"{report['model']} UNet {report['size']}px CFG, {report['dtype']}, "
        f"{report['machine']['threads']} threads",
        fontsize=9,
    )
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m npu_attn bench --e2e",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="sd15", choices=("sd15", "sd21", "tiny"))
    parser.add_argument("--size", type=int, default=512, help="image size in pixels")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--threads", type=int, help="threads for every competitor")
    parser.add_argument("--mode", help="torch.compile mode (default: inductor's default)")
    parser.add_argument("--no-openvino", action="store_true", help="skip OpenVINO")
    parser.add_argument(
        "--images",
        type=int,
        metavar="STEPS",
        help="instead: seconds per whole image (STEPS steps + decode) of the pipeline with "
        "Token Merging and DeepCache (lossy) and tiled, against the diffusers default",
    )
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG bar chart here")
    args = parser.parse_args(argv)
    if args.images:
        report = run_images(args)
        print(images_markdown(report))
        if args.json:
            args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")
        return 0
    report = run(args)
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")
    if args.plot:
        plot(report, args.plot)
    return 0
