"""What npu_attn measured on this machine, kept across processes: one JSON file per kind of
measurement (``kernel_variants.json``, ``auto_strategy.json``) in ``$NPU_ATTN_CACHE_DIR``
(default ``~/.cache/npu_attn``).

File format 1: ``{"format": 1, <fingerprint>: {<key>: <entry>}}``. A fingerprint names the
machine and software an entry was measured on (the caller's choice of what matters), so one
file serves several CPUs, builds or thread counts side by side. Files written before the
format number existed have the same layout without ``"format"`` and are read as format 1; a
file of a newer format is ignored (and replaced on the next store). The cache is an
optimisation: a file that cannot be read or written costs a measurement, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger("npu_attn")

FORMAT = 1


def cache_dir() -> Path:
    root = os.environ.get("NPU_ATTN_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "npu_attn"
    )
    return Path(root)


@functools.cache
def build_digest() -> str:
    """A digest of the loaded C++ extension's file: a rebuilt kernel (same version, new code) is
    measured again instead of being judged by its predecessor's timings."""
    from .extension import _C

    try:
        with open(_C.__file__, "rb") as f:
            return hashlib.sha1(f.read()).hexdigest()[:16]
    except OSError:  # e.g. a frozen application: the version still separates releases
        return "unknown"


class MeasurementCache:
    """One cache file: entries by fingerprint and key."""

    def __init__(self, filename: str) -> None:
        self.filename = filename

    @property
    def path(self) -> Path:
        return cache_dir() / self.filename  # read each time: the directory is an env variable

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format", FORMAT) != FORMAT:
            return {}
        return data

    def get(self, fingerprint: str, key: str) -> Optional[dict]:
        entries = self._load().get(fingerprint)
        return entries.get(key) if isinstance(entries, dict) else None

    def store(self, fingerprint: str, key: str, entry: dict) -> None:
        """Add or replace one entry, atomically (a concurrent reader sees the old file or the
        new one)."""
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = self._load()
            data["format"] = FORMAT
            data.setdefault(fingerprint, {})[key] = entry
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as e:  # a read-only home must not break inference
            logger.debug("npu_attn: cannot write %s: %s", path, e)
