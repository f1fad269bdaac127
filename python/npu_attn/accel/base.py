"""What every acceleration method shares: the row that registers it (:class:`Method`), the error
for a model family it does not apply to, options parsing, instance ``forward`` wrappers, and
the check that diffusers' one cache per model is free.

Adding a method: a module in this folder with its check/apply/remove/settings functions and a
``METHOD = Method(...)`` row, plus that row in ``registry.METHODS_TABLE``.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..components import StateAttribute


@dataclass(frozen=True)
class Method:
    """One acceleration method, as :func:`npu_attn.accelerate` sees it.

    Attributes:
        name: the ``accelerate`` keyword (``"token_merging"``).
        variable: the environment variable that asks for it (``"NPU_ATTN_TOME"``).
        parse: the variable's text to an option value (raises ValueError).
        expected: what the variable must be, for the error message.
        check: ``(target, value) -> checked options``; raises TypeError/ValueError, or
            :class:`ModelFamilyError` where the method does not apply to the target.
        apply: ``(target, checked options) -> settings applied``.
        remove: ``target -> whether it was applied`` (undoes only the method's own changes).
        settings_of: ``target -> settings while applied, else None``.
    """

    name: str
    variable: str
    parse: Callable[[str], Any]
    expected: str
    check: Callable[[Any, Any], Any]
    apply: Callable[[Any, Any], dict]
    remove: Callable[[Any], bool]
    settings_of: Callable[[Any], Optional[dict]]


class ModelFamilyError(ValueError):
    """An acceleration method that does not apply to this model family (e.g. Token Merging on
    a Flux transformer). Environment-requested methods are skipped on it, explicit ones raise."""


def options_from(cls: type, value: Any, method: str, main: str):
    """``cls`` (an options dataclass of ``method``) from an instance, a mapping of its field
    names (``main`` required, unknown names refused), or the value of its ``main`` field."""
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"{method} got unknown options {unknown}; valid: {sorted(known)}")
        if main not in value:
            raise TypeError(f"{method} options need a '{main}'")
        return cls(**value)
    return cls(**{main: value})


class InstanceForward:
    """A module's instance ``forward`` that can still run the module's previous ``forward``
    (the class's, or an earlier instance ``forward``).

    A module-level class rather than a closure, so that a model carrying it pickles and
    deep-copies (the approach of diffusers_integration's processor wrappers); ``__wrapped__``
    lets ``inspect.signature`` see the real signature.

    The class's ``forward`` function is kept at wrapping time rather than looked up as
    ``type(module).forward`` at each call: diffusers marks its transformer blocks
    ``maybe_allow_in_graph``, and dynamo cannot call a method of such a class, so that lookup
    broke the graph inside the model's block loop and dynamo ran the whole model eagerly.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.previous = module.__dict__.get("forward")  # None: the class's forward
        self.class_forward = type(module).forward

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "class_forward" not in state:  # pickled before class_forward was kept
            self.class_forward = type(self.module).forward

    def original(self, *args, **kwargs):
        if self.previous is None:
            return self.class_forward(self.module, *args, **kwargs)
        return self.previous(*args, **kwargs)

    @property
    def __wrapped__(self):
        return self.previous or self.class_forward.__get__(self.module)

    def install(self) -> None:
        self.module.forward = self

    def uninstall(self) -> None:
        if self.previous is None:
            del self.module.forward  # the class's forward again
        else:
            self.module.forward = self.previous


# Tensors an acceleration keeps between steps live in this module-level table, reached through
# a global, not through the model: torch.compile treats tensors reached through an nn.Module's
# attributes as static (under freezing: graph constants guarded on their identity), so every
# refresh of a cache recompiled the model until dynamo's recompile limit, after which the UNet
# ran eagerly. Reached through a global they are ordinary graph inputs.
_TENSOR_STORES: dict[int, dict] = {}
_store_tokens = itertools.count()


class TensorStore:
    """A dict of tensors kept between model calls (``store.tensors``), owned by an
    acceleration's state. Pickles and deep-copies with its contents; each copy is its own."""

    def __init__(self) -> None:
        token = next(_store_tokens)
        _TENSOR_STORES[token] = {}
        self._token = token
        weakref.finalize(self, _TENSOR_STORES.pop, token, None)

    @property
    def tensors(self) -> dict:
        return _TENSOR_STORES[self._token]

    def __getstate__(self) -> dict[str, Any]:
        return {"tensors": dict(self.tensors)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
        self.tensors.update(state["tensors"])


def refuse_other_diffusers_cache(model: torch.nn.Module, ours: StateAttribute, other: str) -> None:
    """Raise when diffusers' cache hooks are on ``model`` but not through ``ours`` (``other``
    or ``model.enable_cache`` enabled them): diffusers keeps one cache per model."""
    enabled = getattr(model, "_cache_config", None)
    if enabled is not None and ours.get(model) is None:
        raise ValueError(
            f"{type(model).__name__} already has diffusers' {type(enabled).__name__} enabled (by "
            f"{other} or model.enable_cache); remove it first (npu_attn.reset_acceleration or "
            "model.disable_cache())"
        )
