"""torch's own ``scaled_dot_product_attention``, whatever kernel torch picks for the device.

npu_attn's diffusers redirect (:mod:`npu_attn.integration.redirect`) replaces
``torch.nn.functional.scaled_dot_product_attention`` with a pass-through shim; this backend
always calls torch's original function, captured here before anything can replace it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .base import ANY_DEVICE, FLOATS, AttentionCall, Backend, count_call

# torch's function, captured when npu_attn is first imported (before the shim exists).
ORIGINAL_SDPA = F.scaled_dot_product_attention


def call_original(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """torch's own SDPA with SDPA's positional argument order."""
    return ORIGINAL_SDPA(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def fold_causal(
    mask: Optional[torch.Tensor], len_q: int, len_k: int, device: torch.device
) -> torch.Tensor:
    """``mask`` (or no mask) with the top-left causal mask applied: npu_attn's semantics for
    a mask together with ``is_causal`` (torch's math path refuses the combination)."""
    keep = torch.ones(len_q, len_k, dtype=torch.bool, device=device).tril()
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, float("-inf"))


def torch_mask_args(mask, is_causal, scale, len_q, len_k, dtype, device):
    """(attn_mask, is_causal) as torch's SDPA takes them with npu_attn's semantics: a float
    mask in the query's dtype, and causal folded into a mask when a mask is given too, or
    when ``scale`` is 0 or negative: torch 2.13's CPU kernels scale the scores after the causal
    mask, so 0 * -inf turns every output into NaN and a negative scale turns the hidden keys'
    -inf into +inf (a mask is added after the scale)."""
    if mask is not None and mask.dtype not in (torch.bool, dtype):
        mask = mask.to(dtype)  # e.g. a float32 mask with 16-bit or float64 inputs
    if mask is not None and mask.dim() < 2:  # npu_attn broadcasts them; torch's SDPA needs 2-D
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
    if is_causal and (mask is not None or (scale is not None and scale <= 0)):
        mask, is_causal = fold_causal(mask, len_q, len_k, device), False
    return mask, is_causal


def torch_mask(call: AttentionCall):
    """:func:`torch_mask_args` for one call."""
    return torch_mask_args(
        call.attn_mask,
        call.is_causal,
        call.scale,
        call.query.shape[-2],
        call.key.shape[-2],
        call.dtype,
        call.query.device,
    )


class TorchSdpaBackend(Backend):
    name = "sdpa"
    description = "torch.nn.functional.scaled_dot_product_attention"
    devices = (ANY_DEVICE,)
    dtypes = (*FLOATS, torch.float64)
    supports_dropout = True

    def forward(self, call: AttentionCall) -> torch.Tensor:
        count_call(self.name)
        mask, causal = torch_mask(call)
        return call_original(
            call.query,
            call.key,
            call.value,
            mask,
            call.dropout_p,
            causal,
            call.scale,
            call.enable_gqa,
        )
