"""Context-scoped redirection of ``torch.nn.functional.scaled_dot_product_attention``.

diffusers' attention processors (UNet/VAE ``AttnProcessor2_0``, SD3's ``JointAttnProcessor2_0``,
HiDream's processor, and Flux through ``dispatch_attention_fn``'s native backend) all end in
``torch.nn.functional.scaled_dot_product_attention``. Rather than re-implementing every
processor (and drifting from diffusers with each release), npu_attn wraps a model's own
processors and, *only while one of them runs*, routes that SDPA call to the chosen strategy.

Mechanism: on first use, ``torch.nn.functional.scaled_dot_product_attention`` is replaced by a
pass-through shim. The shim looks up a ``ContextVar``; when a wrapped processor is running it
holds the strategy's function, otherwise ``None`` and the call goes to torch unchanged (so code
outside wrapped processors, other threads and other models are unaffected). Under
``torch.compile`` the shim always passes through.

Limitation: code that imported the function itself (``from torch.nn.functional import
scaled_dot_product_attention``) before npu_attn patched it is not redirected.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from contextvars import ContextVar
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ._backends.torch_sdpa import ORIGINAL_SDPA

SdpaFunction = Callable[..., torch.Tensor]

_active: ContextVar[Optional[SdpaFunction]] = ContextVar("npu_attn_active_sdpa", default=None)
_install_lock = threading.Lock()
_installed = False


def _call_active(
    fn,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    return fn(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def install() -> None:
    """Install the pass-through shim (idempotent, thread-safe)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        original = ORIGINAL_SDPA

        @functools.wraps(original)
        def scaled_dot_product_attention(*args, **kwargs):
            fn = _active.get()
            if fn is None or torch.compiler.is_compiling():
                return original(*args, **kwargs)
            return _call_active(fn, *args, **kwargs)

        _installed = True
        F.scaled_dot_product_attention = scaled_dot_product_attention


@contextlib.contextmanager
def redirected(fn: SdpaFunction):
    """Within the block, SDPA calls in this thread/context go to ``fn``."""
    token = _active.set(fn)
    try:
        yield
    finally:
        _active.reset(token)
