"""What the web UI (``python -m npu_attn ui``, :mod:`.ui`) does, without the page: checking a
request before anything is loaded, keeping one pipeline loaded, generating images one by one
with their seconds per step and attention share, cancelling between steps, and comparing
configurations with the whole-image benchmark (:mod:`.bench_e2e`).

Gradio-free, so the page stays a thin layer and everything here is tested directly.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from .pipelines import (
    ARCHITECTURES,
    ELEMENT_BYTES,
    FAMILIES,
    architecture_summary,
    build_pipeline,
    decodes_in_float32,
    denoiser,
    estimated_memory_bytes,
    fit_size,
    float32_decode_bytes,
    load_pipeline,
    parameter_count,
    pipeline_family,
    prompt_embeddings,
    read_model_index,
    size_problem,
    step_activation_bytes,
    vae_scale_factor,
)

# The model choice that means "the local diffusers folder given".
LOCAL_MODEL = "local folder"
FAMILY_NAMES = {
    "sd": "Stable Diffusion 1.5/2.1 UNet",
    "sdxl": "SDXL UNet",
    "sd3": "SD3 MMDiT",
    "flux": "Flux transformer",
    "hidream": "HiDream-I1 transformer",
}
# The accelerations the page offers, by name: accelerate()'s methods, then npu_attn.compile
# (inductor) without and with freezing.
ACCELERATIONS = {
    "token_merging": "Token Merging",
    "deep_cache": "DeepCache",
    "block_cache": "First Block Cache",
    "channels_last": "channels-last",
    "compile": "compile",
    "freeze": "compile + freeze",
}
# Which of them each family takes (checked against npu_attn.accelerate in the tests): Token
# Merging and DeepCache need a UNet, First Block Cache a transformer's block list;
# channels-last applies to every VAE, compiling to every model.
FAMILY_ACCELERATIONS = {
    "sd": ("token_merging", "deep_cache", "channels_last", "compile", "freeze"),
    "sdxl": ("token_merging", "deep_cache", "channels_last", "compile", "freeze"),
    "sd3": ("block_cache", "channels_last", "compile", "freeze"),
    "flux": ("block_cache", "channels_last", "compile", "freeze"),
    "hidream": ("block_cache", "channels_last", "compile", "freeze"),
}
MEMORY_ESTIMATE = "parameters x bytes per element + one step's activations"
MAX_STEPS = 100
MAX_IMAGES = 8


class InputError(ValueError):
    """A request that cannot run, with the message to show the user."""


@dataclass
class Request:
    """One generation (or comparison) as the page asks for it."""

    model: str = "tiny"  # an ARCHITECTURES name, or LOCAL_MODEL with `folder`
    folder: str = ""
    prompt: str = ""  # used by local models with text encoders; random embeddings otherwise
    dtype: str = "float32"
    strategy: str = "auto"
    accelerations: tuple[str, ...] = ()
    tome_ratio: float = 0.5
    deep_cache_interval: int = 3
    block_cache_threshold: float = 0.1
    steps: int = 4
    size: int = 0  # 0: the model's default size
    seed: int = 0
    images: int = 1

    @property
    def local(self) -> bool:
        return self.model == LOCAL_MODEL


@dataclass
class GeneratedImage:
    """One finished image and how fast it was made."""

    index: int
    image: Any  # PIL image
    seconds_per_step: float
    attention_share: Optional[float]  # None: not timed, for `untimed_because`
    steps_done: int
    cancelled: bool = False
    untimed_because: str = ""  # why attention_share is None


@dataclass
class StepProgress:
    """Where a generation is: `image` (0-based) of `images`, `step` of `steps` done."""

    image: int
    images: int
    step: int
    steps: int


def model_label(model: str, dtype: str = "float32") -> str:
    """The model menu's entry: name, family, parameters and estimated memory at its size."""
    size = ARCHITECTURES[model][1]
    memory = estimated_memory_bytes(model, size, dtype)
    return (
        f"{model}: {FAMILY_NAMES[FAMILIES[model]]}, {parameter_count(model) / 1e6:,.1f}M "
        f"parameters, ~{memory / 2**30:.2f} GiB at {size}px {dtype}"
    )


