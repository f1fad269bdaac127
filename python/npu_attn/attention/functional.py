"""``scaled_dot_product_attention`` with the signature and semantics of
``torch.nn.functional.scaled_dot_product_attention``, computed by npu_attn's tiled C++ kernel.

Tensors are passed to C++ without copies: torch tensors through DLPack, NumPy arrays through
the buffer protocol. The kernel writes its output in (B, L, H, Dv) memory order (a (B, H, L, Dv)
view); torch tensors keep that layout where torch 2.13's CPU SDPA returns the same one (its
flash kernel on a query stored (B, L, H, D), as diffusers passes it, so a following
``transpose(1, 2).reshape(B, L, H * Dv)`` is free) and are made contiguous elsewhere, as torch's
are. Inputs of any rank >= 2 are broadcast and flattened to the kernel's 4-D problem the way
torch's SDPA broadcasts them (see :func:`scaled_dot_product_attention`).
"""

from __future__ import annotations

import math
import numbers
import sys
import warnings
from typing import Any, NamedTuple, Optional, Union

import numpy as np

from ..runtime import controls as _runtime
from ..runtime import counts, variant_choice
from ..runtime.extension import _C
from . import config

__all__ = ["scaled_dot_product_attention"]

ArrayLike = Any  # torch.Tensor or numpy.ndarray; torch stays an optional import


def _torch():
    return sys.modules.get("torch")


_ops = _registry = None


def _torch_modules():
    """(attention.ops, backends.registry), imported on the first call with torch tensors: they
    import torch, which the NumPy path does without. Kept here after that because an import
    statement inside a function costs ~4 us a call (the import machinery resolves the package
    each time), which short calls notice."""
    global _ops, _registry
    if _ops is None:
        from . import ops
        from .backends import registry

        _ops, _registry = ops, registry
    return _ops, _registry


def _is_torch_tensor(x: object) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _check_common(dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool):
    if (
        scale is None
        and dropout_p == 0.0
        and type(dropout_p) in (float, int)
        and type(is_causal) is bool
        and type(enable_gqa) is bool
    ):
        return  # the usual arguments, accepted without the checks below (a few us per call)
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
        if not math.isfinite(scale):
            raise ValueError(f"scale must be a finite number, got {scale}")


def _scalar_argument(name: str, x):
    """A 0-d torch tensor passed as ``scale`` or ``dropout_p`` as a Python float, as torch's
    SDPA accepts one (its argument parser converts 0-d tensors to numbers); anything else as
    it is, for :func:`_check_common`."""
    if not _is_torch_tensor(x):
        return x
    if x.dim() != 0 or x.is_complex() or x.dtype == _torch().bool:
        raise TypeError(
            f"{name} must be a float or a 0-d real tensor, got a {x.dtype} tensor of shape "
            f"{tuple(x.shape)}"
        )
    return float(x.item())


def _backend_name(backend) -> Optional[str]:
    """``backend=`` as the registry names it: like strategy names, any case and surrounding
    spaces (``"Tiled"``); anything but a string or None is a TypeError."""
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string or None, got {type(backend).__name__}")
    return backend.strip().lower()


def nonnegative_scale(query, scale):
    """(query, scale) with scale >= 0: a negative scale (torch accepts one) becomes the
    query negated and the scale's magnitude. The kernels take scale >= 0 (some apply it after
    taking the maximum of the unscaled scores), and (-scale) * (-q) . k is scale * q . k
    exactly, since negation is exact: one elementwise pass over the query, differentiable, and
    the caller's tensor is left as it is."""
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not scale < 0:
        return query, scale  # None, >= 0, NaN or not a number: for the callers' checks
    if _is_torch_tensor(query) and query.is_floating_point():
        return query.neg(), -scale
    if isinstance(query, np.ndarray) and np.issubdtype(query.dtype, np.floating):
        return np.negative(query), -scale
    return query, scale  # not a floating query: the checks below name what is wrong


