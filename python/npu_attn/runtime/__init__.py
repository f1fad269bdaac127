"""The kernel runtime: the C++ extension, threads, kernel variants and their measured choice,
CPU memory reuse, and the small timing and counting helpers every layer above uses.

The knobs users set live here (``npu_attn.runtime.set_num_threads(4)``)."""

from .controls import (
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

__all__ = [
    "active_isa",
    "available_isas",
    "build_info",
    "cpu_memory_reuse_enabled",
    "get_num_threads",
    "kernel_variants",
    "release_cpu_memory",
    "reuse_cpu_memory",
    "set_isa",
    "set_num_threads",
    "workspace_stats",
]
