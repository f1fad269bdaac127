"""npu_attn's tiled C++ kernels (CPU): forward and backward, float32 / bfloat16 / float16."""

from __future__ import annotations

import torch

from .. import ops
from .base import FLOATS, AttentionCall, Backend


class TiledBackend(Backend):
    name = "tiled"
    description = (
        "npu_attn's tiled C++ kernels: forward and backward, fp32 accumulation, bf16 on AMX "
        "or AVX512-BF16 where measured faster"
    )
    devices = ("cpu",)
    dtypes = FLOATS

    def forward_with_lse(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        # Only tracers (torch.compile, make_fx, dispatch modes, jit.trace), torch.func
        # transforms and tensor subclasses need the registered op (ops.needs_op); in eager code
        # its dispatch costs more than a small attention call, so autograd gets the same kernels
        # and gradient rule through a plain autograd.Function, and calls without gradients the
        # kernel alone.
        if ops.needs_op(call.query, call.key, call.value, call.attn_mask):
            run = ops.op_forward_with_grad if call.needs_grad else ops.sdpa_forward
        elif call.needs_grad:
            run = ops.eager_forward_with_grad
        else:
            run = ops.forward_cpu
        return run(
            call.query,
            call.key,
            call.value,
            call.attn_mask,
            call.is_causal,
            call.scale,
            call.enable_gqa,
        )

    def forward(self, call: AttentionCall) -> torch.Tensor:
        return self.forward_with_lse(call)[0]
