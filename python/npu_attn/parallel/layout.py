"""The shared front half of ring and Ulysses attention: validate one rank's shard, agree with
the other ranks on everything that must match, and learn every rank's sequence length.

Each rank holds a contiguous shard of the query sequence and of the key/value sequence, in rank
order (rank 0 the first tokens). Shards may differ in length (diffusers' ``tensor_split``
sharding gives the first ``L % world`` ranks one token more), so the lengths are exchanged on
every call, in the same ``all_gather`` that checks the ranks agree (see :mod:`._group`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .group import exchange, group_rank, group_size, require_equal

_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
_MASK_CODES = {None: 0, torch.bool: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}

# The header each rank sends: values that must agree across ranks come first, the per-rank
# sequence lengths (and the mask's query-rows flag, which is per rank) after them.
_SHARED = (
    "batch",
    "query heads",
    "key/value heads",
    "head dim",
    "value head dim",
    "dtype",
    "is_causal",
    "enable_gqa",
    "scale",
    "attn_mask dtype",
    "attn_mask batch",
    "attn_mask heads",
    "attn_mask rows (1 or the local query length)",
    "attn_mask key length",
)
_Q_LEN, _K_LEN = len(_SHARED), len(_SHARED) + 1


@dataclass(frozen=True)
class Layout:
    """What every rank agreed on for one call, and every rank's shard lengths."""

    group: Optional[dist.ProcessGroup]
    rank: int
    world: int
    q_sizes: tuple[int, ...]
    k_sizes: tuple[int, ...]
    scale: float
    is_causal: bool
    enable_gqa: bool

    @property
    def k_offsets(self) -> tuple[int, ...]:
        """Where each rank's key shard starts in the full key sequence."""
        offsets, total = [], 0
        for size in self.k_sizes:
            offsets.append(total)
            total += size
        return tuple(offsets)

    @property
    def q_offsets(self) -> tuple[int, ...]:
        offsets, total = [], 0
        for size in self.q_sizes:
            offsets.append(total)
            total += size
        return tuple(offsets)


def as_4d_mask(attn_mask: Optional[Tensor]) -> Optional[Tensor]:
    """A 2-D to 4-D mask as a 4-D view (leading 1s), as torch's SDPA broadcasts it."""
    if attn_mask is None:
        return None
    return attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))


