"""Ring attention: exact attention over a sequence sharded across ranks, with npu_attn's kernel.

Each rank keeps its query shard and passes key/value shards around the ring (rank r sends to
r + 1 and receives from r - 1, ``torch.distributed`` point-to-point ``isend`` / ``irecv``, which
gloo supports); after ``world`` steps every query has met every key. Each step runs npu_attn's
tiled kernel on one (query shard, key shard) pair, which returns the partial output *and its
log-sum-exp*; the partials merge exactly (in float32)::

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

This is the piece torch's CPU SDPA cannot provide (it returns no log-sum-exp), which is why
diffusers' ring attention does not run on CPU.

Backward (:class:`_RingAttention`, an explicit ``autograd.Function``): the saved global output
and log-sum-exp make each block's gradient independent (FlashAttention-2's identities:
P = exp(S - lse_global), dS = P * (dP - rowsum(dO * O_global)) - the gradient of the returned
lse enters as ``grad_lse``); key/value shards go around the ring again, each with its dK/dV
accumulator (float32), which arrives back at its owner after the last step. npu_attn's C++
backward kernel computes every block.

Communication per call and rank: (world - 1) key/value shards forward; in backward (world - 1)
key/value shards plus ``world`` float32 dK/dV accumulators. Transfers overlap the kernel (the
next shard is in flight while the current one is computed).

Causal attention (``is_causal``, positions in rank order): blocks from later ranks are skipped,
the diagonal block is causal, earlier blocks are full. Work is then unbalanced (rank 0 does one
block, the last rank all of them); diffusion models do not use causal attention.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..attention import ops
from ..attention.functional import nonnegative_scale
from .group import count_bytes
from .layout import Layout, agree, as_4d_mask, key_columns

__all__ = ["ring_attention"]

RING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CPU_ONLY = (
    "ring_attention runs on CPU tensors (npu_attn's kernel returns the log-sum-exp the ring "
    "merge needs); use ulysses_attention on other devices"
)
_KV_TAG, _GRAD_TAG = 0, 1  # point-to-point tags: key/value shards, dK/dV accumulators


# --------------------------------------------------------------------------- transport
def _shift(send: Tensor, recv_numel: int, layout: Layout, tag: int) -> Callable[[], Tensor]:
    """Send ``send`` to the next rank and receive ``recv_numel`` elements from the previous one
    (asynchronously); returns the function that waits and gives the received tensor. Both
    directions are bounded by the process group's timeout."""
    recv = send.new_empty(recv_numel)
    nxt, prev = (layout.rank + 1) % layout.world, (layout.rank - 1) % layout.world
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send, group=layout.group, tag=tag, group_peer=nxt),
            dist.P2POp(dist.irecv, recv, group=layout.group, tag=tag, group_peer=prev),
        ]
    )
    count_bytes("ring", send)

    def wait() -> Tensor:
        for work in works:
            work.wait()
        return recv

    return wait