def applicable_accelerations(model: str) -> tuple[str, ...]:
    """The ACCELERATIONS a built-in architecture takes (all of them for a local folder: they
    are checked against the model once it is loaded)."""
    if model == LOCAL_MODEL:
        return tuple(ACCELERATIONS)
    return FAMILY_ACCELERATIONS[FAMILIES[model]]


def accelerate_options(request: Request) -> dict[str, Any]:
    """The request's accelerate() options (compile and freeze are not accelerate's)."""
    values = {
        "token_merging": request.tome_ratio,
        "deep_cache": request.deep_cache_interval,
        "block_cache": request.block_cache_threshold,
        "channels_last": True,
    }
    return {name: values[name] for name in request.accelerations if name in values}


def folder_weight_bytes(directory: Path) -> int:
    """The bytes of a diffusers folder's weight files: its parameters' memory, as stored."""
    suffixes = (".safetensors", ".bin", ".pt", ".pth")
    return sum(p.stat().st_size for p in directory.rglob("*") if p.suffix in suffixes)


class Studio:
    """The web UI's engine: one pipeline loaded at a time, one generation at a time (the page's
    queue runs one event at a time; a lock guards direct callers too)."""

    def __init__(self, allow_local_models: bool = False, device: Optional[str] = None) -> None:
        from ..device import DeviceManager

        self.dm = DeviceManager(device)
        # Each dtype's smoke test runs once: the device panel refreshes every few seconds,
        # also while generating, and every request is checked against this list.
        self.working_dtypes = self.dm.working_dtypes()
        self.allow_local_models = allow_local_models
        self._loaded: Optional[tuple[tuple[str, str], Any]] = None  # ((model, dtype), pipe)
        self._cancel = threading.Event()
        self._busy = threading.Lock()

    # ------------------------------------------------------------------ checks
    def check(self, request: Request) -> None:
        """Raises InputError for a request that cannot run, before anything is loaded."""
        self._check_numbers(request)
        self._check_choices(request)
        if request.local:
            self._check_folder(request)
            return
        if request.model not in ARCHITECTURES:
            raise InputError(f"unknown model {request.model!r}")
        self._check_accelerations(request, FAMILIES[request.model])
        size = request.size or ARCHITECTURES[request.model][1]
        config = architecture_summary(request.model)[1]
        problem = size_problem(
            FAMILIES[request.model], config, vae_scale_factor(request.model), size
        )
        if problem is not None:
            raise InputError(f"{request.model}: {problem}")
        # Images are generated one pipeline call at a time: one image's activations at a time.
        needed = estimated_memory_bytes(request.model, size, request.dtype, 1)
        self._check_memory(needed, request.model)

    @staticmethod
    def _check_numbers(request: Request) -> None:
        if not 1 <= request.steps <= MAX_STEPS:
            raise InputError(f"steps must be 1 to {MAX_STEPS}, got {request.steps}")
        if not 1 <= request.images <= MAX_IMAGES:
            raise InputError(f"number of images must be 1 to {MAX_IMAGES}, got {request.images}")
        if request.seed < 0:
            raise InputError(f"the seed must be >= 0, got {request.seed}")
        if request.size < 0:
            raise InputError(f"size must be positive (0: the model's), got {request.size}")

    def _check_choices(self, request: Request) -> None:
        from ..attention import strategies

        if request.dtype not in self.working_dtypes:
            working = ", ".join(self.working_dtypes)
            raise InputError(f"dtype {request.dtype} does not work on {self.dm.device}: {working}")
        if request.strategy not in strategies.STRATEGIES:
            raise InputError(f"unknown attention strategy {request.strategy!r}")
        reason = strategies.unavailable_reason(request.strategy, self.dm.device)
        if reason is not None:
            raise InputError(f"attention strategy {request.strategy}: {reason}")
        unknown = sorted(set(request.accelerations) - set(ACCELERATIONS))
        if unknown:
            raise InputError(f"unknown accelerations {unknown}; known: {', '.join(ACCELERATIONS)}")
        if {"compile", "freeze"} <= set(request.accelerations):
            raise InputError("choose compile or compile + freeze, not both")

    @staticmethod
    def _check_accelerations(request: Request, family: Optional[str]) -> None:
        taken = FAMILY_ACCELERATIONS.get(family, tuple(ACCELERATIONS))
        refused = [ACCELERATIONS[a] for a in request.accelerations if a not in taken]
        if refused:
            raise InputError(
                f"{', '.join(refused)} cannot run on {FAMILY_NAMES.get(family, family)} models "
                f"(this one takes: {', '.join(ACCELERATIONS[a] for a in taken)})"
            )

    def _check_folder(self, request: Request) -> None:
        if not self.allow_local_models:
            raise InputError(
                "local model folders are off: start the server with --allow-local-models"
            )
        directory = Path(request.folder).expanduser()
        if not request.folder.strip() or not directory.is_dir():
            raise InputError(f"{request.folder!r} is not a folder on the server")
        if not (directory / "model_index.json").is_file():
            raise InputError(
                f"{directory} is not a diffusers model folder: no model_index.json (save one "
                "with pipe.save_pretrained(DIR) or download a diffusers-format model)"
            )
        self._check_memory(folder_weight_bytes(directory), str(directory), "its weight files")

    def _check_memory(
        self, needed: int, what: str, estimate: str = MEMORY_ESTIMATE, loaded_counts: bool = True
    ) -> None:
        available = self.available_memory_bytes(loaded_counts)
        if available is not None and needed > available:
            raise InputError(
                f"{what} needs about {needed / 2**30:.1f} GiB ({estimate}) but "
                f"{available / 2**30:.1f} GiB is available: choose a smaller model, size or "
                "dtype"
            )

    def available_memory_bytes(self, loaded_counts: bool = True) -> Optional[int]:
        """Memory a new model can use: the device's free memory plus, when `loaded_counts`,
        what the loaded pipeline holds (it is released before another is loaded); None when
        unknown."""
        import torch

        if self.dm.device.type == "cpu":
            free = self.dm.memory_stats()["system_available_bytes"]
        else:
            module = getattr(torch, self.dm.device.type, None)
            if module is None or not hasattr(module, "mem_get_info"):
                return None
            free = module.mem_get_info(self.dm.device)[0]
        return free + (self._loaded_bytes() if loaded_counts else 0)

    def _loaded_bytes(self) -> int:
        if self._loaded is None:
            return 0
        modules = [m for m in self._loaded[1].components.values() if hasattr(m, "parameters")]
        return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())

    # ------------------------------------------------------------------ loading
    def pipeline(self, request: Request):
        """The request's pipeline on the device in its dtype: the loaded one when it is the
        same, else the loaded one is released first and the new one built or loaded (a local
        folder without a readable model_index.json is refused before: the loaded one stays)."""
        import torch

        key = (request.folder if request.local else request.model, request.dtype)
        if self._loaded is not None and self._loaded[0] == key:
            return self._loaded[1]
        if request.local:  # a folder that is no model costs nothing: the loaded one stays
            try:
                read_model_index(Path(request.folder).expanduser())
            except (ValueError, OSError) as e:
                raise InputError(f"cannot load {request.folder}: {e}") from e
        self.release()
        if request.local:
            try:
                pipe = load_pipeline(
                    Path(request.folder).expanduser(), torch_dtype=getattr(torch, request.dtype)
                )
            except (ValueError, OSError) as e:  # not loadable: the user's input, not a crash
                raise InputError(f"cannot load {request.folder}: {e}") from e
        else:
            pipe = build_pipeline(request.model)
        pipe = pipe.to(self.dm.device, getattr(torch, request.dtype))
        pipe.set_progress_bar_config(disable=True)
        self._loaded = (key, pipe)
        return pipe

    def release(self) -> None:
        """Drops the loaded pipeline and returns its memory."""
        self._loaded = None
        gc.collect()
        self.dm.empty_cache()

    def _check_loaded(self, pipe, request: Request) -> int:
        """A loaded folder's checks (its family and size are known only now); the size."""
        family = pipeline_family(pipe)
        if not request.local:
            return request.size or ARCHITECTURES[request.model][1]
        if family is None:
            raise InputError(
                f"{request.folder}: {type(denoiser(pipe)).__name__} is not a family npu_attn's "
                f"UI runs ({', '.join(FAMILY_NAMES.values())})"
            )
        self._check_accelerations(request, family)
        config = denoiser(pipe).config
        size = request.size or (config.get("sample_size") or 64) * pipe.vae_scale_factor
        problem = size_problem(family, config, pipe.vae_scale_factor, size)
        if problem is not None:
            raise InputError(f"{request.folder}: {problem}")
        channels = pipe.vae.config.block_out_channels
        activations = step_activation_bytes(
            family,
            config,
            channels,
            pipe.vae_scale_factor,
            size,
            ELEMENT_BYTES[request.dtype],
            1,  # one image per pipeline call
        ) + float32_decode_bytes(
            request.dtype,
            decodes_in_float32(family, pipe.vae.config),
            sum(p.numel() for p in pipe.vae.parameters()),
            channels,
            size,
            1,
        )
        self._check_memory(
            activations, f"{request.folder} at {size}px", "one step's activations", False
        )
        return size

    # ------------------------------------------------------------------ generating
    def cancel(self) -> None:
        """Stops the running generation after its current step."""
        self._cancel.set()

    def generate(
        self, request: Request, on_step: Optional[Callable[[StepProgress], None]] = None
    ) -> Iterator[GeneratedImage]:
        """The request's images, each as soon as it is decoded (seed, seed + 1, ...).
        Raises InputError for a request that cannot run; stops after the current step when
        cancelled (the last image is then partly denoised, and marked so)."""
        self.check(request)
        if not self._busy.acquire(blocking=False):
            raise InputError("a generation is already running: wait for it or cancel it")
        try:
            self._cancel.clear()
            pipe = self.pipeline(request)
            size = self._check_loaded(pipe, request)
            with configured(pipe, request) as attention_clock:
                embeds = prompt_embeddings(
                    pipe, pipe.dtype, self.dm.device, request.prompt.strip() or None
                )
                fit_size(pipe, size)
                for index in range(request.images):
                    progress = _Progress(index, request, on_step)
                    image = self._one_image(pipe, request, embeds, size, attention_clock, progress)
                    yield image
                    if image.cancelled:
                        return
        finally:
            self._busy.release()

    def _one_image(self, pipe, request, embeds, size, attention_clock, progress):
        """One image, timed from the call to its last step's end (the VAE decode after is
        not a step); the attention share is over the same span."""
        import torch

        clock = attention_clock or [0.0, 0]
        loop = {"start": time.perf_counter(), "end": None, "attention": clock[0]}
        attention_start = clock[0]

        def step_end(pipeline, step, timestep, callback_kwargs):
            loop["end"], loop["attention"] = time.perf_counter(), clock[0]
            progress.step_done(step + 1)
            if self._cancel.is_set():
                pipeline._interrupt = True  # diffusers skips the remaining steps
            return callback_kwargs

        with torch.no_grad():
            image = pipe(
                **embeds,
                num_inference_steps=request.steps,
                height=size,
                width=size,
                generator=self.dm.create_generator(request.seed + progress.index),
                callback_on_step_end=step_end,
            ).images[0]
        seconds = (loop["end"] or time.perf_counter()) - loop["start"]
        untimed_because = ""
        if attention_clock is None:
            untimed_because = "graph mode: it runs inside the compiled graph"
        elif attention_clock[1] == 0:
            untimed_because = "diffusers' own attention"
        share = (loop["attention"] - attention_start) / seconds if seconds else None
        return GeneratedImage(
            index=progress.index,
            image=image,
            seconds_per_step=seconds / max(1, progress.steps_done),
            attention_share=None if untimed_because else share,
            untimed_because=untimed_because,
            steps_done=progress.steps_done,
            # a Cancel arriving after the last step (during the decode) cancelled nothing here
            cancelled=self._cancel.is_set() and progress.steps_done < request.steps,
        )

    # ------------------------------------------------------------------ comparing
    def compare(
        self,
        request: Request,
        labels: list[str],
        repeats: int = 1,
        on_round: Optional[Callable[[int, int], None]] = None,
    ) -> dict[str, Any]:
        """The whole-image benchmark (bench --e2e --images) of the chosen configurations of
        the request's model, on the same seed, interleaved; the first configuration (the
        diffusers default, exact) is always run: it is the reference."""
        from .bench_e2e import ConfigurationError, check_image_configs, compare_images
        from .bench_e2e import image_configs as family_configs

        self.check(replace(request, accelerations=()))
        if not 1 <= repeats <= 5:
            raise InputError(f"rounds must be 1 to 5, got {repeats}")
        if not self._busy.acquire(blocking=False):
            raise InputError("a generation is already running: wait for it or cancel it")
        try:
            pipe = self.pipeline(request)
            size = self._check_loaded(pipe, request)
            configs = compare_configs(family_configs(pipeline_family(pipe), graph=False), labels)
            try:
                check_image_configs(pipe, request.model, configs)
            except ConfigurationError as e:
                raise InputError(str(e)) from e
            embeds = prompt_embeddings(pipe, pipe.dtype, self.dm.device)
            measured = compare_images(
                pipe, configs, embeds, request.steps, size, repeats, on_round, request.seed
            )
            return {"model": request.model, "size": size, "steps": request.steps, **measured}
        finally:
            self._busy.release()


