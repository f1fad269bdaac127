"""Ascend's ``torch_npu``, imported in one place and never fatally.

``torch_npu`` is optional: without it npu_attn runs on CPUs and other accelerators. Installed
but not importable is the common broken state of an Ascend host (CANN's ``set_env.sh`` not
sourced, or a CANN / driver / torch version mismatch: ``ImportError: libhccl.so: cannot open
shared object file``, ``OSError: libascendcl.so``). That must not take the CPU path down with it:
here it is a reason the NPU is unavailable, reported by the DeviceManager, the doctor and the
``npu`` strategy, and everything else works.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Optional

NOT_INSTALLED = "torch_npu is not installed (Ascend NPU support)"

# The failed import's message, kept so that a broken installation is imported (and fails) once
# per process rather than on every check.
_import_failure: Optional[str] = None


def torch_npu() -> tuple[Optional[ModuleType], Optional[str]]:
    """``(torch_npu, None)`` when it imports, else ``(None, why the NPU is unavailable)``."""
    global _import_failure
    module = sys.modules.get("torch_npu")
    if module is not None:
        return module, None
    if importlib.util.find_spec("torch_npu") is None:
        return None, NOT_INSTALLED
    if _import_failure is not None:
        return None, _import_failure
    try:
        return importlib.import_module("torch_npu"), None
    except Exception as error:  # ImportError, OSError, RuntimeError: whatever CANN raises
        _import_failure = (
            f"NPU unavailable: {type(error).__name__}: {error} (torch_npu is installed but cannot "
            "be imported: source CANN's set_env.sh, or install the torch_npu release matching "
            "this torch)"
        )
        return None, _import_failure


def unavailable_reason() -> Optional[str]:
    """Why torch_npu cannot be used in this process (None: it can)."""
    return torch_npu()[1]


def forget_import_failure() -> None:
    """Try the import again at the next check (after fixing the environment in-process)."""
    global _import_failure
    _import_failure = None
