"""``python -m npu_attn ui``: a web page (Gradio) to generate images with every model family
npu_attn runs, and to compare configurations.

The page offers the built-in architectures with random weights (the images are noise: the
point is the speed and the attention work, which are the same as with trained weights) or,
with ``--allow-local-models``, a local diffusers folder; the dtype (the DeviceManager's
recommendation preselected), the attention strategy, the accelerations the model's family
takes, steps, size, seed and number of images. Images appear as they finish, with a progress
bar per step, the seconds per step and the attention share; a device panel shows the device,
the memory in use (refreshed every few seconds) and the kernel variant per dtype. The
"Compare" tab runs the whole-image benchmark (``bench --e2e --images``) on the chosen
configurations. The engine is :mod:`.studio`; this module is the page.

Safe by default: it listens on 127.0.0.1 only; another ``--host`` is warned about, local
folders need ``--allow-local-models``, and models are never loaded with ``trust_remote_code``.
One generation runs at a time; at most 8 more wait (QUEUE_SIZE).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from .pipelines import ARCHITECTURES, FAMILIES
from .studio import (
    ACCELERATIONS,
    LOCAL_MODEL,
    MAX_IMAGES,
    MAX_STEPS,
    GeneratedImage,
    InputError,
    Request,
    Studio,
    applicable_accelerations,
    device_report,
    model_label,
)

GRADIO_PIN = "gradio==6.31.0"
INSTALL_HINT = f"pip install 'npu_attn[ui]'  (or: pip install '{GRADIO_PIN}')"
QUEUE_SIZE = 8
DEVICE_REFRESH_SECONDS = 2.0
# Every generating event shares this concurrency group: one at a time, whatever the tab.
GENERATION = "generation"
TITLE = "npu_attn: diffusion on CPUs and Ascend NPUs"


# --------------------------------------------------------------------------- page text
def model_choices(dtype: str) -> list[tuple[str, str]]:
    """The model menu: (label with parameters and memory, name), then the local folder."""
    return [(model_label(m, dtype), m) for m in ARCHITECTURES] + [
        ("local diffusers folder (needs --allow-local-models)", LOCAL_MODEL)
    ]


def compare_labels(model: str, device=None) -> list[str]:
    """The benchmark configurations of the model's family (bench_e2e.image_configs) whose
    attention strategy runs on ``device`` (None: the CPU)."""
    from ..attention.strategies import unavailable_reason
    from .bench_e2e import image_configs

    family = FAMILIES.get(model, "sd")
    configs = image_configs(family, graph=False)
    return [label for label, strategy, _ in configs if unavailable_reason(strategy, device) is None]


def timing_markdown(images: list[GeneratedImage], total: int) -> str:
    """The lines under the gallery: seconds per step and attention share, per image."""
    lines = []
    for image in images:
        share = (
            f"not timed ({image.untimed_because})"
            if image.attention_share is None
            else f"{100 * image.attention_share:.0f}% of the step"
        )
        cancelled = f", cancelled after step {image.steps_done}" if image.cancelled else ""
        lines.append(
            f"- image {image.index + 1} of {total}: **{image.seconds_per_step:.3f} s / step**, "
            f"attention {share}{cancelled}"
        )
    return "\n".join(lines)


def device_markdown(studio: Studio) -> str:
    rows = "\n".join(
        f"| {name} | {value} |" for name, value in device_report(studio.dm, studio.working_dtypes)
    )
    return "| what | now |\n|---|---|\n" + rows


def compare_table(report: dict[str, Any]) -> list[list[Any]]:
    """The compare tab's table: one row per configuration."""
    names = list(report["seconds_per_step"])
    base = report["seconds_per_step"][names[0]]
    rows = []
    for name in names:
        psnr = report["psnr_db_vs_baseline"][name]
        psnr_text = (
            "reference"
            if psnr is None
            else ("identical" if psnr == float("inf") else f"{psnr:.1f} dB")
        )
        step = report["seconds_per_step"][name]
        rows.append(
            [
                name,
                round(step, 4),
                round(report["seconds_per_image"][name], 3),
                f"{base / step:.2f}x",
                psnr_text,
            ]
        )
    return rows


