"""Walking a model call's inputs, and checking that every rank holds the same ones.

Both CFG-parallel and context parallel split *identical* full inputs on every rank (each rank
keeps its slice), so inputs that differ between ranks - a forgotten generator seed, rank-
dependent prompts, a different step count - would silently mix two generations. One small
``all_gather`` per model call compares fingerprints (:func:`._group.fingerprint`) instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch.distributed as dist
from torch import Tensor

from .group import RankDisagreement, exchange, fingerprint, require_equal

__all__ = ["agree_inputs", "map_tensors", "tensors_in"]

# Fingerprints of the same inputs on different machines differ only by rounding.
FINGERPRINT_TOLERANCE = 1e-4


def map_tensors(value: Any, fn: Callable[[Tensor, str], Tensor], name: str = "") -> Any:
    """``value`` with ``fn(tensor, name)`` applied to every tensor in it (dicts, lists and
    tuples are walked; a dict's keys name their values, a sequence passes its name on)."""
    if isinstance(value, Tensor):
        return fn(value, name)
    if isinstance(value, dict):
        return type(value)((k, map_tensors(v, fn, k)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(map_tensors(v, fn, name) for v in value)
    return value


def tensors_in(args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[str, Tensor]]:
    """Every (name, tensor) in a call's arguments, in order."""
    found: list[tuple[str, Tensor]] = []

    def collect(tensor: Tensor, name: str) -> Tensor:
        found.append((name, tensor))
        return tensor

    map_tensors(list(args), collect)
    map_tensors(kwargs, collect)
    return found


def agree_inputs(
    args: Sequence[Any],
    kwargs: dict[str, Any],
    group: Optional[dist.ProcessGroup],
    *,
    what: str,
    header: Sequence[float] = (),
    names: Sequence[str] = (),
    advice: str = "",
    local_error: Optional[BaseException] = None,
) -> list[list[float]]:
    """Raise on every rank unless all ranks call with the same ``header`` values (labelled by
    ``names``) and inputs whose fingerprints match; returns the gathered rows."""
    tensors = tensors_in(args, kwargs)
    digest = [0.0, 0.0, 0.0]
    for i, (_, tensor) in enumerate(tensors):
        # Position-weighted sums keep the row a fixed size for any number of inputs.
        for slot, value in enumerate(fingerprint(tensor)):
            digest[slot] += value * (i + 1)
    shared = [*header, len(tensors), sum(t.numel() for _, t in tensors)]
    rows = exchange([*shared, *digest], group, what=what, local_error=local_error)
    require_equal(
        [r[: len(shared)] for r in rows],
        [*names, "number of input tensors", "input sizes"],
        what=what,
    )
    scale = max(max(abs(r[len(shared)]) for r in rows), 1.0)
    for rank, row in enumerate(rows[1:], start=1):
        pairs = zip(rows[0][len(shared) :], row[len(shared) :])
        if any(abs(a - b) > FINGERPRINT_TOLERANCE * scale for a, b in pairs):
            raise RankDisagreement(
                f"{what}: rank {rank}'s model inputs differ from rank 0's (latents, prompt "
                f"embeddings or timestep). {advice}".rstrip()
            )
    return rows
