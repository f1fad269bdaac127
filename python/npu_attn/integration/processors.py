"""``set_attention_strategy``: switch a diffusers pipeline or model between attention strategies.

Design: npu_attn does not re-implement diffusers' processors. It wraps each attention module's
*own* processor in a thin ``StrategyProcessor`` that runs it unchanged while routing its
``scaled_dot_product_attention`` call to the chosen strategy (see
:mod:`npu_attn.integration.redirect`).
So every step diffusers performs (group/spatial norm, 4-D inputs, ``prepare_attention_mask``,
``norm_cross``, RoPE, QK norms, joint text+image attention, residual, rescale, tuple returns)
is exactly diffusers' own code, for the UNet, VAE, SD3, Flux, HiDream and models added later;
only the attention product itself changes. The one exception is ``vanilla`` on classic
``Attention`` modules, which installs diffusers' own ``AttnProcessor`` (its explicit
matmul-softmax-matmul processor); elsewhere ``vanilla`` is the same matmul-softmax-matmul
computation reached through the redirect.

Attention modules are found by walking ``model.modules()`` for objects with a ``processor``
and ``set_processor`` (HiDream has no model-level ``set_attn_processor``). The original
processor objects are remembered on first use and restored exactly by
:func:`reset_attention_strategy`.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any, Optional

import torch

from ..accel.registry import accelerate_from_environment
from ..attention import config, strategies
from ..attention.config import default_strategy
from ..components import StateAttribute, models_of
from . import redirect as _redirect
from .dispatcher import DiffusersBackendUnavailable, register_diffusers_backends
from .wrapping import FallThrough, RoutedProcessor, attention_modules, routed_class

logger = logging.getLogger("npu_attn")

# On each switched model: {module name: its processor before npu_attn first switched it}.
_ORIGINALS = StateAttribute("_npu_attn_original_processors")
_TARGET_EXPECTED = (
    "target must be a diffusers pipeline, a torch.nn.Module (e.g. a UNet or transformer) or None"
)


# --------------------------------------------------------------------------- processors
class _RoutesSdpa(RoutedProcessor):
    """Shared behaviour: run ``self.inner`` with its SDPA call routed to ``self.strategy``."""

    def _bind(self, inner: Any, strategy: str) -> None:
        self.inner = inner
        self.strategy = strategy

    @property
    def route(self) -> Any:
        """The strategy's runner, looked up on every call rather than kept: a runner wrapped
        while this processor was made (the demo's attention timer) must not outlive its
        wrapper, whose time.perf_counter would split compiled graphs."""
        return strategies.RUNNERS[self.strategy]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy!r}, inner={self.inner!r})"

    # Pickling (torch.save of a switched model). The classes routed_class makes at run time
    # cannot be found by name, so they pickle as "the wrapper class of <inner class>" and are
    # remade on load. The runner is not pickled: it is looked up from the strategy name.
    def __reduce__(self):
        if isinstance(self, torch.nn.Module):
            state = torch.nn.Module.__getstate__(self)
        else:
            state = self.__dict__
        state = {k: v for k, v in state.items() if k != "_sdpa"}
        cls = type(self)
        return (_unpickle_processor, (cls._wraps or cls, cls._wraps is not None), state)

    def __setstate__(self, state: dict) -> None:
        state = {k: v for k, v in state.items() if k != "_sdpa"}  # saved by older releases
        strategy = state.get("strategy")
        if strategy not in strategies.RUNNERS:  # at load, not at the model's first call
            known = ", ".join(sorted(strategies.RUNNERS))
            raise ValueError(
                f"a pickled npu_attn processor routes attention to strategy {strategy!r}, "
                f"which this npu_attn does not have (it has {known})"
            )
        if isinstance(self, torch.nn.Module):
            torch.nn.Module.__setstate__(self, state)
        else:
            self.__dict__.update(state)


class StrategyProcessor(_RoutesSdpa, FallThrough):
    """Runs a model's own attention processor with its SDPA call routed to a strategy.

    Attribute access falls through to the wrapped processor, and ``__call__`` advertises the
    wrapped processor's signature (diffusers filters ``cross_attention_kwargs`` by it).
    """

    def __init__(self, inner: Any, strategy: str) -> None:
        self._bind(inner, strategy)


class StrategyModuleProcessor(_RoutesSdpa, torch.nn.Module):
    """``StrategyProcessor`` for processors that are ``nn.Module``s (e.g. IP-Adapter ones):
    keeps their weights registered, so ``.to(device)`` and ``state_dict`` still reach them."""

    def __init__(self, inner: torch.nn.Module, strategy: str) -> None:
        torch.nn.Module.__init__(self)
        self._bind(inner, strategy)


def _wrapper_class(inner_cls: type) -> type:
    """A StrategyProcessor subclass whose ``__call__`` has ``inner_cls.__call__``'s signature."""
    base = StrategyModuleProcessor if issubclass(inner_cls, torch.nn.Module) else StrategyProcessor
    return routed_class(base, inner_cls, "Npu")


def _unpickle_processor(cls: type, wrapper_of_cls: bool):
    """An empty processor for pickle to fill: of ``_wrapper_class(cls)`` when
    ``wrapper_of_cls``, else of ``cls``. A loaded model routes SDPA like the saved one did, so
    the redirect shim is installed (a fresh process has not installed it yet)."""
    _redirect.install()
    if wrapper_of_cls:
        cls = _wrapper_class(cls)
    return cls.__new__(cls)


def _wrap(processor: Any, strategy: str):
    return _wrapper_class(type(processor))(_on_native_sdpa(processor), strategy)


def _on_native_sdpa(processor: Any) -> Any:
    """A processor that reaches attention through diffusers' dispatcher (it has an
    ``_attention_backend``) runs, inside npu_attn's wrapper, as a copy pinned to the dispatcher's
    native backend: that backend ends in torch's SDPA, which the redirect routes to the chosen
    strategy. Unpinned, a processor with no backend of its own follows the dispatcher's active
    backend, which diffusers' ``set_attention_backend`` on *any* model sets for the whole process
    (``model_a.set_attention_backend("npu_attn_auto")`` would otherwise make
    ``set_attention_strategy(model_b, "tiled")`` run ``auto``). The user's processor is not
    changed (a copy; ``reset_attention_strategy`` restores the original); processors that are
    ``nn.Module``s are left as they are (a shallow copy would share their parameter dicts)."""
    if not hasattr(processor, "_attention_backend") or isinstance(processor, torch.nn.Module):
        return processor
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName
    except ImportError:  # a diffusers without the dispatcher: nothing to pin
        return processor
    pinned = copy.copy(processor)
    pinned._attention_backend = AttentionBackendName.NATIVE
    return pinned


def _uses_matmul_processor(processor: Any) -> bool:
    from diffusers.models.attention_processor import AttnProcessor

    return type(processor) is AttnProcessor


def _processor_for(module: Any, original: Any, strategy: str):
    from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

    classic = type(module) is Attention
    if strategy == "vanilla" and classic and type(original) is AttnProcessor2_0:
        return AttnProcessor()  # diffusers' own explicit matmul-softmax-matmul processor
    if _uses_matmul_processor(original):
        if strategy == "vanilla":
            return original
        original = AttnProcessor2_0()  # the SDPA form of the same processor, so it can redirect
    return _wrap(original, strategy)


# --------------------------------------------------------------------------- targets
def _model_device(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _resolved_name(strategy: str, device: torch.device) -> str:
    """What ``auto`` amounts to on a device (for reporting)."""
    if strategy != "auto":
        return strategy
    if device.type == "cpu":
        return "auto"  # measured per attention shape on first use
    return "npu" if strategies.unavailable_reason("npu", device) is None else "sdpa"


def _apply_to_model(name: str, model: torch.nn.Module, strategy: str) -> int:
    modules = list(attention_modules(model))
    if not modules:
        return 0
    originals = _ORIGINALS.get(model)
    if originals is None:
        originals = {n: m.processor for n, m in modules}
        _ORIGINALS.set(model, originals)
    for module_name, module in modules:
        original = originals.get(module_name, module.processor)
        module.set_processor(_processor_for(module, original, strategy))
    return len(modules)


def _register_dispatcher_backends() -> None:
    """Offer npu_attn to ``model.set_attention_backend`` users as well (best effort: a
    diffusers without the dispatcher internals it relies on only loses that way in)."""
    try:
        register_diffusers_backends()
    except DiffusersBackendUnavailable as error:
        logger.debug("npu_attn: not registered with diffusers' dispatcher: %s", error)


def set_attention_strategy(target: Any = None, strategy: Optional[str] = None, **options) -> str:
    """Switch attention for a pipeline, a model, or (``target=None``) the default.

    Args:
        target: a diffusers pipeline (every model component is switched), a model such as a
            ``UNet2DConditionModel``, ``SD3Transformer2DModel``, ``FluxTransformer2DModel`` or
            ``HiDreamImageTransformer2DModel``, or ``None`` to set the default strategy: used for
            models switched later without a strategy, and preferred by direct
            :func:`npu_attn.scaled_dot_product_attention` calls where it can run them.
        strategy: ``"vanilla"``, ``"sdpa"``, ``"tiled"``, ``"npu"``, ``"auto"`` or (lossy,
            opt-in) ``"int8"``; ``None`` uses :func:`default_strategy`.
        options: reserved; unknown options raise ``TypeError``.

    Returns:
        The strategy applied (for ``auto`` on an accelerator, what it resolved to).

    Raises:
        ValueError: unknown strategy, or one unavailable for the model's device (the message
            lists the valid ones and why this one cannot run).
        TypeError: a strategy that is not a string, or unknown options.
    """
    if options:
        raise TypeError(f"set_attention_strategy got unexpected options: {sorted(options)}")
    if strategy is not None and not isinstance(strategy, str):
        raise TypeError(
            f"strategy must be a str (one of {', '.join(strategies.STRATEGIES)}) or None, "
            f"got {type(strategy).__name__}"
        )
    chosen = (strategy or default_strategy()).strip().lower()
    if target is None:
        strategies.check_strategy(chosen)
        config.set_default_strategy(chosen)
        logger.info("npu_attn: default attention strategy set to %s", chosen)
        return chosen

    models = models_of(target, _TARGET_EXPECTED)
    devices = {n: _model_device(m) for n, m in models.items()}
    for device in devices.values():  # validate everything before changing anything
        strategies.check_strategy(chosen, device)
    _redirect.install()
    _register_dispatcher_backends()
    applied = []
    for name, model in models.items():
        count = _apply_to_model(name, model, chosen)
        if count:
            resolved = _resolved_name(chosen, devices[name])
            applied.append(resolved)
            logger.info("npu_attn: %s: %d attention processors -> %s", name, count, resolved)
    if not applied:
        raise ValueError(f"{type(target).__name__} has no attention modules to switch")
    # NPU_ATTN_TOME / NPU_ATTN_DEEPCACHE: the step accelerations, for scripts that only switch
    # attention (nothing happens when neither is set; lossy methods are never on by default).
    accelerate_from_environment(target)
    return applied[0] if len(set(applied)) == 1 else ",".join(sorted(set(applied)))


def reset_attention_strategy(target: Any = None) -> None:
    """Restore the processors a pipeline/model had before npu_attn touched it (the same
    objects). ``None`` resets the default strategy instead."""
    if target is None:
        config.set_default_strategy(None)
        return
    for model in models_of(target, _TARGET_EXPECTED).values():
        _ORIGINALS.remove(model, functools.partial(_restore_processors, model))


def _restore_processors(model: torch.nn.Module, originals: dict[str, Any]) -> None:
    for module_name, module in attention_modules(model):
        if module_name in originals:
            module.set_processor(originals[module_name])


def attention_strategy_of(model: torch.nn.Module) -> dict[str, int]:
    """Count of attention processors per strategy in ``model`` ("original" = untouched)."""
    counts: dict[str, int] = {}
    for _, module in attention_modules(model):
        processor = module.processor
        if isinstance(processor, _RoutesSdpa):
            key = processor.strategy
        elif _uses_matmul_processor(processor) and _ORIGINALS.get(model) is not None:
            key = "vanilla"
        else:
            key = "original"
        counts[key] = counts.get(key, 0) + 1
    return counts
