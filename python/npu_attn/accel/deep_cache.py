"""DeepCache for diffusers UNet pipelines; diffusers' own cache hooks for transformer models.

DeepCache (Ma, Fang & Wang, CVPR 2024; the ``DeepCache`` package's ``DeepCacheSDHelper``): the
UNet's deep features change slowly between denoising steps, so every ``cache_interval`` steps
the whole UNet runs and the outputs of its deep layers are cached; in the steps between only
the shallow branch runs (``conv_in``, the down layers before the cache position, the up layers
after it, ``conv_out``), reading the deep features from the cache. ``cache_branch_id`` picks the
position as in the paper: block ``cache_branch_id // 3``, layer ``cache_branch_id % 3``
(0 = the shallowest branch, the fastest and the default). The rule for which layer is skipped
is DeepCacheSDHelper's, so the output equals the package's (tested).

How it attaches: the pipeline's own ``__call__`` runs unchanged (no copied pipeline files, so
SDXL's added text/time conditions, CFG and callbacks are diffusers' code). A forward pre-hook on
the UNet finds the step from the pipeline's ``scheduler.timesteps``, and the UNet's down, mid
and up blocks and their resnets, transformers and samplers get an instance ``forward`` that
returns the cached output on skipped steps. :func:`remove_deep_cache` removes exactly those
(the class ``forward`` is what runs again). Beyond DeepCacheSDHelper: a new generation (the
scheduler's timesteps set again, or the step index going back) starts a new cache cycle, also
after a 1-step generation; separate UNet calls within one step (pipelines that run the
conditional and unconditional halves separately) get separate caches; a call whose input shape
differs from the cached one computes everything.

DeepCache is lossy: never enabled unless asked for (``cache_interval=1`` is exact: every step
is computed).

Pickling: the instance ``forward``s and the pre-hook are small classes (not closures), so an
accelerated UNet or pipeline pickles, ``torch.save``s and deep-copies; the state keeps only a
weak reference to its pipeline, which a link stored on the pipeline restores in the copy. A
UNet copied without its pipeline raises a clear error until DeepCache is applied to the
pipeline it now runs in.

Transformer models (Flux and others with diffusers' ``CacheMixin``) are not UNets; diffusers
ships caches for them (FirstBlockCache, PyramidAttentionBroadcast, FasterCache, TaylorSeer,
...), and npu_attn applies the config object you pass (``model.enable_cache``) rather than
re-implement any of them. SD3 and HiDream have no ``CacheMixin``: see :mod:`.block_cache`.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..components import StateAttribute, denoiser_of
from .base import (
    InstanceForward,
    Method,
    ModelFamilyError,
    TensorStore,
    options_from,
    refuse_other_diffusers_cache,
)

__all__ = [
    "DeepCacheOptions",
    "apply_deep_cache",
    "check_deep_cache",
    "deep_cache_of",
    "remove_deep_cache",
]

_STATE = StateAttribute("_npu_attn_deep_cache")
# On the pipeline: re-attaches copied state to the copied pipeline (pickling).
_LINK = StateAttribute("_npu_attn_deep_cache_link")
LAYERS_PER_BRANCH_BLOCK = 3  # DeepCacheSDHelper's cache_branch_id -> (block, layer) split


# --------------------------------------------------------------------------- options
@dataclass(frozen=True)
class DeepCacheOptions:
    """DeepCache's options, as named in the paper and ``DeepCacheSDHelper.set_params``.

    Attributes:
        cache_interval: run the whole UNet every this many steps (>= 1; 1 is exact).
        cache_branch_id: where the cached deep branch starts (>= 0): block
            ``cache_branch_id // 3``, layer ``cache_branch_id % 3``; 0 is the shallowest.
    """

    cache_interval: int
    cache_branch_id: int = 0

    def __post_init__(self) -> None:
        for name, minimum in (("cache_interval", 1), ("cache_branch_id", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"deep_cache {name} must be an int, got {value!r}")
            if value < minimum:
                raise ValueError(f"deep_cache {name} must be >= {minimum}, got {value}")

    @classmethod
    def of(cls, value: Any) -> DeepCacheOptions:
        """Options from an interval, a mapping of option names, or options."""
        return options_from(cls, value, "deep_cache", "cache_interval")

    @property
    def block_id(self) -> int:
        return self.cache_branch_id // LAYERS_PER_BRANCH_BLOCK

    @property
    def layer_id(self) -> int:
        return self.cache_branch_id % LAYERS_PER_BRANCH_BLOCK


# --------------------------------------------------------------------------- the schedule
class _State:
    """Which step a UNet call belongs to, whether it computes the deep branch, and the cache."""

    def __init__(self, options: DeepCacheOptions, pipe: Any) -> None:
        self.options = options
        # The pipeline owns the UNet: a weak reference, so the UNet does not keep it alive.
        self._pipe: Optional[weakref.ref] = weakref.ref(pipe)
        self._store = TensorStore()  # the cached outputs, by (call in step, module name)
        self.cached_shape: dict[int, tuple[int, ...]] = {}  # per call in a step
        self.start_index: Optional[int] = None
        self.last_index: Optional[int] = None
        # The scheduler's timesteps tensor of the current generation: pipelines set it anew for
        # every call, so a new object marks a new generation even where the step index does not
        # go back (a 1-step generation, then another starting at index 0).
        self.schedule: Any = None
        self.call_in_step = 0
        self.skipping = False
        self.skipped_steps = 0
        self.wrapped: list[InstanceForward] = []
        self.handle: Any = None

    @property
    def cache(self) -> dict[tuple[int, str], Any]:
        return self._store.tensors

    def schedule_of_pipeline(self) -> Any:
        """The pipeline scheduler's ``timesteps`` (set by the pipeline for each generation)."""
        pipe = self._pipe() if self._pipe is not None else None
        if pipe is None:
            raise RuntimeError(
                "deep_cache: this UNet is no longer attached to its pipeline (it was pickled or "
                "copied without it); apply DeepCache to the pipeline it runs in again: "
                "npu_attn.accelerate(pipe, deep_cache=...)"
            )
        timesteps = getattr(getattr(pipe, "scheduler", None), "timesteps", None)
        if timesteps is None:
            raise RuntimeError("deep_cache: the pipeline's scheduler has no timesteps yet")
        return timesteps

    @staticmethod
    def step_index(timestep: Any, timesteps: Any) -> int:
        """The index of ``timestep`` in the scheduler's ``timesteps`` (DeepCacheSDHelper's rule)."""
        value = float(timestep.flatten()[0]) if torch.is_tensor(timestep) else float(timestep)
        matches = (torch.as_tensor(timesteps).double() == value).nonzero()
        if len(matches) == 0:
            raise RuntimeError(
                f"deep_cache: timestep {value} is not one of the pipeline scheduler's timesteps; "
                "DeepCache follows the pipeline's own denoising loop (call the pipeline, or "
                "remove deep_cache to call the UNet directly)"
            )
        return int(matches[0])

    def begin_call(self, timestep: Any, sample: torch.Tensor) -> None:
        timesteps = self.schedule_of_pipeline()
        index = self.step_index(timestep, timesteps)
        new_schedule = timesteps is not self.schedule
        if new_schedule or self.last_index is None or index < self.last_index:  # a new generation
            self.schedule = timesteps
            self.start_index = index
            self.last_index = None  # its first call is the step's first call
            self.cache.clear()
            self.cached_shape.clear()
        self.call_in_step = self.call_in_step + 1 if index == self.last_index else 0
        self.last_index = index
        refresh = (index - self.start_index) % self.options.cache_interval == 0
        ready = self.cached_shape.get(self.call_in_step) == tuple(sample.shape)
        self.skipping = ready and not refresh
        if self.skipping:
            self.skipped_steps += 1
        else:
            self.cached_shape[self.call_in_step] = tuple(sample.shape)

    def skips(self, kind: str, block_id: int, layer_id: int) -> bool:
        """DeepCacheSDHelper.is_skip_step: is this layer in the cached (deep) branch?"""
        if not self.skipping:
            return False
        if kind == "mid" or block_id > self.options.block_id:
            return True
        if block_id < self.options.block_id:
            return False
        if kind == "down":
            return layer_id >= self.options.layer_id
        return layer_id > self.options.layer_id

    # Pickling (pickle, torch.save, copy.deepcopy of the UNet or the pipeline): everything but
    # the weak reference to the pipeline, which the pipeline's _PipelineLink restores when the
    # pipeline is pickled with the UNet (a UNet copied alone asks to be attached again).
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pipe": None}


