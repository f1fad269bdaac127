"""Block caching for transformer models (DiTs): First Block Cache for SD3 and HiDream, where
diffusers' cache hooks do not reach, and diffusers' own FirstBlockCache where they do.

First Block Cache (ParaAttention's "FBCache", after TeaCache, Liu et al. 2024; diffusers'
``FirstBlockCacheConfig``): a DiT's hidden states change slowly between denoising steps. Every
call runs the first transformer block; when the first block's residual (output - input) has
changed little since the last call that ran every block, the remaining blocks are skipped and
their residual from that call (last block's output - first block's output) is added to the
first block's output instead. "Little" is diffusers' measure, the relative L1 change
``mean|r - r_ref| / mean|r_ref|``, below ``threshold``. The reference is only updated on calls
that run every block, so drift accumulates until it forces a full call. Alternatively
``interval`` runs every block on every ``interval``-th call of a generation and reuses the
residual on the calls between (a fixed schedule, as DeepCache's for UNets).

Why SD3 and HiDream need npu_attn's own (diffusers 0.42.1, checked by the tests): neither model
has ``CacheMixin`` (no ``enable_cache``; their pipelines never open a ``cache_context``), and
diffusers' ``apply_first_block_cache`` fails on both when applied by hand. SD3's last
``JointTransformerBlock`` (``context_pre_only``) returns ``None`` for the text stream, which the
tail hook subtracts (``TypeError``). HiDream's blocks sit in ``double_stream_blocks`` and
``single_stream_blocks`` (not among diffusers' block-list names: ``IndexError``) behind a
``HiDreamBlock`` wrapper, and the model concatenates text tokens onto the image tokens between
and inside the stacks, so diffusers' block-to-block residuals do not line up. Registering the
block classes in diffusers' ``TransformerBlockRegistry`` would fix neither (SD3's is registered
already). npu_attn keeps the rule but keeps residuals of the image tokens only, the one stream
that reaches either model's output, and reads each block's return convention from diffusers'
``TransformerBlockMetadata`` (the registry's own entry for ``JointTransformerBlock``).

Which calls share a cache: the cache follows the model's calls (both pipelines batch CFG: one
call per step). A call whose timestep is not below the previous call's starts a new generation
(the cache is cleared), so generations never mix; SD3 calls with ``skip_layers`` (skip-layer
guidance) keep a cache of their own; a call whose token count differs from the cached one runs
every block.

How it attaches: as DeepCache does, an instance ``forward`` on each block (small classes, not
closures) and a forward pre-hook on the model; :func:`remove_block_cache` removes exactly those.
diffusers' ``HookRegistry`` is not used because its forwards are closures: a model carrying
them cannot be pickled (diffusers' FirstBlockCache on Flux cannot either). Block caching is
lossy: never on unless asked for; ``threshold=0`` (or ``interval=1``) runs every block: exact.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..components import StateAttribute, denoiser_of
from .base import (
    InstanceForward,
    Method,
    ModelFamilyError,
    TensorStore,
    refuse_other_diffusers_cache,
)

__all__ = [
    "BlockCacheOptions",
    "apply_block_cache",
    "block_cache_of",
    "check_block_cache",
    "remove_block_cache",
]

_STATE = StateAttribute("_npu_attn_block_cache")


# --------------------------------------------------------------------------- options
@dataclass(frozen=True)
class BlockCacheOptions:
    """First Block Cache's options.

    Attributes:
        threshold: skip the remaining blocks when the first block's residual changed by less
            than this (relative L1) since the last full call; 0 never skips (exact). diffusers
            and ParaAttention suggest 0.05-0.2.
        interval: instead of a threshold, run every block on every ``interval``-th call of a
            generation (>= 1; 1 is exact) and reuse the residual on the calls between.
    """

    threshold: float = 0.0
    interval: Optional[int] = None

    def __post_init__(self) -> None:
        threshold = self.threshold
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not math.isfinite(threshold)
        ):
            raise TypeError(f"block_cache threshold must be a number >= 0, got {threshold!r}")
        if threshold < 0:
            raise ValueError(f"block_cache threshold must be >= 0, got {threshold}")
        interval = self.interval
        if interval is not None:
            if isinstance(interval, bool) or not isinstance(interval, int):
                raise TypeError(f"block_cache interval must be an int, got {interval!r}")
            if interval < 1:
                raise ValueError(f"block_cache interval must be >= 1, got {interval}")
            if threshold != 0:
                raise ValueError("block_cache takes a threshold or an interval, not both")

    @classmethod
    def of(cls, value: Any) -> BlockCacheOptions:
        """Options from a threshold, a mapping of option names, diffusers'
        ``FirstBlockCacheConfig``, or options."""
        from diffusers.hooks import FirstBlockCacheConfig

        if isinstance(value, cls):
            return value
        if isinstance(value, FirstBlockCacheConfig):
            return cls(threshold=value.threshold)
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise TypeError(
                    f"block_cache got unknown options {unknown}; valid: {sorted(known)}"
                )
            if not value:
                raise TypeError("block_cache options need a 'threshold' or an 'interval'")
            return cls(**value)
        return cls(threshold=value)


# --------------------------------------------------------------------------- model families
@dataclass(frozen=True)
class _Family:
    """Where a model keeps its blocks and its timestep.

    Attributes:
        stacks: the ``ModuleList`` attributes holding the blocks, in the order they run.
        inner: the attribute of each list entry holding the block itself (HiDream wraps each
            block in a ``HiDreamBlock``); None when the entries are the blocks.
        timestep: the name of the model's timestep argument.
    """

    stacks: tuple[str, ...]
    inner: Optional[str]
    timestep: str


@functools.cache
def _families() -> dict[type, _Family]:
    from diffusers import HiDreamImageTransformer2DModel, SD3Transformer2DModel

    return {
        SD3Transformer2DModel: _Family(("transformer_blocks",), None, "timestep"),
        HiDreamImageTransformer2DModel: _Family(
            ("double_stream_blocks", "single_stream_blocks"), "block", "timesteps"
        ),
    }


@functools.cache
def _own_block_metadata() -> dict[type, Any]:
    """Return conventions of the blocks diffusers' registry does not describe: HiDream's
    double-stream block returns ``(image, text)``, its single-stream block one tensor (the
    image tokens first, the text tokens after them)."""
    from diffusers.hooks._helpers import TransformerBlockMetadata
    from diffusers.models.transformers.transformer_hidream_image import (
        HiDreamImageSingleTransformerBlock,
        HiDreamImageTransformerBlock,
    )

    own = {
        HiDreamImageTransformerBlock: TransformerBlockMetadata(
            return_hidden_states_index=0, return_encoder_hidden_states_index=1
        ),
        HiDreamImageSingleTransformerBlock: TransformerBlockMetadata(
            return_hidden_states_index=0, return_encoder_hidden_states_index=None
        ),
    }
    for cls, metadata in own.items():
        metadata._cls = cls  # what diffusers' registry sets: argument positions come from it
    return own


def _block_metadata(block: torch.nn.Module) -> Any:
    from diffusers.hooks._helpers import TransformerBlockRegistry

    own = _own_block_metadata().get(type(block))
    if own is not None:
        return own
    try:
        return TransformerBlockRegistry.get(type(block))
    except ValueError:
        raise ValueError(f"block_cache does not know what {type(block).__name__} returns") from None


def _supported_model(target: Any) -> torch.nn.Module:
    model = denoiser_of(target, ("transformer",), required=False)
    if model is not None and (type(model) in _families() or hasattr(model, "enable_cache")):
        return model
    name = type(model if model is not None else target).__name__
    hint = " (for UNet pipelines use deep_cache)" if hasattr(target, "unet") else ""
    raise ModelFamilyError(
        "block_cache applies to transformer models: SD3 and HiDream (npu_attn's First Block "
        f"Cache) and models with diffusers' cache hooks (Flux, ...), not to {name}{hint}"
    )


def _blocks(model: torch.nn.Module, family: _Family) -> list[torch.nn.Module]:
    blocks = []
    for stack in family.stacks:
        for entry in getattr(model, stack):
            blocks.append(getattr(entry, family.inner) if family.inner else entry)
    return blocks


# --------------------------------------------------------------------------- the cache
# A cache from before input shapes were recorded (an old pickle): assume the next call has the
# size its residual was cached for.
_UNKNOWN_SHAPE = "unknown"


def _stored_tensor(key: str) -> property:
    def get(cache: _Cache) -> Optional[torch.Tensor]:
        return cache.store.tensors.get(key)

    def set_(cache: _Cache, value: Optional[torch.Tensor]) -> None:
        if value is None:
            cache.store.tensors.pop(key, None)
        else:
            cache.store.tensors[key] = value

    return property(get, set_)


class _Cache:
    """What one kind of call (see the module docstring) remembers between calls.

    The tensors live in a :class:`TensorStore`, not on this object: reached through the model,
    graph mode (under inductor's freezing) would make them graph constants guarded on their
    identity and recompile the model at every refresh."""

    reference = _stored_tensor("reference")  # first block's residual, last full call
    residual = _stored_tensor("residual")  # the other blocks' residual, same call
    head_output = _stored_tensor("head_output")  # first block's output, this call

    def __init__(self) -> None:
        self.store = TensorStore()
        self.clear()
        self.last_timestep: Optional[float] = None

    def clear(self) -> None:
        self.calls = 0  # calls in this generation
        self.store.tensors.clear()
        self.input_shape: Any = None  # the model input's shape in the call that cached

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "store" in state:
            self.__dict__.update(state)
            return
        # Pickled before the tensors moved to a store: move them there.
        tensors = {key: state.pop(key, None) for key in ("reference", "residual", "head_output")}
        self.__dict__.update(state)
        self.store = TensorStore()
        self.store.tensors.update({k: v for k, v in tensors.items() if v is not None})
        self.input_shape = _UNKNOWN_SHAPE

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether the cached residual was computed for a model input of ``shape``."""
        if self.residual is None:
            return False
        return self.input_shape in (shape, _UNKNOWN_SHAPE)


class _State:
    """Per-model state: options, a cache per kind of call, the running call, counters."""

    def __init__(self, options: BlockCacheOptions, family: _Family) -> None:
        self.options = options
        self.family = family
        self.caches: dict[str, _Cache] = {}
        self.current: Optional[_Cache] = None  # the cache of the running model call
        self.reusing = False  # the running call skips the blocks after the first
        self.calls = 0
        self.skipped_calls = 0
        self.blocks = 0
        self.wrapped: list[InstanceForward] = []
        self.handles: list[Any] = []

    def reuses_on_schedule(self, cache: _Cache, shape: tuple[int, ...]) -> bool:
        """With an interval: whether this call (the cache's ``cache.calls``-th of its
        generation, model input of ``shape``) skips the blocks after the first."""
        return cache.fits(shape) and (cache.calls - 1) % self.options.interval != 0

    def reuses_on_change(self, cache: _Cache, residual: torch.Tensor) -> bool:
        """With a threshold: whether this call skips the remaining blocks (``residual``: the
        first block's)."""
        if self.options.threshold <= 0 or cache.residual is None or cache.reference is None:
            return False
        if cache.residual.shape != residual.shape:  # another token count: compute
            return False
        reference = cache.reference.float()
        change = (residual.float() - reference).abs().mean() / reference.abs().mean()
        return bool(change < self.options.threshold)  # NaN (zero reference): compute


@functools.cache
def _parameter_names(function: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)[1:]  # without self


def _argument(function: Any, name: str, args: tuple, kwargs: dict) -> Any:
    if name in kwargs:
        return kwargs[name]
    names = _parameter_names(function)
    index = names.index(name) if name in names else len(args)
    return args[index] if index < len(args) else None


class _BeginCall:
    """The model's forward pre-hook: pick the cache of this kind of call, start a new
    generation when the timestep did not go down, and with an interval decide whether the call
    reuses the cache.

    Host bookkeeping, kept out of graph mode's graphs (``torch.compiler.disable``): traced, its
    counters would be guarded on their values and recompile the model at every call, and the
    timestep's ``float`` would break the graph."""

    def __init__(self, state: _State) -> None:
        self.state = state

    @torch.compiler.disable
    def __call__(self, model, args, kwargs):
        state = self.state
        forward = type(model).forward
        skip_layers = _argument(forward, "skip_layers", args, kwargs)
        key = "default" if skip_layers is None else f"skip_layers={sorted(skip_layers)}"
        cache = state.caches.setdefault(key, _Cache())
        timestep = _argument(forward, state.family.timestep, args, kwargs)
        if timestep is not None:
            timestep = float(torch.as_tensor(timestep).flatten()[0])
        if timestep is None or cache.last_timestep is None or timestep >= cache.last_timestep:
            cache.clear()  # a new generation
        cache.last_timestep = timestep
        cache.head_output = None
        cache.calls += 1
        state.current = cache
        state.reusing = False
        state.calls += 1
        if state.options.interval is not None:
            hidden = _argument(forward, "hidden_states", args, kwargs)
            shape = tuple(hidden.shape) if hidden is not None else ()
            state.reusing = state.reuses_on_schedule(cache, shape)
            if state.reusing:
                state.skipped_calls += 1
            else:
                cache.input_shape = shape  # the residual this call caches is for this size


class _EndCall:
    """The model's forward hook: blocks called outside a model call run as they are."""

    def __init__(self, state: _State) -> None:
        self.state = state

    def __call__(self, _model, _args, _output):
        self.state.current = None
        self.state.reusing = False


def _hidden_of(output: Any, metadata: Any) -> torch.Tensor:
    return output[metadata.return_hidden_states_index] if isinstance(output, tuple) else output


class _FirstBlockForward(InstanceForward):
    """The first block: runs, and decides whether the others run."""

    def __init__(self, block: torch.nn.Module, state: _State, metadata: Any) -> None:
        super().__init__(block)
        self.state = state
        self.metadata = metadata

    def __call__(self, *args, **kwargs):
        metadata = self.metadata
        hidden_in = metadata._get_parameter_from_args_kwargs(
            metadata.hidden_states_argument_name, args, kwargs
        )
        output = self.original(*args, **kwargs)
        state, cache = self.state, self.state.current
        if cache is None:
            return output
        hidden = _hidden_of(output, metadata)
        if state.options.interval is None:  # decided on the residual's change
            residual = (hidden - hidden_in).detach()
            if _decide_on_change(state, cache, residual):
                return self._with_cached_residual(output, hidden, cache)
            cache.reference = residual
        elif state.reusing:  # decided by _BeginCall
            return self._with_cached_residual(output, hidden, cache)
        cache.head_output = hidden.detach()
        return output

    def _with_cached_residual(self, output: Any, hidden: torch.Tensor, cache: _Cache) -> Any:
        cached = hidden + cache.residual
        if not isinstance(output, tuple):
            return cached
        output = list(output)
        output[self.metadata.return_hidden_states_index] = cached
        return tuple(output)


@torch.compiler.disable
def _decide_on_change(state: _State, cache: _Cache, residual: torch.Tensor) -> bool:
    """With a threshold: whether this call reuses the cache, and the bookkeeping if so. A host
    decision on a tensor's value: graph mode breaks its graph here (the blocks are compiled one
    by one), as for diffusers' own FirstBlockCache."""
    reusing = state.reuses_on_change(cache, residual)
    if reusing:
        state.reusing = True
        state.skipped_calls += 1
    return reusing


class _LaterBlockForward(InstanceForward):
    """A block after the first: passes its input through while the call reuses the cache; the
    last block records the residual of all blocks after the first."""

    def __init__(self, block: torch.nn.Module, state: _State, metadata: Any, last: bool) -> None:
        super().__init__(block)
        self.state = state
        self.metadata = metadata
        self.last = last

    def __call__(self, *args, **kwargs):
        state, metadata = self.state, self.metadata
        if state.reusing:
            return self._passthrough(args, kwargs)
        output = self.original(*args, **kwargs)
        cache = state.current
        if self.last and cache is not None and cache.head_output is not None:
            head = cache.head_output
            # The image tokens come first (HiDream's single-stream blocks append text tokens).
            hidden = _hidden_of(output, metadata)[:, : head.shape[1]]
            cache.residual = (hidden - head).detach()
            cache.head_output = None
        return output

    def _passthrough(self, args: tuple, kwargs: dict) -> Any:
        metadata = self.metadata
        hidden = metadata._get_parameter_from_args_kwargs(
            metadata.hidden_states_argument_name, args, kwargs
        )
        if metadata.return_encoder_hidden_states_index is None:
            return hidden
        encoder = metadata._get_parameter_from_args_kwargs(
            metadata.encoder_hidden_states_argument_name, args, kwargs
        )
        output = [None, None]
        output[metadata.return_hidden_states_index] = hidden
        output[metadata.return_encoder_hidden_states_index] = encoder
        return tuple(output)


# --------------------------------------------------------------------------- public API
def check_block_cache(target: Any, options: Any) -> BlockCacheOptions:
    """Validate ``options`` for ``target`` without changing anything (raises as
    :func:`apply_block_cache` would); returns the parsed options."""
    options = BlockCacheOptions.of(options)
    model = _supported_model(target)
    name = type(model).__name__
    family = _families().get(type(model))
    if family is None:  # a model with diffusers' cache hooks
        if options.interval is not None:
            raise ValueError(
                f"block_cache interval is npu_attn's block cache (SD3, HiDream); {name} uses "
                "diffusers' FirstBlockCache, which takes a threshold"
            )
        refuse_other_diffusers_cache(model, _STATE, "deep_cache")
        return options
    blocks = _blocks(model, family)
    if len(blocks) < 2:
        raise ValueError(
            f"block_cache needs at least 2 transformer blocks; this {name} has {len(blocks)}"
        )
    for block in blocks:
        _block_metadata(block)
    return options


def apply_block_cache(target: Any, options: Any) -> dict[str, Any]:
    """Attach First Block Cache to a transformer pipeline's model (or a model); replaces an
    earlier setting.

    Args:
        target: a pipeline with a ``transformer`` or the model: ``SD3Transformer2DModel``,
            ``HiDreamImageTransformer2DModel`` (npu_attn's First Block Cache), or a model with
            diffusers' cache hooks (``enable_cache``: Flux, Wan, ...; diffusers'
            ``FirstBlockCache``, threshold only).
        options: a threshold >= 0, a dict of :class:`BlockCacheOptions` fields, diffusers'
            ``FirstBlockCacheConfig``, or options.

    Returns:
        The options applied, ``implementation`` ("npu_attn" or "diffusers"), and for
        npu_attn's the number of ``blocks`` and the model ``calls`` / ``skipped_calls`` so far.

    Raises:
        ValueError, TypeError: a bad option; ModelFamilyError: a model it does not apply to.
    """
    options = check_block_cache(target, options)
    model = _supported_model(target)
    remove_block_cache(model)
    family = _families().get(type(model))
    if family is None:
        from diffusers.hooks import FirstBlockCacheConfig

        model.enable_cache(FirstBlockCacheConfig(threshold=options.threshold))
        _STATE.set(model, options)
        return block_cache_of(model)
    state = _State(options, family)
    blocks = _blocks(model, family)
    try:
        state.wrapped.append(_FirstBlockForward(blocks[0], state, _block_metadata(blocks[0])))
        for block in blocks[1:]:
            last = block is blocks[-1]
            state.wrapped.append(_LaterBlockForward(block, state, _block_metadata(block), last))
        for wrapper in state.wrapped:
            wrapper.install()
        state.handles.append(model.register_forward_pre_hook(_BeginCall(state), with_kwargs=True))
        state.handles.append(model.register_forward_hook(_EndCall(state)))
    except Exception:
        _detach(state)
        raise
    state.blocks = len(blocks)
    _STATE.set(model, state)
    return block_cache_of(model)


def _detach(state: _State) -> None:
    for wrapper in reversed(state.wrapped):
        if wrapper.module.__dict__.get("forward") is wrapper:
            wrapper.uninstall()
    state.wrapped.clear()
    for handle in state.handles:
        handle.remove()
    state.handles.clear()
    state.caches.clear()
    state.current = None


def remove_block_cache(target: Any) -> bool:
    """Remove the block cache; returns whether there was one. The blocks run their class
    ``forward`` again and the cached tensors are freed."""
    model = denoiser_of(target, ("transformer",), required=False)
    return _STATE.remove(model, functools.partial(_undo, model))


def _undo(model: torch.nn.Module, state: Any) -> None:
    if isinstance(state, _State):
        _detach(state)
    else:  # diffusers' FirstBlockCache, enabled by apply_block_cache
        model.disable_cache()


def block_cache_of(target: Any) -> Optional[dict[str, Any]]:
    """The block cache settings of a pipeline's transformer or a model, or None when off."""
    state = _STATE.get(denoiser_of(target, ("transformer",), required=False))
    if state is None:
        return None
    if isinstance(state, BlockCacheOptions):
        return {**dataclasses.asdict(state), "implementation": "diffusers"}
    return {
        **dataclasses.asdict(state.options),
        "implementation": "npu_attn",
        "blocks": state.blocks,
        "calls": state.calls,
        "skipped_calls": state.skipped_calls,
    }


METHOD = Method(
    name="block_cache",
    variable="NPU_ATTN_BLOCK_CACHE",
    parse=float,
    expected="a block-cache threshold (a number >= 0)",
    check=check_block_cache,
    apply=apply_block_cache,
    remove=remove_block_cache,
    settings_of=block_cache_of,
)
