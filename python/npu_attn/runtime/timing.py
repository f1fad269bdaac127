"""Timing competitors on a noisy machine: one warm-up call each, then interleaved rounds (every
competitor sees the same machine state in each round), medians. Used wherever npu_attn chooses
between implementations by measuring them (auto's per-shape attention choice, frozen float32
linears)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def interleaved_times(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each call in each of ``rounds`` interleaved rounds, after one warm-up each."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_medians(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds of each call over ``rounds`` interleaved rounds, after one warm-up each."""
    return {name: statistics.median(t) for name, t in interleaved_times(calls, rounds).items()}
