"""The call object and the backend interface every attention implementation follows.

Modelled on xformers' fmha operators: an :class:`AttentionCall` is one SDPA call with its
arguments validated and its ``scale`` resolved once; a :class:`Backend` declares what it
supports (devices, dtypes, gradients, dropout, head dims) and answers
:meth:`Backend.not_supported_reasons` for a concrete call, in the user's terms.

Adding a backend is one module with a ``Backend`` subclass and one ``register(...)`` line in
:mod:`npu_attn.attention.backends.registry` (docs/architecture.md shows an example).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ...runtime import counts as _counts

ANY_DEVICE = "*"
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def count_call(name: str) -> None:
    """Count one call served by backend ``name`` (``npu_attn.call_counts``). Not while
    torch.compile traces: traced code runs once and the graph many times, so only npu_attn's
    own op counts itself there, when it runs (``ops.forward_cpu``)."""
    if not torch.compiler.is_compiling():
        _counts.count(name)


def needs_grad(*tensors) -> bool:
    """True when autograd will need gradients through a call on ``tensors``."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One attention call: ``softmax(query @ key^T * scale + mask) @ value``.

    Tensors are 4-D: query (B, Hq, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv);
    ``attn_mask`` is bool (True = attend) or float (added), broadcastable to (B, Hq, Lq, Lk).
    ``scale`` is resolved (1/sqrt(D) when the caller gave none); ``scale_given`` keeps what the
    caller passed, for backends that take torch's ``scale=None``.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale_given: Optional[float] = None
    enable_gqa: bool = False

    @classmethod
    def of(
        cls,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ) -> AttentionCall:
        """The call for torch SDPA's positional arguments (already in the 4-D form)."""
        return cls(
            query,
            key,
            value,
            attn_mask,
            float(dropout_p),
            bool(is_causal),
            None if scale is None else float(scale),
            bool(enable_gqa),
        )

    @property
    def scale(self) -> float:
        """The softmax scale, resolved once: the caller's or 1/sqrt(head_dim)."""
        if self.scale_given is not None:
            return self.scale_given
        return 1.0 / math.sqrt(self.query.shape[-1]) if self.query.shape[-1] else 1.0

    @property
    def device_type(self) -> str:
        return self.query.device.type

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def needs_grad(self) -> bool:
        return needs_grad(self.query, self.key, self.value, self.attn_mask)

    def sdpa_args(self) -> tuple:
        """SDPA's positional arguments, for code that takes torch's signature."""
        return (
            self.query,
            self.key,
            self.value,
            self.attn_mask,
            self.dropout_p,
            self.is_causal,
            self.scale_given,
            self.enable_gqa,
        )


class Backend:
    """One attention implementation. Subclasses set the class attributes and ``forward``."""

    name: ClassVar[str]
    description: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = (ANY_DEVICE,)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = FLOATS
    supports_dropout: ClassVar[bool] = False
    supports_grad: ClassVar[bool] = True
    max_head_dim: ClassVar[Optional[int]] = None
    # Lossy backends (int8) run only when asked for by name, never by the automatic choice.
    opt_in: ClassVar[bool] = False

    def unavailable_reason(self) -> Optional[str]:
        """Why this backend cannot run at all here (a missing package), or None."""
        return None

    def device_reason(self, device_type: str) -> Optional[str]:
        """Why this backend cannot serve tensors on ``device_type``, or None."""
        if ANY_DEVICE in self.devices or device_type in self.devices:
            return None
        return f"device {device_type} not supported (needs {', '.join(self.devices)})"

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        """Everything that stops this backend from running ``call`` (empty: it can)."""
        reasons = []
        for reason in (self.unavailable_reason(), self.device_reason(call.device_type)):
            if reason:
                reasons.append(reason)
        if call.dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            reasons.append(
                f"dtype {str(call.dtype).replace('torch.', '')} not supported (supports {names})"
            )
        if self.max_head_dim is not None and call.query.shape[-1] > self.max_head_dim:
            reasons.append(f"head_dim {call.query.shape[-1]} > {self.max_head_dim}")
        if call.dropout_p > 0.0 and not self.supports_dropout:
            reasons.append("dropout_p > 0 not supported (inference kernel)")
        if not self.supports_grad and call.needs_grad:
            reasons.append("no backward (inputs require grad)")
        return reasons

    def forward(self, call: AttentionCall) -> torch.Tensor:
        raise NotImplementedError

    def forward_with_lse(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        """Output and per-row log-sum-exp (B, Hq, Lq) float32; only some backends have it."""
        raise ValueError(f"return_lse=True needs the tiled backend; this call uses {self.name}")

    def describe(self) -> dict:
        reason = self.unavailable_reason()
        return {
            "name": self.name,
            "description": self.description,
            "devices": list(self.devices),
            "dtypes": [str(d).replace("torch.", "") for d in self.dtypes],
            "max_head_dim": self.max_head_dim,
            "dropout": self.supports_dropout,
            "grad": self.supports_grad,
            "opt_in": self.opt_in,
            "available": reason is None,
            "reason": reason,
        }

    def __repr__(self) -> str:
        return f"<npu_attn backend {self.name!r}>"
