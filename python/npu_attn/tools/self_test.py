"""The doctor's numerical self-test: an attention function against float64 attention on one
grouped-query case with a boolean mask (shared by the CPU and the Ascend checks)."""

from __future__ import annotations

from typing import Any

# A float32 result must match the float64 reference within this (relative to output scale).
SELF_TEST_TOLERANCE = 1e-4
HEAD_DIM = 40  # SD-1.5's


def inputs(len_q: int = 67, len_k: int = 93):
    """A grouped-query case (4 query heads, 2 key/value heads, head dim ``HEAD_DIM``) with a
    boolean mask."""
    import torch

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, len_q, HEAD_DIM, generator=g)
    k = torch.randn(2, 2, len_k, HEAD_DIM, generator=g)
    v = torch.randn(2, 2, len_k, HEAD_DIM, generator=g)
    mask = torch.rand(2, 1, len_q, len_k, generator=g) > 0.2
    return q, k, v, mask


def reference(q, k, v, mask):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True
    )


def self_test(fn, dtype=None) -> dict[str, Any]:
    """Run ``fn`` (SDPA signature) on a GQA + mask case; compare with float64 torch.

    float32: error <= 1e-4 of the output's magnitude. bfloat16 (``dtype``): the flash-attention
    bar, error <= 2x the error of torch's own SDPA in bfloat16 on the same inputs."""
    import torch
    import torch.nn.functional as F

    q, k, v, mask = inputs()
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    try:
        with torch.no_grad():
            out = fn(q, k, v, mask, 0.0, False, None, True)
        ref = reference(q, k, v, mask)
        err = float((out.double() - ref).abs().max())
        if dtype is None:
            tol = SELF_TEST_TOLERANCE * max(1.0, float(ref.abs().max()))
        else:
            with torch.no_grad():
                theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            tol = 2 * float((theirs.double() - ref).abs().max()) + 1e-6
        return {"ok": err <= tol, "max_abs_error": err, "tolerance": tol}
    except Exception as e:  # the doctor reports failures, it does not crash on them
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


# The lossy int8 strategy's bar (its issue and docs/int8-attention.md): cosine similarity and
# relative L1 error of the whole output against float64 attention.
LOSSY_MIN_COSINE = 0.999
LOSSY_MAX_RELATIVE_L1 = 3e-2


def lossy_self_test(fn, length: int, kernel_calls=None) -> dict[str, Any]:
    """:func:`self_test` for a lossy strategy (``int8``), on :func:`inputs` with ``length``
    queries and keys (long enough, the caller's choice, for the int8 strategy to run its own
    kernel: it leaves calls too short to gain to the exact one): ok when the output's cosine
    similarity to float64 attention is >= 0.999 and its relative L1 error <= 3e-2, and, given
    ``kernel_calls`` (how many times the lossy kernel has run), when the call really ran it."""
    import torch

    q, k, v, mask = inputs(length, length)
    try:
        calls_before = kernel_calls() if kernel_calls else 0
        with torch.no_grad():
            out = fn(q, k, v, mask, 0.0, False, None, True).double().flatten()
        ran_kernel = kernel_calls() > calls_before if kernel_calls else None
        ref = reference(q, k, v, mask).flatten()
        cosine = float(out @ ref / (out.norm() * ref.norm()))
        relative_l1 = float((out - ref).abs().sum() / ref.abs().sum())
        ok = cosine >= LOSSY_MIN_COSINE and relative_l1 <= LOSSY_MAX_RELATIVE_L1
        return {
            "ok": ok and ran_kernel is not False,
            "tokens": length,
            "ran_lossy_kernel": ran_kernel,
            "max_abs_error": float((out - ref).abs().max()),
            "cosine": cosine,
            "relative_l1": relative_l1,
            "tolerance": LOSSY_MAX_RELATIVE_L1,
        }
    except Exception as e:  # the doctor reports failures, it does not crash on them
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