class _Progress:
    """Counts one image's steps and reports them to the caller's on_step."""

    def __init__(self, index: int, request: Request, on_step) -> None:
        self.index, self.request, self.on_step = index, request, on_step
        self.steps_done = 0

    def step_done(self, steps_done: int) -> None:
        self.steps_done = steps_done
        if self.on_step is not None:
            report = StepProgress(self.index, self.request.images, steps_done, self.request.steps)
            self.on_step(report)


def compare_configs(configs, labels: list[str]) -> tuple:
    """The family's benchmark configurations named in `labels`, the reference first."""
    unknown = sorted(set(labels) - {label for label, _, _ in configs})
    if unknown:
        known = ", ".join(label for label, _, _ in configs)
        raise InputError(f"configurations {unknown} do not apply to this model; it takes {known}")
    return (configs[0],) + tuple(c for c in configs[1:] if c[0] in labels)


@contextlib.contextmanager
def configured(pipe, request: Request) -> Iterator[list]:
    """The request's attention strategy (timed, for the attention share) and accelerations on
    `pipe`, all removed on exit. Yields the attention clock: [seconds spent in npu_attn's
    attention runner, calls], growing as the pipeline runs; None in graph mode, where a timer
    around each attention call would split the compiled graph there (dynamo cannot trace
    time.perf_counter) and run the rest of each attention block eagerly."""
    from ..accel.registry import accelerate, reset_acceleration
    from ..graph.mode import compile as compile_pipeline
    from ..graph.mode import release_compiled_graphs, reset_compile
    from ..integration.processors import set_attention_strategy
    from .demo import time_attention

    compiling = {"compile", "freeze"} & set(request.accelerations)
    # The timer wraps the runner itself, which processors look up on every call.
    spent, restore = (None, lambda: None) if compiling else time_attention(request.strategy)
    try:
        reset_acceleration(pipe)
        set_attention_strategy(pipe, request.strategy)
        options = accelerate_options(request)
        if options:
            accelerate(pipe, **options)
        if compiling:
            freeze = "freeze" in compiling
            compile_pipeline(pipe, request.strategy, freeze=freeze, show_progress=False)
        yield spent
    finally:
        restore()
        if compiling:
            reset_compile(pipe)
            # Each request compiles afresh: inductor would otherwise keep each released
            # frozen graph's weights (~6.7 GB per float32 SD-1.5 request), and graphs compiled
            # unfrozen would pile up on nn.Module._call_impl, the one code object every module
            # is compiled through, until dynamo's recompile limit (8), after which requests
            # would silently run eagerly.
            release_compiled_graphs()
        reset_acceleration(pipe)


def device_report(dm, working_dtypes: Optional[list[str]] = None) -> list[tuple[str, str]]:
    """The device panel's rows: the DeviceManager's choice, memory in use, threads, the
    kernel variant per dtype and each attention strategy's availability. `working_dtypes`:
    the dtypes already found to work (None: smoke-test them now)."""
    from ..runtime import controls

    if working_dtypes is None:
        working_dtypes = dm.working_dtypes()
    info = dm.info()
    rows = [
        ("device", info["device"]),
        ("recommended dtype", info["dtype"]),
        ("working dtypes", ", ".join(working_dtypes)),
        ("threads", str(info["threads"])),
        ("CPU", controls.cpu_identity()),
        ("memory", dm.memory_summary()),
    ]
    for dtype, variant in controls.build_info()["active_isa"].items():
        rows.append((f"kernel variant, {dtype}", variant))
    for strategy, state in info["strategies"].items():
        rows.append((f"strategy {strategy}", state))
    return rows


__all__ = [
    "ACCELERATIONS",
    "FAMILY_ACCELERATIONS",
    "LOCAL_MODEL",
    "GeneratedImage",
    "InputError",
    "Request",
    "StepProgress",
    "Studio",
    "applicable_accelerations",
    "device_report",
    "model_label",
]