COMPARE_HEADERS = [
    "configuration",
    "s / step",
    "s / image",
    "speed-up vs diffusers default",
    "PSNR vs exact run",
]


def compare_chart(report: dict[str, Any]) -> str:
    """The compare tab's chart (bench_e2e's bar chart of seconds per step), as a PNG path."""
    from .bench_e2e import bar_chart

    seconds = report["seconds_per_step"]
    base = next(iter(seconds.values()))
    speedups = {name: base / s for name, s in seconds.items()}
    path = Path(tempfile.mkdtemp(prefix="npu_attn_ui_")) / "compare.png"
    title = (
        f"{report['model']} {report['size']}px, {report['steps']} steps; "
        "x = speed-up vs the diffusers default"
    )
    return str(bar_chart(seconds, speedups, "seconds per denoising step", title, path))


# --------------------------------------------------------------------------- the page
def build_app(studio: Studio, default_model: str = "tiny"):
    """The Gradio page on top of `studio`: the layout, then its events."""
    import gradio as gr

    page = SimpleNamespace()
    # delete_cache: the compare tab's charts and the images are removed after an hour.
    with gr.Blocks(title=TITLE, delete_cache=(3600, 3600)) as app:
        gr.Markdown(
            f"## {TITLE}\nBuilt-in models have **random weights**: images are noise, timings "
            "and attention work are the real ones. Device and memory are below."
        )
        model_row(gr, page, studio, default_model)
        with gr.Tab("Generate"), gr.Row():
            generate_settings(gr, page, studio, default_model)
            with gr.Column(scale=2):
                page.gallery = gr.Gallery(label="images", columns=4, height=360, elem_id="gallery")
                page.timing = gr.Markdown(elem_id="timing")
        with gr.Tab("Compare"):
            compare_tab(gr, page, default_model, studio.dm.device)
        with gr.Accordion("device", open=True):
            page.device = gr.Markdown(device_markdown(studio), elem_id="device")
        connect(gr, page, studio)
    return app


def model_row(gr, page, studio: Studio, default_model: str) -> None:
    """Model (with parameters and memory), dtype (recommended first) and the local folder."""
    recommended = str(studio.dm.dtype).replace("torch.", "")
    with gr.Row():
        page.model = gr.Dropdown(
            model_choices(recommended), value=default_model, label="model", scale=3
        )
        page.dtype = gr.Radio(
            studio.working_dtypes,
            value=recommended,
            label=f"dtype (recommended: {recommended})",
        )
    page.folder = gr.Textbox(
        label="local diffusers folder on the server",
        placeholder="/path/to/model (with model_index.json)",
        visible=False,
    )


def generate_settings(gr, page, studio: Studio, default_model: str) -> None:
    """The Generate tab's settings column and its buttons."""
    from ..attention import strategies

    usable = [
        s
        for s in strategies.STRATEGIES
        if strategies.unavailable_reason(s, studio.dm.device) is None
    ]
    with gr.Column(scale=1):
        page.prompt = gr.Textbox(label="prompt (local models with text encoders)", visible=False)
        page.strategy = gr.Dropdown(usable, value="auto", label="attention strategy")
        # One checkbox per method, those the family does not take hidden: the server still
        # answers a request for one (from the API) with its own message.
        with gr.Group():
            gr.Markdown("accelerations (those this model family takes)")
            taken = applicable_accelerations(default_model)
            page.accelerations = [
                gr.Checkbox(label=label, visible=name in taken)
                for name, label in ACCELERATIONS.items()
            ]
        with gr.Accordion("acceleration settings", open=False):
            page.tome = gr.Slider(0.0, 0.9, 0.5, step=0.05, label="Token Merging ratio")
            page.deep_cache = gr.Slider(1, 10, 3, step=1, label="DeepCache interval")
            page.threshold = gr.Slider(
                0.0, 1.0, 0.1, step=0.01, label="First Block Cache threshold"
            )
        page.steps = gr.Slider(1, MAX_STEPS, 4, step=1, label="steps")
        page.size = gr.Number(ARCHITECTURES[default_model][1], precision=0, label="size")
        page.seed = gr.Number(0, precision=0, label="seed")
        page.images = gr.Slider(1, MAX_IMAGES, 1, step=1, label="number of images")
        with gr.Row():
            page.generate = gr.Button("Generate", variant="primary", elem_id="generate")
            page.cancel = gr.Button("Cancel", variant="stop", elem_id="cancel")