class _PipelineLink:
    """Stored on the pipeline: when the pipeline is pickled or deep-copied, it re-attaches the
    copied DeepCache state to the copied pipeline (pickle rebuilds ``(pipeline, state)`` from
    its memo, so both are the copies)."""

    def __init__(self, pipe: Any, state: _State) -> None:
        self._pipe = weakref.ref(pipe)
        self.state = state

    def __reduce__(self):
        return (_relink, (self._pipe(), self.state))


def _relink(pipe: Any, state: _State) -> Optional[_PipelineLink]:
    if pipe is None:  # the link was copied without its pipeline: nothing to attach to
        return None
    state._pipe = weakref.ref(pipe)
    return _PipelineLink(pipe, state)


# --------------------------------------------------------------------------- attaching it
class _CachedForward(InstanceForward):
    """DeepCache's instance ``forward``: the cached output on skipped steps (a class, not a
    closure, so that the UNet pickles)."""

    def __init__(
        self, module: torch.nn.Module, state: _State, where: tuple[str, int, int], key: str
    ) -> None:
        super().__init__(module)
        self.state = state
        self.where = where
        self.key = key

    def __call__(self, *args, **kwargs):
        state = self.state
        cache_key = (state.call_in_step, self.key)
        if state.skips(*self.where):
            return state.cache[cache_key]
        output = self.original(*args, **kwargs)
        state.cache[cache_key] = output
        return output


