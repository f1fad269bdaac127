"""Argument types shared by the command-line tools (argparse reports a bad value as a usage
error naming the option, exit code 2, before anything is built or measured)."""

from __future__ import annotations

import argparse
from typing import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)  # ValueError: argparse says "invalid int value"
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"
    return parse
