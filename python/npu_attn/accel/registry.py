"""``accelerate``: Token Merging, DeepCache, block caching and the channels-last layout for a
pipeline in one call, undone by one call.

The first three trade quality for speed, and channels-last changes the layout of the user's
weights, so none is ever enabled by default: only an explicit option or environment variable
turns one on. They compose with every attention strategy and
with each other: Token Merging hooks the UNet's transformer blocks (:mod:`.token_merging`),
DeepCache gives its blocks a caching ``forward`` (:mod:`.deep_cache`), block caching does the
same for a transformer's blocks (:mod:`.block_cache`), channels-last changes only the memory
layout of convolutional models (:mod:`.channels_last`, exact), attention strategies replace
attention *processors*; each undo removes only its own changes. Accelerated models and
pipelines pickle and deep-copy (except diffusers' own cache hooks, whose forwards are
closures).

Environment (for scripts that should benefit unchanged; read by ``accelerate(pipe)`` without
options):

- ``NPU_ATTN_TOME=0.5``: Token Merging with this ratio (tomesd's other defaults).
- ``NPU_ATTN_DEEPCACHE=3``: DeepCache with this cache interval (branch 0).
- ``NPU_ATTN_BLOCK_CACHE=0.1``: First Block Cache with this threshold (transformer models).
- ``NPU_ATTN_CHANNELS_LAST=1``: the UNet and VAE in channels-last (``0``: leave them).

Under ``torch.compile`` (``npu_attn.compile`` or ``torch.compile(pipe.unet)``) Token Merging and
DeepCache run with the default ``fullgraph=False``: Token Merging's hooks trace into the graph
with a break at its seeded random draw, DeepCache breaks the graph at its step lookup and
recompiles for skipped steps. ``fullgraph=True`` cannot trace either and raises dynamo's
``Unsupported`` error.

A variable that does not apply to the pipeline's model family (e.g. ``NPU_ATTN_TOME`` for a
Flux pipeline) is skipped with a warning, so one environment can serve every script; the same
option passed explicitly raises.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from . import block_cache, channels_last, deep_cache, token_merging
from .base import Method, ModelFamilyError

logger = logging.getLogger("npu_attn")

__all__ = [
    "ENVIRONMENT",
    "METHODS",
    "METHODS_TABLE",
    "ModelFamilyError",
    "accelerate",
    "accelerate_from_environment",
    "acceleration_of",
    "check_acceleration",
    "environment_options",
    "reset_acceleration",
]

# One row per method, in the order they are applied and removed: a new method is a module with
# a ``METHOD`` row (see .base.Method) and its line here.
METHODS_TABLE: tuple[Method, ...] = (
    token_merging.METHOD,
    deep_cache.METHOD,
    block_cache.METHOD,
    channels_last.METHOD,
)
_BY_NAME = {method.name: method for method in METHODS_TABLE}
METHODS = tuple(_BY_NAME)
ENVIRONMENT = {method.name: method.variable for method in METHODS_TABLE}


def environment_options() -> dict[str, Any]:
    """The methods the environment asks for, e.g. ``{"token_merging": 0.5, "deep_cache": 3}``.

    Raises:
        ValueError: a variable that is set but not a value of the right kind.
    """
    options: dict[str, Any] = {}
    for method in METHODS_TABLE:
        text = os.environ.get(method.variable, "").strip()
        if not text:
            continue
        try:
            options[method.name] = method.parse(text)
        except ValueError:
            raise ValueError(f"{method.variable} must be {method.expected}, got {text!r}") from None
    return options


def _checked_environment_options(target: Any) -> dict[str, Any]:
    """The environment's options that apply to ``target``; the others are skipped with a
    warning (a bad value still raises: it is a typo, not a model mismatch)."""
    checked = {}
    for method, value in environment_options().items():
        variable = f"{ENVIRONMENT[method]}={os.environ[ENVIRONMENT[method]].strip()}"
        try:
            checked[method] = _BY_NAME[method].check(target, value)
        except ModelFamilyError as error:
            logger.warning(
                "npu_attn: %s ignored for %s: %s", variable, type(target).__name__, error
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"{variable}: {error}") from None
    return checked


def accelerate(
    target: Any,
    *,
    token_merging: Any = None,
    deep_cache: Any = None,
    block_cache: Any = None,
    channels_last: Optional[bool] = None,
    **unknown: Any,
) -> dict[str, dict[str, Any]]:
    """Enable Token Merging, DeepCache, block caching and/or the channels-last layout on a
    pipeline (each replaces an earlier setting).

    Args:
        target: a diffusers pipeline (Token Merging also takes a ``UNet2DConditionModel``).
        token_merging: a ratio in [0, 1) (0 is exact), or a dict of
            :class:`~npu_attn.accel.token_merging.TokenMergingOptions` fields (``ratio``,
            ``max_downsample``, ``sx``, ``sy``, ``use_rand``, ``merge_attn``,
            ``merge_crossattn``, ``merge_mlp``, ``seed``). UNet models (SD-1.5/2.1, SDXL).
        deep_cache: a cache interval >= 1 (1 is exact), or a dict with ``cache_interval`` and
            ``cache_branch_id``, for UNet pipelines; for transformer models with diffusers'
            cache hooks, one of diffusers' cache configs (e.g. ``FirstBlockCacheConfig``).
        block_cache: First Block Cache for transformer models: a threshold >= 0 (0 is exact),
            or a dict of :class:`~npu_attn.accel.block_cache.BlockCacheOptions` fields
            (``threshold`` or ``interval``). SD3 and HiDream (npu_attn's), models with
            diffusers' cache hooks (Flux, ...: diffusers' ``FirstBlockCache``).
        channels_last: ``True`` puts every model with 2-D convolutions (UNet, VAE) in the
            channels-last memory format (exact; faster convolutions on CPU), ``False`` back in
            the contiguous one.
        unknown: anything else raises ``TypeError``.

    With no option, the environment decides (``NPU_ATTN_TOME``, ``NPU_ATTN_DEEPCACHE``,
    ``NPU_ATTN_BLOCK_CACHE``, ``NPU_ATTN_CHANNELS_LAST``); unset, nothing changes. ``None``
    leaves a method as it is.

    Returns:
        What was applied, per method, e.g. ``{"token_merging": {"ratio": 0.5, ...,
        "blocks": 16}, "deep_cache": {"cache_interval": 3, "cache_branch_id": 0, ...}}``.

    Raises:
        TypeError, ValueError: an unknown or invalid option, or a method that does not apply
            to this model family. Everything is validated before anything changes.
    """
    requested = {
        "token_merging": token_merging,
        "deep_cache": deep_cache,
        "block_cache": block_cache,
        "channels_last": channels_last,
    }
    checked = _checked_options(target, requested, unknown)
    applied = {
        method: _BY_NAME[method].apply(target, options) for method, options in checked.items()
    }
    for method, settings in applied.items():
        logger.info("npu_attn: %s: %s -> %s", type(target).__name__, method, settings)
    return applied


def _checked_options(
    target: Any, requested: dict[str, Any], unknown: dict[str, Any]
) -> dict[str, Any]:
    """accelerate's options for ``target`` validated (the environment's when none is given),
    as each method's checked options; raises as :func:`accelerate` documents."""
    if unknown:
        raise TypeError(
            f"accelerate got unknown options {sorted(unknown)}; valid: {', '.join(METHODS)}"
        )
    requested = {method: value for method, value in requested.items() if value is not None}
    if requested:
        checked = {
            method: _BY_NAME[method].check(target, value) for method, value in requested.items()
        }
    else:
        checked = _checked_environment_options(target)
    diffusers_cache = "deep_cache" in checked and not isinstance(
        checked["deep_cache"], deep_cache.DeepCacheOptions
    )
    if diffusers_cache and "block_cache" in checked:
        raise ValueError(
            "deep_cache with a diffusers cache config and block_cache both cache the "
            "transformer's blocks; choose one"
        )
    return checked