def compare_tab(gr, page, default_model: str, device) -> None:
    gr.Markdown(
        "The same seed under each configuration, interleaved after a 1-step warm-up of each "
        "(the benchmark of `bench --e2e --images`); the diffusers default is the exact reference."
    )
    labels = compare_labels(default_model, device)
    with gr.Row():
        page.compare_configs = gr.CheckboxGroup(labels, value=labels[:2], label="configurations")
        with gr.Column():
            page.compare_steps = gr.Slider(1, 50, 4, step=1, label="steps")
            page.compare_size = gr.Number(
                ARCHITECTURES[default_model][1], precision=0, label="size"
            )
            page.rounds = gr.Slider(1, 5, 1, step=1, label="interleaved rounds")
            page.compare = gr.Button("Compare", variant="primary")
    page.chart = gr.Image(label="seconds per step", type="filepath")
    page.table = gr.Dataframe(headers=COMPARE_HEADERS, label="results", elem_id="compare")


def connect(gr, page, studio: Studio) -> None:
    """The page's events. Generating and comparing share one concurrency group (one at a time);
    cancelling and the device panel's refresh bypass the queue so they act during a run."""
    generate, compare, model_changed = handlers(gr, studio)
    inputs = [page.model, page.folder, page.prompt, page.dtype, page.strategy]
    inputs += [*page.accelerations, page.tome, page.deep_cache, page.threshold]
    inputs += [page.steps, page.size, page.seed, page.images]
    page.generate.click(
        generate,
        inputs,
        [page.gallery, page.timing],
        api_name="generate",
        concurrency_id=GENERATION,
    )
    page.cancel.click(studio.cancel, None, None, api_name="cancel", queue=False)
    compare_inputs = [page.model, page.folder, page.dtype, page.seed, page.compare_steps]
    compare_inputs += [page.compare_size, page.compare_configs, page.rounds]
    page.compare.click(
        compare,
        compare_inputs,
        [page.chart, page.table],
        api_name="compare",
        concurrency_id=GENERATION,
    )
    page.model.change(
        model_changed,
        page.model,
        [*page.accelerations, page.size, page.compare_size, page.compare_configs]
        + [page.folder, page.prompt],
        queue=False,  # cheap, and never refused because generations fill the queue
        api_visibility="private",
    )
    page.dtype.change(
        lambda d: gr.update(choices=model_choices(d)),
        page.dtype,
        page.model,
        queue=False,
        api_visibility="private",
    )
    gr.Timer(DEVICE_REFRESH_SECONDS).tick(
        lambda: device_markdown(studio), None, page.device, queue=False, api_visibility="private"
    )


def request_from(model, folder, prompt, dtype, strategy, *rest) -> Request:
    """The Generate tab's values (in connect's order) as a Request."""
    chosen = rest[: len(ACCELERATIONS)]
    tome, deep_cache, threshold, steps, size, seed, images = rest[len(ACCELERATIONS) :]
    return Request(
        model=model,
        folder=folder or "",
        prompt=prompt or "",
        dtype=dtype,
        strategy=strategy,
        accelerations=tuple(name for name, on in zip(ACCELERATIONS, chosen) if on),
        tome_ratio=float(tome),
        deep_cache_interval=int(deep_cache),
        block_cache_threshold=float(threshold),
        steps=int(steps),
        size=int(size or 0),
        seed=int(seed or 0),
        images=int(images),
    )