class _Plan(NamedTuple):
    """How torch's SDPA broadcasting maps a call onto the kernel's 4-D (B, H, L, D) problem."""

    rank: int  # rank every input is padded to (>= 4): (*batch, heads, L, D)
    padded: tuple  # query, key, value shapes with leading 1s up to `rank`
    target: tuple  # query, key, value shapes after broadcasting the batch (and heads) dims
    mask_padded: Optional[tuple]
    batch: tuple  # the broadcast batch dims (everything before heads)
    out: tuple  # the output's shape, as torch returns it
    lse: tuple  # the log-sum-exp's shape


def _broadcast_plan(q_shape, k_shape, v_shape, mask_shape, enable_gqa) -> _Plan:
    """Shapes as torch 2.13's SDPA treats them: inputs are (..., L, D) with any number (>= 0) of
    leading dims; the leading dims of query, key and value broadcast together (size 1 against
    size n), heads too unless ``enable_gqa`` groups them; ``attn_mask`` broadcasts to
    (..., heads, L_q, L_k) without enlarging it. Errors name the argument and the shape."""
    qs, ks, vs = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    if (
        len(qs) == len(ks) == len(vs) == 4
        and qs[0] == ks[0] == vs[0]
        and ks[1] == vs[1]
        and (qs[1] == ks[1] or (enable_gqa and ks[1] > 0 and qs[1] % ks[1] == 0))
        and qs[3] == ks[3]
        and ks[2] == vs[2]
        and (mask_shape is None or 2 <= len(mask_shape) <= 4)
    ):  # the usual call: nothing to broadcast (a mask's shape is still checked below)
        mask_padded = None
        if mask_shape is not None:
            ms = tuple(mask_shape)
            mask_padded = (1,) * (4 - len(ms)) + ms
            full = qs[:3] + ks[2:3]
            if any(m not in (1, t) for m, t in zip(mask_padded, full)):
                raise ValueError(
                    f"attn_mask of shape {ms} cannot be broadcast to (batch, heads, L_q, L_k) "
                    f"= {full}"
                )
        return _Plan(4, (qs, ks, vs), (qs, ks, vs), mask_padded, qs[:1], qs[:3] + vs[3:], qs[:3])
    for name, shape in (("query", qs), ("key", ks), ("value", vs)):
        if len(shape) < 2:
            raise ValueError(
                f"{name} must have at least 2 dimensions (..., seq_len, head_dim), "
                f"got shape {shape}"
            )
    (lq, d), (lk, dk), (lv, dv) = qs[-2:], ks[-2:], vs[-2:]
    if dk != d:
        raise ValueError(f"key's head_dim ({dk}) must equal query's ({d}): key {ks}, query {qs}")
    if lv != lk:
        raise ValueError(f"value must have the same L_k (dim -2) as key: key {ks}, value {vs}")
    rank = max(4, len(qs), len(ks), len(vs))
    qp, kp, vp = ((1,) * (rank - len(s)) + s for s in (qs, ks, vs))
    batch = []
    for i in range(rank - 3):
        sizes = {qp[i], kp[i], vp[i]} - {1}
        if len(sizes) > 1:
            raise ValueError(
                "query, key and value must have the same batch size, or 1 to broadcast "
                f"(the dims before heads), got shapes {qs}, {ks}, {vs}"
            )
        batch.append(sizes.pop() if sizes else 1)
    batch = tuple(batch)
    hq, hk, hv = qp[-3], kp[-3], vp[-3]
    if hk != hv:
        if 1 not in (hk, hv):
            raise ValueError(
                "value must have the same number of heads as key (or 1 to broadcast): "
                f"key {ks}, value {vs}"
            )
        hk = hv = hv if hk == 1 else hk
    if hq != hk:
        if enable_gqa:
            if hk == 0 or hq % hk != 0:
                raise ValueError(
                    f"with enable_gqa=True, query heads ({hq}) must be a multiple of key/value "
                    f"heads ({hk})"
                )
        elif hq == 1:
            hq = hk
        elif hk == 1:
            hk = hq
        else:
            raise ValueError(
                f"query has {hq} heads but key/value have {hk}; pass enable_gqa=True for "
                "grouped-query attention (or give key/value 1 head to broadcast)"
            )
    mask_padded = None
    if mask_shape is not None:
        ms = tuple(mask_shape)
        full = batch + (hq, lq, lk)
        what = "(batch, heads, L_q, L_k)" if rank == 4 else "(*batch, heads, L_q, L_k)"
        if len(ms) > rank:
            raise ValueError(
                f"attn_mask must have at most {rank} dimensions to broadcast to {what} = "
                f"{full}, got shape {ms}"
            )
        mask_padded = (1,) * (rank - len(ms)) + ms
        if any(m not in (1, t) for m, t in zip(mask_padded, full)):
            raise ValueError(f"attn_mask of shape {ms} cannot be broadcast to {what} = {full}")
    lead = (batch + (hq,))[rank - max(len(qs), len(ks), len(vs)) :]
    if 0 in (lq, lk, dv):
        # torch 2.13 returns a call with no queries, keys or value channels in the query's own
        # leading dims, not the broadcast ones (e.g. query (2, 1, 5, 8) with key and value
        # (2, 2, 0, 8) gives (2, 1, 5, 8) of zeros); _shaped_like_torch narrows to them.
        lead = qs[:-2]
    return _Plan(
        rank,
        (qp, kp, vp),
        (batch + (hq, lq, d), batch + (hk, lk, d), batch + (hk, lk, dv)),
        mask_padded,
        batch,
        lead + (lq, dv),
        lead + (lq,),
    )


