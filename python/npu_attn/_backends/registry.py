"""Attention backends that declare what they support and say why they cannot take a call.

Modelled on xformers' fmha operators: each :class:`Backend` lists its devices, dtypes, head
dims, mask/causal/dropout/grad support and an availability check, and answers
:meth:`Backend.not_supported_reasons` for concrete inputs. ``scaled_dot_product_attention(...,
backend=None)`` takes the first backend in priority order with no reasons; an explicit
``backend=`` that cannot run raises ``ValueError`` listing its reasons.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

ANY_DEVICE = "*"


def needs_grad(*tensors) -> bool:
    """True when autograd will need gradients through this call."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@dataclass(frozen=True)
class Backend:
    name: str
    description: str
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    supports_dropout: bool
    supports_grad: bool
    run: Callable = field(repr=False)
    max_head_dim: Optional[int] = None
    availability: Callable[[], Optional[str]] = field(default=lambda: None, repr=False)

    def unavailable_reason(self) -> Optional[str]:
        return self.availability()

    def not_supported_reasons(
        self,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ) -> list[str]:
        reasons = []
        unavailable = self.unavailable_reason()
        if unavailable:
            reasons.append(unavailable)
        device = query.device.type
        if ANY_DEVICE not in self.devices and device not in self.devices:
            reasons.append(f"device {device} not supported (needs {', '.join(self.devices)})")
        if query.dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            reasons.append(
                f"dtype {str(query.dtype).replace('torch.', '')} not supported "
                f"(supports {names})"
            )
        if self.max_head_dim is not None and query.shape[-1] > self.max_head_dim:
            reasons.append(f"head_dim {query.shape[-1]} > {self.max_head_dim}")
        if dropout_p > 0.0 and not self.supports_dropout:
            reasons.append("dropout_p > 0 not supported (inference kernel)")
        if needs_grad(query, key, value, attn_mask) and not self.supports_grad:
            reasons.append("no backward (inputs require grad)")
        return reasons

    def describe(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "devices": list(self.devices),
            "dtypes": [str(d).replace("torch.", "") for d in self.dtypes],
            "max_head_dim": self.max_head_dim,
            "dropout": self.supports_dropout,
            "grad": self.supports_grad,
            "available": self.unavailable_reason() is None,
            "reason": self.unavailable_reason(),
        }


def _torch_npu_reason() -> Optional[str]:
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed (Ascend NPU support)"
    return None


def _run_tiled(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    from .. import ops

    out, _ = ops.sdpa_forward(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    return out


def _run_npu(*args):
    from . import npu

    return npu.fusion_attention(*args)


def _run_sdpa(*args):
    from .. import strategies

    return strategies.torch_sdpa(*args)


def _run_vanilla(*args):
    from .. import strategies

    return strategies.vanilla_attention(*args)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

BACKENDS: tuple[Backend, ...] = (
    Backend(
        "tiled",
        "npu_attn's tiled C++ kernels: forward and backward, fp32 accumulation, "
        "bf16 on AMX where available",
        ("cpu",),
        _FLOATS,
        supports_dropout=False,
        supports_grad=True,
        run=_run_tiled,
    ),
    Backend(
        "npu",
        "torch_npu.npu_fusion_attention (Ascend; unverified on hardware)",
        ("npu",),
        (torch.float16, torch.bfloat16),
        supports_dropout=True,
        supports_grad=True,
        run=_run_npu,
        availability=_torch_npu_reason,
    ),
    Backend(
        "sdpa",
        "torch.nn.functional.scaled_dot_product_attention",
        (ANY_DEVICE,),
        _FLOATS + (torch.float64,),
        supports_dropout=True,
        supports_grad=True,
        run=_run_sdpa,
    ),
    Backend(
        "vanilla",
        "matmul -> softmax -> matmul in torch (O(L^2) memory)",
        (ANY_DEVICE,),
        _FLOATS + (torch.float64,),
        supports_dropout=True,
        supports_grad=True,
        run=_run_vanilla,
    ),
)

BY_NAME = {b.name: b for b in BACKENDS}


def select(args: tuple, backend: Optional[str], preferred: Optional[str] = None) -> Backend:
    """The backend to run ``args`` (SDPA positional arguments) on; see module docstring.

    ``preferred`` (the default set with ``set_attention_strategy(None, name)``) is taken when it
    can run the call; otherwise the automatic choice applies, so a default that cannot take a
    call (``"tiled"`` and float64, ``"npu"`` and CPU tensors) does not make the call fail."""
    if backend is not None:
        if backend not in BY_NAME:
            raise ValueError(f"unknown backend {backend!r}; backends: {', '.join(BY_NAME)}")
        reasons = BY_NAME[backend].not_supported_reasons(*args)
        if reasons:
            raise ValueError(f"backend {backend!r} cannot run this call: " + "; ".join(reasons))
        return BY_NAME[backend]
    query = args[0]
    # The common case, decided without building refusal lists.
    tiled_fits = query.device.type == "cpu" and query.dtype in _FLOATS and not args[4]
    if (
        preferred in BY_NAME
        and preferred != "tiled"
        and not BY_NAME[preferred].not_supported_reasons(*args)
    ):
        return BY_NAME[preferred]
    if tiled_fits:
        return BY_NAME["tiled"]
    refusals = {}
    for candidate in BACKENDS:
        reasons = candidate.not_supported_reasons(*args)
        if not reasons:
            return candidate
        refusals[candidate.name] = "; ".join(reasons)
    detail = " | ".join(f"{name}: {why}" for name, why in refusals.items())
    raise TypeError(f"no attention backend can run this call ({detail})")


def backends() -> list[dict]:
    """Every backend with what it supports and whether it is available here."""
    return [b.describe() for b in BACKENDS]
