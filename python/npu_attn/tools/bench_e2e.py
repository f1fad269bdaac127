"""``python -m npu_attn bench --e2e``: seconds per denoising step of a full-size UNet.

Attention is only part of a CPU denoising step, so this section measures what users feel: one
UNet call of the full Stable Diffusion 1.5 architecture (random weights, nothing downloaded) at
512x512 with classifier-free guidance (batch 2), for

- ``eager sdpa``: the diffusers default (torch's SDPA, original processors), the baseline;
- ``eager tiled``: npu_attn's kernel, eager;
- ``eager int8 (lossy)``: npu_attn's opt-in int8 kernel (docs/int8-attention.md), eager;
- ``compiled sdpa`` / ``compiled tiled``: ``torch.compile`` (inductor) of the same UNet with
  that strategy compiled in;
- ``compiled sdpa (frozen)`` / ``compiled tiled (frozen)``: ``npu_attn.compile(unet,
  freeze=True)``, inductor's freezing for inference (weights as constants, prepacked for
  oneDNN), on a module copy sharing the same weight tensors;
- ``eager tiled + channels-last``: a copy of the UNet with ``accelerate(unet,
  channels_last=True)`` (exact; no layout reorders around the convolutions);
- ``openvino``: the same UNet converted with ``openvino.convert_model`` and compiled for the
  CPU with the run's precision as its inference-precision hint (when ``openvino`` is installed:
  ``pip install "npu_attn[bench]"`` or ``pip install openvino==2026.4.1``), the runtime CPU
  users of diffusion often pick instead.

Every competitor runs in this process on the same inputs with the same thread count,
interleaved after a warm-up (each round in an order balanced for which competitor ran before:
``rounds.round_order``); compile and conversion times are reported separately; the table gives
medians and ratios to the baseline and names the machine. Below it, the step's attention calls
replayed alone with each kernel predict the ``eager tiled`` and ``eager int8`` steps from the
``eager sdpa`` one (:mod:`npu_attn.tools.attention_share`), next to the measured ones; the
eager steps also time their attention calls, so a step that misses its prediction shows whether
its attention calls or the rest of it took the time.
``--configs eager`` runs the eager rows alone (no compiles).

``--images STEPS`` measures whole images instead (STEPS denoising steps + VAE decode of the
pipeline) under the diffusers default, ``tiled``, channels-last, Token Merging, DeepCache and
their combinations (IMAGE_CONFIGS; the transformer families SD3, Flux and HiDream take First
Block Cache instead: TRANSFORMER_IMAGE_CONFIGS), and graph mode (``npu_attn.compile`` with
``tiled`` and frozen weights, ``fullgraph=False``) alone and with the accelerations, the fastest
exact and lossy recipes also with heap reuse (GRAPH_IMAGE_CONFIGS), with each image's PSNR
against the default's and the seconds per denoising step inside each image. Each graph-mode
configuration runs on its own copy of the pipeline (sharing the weights), configured, compiled,
timed and released after the eager rounds, one at a time: switching one pipeline between
configurations would recompile at every switch, and two frozen copies of a full-size model need
more memory than one (a heap-reuse row shares the copy of the row without it, interleaved with
it on that copy). Its compile time is reported apart; its warm-up is an untimed image of up to 4
steps, so the graphs DeepCache's cached steps take are compiled too. ``--configs`` picks
configurations by label (the baseline always runs). ``--sdcpp f32,q8_0+fa`` adds
stable-diffusion.cpp, the CPU-native engine, loading the same SD-1.5 from a diffusers folder,
interleaved with the eager rounds (:mod:`npu_attn.tools.sdcpp`: what it shares with the other
rows and what it does not). The web UI's compare tab runs the same code (compare_images) without
the graph-mode ones. ``--model sdxl`` is SDXL base 1.0's architecture (its UNet, VAE and Euler
scheduler, random weights, prompts as random embeddings with SDXL's pooled ones) at 1024x1024 by
default; ``--size`` picks another size. ``--plot`` writes either report as a bar chart.
diffusers' and transformers' configuration and deprecation warnings are silenced while it runs,
as in the demo (set DIFFUSERS_VERBOSITY or TRANSFORMERS_VERBOSITY to see them).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from .arguments import at_least, on_requested_threads

BASELINE = "eager sdpa"
INT8 = "eager int8 (lossy)"
# The eager step competitors whose attention calls are timed inside the step, and the strategy
# each one's attention runs.
EAGER_STRATEGIES = {BASELINE: "sdpa", "eager tiled": "tiled", INT8: "int8"}
CL = " + channels-last"
FROZEN = " (frozen)"
REUSE = " + heap reuse"


class ConfigurationError(ValueError):
    """An ``--images`` configuration that cannot run on the chosen model."""


def build_unet(model: str = "sd15"):
    """The full-size UNet of ``model`` (demo.UNET_ARCHITECTURES) with random weights, in float32."""
    from diffusers import UNet2DConditionModel

    from .pipelines import UNET_ARCHITECTURES, seeded_weights

    with seeded_weights(0):
        return UNet2DConditionModel(**UNET_ARCHITECTURES[model][0]).eval()


def make_inputs(unet, size: int, dtype, vae_scale: int = 8) -> dict:
    """One CFG (batch 2) UNet call's inputs at ``size`` pixels; SDXL-style UNets also get their
    added conditions (pooled text embeddings, and time ids for an uncropped ``size`` image)."""
    import torch

    g = torch.Generator().manual_seed(0)
    latent = size // vae_scale
    inputs = {
        "sample": torch.randn(2, unet.config.in_channels, latent, latent, generator=g).to(dtype),
        "timestep": torch.tensor(500),
        "encoder_hidden_states": torch.randn(
            2, 77, unet.config.cross_attention_dim, generator=g
        ).to(dtype),
    }
    if unet.config.addition_embed_type == "text_time":
        pooled = (
            unet.config.projection_class_embeddings_input_dim
            - 6 * unet.config.addition_time_embed_dim
        )
        inputs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(2, pooled, generator=g).to(dtype),
            "time_ids": torch.tensor([[size, size, 0, 0, size, size]] * 2).to(dtype),
        }
    return inputs


def openvino_runner(unet, inputs: dict, dtype, threads: int) -> tuple[Callable, float]:
    """(one inference, seconds to convert and compile) of ``unet`` (float32, original
    processors) in OpenVINO with ``dtype`` as its inference precision."""
    import openvino as ov
    import torch

    added = sorted(inputs.get("added_cond_kwargs", {}))  # SDXL's text_embeds, time_ids

    class Positional(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, sample, timestep, encoder_hidden_states, *conditions):
            kwargs = {"added_cond_kwargs": dict(zip(added, conditions))} if added else {}
            out = self.inner(sample, timestep, encoder_hidden_states, return_dict=False, **kwargs)
            return out[0]

    start = time.perf_counter()
    tensors = [inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"]]
    tensors += [inputs["added_cond_kwargs"][name] for name in added]
    example = tuple(v.float() if torch.is_floating_point(v) else v for v in tensors)
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


def shared_tensors(module) -> list:
    """The module's parameters and buffers (for a deepcopy memo that shares them)."""
    return list(module.parameters()) + list(module.buffers())


