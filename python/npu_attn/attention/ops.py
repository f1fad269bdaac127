"""npu_attn's kernels as real torch ops: ``torch.ops.npu_attn.sdpa_forward`` and
``torch.ops.npu_attn.sdpa_backward``.

Both are registered with ``torch.library.custom_op`` + ``register_fake`` so that
``torch.compile`` (fullgraph, forward and backward) treats each as one opaque node; the forward's
``register_autograd`` formula calls the backward op, so gradients flow in compiled code. Eager
autograd takes ``_EagerAttention``, an ``autograd.Function`` with the same kernels and the same
gradient rule (``_gradients``) but without the op's dispatch, which costs more than a small
call's kernels.

Backward (FlashAttention-2's algorithm, never materialising Lq x Lk): the forward saves the
per-row log-sum-exp, and ``backward_cpu`` runs the C++ tiled backward kernel
(csrc/kernels/attention_backward_impl.h), which recomputes P = exp(S - lse) one
(query tile x key tile) at a time and accumulates dQ, dK, dV in float32 with the forward's masks,
causal flag, scale and GQA grouping. Rows whose lse is too large for that (a whole row hidden
by a torch.finfo(float32).min mask) get exact gradients from ``attention_backward`` instead.
A 16-bit forward whose gradients will follow writes its output in float32 and keeps it for
the backward's Delta = rowsum(dO * O) (``training_out_dtype``, ``forward_with_grad``).

``attention_backward`` is the same algorithm written with torch ops over query blocks. It is used
where the kernel has no path: the gradient of a float ``attn_mask`` that requires grad (the
kernel does not produce d(mask)) and higher-order gradients (below). It also computes in
float64 when given float64, which the tests use for gradcheck; both are checked against torch's
math backend in float64.

Higher-order gradients (``create_graph=True``, e.g. gradient penalties): the kernel's gradients
carry no graph, so when grad mode is on during backward and anything there requires grad, the
backward runs ``attention_backward`` instead. It is written with differentiable torch ops over
the saved inputs, output and log-sum-exp (whose own gradients lead back into this op), so
autograd differentiates the backward itself. That path keeps each query block's probabilities
for the graph: memory is O(Lq x Lk) per call, as with torch's math backend.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.utils.dlpack import to_dlpack

from ..runtime import controls as _runtime
from ..runtime import counts, variant_choice
from ..runtime.extension import _C

_BLOCK_BYTES = 64 << 20
# Rows whose log-sum-exp is beyond this magnitude: there float32 cannot hold log(row sum) beside
# the row maximum (at torch.finfo(float32).min, a mask hiding a whole row, the sum is lost
# entirely), so exp(S - lse) does not give the row's probabilities back. The kernels' forward
# shifts such rows exactly from the same limit (kFusedShiftLimit, attention_forward_impl.h).
_HUGE_LSE = 2.0**20
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _kernel_mask(attn_mask):
    """The mask as the kernel takes it: bool, or float32 (another float mask is converted;
    masks are usually broadcast (B, 1, 1, Lk) or (Lq, Lk), so this copy is small). An integer
    mask is refused, as torch's SDPA refuses it: read as additive, a 0/1 keep-mask would hide
    nothing."""
    if attn_mask is None or attn_mask.dtype in (torch.bool, torch.float32):
        return attn_mask
    if not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    return attn_mask.float()


def _check_op_inputs(query, key, value):
    """The ops take the kernel's 4-D problem (the public function flattens other ranks); the
    C++ binding validates the rest of the call."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(
                f"torch.ops.npu_attn ops take 4-D (batch, heads, seq_len, head_dim) tensors; "
                f"{name} has shape {tuple(t.shape)} (npu_attn.scaled_dot_product_attention "
                "takes any rank)"
            )


def _choose_variant(dtype: torch.dtype, backward: bool = False) -> None:
    """The kernel variant for ``dtype`` (with ``backward``, also its backward's) is measured
    once per machine, before its first call (other dtypes are left to the C++ validation, which
    names what it expects)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is not None:
        variant_choice.ensure(name, backward=backward)


def recorded() -> bool:
    """True when something records the torch ops that run: ``torch.compile`` / ``export``,
    ``make_fx``, any ``TorchDispatchMode`` (``FakeTensorMode``, ``FlopCounterMode``) or
    ``torch.jit.trace``. The kernel must then run as the registered op, which they see (and
    which has a fake for tensors without data); called directly it reads memory through DLPack,
    which they do not see, and a recorded graph would return whatever the trace's output held."""
    return (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._get_tracing_state() is not None
    )


