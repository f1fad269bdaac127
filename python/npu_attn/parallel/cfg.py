"""CFG-parallel: the two halves of a classifier-free-guidance batch on two processes.

A diffusers pipeline with guidance calls its denoiser (UNet or transformer) once per step with
the batch ``[unconditional; conditional]`` (2B samples) and combines the two halves itself.
:func:`enable_cfg_parallel` hooks the denoiser (a forward pre-hook and a forward hook, nothing
else): with ``world`` ranks, rank r runs only its ``2B / world`` slice of every batched input,
and ``all_gather`` reassembles the full output, so the pipeline's own ``__call__``, unchanged,
sees the complete noise prediction on every rank and every rank computes the same latents and
returns the same image. This is the seeds' "dual-chip" mode (rank 0 the unconditional half,
rank 1 the text half), on ``torch.distributed``.

Why hooks on the denoiser rather than a pipeline wrapper: every pipeline family (SD 1.5/2.1,
SDXL with its added conditions, SD3, HiDream ...) builds the guidance batch and applies the
guidance formula in its own ``__call__``; the denoiser call is the one place they share. Hooks
compose with attention strategies, Token Merging and DeepCache, and removing them restores the
model exactly.

Which inputs are batched: every tensor (also inside dicts, lists and tuples, e.g. SDXL's
``added_cond_kwargs``) whose first dimension is the batch size, except the few names listed in
:data:`NOT_BATCHED`; HiDream's ``encoder_hidden_states_llama3`` has its batch in dim 1
(:data:`BATCH_DIM`). Outputs: every tensor whose first dimension is the local batch is
gathered.

Agreement: ranks must hold the same inputs (same prompt embeddings, same latents), which a
seeded ``generator`` guarantees. Every call first exchanges a fingerprint of each input tensor
(norm and two fixed projections, see :func:`~npu_attn.parallel.group.fingerprint`) and the
batch size; if the ranks differ (a forgotten seed, different prompts or step counts), every
rank raises :class:`~npu_attn.parallel.RankDisagreement` at once instead of producing an image
from mixed inputs or hanging. The check costs one 256-byte ``all_gather`` per step.

A batch that the world size does not divide (no guidance: ``guidance_scale <= 1``; SD3's
skip-layer guidance pass) raises ``ValueError`` by default; ``on_indivisible="replicate"`` runs
such calls whole on every rank instead (correct, but no faster).

Inference only: the gather is not differentiable, so outputs that require grad raise.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..components import StateAttribute, denoiser_of
from .group import count_bytes, group_rank, group_size, require_distributed
from .inputs import agree_inputs, map_tensors

__all__ = [
    "BATCH_DIM",
    "NOT_BATCHED",
    "cfg_parallel_of",
    "disable_cfg_parallel",
    "enable_cfg_parallel",
]

# Inputs whose batch is not in dim 0: HiDream's Llama states are (layers, batch, tokens, dim).
BATCH_DIM = {"encoder_hidden_states_llama3": 1}
# Inputs that are never batched, even if their first dimension happens to equal the batch:
# Flux's position ids are (tokens, 3).
NOT_BATCHED = frozenset({"img_ids", "txt_ids"})
# Where the batch size is read: the first positional argument, or one of these keywords.
SAMPLE_NAMES = ("sample", "hidden_states", "x")

_STATE = StateAttribute("_npu_attn_cfg_parallel")
ON_INDIVISIBLE = ("raise", "replicate")
_SEED_ADVICE = (
    "Every rank must run the same generation: pass the same prompts and a seeded generator, "
    "e.g. generator=torch.Generator().manual_seed(0), on every rank"
)


@dataclasses.dataclass
class _State:
    group: Optional[dist.ProcessGroup]
    rank: int
    world: int
    on_indivisible: str
    handles: list
    calls: int = 0
    split_calls: int = 0
    local_batch: Optional[int] = None  # this call's slice size; None: the call ran whole


# --------------------------------------------------------------------------- inputs
def _batch_size(args: tuple, kwargs: dict) -> int:
    """The batch of the denoiser's sample (its first argument or sample keyword)."""
    sample = args[0] if args else next((kwargs[n] for n in SAMPLE_NAMES if n in kwargs), None)
    if not isinstance(sample, Tensor) or sample.dim() == 0:
        raise TypeError(
            "CFG-parallel reads the batch size from the denoiser's first argument (or its "
            f"{'/'.join(SAMPLE_NAMES)} keyword), which must be a tensor; got "
            f"{type(sample).__name__}"
        )
    return sample.shape[0]


def _batch_dim(tensor: Tensor, name: str, batch: int) -> Optional[int]:
    """The dim of ``tensor`` that holds the batch, or None if it is not batched."""
    if name in NOT_BATCHED:
        return None
    dim = BATCH_DIM.get(name, 0)
    if tensor.dim() > dim and tensor.shape[dim] == batch:
        return dim
    return None