def handlers(gr, studio: Studio):
    """(generate, compare, model_changed): the functions the page's events call. A request
    the studio refuses becomes a gr.Error, shown in the page; the server goes on."""

    # Gradio finds its progress tracker as a gr.Progress() default argument (its documented
    # way), hence the calls in the defaults below.
    def generate(*values, progress=gr.Progress()):  # noqa: B008
        request = request_from(*values)
        done: list[GeneratedImage] = []
        total_steps = request.steps * request.images

        def on_step(at):
            desc = f"image {at.image + 1} of {at.images}: step {at.step} of {at.steps}"
            progress((at.image * at.steps + at.step, total_steps), desc=desc)

        try:
            for image in studio.generate(request, on_step):
                done.append(image)
                yield [d.image for d in done], timing_markdown(done, request.images)
        except InputError as e:
            raise gr.Error(str(e), print_exception=False) from e

    def compare(model, folder, dtype, seed, steps, size, labels, rounds, progress=gr.Progress()):  # noqa: B008
        request = Request(model=model, folder=folder or "", dtype=dtype, seed=int(seed or 0))
        request.steps, request.size = int(steps), int(size or 0)
        progress((0, int(rounds)), desc="warming up (1 step per configuration)")
        try:
            report = studio.compare(
                request,
                list(labels or ()),
                int(rounds),
                lambda done, total: progress((done, total), desc="interleaved rounds"),
            )
        except InputError as e:
            raise gr.Error(str(e), print_exception=False) from e
        return compare_chart(report), compare_table(report)

    def model_changed(model):
        size = ARCHITECTURES[model][1] if model in ARCHITECTURES else 0
        taken = applicable_accelerations(model)
        labels = compare_labels(model, studio.dm.device)
        local = model == LOCAL_MODEL
        return (
            *(gr.update(visible=name in taken, value=False) for name in ACCELERATIONS),
            gr.update(value=size),
            gr.update(value=size),
            gr.update(choices=labels, value=labels[:2]),
            gr.update(visible=local),
            gr.update(visible=local),
        )

    return generate, compare, model_changed


# --------------------------------------------------------------------------- command line
def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m npu_attn ui",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; others are warned about)",
    )
    parser.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    parser.add_argument(
        "--model",
        default="tiny",
        choices=tuple(ARCHITECTURES),
        help="the model selected when the page opens (default tiny: generates in seconds)",
    )
    parser.add_argument(
        "--allow-local-models",
        action="store_true",
        help="let the page load diffusers folders from this machine's disk",
    )
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # Gradio reports usage to its servers unless told not to: this page makes no outside call.
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        import gradio  # noqa: F401
    except ImportError:
        print(f"error: the web UI needs gradio, not installed: {INSTALL_HINT}", file=sys.stderr)
        return 2
    if not is_loopback(args.host):
        print(
            f"warning: listening on {args.host}: anyone who can reach this machine can use the "
            "page and its compute (there is no login)"
            + (" and load models from its disk" if args.allow_local_models else ""),
            file=sys.stderr,
        )
    from .pipelines import quiet_third_party_warnings

    with quiet_third_party_warnings():
        studio = Studio(allow_local_models=args.allow_local_models)
        app = build_app(studio, args.model)
        app.queue(default_concurrency_limit=1, max_size=QUEUE_SIZE).launch(
            server_name=args.host,
            server_port=args.port,
            show_error=True,
            share=False,  # never a public tunnel, whatever GRADIO_SHARE says
            ssr_mode=False,
            footer_links=["api"],
        )
    return 0