def _check_local(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    enable_gqa: bool,
    dropout_p: float,
    dtypes: tuple[torch.dtype, ...],
    cpu_only: str,
) -> None:
    """This rank's inputs on their own: the errors name the argument and what was expected
    (``cpu_only``: the reason CPU tensors are required, or "" when any device works)."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, local sequence, head dim), "
                f"got shape {tuple(tensor.shape)}"
            )
        if tensor.dtype != query.dtype or tensor.device != query.device:
            raise TypeError(
                f"{name} must have query's dtype and device ({query.dtype}, {query.device}), "
                f"got {tensor.dtype}, {tensor.device}"
            )
    if cpu_only and query.device.type != "cpu":
        raise ValueError(f"query is on {query.device}: {cpu_only}")
    if query.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"query dtype {query.dtype} is not supported here (supports {names})")
    (b, hq, lq, d), (bk, hk, lk, dk), (bv, hv, lv, _) = query.shape, key.shape, value.shape
    if not b == bk == bv or hk != hv or lk != lv or dk != d:
        raise ValueError(
            "query (B, Hq, Lq, D), key (B, Hkv, Lk, D) and value (B, Hkv, Lk, Dv) do not fit: "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if hq != hk and not (enable_gqa and hk > 0 and hq % hk == 0):
        raise ValueError(
            f"query has {hq} heads and key/value {hk}: pass enable_gqa=True for grouped-query "
            "attention (query heads a multiple of key/value heads)"
        )
    if min(lq, lk) < 1:
        raise ValueError(f"every rank needs at least one token, got Lq={lq}, Lk={lk}")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0 (inference attention), got {dropout_p}")
    if attn_mask is not None:
        _check_mask(attn_mask, query)


def _check_mask(attn_mask: Tensor, query: Tensor) -> None:
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask)}")
    if not 2 <= attn_mask.dim() <= 4:
        raise ValueError(f"attn_mask must have 2 to 4 dims, got shape {tuple(attn_mask.shape)}")
    if attn_mask.dtype not in _MASK_CODES:
        raise TypeError(f"attn_mask must be bool or float, got {attn_mask.dtype}")
    if attn_mask.requires_grad:
        raise ValueError(
            "attn_mask requires grad: sequence-parallel attention does not compute the mask's "
            "gradient (detach it)"
        )
    b, h, lq, _ = query.shape
    mb, mh, mq, _ = as_4d_mask(attn_mask).shape
    if mb not in (1, b) or mh not in (1, h) or mq not in (1, lq):
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} must broadcast to (batch, heads, "
            f"local query length, full key length) = ({b}, {h}, {lq}, L_k of all ranks)"
        )


def _header(query, key, value, attn_mask, is_causal, scale, enable_gqa) -> list[float]:
    mask = as_4d_mask(attn_mask)
    mask_shape = [0.0, 0.0, 0.0, 0.0] if mask is None else list(mask.shape)
    if mask is not None:  # rows: 1 (broadcast) or this rank's own query length -> flag
        mask_shape[2] = 1.0 if mask.shape[2] == 1 else 2.0
    return [
        query.shape[0],
        query.shape[1],
        key.shape[1],
        query.shape[3],
        value.shape[3],
        _DTYPE_CODES.get(query.dtype, 0),
        float(bool(is_causal)),
        float(bool(enable_gqa)),
        -1.0 if scale is None else float(scale),
        _MASK_CODES[None if mask is None else mask.dtype],
        *mask_shape,
        query.shape[2],
        key.shape[2],
    ]


def agree(
    what: str,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    *,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    dropout_p: float,
    group: Optional[dist.ProcessGroup],
    dtypes: tuple[torch.dtype, ...],
    cpu_only: str = "",
    full_key_mask: bool = True,
) -> Layout:
    """Validate this rank's shard, exchange headers and return the agreed :class:`Layout`.

    ``full_key_mask``: a mask's key dim must be 1 or this group's full key length (False
    when the keys are shards of a longer sequence, for an inner attention to check).

    Raises (on every rank, never leaving one waiting):
        TypeError, ValueError: this rank's inputs are invalid (on that rank), or the shards
            together are (a mask or causal flag that does not fit the full sequence);
        RankDisagreement: another rank's inputs are invalid, or the ranks disagree.
    """
    error: Optional[BaseException] = None
    try:
        _check_local(query, key, value, attn_mask, enable_gqa, dropout_p, dtypes, cpu_only)
        header = _header(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    except (TypeError, ValueError) as caught:
        error, header = caught, []
    device = query.device if isinstance(query, Tensor) else "cpu"
    rows = exchange(
        header, group, what=what, device=_exchange_device(group, device), local_error=error
    )
    require_equal([r[: len(_SHARED)] for r in rows], _SHARED, what=what)
    q_sizes = tuple(int(r[_Q_LEN]) for r in rows)
    k_sizes = tuple(int(r[_K_LEN]) for r in rows)
    mask_keys = rows[0][len(_SHARED) - 1]
    # The checks below read the gathered values, so every rank takes the same decision.
    if full_key_mask and attn_mask is not None and mask_keys not in (1, sum(k_sizes)):
        raise ValueError(
            f"{what}: attn_mask's last dim is {int(mask_keys)}; it must be 1 or the full key "
            f"length over all ranks ({sum(k_sizes)} = {' + '.join(map(str, k_sizes))}), keys in "
            "rank order"
        )
    if is_causal and q_sizes != k_sizes:
        raise ValueError(
            f"{what}: is_causal needs each rank's query and key shards to cover the same "
            f"positions; query lengths {q_sizes}, key lengths {k_sizes}"
        )
    resolved = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return Layout(
        group,
        group_rank(group),
        group_size(group),
        q_sizes,
        k_sizes,
        resolved,
        is_causal,
        enable_gqa,
    )


def _exchange_device(group: Optional[dist.ProcessGroup], device: torch.device) -> torch.device:
    """Where the header tensor must live for this group's backend: CPU when the group has a
    CPU backend (gloo), else the data's device (nccl / hccl only)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or torch.device(device).type == "cpu":
        return torch.device("cpu")
    return torch.device(device)


def key_columns(mask: Optional[Tensor], layout: Layout, block: int) -> Optional[Tensor]:
    """The columns of a full-key-length mask that belong to rank ``block``'s key shard (a mask
    broadcast over keys is returned as it is)."""
    if mask is None or mask.shape[-1] == 1:
        return mask
    start = layout.k_offsets[block]
    return mask[..., start : start + layout.k_sizes[block]]