def check_acceleration(target: Any, **options: Any) -> None:
    """Validates :func:`accelerate`'s options for ``target`` without changing anything: raises
    the ``TypeError`` or ``ValueError`` that ``accelerate(target, **options)`` would, e.g. before
    a long run that would apply them later."""
    _checked_options(target, {m: options.pop(m, None) for m in METHODS}, options)


def accelerate_from_environment(target: Any) -> dict[str, dict[str, Any]]:
    """What ``set_attention_strategy`` (or any entry point) calls so that scripts benefit
    unchanged: :func:`accelerate` with the environment's options; returns at once, changing
    nothing, when none of :data:`ENVIRONMENT`'s variables is set."""
    if not any(os.environ.get(variable, "").strip() for variable in ENVIRONMENT.values()):
        return {}
    return accelerate(target)


def reset_acceleration(target: Any, method: Optional[str] = None) -> list[str]:
    """Remove what :func:`accelerate` applied (``method``: only one of :data:`METHODS`); the
    original modules, ``forward`` methods and memory layout return, the attention strategy
    stays. Returns the methods that were removed."""
    if method is not None and method not in METHODS:
        raise ValueError(f"reset_acceleration method must be one of {METHODS}, got {method!r}")
    removed = []
    for name in METHODS if method is None else (method,):
        try:
            if _BY_NAME[name].remove(target):
                removed.append(name)
        except ModelFamilyError:  # the method cannot apply to the target, so it is not applied
            continue
    return removed


def acceleration_of(target: Any) -> dict[str, dict[str, Any]]:
    """The methods currently applied to a pipeline (or model) and their settings."""
    found = {method.name: method.settings_of(target) for method in METHODS_TABLE}
    return {method: settings for method, settings in found.items() if settings is not None}
