"""Peak resident memory of a block of code in this process.

``resource.getrusage().ru_maxrss`` is not usable for this: Linux carries it across ``exec``, so
a subprocess started by a large parent begins with the parent's peak and shows no growth.
Instead the kernel's high-water mark (VmHWM in /proc/self/status) is reset by writing "5" to
/proc/self/clear_refs before the block and read after it.
"""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass
from typing import Optional


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_bytes() -> Optional[int]:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class PeakMeasurement:
    baseline_bytes: int = 0
    peak_bytes: int = 0
    exact: bool = True  # False: the high-water mark could not be reset

    @property
    def extra_bytes(self) -> int:
        return max(0, self.peak_bytes - self.baseline_bytes)


@contextlib.contextmanager
def measure_peak():
    """``with measure_peak() as m: ...`` then ``m.extra_bytes`` is the peak RSS growth."""
    m = PeakMeasurement()
    m.exact = _reset_peak()
    m.baseline_bytes = current_rss_bytes() or peak_rss_bytes()
    try:
        yield m
    finally:
        m.peak_bytes = peak_rss_bytes()
