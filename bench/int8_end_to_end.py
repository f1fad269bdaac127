"""int8 attention end to end: what the lossy ``int8`` strategy changes in a whole generation,
next to what bfloat16 alone changes, on full-size architectures with random weights.

For each model: one float32 run with the exact ``tiled`` kernel (the reference), one float32
run with ``int8``, and one bfloat16 run with ``tiled`` (where the CPU has bfloat16 units, as
torch's oneDNN reports them, or with ``--bfloat16 on``: without them torch emulates bfloat16
arithmetic, slowly); the same seed, prompt embeddings and steps.
Reported: the relative L2 error of the final latents against the reference and the decoded
image's PSNR (pixels in [0, 1]). Random weights say little about perceived image
quality: this measures distance, not quality.

    python bench/int8_end_to_end.py --models sd15,sdxl,sd3,flux --steps 4 --size 512

Each model runs 3 generations in this process (minutes per full-size model on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm

import npu_attn
from npu_attn.tools.bench_report import machine_info
from npu_attn.tools.pipelines import build_pipeline, fit_size, prompt_embeddings, psnr_db

RUNS = (("float32", "tiled"), ("float32", "int8"), ("bfloat16", "tiled"))


def runs_for(bfloat16: str) -> tuple:
    """RUNS, without the bfloat16 one when ``bfloat16`` is "off", or "auto" on a CPU without
    bfloat16 units."""
    has_units = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if bfloat16 == "on" or (bfloat16 == "auto" and has_units):
        return RUNS
    return tuple(run for run in RUNS if run[0] != "bfloat16")


def generate(pipe, embeds: dict, steps: int, size: int, strategy: str):
    """(final latents float32, image float32 in [0, 1]) of one seeded generation; the latents
    are the last step's (callback_on_step_end), before the VAE decodes them."""
    npu_attn.set_attention_strategy(pipe, strategy)
    fit_size(pipe, size)
    last = {}

    def keep_latents(pipeline, step, timestep, callback_kwargs):
        last["latents"] = callback_kwargs["latents"].float().clone()
        return callback_kwargs

    with torch.no_grad():
        image = pipe(
            **embeds,
            num_inference_steps=steps,
            height=size,
            width=size,
            output_type="pt",
            generator=torch.Generator().manual_seed(0),
            callback_on_step_end=keep_latents,
        ).images
    return last["latents"], image.float()


def measure(model: str, steps: int, size: int, runs=RUNS) -> dict:
    results = {}
    reference = None
    for dtype_name, strategy in runs:
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)  # the same random weights for every run
        pipe = build_pipeline(model).to(dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        embeds = prompt_embeddings(pipe, torch.float32, "cpu")  # the same numbers for every run
        embeds = {k: (v.to(dtype) if torch.is_tensor(v) else v) for k, v in embeds.items()}
        start = time.perf_counter()
        latents, image = generate(pipe, embeds, steps, size, strategy)
        seconds = time.perf_counter() - start
        label = f"{dtype_name} {strategy}"
        if reference is None:
            reference = (latents, image)
            results[label] = {"reference": True, "seconds": seconds}
        else:
            err = float((latents - reference[0]).norm() / reference[0].norm())
            results[label] = {
                "latents_relative_l2": err,
                "image_psnr_db": psnr_db(image, reference[1]),
                "seconds": seconds,
            }
        del pipe
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sd15,sdxl,sd3,flux")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument(
        "--bfloat16",
        choices=("auto", "on", "off"),
        default="auto",
        help="the bfloat16 run: auto = where the CPU has bfloat16 units",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    runs = runs_for(args.bfloat16)
    report = {"machine": machine_info(torch.get_num_threads()), "steps": args.steps}
    report["size"], report["models"] = args.size, {}
    for model in tqdm(args.models.split(","), desc="models"):
        report["models"][model] = measure(model, args.steps, args.size, runs)
        print(model, json.dumps(report["models"][model]), flush=True)  # as each model finishes
    print("\n".join(markdown_lines(report, [f"{d} {s}" for d, s in runs[1:]])))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


def markdown_lines(report: dict, labels: list) -> list:
    """The report's table: each non-reference run's latents error and image PSNR per model."""
    m = report["machine"]
    lines = [
        f"{m['cpu']}, {m['threads']} threads; {report['steps']} steps at "
        f"{report['size']}x{report['size']}, random weights; against float32 `tiled` (exact).",
        "",
        "| model | " + " | ".join(f"{n}: latents rel. L2 | {n}: image PSNR" for n in labels) + " |",
        "|---|" + "---|---|" * len(labels),
    ]
    for model, r in report["models"].items():
        cells = [
            f"{r[n]['latents_relative_l2']:.1e} | {r[n]['image_psnr_db']:.1f} dB" for n in labels
        ]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()
