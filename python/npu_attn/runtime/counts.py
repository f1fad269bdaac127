"""How many attention calls each implementation served in this process.

Counted where a backend really runs (the function layer for direct calls, the strategies for
redirected ones), read through :func:`npu_attn.call_counts`. At the bottom of the package so
both layers can count without importing each other.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_counts: dict[str, int] = {}


def count(name: str) -> None:
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def reset() -> None:
    with _lock:
        _counts.clear()
