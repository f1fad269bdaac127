"""The backends, in priority order, and the choice of one for a call.

Adding a backend: write a module with a :class:`~npu_attn.attention.backends.base.Backend`
subclass and add one ``register(...)`` line below (docs/architecture.md has the recipe).
Everything else (``scaled_dot_product_attention(backend=...)``, ``npu_attn.backends()``, the
doctor, a strategy of the same name) reads this registry.

``scaled_dot_product_attention(..., backend=None)`` takes the first registered backend with no
``not_supported_reasons`` that is not ``opt_in`` (lossy backends run only when named); an
explicit ``backend=`` that cannot run raises ``ValueError``
listing its reasons.
"""

from __future__ import annotations

from typing import Optional

from .base import AttentionCall, Backend
from .int8 import Int8Backend
from .npu import NpuBackend
from .tiled import TiledBackend
from .torch_sdpa import TorchSdpaBackend
from .vanilla import VanillaBackend

BACKENDS: list[Backend] = []
BY_NAME: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add ``backend`` after the ones registered so far (lower priority); names are unique."""
    if backend.name in BY_NAME:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    BACKENDS.append(backend)
    BY_NAME[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Remove a backend (tests and plug-ins that were registered for a while)."""
    backend = BY_NAME.pop(name)
    BACKENDS.remove(backend)


register(TiledBackend())
register(NpuBackend())
register(TorchSdpaBackend())
register(VanillaBackend())
register(Int8Backend())


def get(name: str) -> Backend:
    if name not in BY_NAME:
        raise ValueError(f"unknown backend {name!r}; backends: {', '.join(BY_NAME)}")
    return BY_NAME[name]


def select(call: AttentionCall, backend: Optional[str], preferred: Optional[str] = None) -> Backend:
    """The backend to run ``call`` on.

    ``backend`` is a requirement (ValueError with its reasons if it cannot run the call).
    ``preferred`` (the default set with ``set_attention_strategy(None, name)``) is taken when it
    can run the call; otherwise the automatic choice applies, so a default that cannot take a
    call (``"tiled"`` and float64, ``"npu"`` and CPU tensors) does not make the call fail."""
    if backend is not None:
        reasons = get(backend).not_supported_reasons(call)
        if reasons:
            raise ValueError(f"backend {backend!r} cannot run this call: " + "; ".join(reasons))
        return BY_NAME[backend]
    if preferred in BY_NAME and not BY_NAME[preferred].not_supported_reasons(call):
        return BY_NAME[preferred]
    refusals = {}
    for candidate in BACKENDS:
        if candidate.opt_in:
            continue
        reasons = candidate.not_supported_reasons(call)
        if not reasons:
            return candidate
        refusals[candidate.name] = "; ".join(reasons)
    detail = " | ".join(f"{name}: {why}" for name, why in refusals.items())
    raise TypeError(f"no attention backend can run this call ({detail})")


def chosen_without_checks(backend: Optional[str], preferred: Optional[str]) -> Optional[Backend]:
    """What :func:`select` returns for a call that this backend can run, decided without the
    call (the public function's fast path asks, then checks the call against the backend's own
    declaration): the required backend, else a registered preferred one, else the first in
    priority order. The same rule as ``select``; where ``select`` would also fall back past
    a preferred backend that refuses, the fast path simply does not apply."""
    if backend is not None:
        return BY_NAME.get(backend)
    if preferred in BY_NAME:
        return BY_NAME[preferred]
    automatic = [b for b in BACKENDS if not b.opt_in]
    return automatic[0] if automatic else None


def backends() -> list[dict]:
    """Every backend with what it supports and whether it is available here."""
    return [b.describe() for b in BACKENDS]
