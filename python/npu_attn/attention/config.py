"""Process-wide settings at the bottom of the package: the default attention strategy.

Kept here, below everything that reads it, so the function layer (direct
``scaled_dot_product_attention`` calls) and the diffusers layer share it without importing each
other.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

logger = logging.getLogger("npu_attn")

_explicit: Optional[str] = None  # set_attention_strategy(None, name)
_alias_noted = False


def set_default_strategy(name: Optional[str]) -> None:
    """The default set by ``set_attention_strategy(None, name)`` (``None`` clears it)."""
    global _explicit
    _explicit = name


def explicit_default() -> Optional[str]:
    """The default set with ``set_attention_strategy(None, name)``, if any. Direct
    ``scaled_dot_product_attention`` calls prefer it where it can run them."""
    return _explicit


def default_strategy() -> str:
    """The strategy used when none is given: set by ``set_attention_strategy(None, s)``, else
    ``NPU_ATTN_STRATEGY``, else ``DIFFUSERS_ATTENTION_TYPE`` (the seeds' variable, which
    diffusers itself ignores), else ``"auto"``."""
    global _alias_noted
    if _explicit is not None:
        return _explicit
    env = os.environ.get("NPU_ATTN_STRATEGY")
    if env:
        return env.strip().lower()
    alias = os.environ.get("DIFFUSERS_ATTENTION_TYPE")
    if alias:
        if not _alias_noted:
            _alias_noted = True
            logger.warning(
                "npu_attn: honouring DIFFUSERS_ATTENTION_TYPE=%s. Note that diffusers itself never "
                "reads this variable; npu_attn does. Prefer NPU_ATTN_STRATEGY.",
                alias,
            )
        return alias.strip().lower()
    return "auto"
