"""matmul -> softmax -> matmul in torch ops: what diffusers' ``AttnProcessor`` computes.

Materialises the (B, H, Lq, Lk) scores (O(L^2) memory); differentiable to any order and under
forward-mode AD, because it is plain torch ops.
"""

from __future__ import annotations

import torch

from .base import ANY_DEVICE, FLOATS, AttentionCall, Backend, count_call


def vanilla_attention(call: AttentionCall) -> torch.Tensor:
    """Rows whose keys are all masked give 0, as torch's SDPA does (a plain softmax would give
    NaN); a mask and ``is_causal`` combine."""
    query, key, value = call.query, call.key, call.value
    if call.enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    scores = torch.matmul(query, key.transpose(-2, -1)) * call.scale
    lq, lk = query.shape[-2], key.shape[-2]
    if call.is_causal:
        causal = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    mask = call.attn_mask
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(scores.dtype)
    probs = torch.softmax(scores, dim=-1)
    probs = probs.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
    if call.dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=call.dropout_p)
    return torch.matmul(probs, value)


class VanillaBackend(Backend):
    name = "vanilla"
    description = "matmul -> softmax -> matmul in torch (O(L^2) memory)"
    devices = (ANY_DEVICE,)
    dtypes = (*FLOATS, torch.float64)
    supports_dropout = True

    def forward(self, call: AttentionCall) -> torch.Tensor:
        count_call(self.name)
        return vanilla_attention(call)