def _values_emptied_by_batch(q_shape, v_shape) -> bool:
    """Whether value has no elements because a batch or heads dim is 0 where the query's is
    not: torch 2.13 returns zeros in the query's own shape (..., L_q, D_v) there (query
    (1, 2, 5, 8) with key and value (0, 2, 6, 8) gives (1, 2, 5, 8)), where broadcasting would
    give an empty batch."""
    return 0 in tuple(v_shape)[:-2] and 0 not in tuple(q_shape)


def _shaped_like_torch(out, lse, plan: _Plan):
    """The kernel's 4-D output and 3-D log-sum-exp (or None) in the plan's shapes for them.
    Where those keep the query's own leading dims although key and value broadcast them (calls
    without keys, _broadcast_plan), the broadcast dims are narrowed to the query's size 1:
    every output there is the same zero."""

    def fit(x, shape):
        if math.prod(x.shape) != math.prod(shape):
            x = x.reshape(plan.target[0][:-2] + tuple(x.shape[2:]))
            x = x[tuple(slice(0, 1) if n == 1 else slice(None) for n in plan.padded[0][:-2])]
        return x.reshape(shape)

    return fit(out, plan.out), None if lse is None else fit(lse, plan.lse)


def _apply_plan(plan: _Plan, query, key, value, attn_mask, reshape, expand):
    """query, key, value (and attn_mask) as 4-D (B, H, L, D) arrays: leading 1s added and
    broadcast dims expanded (views, zero strides), extra batch dims merged into one (a view
    for the usual layouts; a copy where the strides do not allow it, e.g. after expanding)."""

    if (
        plan.rank == 4
        and plan.padded == plan.target
        and tuple(query.shape) == plan.padded[0]
        and (attn_mask is None or attn_mask.ndim >= 2)
    ):  # the usual call: nothing to change
        return query, key, value, attn_mask

    def fit(x, padded, target):
        if tuple(x.shape) != padded:
            x = reshape(x, padded)
        if padded != target:
            x = expand(x, target)
        if len(target) > 4:
            x = reshape(x, (math.prod(target[:-3]),) + target[-3:])
        return x

    q, k, v = (fit(x, p, t) for x, p, t in zip((query, key, value), plan.padded, plan.target))
    mask = attn_mask
    if mask is not None:
        mp = plan.mask_padded
        if plan.rank == 4:
            if mask.ndim < 2:  # the kernel and torch's backends both take >= 2-D masks
                mask = reshape(mask, mp[2:])
        elif all(s == 1 for s in mp[:-3]):
            mask = reshape(mask, (1,) + mp[-3:])
        else:
            mask = fit(mask, mp, plan.batch + mp[-3:])
    return q, k, v, mask


