"""Ascend NPU attention through ``torch_npu.npu_fusion_attention``.

UNVERIFIED ON HARDWARE: no NPU exists where npu_attn is developed. The translation of SDPA
arguments below is tested against a stand-in ``torch_npu`` module at this call boundary
(tests/py/test_npu_backend.py); the semantics follow the torch_npu documentation and what
diffusers itself sends (see shared/reference/FACTS.md section 4):

- layout: SDPA's (B, H, S, D) is ``input_layout="BNSD"``; ``head_num`` is H.
- ``atten_mask`` marks *masked* positions (True = do not attend), the inverse of torch's bool
  mask; it is given as BNSS, B1SS or 11SS (the layouts torch_npu documents). Causal (top-left)
  adds the strict upper triangle. Float (additive) masks go in ``pse``, the additive bias input.
- ``keep_prob = 1 - dropout_p``; ``scale`` defaults to 1/sqrt(D); pre/next tokens 65536 as
  diffusers uses.
- The fused kernel takes fp16/bf16 only: fp32 calls go to torch's SDPA, as diffusers does.
- Grouped-query attention repeats K/V heads to the query's head count.
"""

from __future__ import annotations

import math

import torch

from ...runtime import ascend
from .base import AttentionCall, Backend, count_call
from .torch_sdpa import call_original, torch_mask_args


def unavailable_reason(device_type: str) -> str | None:
    """Why the NPU path cannot serve a model on ``device_type`` (None: it can)."""
    reason = ascend.unavailable_reason()
    if reason is not None:
        return reason
    if device_type != "npu":
        return f"the npu strategy needs the model on an Ascend NPU; it is on {device_type}"
    return None


# pre_tockens / next_tockens: the window diffusers passes on Ascend. It bounds nothing for
# diffusion sequence lengths; the schema's default (2**31 - 1) is the unbounded one.
TOKEN_WINDOW = 65536


def _masked_positions(attn_mask, is_causal, batch, heads, len_q, len_k, device):
    """torch semantics (True = attend / additive) -> torch_npu's (True = masked), in one of the
    layouts it documents: BNSS, B1SS or 11SS (never (B, 1, 1, S), nor 1NSS)."""
    masked = None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        mask = attn_mask
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        per_head = mask.shape[1] != 1
        rows = batch if mask.shape[0] != 1 or per_head else 1
        masked = ~mask.expand(rows, heads if per_head else 1, len_q, len_k)
    if is_causal:
        upper = torch.ones(len_q, len_k, dtype=torch.bool, device=device).triu(1)
        upper = upper.view(1, 1, len_q, len_k)
        masked = upper if masked is None else (masked | upper)
    return masked


def fusion_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """SDPA semantics on torch_npu's fused kernel (see module docstring)."""
    if query.dtype not in (torch.float16, torch.bfloat16):
        mask, causal = torch_mask_args(
            attn_mask, is_causal, scale, query.shape[-2], key.shape[-2], query.dtype, query.device
        )
        return call_original(query, key, value, mask, dropout_p, causal, scale, enable_gqa)
    torch_npu, reason = ascend.torch_npu()
    if torch_npu is None:
        raise RuntimeError(f"the npu strategy cannot run: {reason}")
    batch, heads, len_q, head_dim = query.shape
    len_k = key.shape[-2]
    if key.shape[1] != heads:
        repeat = heads // key.shape[1]
        key = key.repeat_interleave(repeat, dim=1)
        value = value.repeat_interleave(repeat, dim=1)
    pse = None
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        pse = attn_mask.to(query.dtype).expand(batch, heads, len_q, len_k)
    masked = _masked_positions(attn_mask, is_causal, batch, heads, len_q, len_k, query.device)
    outputs = torch_npu.npu_fusion_attention(
        query,
        key,
        value,
        heads,
        input_layout="BNSD",
        pse=pse,
        atten_mask=masked,
        scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        keep_prob=1.0 - float(dropout_p),
        pre_tockens=TOKEN_WINDOW,
        next_tockens=TOKEN_WINDOW,
    )
    return outputs[0]


class NpuBackend(Backend):
    name = "npu"
    description = "torch_npu.npu_fusion_attention (Ascend; unverified on hardware)"
    devices = ("npu",)
    dtypes = (torch.float16, torch.bfloat16)
    supports_dropout = True

    def unavailable_reason(self):
        return ascend.unavailable_reason()

    def forward(self, call: AttentionCall) -> torch.Tensor:
        count_call(self.name)
        return fusion_attention(
            call.query,
            call.key,
            call.value,
            call.attn_mask,
            call.dropout_p,
            call.is_causal,
            call.scale,
            call.enable_gqa,
        )
