"""Argument types shared by the command-line tools (argparse reports a bad value as a usage
error naming the option, exit code 2, before anything is built or measured)."""

from __future__ import annotations

import argparse
import functools
from typing import Callable


def on_requested_threads(run: Callable) -> Callable:
    """Decorates a tool's ``run(args, ...)``: it runs with torch and npu_attn's kernels on
    ``args.threads`` threads (None: torch's current count), both restored when it returns or
    raises (:func:`npu_attn.runtime.controls.threads_for_run`)."""

    @functools.wraps(run)
    def with_threads(args, *rest, **kwargs):
        from ..runtime.controls import threads_for_run

        with threads_for_run(getattr(args, "threads", None)):
            return run(args, *rest, **kwargs)

    return with_threads


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)  # ValueError: argparse says "invalid int value"
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"
    return parse
