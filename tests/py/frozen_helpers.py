"""What the frozen-graph pass tests share: compiling a model frozen against running it eagerly,
and recording the graphs inductor lowers with a pass of the test's own, set where a user would
set one."""

from __future__ import annotations

import contextlib
import sys

import torch
from torch._inductor import config as inductor_config

import npu_attn
from npu_attn.graph.mode import INDUCTOR_MODULE_PREFIX


@contextlib.contextmanager
def recording(recorder, setting: str):
    """``recorder`` installed as ``torch._inductor.config.<setting>`` with fresh dynamo caches
    (so every compile lowers, and records, its graph)."""
    torch._dynamo.reset()
    with inductor_config.patch(**{setting: recorder}):
        yield recorder
    torch._dynamo.reset()


def frozen_and_eager(model, x, **options):
    """``model(x)`` compiled with ``npu_attn.compile(model, None, freeze=True, **options)``,
    then eagerly, both without gradients."""
    npu_attn.compile(model, None, freeze=True, **options)
    with torch.no_grad():
        compiled = model(x)
    npu_attn.reset_compile(model)
    with torch.no_grad():
        eager = model(x)
    return compiled, eager


def tensors_kept_by_generated_code() -> list[str]:
    """The tensors (module.attribute) inductor's generated modules still hold: a frozen graph's
    weights stay there after its compiled model is gone, unless released."""
    return [
        f"{name}.{attr}"
        for name, module in list(sys.modules.items())
        if name.startswith(INDUCTOR_MODULE_PREFIX)
        for attr, value in vars(module).items()
        if isinstance(value, torch.Tensor)
    ]
