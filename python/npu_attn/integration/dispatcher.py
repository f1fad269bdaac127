"""npu_attn as a backend of diffusers' attention dispatcher, for ``model.set_attention_backend``.

Model families built on diffusers' ``AttentionModuleMixin`` (Flux, Wan, QwenImage, ...) compute
attention through ``diffusers.models.attention_dispatch.dispatch_attention_fn``, which looks the
backend up by name in ``_AttentionBackendRegistry``. After :func:`register_diffusers_backends`
(which :func:`npu_attn.set_attention_strategy` also calls), users of that API get npu_attn too::

    import npu_attn
    npu_attn.register_diffusers_backends()
    pipe.transformer.set_attention_backend("npu_attn")        # the tiled kernel
    pipe.transformer.set_attention_backend("npu_attn_auto")   # npu_attn's per-shape choice
    with attention_backend("npu_attn"): ...                    # diffusers' context manager

Each backend runs the npu_attn strategy of the same name (``tiled``, ``auto``), so call
counting, the kernel-variant choice and graph mode behave as with ``set_attention_strategy``:
under ``torch.compile`` dynamo traces the dispatcher, which reads the backend from the
processor, and the strategy's registered op lands in the graph (no graph break).

How the backend is registered, and what that relies on: the dispatcher only accepts names that
are members of its ``AttentionBackendName`` enum, which is closed (``set_attention_backend``
checks ``AttentionBackendName.__members__``). Python enums cannot be extended through a public
API, so :func:`_add_enum_member` adds members the way ``aenum.extend_enum`` does, through the
enum's internal maps (``_member_map_``, ``_value2member_map_``, ``_member_names_``, which CPython
3.9-3.13 keep), then registers the function with the dispatcher's own
``_AttentionBackendRegistry.register`` (private, present since diffusers 0.35). Both are pinned
by the tested diffusers version (pyproject's ``diffusers`` extra, 0.42.1); if a later diffusers
or Python changes them, registration raises :class:`DiffusersBackendUnavailable` naming what was
missing, and ``set_attention_strategy`` (which does not depend on it) keeps working.

Not supported through the dispatcher: diffusers' context parallelism (``_parallel_config``:
its CPU path fails in diffusers itself, see :mod:`npu_attn.parallel`, which provides ring and
Ulysses attention with npu_attn's kernel instead) and ``return_lse``; both raise ValueError.
"""

from __future__ import annotations

import enum
from typing import Callable, Optional

import torch

from ..attention import strategies

__all__ = ["BACKENDS", "DiffusersBackendUnavailable", "register_diffusers_backends"]

# dispatcher backend name -> npu_attn strategy it runs
BACKENDS = {"npu_attn": "tiled", "npu_attn_auto": "auto"}


class DiffusersBackendUnavailable(RuntimeError):
    """diffusers' dispatcher does not offer what registering a backend needs."""


def _add_enum_member(enum_cls: type, name: str, value: str) -> enum.Enum:
    """Add ``name = value`` to a str-valued Enum class (idempotent); returns the member."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def _dispatcher_function(strategy: str) -> Callable[..., torch.Tensor]:
    """The function the dispatcher calls: (B, S, H, D) tensors as diffusers passes them.

    It looks the strategy's runner up on every call, not once here: it is registered once per
    process, and a runner wrapped at that moment (the demo's attention timer) would otherwise
    stay in diffusers' registry after it is removed, and split every compiled graph at its
    ``time.perf_counter``."""

    def npu_attn_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: Optional[float] = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        _parallel_config=None,
    ) -> torch.Tensor:
        if return_lse:
            raise ValueError(
                "return_lse=True: npu_attn's diffusers backend returns the attention output "
                "only; for ring attention use npu_attn.parallel"
            )
        if _parallel_config is not None:
            raise ValueError(
                "diffusers' context parallelism is not supported by npu_attn's dispatcher "
                "backend (its CPU path fails inside diffusers); use "
                "npu_attn.parallel.enable_context_parallel instead"
            )
        # As diffusers' native backend: a (B, S_k) mask means one row of keys per batch.
        if (
            attn_mask is not None
            and attn_mask.ndim == 2
            and attn_mask.shape[0] == query.shape[0]
            and attn_mask.shape[1] == key.shape[1]
        ):
            attn_mask = attn_mask[:, None, None, :]
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        out = strategies.RUNNERS[strategy](
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)

    npu_attn_attention.__qualname__ = npu_attn_attention.__name__ = f"npu_attn_{strategy}_attention"
    return npu_attn_attention


def _dispatch_module():
    try:
        from diffusers.models import attention_dispatch
    except ImportError as error:
        raise DiffusersBackendUnavailable(
            f"diffusers' attention dispatcher cannot be imported ({error}); install the "
            "tested version: pip install 'npu_attn[diffusers]'"
        ) from error
    for needed in ("AttentionBackendName", "_AttentionBackendRegistry"):
        if not hasattr(attention_dispatch, needed):
            raise DiffusersBackendUnavailable(
                f"this diffusers has no attention_dispatch.{needed}; npu_attn's dispatcher "
                "backend is tested with diffusers 0.42.1 (set_attention_strategy still works)"
            )
    return attention_dispatch


def register_diffusers_backends() -> list[str]:
    """Make ``npu_attn`` (the tiled kernel) and ``npu_attn_auto`` (per-shape choice) backends
    of diffusers' attention dispatcher (idempotent); returns their names.

    Raises :class:`DiffusersBackendUnavailable` if diffusers or its dispatcher internals are
    missing (see the module docstring for what this relies on)."""
    dispatch = _dispatch_module()
    names, registry = dispatch.AttentionBackendName, dispatch._AttentionBackendRegistry
    for value, strategy in BACKENDS.items():
        try:
            member = _add_enum_member(names, value.upper(), value)
        except (AttributeError, TypeError) as error:
            raise DiffusersBackendUnavailable(
                f"cannot add {value!r} to diffusers' AttentionBackendName ({error}); this "
                "Python or diffusers keeps enum members differently than the tested ones"
            ) from error
        if member not in registry._backends:
            registry.register(member, constraints=[], supports_context_parallel=False)(
                _dispatcher_function(strategy)
            )
    return list(BACKENDS)
