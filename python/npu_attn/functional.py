"""``scaled_dot_product_attention`` with the signature and semantics of
``torch.nn.functional.scaled_dot_product_attention``, computed by npu_attn's tiled C++ kernel.

Tensors are passed to C++ without copies: torch tensors through DLPack, NumPy arrays through
the buffer protocol. The output is allocated here (by torch or NumPy) in (B, L, H, Dv) memory
order and returned as a (B, H, L, Dv) view, as torch's own CPU flash kernel does; a following
``transpose(1, 2).reshape(B, L, H * Dv)`` (what diffusers does next) is then free.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Optional, Union

import numpy as np

from . import _C, _runtime

__all__ = ["scaled_dot_product_attention"]

ArrayLike = Any  # torch.Tensor or numpy.ndarray; torch stays an optional import


def _torch():
    return sys.modules.get("torch")


def _is_torch_tensor(x: object) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _check_common(dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool):
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if dropout_p != 0.0:
        raise ValueError(
            f"dropout_p={dropout_p}: npu_attn's kernels compute inference attention and do not "
            "implement dropout; pass dropout_p=0.0 (diffusers processors always do)"
        )
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if scale is not None:
        if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale) or scale < 0:
            raise ValueError(f"scale must be a finite, non-negative number, got {scale}")


def _as_4d(name: str, x, ndim: int):
    """Accept (B, H, L, D) or (H, L, D); anything else is an error naming the argument."""
    if ndim == 4:
        return x
    if ndim == 3:
        return x[None]
    raise ValueError(
        f"{name} must have 4 dimensions (batch, heads, seq_len, head_dim) or 3 "
        f"(heads, seq_len, head_dim), got {ndim}"
    )


def _default_backend() -> Optional[str]:
    """A concrete default strategy set via set_attention_strategy(None, s) / environment."""
    integration = sys.modules.get("npu_attn.diffusers_integration")
    if integration is None:
        return None
    name = integration._default_strategy
    return name if name in ("tiled", "npu", "sdpa", "vanilla") else None


def _torch_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa, return_lse, backend):
    torch = _torch()
    from ._backends import registry

    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor like query, got {type(t).__name__}")
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    devices = {t.device for t in (query, key, value)}
    if attn_mask is not None:
        devices.add(attn_mask.device)
    if len(devices) > 1:
        raise ValueError(f"query, key, value and attn_mask must be on one device, got {devices}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            f"query, key and value must have one dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, query.dtype):
        raise TypeError(
            f"attn_mask must be bool or have the query's dtype ({query.dtype}), "
            f"got {attn_mask.dtype}"
        )
    squeeze = query.dim() == 3
    q = _as_4d("query", query, query.dim())
    k = _as_4d("key", key, key.dim())
    v = _as_4d("value", value, value.dim())
    if q.dim() != k.dim() or q.dim() != v.dim():
        raise ValueError(
            f"query, key and value must have the same number of dimensions, "
            f"got {query.dim()}, {key.dim()}, {value.dim()}"
        )
    scale = None if scale is None else float(scale)
    args = (q, k, v, attn_mask, 0.0, bool(is_causal), scale, bool(enable_gqa))
    chosen = registry.select(args, backend or _default_backend())
    if chosen.name == "tiled":
        from . import ops

        needs_op = torch.compiler.is_compiling() or registry.needs_grad(q, k, v, attn_mask)
        # Outside autograd and compilation the registered op adds only dispatch overhead
        # (~30 us a call, which matters for small attention calls): call the kernel directly.
        run = ops.sdpa_forward if needs_op else ops.forward_cpu
        out, lse = run(q, k, v, attn_mask, bool(is_causal), scale, bool(enable_gqa))
    else:
        if return_lse:
            raise ValueError(
                f"return_lse=True needs the tiled backend; this call uses {chosen.name}"
            )
        out, lse = chosen.run(*args), None
    if squeeze:
        out = out[0]
        lse = None if lse is None else lse[0]
    return (out, lse) if return_lse else out


def _numpy_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa, return_lse):
    for name, a in (("key", key), ("value", value)):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray like query, got {type(a).__name__}")
    if attn_mask is not None and not isinstance(attn_mask, np.ndarray):
        raise TypeError(
            f"attn_mask must be a numpy.ndarray or None, got {type(attn_mask).__name__}"
        )
    squeeze = query.ndim == 3
    q = _as_4d("query", query, query.ndim)
    k = _as_4d("key", key, key.ndim)
    v = _as_4d("value", value, value.ndim)
    if q.ndim != k.ndim or q.ndim != v.ndim:
        raise ValueError(
            f"query, key and value must have the same number of dimensions, "
            f"got {query.ndim}, {key.ndim}, {value.ndim}"
        )
    b, hq, lq, _ = q.shape
    out = np.empty((b, lq, hq, v.shape[-1]), dtype=np.float32).transpose(0, 2, 1, 3)
    lse = np.empty((b, hq, lq), dtype=np.float32) if return_lse else None
    _C.forward(
        q,
        k,
        v,
        out,
        attn_mask=attn_mask,
        lse=lse,
        scale=None if scale is None else float(scale),
        is_causal=bool(is_causal),
        enable_gqa=bool(enable_gqa),
        num_threads=_runtime.get_num_threads(),
    )
    if squeeze:
        out = out[0]
        lse = None if lse is None else lse[0]
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: Optional[ArrayLike] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    return_lse: bool = False,
    backend: Optional[str] = None,
) -> Union[ArrayLike, tuple]:
    """Exact attention ``softmax(query @ key^T * scale + mask) @ value`` in O(L) memory.

    Same arguments and semantics as ``torch.nn.functional.scaled_dot_product_attention``:

    - ``query`` (B, Hq, Lq, D), ``key`` (B, Hkv, Lk, D), ``value`` (B, Hkv, Lk, Dv); 3-D inputs
      (H, L, D) work too. Any strides: (B, L, H, D) memory layouts are read without copies.
    - ``attn_mask``: bool (True = attend) or float (added to the scores), broadcastable to
      (B, Hq, Lq, Lk).
    - ``is_causal``: top-left aligned causal mask (query i attends keys j <= i); may be combined
      with ``attn_mask``.
    - ``scale``: defaults to 1/sqrt(D). Must be finite and non-negative (npu_attn refuses
      negative scales, which torch accepts).
    - ``enable_gqa``: allow Hq to be a multiple of Hkv (grouped-query attention).
    - ``dropout_p`` must be 0.0 (inference kernel).

    Query rows whose keys are all masked return 0, as torch 2.13's CPU SDPA does. NaN and Inf
    in the inputs propagate as in the math reference.

    Torch tensors on any device are routed to the first backend that can take the call
    (see :func:`npu_attn.backends`): CPU tensors to npu_attn's tiled kernels (float32,
    bfloat16 and float16 read and written directly, accumulated in float32; bfloat16 on AMX
    tiles where available; differentiable through a C++ tiled backward),
    Ascend NPU tensors to torch_npu's fused attention, anything else to torch's SDPA. NumPy
    arrays (float32) always use the tiled kernel and return NumPy.

    Args:
        return_lse: also return the per-row log-sum-exp of the scaled, masked scores,
            shape (B, Hq, Lq), float32 (``-inf`` for fully masked rows); tiled backend only.
        backend: force ``"tiled"``, ``"npu"``, ``"sdpa"`` or ``"vanilla"``; a backend that
            cannot run the call raises ``ValueError`` listing why.

    Raises:
        TypeError: wrong argument type, dtype or device.
        ValueError: inconsistent shapes, bad mask shape, bad ``scale`` or ``dropout_p``.
    """
    _check_common(dropout_p, is_causal, scale, enable_gqa)
    if _is_torch_tensor(query):
        return _torch_sdpa(
            query, key, value, attn_mask, is_causal, scale, enable_gqa, return_lse, backend
        )
    if isinstance(query, np.ndarray):
        if backend not in (None, "tiled"):
            raise ValueError(f"NumPy inputs run on the tiled backend only, got backend={backend!r}")
        return _numpy_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa, return_lse)
    raise TypeError(f"query must be a torch.Tensor or numpy.ndarray, got {type(query).__name__}")
