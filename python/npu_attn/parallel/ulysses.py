"""Ulysses attention (DeepSpeed-Ulysses): swap sequence sharding for head sharding, attend
over the whole sequence locally, swap back.

Each rank holds a sequence shard of every head. One ``all_to_all`` per tensor (gloo supports
``all_to_all_single``, with per-rank split sizes, so uneven shards need no padding) gives rank r
the *whole* sequence of heads [r H / world, (r + 1) H / world); it runs ordinary attention on
them (npu_attn's kernel on CPU, differentiable through its C++ backward; the registered backend
for other devices), and a last ``all_to_all`` returns each rank its own tokens of every head.
The all-to-alls are autograd functions whose backward is the opposite all-to-all, so gradients
flow to query, key and value.

Query and key/value heads must both divide by the world size. Masks are simple here, since
every rank sees the full sequence: rows of a per-rank mask are gathered, and a per-head mask
keeps its local heads.

Communication per call and rank: four all-to-alls (query, key, value, output) of which
(world - 1) / world of each local tensor leaves the rank; backward the same four in reverse.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..attention.functional import scaled_dot_product_attention as _sdpa
from .group import count_bytes
from .layout import Layout, agree, as_4d_mask

__all__ = ["ulysses_attention"]

ULYSSES_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- all-to-all
def _seq_to_heads(x: Tensor, sizes: tuple[int, ...], layout: Layout) -> Tensor:
    """(B, H, s_r, D) with this rank's tokens of every head -> (B, H / world, sum(s), D) with
    every token of this rank's heads."""
    b, h, s, d = x.shape
    w = layout.world
    send = x.reshape(b, w, h // w, s, d).transpose(0, 1).contiguous().reshape(-1)
    part = b * (h // w) * d
    recv = x.new_empty(part * sum(sizes))
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=[part * size for size in sizes],
        input_split_sizes=[part * s] * w,
        group=layout.group,
    )
    count_bytes("ulysses", send.numel() * send.element_size() * (w - 1) // w)
    chunks = recv.split([part * size for size in sizes])
    return torch.cat([c.view(b, h // w, size, d) for c, size in zip(chunks, sizes)], dim=2)


def _heads_to_seq(x: Tensor, sizes: tuple[int, ...], layout: Layout) -> Tensor:
    """The inverse of :func:`_seq_to_heads`: (B, H / world, sum(s), D) -> (B, H, s_r, D)."""
    b, hl, _, d = x.shape
    w, mine = layout.world, sizes[layout.rank]
    send = torch.cat([c.reshape(-1) for c in x.split(list(sizes), dim=2)])
    part = b * hl * d
    recv = x.new_empty(w * part * mine)
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=[part * mine] * w,
        input_split_sizes=[part * size for size in sizes],
        group=layout.group,
    )
    count_bytes("ulysses", (send.numel() - part * mine) * send.element_size())
    return recv.view(w, b, hl, mine, d).transpose(0, 1).reshape(b, w * hl, mine, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, layout):
        ctx.sizes, ctx.layout = sizes, layout
        return _seq_to_heads(x, sizes, layout)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.sizes, ctx.layout), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, layout):
        ctx.sizes, ctx.layout = sizes, layout
        return _heads_to_seq(x, sizes, layout)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.sizes, ctx.layout), None, None


# --------------------------------------------------------------------------- masks
def _gather_rows(mask: Tensor, layout: Layout) -> Tensor:
    """A mask whose rows are this rank's queries -> the rows of every rank's queries (one
    all_gather; shards of different lengths are padded for it and trimmed after)."""
    longest = max(layout.q_sizes)
    is_bool = mask.dtype == torch.bool
    data = mask.to(torch.uint8) if is_bool else mask  # gloo reduces no bools; uint8 is exact
    pad = longest - data.shape[2]
    if pad:
        data = torch.cat([data, data.new_zeros(*data.shape[:2], pad, data.shape[3])], dim=2)
    parts = [torch.empty_like(data) for _ in range(layout.world)]
    dist.all_gather(parts, data.contiguous(), group=layout.group)
    count_bytes("ulysses", data.numel() * data.element_size() * (layout.world - 1))
    rows = torch.cat([p[:, :, :size] for p, size in zip(parts, layout.q_sizes)], dim=2)
    return rows.bool() if is_bool else rows


def _local_mask(mask: Optional[Tensor], layout: Layout, heads: int) -> Optional[Tensor]:
    """The mask for this rank's heads and every query row."""
    if mask is None:
        return None
    if mask.shape[2] != 1:
        mask = _gather_rows(mask, layout)
    if mask.shape[1] != 1:
        per_rank = heads // layout.world
        mask = mask[:, layout.rank * per_rank : (layout.rank + 1) * per_rank]
    return mask


# --------------------------------------------------------------------------- public
def _check_heads(layout: Layout, heads: int, kv_heads: int) -> None:
    """Heads must split evenly (the same decision on every rank: the heads agreed)."""
    if heads % layout.world or kv_heads % layout.world:
        raise ValueError(
            f"ulysses_attention shards heads: query heads ({heads}) and key/value heads "
            f"({kv_heads}) must both be divisible by the world size ({layout.world}); use "
            "ring_attention for this model, or a world size dividing the heads"
        )


def ulysses_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    group: Optional[dist.ProcessGroup] = None,
    attend: Optional[Callable[..., Tensor]] = None,
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``, by all-to-all.

    Same contract as :func:`~npu_attn.parallel.ring_attention` (every rank calls it with its
    contiguous shard in (B, H, L_r, D) layout and gets its rows of the output; shards may
    differ in length; differentiable), plus: query heads and key/value heads must be
    divisible by the group's size. ``attn_mask``: broadcastable to (B, Hq, Lq_r, L_k) with
    L_k the full key length or 1; ``is_causal`` is top-left over the full sequence.

    CPU tensors (float32, bfloat16, float16) attend with npu_attn's kernel; tensors on other
    devices with the backend :func:`npu_attn.scaled_dot_product_attention` selects there.
    ``attend`` replaces that local attention: a function with torch SDPA's signature called
    on the full sequence of this rank's heads, e.g. ``functools.partial(ring_attention,
    group=ring_group)`` for unified (Ulysses inside, ring across) sequence parallelism.
    """
    layout = agree(
        "ulysses_attention",
        query,
        key,
        value,
        attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        dropout_p=dropout_p,
        group=group,
        dtypes=ULYSSES_DTYPES,
        full_key_mask=attend is None,  # an inner ring checks it against the whole world
    )
    heads = query.shape[1]
    _check_heads(layout, heads, key.shape[1])
    mask = _local_mask(as_4d_mask(attn_mask), layout, heads)
    q = _SeqToHeads.apply(query, layout.q_sizes, layout)
    k = _SeqToHeads.apply(key, layout.k_sizes, layout)
    v = _SeqToHeads.apply(value, layout.k_sizes, layout)
    if attend is None:
        attend = functools.partial(_sdpa, backend="tiled" if query.device.type == "cpu" else None)
    out = attend(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=layout.scale, enable_gqa=enable_gqa
    )
    return _HeadsToSeq.apply(out, layout.q_sizes, layout)