def _set_heap_reuse(name: str, runner: Optional[Callable]) -> None:
    """Heap reuse (npu_attn.runtime.reuse_cpu_memory) on for `+ heap reuse` rows only (steps and
    images). Such a row is timed in its steady state, as in a denoising loop after the first
    step: the untimed call after switching it on fills the heap that the timed call then
    reuses (switching it off for the other rows returns the memory to the OS)."""
    import npu_attn

    from ..runtime.extension import _C

    if not _C.heap_reuse_supported():
        return
    reuse = name.endswith(REUSE)
    npu_attn.runtime.reuse_cpu_memory(reuse)
    if reuse and runner is not None:
        runner()


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


# The per-step competitors, in report order; the first is the baseline.
STEP_COMPETITORS = (
    BASELINE,
    "eager tiled",
    INT8,
    f"eager tiled{CL}",
    "compiled sdpa",
    "compiled tiled",
    f"compiled sdpa{FROZEN}",
    f"compiled tiled{FROZEN}",
    f"compiled tiled{FROZEN}{REUSE}",
    "openvino",
)


def select_step_competitors(wanted: Optional[str]) -> tuple[str, ...]:
    """The per-step competitors ``--configs`` names (as select_configs picks configurations)."""
    chosen = select_configs(tuple((name, None, None) for name in STEP_COMPETITORS), wanted)
    return tuple(name for name, _, _ in chosen)


