"""Wrapping a model's own attention processors so that their SDPA call goes elsewhere: the one
mechanism under strategy switching (:mod:`npu_attn.integration.processors`) and context
parallelism (:mod:`npu_attn.parallel.context`).

A wrapper runs the diffusers processor it holds (``inner``) unchanged, with its
``torch.nn.functional.scaled_dot_product_attention`` call routed to a function of the wrapper's
(:mod:`npu_attn.integration.redirect`). :func:`routed_class` makes, per inner processor class,
a subclass whose ``__call__`` advertises the inner ``__call__``'s signature, because diffusers
filters ``cross_attention_kwargs`` by it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from . import redirect


def attention_modules(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """(name, module) of every attention module: anything with a ``processor`` and a
    ``set_processor`` (HiDream's modules have no model-level ``set_attn_processor``)."""
    for name, module in model.named_modules():
        if hasattr(module, "set_processor") and hasattr(module, "processor"):
            yield name, module


class RoutedProcessor:
    """Base of every npu_attn processor wrapper: ``self.inner`` with its SDPA call routed to
    ``self.route``. Subclasses provide both (an attribute, or a property)."""

    inner: Any
    route: Callable[..., torch.Tensor]
    # The wrapped processor class, on the subclasses routed_class makes (None on the bases).
    _wraps: Optional[type] = None

    def _run(self, *args, **kwargs):
        return redirect.call_routed(self.route, self.inner, *args, **kwargs)


class FallThrough:
    """Attribute access falls through to the wrapped processor (for wrappers that are not
    ``nn.Module``s, whose own ``__getattr__`` finds the registered ``inner``)."""

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)


@functools.cache
def routed_class(base: type, inner_cls: type, prefix: str) -> type:
    """A ``base`` subclass named ``prefix + inner_cls.__name__`` whose ``__call__`` runs
    ``_run`` with ``inner_cls.__call__``'s signature."""

    def __call__(self, *args, **kwargs):
        return self._run(*args, **kwargs)

    # inspect.signature follows __wrapped__ to the inner processor's own __call__, which dynamo
    # traces like the unswitched model (a precomputed __signature__ object made dynamo break the
    # graph on its mappingproxy when Flux checks its processor's parameters).
    functools.update_wrapper(__call__, inner_cls.__call__, assigned=("__module__", "__qualname__"))
    __call__.__wrapped__ = inner_cls.__call__
    __call__.__doc__ = f"{inner_cls.__name__}.__call__ with its SDPA call routed."
    return type(
        f"{prefix}{inner_cls.__name__}", (base,), {"__call__": __call__, "_wraps": inner_cls}
    )


def unwrapped(processor: Any) -> Any:
    """The diffusers processor under any npu_attn wrappers."""
    while isinstance(processor, RoutedProcessor):
        processor = processor.inner
    return processor
