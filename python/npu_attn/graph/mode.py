"""Graph mode: ``torch.compile`` with the chosen attention strategy inside the compiled graph.

``set_attention_strategy(model, s)`` followed by ``torch.compile(model)`` (or
``model.compile()``) compiles the chosen strategy into the graph: ``tiled`` appears as the
registered op ``torch.ops.npu_attn.sdpa_forward``, ``sdpa`` and ``vanilla`` as the torch ops they
are, and ``auto`` is resolved per attention shape while tracing (shapes are known then) and
baked in. Switching the strategy after compiling replaces the processors, which dynamo guards
on, so the next call recompiles with the new strategy (never a stale graph).

:func:`compile` does the whole job for a pipeline: switch the strategy, compile the components
that benefit (the UNet or transformer, the VAE decoder, optionally the text encoders), report
progress while the first call compiles and one line with the time it took; :func:`reset_compile`
puts the eager modules back. ``freeze=True`` adds inductor's freezing for inference (weights
become constants of the graph, prepacked for oneDNN): the big CPU win, with a memory cost and a
check that the weights it froze are still the module's (:class:`FrozenWeightsChanged`).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Optional

import torch

from ..components import StateAttribute, models_of
from ..integration.processors import set_attention_strategy
from ..runtime import ascend
from .frozen_conv import FrozenConvPass, check_float32_convs
from .frozen_linear import FrozenLinearPass, check_float32_linears

__all__ = ["FrozenWeightsChanged", "compile", "compiled_components", "reset_compile"]

# On the target: {component name: the module compile() compiled}.
_COMPILED = StateAttribute("_npu_attn_compiled")
DENOISERS = ("unet", "transformer", "prior")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")


class FrozenWeightsChanged(RuntimeError):
    """A module compiled with ``freeze=True`` was called after its weights changed: its graph
    holds the old weights as constants and would silently compute with them."""


def _weights_fingerprint(module: torch.nn.Module) -> tuple:
    """Which tensors the module's parameters and buffers are, where their data lives, and their
    in-place version counters: changes when a weight is replaced, its ``.data`` swapped, or it
    is modified in place (load_state_dict, an optimizer step, fusing a LoRA)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return tuple((id(t), t.data_ptr(), t._version) for t in tensors)