def needs_op(*tensors) -> bool:
    """True where a call on ``tensors`` must run the kernel as the registered op rather than
    directly: when :func:`recorded`, under a ``torch.func`` transform (which handles the op,
    not an ``autograd.Function`` written the classic way), and for inputs of a ``Tensor``
    subclass (``__torch_dispatch__`` wrappers such as DTensor see the op and unwrap; DLPack
    would read the wrapper, which holds no data)."""
    if recorded() or torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    return any(t is not None and type(t) is not Tensor for t in tensors)


def _empty_output(query: Tensor, head_dim_v: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The (B, Hq, Lq, Dv) output, laid out like the query (as torch's CPU flash kernel does):
    (B, L, H, D) storage when the query's heads are inside its sequence (diffusers' projections
    viewed as heads, so ``out.transpose(1, 2).reshape(B, L, H * Dv)`` is free), else contiguous
    (what torch returns for such a call, so the caller needs no copy).

    One ``empty_strided`` call: ``new_empty(...).transpose(1, 2)`` costs ~3 us more, which
    SD-1.5's 64-token level (a ~70 us call) notices."""
    b, hq, lq, _ = query.shape
    dv = head_dim_v
    if query.stride(1) < query.stride(2):
        strides = (lq * hq * dv, dv, hq * dv, 1)
    else:
        strides = (hq * lq * dv, lq * dv, dv, 1)
    dtype = query.dtype if dtype is None else dtype
    return torch.empty_strided((b, hq, lq, dv), strides, dtype=dtype, device=query.device)


def _readable(tensor: Tensor):
    """A DLPack capsule the kernel reads. DLPack refuses tensors that require grad, so those
    are detached first; the others are exported as they are (a detach costs ~1.5 us a tensor
    with its release, a third of a short call's Python cost)."""
    return to_dlpack(tensor.detach() if tensor.requires_grad else tensor)


def forward_cpu(
    query,
    key,
    value,
    attn_mask,
    is_causal,
    scale,
    enable_gqa,
    with_lse=True,
    counted_as="tiled",
    out_dtype=None,
):
    """(out, lse) from the C++ kernel. float32, bfloat16 and float16 tensors are read and
    written in place by the kernel, which computes in float32 (lse is always float32).
    ``with_lse=False`` (callers that drop it) gives (out, None); ``counted_as`` names the call
    in call_counts(); ``out_dtype``: the output's dtype, the inputs' (None) or float32."""
    attn_mask = _kernel_mask(attn_mask)
    b, hq, lq, _ = query.shape
    out = _empty_output(query, value.shape[-1], out_dtype)
    lse = torch.empty((b, hq, lq), dtype=torch.float32) if with_lse else None
    # torch.utils.dlpack.to_dlpack is the direct C export (Tensor.__dlpack__ adds ~5 us of
    # Python per tensor); the kernel only reads the inputs.
    _choose_variant(query.dtype)
    counts.count(counted_as)  # here, where the kernel runs: counted in compiled graphs too
    # Positional: pybind11 matches keywords by name at ~1 us a call. The order is
    # (query, key, value, out, attn_mask, lse, scale, is_causal, enable_gqa, num_threads).
    _C.forward(
        _readable(query),
        _readable(key),
        _readable(value),
        to_dlpack(out),
        None if attn_mask is None else _readable(attn_mask),
        None if lse is None else to_dlpack(lse),
        scale,
        is_causal,
        enable_gqa,
        _runtime.get_num_threads(),
    )
    return out, lse


@torch.library.custom_op("npu_attn::sdpa_forward", mutates_args=(), device_types="cpu")
def sdpa_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor]:
    """Attention output (B, Hq, Lq, Dv) and log-sum-exp (B, Hq, Lq) of 4-D CPU tensors. The
    output has the inputs' dtype, or ``out_dtype=torch.float32`` (for 16-bit inputs whose
    gradients will follow: training_out_dtype)."""
    _check_op_inputs(query, key, value)
    _check_out_dtype(query, out_dtype)
    return forward_cpu(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                       out_dtype=out_dtype)  # fmt: skip