def _pack(*tensors: Tensor) -> Tensor:
    """One flat buffer (one message instead of one per tensor)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: Tensor, shapes: list[tuple[int, ...]]) -> list[Tensor]:
    """Views of ``flat`` with ``shapes``, in order (the inverse of :func:`_pack`)."""
    parts, start = [], 0
    for shape in shapes:
        count = math.prod(shape)
        parts.append(flat[start : start + count].view(shape))
        start += count
    return parts


def _kv_shapes(key: Tensor, value: Tensor, length: int) -> list[tuple[int, ...]]:
    """Shapes of a key and a value shard of ``length`` tokens."""
    b, h, _, d = key.shape
    return [(b, h, length, d), (b, h, length, value.shape[-1])]


def _block_of(layout: Layout, step: int) -> int:
    """The rank whose key/value shard this rank holds at ``step``."""
    return (layout.rank - step) % layout.world


def _block_causal(layout: Layout, block: int) -> Optional[bool]:
    """The kernel's ``is_causal`` for this block, or None when the block is skipped (causal
    attention to keys that all come later)."""
    if not layout.is_causal:
        return False
    if block > layout.rank:
        return None
    return block == layout.rank


# --------------------------------------------------------------------------- forward
def _merge(acc: Optional[tuple[Tensor, Tensor, Tensor]], out: Tensor, shift: Tensor, rel: Tensor):
    """Fold one block's (out, lse = shift + rel) into the running float32 (out, shift, rel).

    The lse travels split (ops.split_lse): a row a torch.finfo(float32).min mask hides in a
    block has lse = -FLT_MAX + log(its key count), which float32 rounds to -FLT_MAX, so merging
    lse alone would weigh every such block 1 and sum their outputs; shift (the row's largest
    score) and rel (log of its sum below that) keep the counts. Rows with no key yet (rel -inf)
    take no part in the shift and stay 0 with rel -inf, as the kernel returns them."""
    if acc is None:
        return out.float(), shift, rel
    acc_out, acc_shift, acc_rel = acc
    empty, acc_empty = torch.isneginf(rel), torch.isneginf(acc_rel)
    top = torch.where(
        acc_empty, shift, torch.where(empty, acc_shift, torch.maximum(acc_shift, shift))
    )
    acc_rel = acc_rel + (acc_shift - top)  # both relative to `top` now
    rel = rel + (shift - top)
    new_rel = torch.logaddexp(acc_rel, rel)
    safe = new_rel.masked_fill(torch.isneginf(new_rel), 0.0)
    acc_out = acc_out * torch.exp(acc_rel - safe).unsqueeze(-1)
    acc_out += out.float() * torch.exp(rel - safe).unsqueeze(-1)
    return acc_out, top, new_rel


def _pass_on(
    tensors: tuple[Tensor, ...], shapes: list[tuple[int, ...]], layout: Layout, tag: int
) -> Callable[[], list[Tensor]]:
    """Start sending ``tensors`` to the next rank (one message) and receiving tensors of
    ``shapes`` from the previous one; the returned function waits and gives them."""
    wait = _shift(_pack(*tensors), sum(math.prod(s) for s in shapes), layout, tag)
    return lambda: _unpack(wait(), shapes)


def _next_shapes(key: Tensor, value: Tensor, layout: Layout, step: int):
    """Shapes of the key/value shard this rank holds at ``step + 1``."""
    return _kv_shapes(key, value, layout.k_sizes[_block_of(layout, step + 1)])


def _ring_forward(query, key, value, mask, layout: Layout) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's (float32 out, float32 shift, float32 rel), lse = shift + rel
    (ops.split_lse): its query shard against every key/value shard."""
    acc = None
    k_cur, v_cur = key, value
    for step in range(layout.world):
        block = _block_of(layout, step)
        receive = None  # the next shard travels while this one is computed
        if step < layout.world - 1:
            shapes = _next_shapes(key, value, layout, step)
            receive = _pass_on((k_cur, v_cur), shapes, layout, _KV_TAG)
        causal = _block_causal(layout, block)
        if causal is not None:
            block_mask = key_columns(mask, layout, block)
            flags = (causal, layout.scale, layout.enable_gqa)
            # 16-bit blocks in float32: the merge is float32, and so is the output the
            # backward reads (ops.training_out_dtype)
            out32 = ops.training_out_dtype(query)
            out, lse = ops.forward_cpu(query, k_cur, v_cur, block_mask, *flags, out_dtype=out32)
            acc = _merge(acc, out, *ops.split_lse(query, k_cur, block_mask, lse, *flags))
        if receive is not None:
            k_cur, v_cur = receive()
    return acc  # block `rank` is never skipped, so acc is set