@on_requested_threads
def run(args) -> dict:
    import torch
    from tqdm import tqdm

    from ..accel.registry import accelerate
    from ..graph.mode import compile as compile_components
    from ..runtime import controls as _runtime
    from ..runtime.extension import _C
    from .attention_share import record_attention_calls, step_predictions, timed_attention_calls
    from .bench_report import machine_info
    from .pipelines import vae_scale_factor
    from .rounds import round_order

    dtype = getattr(torch, args.dtype)
    threads = _runtime.get_num_threads()  # set by on_requested_threads
    unet = build_unet(args.model)
    inputs = make_inputs(unet, args.size, dtype, vae_scale_factor(args.model))
    chosen = select_step_competitors(getattr(args, "configs", None))
    runners: dict[str, Callable] = {}
    setup_seconds: dict[str, float] = {}
    if "openvino" in chosen and not args.no_openvino:
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
    runners[INT8] = torch_runner(unet, inputs, "int8", False, None)
    if any(FROZEN in name for name in chosen):
        # Frozen graphs on a copy of the module tree that shares the weight tensors (so no
        # second copy of the weights; only the frozen graphs' prepacked ones), compiled in place
        # by npu_attn.compile so the unfrozen rows' module is left alone.
        unet_frozen = copy.deepcopy(unet, memo={id(t): t for t in shared_tensors(unet)})
        compile_components(unet_frozen, None, mode=args.mode, freeze=True, show_progress=False)
        for strategy in ("sdpa", "tiled"):
            runners[f"compiled {strategy}{FROZEN}"] = torch_runner(
                unet_frozen, inputs, strategy, False, None
            )
        if _C.heap_reuse_supported():  # the same frozen graphs, freed memory kept between steps
            runners[f"compiled tiled{FROZEN}{REUSE}"] = runners[f"compiled tiled{FROZEN}"]
    if f"eager tiled{CL}" in chosen:
        # The same weights in channels-last (a copy: the layout is the weights' own).
        unet_cl = copy.deepcopy(unet)
        accelerate(unet_cl, channels_last=True)
        runners[f"eager tiled{CL}"] = torch_runner(unet_cl, inputs, "tiled", False, None)
    names = [n for n in STEP_COMPETITORS if n in runners and n in chosen]
    times: dict[str, list[float]] = {n: [] for n in names}
    try:  # heap reuse is process-wide: off again afterwards, also when a step raises
        for name in tqdm(names, desc="warm-up (compiles)", unit="competitor"):
            _set_heap_reuse(name, runners[name])
            start = time.perf_counter()
            runners[name]()
            # (a compiled step's first call compiles)
            if name.startswith("compiled") and not name.endswith(REUSE):
                setup_seconds[name] = time.perf_counter() - start
        # Each round in an order balanced for the predecessor (rounds.round_order): a step's
        # time depends on the heap and caches the step before it left.
        # The eager steps also time their attention calls (the split of step_predictions).
        in_step: dict[str, list[float]] = {n: [] for n in names if n in EAGER_STRATEGIES}
        for round_index in tqdm(range(args.repeats), desc="interleaved rounds", unit="round"):
            for name in round_order(names, round_index):
                _set_heap_reuse(name, runners[name])
                timer = timed_attention_calls() if name in in_step else contextlib.nullcontext()
                with timer as attention:
                    start = time.perf_counter()
                    runners[name]()
                    times[name].append(time.perf_counter() - start)
                if name in in_step:
                    in_step[name].append(attention[0])
    finally:
        _set_heap_reuse("", None)
    medians = {n: statistics.median(t) for n, t in times.items()}
    # What the attention kernels' own speed-ups predict for the tiled and int8 steps (one more
    # sdpa step records its attention calls, which are then replayed alone).
    calls = record_attention_calls(runners[BASELINE])
    predictions = {}
    measured = {
        s: medians[name]
        for s, name in (("tiled", "eager tiled"), ("int8", INT8))
        if name in medians
    }
    in_step_medians = {EAGER_STRATEGIES[n]: statistics.median(t) for n, t in in_step.items()}
    if calls and measured:
        predictions = step_predictions(
            medians[BASELINE], measured, calls, rounds=max(3, args.repeats), in_step=in_step_medians
        )
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
        "step_predictions": predictions,
    }


# --------------------------------------------------------------------------- whole images
TOME, DEEPCACHE, CHANNELS_LAST = {"token_merging": 0.5}, {"deep_cache": 3}, {"channels_last": True}
BLOCK_CACHE = {"block_cache": 0.1}
# (label, attention strategy, accelerate() options); the first is the baseline. UNet models
# (SD-1.5, 2.1, SDXL) take Token Merging and DeepCache.
IMAGE_CONFIGS = (
    ("sdpa (diffusers default)", "sdpa", {}),
    ("tiled", "tiled", {}),
    ("channels-last", "sdpa", CHANNELS_LAST),
    ("ToMe 0.5", "sdpa", TOME),
    ("DeepCache 3", "sdpa", DEEPCACHE),
    ("ToMe 0.5 + DeepCache 3", "sdpa", {**TOME, **DEEPCACHE}),
    ("ToMe 0.5 + DeepCache 3 + tiled", "tiled", {**TOME, **DEEPCACHE}),
    (
        "ToMe 0.5 + DeepCache 3 + tiled + channels-last",
        "tiled",
        {**TOME, **DEEPCACHE, **CHANNELS_LAST},
    ),
    ("int8 (lossy attention)", "int8", {}),
)
# The transformer families (SD3, Flux, HiDream) take First Block Cache instead; channels-last
# applies to their VAE.
TRANSFORMER_IMAGE_CONFIGS = (
    ("sdpa (diffusers default)", "sdpa", {}),
    ("tiled", "tiled", {}),
    ("channels-last", "sdpa", CHANNELS_LAST),
    ("block cache 0.1", "sdpa", BLOCK_CACHE),
    ("block cache 0.1 + tiled", "tiled", BLOCK_CACHE),
    ("int8 (lossy attention)", "int8", {}),
)