@sdpa_forward.register_fake
def _(query, key, value, attn_mask, is_causal, scale, enable_gqa, out_dtype=None):
    _check_op_inputs(query, key, value)
    _check_out_dtype(query, out_dtype)
    b, hq, lq, _ = query.shape
    out = _empty_output(query, value.shape[-1], out_dtype)
    return out, query.new_empty((b, hq, lq), dtype=torch.float32)


def _check_out_dtype(query: Tensor, out_dtype: Optional[torch.dtype]) -> None:
    if out_dtype not in (None, query.dtype, torch.float32):
        raise TypeError(f"out_dtype must be None, query's dtype or torch.float32, got {out_dtype}")


def training_out_dtype(query: Tensor) -> Optional[torch.dtype]:
    """The output dtype of a forward whose backward will follow: float32 for 16-bit inputs
    (else None, the inputs' dtype). The backward's Delta = rowsum(dO * O) then reads the
    unrounded output: from the 16-bit one its rounding dominates the scores' gradients where
    softmaxes are sharp (FlashAttention-2's and torch's CPU flash backward's error; dQ and dK
    measured 1.2-6x less accurate there). The caller rounds the output once to the inputs' dtype
    (forward_with_grad); the kernel writes the float32 output as it would the 16-bit one."""
    return torch.float32 if query.dtype in (torch.bfloat16, torch.float16) else None


