"""Context-scoped redirection of ``torch.nn.functional.scaled_dot_product_attention``.

diffusers' attention processors (UNet/VAE ``AttnProcessor2_0``, SD3's ``JointAttnProcessor2_0``,
HiDream's processor, and Flux through ``dispatch_attention_fn``'s native backend) all end in
``torch.nn.functional.scaled_dot_product_attention``. Rather than re-implementing every
processor (and drifting from diffusers with each release), npu_attn wraps a model's own
processors and, *only while one of them runs*, routes that SDPA call to the chosen strategy.

Mechanism: on first use, ``torch.nn.functional.scaled_dot_product_attention`` is replaced by a
pass-through shim (and again whenever torch's own function is found back in its place). In
eager mode the shim looks up a ``ContextVar``; when a wrapped processor is running it holds the
strategy's function, otherwise ``None`` and the call goes to torch unchanged (so code outside
wrapped processors, other threads and other models are unaffected).

Under ``torch.compile`` dynamo cannot trace ``ContextVar.get/.set`` (it would break the graph and
the call would silently reach torch's SDPA), so while tracing the wrapped processor publishes
its strategy in a plain module attribute (:data:`_traced_route`) around the inner call instead;
dynamo traces that store and load, so the chosen strategy's own code (for ``tiled`` the
registered op ``torch.ops.npu_attn.sdpa_forward``) lands in the graph. Tracing is
single-threaded, and the attribute is ``None`` again when the processor returns. If torch's own
function is back in ``F`` when tracing starts, the traced processor puts the shim back first.

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

from ..attention.backends.torch_sdpa import ORIGINAL_SDPA

SdpaFunction = Callable[..., torch.Tensor]

_active: ContextVar[Optional[SdpaFunction]] = ContextVar("npu_attn_active_sdpa", default=None)
_install_lock = threading.Lock()
_installed = False
# The strategy function of the wrapped processor being traced by torch.compile (see above).
_traced_route: Optional[SdpaFunction] = None


def install() -> None:
    """Install the pass-through shim (idempotent, thread-safe). Also again when torch's own
    function is back in place: code that wraps ``F.scaled_dot_product_attention`` for a while
    and then restores the function it found (a call recorder) can have found torch's, if our
    first install happened inside its window."""
    global _installed
    with _install_lock:
        if _installed and F.scaled_dot_product_attention is not ORIGINAL_SDPA:
            return  # ours, or someone's wrapper, which may call ours
        _installed = True
        # Always the same function: compiled graphs guard on its identity.
        F.scaled_dot_product_attention = _shim


@functools.wraps(ORIGINAL_SDPA)
def _shim(*args, **kwargs):
    # torch's SDPA, or the strategy of the wrapped processor running in this context (it
    # carries torch's name and docstring, for code that inspects the function).
    # dynamo cannot trace the ContextVar: while tracing, the route is a plain attribute
    fn = _traced_route if torch.compiler.is_compiling() else _active.get()
    if fn is None:
        return ORIGINAL_SDPA(*args, **kwargs)
    return fn(*args, **kwargs)  # strategy functions take SDPA's arguments as torch's


@contextlib.contextmanager
def redirected(fn: SdpaFunction):
    """Within the block, SDPA calls in this thread/context go to ``fn`` (eager mode)."""
    token = _active.set(fn)
    try:
        yield
    finally:
        _active.reset(token)


def call_routed(fn: SdpaFunction, inner: Callable, *args, **kwargs):
    """``inner(*args, **kwargs)`` with its SDPA calls routed to ``fn``: through the ContextVar
    in eager mode, through :data:`_traced_route` while torch.compile traces."""
    global _traced_route
    if torch.compiler.is_compiling():
        if F.scaled_dot_product_attention is ORIGINAL_SDPA:  # the shim was removed (see install)
            # install() takes a lock, which dynamo cannot trace; a plain attribute store it
            # traces, and replays when the compiled code runs (the graph then guards on it)
            F.scaled_dot_product_attention = _shim
        previous = _traced_route
        _traced_route = fn
        try:
            return inner(*args, **kwargs)
        finally:
            _traced_route = previous
    if F.scaled_dot_product_attention is ORIGINAL_SDPA:  # the shim was removed (see install)
        install()
    with redirected(fn):
        return inner(*args, **kwargs)