class _BeginCall:
    """The UNet's forward pre-hook: which step this call is and whether it skips."""

    def __init__(self, state: _State) -> None:
        self.state = state

    # Step bookkeeping runs outside torch.compile's graphs: traced, its float(timestep) made
    # dynamo specialise the code after it on every timestep's value, recompiling at each step
    # until its recompile limit (8). Run eagerly, the compiled UNet specialises only on
    # whether a step skips (and on the cache being empty at the first step).
    @torch.compiler.disable
    def __call__(self, _unet, args, kwargs):
        timestep = args[1] if len(args) > 1 else kwargs["timestep"]
        self.state.begin_call(timestep, args[0] if args else kwargs["sample"])


def _wrap_forward(module: torch.nn.Module, state: _State, where: tuple[str, int, int], key: str):
    """Give ``module`` an instance ``forward`` that returns its cached output on skipped steps
    (the module's previous instance ``forward``, if any, is kept to put back)."""
    wrapper = _CachedForward(module, state, where, key)
    wrapper.install()
    state.wrapped.append(wrapper)


def _wrap_down_block(block, block_id: int, name: str, state: _State) -> None:
    for layer_id, attention in enumerate(getattr(block, "attentions", None) or []):
        _wrap_forward(
            attention, state, ("down", block_id, layer_id), f"{name}.attentions.{layer_id}"
        )
    resnets = getattr(block, "resnets", None) or []
    for layer_id, resnet in enumerate(resnets):
        _wrap_forward(resnet, state, ("down", block_id, layer_id), f"{name}.resnets.{layer_id}")
    for i, sampler in enumerate(getattr(block, "downsamplers", None) or []):
        _wrap_forward(sampler, state, ("down", block_id, len(resnets)), f"{name}.down.{i}")
    _wrap_forward(block, state, ("down", block_id, 0), name)


def _wrap_up_block(block, block_id: int, name: str, state: _State) -> None:
    """Up blocks count layers from the deep end, so an up layer mirrors its down layer."""
    resnets = getattr(block, "resnets", None) or []
    for i, attention in enumerate(getattr(block, "attentions", None) or []):
        where = ("up", block_id, len(resnets) - i - 1)
        _wrap_forward(attention, state, where, f"{name}.attentions.{i}")
    for i, resnet in enumerate(resnets):
        _wrap_forward(resnet, state, ("up", block_id, len(resnets) - i - 1), f"{name}.resnets.{i}")
    for i, sampler in enumerate(getattr(block, "upsamplers", None) or []):
        _wrap_forward(sampler, state, ("up", block_id, 0), f"{name}.up.{i}")
    _wrap_forward(block, state, ("up", block_id, 0), name)


def _wrap_unet(unet: torch.nn.Module, state: _State) -> None:
    for block_id, block in enumerate(unet.down_blocks):
        _wrap_down_block(block, block_id, f"down_blocks.{block_id}", state)
    if unet.mid_block is not None:
        _wrap_forward(unet.mid_block, state, ("mid", 0, 0), "mid_block")
    count = len(unet.up_blocks)
    for i, block in enumerate(unet.up_blocks):
        _wrap_up_block(block, count - i - 1, f"up_blocks.{i}", state)

    state.handle = unet.register_forward_pre_hook(_BeginCall(state), with_kwargs=True)


def _unwrap(state: _State) -> None:
    for wrapper in reversed(state.wrapped):
        wrapper.uninstall()
    state.wrapped.clear()
    if state.handle is not None:
        state.handle.remove()
    state.cache.clear()


def _unet_pipeline(target: Any) -> tuple[Any, torch.nn.Module]:
    from diffusers import UNet2DConditionModel

    if isinstance(target, torch.nn.Module):
        raise ModelFamilyError(
            "deep_cache needs the pipeline, not a bare model: the pipeline's scheduler tells "
            "which denoising step each UNet call belongs to"
        )
    unet = getattr(target, "unet", None)
    if not isinstance(unet, UNet2DConditionModel):
        raise ModelFamilyError(
            "deep_cache (DeepCache) applies to UNet pipelines (SD-1.5/2.1, SDXL), not to "
            f"{type(target).__name__}; for transformer models pass one of diffusers' cache "
            "configs (e.g. diffusers.FirstBlockCacheConfig) where the model supports them"
        )
    if getattr(getattr(target, "scheduler", None), "set_timesteps", None) is None:
        raise ValueError("deep_cache needs a pipeline with a diffusers scheduler")
    return target, unet


