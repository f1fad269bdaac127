"""Context (sequence) parallelism for SD3, Flux and HiDream transformers on CPU.

:func:`enable_context_parallel` makes every rank hold 1 / world of the tokens (image *and*
text) through the whole transformer: the inputs are split along the sequence when the model
starts, each attention call runs ring or Ulysses attention (or both, "unified") across the
ranks, and the output is gathered at the end, so the caller (a pipeline, unchanged) sees the
full result on every rank.

What is diffusers' and what is npu_attn's, and why:

- **Sharding and gathering are diffusers' own** (``diffusers.hooks.apply_context_parallel``
  with a context-parallel plan of ``ContextParallelInput`` / ``ContextParallelOutput``):
  Flux's is the model's ``_cp_plan``, shipped and maintained by diffusers; SD3 and HiDream
  have none, and :data:`PLANS` gives theirs in the same format (HiDream computes its image
  position ids in ``patchify``, a method rather than a module, so that one method is wrapped
  as well). The mesh and the ``ContextParallelConfig`` are diffusers' too. npu_attn does not
  call ``ModelMixin.enable_parallelism``, only the pieces after its device resolution, which
  computes ``rank % torch.accelerator.device_count()``: a ZeroDivisionError on a CPU-only
  torch. Here the device is the model's, and the mesh a CPU (gloo) one.
- **Attention is npu_attn's** (:func:`~npu_attn.parallel.ring_attention`,
  :func:`~npu_attn.parallel.ulysses_attention`), reached through the same SDPA redirect as
  ``set_attention_strategy``: each attention module's own processor runs unchanged inside a
  wrapper that routes its ``scaled_dot_product_attention`` call to the sequence-parallel
  function. diffusers' dispatcher cannot be extended cleanly instead: its backend names are a
  closed enum, its ring needs a backend that returns the log-sum-exp (its ``native`` one,
  torch's SDPA, cannot), and SD3's and HiDream's processors call
  ``F.scaled_dot_product_attention`` directly, never the dispatcher. Processors therefore keep
  ``_parallel_config = None`` (they attend over local tokens as far as diffusers knows), and a
  processor call that does not reach SDPA raises instead of silently attending locally.

Shards: with ring only or Ulysses only, sequences are split by ``tensor_split`` (diffusers'
"anything" mode), so any length works, e.g. SD3's 333 text tokens on 2 ranks; the unified
mode needs every length divisible by the world size. Ulysses (and unified) need the heads
divisible by the Ulysses degree. Every model call checks the ranks hold the same inputs
(fingerprints, as CFG-parallel does) and the lengths fit, raising on every rank otherwise.

Attention masks: these families attend without SDPA masks (HiDream multiplies padded keys by
its token mask before attention, which shards with the tokens). A mask over the joint sequence
(Flux's optional ``attention_mask``) is given in unsharded order, and is refused with an error.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..components import StateAttribute, denoiser_of
from ..integration import redirect as _redirect
from ..integration.wrapping import (
    FallThrough,
    RoutedProcessor,
    attention_modules,
    routed_class,
    unwrapped,
)
from .group import group_rank, group_size, require_distributed
from .inputs import agree_inputs
from .ring import CPU_ONLY, ring_attention
from .ulysses import ulysses_attention

__all__ = [
    "FAMILIES",
    "ContextParallelProcessor",
    "context_parallel_of",
    "disable_context_parallel",
    "enable_context_parallel",
]

FAMILIES = {
    "FluxTransformer2DModel": "flux",
    "SD3Transformer2DModel": "sd3",
    "HiDreamImageTransformer2DModel": "hidream",
}
_STATE = StateAttribute("_npu_attn_context_parallel")


def _plans() -> dict[str, dict]:
    """Context-parallel plans in diffusers' format for the families without one."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    split_output = ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)
    gather = ContextParallelOutput(gather_dim=1, expected_dims=3)
    return {
        # SD3: image tokens after patch embedding (+ positions), text after its projection.
        "sd3": {
            "pos_embed": {0: split_output},
            "context_embedder": {0: split_output},
            "proj_out": gather,
        },
        # HiDream: every text stream after its caption projection (T5 and each Llama layer);
        # image tokens, their position ids and mask in the patchify wrapper.
        "hidream": {"caption_projection.*": {0: split_output}, "final_layer": gather},
    }


@dataclasses.dataclass
class _State:
    family: str
    plan: dict
    config: Any  # diffusers ContextParallelConfig
    ring_group: Optional[dist.ProcessGroup]
    ulysses_group: Optional[dist.ProcessGroup]
    originals: dict[str, Any]
    handles: list
    attention_calls: int = 0
    model_calls: int = 0
    wrap_output: bool = False


