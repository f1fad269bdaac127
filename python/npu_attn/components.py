"""What a ``target`` (a diffusers pipeline or a bare model) comes down to, and the state a
feature keeps on a model.

The one reader of a pipeline's components, shared by strategy switching, the step
accelerations, graph mode and scale-out. This module imports nothing from npu_attn, so every
layer above can use it without an import cycle.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["DENOISERS", "StateAttribute", "denoiser_of", "models_of"]

DENOISERS = ("unet", "transformer")  # a pipeline's denoiser attributes, in the order tried


def models_of(
    target: Any, expected: str = "target must be a diffusers pipeline or a torch.nn.Module"
) -> dict[str, torch.nn.Module]:
    """The models of ``target``: a pipeline's ``nn.Module`` components by name, or
    ``{class name: target}`` for a model.

    Raises:
        TypeError: ``target`` is neither; the message is ``expected``, then what it got.
    """
    if isinstance(target, torch.nn.Module):
        return {type(target).__name__: target}
    components = getattr(target, "components", None)
    if not isinstance(components, dict):
        raise TypeError(f"{expected}, got {type(target).__name__}")
    return {name: m for name, m in components.items() if isinstance(m, torch.nn.Module)}


def denoiser_of(
    target: Any,
    kinds: tuple[str, ...] = DENOISERS,
    *,
    required: bool = True,
    families: str = "",
) -> Optional[torch.nn.Module]:
    """The denoiser of a pipeline, or ``target`` itself when it is a model.

    Args:
        target: a diffusers pipeline or an ``nn.Module``.
        kinds: the pipeline attributes that may hold the denoiser, tried in order (e.g.
            ``("transformer",)`` for a transformer-only feature); the first that holds an
            ``nn.Module`` is it.
        required: raise when there is none (else return None).
        families: the model families expected, named in the error (e.g. ``"SD3, Flux"``).

    Raises:
        TypeError: ``required`` and ``target`` is neither a model nor a pipeline with one of
            ``kinds``; the message names what was expected.
    """
    if isinstance(target, torch.nn.Module):
        return target
    for name in kinds:
        model = getattr(target, name, None)
        if isinstance(model, torch.nn.Module):
            return model
    if not required:
        return None
    attributes = " or ".join(f"`{name}`" for name in kinds)
    hint = f" ({families})" if families else ""
    model = kinds[0] if len(kinds) == 1 else "denoiser"
    raise TypeError(
        f"target must be a diffusers pipeline with a {attributes}{hint}, or the {model} model "
        f"itself, got {type(target).__name__}"
    )


class StateAttribute:
    """A feature's state on a model (or pipeline), kept in one plain instance attribute.

    Set with ``object.__setattr__``, so it is not a submodule and not in ``state_dict``, and it
    is pickled and deep-copied with the object; read from the instance ``__dict__`` only.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def get(self, owner: Any) -> Any:
        """The state on ``owner``, or None (also when ``owner`` is None)."""
        return None if owner is None else owner.__dict__.get(self.name)

    def set(self, owner: Any, state: Any) -> None:
        object.__setattr__(owner, self.name, state)

    def remove(self, owner: Any, undo: Optional[Callable[[Any], None]] = None) -> bool:
        """``undo(state)``, then forget the state; returns whether there was one. If ``undo``
        raises, the state stays (removing again retries)."""
        state = self.get(owner)
        if state is None:
            return False
        if undo is not None:
            undo(state)
        object.__delattr__(owner, self.name)
        return True