# Graph mode: the options key GRAPH = "frozen" compiles the configured pipeline copy with
# npu_attn.compile(strategy, freeze=True) (fullgraph=False: the accelerations' hooks break the
# graph). The exact recipe (graph mode alone) and the lossy ones (with the caches and Token
# Merging). Not with channels-last: a frozen graph lays out its convolution weights itself
# (and channels-last converts weights in place, which the frozen copies share).
# A row labelled `<row> + heap reuse` (REUSE, as in the step benchmark) times the compiled copy
# of <row>, interleaved with it, with npu_attn.runtime.reuse_cpu_memory(True) (rows dropped
# where the C heap is not glibc's): the fastest recipes' last exact switch.
GRAPH = "graph_mode"
FROZEN_GRAPH = {GRAPH: "frozen"}
GRAPH_IMAGE_CONFIGS = (
    ("compiled tiled (frozen)", "tiled", FROZEN_GRAPH),
    (f"compiled tiled (frozen){REUSE}", "tiled", FROZEN_GRAPH),
    ("DeepCache 3 + compiled tiled (frozen)", "tiled", {**DEEPCACHE, **FROZEN_GRAPH}),
    (
        "ToMe 0.5 + DeepCache 3 + compiled tiled (frozen)",
        "tiled",
        {**TOME, **DEEPCACHE, **FROZEN_GRAPH},
    ),
    (
        f"ToMe 0.5 + DeepCache 3 + compiled tiled (frozen){REUSE}",
        "tiled",
        {**TOME, **DEEPCACHE, **FROZEN_GRAPH},
    ),
)
TRANSFORMER_GRAPH_IMAGE_CONFIGS = (("compiled tiled (frozen)", "tiled", FROZEN_GRAPH),)
GRAPH_WARM_UP_STEPS = 4


def image_configs(family: str, graph: bool = True) -> tuple:
    """The ``--images`` configurations for a model family (pipelines.FAMILIES); ``graph``: with
    the graph-mode ones (the web UI's compare tab leaves them out: it compiles on request)."""
    if family in ("sd", "sdxl"):
        configs = IMAGE_CONFIGS + (GRAPH_IMAGE_CONFIGS if graph else ())
    else:
        configs = TRANSFORMER_IMAGE_CONFIGS + (TRANSFORMER_GRAPH_IMAGE_CONFIGS if graph else ())
    from ..runtime.extension import _C

    if _C.heap_reuse_supported():
        return configs
    return tuple(c for c in configs if not c[0].endswith(REUSE))


def select_configs(configs: tuple, wanted: Optional[str]) -> tuple:
    """The baseline and the configurations ``wanted`` names: comma-separated texts, each
    selecting the configuration whose label it is (case-insensitive), or else every label that
    contains it; all of them for None. ValueError if a text matches nothing."""
    if not wanted:
        return configs
    chosen = set()
    for text in (w.strip().lower() for w in wanted.split(",") if w.strip()):
        labels = [label for label, _, _ in configs]
        exact = [label for label in labels if label.lower() == text]
        found = exact or [label for label in labels if text in label.lower()]
        if not found:
            raise ValueError(f"--configs: {text!r} matches no configuration ({'; '.join(labels)})")
        chosen.update(found)
    return (configs[0],) + tuple(c for c in configs[1:] if c[0] in chosen)


def is_graph_config(options: dict) -> bool:
    return GRAPH in options


def acceleration_options(options: dict) -> dict:
    """A configuration's options for accelerate(): without the benchmark's own key."""
    return {k: v for k, v in options.items() if k != GRAPH}


def graph_config_groups(configs) -> list:
    """Graph-mode configurations grouped by the compiled copy they run on: a `+ heap reuse`
    row shares the copy of the row it names, in their given order."""
    groups = {}
    for config in configs:
        groups.setdefault(config[0].removesuffix(REUSE), []).append(config)
    return list(groups.values())


def pipeline_copy(pipe):
    """A pipeline object of its own whose modules are copies of ``pipe``'s sharing every weight
    tensor with them: configuring and compiling the copy leaves ``pipe`` as it is, at the memory
    of the module objects only."""
    import torch

    shared = {}
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            for t in shared_tensors(component):
                shared[id(t)] = t
    twin = copy.copy(pipe)
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            setattr(twin, name, copy.deepcopy(component, dict(shared)))
    return twin


