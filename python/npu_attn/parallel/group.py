"""Process groups for :mod:`npu_attn.parallel`: start-up from torchrun's environment, rank
agreement checks that fail on every rank at once, and byte counters for the bench.

Everything here is plain ``torch.distributed`` (gloo on CPU, hccl / nccl where the device has
them); npu_attn adds no transport of its own.

Why the agreement checks exist: a collective that one rank enters with other shapes than its
peers, or that one rank never enters because it raised an error, leaves the others waiting until
the process group's timeout. So every public entry point first exchanges a small header (shapes,
flags, input fingerprints and "did my local validation fail") with one ``all_gather``; every
rank then takes the same decision from the same gathered data, and either all proceed or all
raise, with a message naming the ranks and values that disagree.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "DEFAULT_TIMEOUT",
    "RankDisagreement",
    "comm_stats",
    "count_bytes",
    "default_backend",
    "distributed_group",
    "exchange",
    "fingerprint",
    "group_rank",
    "group_size",
    "init_distributed",
    "require_distributed",
    "require_equal",
    "reset_comm_stats",
    "shutdown_distributed",
]

ENV_TIMEOUT = "NPU_ATTN_DIST_TIMEOUT"
# Long enough for a slow rank to finish a full-size denoising step before the next collective,
# short enough that a crashed peer is reported within minutes instead of never.
DEFAULT_TIMEOUT = timedelta(minutes=10)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# The agreement header is a fixed-size float64 row per rank: a rank with a different number of
# values (a mismatched call) must still take part in the same all_gather.
_HEADER_SLOTS = 32
_ERROR_SLOT = 0  # 1.0: this rank's local validation failed
_COUNT_SLOT = 1  # how many values follow

_bytes_sent: Counter = Counter()


class RankDisagreement(ValueError):
    """Ranks called a collective entry point with inputs that do not fit together."""


# --------------------------------------------------------------------------- start-up
def default_backend(device_type: str = "cpu") -> str:
    """The torch.distributed backend for tensors on ``device_type``: gloo for CPU, hccl for
    Ascend NPUs, nccl for CUDA (each with gloo for CPU tensors, which the agreement checks
    and CPU-side collectives use)."""
    if device_type == "npu":
        return "cpu:gloo,npu:hccl"
    if device_type == "cuda":
        return "cpu:gloo,cuda:nccl"
    if device_type == "cpu":
        return "gloo"
    raise ValueError(f"device_type must be 'cpu', 'cuda' or 'npu', got {device_type!r}")


def _timeout(timeout: Union[timedelta, float, None]) -> timedelta:
    """``timeout`` as a timedelta: given, else ``NPU_ATTN_DIST_TIMEOUT`` seconds, else the
    default."""
    if timeout is None:
        raw = os.environ.get(ENV_TIMEOUT, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{ENV_TIMEOUT} must be a number of seconds, got {raw!r}") from None
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=float(timeout))
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive timedelta or seconds, got {timeout!r}")
    return timeout


def init_distributed(
    backend: Optional[str] = None,
    *,
    device_type: str = "cpu",
    timeout: Union[timedelta, float, None] = None,
) -> tuple[int, int]:
    """Join the process group torchrun (or any launcher setting its variables) describes.

    Args:
        backend: a torch.distributed backend string; default :func:`default_backend`.
        device_type: where the model runs (``"cpu"``, ``"cuda"``, ``"npu"``), for the default
            backend.
        timeout: how long a collective may wait for its peers before raising (seconds or a
            timedelta); default ``NPU_ATTN_DIST_TIMEOUT`` or 10 minutes. Every collective
            npu_attn runs, including ring attention's point-to-point transfers, is bounded by it.

    Returns:
        ``(rank, world_size)``. Already initialised: the existing group's values (nothing
        changes).

    Raises:
        RuntimeError: torch.distributed is unavailable, or the launcher variables
            (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) are missing.
    """
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed support")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [name for name in TORCHRUN_VARIABLES if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            f"init_distributed needs the launcher's environment; missing {', '.join(missing)}. "
            "Launch with e.g. `torchrun --nproc-per-node 2 your_script.py` (one machine) or "
            "`torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --master-addr HOST "
            "--master-port 29500 your_script.py` (one process per machine)"
        )
    dist.init_process_group(
        backend or default_backend(device_type), init_method="env://", timeout=_timeout(timeout)
    )
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def distributed_group(
    backend: Optional[str] = None,
    device_type: str = "cpu",
    timeout: Union[timedelta, float, None] = None,
) -> Iterator[tuple[int, int]]:
    """:func:`init_distributed` for the block, yielding ``(rank, world_size)``; on the way out
    it leaves the group only if the block joined it: a group the caller made stays the
    caller's (a script that calls a tool in-process keeps its group)."""
    joined = not (dist.is_available() and dist.is_initialized())
    ranks = init_distributed(backend=backend, device_type=device_type, timeout=timeout)
    try:
        yield ranks
    finally:
        if joined:
            shutdown_distributed()