# --------------------------------------------------------------------------- hooks
def _split_inputs(state: _State, module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: every rank holds the same inputs (or every rank raises); keep this
    rank's slice of every batched input."""
    state.calls += 1
    error, batch = None, 0
    try:
        batch = _batch_size(args, kwargs)
    except TypeError as caught:  # raised after the exchange, so the peers raise too
        error = caught
    agree_inputs(
        args,
        kwargs,
        state.group,
        what="CFG-parallel",
        header=[batch],
        names=["batch size"],
        advice=_SEED_ADVICE,
        local_error=error,
    )
    if batch % state.world:
        if state.on_indivisible == "replicate":
            state.local_batch = None
            return None
        raise ValueError(
            f"CFG-parallel: the denoiser was called with batch {batch}, which the world size "
            f"{state.world} does not divide. Guidance doubles the batch, so this usually means "
            "the pipeline runs without classifier-free guidance (guidance_scale <= 1) or makes "
            "an extra unguided pass; use guidance, or enable_cfg_parallel(..., "
            "on_indivisible='replicate') to run such calls whole on every rank"
        )
    local = batch // state.world
    start = state.rank * local
    state.local_batch = local
    state.split_calls += 1

    def take(tensor: Tensor, name: str) -> Tensor:
        dim = _batch_dim(tensor, name, batch)
        return tensor if dim is None else tensor.narrow(dim, start, local)

    return tuple(map_tensors(list(args), take)), map_tensors(kwargs, take)


def _gather(state: _State, tensor: Tensor) -> Tensor:
    """Every rank's slice of ``tensor``, concatenated in rank order (the full batch)."""
    if tensor.requires_grad:
        raise RuntimeError(
            "CFG-parallel is for inference: the denoiser's output requires grad, and the "
            "all_gather that reassembles the batch is not differentiable (run under "
            "torch.no_grad(), as pipelines do)"
        )
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(state.world)]
    dist.all_gather(parts, tensor, group=state.group)
    count_bytes("cfg", tensor.numel() * tensor.element_size() * (state.world - 1))
    return torch.cat(parts, dim=0)


def _gather_outputs(state: _State, module: torch.nn.Module, args, kwargs, output):
    """Forward hook: the full batch of every batched output, on every rank."""
    local = state.local_batch
    if local is None:
        return None

    def full(tensor: Tensor, name: str) -> Tensor:
        return _gather(state, tensor) if tensor.dim() and tensor.shape[0] == local else tensor

    if isinstance(output, dict):  # diffusers' BaseOutput (an OrderedDict dataclass)
        return type(output)(**{k: map_tensors(v, full, k) for k, v in output.items()})
    return map_tensors(output, full)


# --------------------------------------------------------------------------- public
def enable_cfg_parallel(
    target: Any,
    *,
    group: Optional[dist.ProcessGroup] = None,
    on_indivisible: str = "raise",
) -> dict[str, Any]:
    """Split a pipeline's guidance batch across the ranks of ``group`` (see the module doc).

    Args:
        target: a diffusers pipeline (its ``unet`` or ``transformer`` is hooked) or the
            denoiser model itself.
        group: the process group (default: the whole world); torch.distributed must be
            initialised (:func:`~npu_attn.parallel.init_distributed` under torchrun).
        on_indivisible: ``"raise"`` (default) or ``"replicate"``, for denoiser calls whose
            batch the world size does not divide.

    Returns:
        ``{"model": class name, "rank": r, "world_size": n, "on_indivisible": ...}``.
        Enabling again replaces the earlier setting.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError, ValueError: a target without a denoiser, an unknown ``on_indivisible``.
    """
    require_distributed("enable_cfg_parallel")
    if on_indivisible not in ON_INDIVISIBLE:
        raise ValueError(f"on_indivisible must be one of {ON_INDIVISIBLE}, got {on_indivisible!r}")
    model = denoiser_of(target)
    disable_cfg_parallel(model)
    state = _State(group, group_rank(group), group_size(group), on_indivisible, [])
    state.handles = [
        model.register_forward_pre_hook(functools.partial(_split_inputs, state), with_kwargs=True),
        model.register_forward_hook(functools.partial(_gather_outputs, state), with_kwargs=True),
    ]
    _STATE.set(model, state)
    return cfg_parallel_of(model)


def disable_cfg_parallel(target: Any) -> bool:
    """Remove CFG-parallel's hooks (the model is exactly as before); whether it was on."""
    return _STATE.remove(denoiser_of(target), _remove_hooks)


def _remove_hooks(state: _State) -> None:
    for handle in state.handles:
        handle.remove()


def cfg_parallel_of(target: Any) -> Optional[dict[str, Any]]:
    """CFG-parallel's settings and counters on a pipeline's denoiser, or None when off."""
    model = denoiser_of(target)
    state = _STATE.get(model)
    if state is None:
        return None
    return {
        "model": type(model).__name__,
        "rank": state.rank,
        "world_size": state.world,
        "on_indivisible": state.on_indivisible,
        "calls": state.calls,
        "split_calls": state.split_calls,
    }