def prepare_graph_config(weights, strategy: str, options: dict, embeds: dict, size: int):
    """A compiled copy of the pipeline ``weights`` (sharing its weights, which must not change
    while the copy is used) in one graph-mode configuration, warmed up (compiled): (the copy,
    seconds its configuration, compilation and warm-up image took)."""
    from ..graph.mode import compile as graph_compile

    start = time.perf_counter()
    twin = pipeline_copy(weights)
    configure(twin, strategy, acceleration_options(options))
    graph_compile(twin, strategy=None, freeze=True, show_progress=False)
    timed_image(twin, embeds, GRAPH_WARM_UP_STEPS, size)
    return twin, time.perf_counter() - start


def check_image_configs(pipe, model: str, configs=IMAGE_CONFIGS) -> None:
    """Checks every configuration's attention strategy and acceleration against the model
    before anything is timed: a strategy that cannot run on the model's device or a method that
    does not apply to the model fails here, naming the configuration, instead of after the
    configurations before it have run (ConfigurationError)."""
    from ..accel.registry import check_acceleration
    from ..attention.strategies import unavailable_reason
    from .pipelines import denoiser

    device = next(denoiser(pipe).parameters()).device
    for label, strategy, options in configs:
        reason = unavailable_reason(strategy, device)
        if reason is not None:
            raise ConfigurationError(f"configuration {label!r} cannot run on {model}: {reason}")
        options = acceleration_options(options)
        if not options:  # (no options would check the environment's)
            continue
        try:
            check_acceleration(pipe, **options)
        except (TypeError, ValueError) as e:
            raise ConfigurationError(f"configuration {label!r} cannot run on {model}: {e}") from e


def configure(pipe, strategy: str, options: dict) -> None:
    """Puts `pipe` in one configuration: the attention strategy (``sdpa`` = diffusers' own
    processors) and the accelerations, replacing the previous configuration's."""
    from ..accel.registry import accelerate, reset_acceleration
    from ..integration.processors import reset_attention_strategy, set_attention_strategy

    reset_acceleration(pipe)
    if strategy == "sdpa":
        reset_attention_strategy(pipe)
    else:
        set_attention_strategy(pipe, strategy)
    if options:
        accelerate(pipe, **options)


def timed_image(pipe, embeds: dict, steps: int, size: int, seed: int = 0):
    """(seconds of the whole image, seconds of its denoising loop, image float32 in [0, 1]):
    one image of `pipe` as configured; the loop ends at the last step's callback, before the
    VAE decodes."""
    import torch

    from .pipelines import fit_size

    fit_size(pipe, size)
    loop_end = []

    def mark_step_end(pipeline, step, timestep, callback_kwargs):
        loop_end[:] = [time.perf_counter()]
        return callback_kwargs

    start = time.perf_counter()
    with torch.no_grad():
        out = pipe(
            **embeds,
            num_inference_steps=steps,
            height=size,
            width=size,
            output_type="pt",
            generator=torch.Generator().manual_seed(seed),
            callback_on_step_end=mark_step_end,
        ).images
    end = time.perf_counter()
    return end - start, loop_end[0] - start, out.float()


def compare_images(
    pipe,
    configs,
    embeds: dict,
    steps: int,
    size: int,
    repeats: int,
    on_round=None,
    seed: int = 0,
    external=(),
):
    """Each configuration's image seconds (all from `seed`) and its distance from the first
    (exact) configuration's image. Eager configurations are interleaved over `repeats` rounds
    after an untimed 1-step warm-up of each; then each graph-mode configuration is compiled on
    a copy of the pipeline, warmed up, timed `repeats` times and released, one at a time (its
    compiled graphs and prepacked weights never share the process with another's: memory,
    and no recompilation inside a timed image).
    `external`: other engines' runners (``label``, ``image(steps, size, seed) -> (seconds,
    image)``: sdcpp.SdCppRunner), warmed up and interleaved with the eager configurations;
    their images come from other samplers and noise, so they get no PSNR (``not_comparable``).
    `on_round(done, total)` is called after each eager round. Returns the report's
    measurements: medians of seconds per image and per denoising step, speed-ups and PSNRs vs
    the first, and each graph-mode configuration's compile + warm-up seconds."""
    from .pipelines import psnr_db

    names = [label for label, _, _ in configs] + [runner.label for runner in external]
    eager = [c for c in configs if not is_graph_config(c[2])]
    graph = [c for c in configs if is_graph_config(c[2])]
    times = {name: [] for name in names}
    loop_times = {name: [] for name in names}
    images = {}

    def timed(target, label):
        seconds, loop_seconds, image = timed_image(target, embeds, steps, size, seed)
        times[label].append(seconds)
        loop_times[label].append(loop_seconds / steps)
        images.setdefault(label, image)

    # One-time costs (first calls of each shape and dtype, allocations) would otherwise land on
    # the first round, the diffusers default's image first: a 1-step image per configuration.
    for _, strategy, options in eager:
        configure(pipe, strategy, options)
        timed_image(pipe, embeds, 1, size)
    for runner in external:
        runner.image(1, size, seed)
    for done in range(repeats):
        for label, strategy, options in eager:
            configure(pipe, strategy, options)
            timed(pipe, label)
        for runner in external:
            seconds, image = runner.image(steps, size, seed)
            times[runner.label].append(seconds)
            images.setdefault(runner.label, image)
        if on_round is not None:
            on_round(done + 1, repeats)
    configure(pipe, "sdpa", {})
    setup_seconds = run_graph_configs(pipe, graph, embeds, size, repeats, timed)
    baseline = names[0]
    not_comparable = [runner.label for runner in external]
    medians = {n: statistics.median(t) for n, t in times.items()}
    return {
        "seconds_per_image": medians,
        "seconds_per_step": {n: statistics.median(t) for n, t in loop_times.items() if t},
        "all_seconds": times,
        "speedup_vs_baseline": {n: medians[baseline] / m for n, m in medians.items()},
        "psnr_db_vs_baseline": {
            n: (
                None
                if n == baseline or n in not_comparable
                else psnr_db(images[n], images[baseline])
            )
            for n in names
        },
        "not_comparable": not_comparable,
        "compile_and_warm_up_seconds": setup_seconds,
    }


