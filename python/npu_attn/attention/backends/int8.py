"""npu_attn's int8 kernel (CPU): lossy, opt-in, forward only.

SageAttention's method on CPU integer units: K smoothed by its mean, Q's outlier channels moved
into K, both quantized per token to 8 bits, Q K^T on integers, the softmax exact in float32,
P V on 16-bit integer codes with AVX2 (float32 elsewhere) (csrc/kernels/attention_int8_impl.h;
docs/int8-attention.md). Calls too small to gain run the exact kernel
(ops.int8_runs_exact_kernel).
Never chosen automatically: only ``backend="int8"`` or the ``int8`` strategy run it.
"""

from __future__ import annotations

import torch

from .. import ops
from .base import FLOATS, AttentionCall, Backend


class Int8Backend(Backend):
    name = "int8"
    description = (
        "npu_attn's int8 kernel: Q K^T on 8-bit codes (smoothed K, per-token scales), "
        "softmax in float32, P V on 16-bit codes (AVX2); lossy, opt-in, forward only"
    )
    devices = ("cpu",)
    dtypes = FLOATS
    supports_grad = False
    opt_in = True

    def forward(self, call: AttentionCall) -> torch.Tensor:
        run = ops.sdpa_forward_int8 if ops.needs_op(call.query, call.key, call.value) else None
        args = (
            call.query,
            call.key,
            call.value,
            call.attn_mask,
            call.is_causal,
            call.scale,
            call.enable_gqa,
        )
        return run(*args) if run is not None else ops.forward_int8_cpu(*args)
