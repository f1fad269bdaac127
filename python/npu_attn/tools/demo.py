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

``--model`` picks another architecture (SD-2.1, SDXL, SD3 medium, Flux and HiDream-I1 at full
width but reduced depth: ARCHITECTURES), ``--weights DIR`` a real local diffusers model folder
(with ``--prompt``). ``--tome``, ``--deepcache`` (UNet pipelines) and ``--block-cache`` (SD3,
Flux, HiDream) add one lossy row: ``auto`` with those step accelerations
(:func:`~npu_attn.accelerate`), checked against the model before anything runs.
While the demo runs, diffusers' and transformers' configuration and deprecation warnings are
silenced (set DIFFUSERS_VERBOSITY or TRANSFORMERS_VERBOSITY to see them); npu_attn's own log
lines and errors are shown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .arguments import at_least, on_requested_threads
from .pipelines import (
    ARCHITECTURES,
    FAMILIES,
    architecture_summary,
    build_pipeline,
    denoiser,
    fit_size,
    load_pipeline,
    pipeline_family,
    prompt_embeddings,
    psnr_db,
    quiet_third_party_warnings,
    relative_error,
    size_problem,
    vae_scale_factor,
)

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


def time_attention(strategy: str):
    """Replaces the strategy's runner by a timed one; returns ([seconds, calls] inside it,
    restore). npu_attn's processors and dispatcher backend look the runner up on every call,
    so they run the timer while it is in place, and never after ``restore()``."""
    from ..attention import strategies

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

    from ..integration.processors import set_attention_strategy
    from ..runtime.memory import measure_peak

    label = label or strategy
    pipe.set_progress_bar_config(desc=f"{label:>7} denoising")
    fit_size(pipe, args.size)
    spent, restore = time_attention(strategy)
    try:
        set_attention_strategy(pipe, strategy)
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
    if latents.ndim == 3:  # Flux returns them packed in 2x2 patches; the demo's are square
        side = math.isqrt(latents.shape[1]) * 2 * pipe.vae_scale_factor
        latents = pipe._unpack_latents(latents, side, side, pipe.vae_scale_factor)
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
    from ..attention import strategies

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
    from ..accel.registry import check_acceleration

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
    from ..accel.block_cache import block_cache_of
    from ..accel.registry import accelerate, reset_acceleration

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
    if state["implementation"] == "diffusers":  # Flux...: diffusers' hooks keep no counts
        return (
            f"First Block Cache (threshold {state['threshold']}): diffusers' FirstBlockCache "
            "hooks on this transformer (they do not count the skipped calls)"
        )
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


def requested_strategies(text: str) -> list[str]:
    """The names in a comma-separated --strategies value."""
    return [name.strip() for name in text.split(",") if name.strip()]


def strategies_to_compare(requested: str, device) -> list[str]:
    """The requested strategies that can run on `device`, always with ``sdpa``: it is the
    reference the accuracy columns compare with."""
    from ..attention import strategies

    names = []
    for name in requested_strategies(requested):
        if name in names:
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
        "VAE and scheduler, 512px by default; flux and hidream are FLUX.1-dev's and HiDream-I1's "
        "transformers at full width with 2 + 4 blocks; the tiny ones are for tests)",
    )
    parser.add_argument("--weights", type=Path, help="a local diffusers model folder instead")
    parser.add_argument("--prompt", help="prompt (with --weights; random embeddings otherwise)")
    parser.add_argument("--steps", type=at_least(1), default=3, help="denoising steps (default 3)")
    parser.add_argument("--size", type=int, help="image size in pixels (default: model's)")
    parser.add_argument(
        "--strategies",
        default="vanilla,sdpa,tiled",
        help="comma-separated strategies to compare (unavailable ones are skipped; sdpa, the "
        "accuracy reference, is always run)",
    )
    parser.add_argument("--threads", type=at_least(1), help="CPU threads (default: torch's)")
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
        "(--model sd3, flux or hidream; lossy; e.g. 0.1)",
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


def prepare_pipeline(args, dtype=None):
    """(pipeline, source description); sets args.size. A --weights folder is loaded in `dtype`
    (when given); ValueError or OSError if it cannot be loaded."""
    if args.weights is not None:
        pipe = load_pipeline(args.weights, torch_dtype=dtype)
        config = denoiser(pipe).config
        latent_size = config.sample_size or 64
        args.size = args.size or latent_size * pipe.vae_scale_factor
        problem = size_problem(pipeline_family(pipe), config, pipe.vae_scale_factor, args.size)
        if problem is not None:
            raise ValueError(f"--size: {problem}")
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

    from ..device import DeviceManager
    from ..parallel import disable_cfg_parallel, distributed_group, enable_cfg_parallel
    from ..runtime import controls as _runtime

    with contextlib.ExitStack() as group:
        try:
            rank, world = group.enter_context(distributed_group())
        except RuntimeError as e:  # not started by torchrun: say how
            print(f"error: {e}", file=sys.stderr)
            return 2
        say = print if rank == 0 else (lambda *_: None)
        dm = DeviceManager()
        pipe, source = prepare_pipeline(args, dm.dtype)
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


@on_requested_threads
def run(args) -> int:
    """The demo itself (see the module docstring); 0 on success, 2 for an unusable --weights."""
    import torch

    from ..attention import strategies
    from ..device import DeviceManager
    from ..runtime import controls as _runtime

    if args.parallel:
        return run_parallel(args)
    dm = DeviceManager()
    try:
        pipe, source = prepare_pipeline(args, dm.dtype)
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
    # Flux's guidance is distilled into the model: one batch, no classifier-free pair.
    batch = "batch 1 (distilled guidance)" if pipeline_family(pipe) == "flux" else "batch 2 (CFG)"
    print(
        f"npu_attn demo: {source}; {args.size}x{args.size}, {args.steps} steps, {batch}; "
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


def check_arguments(parser: argparse.ArgumentParser, args) -> None:
    """Refuse, as usage errors, what would otherwise fail (or be skipped) after the models are
    built: unknown strategy names, and an image size the architecture cannot take (a
    --weights folder's size is checked once it is loaded: prepare_pipeline)."""
    from ..attention import strategies

    requested = requested_strategies(args.strategies)
    unknown = [name for name in requested if name not in strategies.STRATEGIES]
    if unknown:
        parser.error(
            f"--strategies: unknown {', '.join(map(repr, unknown))}; "
            f"choose from {', '.join(strategies.STRATEGIES)}"
        )
    if args.size is not None and args.weights is None:
        config = architecture_summary(args.model)[1]
        family, scale = FAMILIES[args.model], vae_scale_factor(args.model)
        problem = size_problem(family, config, scale, args.size)
        if problem is not None:
            parser.error(f"--size: {problem}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("npu_attn").setLevel(logging.INFO)
    with quiet_third_party_warnings():
        return run(args)