class _FrozenWeightsGuard:
    """Remembers the weights a frozen graph was built from (at the first call without
    gradients, where inductor freezes) and refuses later inference calls once they changed."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.module = module
        self.name = name
        self.fingerprint: Optional[tuple] = None

    def check(self) -> None:
        if torch.is_grad_enabled():  # inductor freezes inference graphs only
            return
        current = _weights_fingerprint(self.module)
        if self.fingerprint is None:
            self.fingerprint = current
        elif current != self.fingerprint:
            raise FrozenWeightsChanged(
                f"{self.name} was compiled with freeze=True and its weights changed since "
                "(replaced, moved, or modified in place); its compiled graph holds the old "
                "weights. Call npu_attn.reset_compile(target) and npu_attn.compile(target, ...) "
                "again, or compile with freeze=False to change weights between calls"
            )


def _frozen_entry(module: torch.nn.Module):
    """The module's call as a function of this file's own: dynamo caches graphs per code
    object and, with the parameters as graph inputs, an unfrozen graph of the same module
    (``torch.compile(module)`` shares ``nn.Module._call_impl``'s code) would pass the guards
    of a frozen call and run unfrozen.

    Each module's entry has a code object of its own (a copy): frozen graphs guard on their
    parameters' identity, so on one shared code object every frozen module of the process (and
    every input shape of each) would take one of dynamo's ``recompile_limit`` (8) entries, and
    from the ninth on modules would silently run eagerly."""

    def frozen_call(*args, **kwargs):
        return module._call_impl(*args, **kwargs)

    frozen_call.__code__ = frozen_call.__code__.replace()
    return frozen_call


class _TimedFirstCall:
    """The compiled call of one module; its first call (where dynamo and inductor compile)
    shows a progress line with the elapsed time, then one line with the total. With a
    frozen-weights guard, every call first checks the weights are still the frozen ones."""

    def __init__(
        self,
        compiled,
        name: str,
        show_progress: bool,
        frozen_guard: Optional[_FrozenWeightsGuard] = None,
        linear_pass: Optional[FrozenLinearPass] = None,
        conv_pass: Optional[FrozenConvPass] = None,
    ) -> None:
        self.compiled = compiled
        self.name = name
        self.show_progress = show_progress
        self.frozen_guard = frozen_guard
        self.linear_pass = linear_pass
        self.conv_pass = conv_pass
        self.first_call_seconds: Optional[float] = None

    def __call__(self, *args, **kwargs):
        if self.frozen_guard is None:
            return self._timed(*args, **kwargs)
        self.frozen_guard.check()
        # dynamo reads inductor's global freezing flag while tracing (to make the parameters
        # static), which torch.compile(options=...) does not set: patch it around the call,
        # where tracing and compilation happen. The float32 convolution and linear passes go in
        # the same way, each first in a tuple with the user's own passes of that kind, which
        # inductor runs in order.
        from torch._inductor import config as inductor_config
        from torch._inductor.custom_graph_pass import get_custom_graph_passes

        patches: dict[str, Any] = {"freezing": True}
        for setting, our_pass in (
            ("post_grad_custom_pre_pass", self.conv_pass),
            ("post_grad_custom_post_pass", self.linear_pass),
        ):
            if our_pass is not None:
                user_passes = get_custom_graph_passes(getattr(inductor_config, setting))
                patches[setting] = (our_pass,) + tuple(p for p in user_passes if p is not our_pass)
        with inductor_config.patch(**patches):
            return self._timed(*args, **kwargs)

    def _timed(self, *args, **kwargs):
        if self.first_call_seconds is not None:
            return self.compiled(*args, **kwargs)
        done = threading.Event()
        start = time.perf_counter()
        ticker = None
        if self.show_progress:
            ticker = threading.Thread(target=self._tick, args=(start, done), daemon=True)
            ticker.start()
        try:
            return self.compiled(*args, **kwargs)
        finally:
            done.set()
            if ticker is not None:
                ticker.join()
            self.first_call_seconds = time.perf_counter() - start
            if self.show_progress:
                print(
                    f"npu_attn.compile: {self.name} compiled in {self.first_call_seconds:.1f} s "
                    f"(its first call, including running it once){self._passes_note()}",
                    file=sys.stderr,
                )

    def _passes_note(self) -> str:
        note = ""
        convs = self.conv_pass.counts if self.conv_pass is not None else {}
        if convs:
            note += (
                f"; float32 3x3 stride-1 convolutions: {convs.get('winograd', 0)} Winograd, "
                f"{convs.get('direct', 0)} direct ({self.conv_pass.choice})"
            )
        linears = self.linear_pass.counts if self.linear_pass is not None else {}
        if linears:
            note += (
                f"; float32 linears: {linears.get('onednn', 0)} on oneDNN, "
                f"{linears.get('mkl', 0)} on MKL ({self.linear_pass.choice})"
            )
        return note

    def _tick(self, start: float, done: threading.Event) -> None:
        from tqdm import tqdm

        with tqdm(
            desc=f"npu_attn.compile: compiling {self.name}",
            bar_format="{desc}: {elapsed}",
            file=sys.stderr,
            leave=False,
        ) as bar:
            while not done.wait(0.5):
                bar.refresh()


def _components(target: Any, text_encoder: bool) -> dict[str, torch.nn.Module]:
    """The modules worth compiling: a model itself, or a pipeline's denoiser, VAE decoder and
    (if asked) text encoders."""
    if isinstance(target, torch.nn.Module):
        return {type(target).__name__: target}
    components = models_of(target)
    chosen = {}
    for name in DENOISERS:
        if isinstance(components.get(name), torch.nn.Module):
            chosen[name] = components[name]
    vae = components.get("vae")
    if isinstance(getattr(vae, "decoder", None), torch.nn.Module):
        chosen["vae.decoder"] = vae.decoder
    if text_encoder:
        for name in TEXT_ENCODERS:
            if isinstance(components.get(name), torch.nn.Module):
                chosen[name] = components[name]
    if not chosen:
        raise ValueError(f"{type(target).__name__} has no UNet, transformer or VAE to compile")
    return chosen


def _default_backend(components: dict[str, torch.nn.Module]) -> str:
    on_npu = any(p.device.type == "npu" for m in components.values() for p in m.parameters())
    return "torchair" if on_npu else "inductor"


def torchair_backend():
    """torchair's torch.compile backend for Ascend NPUs, with frozen parameters (the graph mode
    of Ascend's SD-2.1 port). Raises RuntimeError, saying why, without torch_npu or an NPU."""
    torch_npu, reason = ascend.torch_npu()
    if torch_npu is None:
        raise RuntimeError(
            f"backend='torchair' is Ascend's graph mode and needs torch_npu: {reason}"
        )
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        raise RuntimeError(
            "backend='torchair' compiles for an Ascend NPU and none is available here; use "
            "backend='inductor' (the default off the NPU)"
        )
    import torchair  # shipped inside torch_npu (torch_npu/dynamo/torchair)

    config = torchair.CompilerConfig()
    config.experimental_config.frozen_parameter = True
    return torchair.get_npu_backend(compiler_config=config)