def _dense_tensor(torch, name: str, t) -> None:
    """Sparse and nested tensors have no strided buffer the kernel could read."""
    if t.is_nested:
        raise TypeError(
            f"npu_attn.scaled_dot_product_attention does not support nested tensors: {name} "
            "is a torch.nested tensor. Pad the sequences to one length and mask the padding "
            "with attn_mask, or call torch.nn.functional.scaled_dot_product_attention"
        )
    if t.layout != torch.strided:
        raise TypeError(
            f"npu_attn.scaled_dot_product_attention does not support sparse tensors: {name} "
            f"has layout {t.layout}; expected a dense (torch.strided) tensor, e.g. "
            f"{name}.to_dense()"
        )


def _autocast(torch, tensors: tuple) -> tuple:
    """What torch's autocast does to SDPA's arguments: inside ``torch.autocast(device)`` every
    floating-point tensor except float64 is cast to the autocast dtype (SDPA is on autocast's
    lower-precision list, on CPU as on CUDA)."""
    device = tensors[0].device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


_TRANSFORMS = {
    "Vmap": "torch.func.vmap",
    "Grad": "torch.func.grad / torch.func.vjp",
    "Jvp": "torch.func.jvp (forward-mode AD)",
    "Functionalize": "torch.func.functionalize",
}


def _transform(torch, tensors: tuple) -> Optional[tuple[str, bool]]:
    """(what, forward_mode) when a torch.func transform or forward-mode AD wraps one of the
    tensors: the C++ kernel reads raw memory and cannot run on such wrappers."""
    if torch.compiler.is_compiling():
        return None
    functorch = torch._C._functorch
    if functorch.peek_interpreter_stack() is not None and any(
        t is not None and functorch.is_functorch_wrapped_tensor(t) for t in tensors
    ):
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        kinds = [i.key().name for i in retrieve_all_functorch_interpreters()]
        what = " inside ".join(_TRANSFORMS.get(k, k) for k in reversed(kinds))
        return what, "Jvp" in kinds
    forward_ad = torch.autograd.forward_ad
    if forward_ad._current_level >= 0 and any(
        t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors
    ):
        return "forward-mode AD (torch.autograd.forward_ad dual tensors)", True
    return None


def _transform_backend(registry, transform: tuple[str, bool], backend: Optional[str]):
    """torch's SDPA under vmap/grad/functionalize (it has rules for them); under forward-mode AD
    (which torch's CPU SDPA lacks) the matmul-softmax-matmul composition, which has it."""
    what, forward_mode = transform
    if backend in ("sdpa", "vanilla"):
        return registry.BY_NAME[backend]
    if backend is not None:
        raise NotImplementedError(
            f"npu_attn.scaled_dot_product_attention does not support {what} with "
            f"backend={backend!r}: its kernel reads raw memory, which the transform hides. "
            "Pass backend=None (falls back to torch ops) or backend='sdpa' / 'vanilla'"
        )
    chosen = registry.BY_NAME["vanilla" if forward_mode else "sdpa"]
    instead = (
        "matmul-softmax-matmul in torch ops (O(L_q x L_k) memory)"
        if forward_mode
        else "torch.nn.functional.scaled_dot_product_attention"
    )
    warnings.warn(
        f"npu_attn.scaled_dot_product_attention does not support {what} in its C++ kernel; "
        f"this call runs {instead} instead",
        RuntimeWarning,
        stacklevel=4,
    )
    return chosen