def run_graph_configs(pipe, configs, embeds: dict, size: int, repeats: int, timed) -> dict:
    """Compiles, warms up and times (``timed(target, label)``, `repeats` times) each graph-mode
    configuration in turn on a compiled copy of ``pipe``, released before the next (those that
    differ only in heap reuse share one copy and are interleaved on it); returns the compile +
    warm-up seconds of each copy, under its first configuration's label."""
    from ..graph.mode import release_compiled_graphs

    setup_seconds = {}
    # The eager configurations are over (they convert the pipeline's weights in place for
    # channels-last, which a frozen graph must not see afterwards), so the compiled copies share
    # the pipeline's weights: a private copy of them did not fit next to a frozen full-size
    # SD-1.5 in float32 on 24 GiB.
    for group in graph_config_groups(configs):
        label, strategy, options = group[0]
        twin, setup_seconds[label] = prepare_graph_config(pipe, strategy, options, embeds, size)
        # A reuse row fills the heap with an untimed image first, as the images before it would
        # in a user's process (of the warm-up's step count, so it takes the warm-up's graphs).
        fill = functools.partial(timed_image, twin, embeds, GRAPH_WARM_UP_STEPS, size)
        try:
            for _ in range(repeats):
                for name, _, _ in group:
                    _set_heap_reuse(name, fill)
                    timed(twin, name)
        finally:
            _set_heap_reuse("", None)
        del twin
        # Its graphs and their frozen weights go with it (~6.7 GB for float32 SD-1.5 otherwise
        # kept by inductor), and its unfrozen graphs count against no recompile limit.
        release_compiled_graphs()
    return setup_seconds


def sdcpp_runners(pipe, model: str, weight_types, threads: int, stack) -> list:
    """stable-diffusion.cpp runners (sdcpp.py) for ``weight_types``, loaded from ``pipe``
    exported to a temporary folder that ``stack`` removes; ConfigurationError when it cannot
    run here or on this model."""
    import tempfile

    from . import sdcpp

    if not weight_types:
        return []
    reason = sdcpp.unavailable_reason() or sdcpp.check_pipeline(pipe, model)
    if reason is not None:
        raise ConfigurationError(f"--sdcpp: {reason}")
    folder = sdcpp.export_folder(pipe, Path(stack.enter_context(tempfile.TemporaryDirectory())))
    return [sdcpp.SdCppRunner.load(folder, w, threads) for w in weight_types]