# --------------------------------------------------------------------------- attention
def _sequence_parallel_sdpa(state: _State) -> Callable[..., Tensor]:
    """A function with torch SDPA's signature that runs the configured sequence-parallel
    attention on the shards the processor computed."""
    ring, ulysses = state.config.ring_degree, state.config.ulysses_degree

    def attention(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Optional[Tensor] = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: Optional[float] = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        if attn_mask is not None and attn_mask.shape[-1] != 1:
            raise NotImplementedError(
                "context parallel: this attention call has a mask over the key sequence "
                f"(shape {tuple(attn_mask.shape)}); masks are built over the unsharded joint "
                "sequence and cannot be used on shards. Run without the mask, or without "
                "context parallelism"
            )
        state.attention_calls += 1
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if ulysses > 1 and ring > 1:
            inner = functools.partial(ring_attention, group=state.ring_group)
            return ulysses_attention(*args, group=state.ulysses_group, attend=inner)
        if ulysses > 1:
            return ulysses_attention(*args, group=state.ulysses_group)
        return ring_attention(*args, group=state.ring_group)

    return attention


class ContextParallelProcessor(RoutedProcessor, FallThrough):
    """Runs a model's own attention processor with its SDPA call routed to sequence-parallel
    attention. Attribute access falls through to the wrapped processor; ``__call__`` has the
    wrapped processor's signature (diffusers filters keyword arguments by it)."""

    def __init__(self, inner: Any, attention: Callable[..., Tensor]) -> None:
        self.inner = inner
        self.route = attention

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        calls = 0

        def routed(*a: Any, **k: Any) -> Tensor:
            nonlocal calls
            calls += 1
            return self.route(*a, **k)

        result = _redirect.call_routed(routed, self.inner, *args, **kwargs)
        if not calls:
            raise RuntimeError(
                f"context parallel: {type(self.inner).__name__} returned without calling "
                "torch.nn.functional.scaled_dot_product_attention, so it attended over this "
                "rank's tokens only. Use diffusers' default ('native') attention backend with "
                "context parallelism"
            )
        return result

    def __repr__(self) -> str:
        return f"ContextParallelProcessor(inner={self.inner!r})"


def _check_backends(model: torch.nn.Module) -> None:
    """Processors must reach SDPA: diffusers' dispatcher only does on its native backend."""
    for name, module in attention_modules(model):
        backend = getattr(unwrapped(module.processor), "_attention_backend", None)
        if backend not in (None, "native"):
            raise ValueError(
                f"context parallel: {name} uses diffusers attention backend {backend!r}; "
                "npu_attn's sequence-parallel attention replaces the 'native' backend's SDPA "
                "call. Call model.reset_attention_backend() first"
            )


def _wrap_processors(model: torch.nn.Module, state: _State) -> None:
    """Route every attention module's SDPA call to the sequence-parallel function (the exact
    original processor objects are kept for disable)."""
    attention = _sequence_parallel_sdpa(state)
    for name, module in attention_modules(model):
        state.originals[name] = module.processor
        inner = unwrapped(module.processor)
        processor_class = routed_class(ContextParallelProcessor, type(inner), "ContextParallel")
        module.set_processor(processor_class(inner, attention))


# --------------------------------------------------------------------------- model inputs
def _arguments(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    signature = inspect.signature(type(model).forward)
    return signature.bind_partial(model, *args, **kwargs).arguments


def _lengths(family: str, model: torch.nn.Module, arguments: dict[str, Any]) -> dict[str, int]:
    """The sequences that get sharded, by name, for one model call."""
    hidden = arguments.get("hidden_states")
    if not isinstance(hidden, Tensor):
        raise TypeError("context parallel: the model's hidden_states must be a tensor")
    if family == "flux":
        for name in ("img_ids", "txt_ids"):
            ids = arguments.get(name)
            if isinstance(ids, Tensor) and ids.dim() != 2:
                raise ValueError(
                    f"context parallel: Flux's {name} must be 2-D (tokens, 3), got shape "
                    f"{tuple(ids.shape)} (3-D ids are deprecated in diffusers and not sharded)"
                )
        return {
            "image tokens": hidden.shape[1],
            "text tokens": arguments["encoder_hidden_states"].shape[1],
        }
    patch = model.config.patch_size
    if hidden.dim() != 4:
        raise ValueError(
            "context parallel: hidden_states must be 4-D latents (batch, channels, height, "
            f"width), got shape {tuple(hidden.shape)}"
        )
    height, width = hidden.shape[-2] // patch, hidden.shape[-1] // patch
    if family == "sd3":
        return {
            "image tokens": height * width,
            "text tokens": arguments["encoder_hidden_states"].shape[1],
        }
    image = height * width if height == width else model.max_seq  # HiDream pads non-square
    return {
        "image tokens": image,
        "T5 tokens": arguments["encoder_hidden_states_t5"].shape[1],
        "Llama tokens": arguments["encoder_hidden_states_llama3"].shape[2],
    }


def _check_lengths(lengths: dict[str, int], state: _State, world: int) -> None:
    unified = state.config.ring_degree > 1 and state.config.ulysses_degree > 1
    for name, length in lengths.items():
        if unified and length % world:
            raise ValueError(
                f"context parallel: {length} {name} do not split evenly over {world} ranks, "
                "which unified ring + Ulysses attention needs; use ring or Ulysses alone "
                "(they take uneven shards) or a world size dividing every sequence"
            )
        if length < world:
            raise ValueError(
                f"context parallel: {length} {name} are fewer than the {world} ranks; every "
                "rank needs at least one token of each sequence"
            )


def _check_call(state: _State, model: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: the sequences fit the world, and every rank has the same inputs."""
    state.model_calls += 1
    error, lengths, arguments = None, {}, {}
    try:
        arguments = _arguments(model, args, kwargs)
        lengths = _lengths(state.family, model, arguments)
        _check_lengths(lengths, state, group_size(None))
    except (TypeError, ValueError) as caught:
        error = caught
    agree_inputs(
        args,
        kwargs,
        None,
        what="context parallel model call",
        header=list(lengths.values()),
        names=list(lengths),
        advice="Every rank must run the same generation with a seeded generator",
        local_error=error,
    )
    # diffusers' split hook on the model itself (Flux's plan has one) accepts only tensor
    # outputs: 0.42.1 raises ValueError for a Transformer2DModelOutput. Ask for the tuple and
    # wrap it back in _wrap_output.
    state.wrap_output = "" in state.plan and arguments.get("return_dict", True)
    if state.wrap_output:
        if "return_dict" in arguments and "return_dict" not in kwargs:
            raise TypeError("context parallel: pass return_dict as a keyword argument")
        return args, {**kwargs, "return_dict": False}
    return None


def _wrap_output(state: _State, model: torch.nn.Module, args, kwargs, output):
    """Forward hook: the output type the caller asked for (see :func:`_check_call`)."""
    if not state.wrap_output:
        return None
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=output[0])


def _shard(tensor: Optional[Tensor], state: _State) -> Optional[Tensor]:
    """This rank's piece of a tensor's sequence dim (1), as diffusers' sharder cuts it."""
    if tensor is None:
        return None
    mesh = state.config._flattened_mesh
    return tensor.tensor_split(mesh.size(), dim=1)[dist.get_rank(mesh.get_group())]


def _wrap_patchify(model: torch.nn.Module, state: _State) -> None:
    """HiDream builds image tokens, their mask and their position ids in ``patchify``; shard
    all three there (img_sizes stays whole: unpatchify runs on the gathered output)."""
    unwrapped = type(model).patchify

    def patchify(hidden_states: Tensor):
        tokens, masks, sizes, ids = unwrapped(model, hidden_states)
        return _shard(tokens, state), _shard(masks, state), sizes, _shard(ids, state)

    model.patchify = patchify


# --------------------------------------------------------------------------- public
def _transformer(target: Any) -> torch.nn.Module:
    return denoiser_of(target, ("transformer",), families="SD3, Flux, HiDream")


def _degrees(
    ring_degree: Optional[int], ulysses_degree: Optional[int], world: int
) -> tuple[int, int]:
    """(ring, ulysses) degrees whose product is the world size; default: all ring."""
    for name, value in (("ring_degree", ring_degree), ("ulysses_degree", ulysses_degree)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if ring_degree is None and ulysses_degree is None:
        ring_degree = world  # ring takes any head count and uneven shards
    ring = ring_degree if ring_degree is not None else world // ulysses_degree
    ulysses = ulysses_degree if ulysses_degree is not None else world // ring
    if ring * ulysses != world or world < 2:
        raise ValueError(
            f"ring_degree ({ring}) x ulysses_degree ({ulysses}) must equal the world size "
            f"({world}), which must be at least 2"
        )
    return ring, ulysses


def _check_heads(model: torch.nn.Module, ulysses: int) -> None:
    """Ulysses shards heads: its degree must divide the model's."""
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if ulysses > 1 and heads is not None and heads % ulysses:
        raise ValueError(
            f"ulysses_degree {ulysses} must divide the model's {heads} attention heads "
            "(Ulysses shards heads); use ring_degree for the rest of the world"
        )


def _setup_config(device: torch.device, ring: int, ulysses: int):
    """diffusers' ContextParallelConfig on a mesh of the model's device type: what
    ``ModelMixin._resolve_parallel_config`` does, without its ``rank % device_count()``."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    config = ContextParallelConfig(
        ring_degree=ring,
        ulysses_degree=ulysses,
        # tensor_split sharding (uneven shards) where npu_attn's attention supports it
        ring_anything=ring > 1 and ulysses == 1,
        ulysses_anything=ulysses > 1 and ring == 1,
    )
    mesh = init_device_mesh(device.type, config.mesh_shape, mesh_dim_names=config.mesh_dim_names)
    config.setup(dist.get_rank(), dist.get_world_size(), device, mesh)
    return config


def enable_context_parallel(
    target: Any,
    *,
    ring_degree: Optional[int] = None,
    ulysses_degree: Optional[int] = None,
) -> dict[str, Any]:
    """Shard an SD3, Flux or HiDream transformer's sequence across every rank of the world.

    Call on every rank (torch.distributed initialised, e.g. by
    :func:`~npu_attn.parallel.init_distributed` under torchrun), with identical models.

    Args:
        target: a pipeline with a ``transformer`` or the transformer itself
            (``SD3Transformer2DModel``, ``FluxTransformer2DModel``,
            ``HiDreamImageTransformer2DModel``), on CPU.
        ring_degree, ulysses_degree: ranks in the ring and Ulysses dimensions; their product
            is the world size. Default: ring over the whole world (any head count, any
            sequence length). Ulysses needs the heads divisible by its degree.

    The transformer's attention then always runs npu_attn's kernel (inside ring or Ulysses),
    whatever attention strategy was set; set strategies before enabling (a processor already
    switched by ``set_attention_strategy`` is unwrapped, and put back by
    :func:`disable_context_parallel`), not while context parallelism is on.

    Returns:
        ``{"model", "ring_degree", "ulysses_degree", "world_size", "rank"}``. Enabling again
        replaces the earlier setting.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError, ValueError: another model family, bad degrees, heads that Ulysses cannot
            split, a processor on a non-native diffusers attention backend.
    """
    require_distributed("enable_context_parallel")
    model = _transformer(target)
    family = FAMILIES.get(type(model).__name__)
    if family is None:
        raise ValueError(
            f"context parallel supports {', '.join(FAMILIES)}; got {type(model).__name__}"
        )
    ring, ulysses = _degrees(ring_degree, ulysses_degree, dist.get_world_size())
    _check_heads(model, ulysses)
    _check_backends(model)
    device = next(model.parameters()).device
    if ring > 1 and device.type != "cpu":
        raise ValueError(f"ring_degree > 1 needs a model on CPU, got {device}: {CPU_ONLY}")
    disable_context_parallel(model)
    config = _setup_config(device, ring, ulysses)
    plan = type(model)._cp_plan if family == "flux" else _plans()[family]
    state = _State(
        family=family,
        plan=plan,
        config=config,
        ring_group=config._ring_mesh.get_group(),
        ulysses_group=config._ulysses_mesh.get_group(),
        originals={},
        handles=[],
    )
    _install(model, state)
    return context_parallel_of(model)


def _install(model: torch.nn.Module, state: _State) -> None:
    """Processors, diffusers' sharding hooks, HiDream's patchify, npu_attn's checks."""
    from diffusers.hooks.context_parallel import apply_context_parallel

    _redirect.install()
    _wrap_processors(model, state)
    apply_context_parallel(model, state.config, state.plan)
    if state.family == "hidream":
        _wrap_patchify(model, state)
    check = functools.partial(_check_call, state)
    state.handles.append(model.register_forward_pre_hook(check, with_kwargs=True, prepend=True))
    wrap = functools.partial(_wrap_output, state)
    state.handles.append(model.register_forward_hook(wrap, with_kwargs=True))
    _STATE.set(model, state)


def disable_context_parallel(target: Any) -> bool:
    """Undo :func:`enable_context_parallel`: diffusers' sharding hooks removed, the original
    processors (the same objects) and methods back. Returns whether it was enabled."""
    model = _transformer(target)
    return _STATE.remove(model, functools.partial(_uninstall, model))


def _uninstall(model: torch.nn.Module, state: _State) -> None:
    """Undo :func:`_install`."""
    from diffusers.hooks.context_parallel import remove_context_parallel

    for handle in state.handles:
        handle.remove()
    remove_context_parallel(model, state.plan)
    modules = dict(attention_modules(model))
    for name, processor in state.originals.items():
        modules[name].set_processor(processor)
    model.__dict__.pop("patchify", None)


def context_parallel_of(target: Any) -> Optional[dict[str, Any]]:
    """The context-parallel settings and counters of a transformer, or None when off."""
    model = _transformer(target)
    state = _STATE.get(model)
    if state is None:
        return None
    return {
        "model": type(model).__name__,
        "ring_degree": state.config.ring_degree,
        "ulysses_degree": state.config.ulysses_degree,
        "world_size": group_size(None),
        "rank": group_rank(None),
        "model_calls": state.model_calls,
        "attention_calls": state.attention_calls,
    }