def _keeps_query_layout(torch, query, key, value, attn_mask, enable_gqa) -> bool:
    """True when torch 2.13's CPU SDPA would return this call's output in the query's memory
    order with heads inside the sequence ((B, L, H, D) storage, which ``.view(-1)`` refuses).

    torch's CPU flash kernel lays its output out like the query; every other path (3-D or 5-D
    inputs, broadcast batch or heads, D != Dv, a last dim with stride != 1, a 3-D mask or one
    that requires grad, empty sequences, flash disabled) returns a contiguous tensor, and so
    does the flash kernel for a query expanded over heads (stride 0). Where this says False
    npu_attn returns a contiguous output too; where torch's choice is unclear it says False,
    so npu_attn's output is viewable whenever torch's is."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    (b, hq, lq, d), (bk, hk, lk, dk), (bv, hv, _, dv) = query.shape, key.shape, value.shape
    if not (b == bk == bv and hk == hv and d == dk and lq > 0 and lk > 0):
        return False
    if hq != hk and not (enable_gqa and hk > 0 and hq % hk == 0):
        return False
    if attn_mask is not None and (attn_mask.dim() not in (2, 4) or attn_mask.requires_grad):
        return False
    return _flash_keeps_query_layout(torch, query, key, value, d == dv)


def _flash_keeps_query_layout(torch, query, key, value, same_head_dims: bool) -> bool:
    """The layout part of :func:`_keeps_query_layout`, for a call torch's flash kernel takes
    (4-D, consistent non-empty shapes, equal heads or GQA, no mask or a 2-D/4-D one without
    grad): whether the query is stored (B, L, H, D) and the kernel's output would be too.
    The fast path has checked the rest already."""
    if query.stride(1) >= query.stride(2):  # heads outside the sequence: torch's is viewable
        return False
    if query.stride(1) == 0 and query.shape[1] > 1:  # heads expanded: torch's is contiguous
        return False
    if not same_head_dims:
        return False
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    return torch.compiler.is_compiling() or torch.backends.cuda.flash_sdp_enabled()


def _default_backend() -> Optional[str]:
    """The default set with ``set_attention_strategy(None, name)``, when it names a backend."""
    return config.explicit_default()


def _fast_cpu_call(torch, query, key, value, is_causal, scale, enable_gqa, return_lse, backend):
    """The common call in a few attribute reads, or None where it does not apply.

    Plain 4-D CPU tensors of one dtype the tiled backend declares, with consistent, non-empty
    shapes, no mask, outside autocast, torch.func transforms and tracing, when backend
    selection picks the tiled backend: then the general path below would run
    ``ops.forward_cpu`` (under autograd ``ops.eager_forward_with_grad``) on the tensors as
    given, and so does this, without building the broadcast plan, the call object and the
    backend choice. Likewise ``ops.forward_int8_cpu`` when it picks the int8 backend, for
    calls without gradients or log-sum-exp (the general path explains why those are
    refused). That is ~15 us of Python per call, which short calls notice (SD-1.5's 8x8 level
    computes in ~70 us). The output layout rule is the general path's
    (``_flash_keeps_query_layout``, the part of ``_keeps_query_layout`` left once the checks
    here have passed)."""
    ops, registry = _torch_modules()
    # First, before reading any shape (under torch.jit.trace that records ops): calls that
    # must run as the registered op (tracers, torch.func transforms, tensor subclasses, and
    # anything that is not a plain tensor) are the general path's to decide.
    if ops.needs_op(query, key, value):
        return None
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    if not (query.is_cpu and key.is_cpu and value.is_cpu):
        return None
    strided = torch.strided  # not sparse (COO or compressed) nor nested
    if query.layout is not strided or key.layout is not strided or value.layout is not strided:
        return None
    if query.is_nested or key.is_nested or value.is_nested:
        return None
    (b, hq, lq, d), (bk, hk, lk, dk), (bv, hv, lv, dv) = query.shape, key.shape, value.shape
    if not (b == bk == bv and hk == hv and lk == lv and d == dk):
        return None
    if 0 in (b, hq, lq, d, hk, lk, dv) or not (hq == hk or (enable_gqa and hq % hk == 0)):
        return None
    grads = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )
    if torch.is_autocast_enabled("cpu"):
        return None
    if torch.autograd.forward_ad._current_level >= 0:
        return None
    chosen = registry.chosen_without_checks(backend, _default_backend())
    if chosen is None or chosen.name not in ("tiled", "int8"):
        return None
    if chosen.name == "int8" and (grads or return_lse):
        return None
    dtype = query.dtype
    if dtype not in chosen.dtypes or key.dtype is not dtype or value.dtype is not dtype:
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    flags = (bool(is_causal), float(scale), bool(enable_gqa))
    if chosen.name == "int8":
        out, lse = ops.forward_int8_cpu(query, key, value, None, *flags), None
    elif grads:
        out, lse = ops.eager_forward_with_grad(query, key, value, None, *flags)
    else:
        out, lse = ops.forward_cpu(query, key, value, None, *flags, return_lse)
    if not _flash_keeps_query_layout(torch, query, key, value, d == dv):
        out = out.contiguous()
    return (out, lse) if return_lse else out


def _torch_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa, return_lse, backend):
    torch = _torch()
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor like query, got {type(t).__name__}")
    if attn_mask is None:
        fast = _fast_cpu_call(
            torch, query, key, value, is_causal, scale, enable_gqa, return_lse, backend
        )
        if fast is not None:
            return fast
    _, registry = _torch_modules()
    from .backends.base import AttentionCall

    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    for name, t in (("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask)):
        if t is not None:
            _dense_tensor(torch, name, t)
    devices = {t.device for t in (query, key, value)}
    if attn_mask is not None:
        devices.add(attn_mask.device)
    if len(devices) > 1:
        raise ValueError(f"query, key, value and attn_mask must be on one device, got {devices}")
    query, key, value, attn_mask = _autocast(torch, (query, key, value, attn_mask))
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            f"query, key and value must have one dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise TypeError(
            f"attn_mask must be bool, float32 or the query's dtype ({query.dtype}), "
            f"got {attn_mask.dtype}"
        )
    if _values_emptied_by_batch(query.shape, value.shape):
        # The empty sums (exactly 0, whatever the tensors hold) keep the output in the inputs'
        # autograd graph, as torch's is.
        empty_sums = query[..., :0].sum() + key[..., :0].sum() + value.sum()
        out = query.new_zeros(tuple(query.shape[:-1]) + (value.shape[-1],)) + empty_sums
        if not return_lse:
            return out
        lse_shape = tuple(query.shape[:-1])
        return out, torch.full(lse_shape, -math.inf, dtype=torch.float32, device=query.device)
    plan = _broadcast_plan(
        query.shape,
        key.shape,
        value.shape,
        None if attn_mask is None else attn_mask.shape,
        enable_gqa,
    )
    transform = _transform(torch, (query, key, value, attn_mask))
    keep_layout = transform is None and _keeps_query_layout(
        torch, query, key, value, attn_mask, enable_gqa
    )
    q, k, v, mask = _apply_plan(
        plan, query, key, value, attn_mask, torch.Tensor.reshape, torch.Tensor.expand
    )
    # The one validated call object every backend receives (scale resolved once there).
    call = AttentionCall.of(q, k, v, mask, 0.0, is_causal, scale, enable_gqa)
    if transform is not None:
        if return_lse:
            raise NotImplementedError(
                f"return_lse=True is not supported under {transform[0]}: only npu_attn's tiled "
                "kernel returns the log-sum-exp, and it cannot run under the transform"
            )
        chosen = _transform_backend(registry, transform, backend)
    else:
        preferred = None if backend else _default_backend()
        if return_lse and preferred != "tiled":
            # Only tiled returns the log-sum-exp: a default that cannot is ignored, as is one
            # that cannot run the call.
            preferred = None
        chosen = registry.select(call, backend, preferred)
    if return_lse:
        out, lse = chosen.forward_with_lse(call)
    else:
        out, lse = chosen.forward(call), None
    if tuple(out.shape) != plan.out:
        out, lse = _shaped_like_torch(out, lse, plan)
    if transform is None and not keep_layout and not out.is_contiguous():
        out = out.contiguous()  # torch returns a contiguous tensor for this call
    return (out, lse) if return_lse else out


def _numpy_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa, return_lse):
    for name, a in (("key", key), ("value", value)):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray like query, got {type(a).__name__}")
    if attn_mask is not None and not isinstance(attn_mask, np.ndarray):
        raise TypeError(
            f"attn_mask must be a numpy.ndarray or None, got {type(attn_mask).__name__}"
        )
    if query.dtype not in (np.float32, np.float16):
        raise TypeError(
            f"query: NumPy arrays must be float32 or float16, got {query.dtype} (convert with "
            ".astype(np.float32), or pass torch tensors: bfloat16 and float64 work there)"
        )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            f"query, key and value must have one dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    if attn_mask is not None:
        if attn_mask.dtype not in (np.bool_, np.float32, query.dtype):
            raise TypeError(
                f"attn_mask must be bool, float32 or the query's dtype ({query.dtype}), "
                f"got {attn_mask.dtype}"
            )
        if attn_mask.dtype == np.float16:  # the kernel reads bool or float32 masks
            attn_mask = attn_mask.astype(np.float32)
    if _values_emptied_by_batch(query.shape, value.shape):
        out = np.zeros(query.shape[:-1] + (value.shape[-1],), dtype=query.dtype)
        lse = np.full(query.shape[:-1], -np.inf, dtype=np.float32) if return_lse else None
        return (out, lse) if return_lse else out
    plan = _broadcast_plan(
        query.shape,
        key.shape,
        value.shape,
        None if attn_mask is None else attn_mask.shape,
        enable_gqa,
    )
    q, k, v, attn_mask = _apply_plan(
        plan, query, key, value, attn_mask, np.reshape, np.broadcast_to
    )
    b, hq, lq, _ = q.shape
    out = np.empty((b, lq, hq, v.shape[-1]), dtype=query.dtype).transpose(0, 2, 1, 3)
    lse = np.empty((b, hq, lq), dtype=np.float32) if return_lse else None
    variant_choice.ensure("float32" if query.dtype == np.float32 else "float16")
    counts.count("tiled")
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
    if out.shape != plan.out:
        out, lse = _shaped_like_torch(out, lse, plan)
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

    Same arguments and semantics as ``torch.nn.functional.scaled_dot_product_attention``
    (checked against torch 2.13's CPU implementation), for every dtype and backend:

    - ``query`` (..., Hq, Lq, D), ``key`` (..., Hkv, Lk, D), ``value`` (..., Hkv, Lk, Dv), with
      any number of leading dims, 0 or more: (B, H, L, D), (H, L, D), (L, D) and 5-D video
      latents (B, F, H, L, D) alike. As in torch, the leading dims broadcast against each
      other: a key/value batch (or head count) of 1 serves every query batch (or head), a
      3-D query with 4-D key/value gives a 4-D output; the output has the broadcast shape
      (..., Hq, Lq, Dv), except that a call with no keys, queries or value channels, or whose
      value has a batch or heads dim of 0, keeps the query's own leading dims (zeros where it
      has queries), as torch 2.13 returns it. Extra batch dims are merged into one for the
      kernel (a view for the usual layouts; broadcast inputs whose strides cannot merge are
      copied). Any strides: (B, L, H, D) memory layouts are read without copies. Inputs of 1
      dimension raise ``ValueError`` (torch raises too).
    - ``attn_mask``: bool (True = attend) or float (added to the scores), broadcastable to
      (..., Hq, Lq, Lk) by torch's rules (0-D and 1-D masks included; torch 2.13 raises
      ``IndexError`` for those, npu_attn broadcasts them). A float mask may be float32 with any
      query dtype (as torch allows for bfloat16/float16 queries) or have the query's dtype;
      other dtypes raise ``TypeError``.
    - ``is_causal``: top-left aligned causal mask (query i attends keys j <= i); may be combined
      with ``attn_mask`` (torch's math path refuses that combination; npu_attn applies both on
      every backend, folding the causal mask into ``attn_mask`` where it calls torch).
    - ``scale``: defaults to 1/sqrt(D). Must be finite; a negative scale runs as the query
      negated with the scale's magnitude (the same scores, exactly). ``scale=0`` with
      ``is_causal`` averages the values each query sees on every backend (torch 2.13's CPU
      kernel returns NaN there).
    - ``enable_gqa``: allow Hq to be a multiple of Hkv (grouped-query attention).
    - ``dropout_p`` must be 0.0 (inference kernel). ``scale`` and ``dropout_p`` may be 0-d
      tensors, as torch accepts them.
    - Inside ``torch.autocast(device, dtype)`` the inputs are cast as torch's autocast casts
      them (every floating tensor but float64, the mask included, to ``dtype``): float32 inputs
      under bfloat16 autocast give a bfloat16 output, as torch's SDPA does.
    - Output layout, as torch 2.13's CPU SDPA lays it out: where torch runs its flash kernel
      (4-D inputs of one batch size, equal heads or GQA, D == Dv, last dims of stride 1, no 3-D
      mask and no mask that requires grad) and the query is stored (B, L, H, D), as diffusers
      passes it (not expanded over heads), the output is stored (B, L, H, Dv) too and
      ``out.transpose(1, 2).reshape(B, L, H * Dv)`` is free; every other output is contiguous,
      so ``out.view(-1)`` works wherever it works on torch's output.

    Query rows whose keys are all masked return 0, as torch 2.13's CPU SDPA does; rows that a
    float mask of ``torch.finfo(torch.float32).min`` hides entirely (as transformers builds
    padding masks) see equal scores and average the values, as in torch; their gradients are
    exact (the backward recomputes such rows' softmax instead of reading it back from a
    log-sum-exp that rounds to the mask value, which makes torch 2.13's CPU kernel's gradients
    there n times too large for n keys). NaN and Inf in the inputs propagate as in the math
    reference, except that with ``is_causal`` the keys a query cannot see never enter its
    computation (its output stays finite where only those keys' values are not; torch's kernel
    turns 0 x Inf into NaN for them on short sequences).

    Torch tensors on any device are routed to the first backend that can take the call
    (see :func:`npu_attn.backends`): CPU tensors to npu_attn's tiled kernels (float32,
    bfloat16 and float16 read and written directly, accumulated in float32; bfloat16 on AMX
    tiles where available; differentiable through a C++ tiled backward),
    Ascend NPU tensors to torch_npu's fused attention, anything else (float64, other devices)
    to torch's SDPA with the semantics above. A default set with
    ``npu_attn.set_attention_strategy(None, name)`` is used where it can run the call and
    otherwise ignored (``"tiled"`` does not take float64: such calls go to torch's SDPA). NumPy
    arrays (float32 or float16; a float16 mask is widened to float32) always use the tiled
    kernel and return NumPy.

    Not supported by the kernel, handled instead:

    - ``torch.func.vmap`` / ``grad`` / ``vjp`` / ``functionalize``: the call runs torch's SDPA
      (which supports them) with a ``RuntimeWarning``.
    - Forward-mode AD (``torch.autograd.forward_ad`` dual tensors, ``torch.func.jvp``), which
      torch's CPU SDPA lacks: the call runs matmul-softmax-matmul in torch ops (O(Lq x Lk)
      memory) with a ``RuntimeWarning``.
    - Sparse and nested tensors raise ``TypeError`` naming the argument.

    Args:
        return_lse: also return the per-row log-sum-exp of the scaled, masked scores,
            shape (..., Hq, Lq), float32 (``-inf`` for fully masked rows); tiled backend only.
        backend: force ``"tiled"``, ``"npu"``, ``"sdpa"``, ``"vanilla"`` or ``"int8"`` (any
            case); a backend that cannot run the call raises ``ValueError`` listing why, a
            name that is not a string ``TypeError``.

    Raises:
        TypeError: wrong argument type, dtype, layout (sparse, nested) or device.
        ValueError: inconsistent shapes, bad mask shape, bad ``scale`` or ``dropout_p``.
        NotImplementedError: an explicit ``backend="tiled"`` / ``"npu"`` under a torch.func
            transform or forward-mode AD.
    """
    if scale is not None and type(scale) is not float:
        scale = _scalar_argument("scale", scale)
    if type(dropout_p) is not float:
        dropout_p = _scalar_argument("dropout_p", dropout_p)
    _check_common(dropout_p, is_causal, scale, enable_gqa)
    backend = _backend_name(backend)
    query, scale = nonnegative_scale(query, scale)
    if _is_torch_tensor(query):
        return _torch_sdpa(
            query, key, value, attn_mask, is_causal, scale, enable_gqa, return_lse, backend
        )
    if isinstance(query, np.ndarray):
        if backend not in (None, "tiled"):
            raise ValueError(f"NumPy inputs run on the tiled backend only, got backend={backend!r}")
        return _numpy_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa, return_lse)
    raise TypeError(f"query must be a torch.Tensor or numpy.ndarray, got {type(query).__name__}")
