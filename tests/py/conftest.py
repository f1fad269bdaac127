"""Shared helpers for the Python tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


@pytest.fixture(autouse=True, scope="session")
def _session_cache_dir(tmp_path_factory):
    """Measured choices (kernel variants, ``auto``) go to a directory of this test process,
    not the user's ``~/.cache/npu_attn``: tests neither reuse what another build measured nor
    leave entries behind, and pytest-xdist workers do not write one file at once. Tests that
    need their own directory still set ``NPU_ATTN_CACHE_DIR`` with monkeypatch."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NPU_ATTN_CACHE_DIR", str(tmp_path_factory.mktemp("npu_attn_cache")))
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def reference_sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch's SDPA math in float64: the oracle every kernel is checked against.

    The math backend explicitly: for float64 torch would otherwise pick its CPU flash kernel,
    whose backward recomputes probabilities from the log-sum-exp and so gets rows that a
    torch.finfo(float32).min mask hides entirely wrong (P = 1 instead of 1/n: the lse,
    -FLT_MAX + log n, rounds to -FLT_MAX even in float64).

    torch's math path refuses attn_mask together with is_causal (its CPU flash path applies
    both); npu_attn applies both, so the reference folds the causal mask into attn_mask. It
    folds it with a scale of 0 or below too: torch 2.13 scales the scores after its causal
    mask there, and 0 * -inf makes every output NaN (a negative scale too: -inf * -s = inf).
    """
    mask = attn_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    if is_causal and (mask is not None or (scale is not None and scale <= 0)):
        lq, lk = q.shape[-2], k.shape[-2]
        causal = torch.ones(lq, lk, dtype=torch.bool).tril()
        if mask is None:
            mask = causal
        elif mask.dtype == torch.bool:
            mask = mask & causal
        else:
            mask = mask.masked_fill(~causal, float("-inf"))
        is_causal = False
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            q.double(),
            k.double(),
            v.double(),
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b|; NaN/Inf must sit at the same places with the same values."""
    a = a.double()
    b = b.double()
    assert torch.equal(torch.isnan(a), torch.isnan(b)), "NaN positions differ"
    finite = torch.isfinite(a) & torch.isfinite(b)
    assert torch.equal(a[~finite & ~torch.isnan(a)], b[~finite & ~torch.isnan(b)]), "Inf differ"
    if not finite.any():
        return 0.0
    return float((a[finite] - b[finite]).abs().max())
