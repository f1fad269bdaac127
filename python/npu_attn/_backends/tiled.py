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
        # Outside autograd and compilation the registered op adds only dispatch overhead
        # (~30 us a call, which matters for small attention calls): call the kernel directly.
        use_op = torch.compiler.is_compiling() or call.needs_grad
        run = ops.sdpa_forward if use_op else ops.forward_cpu
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