def shutdown_distributed() -> None:
    """Leave the process group (safe to call when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def require_distributed(what: str) -> None:
    """RuntimeError unless a default process group exists."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed: call npu_attn.parallel.init_distributed() in a "
            "process started by torchrun (e.g. `torchrun --nproc-per-node 2 script.py`), or "
            "torch.distributed.init_process_group(...) yourself, first"
        )


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Ranks in ``group`` (None: the default group)."""
    return dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank within ``group`` (None: the default group)."""
    return dist.get_rank(group)


# --------------------------------------------------------------------------- agreement
def exchange(
    values: Sequence[float],
    group: Optional[dist.ProcessGroup],
    *,
    what: str,
    device: Union[torch.device, str] = "cpu",
    local_error: Optional[BaseException] = None,
) -> list[list[float]]:
    """All ranks' ``values`` (one all_gather of a fixed-size float64 row per rank).

    ``local_error`` is this rank's validation error, if any: it is raised here, after the
    exchange, so that peers learn of it and raise too (a :class:`RankDisagreement` naming the
    failing ranks) instead of waiting for a collective this rank will never enter.
    """
    if len(values) > _HEADER_SLOTS - 2:
        raise ValueError(f"exchange takes at most {_HEADER_SLOTS - 2} values, got {len(values)}")
    row = torch.zeros(_HEADER_SLOTS, dtype=torch.float64)
    row[_ERROR_SLOT] = 1.0 if local_error is not None else 0.0
    row[_COUNT_SLOT] = len(values)
    row[2 : 2 + len(values)] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    row = row.to(device)
    rows = [torch.empty_like(row) for _ in range(group_size(group))]
    dist.all_gather(rows, row, group=group)
    gathered = [r.cpu().tolist() for r in rows]
    if local_error is not None:
        raise local_error
    failed = [rank for rank, r in enumerate(gathered) if r[_ERROR_SLOT]]
    if failed:
        raise RankDisagreement(
            f"{what}: rank(s) {failed} rejected their inputs (see their error messages); "
            "every rank stops here instead of waiting for them"
        )
    return [r[2 : 2 + int(r[_COUNT_SLOT])] for r in gathered]


def require_equal(
    rows: list[list[float]], names: Sequence[str], *, what: str, tolerance: float = 0.0
) -> None:
    """RankDisagreement (on every rank, as all hold the same ``rows``) unless every rank's
    values equal rank 0's; ``names`` label the values in the message."""
    reference = rows[0]
    for rank, row in enumerate(rows[1:], start=1):
        if len(row) != len(reference):
            raise RankDisagreement(
                f"{what}: rank {rank} sent {len(row)} values, rank 0 {len(reference)}; the "
                "ranks are running different calls"
            )
        for name, mine, theirs in zip(names, reference, row):
            if not _close(mine, theirs, tolerance):
                raise RankDisagreement(
                    f"{what}: ranks disagree on {name}: rank 0 has {_fmt(mine)}, rank {rank} "
                    f"has {_fmt(theirs)}"
                )


def _close(a: float, b: float, tolerance: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= tolerance * max(abs(a), abs(b), 1.0)


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


_probes: dict[tuple[int, str], Tensor] = {}


def fingerprint(tensor: Tensor) -> tuple[float, float, float]:
    """(norm, probe 1, probe 2) of a tensor in float64: two projections on fixed deterministic
    vectors. Equal tensors give equal values; tensors that are not close give different ones
    (relative to the norm) with overwhelming probability, while rounding differences between
    machines stay within a small tolerance, which exact hashes would not allow."""
    flat = torch.nan_to_num(tensor.detach().reshape(-1).to(torch.float64))
    key = (flat.numel(), str(flat.device))
    probe = _probes.get(key)
    if probe is None:
        index = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device)
        probe = torch.stack(
            [torch.cos(0.7548776662 * index + 0.3), torch.sin(0.5698402910 * index)]
        )
        if len(_probes) > 64:  # a few shapes per pipeline: keep the cache small
            _probes.clear()
        _probes[key] = probe
    projections = probe @ flat
    return float(flat.norm()), float(projections[0]), float(projections[1])


# --------------------------------------------------------------------------- accounting
def count_bytes(kind: str, tensor_or_bytes: Union[Tensor, int]) -> None:
    """Add bytes this rank sends for ``kind`` ("ring", "ulysses", "cfg", "gather") to the
    counters the bench reads."""
    if isinstance(tensor_or_bytes, Tensor):
        tensor_or_bytes = tensor_or_bytes.numel() * tensor_or_bytes.element_size()
    _bytes_sent[kind] += int(tensor_or_bytes)


def comm_stats() -> dict[str, int]:
    """Bytes this rank has sent through npu_attn.parallel's collectives, per kind, since the
    last :func:`reset_comm_stats` (agreement headers are not counted: 256 bytes per call)."""
    return dict(_bytes_sent)


def reset_comm_stats() -> None:
    _bytes_sent.clear()
