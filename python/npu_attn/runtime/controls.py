"""Kernel runtime controls: threads, kernel variants and build information.

The C++ extension compiles several kernel variants (``available_isas()``). Which one runs a
call is chosen per dtype (and shape class) by measurement on first use on a machine and cached
(see :mod:`npu_attn.runtime.variant_choice`); ``NPU_ATTN_ISA`` or :func:`set_isa` force one variant,
and importing fails with a clear message if the machine cannot run a requested variant.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Iterator
from typing import Any, Optional

from . import variant_choice
from .extension import _C

__all__ = [
    "active_isa",
    "available_isas",
    "build_info",
    "get_num_threads",
    "kernel_variants",
    "set_isa",
    "set_num_threads",
    "workspace_stats",
]

# More threads than this is a mistake, not a configuration (OpenMP would try to start them).
MAX_THREADS = max(1024, 4 * (os.cpu_count() or 1))

_explicit_threads: Optional[int] = None


def cpu_model() -> str:
    """This CPU's model name: the CPUID brand string (x86), else the machine type."""
    return _C.cpu_info()["model"] or platform.machine()


def cpu_identity() -> str:
    """The model name and the CPUID signature, e.g. ``AMD EPYC (family 23 model 1 stepping 2)``.

    Virtual machines often report one generic brand string for several generations (Zen 1 and
    Zen 3 are both "AMD EPYC"), so whatever is measured per CPU (cached kernel choices, graph
    caches, benchmark reports) is keyed and labelled by this, not by the brand string alone.
    """
    info = _C.cpu_info()
    model = info["model"] or platform.machine()
    return f"{model} ({info['signature']})" if info["signature"] else model


def set_num_threads(threads: Optional[int]) -> None:
    """Set the number of threads npu_attn's kernels use (1 .. ``MAX_THREADS``).

    ``None`` restores the default, which follows ``torch.get_num_threads()`` when torch is
    imported and OpenMP's default otherwise. A rejected value leaves the setting unchanged.
    """
    global _explicit_threads
    if threads is None:
        _explicit_threads = None
        return
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be an int or None, got {type(threads).__name__}")
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be between 1 and {MAX_THREADS}, got {threads}")
    _C.set_num_threads(threads)  # raises before anything is stored if C++ refuses it
    _explicit_threads = threads


@contextlib.contextmanager
def threads_for_run(threads: Optional[int]) -> Iterator[int]:
    """torch and npu_attn's kernels on ``threads`` threads (None: torch's current count) for
    one tool run (bench, demo), which yields the count. Both settings are restored afterwards,
    on errors too: a tool's ``main()`` called from Python (a notebook, a test) leaves the
    caller's thread counts as they were, and npu_attn's following torch's."""
    import torch

    torch_before, npu_attn_before = torch.get_num_threads(), _explicit_threads
    count = threads or torch_before
    try:  # (a count npu_attn refuses raises after torch took it: restored too)
        torch.set_num_threads(count)
        set_num_threads(count)
        yield count
    finally:
        torch.set_num_threads(torch_before)
        set_num_threads(npu_attn_before)


def get_num_threads() -> int:
    """Threads the next kernel call will use."""
    if _explicit_threads is not None:
        return _explicit_threads
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        return int(torch.get_num_threads())
    return int(_C.get_num_threads())


def active_isa(dtype: str = "float32") -> str:
    """The kernel variant that runs ``dtype`` ("float32", "bfloat16" or "float16")
    self-attention on this machine: ``"scalar"``, ``"avx2"``, ``"avx512"``, ``"avx512_bf16"``
    (bfloat16 on AVX-512-BF16 dot products) or ``"amx_bf16"`` (bfloat16 on AMX tiles).
    Chooses it now (measuring once per machine) if no call has yet; see
    :func:`kernel_variants` for every shape class and the reason."""
    variant_choice.ensure(dtype)
    return _C.active_isa(dtype)


def kernel_variants() -> dict[str, dict[str, Any]]:
    """Per dtype: ``choice`` (shape class -> variant), ``source`` (measured when / cached /
    ``NPU_ATTN_ISA`` / ``set_isa()`` / rule) and, when measured, ``ms`` (best-of-N milliseconds
    of every candidate per shape class)."""
    return variant_choice.report()


def available_isas() -> list[str]:
    """Variants compiled into this build that this CPU can run, least specialised first."""
    return list(_C.runnable_isas())


def set_isa(name: Optional[str]) -> None:
    """Force kernel variant ``name`` for every dtype (e.g. to compare variants); ``None`` goes
    back to the measured choice. Raises ``ValueError`` for an unknown name and
    ``RuntimeError`` if this CPU cannot run it."""
    if name is not None:
        known = [row["name"] for row in _C.variants()]
        if name not in known:
            raise ValueError(f"isa must be one of {', '.join(map(repr, known))}, got {name!r}")
    variant_choice.pin(name)


def build_info() -> dict:
    """Compiler, OpenMP, Eigen and DLPack versions and the compiled kernel variants."""
    info = dict(_C.build_info())
    # the variants that will run (measured or loaded from the cache now, if not yet)
    info["active_isa"] = {
        dtype: entry["choice"]["self-attention"] for dtype, entry in kernel_variants().items()
    }
    info["runnable_isas"] = available_isas()
    return info


def workspace_stats() -> dict:
    """Bytes held by the kernels' workspaces now and at peak, and the number of allocations."""
    return dict(_C.workspace_stats())


def reuse_cpu_memory(enabled: bool = True) -> None:
    """Keep freed CPU memory in the process for reuse (``True``) or go back to the C library's
    defaults (``False``). Process-wide; off unless you call this.

    A diffusion step allocates and frees tens of megabytes per layer (SD-1.5's feed-forward at
    512px: 84 MB in float32). glibc maps blocks that large afresh on every allocation and
    unmaps them when freed, so each step pays a page fault per 4 KiB on first touch; with
    reuse on they come from the heap and stay there between steps, as a caching allocator
    keeps them on an accelerator (measured: a frozen float32 SD-1.5 UNet step 1.5% faster on
    a 2-core Zen 4; BENCHMARKS.md). The cost: the process keeps its peak heap size until
    :func:`release_cpu_memory` (or ``DeviceManager.empty_cache()``) or ``False`` here returns
    the free memory to the OS.

    ``False`` after ``True`` sets glibc's thresholds to the values glibc itself reaches once a
    process has freed large blocks (mmap above 32 MiB, trim above 64 MiB): any change ends
    glibc's own adjustment, so its start-up values would be slower than never calling this.
    ``False`` while reuse is off changes nothing.

    Raises:
        TypeError: ``enabled`` is not a bool.
        RuntimeError: enabling where the C heap is not glibc's (another libc, or a sanitizer's
            allocator); disabling there is a no-op.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if not _C.set_heap_reuse(enabled) and enabled:
        raise RuntimeError(
            "reuse_cpu_memory needs glibc's malloc (mallopt); this process's C heap is "
            "another one (a different libc, or a sanitizer's allocator)"
        )


def cpu_memory_reuse_enabled() -> bool:
    """Whether :func:`reuse_cpu_memory` is on."""
    return bool(_C.memory_info()["heap_reuse"])


def release_cpu_memory() -> int:
    """Return the free memory the C heap keeps to the OS (glibc's ``malloc_trim``); the
    reuse setting stays as it is. Returns the bytes the heap held free before."""
    held = int(_C.memory_info()["heap_free_bytes"])
    _C.release_free_heap()
    return held