@on_requested_threads
def run_images(args) -> dict:
    """Seconds per image (``--images N`` denoising steps + VAE decode) of a pipeline of any
    family under each of its configurations (image_configs), interleaved after a 1-step
    warm-up of each, and each image's distance from the exact baseline image (PSNR, pixels in
    [0, 1]; lossy methods deviate, exact ones do not). ConfigurationError when a configuration
    does not apply to the model."""
    import torch
    from tqdm import tqdm

    from ..runtime import controls as _runtime
    from .bench_report import machine_info
    from .pipelines import FAMILIES, build_pipeline, prompt_embeddings

    dtype = getattr(torch, args.dtype)
    threads = _runtime.get_num_threads()  # set by on_requested_threads
    pipe = build_pipeline(args.model).to(dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    graph = not getattr(args, "no_graph_mode", False)
    configs = image_configs(FAMILIES[args.model], graph)
    configs = select_configs(configs, getattr(args, "configs", None))
    check_image_configs(pipe, args.model, configs)
    embeds = prompt_embeddings(pipe, dtype, "cpu")
    weight_types = getattr(args, "sdcpp", None) or ()
    with contextlib.ExitStack() as stack:
        external = sdcpp_runners(pipe, args.model, weight_types, threads, stack)
        with tqdm(total=args.repeats, desc="interleaved rounds", unit="round") as bar:
            measured = compare_images(
                pipe,
                configs,
                embeds,
                args.images,
                args.size,
                args.repeats,
                lambda *_: bar.update(),
                external=external,
            )
    if external:
        measured["load_seconds"] = {runner.label: runner.load_seconds for runner in external}
    return {
        "machine": machine_info(threads),
        "model": args.model,
        "size": args.size,
        "dtype": args.dtype,
        "steps": args.images,
        "scheduler": type(pipe.scheduler).__name__,
        "repeats": args.repeats,
        "warm_up": "a 1-step image per configuration, untimed",
        **measured,
    }


def images_markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['threads']} threads; torch {m['torch']}; {m['date']}. "
        f"{report['model']} pipeline (random weights), {report['size']}x{report['size']}, "
        f"{report['steps']} {report.get('scheduler', 'DDIMScheduler')} steps + VAE decode, "
        f"CFG, {report['dtype']}; medians of {report['repeats']} interleaved rounds"
        f"{' after a 1-step warm-up of each' if report.get('warm_up') else ''}.",
        "",
        "| configuration | s / image | vs diffusers default | image PSNR vs default |",
        "|---|---|---|---|",
    ]
    setup = report.get("compile_and_warm_up_seconds", {})
    not_comparable = report.get("not_comparable", [])
    for name, seconds in report["seconds_per_image"].items():
        psnr = report["psnr_db_vs_baseline"][name]
        if name in not_comparable:
            psnr_text = "not comparable (own sampler and noise)"
        elif psnr is None:
            psnr_text = "reference"
        else:
            psnr_text = "identical" if psnr == float("inf") else f"{psnr:.1f} dB"
        lines.append(
            f"| {name} | {seconds:.1f} | {report['speedup_vs_baseline'][name]:.2f}x | {psnr_text} |"
        )
    if setup:
        lines += [
            "",
            "Graph mode, compile + warm-up image (once per process, not in the times above): "
            + ", ".join(f"{name} {s:.0f} s" for name, s in setup.items())
            + ". Exact configurations differ from the default by float rounding only; the "
            "lossy ones (Token Merging, DeepCache, block cache) by their PSNR.",
        ]
    if not_comparable:
        loads = report.get("load_seconds", {})
        lines += [
            "",
            "stable-diffusion.cpp (its Python binding, built from source for this CPU) loads the "
            "same UNet and VAE from a diffusers folder and runs the same steps and size with "
            "guidance, but samples with its own Euler and noise and encodes its prompts itself "
            "(included in its time; the other rows take precomputed embeddings): its images "
            "are not comparable pixel for pixel. f32 keeps the weights exact; f16 and q8_0 are "
            "lossy weight types; its flash attention rounds K and V to float16. Loading: "
            + ", ".join(f"{name} {s:.0f} s" for name, s in loads.items())
            + ".",
        ]
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
    from .attention_share import prediction_markdown

    for prediction in report.get("step_predictions", {}).values():
        lines += ["", prediction_markdown(prediction)]
    return "\n".join(lines)


def bar_chart(seconds: dict, speedups: dict, ylabel: str, title: str, path: Path) -> Path:
    """One bar per competitor (seconds), labelled with its speed-up against the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(seconds)
    fig, ax = plt.subplots(figsize=(max(7.5, 1.15 * len(names)), 3.8))
    wrapped = [n.replace(" + ", "\n+ ").replace(" (", "\n(") for n in names]
    bars = ax.bar(wrapped, [seconds[n] for n in names], color="#4477aa")
    ax.bar_label(bars, [f"{speedups[n]:.2f}x" for n in names], padding=2, fontsize=8)
    ax.margins(y=0.15)  # room for the labels above the tallest bar
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    plt.setp(ax.get_xticklabels(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _machine_line(report: dict) -> str:
    m = report["machine"]
    return f"{m['cpu']}, {m['threads']} threads"


def plot(report: dict, path: Path) -> Path:
    """The step report's chart: seconds per UNet step per competitor."""
    return bar_chart(
        report["seconds_per_step"],
        report["speedup_vs_baseline"],
        "seconds per UNet step",
        f"{report['model']} UNet {report['size']}px CFG, {report['dtype']}; "
        f"x = speed-up vs {BASELINE}\n{_machine_line(report)}",
        path,
    )