def compile(
    target: Any,
    strategy: Optional[str] = "auto",
    *,
    mode: Optional[str] = None,
    dynamic: Optional[bool] = None,
    fullgraph: bool = False,
    backend: Optional[str] = None,
    freeze: bool = False,
    float32_linears: str = "auto",
    float32_convs: str = "auto",
    text_encoder: bool = False,
    show_progress: bool = True,
) -> dict[str, str]:
    """Switch ``target`` to ``strategy`` and compile what benefits, in place.

    Args:
        target: a diffusers pipeline (its UNet or transformer and VAE decoder are compiled) or a
            single model.
        strategy: the attention strategy to compile in (``"auto"``, ``"tiled"``, ``"sdpa"``,
            ``"vanilla"``, ``"npu"``); ``None`` keeps the processors as they are.
        mode, dynamic, fullgraph: passed to :func:`torch.compile`.
        backend: :func:`torch.compile`'s backend. ``"torchair"`` is Ascend's graph mode
            (torchair's ``get_npu_backend`` with frozen parameters, as Ascend's SD-2.1 port
            uses it), for models on an NPU; it needs torch_npu and an NPU and raises otherwise.
            ``None``: ``"torchair"`` when the compiled components are on an NPU, else
            ``"inductor"``.
        freeze: inductor's freezing (``backend="inductor"`` only) for calls under
            ``torch.no_grad`` / ``torch.inference_mode``: the weights become constants of the
            compiled graph, so convolutions and linears are prepacked for oneDNN and constant
            work is folded away (measured per SD-1.5 UNet step on a 2-core Sapphire Rapids:
            1.6x in bfloat16 and 1.2x in float32 over compiling without it; BENCHMARKS.md).
            Costs: the prepacked copies of the weights live next to the module's own (about
            the compiled components' weight size again), and the graph cannot see later weight
            changes, so each inference call checks the weights are the ones it froze and raises
            :class:`FrozenWeightsChanged` if not. Calls with gradients enabled (training)
            compile without freezing and are not checked.
        float32_linears: with ``freeze=True``, which library computes float32 linears:
            ``"mkl"`` (inductor's own choice), ``"onednn"``, or ``"auto"``: per linear shape,
            oneDNN where it measures at least 5% faster than MKL on this machine (each shape
            is timed once per process while compiling, ~0.1 s each). On an AMD Zen 4 oneDNN
            is 1.2-1.5x faster on the SD-1.5 UNet's linears (a float32 step ~6% faster); both
            compute in float32, outputs agree to rounding. The compile line reports the split.
        float32_convs: with ``freeze=True``, how float32 3x3 convolutions (stride 1, padding 1)
            are computed: ``"direct"`` (oneDNN, inductor's own choice), ``"winograd"``
            (Winograd F(4x4, 3x3), :mod:`npu_attn.graph.winograd`: 4x fewer multiplications; 3-5x
            the direct convolution's float32 rounding error, ~1e-5 of the output's largest
            magnitude; transformed weights 4x the size of the kernels), or ``"auto"``: per
            shape, Winograd where it measures at least 10% faster on this machine (each shape
            timed once per process while compiling, ~1-2 s each). On an AMD Zen 4 it is
            1.5-2.4x faster on the SD-1.5 UNet's convolutions at 64x64 to 16x16 latents (a
            float32 step 1.25x faster). bfloat16 convolutions are never changed. The compile
            line reports the split.
        text_encoder: also compile the text encoders (their attention is not switched; they
            rarely dominate a diffusion step).
        show_progress: show the elapsed time while each component's first call compiles, and
            one line with the time it took.

    Returns:
        The compiled components and the strategy applied, e.g.
        ``{"unet": "auto", "vae.decoder": "auto"}``.

    Compilation happens on the first call of each component (the first denoising step and the
    first decode). :func:`reset_compile` restores the eager modules.
    """
    components = _components(target, text_encoder)
    check_float32_linears(float32_linears)
    check_float32_convs(float32_convs)
    for option, value in (("float32_linears", float32_linears), ("float32_convs", float32_convs)):
        if value != "auto" and not freeze:
            raise ValueError(f"{option}={value!r} applies to frozen graphs only: pass freeze=True")
    backend = backend or _default_backend(components)
    if freeze and backend != "inductor":
        raise ValueError(
            "freeze=True needs backend='inductor' (freezing is an inductor pass), got "
            f"backend={backend!r}"
        )
    if fullgraph:
        from ..accel.registry import acceleration_of

        # channels-last only changes the weights' layout, which traces like any other
        applied_methods = set(acceleration_of(target)) - {"channels_last"}
        if applied_methods:
            raise ValueError(
                f"fullgraph=True cannot trace {', '.join(sorted(applied_methods))} (Token "
                "Merging's random destination draw and the caches' step bookkeeping break the "
                "graph); use fullgraph=False or npu_attn.reset_acceleration(target) first"
            )
    compiler = torchair_backend() if backend == "torchair" else backend
    applied = "unchanged"
    if strategy is not None:
        applied = set_attention_strategy(target, strategy)
    compiled = _COMPILED.get(target) or {}
    for name, module in components.items():
        call = torch.compile(
            _frozen_entry(module) if freeze else module._call_impl,
            mode=mode,
            dynamic=dynamic,
            fullgraph=fullgraph,
            backend=compiler,
        )
        # What nn.Module.compile() does, with the first call timed around the compiled call.
        guard = _FrozenWeightsGuard(module, name) if freeze else None
        linear_pass = FrozenLinearPass(float32_linears) if freeze else None
        conv_pass = FrozenConvPass(float32_convs) if freeze else None
        module._compiled_call_impl = _TimedFirstCall(
            call, name, show_progress, guard, linear_pass, conv_pass
        )
        compiled[name] = module
    _COMPILED.set(target, compiled)
    return {name: applied for name in components}


