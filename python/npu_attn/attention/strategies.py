"""Attention strategies: the names users pick, mapped onto backends, plus ``auto`` and counting.

A strategy is what ``set_attention_strategy(pipe, name)`` installs; each has a function with
torch SDPA's positional signature ``(query, key, value, attn_mask, dropout_p, is_causal, scale,
enable_gqa) -> Tensor`` that the diffusers redirect calls:

- ``vanilla``: the ``vanilla`` backend (matmul -> softmax -> matmul, O(L^2) scores).
- ``sdpa``: the ``sdpa`` backend (torch's own SDPA).
- ``tiled``: npu_attn's kernel through :func:`npu_attn.scaled_dot_product_attention`; calls it
  cannot serve (tensors on another device, dropout, float64) go to ``sdpa`` with a one-time
  warning.
- ``npu``: the ``npu`` backend (torch_npu's fused attention).
- ``int8``: the ``int8`` backend (npu_attn's lossy int8 kernel; opt-in, inference only: a call
  that needs gradients raises). Calls it cannot serve go to ``sdpa`` like ``tiled``'s.
- ``auto``: measured per shape on CPU (:mod:`npu_attn.attention.auto`; float64 runs ``sdpa``),
  ``npu`` on an Ascend NPU, ``sdpa`` elsewhere.

What each backend computes and supports lives in :mod:`npu_attn.attention.backends`; this
module keeps only names, the fallback rule, availability per device and call counts.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from ..runtime import counts as _counts
from .auto import AutoSelector
from .backends import npu as npu_backend
from .backends import registry
from .backends.base import AttentionCall, count_call
from .functional import scaled_dot_product_attention as tiled_sdpa

STRATEGIES = ("vanilla", "sdpa", "tiled", "npu", "auto", "int8")
StrategyFn = Callable[..., torch.Tensor]


# --------------------------------------------------------------------------- call counts
def call_counts() -> dict[str, int]:
    """How many attention calls each implementation served in this process (``tiled`` counts
    only calls npu_attn's kernel computed; ``tiled->sdpa`` counts its fallbacks, ``int8->tiled``
    the int8 strategy's calls too short to quantize)."""
    return _counts.snapshot()


def reset_call_counts() -> None:
    _counts.reset()


# --------------------------------------------------------------------------- strategy functions
def _run_backend(name: str, args: tuple, kwargs: dict) -> torch.Tensor:
    return registry.BY_NAME[name].forward(AttentionCall.of(*args, **kwargs))


def vanilla_attention(*args, **kwargs) -> torch.Tensor:
    """The ``vanilla`` strategy: matmul -> softmax -> matmul (SDPA's signature)."""
    return _run_backend("vanilla", args, kwargs)


def torch_sdpa(*args, **kwargs) -> torch.Tensor:
    """The ``sdpa`` strategy: torch's own SDPA (SDPA's signature)."""
    return _run_backend("sdpa", args, kwargs)


def npu_attention(*args, **kwargs) -> torch.Tensor:
    """The ``npu`` strategy: torch_npu's fused attention (SDPA's signature)."""
    return _run_backend("npu", args, kwargs)


_fallback_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _fallback_warned:
        _fallback_warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _cpu_kernel(name: str, call: AttentionCall) -> torch.Tensor:
    """Runs ``call`` on npu_attn's CPU kernel backend ``name`` (``tiled`` or ``int8``) through
    the public function (autocast, broadcasting and transforms as torch does them; the kernel
    counts the call where it runs). Calls it cannot serve (dropout, non-CPU tensors, float64)
    go to torch's SDPA with a one-time warning instead of failing inside a model."""
    reason = None
    if call.device_type != "cpu":
        reason = f"tensors on {call.query.device}"
    elif call.dropout_p > 0.0:
        reason = "dropout_p > 0 (training)"
    elif call.dtype not in registry.BY_NAME[name].dtypes:
        reason = f"{call.dtype} inputs (the kernel takes float32, bfloat16 and float16)"
    if reason is not None:
        _warn_once(
            f"{name}:{reason}", f"npu_attn '{name}': {reason}; using torch SDPA for these calls"
        )
        count_call(f"{name}->sdpa")
        return registry.BY_NAME["sdpa"].forward(call)
    return tiled_sdpa(*call.sdpa_args(), backend=name)


def tiled_attention(*args, **kwargs) -> torch.Tensor:
    """The ``tiled`` strategy: npu_attn's kernel (differentiable; SDPA's signature); calls it
    cannot serve go to torch's SDPA (:func:`_cpu_kernel`)."""
    return _cpu_kernel("tiled", AttentionCall.of(*args, **kwargs))


def int8_attention(*args, **kwargs) -> torch.Tensor:
    """The ``int8`` strategy: npu_attn's lossy int8 kernel (SDPA's signature), inference only:
    a call that needs gradients raises (the kernel has no backward); calls it cannot serve go
    to torch's SDPA (:func:`_cpu_kernel`)."""
    call = AttentionCall.of(*args, **kwargs)
    if call.needs_grad:
        raise RuntimeError(
            "npu_attn 'int8' attention is inference only (no backward): run the pipeline under "
            "torch.no_grad() / torch.inference_mode(), or use the exact 'tiled' strategy to train"
        )
    return _cpu_kernel("int8", call)


auto_selector = AutoSelector(lambda name: RUNNERS[name])

RUNNERS: dict[str, StrategyFn] = {
    "vanilla": vanilla_attention,
    "sdpa": torch_sdpa,
    "tiled": tiled_attention,
    "npu": npu_attention,
    "auto": auto_selector,
    "int8": int8_attention,
}


# --------------------------------------------------------------------------- availability
def unavailable_reason(strategy: str, device: Optional[torch.device] = None) -> Optional[str]:
    """Why ``strategy`` cannot run for a model on ``device`` (None: it can)."""
    device_type = torch.device(device).type if device is not None else "cpu"
    if strategy in ("vanilla", "sdpa", "auto"):
        return None
    if strategy in ("tiled", "int8"):
        if device_type != "cpu":
            return f"the {strategy} kernel runs on CPU tensors; the model is on {device_type}"
        return None
    if strategy == "npu":
        return npu_backend.unavailable_reason(device_type)
    return f"unknown strategy {strategy!r}"


def check_strategy(strategy: str, device: Optional[torch.device] = None) -> str:
    """Validate a strategy name for a device; ValueError listing valid ones and reasons."""
    if strategy not in STRATEGIES:
        raise ValueError(
            f"unknown attention strategy {strategy!r}; valid strategies: {', '.join(STRATEGIES)}"
        )
    reason = unavailable_reason(strategy, device)
    if reason is not None:
        others = [s for s in STRATEGIES if unavailable_reason(s, device) is None]
        raise ValueError(
            f"attention strategy {strategy!r} is unavailable: {reason}. "
            f"Available here: {', '.join(others)}"
        )
    return strategy
