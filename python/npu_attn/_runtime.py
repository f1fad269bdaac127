"""Kernel runtime controls: threads, ISA variants and build information.

The C++ extension chooses the best kernel variant for this CPU once, at import; the
``NPU_ATTN_ISA`` environment variable (``scalar``, ``avx2`` or ``avx512``) overrides that choice
and importing fails with a clear message if the machine cannot run the requested variant.
"""

from __future__ import annotations

import sys
from typing import Optional

from . import _C

__all__ = [
    "active_isa",
    "available_isas",
    "build_info",
    "get_num_threads",
    "set_isa",
    "set_num_threads",
    "workspace_stats",
]

_explicit_threads: Optional[int] = None


def set_num_threads(threads: Optional[int]) -> None:
    """Set the number of threads npu_attn's kernels use.

    ``None`` restores the default, which follows ``torch.get_num_threads()`` when torch is
    imported and OpenMP's default otherwise.
    """
    global _explicit_threads
    if threads is None:
        _explicit_threads = None
        return
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be an int or None, got {type(threads).__name__}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    _explicit_threads = threads
    _C.set_num_threads(threads)


def get_num_threads() -> int:
    """Threads the next kernel call will use."""
    if _explicit_threads is not None:
        return _explicit_threads
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        return int(torch.get_num_threads())
    return int(_C.get_num_threads())


def active_isa() -> str:
    """Name of the kernel variant in use: ``"scalar"``, ``"avx2"``, ``"avx512"``,
    ``"avx512_bf16"`` or ``"amx_bf16"`` (avx512 plus a bfloat16 forward on AVX-512-BF16 dot
    products or on AMX tiles)."""
    return _C.active_isa()


def available_isas() -> list[str]:
    """Variants compiled into this build that this CPU can run, slowest first."""
    return list(_C.runnable_isas())


def set_isa(name: str) -> None:
    """Switch the kernel variant (e.g. to compare variants). Raises if this CPU cannot run it."""
    known = ("scalar", "avx2", "avx512", "avx512_bf16", "amx_bf16")
    if name not in known:
        raise ValueError(f"isa must be one of {', '.join(map(repr, known))}, got {name!r}")
    _C.set_isa(name)


def build_info() -> dict:
    """Compiler, OpenMP, Eigen and DLPack versions and the compiled kernel variants."""
    info = dict(_C.build_info())
    info["active_isa"] = active_isa()
    info["runnable_isas"] = available_isas()
    return info


def workspace_stats() -> dict:
    """Bytes held by the kernels' workspaces now and at peak, and the number of allocations."""
    return dict(_C.workspace_stats())