def plot_images(report: dict, path: Path) -> Path:
    """The ``--images`` report's chart: seconds per image per configuration."""
    baseline = next(iter(report["seconds_per_image"]))
    return bar_chart(
        report["seconds_per_image"],
        report["speedup_vs_baseline"],
        "seconds per image",
        f"{report['model']} pipeline {report['size']}px, {report['steps']} steps + VAE decode, "
        f"CFG, {report['dtype']}; x = speed-up vs {baseline}\n{_machine_line(report)}",
        path,
    )


def main(argv: Optional[list[str]] = None) -> int:
    from .pipelines import (
        ARCHITECTURES,
        FAMILIES,
        UNET_ARCHITECTURES,
        architecture_summary,
        quiet_third_party_warnings,
        size_problem,
        vae_scale_factor,
    )

    parser = argparse.ArgumentParser(
        prog="python -m npu_attn bench --e2e",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="sd15",
        choices=tuple(ARCHITECTURES),
        help="architecture built from config with random weights (default sd15; sdxl is SDXL "
        "base 1.0's UNet and VAE; the tiny ones are for tests). The per-step comparison "
        f"takes the UNets ({', '.join(UNET_ARCHITECTURES)}); --images every family",
    )
    parser.add_argument(
        "--size",
        type=int,
        help="image size in pixels (default: the model's, 512 for sd15, 1024 for sdxl)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--threads", type=at_least(1), help="threads for every competitor")
    parser.add_argument("--mode", help="torch.compile mode (default: inductor's default)")
    parser.add_argument("--no-openvino", action="store_true", help="skip OpenVINO")
    parser.add_argument(
        "--images",
        type=int,
        metavar="STEPS",
        help="instead: seconds per whole image (STEPS steps + decode) of the pipeline with "
        "Token Merging and DeepCache (UNets) or First Block Cache (transformers; lossy), tiled "
        "and channels-last, against the diffusers default",
    )
    parser.add_argument(
        "--no-graph-mode",
        action="store_true",
        help="with --images: leave out the graph-mode configurations (each compiles a copy of "
        "the pipeline: minutes per configuration on a full-size model)",
    )
    parser.add_argument(
        "--configs",
        help="only the configurations (with --images) or per-step competitors whose label "
        "contains one of these comma-separated texts (the diffusers default always runs), "
        "e.g. 'frozen,channels-last' or 'eager'",
    )
    parser.add_argument(
        "--sdcpp",
        metavar="TYPES",
        help="with --images: add stable-diffusion.cpp (pip install "
        "stable-diffusion-cpp-python==0.4.7) with these comma-separated weight types (f32, f16, "
        "q8_0; +fa for its flash attention, e.g. 'f32,q8_0+fa'), loading the same SD-1.5 "
        "pipeline",
    )
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG bar chart here")
    args = parser.parse_args(argv)
    if args.size is None:
        args.size = ARCHITECTURES[args.model][1]
    config = architecture_summary(args.model)[1]
    problem = size_problem(FAMILIES[args.model], config, vae_scale_factor(args.model), args.size)
    if problem is not None:
        parser.error(f"--size: {problem}")
    if args.images is None and args.model not in UNET_ARCHITECTURES:
        parser.error(f"the per-step comparison takes UNet models; use --images for {args.model}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.images is not None:
        if args.images < 1:
            parser.error(f"--images must be >= 1 denoising step, got {args.images}")
        if args.configs:
            try:
                select_configs(image_configs(FAMILIES[args.model]), args.configs)
            except ValueError as e:
                parser.error(str(e))
        if args.sdcpp is not None:
            from .sdcpp import parse_weight_types, unavailable_reason

            try:
                args.sdcpp = parse_weight_types(args.sdcpp)
            except ValueError as e:
                parser.error(str(e))
            if unavailable_reason() is not None:
                print(f"error: --sdcpp: {unavailable_reason()}", file=sys.stderr)
                return 2
    else:
        if args.sdcpp is not None:
            parser.error("--sdcpp compares whole images: use it with --images")
        if args.configs:  # the per-step competitors' labels, not the per-image ones
            try:
                select_step_competitors(args.configs)
            except ValueError as e:
                parser.error(f"{e}; per-image configurations need --images")
    with quiet_third_party_warnings():
        return run_and_report(args)


def run_and_report(args: argparse.Namespace) -> int:
    """Runs the per-image or per-step comparison the checked arguments ask for; prints its
    table and writes its JSON and chart. 2 for a configuration this pipeline cannot run."""
    if args.images is not None:
        try:
            report = run_images(args)
        except ConfigurationError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(images_markdown(report))
        if args.json:
            args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")
        if args.plot:
            plot_images(report, args.plot)
        return 0
    report = run(args)
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")
    if args.plot:
        plot(report, args.plot)
    return 0