def forward_with_grad(run, query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """(out, lse) of ``run`` (``sdpa_forward`` or ``_EagerAttention.apply``) for a call whose
    gradients will follow: the forward keeps a float32 output for the backward where the
    inputs are 16-bit (training_out_dtype), and the output returned is its rounding."""
    out_dtype = training_out_dtype(query)
    out, lse = run(query, key, value, attn_mask, is_causal, scale, enable_gqa, out_dtype)
    return (out if out_dtype is None else out.to(query.dtype)), lse


# --------------------------------------------------------------------------- int8 forward
# Below this many scores per (batch, head) the int8 kernel's quantizing passes (channel
# factors, K and V codes, Q codes) cost more than its integer products save on every CPU
# measured, and the exact kernel is faster: on Zen 3 (2 threads, head dims 64 and 160) int8 ran
# at 0.59-0.70x the exact kernel's speed at 48-64 tokens, 0.76-0.89x at 96-128, 0.95-1.00x at
# 192, 1.01-1.06x at 256. Where the break-even is longer (Sapphire Rapids with AVX-512 hidden:
# 384-512 tokens), the measured ``variant_choice.int8_min_scores`` raises it.
INT8_MIN_SCORES = 256 * 256
# ...and with fewer keys than this (cross-attention to 77 text tokens) the softmax and the
# per-query passes dominate: on Zen 3 (2 threads, 4096 queries) int8 ran at 0.99-1.01x the exact
# kernel's speed at 77 keys and 1.05-1.08x at 128 (head dims 40 and 80); SD-1.5's cross-attention
# measured 0.96-0.99x through the whole call.
INT8_MIN_KEYS = 128


def int8_runs_exact_kernel(
    len_q: int, len_k: int, dtype: Optional[torch.dtype] = None, head_dim: Optional[int] = None
) -> bool:
    """Whether an int8 call with ``len_q`` queries and ``len_k`` keys per head runs the exact
    kernel instead: too small to gain from quantizing on any CPU (``INT8_MIN_SCORES``,
    ``INT8_MIN_KEYS``), or, given its input ``dtype``, shorter than the length from which the
    int8 kernel measured faster than the exact one on this CPU, or in a dtype whose exact kernel
    measured faster at every length (``variant_choice.int8_min_scores``: bfloat16 on AMX), or,
    given its ``head_dim``, below the head dim from which it measured faster
    (``variant_choice.int8_min_head_dim``: head dim 40 in bfloat16 on Zen 4)."""
    scores = len_q * len_k
    if scores < INT8_MIN_SCORES or len_k < INT8_MIN_KEYS:
        return True
    if dtype is None:
        return False
    dtype_name = str(dtype).removeprefix("torch.")
    min_scores = variant_choice.int8_min_scores(dtype_name)
    if min_scores is None or scores < min_scores:
        return True
    return head_dim is not None and head_dim < variant_choice.int8_min_head_dim(dtype_name)


def forward_int8_cpu(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """The output of the lossy int8 kernel (Q K^T on 8-bit codes; csrc/kernels/
    attention_int8_impl.h), in the inputs' dtype. Forward only: it has no gradient. Calls too
    small to gain, or in a dtype the exact kernel runs faster on this CPU
    (:func:`int8_runs_exact_kernel`), run the exact kernel (faster there)."""
    if int8_runs_exact_kernel(query.shape[-2], key.shape[-2], query.dtype, query.shape[-1]):
        args = (query, key, value, attn_mask, is_causal, scale, enable_gqa)
        return forward_cpu(*args, with_lse=False, counted_as="int8->tiled")[0]
    attn_mask = _kernel_mask(attn_mask)
    out = _empty_output(query, value.shape[-1])
    variant_choice.ensure_int8()
    counts.count("int8")
    _C.forward_int8(
        _readable(query),
        _readable(key),
        _readable(value),
        to_dlpack(out),
        None if attn_mask is None else _readable(attn_mask),
        None,
        scale,
        is_causal,
        enable_gqa,
        _runtime.get_num_threads(),
    )
    return out


@torch.library.custom_op("npu_attn::sdpa_forward_int8", mutates_args=(), device_types="cpu")
def sdpa_forward_int8(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
) -> Tensor:
    """Lossy int8 attention output (B, Hq, Lq, Dv) of 4-D CPU tensors (no autograd formula:
    differentiating it raises)."""
    _check_op_inputs(query, key, value)
    return forward_int8_cpu(query, key, value, attn_mask, is_causal, scale, enable_gqa)


@sdpa_forward_int8.register_fake
def _(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    _check_op_inputs(query, key, value)
    return _empty_output(query, value.shape[-1])


# --------------------------------------------------------------------------- backward
def _huge_rows(lse: Tensor) -> Tensor:
    """The rows whose finite log-sum-exp is beyond _HUGE_LSE in magnitude (bool, lse's shape)."""
    return (lse.abs() > _HUGE_LSE) & torch.isfinite(lse)


def _rows_with(huge: Tensor) -> Tensor:
    """The query positions (the last dim of ``huge``) where some batch or head has a huge row."""
    return huge.flatten(0, -2).any(0).nonzero().flatten()


def split_lse(query, key, attn_mask, lse, is_causal, scale, enable_gqa) -> tuple[Tensor, Tensor]:
    """(shift, rel) with lse = shift + rel, for merging partial results (ring attention):
    shift is 0 and rel the lse on every row but the huge ones (_HUGE_LSE), whose log-sum float32
    has rounded away beside the row maximum (a row a torch.finfo(float32).min mask hides:
    lse = -FLT_MAX + log n = -FLT_MAX). Those get shift = their largest scaled score and
    rel = log(sum(exp(score - shift))), from scores recomputed with torch ops on the query
    positions that hold one, in blocks of rows (_BLOCK_BYTES of scores at a time)."""
    huge = _huge_rows(lse)
    shift = torch.zeros_like(lse)
    if not bool(huge.any()):
        return shift, lse
    rel = lse.clone()
    all_rows = _rows_with(huge)
    b, hq = query.shape[:2]
    group = hq // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1) if enable_gqa and group > 1 else key.float()
    bytes_per_row = b * hq * max(key.shape[2], 1) * 4 * 3  # scores, their shift, exp
    block = max(1, _BLOCK_BYTES // bytes_per_row)
    for rows in all_rows.split(block):
        mask = None if attn_mask is None else _mask_rows_at(attn_mask, rows)
        scores = masked_scores(query[:, :, rows].float(), k, mask, is_causal, scale, rows)
        top = scores.amax(-1)
        row_rel = torch.exp(scores - top.unsqueeze(-1)).sum(-1).log()
        keep = huge[..., rows]
        shift[..., rows] = torch.where(keep, top, 0.0)
        rel[..., rows] = torch.where(keep, row_rel, lse[..., rows])
    return shift, rel


def backward_cpu(
    grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa, grad_lse=None
):
    """dQ, dK, dV of the forward's rows, in the inputs' dtype: the C++ kernel's
    (kernel_backward), except for rows whose lse is beyond _HUGE_LSE (rows a
    torch.finfo(float32).min mask hides entirely, scores of ~1e6 and beyond), where the kernel's
    exp(S - lse) fails: the kernel leaves those rows out and the torch-ops backward adds their
    exact gradients, on their query positions only (add_huge_rows)."""
    huge = _huge_rows(lse)
    if not bool(huge.any()):
        return kernel_backward(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale,
                               enable_gqa, grad_lse)  # fmt: skip
    tensors = (grad_out, query, key, value, attn_mask, out)
    flags = (is_causal, scale, enable_gqa, grad_lse)
    kernel_lse = lse.masked_fill(huge, -math.inf)  # the kernel skips rows of lse -inf
    grads = kernel_backward(*tensors, kernel_lse, *flags)
    return add_huge_rows(grads, huge, *tensors, lse, *flags)


def kernel_backward(
    grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa, grad_lse=None
):
    """dQ, dK, dV from the C++ tiled backward kernel, in the inputs' dtype (float32, bfloat16
    or float16 read and written directly; the kernel accumulates in float32). Probabilities
    are recomputed as exp(S - lse): right for a key shard of ring attention, whose lse covers
    every shard's keys, and for every row whose lse is within _HUGE_LSE (backward_cpu)."""
    mask = _kernel_mask(attn_mask)
    grad_q = torch.empty_like(query, memory_format=torch.contiguous_format)
    grad_k = torch.empty_like(key, memory_format=torch.contiguous_format)
    grad_v = torch.empty_like(value, memory_format=torch.contiguous_format)
    if grad_out.dtype != query.dtype:
        grad_out = grad_out.to(query.dtype)
    _choose_variant(query.dtype, backward=True)
    _C.backward(
        _readable(query),
        _readable(key),
        _readable(value),
        _readable(out),
        _readable(lse),
        _readable(grad_out),
        to_dlpack(grad_q),
        to_dlpack(grad_k),
        to_dlpack(grad_v),
        attn_mask=None if mask is None else _readable(mask),
        grad_lse=None if grad_lse is None else _readable(grad_lse.float()),
        scale=scale,
        is_causal=is_causal,
        enable_gqa=enable_gqa,
        num_threads=_runtime.get_num_threads(),
    )
    return grad_q, grad_k, grad_v


def add_huge_rows(
    grads,
    huge,
    grad_out,
    query,
    key,
    value,
    attn_mask,
    out,
    lse,
    is_causal,
    scale,
    gqa,
    grad_lse,
    lse_shift=None,
):
    """grads (the kernel's, without the `huge` rows) plus those rows' exact gradients from the
    torch-ops backward, run on the query positions that hold one (any batch or head), with the
    other rows' incoming gradients and outputs zeroed (is_causal from the rows' positions). The
    torch-ops backward gets float32 inputs (exact copies), so its gradients come back in
    float32 and are rounded once, with the kernel's, to the inputs' dtype. ``lse_shift``: the
    shift of split_lse (then ``lse`` is its rel), for rows normalised over more keys than
    ``key`` holds (a key shard of ring attention)."""
    rows = _rows_with(huge)
    keep = huge[..., rows]  # (B, H, R)
    pick = (slice(None), slice(None), rows)
    mask = None if attn_mask is None else _mask_rows_at(attn_mask, rows)
    f32 = torch.float32
    exact = attention_backward(
        grad_out[pick].to(f32).masked_fill(~keep[..., None], 0),
        query[pick].to(f32),
        key.to(f32),
        value.to(f32),
        mask,
        out[pick].to(f32).masked_fill(~keep[..., None], 0),
        lse[pick].masked_fill(~keep, -math.inf),
        is_causal,
        scale,
        gqa,
        grad_lse=None if grad_lse is None else grad_lse[pick].masked_fill(~keep, 0),
        query_positions=rows,
        lse_shift=None if lse_shift is None else lse_shift[pick].masked_fill(~keep, 0),
    )
    dq, dk, dv = (g.float() for g in grads)
    dq.index_add_(2, rows, exact[0])
    dk += exact[1]
    dv += exact[2]
    return tuple(g.to(query.dtype) for g in (dq, dk, dv))


@torch.library.custom_op("npu_attn::sdpa_backward", mutates_args=(), device_types="cpu")
def sdpa_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    grad_lse: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV (contiguous, in the inputs' dtypes) from the C++ tiled backward kernel
    (backward_cpu)."""
    return backward_cpu(
        grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa, grad_lse
    )


@sdpa_backward.register_fake
def _(grad_out, query, key, value, attn_mask, out, lse, grad_lse, is_causal, scale, enable_gqa):
    return tuple(
        torch.empty_like(t, memory_format=torch.contiguous_format) for t in (query, key, value)
    )


def _mask_rows_at(attn_mask, rows):
    """The query rows ``rows`` (a slice or a 1-D index tensor) of a mask broadcastable to
    (B, H, Lq, Lk)."""
    if attn_mask.dim() >= 2 and attn_mask.shape[-2] > 1:
        return attn_mask[..., rows, :]
    return attn_mask


def masked_scores(q, k, attn_mask, is_causal, scale, positions):
    """q k^T * scale plus ``attn_mask`` (bool: False hides; float: added), with the keys after
    each query hidden when ``is_causal``; ``positions``: the query rows' places in the
    sequence. Computes in q's dtype; ``scale`` None means 1/sqrt(head dim)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    if is_causal:
        hidden = torch.arange(k.shape[-2]).view(1, -1) > positions.view(-1, 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def attention_backward(
    grad_out,
    query,
    key,
    value,
    attn_mask,
    out,
    lse,
    is_causal,
    scale,
    enable_gqa,
    need_mask_grad=False,
    grad_lse=None,
    query_positions=None,
    lse_shift=None,
):
    """dQ, dK, dV (and d(mask)) of softmax(Q K^T * scale + mask) V, recomputed per query block
    from the saved log-sum-exp; ``grad_lse`` is the gradient of the lse output, if used;
    ``query_positions``: where the given query rows sit in the sequence, for ``is_causal``
    (default 0, 1, ...: every row); ``lse_shift``: split_lse's shift, subtracted from each
    row's scores (``lse`` is then split_lse's rel). Computes in float32 (float64 inputs stay
    float64)."""
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    b, hq, lq, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = query.to(compute)
    k = key.to(compute).repeat_interleave(group, dim=1) if group > 1 else key.to(compute)
    v = value.to(compute).repeat_interleave(group, dim=1) if group > 1 else value.to(compute)
    do = grad_out.to(compute)
    o = out.to(compute)
    lse = lse.to(compute)
    delta = (do * o).sum(-1)  # D_i = rowsum(dO * O)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    dmask = torch.zeros((b, hq, lq, lk), dtype=compute) if need_mask_grad else None
    bytes_per_row = b * hq * max(lk, 1) * torch.finfo(compute).bits // 8 * 4
    block = max(1, min(lq, _BLOCK_BYTES // max(bytes_per_row, 1)))
    for i0 in range(0, lq, block):
        i1 = min(lq, i0 + block)
        rows = torch.arange(i0, i1) if query_positions is None else query_positions[i0:i1]
        m = None if attn_mask is None else _mask_rows_at(attn_mask, slice(i0, i1))
        scores = masked_scores(q[:, :, i0:i1], k, m, is_causal, scale, rows)
        if lse_shift is not None:
            scores = scores - lse_shift[:, :, i0:i1, None].to(compute)
        row_lse = lse[:, :, i0:i1, None]
        # Fully masked rows (lse = -inf) have P = 0. Subtracting 0 there instead of -inf keeps
        # NaN (-inf - -inf) out of the values and out of the graph of a higher-order gradient.
        empty = torch.isneginf(row_lse)
        # Rows with a huge lse (_HUGE_LSE) are normalised from their own scores instead, which
        # this block has whole: shifted by their maximum, divided by their sum. Selected
        # without a branch (tracing stays static) and finite in every branch (no 0 x inf in a
        # higher-order gradient).
        huge = _huge_rows(row_lse)
        row_shift = torch.where(huge, scores.amax(-1, keepdim=True), row_lse.masked_fill(empty, 0))
        probs = torch.exp(scores - row_shift).masked_fill(empty, 0.0)
        probs = probs / probs.sum(-1, keepdim=True).masked_fill(~huge, 1.0)
        dv += torch.matmul(probs.transpose(-1, -2), do[:, :, i0:i1])
        dp = torch.matmul(do[:, :, i0:i1], v.transpose(-1, -2))
        shift = delta[:, :, i0:i1, None]
        if grad_lse is not None:  # d lse / d S = P
            shift = shift - grad_lse[:, :, i0:i1, None].to(compute)
        ds = probs * (dp - shift)
        dq[:, :, i0:i1] = torch.matmul(ds, k) * scale
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, i0:i1]) * scale
        if dmask is not None:
            dmask[:, :, i0:i1] = ds
    if group > 1:
        dk = dk.view(b, hkv, group, lk, d).sum(2)
        dv = dv.view(b, hkv, group, lk, v.shape[-1]).sum(2)
    dmask_out = None
    if dmask is not None:
        dmask_out = dmask.sum_to_size(attn_mask.shape).to(attn_mask.dtype)
    return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), dmask_out)


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, is_causal, scale, enable_gqa = inputs[:7]
    out, lse = output
    ctx.save_for_backward(query, key, value, attn_mask, out, lse)
    ctx.is_causal, ctx.scale, ctx.enable_gqa = is_causal, scale, enable_gqa
    ctx.mask_grad = attn_mask is not None and attn_mask.requires_grad


def _gradients(ctx, grad_out, grad_lse, use_op: bool):
    """The gradients of the 8 forward inputs (query, key, value, attn_mask, then None for the
    flags and out_dtype), from the C++ backward kernel where it can (``use_op``: as the
    registered op ``sdpa_backward``, for tracers; else called directly)."""
    query, key, value, attn_mask, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    args = (grad_out, query, key, value, attn_mask, out, lse)
    flags = (ctx.is_causal, ctx.scale, ctx.enable_gqa)
    # create_graph=True: the gradient itself must be differentiable, which the kernel's output
    # is not. attention_backward is made of torch ops, so autograd records it (see the module
    # docstring); without this, a gradient penalty would be silently dropped.
    higher_order = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (*args, grad_lse)
    )
    if not ctx.mask_grad and not higher_order:
        if use_op:
            grads = torch.ops.npu_attn.sdpa_backward(*args, grad_lse, *flags)
        else:
            grads = backward_cpu(*args, *flags, grad_lse)
        return (*grads, None, None, None, None, None)
    # The C++ kernel produces no d(mask) and no graph: the torch-ops routine does both.
    return (*attention_backward(*args, *flags, ctx.mask_grad, grad_lse), None, None, None, None)


def _backward(ctx, grad_out, grad_lse):
    return _gradients(ctx, grad_out, grad_lse, use_op=True)


torch.library.register_autograd("npu_attn::sdpa_forward", _backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """``sdpa_forward`` and its registered autograd formula, without the op dispatcher.

    The registered op is what ``torch.compile`` needs (one opaque node in forward and
    backward graphs), but in eager code its dispatch and its Python autograd wrapper cost
    ~40 us more per forward and ~45 us more per backward than this, which small calls notice
    (SD-1.5's 8x8 level computes in ~70 us). This runs the same kernels with the same saved
    tensors and the same gradient rule (``_gradients``), so its gradients are bit-identical
    to the op's."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, scale, enable_gqa, out_dtype):
        inputs = (query, key, value, attn_mask, is_causal, scale, enable_gqa)
        out, lse = forward_cpu(*inputs, out_dtype=out_dtype)
        _setup_context(ctx, inputs, (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        # A backward traced or run under a dispatch mode must show the op, as the forward does.
        return _gradients(ctx, grad_out, grad_lse, use_op=recorded())


def eager_forward_with_grad(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """(out, lse) of ``sdpa_forward`` with its gradients, for eager autograd (not where
    :func:`needs_op`)."""
    args = (query, key, value, attn_mask, is_causal, scale, enable_gqa)
    return forward_with_grad(_EagerAttention.apply, *args)


def op_forward_with_grad(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """(out, lse) of the registered op ``sdpa_forward`` for a call whose gradients will follow
    (where :func:`needs_op`): the same float32 output for the backward as the eager path."""
    args = (query, key, value, attn_mask, is_causal, scale, enable_gqa)
    return forward_with_grad(torch.ops.npu_attn.sdpa_forward, *args)