def _check_branch(unet: torch.nn.Module, options: DeepCacheOptions) -> None:
    blocks = len(unet.down_blocks)
    if options.block_id >= blocks:
        raise ValueError(
            f"deep_cache cache_branch_id must be < {LAYERS_PER_BRANCH_BLOCK * blocks} for this "
            f"UNet ({blocks} down blocks), got {options.cache_branch_id}"
        )


def check_deep_cache(target: Any, options: Any) -> Any:
    """Validate ``options`` for ``target`` without changing anything (raises as
    :func:`apply_deep_cache` would); returns the parsed options or the diffusers config."""
    if _is_diffusers_cache_config(options):
        _cache_capable_model(target, options)
        return options
    options = DeepCacheOptions.of(options)
    _, unet = _unet_pipeline(target)
    _check_branch(unet, options)
    return options


def apply_deep_cache(target: Any, options: Any) -> dict[str, Any]:
    """Attach DeepCache to a UNet pipeline, or a diffusers cache config to a transformer.

    Args:
        target: a diffusers pipeline with a ``unet`` (SD-1.5/2.1, SDXL, ...), or, with a
            diffusers cache config, a pipeline with a ``transformer`` or a model that has
            ``enable_cache``.
        options: for UNet pipelines an interval (>= 1), a dict of :class:`DeepCacheOptions`
            fields, or options; for transformers one of diffusers' cache config objects
            (``FirstBlockCacheConfig``, ``PyramidAttentionBroadcastConfig``, ...).

    Returns:
        What was applied (the options, or the diffusers config's name).
    """
    options = check_deep_cache(target, options)
    if not isinstance(options, DeepCacheOptions):
        return _apply_diffusers_cache(target, options)
    pipe, unet = _unet_pipeline(target)
    remove_deep_cache(pipe)
    state = _State(options, pipe)
    try:
        _wrap_unet(unet, state)
    except Exception:
        _unwrap(state)
        raise
    _STATE.set(unet, state)
    _LINK.set(pipe, _PipelineLink(pipe, state))
    return deep_cache_of(pipe)


def remove_deep_cache(target: Any) -> bool:
    """Remove DeepCache (or the diffusers cache npu_attn enabled); returns whether there was
    one. The UNet's modules run their class ``forward`` again and the cache is freed."""
    model = denoiser_of(target, required=False)
    return _STATE.remove(model, functools.partial(_undo, model))


def _undo(model: torch.nn.Module, state: Any) -> None:
    if isinstance(state, _State):
        _unwrap(state)
        _LINK.remove(state._pipe() if state._pipe is not None else None)
    else:  # a diffusers cache config npu_attn enabled
        model.disable_cache()


def deep_cache_of(target: Any) -> Optional[dict[str, Any]]:
    """The cache settings npu_attn applied to a pipeline's denoiser (or a model), or None."""
    state = _STATE.get(denoiser_of(target, required=False))
    if state is None:
        return None
    if isinstance(state, _State):
        return {**dataclasses.asdict(state.options), "skipped_steps": state.skipped_steps}
    return {"diffusers_cache": type(state).__name__}


# --------------------------------------------------------------------------- transformers
def _cache_capable_model(target: Any, config: Any) -> torch.nn.Module:
    model = denoiser_of(target, required=False)
    name = type(model if model is not None else target).__name__
    if model is None or not hasattr(model, "enable_cache"):
        raise ModelFamilyError(
            f"{name} does not support diffusers' cache hooks ({type(config).__name__}); "
            "for UNet pipelines pass a cache interval (DeepCache), for SD3 and HiDream use "
            "block_cache=<threshold> (npu_attn's First Block Cache)"
        )
    refuse_other_diffusers_cache(model, _STATE, "block_cache")
    return model


def _is_diffusers_cache_config(value: Any) -> bool:
    return type(value).__module__.startswith("diffusers.hooks")


def _apply_diffusers_cache(target: Any, config: Any) -> dict[str, Any]:
    """``model.enable_cache(config)``: diffusers' own cache, for models that support it."""
    model = _cache_capable_model(target, config)
    remove_deep_cache(model)
    model.enable_cache(config)
    _STATE.set(model, config)
    return deep_cache_of(model)


METHOD = Method(
    name="deep_cache",
    variable="NPU_ATTN_DEEPCACHE",
    parse=int,
    expected="a DeepCache interval (an int >= 1)",
    check=check_deep_cache,
    apply=apply_deep_cache,
    remove=remove_deep_cache,
    settings_of=deep_cache_of,
)
