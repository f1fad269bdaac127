"""npu_attn: fast, exact attention for diffusion models where CUDA flash-attention is missing.

The tiled (flash-style) C++ kernel computes exact attention in O(L) memory on any CPU, with the
kernel variant for each dtype measured on the machine at first use (see
:func:`npu_attn.runtime.kernel_variants`).

Quick start::

    import npu_attn
    out = npu_attn.scaled_dot_product_attention(q, k, v)   # same signature as torch's SDPA
"""

from . import _compat, runtime
from ._version import __version__
from .attention.functional import scaled_dot_product_attention

_compat.install()

# With torch already imported, npu_attn's torch ops are registered now (~10 ms), so a program
# saved with torch.export that calls them loads after a plain ``import npu_attn``; otherwise they
# register on first use, and NumPy-only processes never import torch.
if "torch" in __import__("sys").modules:
    from .attention import ops as _ops  # noqa: F401
    from .graph import winograd as _winograd  # noqa: F401

# Everything else is imported on first use: the diffusers integration needs torch, and NumPy-only
# users of the kernel should not pay for (or need) it. name -> module that defines it.
_LAZY = {
    "set_attention_strategy": "integration.processors",
    "reset_attention_strategy": "integration.processors",
    "attention_strategy_of": "integration.processors",
    "register_diffusers_backends": "integration.dispatcher",
    "default_strategy": "attention.config",
    "STRATEGIES": "attention.strategies",
    "auto_selector": "attention.strategies",
    "call_counts": "attention.strategies",
    "reset_call_counts": "attention.strategies",
    "backends": "attention.backends.registry",
    "accelerate": "accel.registry",
    "acceleration_of": "accel.registry",
    "check_acceleration": "accel.registry",
    "reset_acceleration": "accel.registry",
    "compile": "graph.mode",
    "compiled_components": "graph.mode",
    "FrozenWeightsChanged": "graph.mode",
    "reset_compile": "graph.mode",
    "DeviceManager": "device",
}
# Folders served as attributes on first use (``npu_attn.parallel.enable_cfg_parallel(...)`` after
# a plain ``import npu_attn``).
_SUBPACKAGES = (
    "accel",
    "attention",
    "components",
    "device",
    "graph",
    "integration",
    "parallel",
    "tools",
)
# Names whose home is now a subpackage: still served here, with a DeprecationWarning.
_MOVED = {
    **dict.fromkeys(runtime.__all__, "runtime"),
    **dict.fromkeys(
        [
            "enable_cfg_parallel",
            "disable_cfg_parallel",
            "enable_context_parallel",
            "disable_context_parallel",
        ],
        "parallel",
    ),
}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    if name in _MOVED:
        import warnings

        home = f"{__name__}.{_MOVED[name]}"
        warnings.warn(f"npu_attn.{name} moved to {home}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'npu_attn' has no attribute {name!r}")


__all__ = [
    "STRATEGIES",
    "DeviceManager",
    "FrozenWeightsChanged",
    "__version__",
    "accelerate",
    "acceleration_of",
    "attention_strategy_of",
    "auto_selector",
    "backends",
    "call_counts",
    "check_acceleration",
    "compile",
    "compiled_components",
    "default_strategy",
    "register_diffusers_backends",
    "reset_acceleration",
    "reset_attention_strategy",
    "reset_call_counts",
    "reset_compile",
    "scaled_dot_product_attention",
    "set_attention_strategy",
]