def compiled_components(target: Any) -> dict[str, Optional[float]]:
    """The components :func:`compile` compiled, with their first call's seconds (None: not
    called yet)."""
    compiled = _COMPILED.get(target) or {}
    return {
        name: getattr(module._compiled_call_impl, "first_call_seconds", None)
        for name, module in compiled.items()
    }


def reset_compile(target: Any) -> None:
    """Put back the eager modules :func:`compile` compiled (the attention strategy stays; see
    :func:`npu_attn.reset_attention_strategy`)."""
    _COMPILED.remove(target, _restore_eager)


def _restore_eager(compiled: dict[str, torch.nn.Module]) -> None:
    for module in compiled.values():
        module._compiled_call_impl = None


# Where inductor loads the Python module of each graph it generates (its output code).
INDUCTOR_MODULE_PREFIX = "torch._inductor.runtime.compile_tasks."


def release_compiled_graphs() -> int:
    """Drops every graph compiled in this process and the memory it holds, for processes that
    own every compiled model in them (the benchmark, the web UI's server); returns how many
    generated modules were dropped.

    ``torch.compiler.reset()`` drops dynamo's caches, but inductor keeps the Python module it
    generated for each graph in ``sys.modules`` and its module cache, and a frozen graph's
    weights (oneDNN-packed linears, Winograd-transformed convolutions) are attributes of that
    module: a float32 SD-1.5 UNet compiled with ``freeze=True`` kept ~6.7 GB after its
    compiled copy was gone (measured on Sapphire Rapids), so three such compiles ran out of
    24 GiB. This also drops those modules and their tensors (the next compile loads its code
    afresh), then returns the freed heap to the OS (another 1-2.2 GB per float32 SD-1.5 compile
    that would stay in glibc's heap). A model compiled with ``torch.compile`` recompiles at its
    next call; a callable that holds inductor's output directly would break, which is why
    :func:`reset_compile` does not do this."""
    import gc

    from torch._inductor.codecache import PyCodeCache

    from ..runtime.controls import release_cpu_memory

    torch.compiler.reset()
    names = [n for n in list(sys.modules) if n.startswith(INDUCTOR_MODULE_PREFIX)]
    for name in names:
        module = sys.modules.pop(name)
        for attr, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                delattr(module, attr)
    PyCodeCache.cache_clear()
    gc.collect()
    release_cpu_memory()
    return len(names)
