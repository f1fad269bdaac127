"""npu_attn: fast, exact attention for diffusion models where CUDA flash-attention is missing.

The tiled (flash-style) C++ kernel computes exact attention in O(L) memory on any CPU, with the
kernel variant for each dtype measured on the machine at first use (see :func:`kernel_variants`).

Quick start::

    import npu_attn
    out = npu_attn.scaled_dot_product_attention(q, k, v)   # same signature as torch's SDPA
"""

from ._runtime import (
    active_isa,
    available_isas,
    build_info,
    cpu_memory_reuse_enabled,
    get_num_threads,
    kernel_variants,
    release_cpu_memory,
    reuse_cpu_memory,
    set_isa,
    set_num_threads,
    workspace_stats,
)
from ._version import __version__
from .functional import scaled_dot_product_attention

# The diffusers integration needs torch; import it on first use so that NumPy-only users of the
# kernel do not pay for (or need) torch.
_LAZY = {
    "accelerate": "acceleration",
    "acceleration_of": "acceleration",
    "check_acceleration": "acceleration",
    "reset_acceleration": "acceleration",
    "set_attention_strategy": "diffusers_integration",
    "reset_attention_strategy": "diffusers_integration",
    "default_strategy": "_config",
    "attention_strategy_of": "diffusers_integration",
    "STRATEGIES": "strategies",
    "DeviceManager": "device",
    "enable_cfg_parallel": "parallel",
    "disable_cfg_parallel": "parallel",
    "enable_context_parallel": "parallel",
    "disable_context_parallel": "parallel",
    "backends": "_backends.registry",
    "auto_selector": "strategies",
    "call_counts": "strategies",
    "compile": "graph_mode",
    "compiled_components": "graph_mode",
    "FrozenWeightsChanged": "graph_mode",
    "reset_compile": "graph_mode",
    "reset_call_counts": "strategies",
    "register_diffusers_backends": "diffusers_backend",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'npu_attn' has no attribute {name!r}")


__all__ = [
    "STRATEGIES",
    "DeviceManager",
    "FrozenWeightsChanged",
    "__version__",
    "accelerate",
    "acceleration_of",
    "active_isa",
    "attention_strategy_of",
    "auto_selector",
    "available_isas",
    "backends",
    "build_info",
    "call_counts",
    "check_acceleration",
    "compile",
    "compiled_components",
    "cpu_memory_reuse_enabled",
    "default_strategy",
    "disable_cfg_parallel",
    "disable_context_parallel",
    "enable_cfg_parallel",
    "enable_context_parallel",
    "get_num_threads",
    "kernel_variants",
    "register_diffusers_backends",
    "release_cpu_memory",
    "reset_acceleration",
    "reset_attention_strategy",
    "reset_call_counts",
    "reset_compile",
    "reuse_cpu_memory",
    "scaled_dot_product_attention",
    "set_attention_strategy",
    "set_isa",
    "set_num_threads",
    "workspace_stats",
]