def _ring_backward(ctx, grad_out: Tensor, grad_lse: Optional[Tensor]):
    """(dQ, dK, dV) of this rank's shards: each block's gradient from the saved global output
    and lse; dK/dV accumulate in float32 while travelling with their shard."""
    query, key, value, mask, out, shift, rel = ctx.saved_tensors
    layout: Layout = ctx.layout
    # Rows with a shift (ops.split_lse) are left out of the kernel, whose exp(S - lse) cannot
    # recover them, and get exact gradients from the torch-ops backward on their positions.
    huge = shift != 0
    any_huge = bool(huge.any())
    kernel_lse = (shift + rel).masked_fill(huge, -math.inf)
    grad_q = torch.zeros(query.shape, dtype=torch.float32)
    k_cur, v_cur = key, value
    # The dK/dV accumulators travel with their key/value shard and reach its owner at the end.
    acc_k = torch.zeros(key.shape, dtype=torch.float32)
    acc_v = torch.zeros(value.shape, dtype=torch.float32)
    for step in range(layout.world):
        block = _block_of(layout, step)
        shapes = _next_shapes(key, value, layout, step)  # after the last step: this rank's own
        receive = None
        if step < layout.world - 1:
            receive = _pass_on((k_cur, v_cur), shapes, layout, _KV_TAG)
        causal = _block_causal(layout, block)
        if causal is not None:
            block_mask = key_columns(mask, layout, block)
            # lse covers the rows' keys in every shard, so exp(S - lse) is this block's P
            tensors = (grad_out, query, k_cur, v_cur, block_mask, out)
            flags = (causal, layout.scale, layout.enable_gqa, grad_lse)
            grads = ops.kernel_backward(*tensors, kernel_lse, *flags)
            if any_huge:
                grads = ops.add_huge_rows(grads, huge, *tensors, rel, *flags, lse_shift=shift)
            dq, dk, dv = grads
            grad_q += dq
            acc_k += dk
            acc_v += dv
        if layout.world == 1:  # nothing to pass on (and no sending to oneself)
            break
        receive_grads = _pass_on((acc_k, acc_v), shapes, layout, _GRAD_TAG)
        if receive is not None:
            k_cur, v_cur = receive()
        acc_k, acc_v = receive_grads()
    return grad_q.to(query.dtype), acc_k.to(key.dtype), acc_v.to(value.dtype)


class _RingAttention(torch.autograd.Function):
    """(out, lse) of ring attention; backward runs the ring again with the C++ backward."""

    @staticmethod
    def forward(ctx, query, key, value, mask, layout):
        out, shift, rel = _ring_forward(query, key, value, mask, layout)
        # the float32 merge for the backward's Delta = rowsum(dO * O) (ops.training_out_dtype)
        ctx.save_for_backward(query, key, value, mask, out, shift, rel)
        ctx.layout = layout
        ctx.set_materialize_grads(False)
        return out.to(query.dtype), shift + rel

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if grad_out is None and grad_lse is None:
            return None, None, None, None, None
        if grad_out is None:
            grad_out = torch.zeros_like(ctx.saved_tensors[4])
        grads = _ring_backward(ctx, grad_out, grad_lse)
        return (*grads, None, None)


# --------------------------------------------------------------------------- public
def ring_attention(
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
    return_lse: bool = False,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Called on every rank of ``group`` (default: the whole world) with that rank's shard, in
    torch SDPA's layout: ``query`` (B, Hq, Lq_r, D), ``key`` (B, Hkv, Lk_r, D), ``value``
    (B, Hkv, Lk_r, Dv), rank r holding the r-th contiguous piece of the sequence. Shards may
    differ in length between ranks (at least one token each). Returns this rank's output
    (B, Hq, Lq_r, Dv) - its rows of the full attention - and with ``return_lse`` also the
    float32 log-sum-exp (B, Hq, Lq_r). Differentiable in query, key and value (and through
    the returned lse).

    Args:
        attn_mask: bool (True = attend) or float (added), broadcastable to (B, Hq, Lq_r, L_k)
            where L_k is the *full* key length (keys in rank order) or 1; each block uses its
            columns. A key-padding mask (B, 1, 1, L_k) is the usual case.
        dropout_p: must be 0.0.
        is_causal: top-left causal over the full sequence (needs query and key shards of
            equal lengths on every rank).
        scale, enable_gqa: as torch's SDPA.
        group: the process group; its ranks' order is the sequence order.

    Runs on CPU tensors in float32, bfloat16 or float16 (npu_attn's kernel, whose log-sum-exp
    the merge needs). Every rank validates its shard, then all agree on the shapes in one
    small ``all_gather`` before any data moves: bad input raises ``TypeError`` /
    ``ValueError`` on its rank and :class:`~npu_attn.parallel.RankDisagreement` on the
    others, never a hang.
    """
    query, scale = nonnegative_scale(query, scale)  # the kernel takes scale >= 0
    layout = agree(
        "ring_attention",
        query,
        key,
        value,
        attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        dropout_p=dropout_p,
        group=group,
        dtypes=RING_DTYPES,
        cpu_only=CPU_ONLY,
    )
    out, lse = _RingAttention.apply(query, key, value, as_4d_mask(attn_mask), layout)
    return (out, lse) if return_lse else out
