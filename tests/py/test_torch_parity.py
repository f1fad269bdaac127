"""Parity with torch.nn.functional.scaled_dot_product_attention (torch 2.13, CPU) where npu_attn
used to refuse, differ or fail unclearly. Each test failed before the fix it guards.

5. float64 (torch's SDPA underneath) follows npu_attn's documented semantics, like float32.
6. What torch accepts: any number of leading dims, broadcast batch/heads, a float32 mask with
   a bfloat16 query, 3-D query with 4-D key/value, autocast, and an output ``.view(-1)``
   accepts wherever it accepts torch's.
7. torch.func transforms, forward-mode AD, sparse/nested tensors and NumPy float16 either work
   or fail with an error that names the argument and says what is expected.

Bounds: float32 max|out - ref64| <= 1e-5 * max(1, max|ref64|) (as in test_sdpa.py); float64
1e-12; bfloat16/float16 the flash-attention bar (2x torch's own error in that dtype).
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import npu_attn
from conftest import max_err, reference_sdpa

sdpa = npu_attn.scaled_dot_product_attention


def tol(ref: torch.Tensor, rel: float = 1e-5) -> float:
    return rel * max(1.0, float(ref.abs().max()))


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


# --------------------------------------------------------------------------- 5. float64
@pytest.mark.parametrize("mask_kind", ["float", "bool"])
def test_float64_mask_with_causal_combines_like_float32(mask_kind):
    # Dv != D makes torch take its math path, which refuses attn_mask with is_causal=True.
    q, k, v = randn(2, 3, 9, 16), randn(2, 3, 12, 16), randn(2, 3, 12, 8)
    mask = randn(9, 12) if mask_kind == "float" else torch.rand(2, 1, 9, 12) > 0.3
    ref = reference_sdpa(q, k, v, mask, is_causal=True)
    for dtype, rel in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        m = mask.to(dtype) if mask.is_floating_point() else mask
        before = m.clone()
        out = sdpa(q.to(dtype), k.to(dtype), v.to(dtype), m, is_causal=True)
        assert out.dtype == dtype and out.shape == ref.shape
        assert max_err(out, ref) <= tol(ref, rel), dtype
        assert torch.equal(m, before)  # the causal mask is folded into a copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "mask",
    [torch.tensor(0.5), torch.tensor(True), torch.randn(12), torch.rand(12) > 0.3],
    ids=["0d-float", "0d-bool", "1d-float", "1d-bool"],
)
def test_zero_and_one_dimensional_masks_broadcast(mask, dtype):
    q = randn(2, 3, 9, 16, dtype=dtype)
    k, v = randn(2, 3, 12, 16, dtype=dtype), randn(2, 3, 12, 16, dtype=dtype)
    m = mask.to(dtype) if mask.is_floating_point() else mask
    # torch's broadcasting: a 1-D mask is (L_k,), a 0-D one a scalar.
    ref = reference_sdpa(q, k, v, m.expand(9, 12))
    out = sdpa(q, k, v, m)
    assert max_err(out, ref) <= tol(ref, 1e-5 if dtype == torch.float32 else 1e-12)


def test_one_dimensional_mask_of_the_wrong_length_names_attn_mask():
    q = randn(1, 2, 9, 16, dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(ValueError, match=r"attn_mask of shape \(5,\) cannot be broadcast"):
            sdpa(q.to(dtype), q.to(dtype), q.to(dtype), torch.zeros(5, dtype=dtype))


def test_default_tiled_strategy_does_not_break_float64_calls():
    q, k, v = randn(1, 2, 9, 16), randn(1, 2, 11, 16), randn(1, 2, 11, 16)
    try:
        npu_attn.set_attention_strategy(None, "tiled")
        out64 = sdpa(q.double(), k.double(), v.double())
        out32, lse = sdpa(q, k, v, return_lse=True)  # float32 still runs the tiled kernel
    finally:
        npu_attn.reset_attention_strategy(None)
    ref = reference_sdpa(q, k, v)
    assert out64.dtype == torch.float64 and max_err(out64, ref) <= 1e-12
    assert max_err(out32, ref) <= 1e-5 and lse.shape == (1, 2, 9)
    # An explicit backend is still a demand, not a preference.
    with pytest.raises(ValueError, match="backend 'tiled' cannot run this call: dtype float64"):
        sdpa(q.double(), k.double(), v.double(), backend="tiled")


def running_mean_of_values(v: torch.Tensor, len_q: int) -> torch.Tensor:
    """softmax(0) over the keys each query sees with top-left causal masking: query i averages
    the values of keys 0..i."""
    return torch.stack([v[..., : i + 1, :].mean(-2) for i in range(len_q)], -2)


@pytest.mark.parametrize(
    "backend, dtype",
    [
        (backend, dtype)
        for backend in (None, "tiled", "sdpa", "vanilla", "int8")
        for dtype in (torch.float32, torch.bfloat16, torch.float64)
        if dtype != torch.float64 or backend not in ("tiled", "int8")  # float32-compute kernels
    ],
)
def test_zero_scale_with_causal_averages_the_visible_values(backend, dtype):
    # torch 2.13 returns NaN everywhere for this call (it scales after the causal mask:
    # 0 * -inf); every npu_attn backend returns the softmax of zero scores.
    # D == Dv: torch's flash kernel (its math path, taken when they differ, gets it right)
    q, k, v = randn(2, 3, 5, 8), randn(2, 3, 7, 8), randn(2, 3, 7, 8)
    expected = running_mean_of_values(v.double(), 5)
    out = sdpa(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True, scale=0.0, backend=backend)
    assert out.dtype == dtype and torch.isfinite(out).all()
    rel = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}[dtype]
    assert max_err(out, expected) <= tol(expected, rel)
    assert max_err(reference_sdpa(q, k, v, is_causal=True, scale=0.0), expected) <= 1e-12


NEGATIVE_SCALE_CASES = [
    (backend, dtype)
    for backend in (None, "tiled", "sdpa", "vanilla", "int8")
    for dtype in (torch.float32, torch.bfloat16, torch.float64)
    if dtype != torch.float64 or backend not in ("tiled", "int8")  # float32-compute kernels
]


@pytest.mark.parametrize("backend, dtype", NEGATIVE_SCALE_CASES)
@pytest.mark.parametrize("masking", ["none", "bool mask", "causal"])
def test_negative_scale_is_torch_semantics(backend, dtype, masking):
    # torch accepts a negative scale; npu_attn runs it as the query negated. With is_causal
    # torch 2.13 returns NaN (its causal -inf times the scale is +inf): the reference folds
    # the causal mask, as for scale 0. The caller's (B, L, H, D) query keeps its values and
    # the output keeps that layout.
    q = randn(2, 9, 3, 16).transpose(1, 2)
    k, v = randn(2, 3, 11, 16), randn(2, 3, 11, 16)
    mask = {"none": None, "bool mask": torch.rand(9, 11) > 0.3, "causal": None}[masking]
    causal = masking == "causal"
    args = [t.to(dtype) for t in (q, k, v)]
    before = args[0].clone()
    out = sdpa(*args, mask, is_causal=causal, scale=-0.7, backend=backend)
    ref = reference_sdpa(*args, mask, is_causal=causal, scale=-0.7)
    assert torch.isfinite(ref).all() and out.dtype == dtype
    rel = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}[dtype]
    if backend == "int8" and dtype == torch.float32:
        rel = 3e-2  # lossy where its kernel runs (this call is short enough for the exact one)
    assert max_err(out, ref) <= tol(ref, rel)
    assert torch.equal(args[0], before)
    if backend in (None, "tiled") and masking != "bool mask":
        assert out.transpose(1, 2).is_contiguous()  # still torch's flash layout


@pytest.mark.parametrize("strategy", ["vanilla", "sdpa", "tiled", "auto"])
def test_negative_scale_with_causal_in_every_strategy(strategy, tmp_path, monkeypatch):
    # What set_attention_strategy installs gets SDPA's positional arguments straight from
    # diffusers, without the public function's negation: torch's own kernel would turn the
    # causal -inf into +inf there (NaN outputs), so the sdpa backend folds the causal mask.
    from npu_attn.attention import strategies

    monkeypatch.setenv("NPU_ATTN_CACHE_DIR", str(tmp_path))
    q, k, v = randn(1, 2, 40, 24), randn(1, 2, 40, 24), randn(1, 2, 40, 24)
    out = strategies.RUNNERS[strategy](q, k, v, None, 0.0, True, -0.8)
    ref = reference_sdpa(q, k, v, is_causal=True, scale=-0.8)
    assert max_err(out, ref) <= tol(ref)


@pytest.mark.parametrize("backend", [None, "tiled", "sdpa", "vanilla"])
def test_negative_scale_has_exact_gradients_and_lse(backend):
    q, k, v = (
        t.requires_grad_() for t in (randn(1, 2, 6, 8), randn(1, 2, 7, 8), randn(1, 2, 7, 8))
    )
    grad_out = randn(1, 2, 6, 8)
    (sdpa(q, k, v, is_causal=True, scale=-1.3, backend=backend) * grad_out).sum().backward()
    ours = [t.grad.clone() for t in (q, k, v)]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_sdpa(q64, k64, v64, is_causal=True, scale=-1.3)
    (ref * grad_out.double()).sum().backward()
    for mine, theirs in zip(ours, (q64.grad, k64.grad, v64.grad)):
        assert max_err(mine, theirs) <= tol(theirs)
    if backend in (None, "tiled"):
        with torch.no_grad():
            _, lse = sdpa(q, k, v, scale=-1.3, backend=backend, return_lse=True)
        scores = -1.3 * q64.detach() @ k64.detach().transpose(-1, -2)
        assert max_err(lse, torch.logsumexp(scores, -1)) <= 1e-5


@pytest.mark.parametrize(
    "q_shape, kv_shape, gqa",
    [
        ((1, 2, 5, 8), (0, 2, 6, 8), False),
        ((2, 1, 5, 8), (2, 0, 6, 8), False),
        ((2, 4, 5, 8), (2, 0, 6, 8), False),
        ((2, 4, 5, 8), (2, 0, 6, 8), True),
        ((5, 8), (0, 6, 8), False),
    ],
)
def test_values_with_a_zero_batch_give_zeros_in_the_querys_shape(q_shape, kv_shape, gqa):
    q, k, v = randn(*q_shape), randn(*kv_shape), randn(*kv_shape)
    theirs = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    ours = sdpa(q, k, v, enable_gqa=gqa)
    assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    arrays = sdpa(q.numpy(), k.numpy(), v.numpy(), enable_gqa=gqa)
    assert arrays.shape == theirs.shape and not arrays.any()
    # In the autograd graph like torch's (zero gradients), with a float32 lse of -inf.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = sdpa(*leaves, enable_gqa=gqa, return_lse=True)
    out.sum().backward()
    assert not leaves[0].grad.any() and leaves[2].grad.shape == v.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1] and torch.isneginf(lse).all()


def test_zero_dim_tensor_scale_and_dropout_like_torch():
    q, k, v = randn(1, 2, 6, 8), randn(1, 2, 7, 8), randn(1, 2, 7, 8)
    theirs = F.scaled_dot_product_attention(
        q, k, v, dropout_p=torch.tensor(0.0), scale=torch.tensor(0.3)
    )
    ours = sdpa(q, k, v, dropout_p=torch.tensor(0.0), scale=torch.tensor(0.3, dtype=torch.float64))
    assert max_err(ours, theirs) <= 1e-6
    with pytest.raises(TypeError, match="scale must be a float or a 0-d real tensor"):
        sdpa(q, k, v, scale=torch.tensor([0.3, 0.4]))


def test_negative_scale_with_numpy_inputs():
    q, k, v = (randn(1, 2, 6, 8) for _ in range(3))
    arrays = [t.numpy() for t in (q, k, v)]
    before = arrays[0].copy()
    out = sdpa(*arrays, scale=-0.4)
    assert isinstance(out, np.ndarray) and np.array_equal(arrays[0], before)
    ref = reference_sdpa(q, k, v, scale=-0.4)
    assert max_err(torch.from_numpy(out), ref) <= tol(ref)


def test_backend_names_are_read_in_any_case():
    q = randn(1, 2, 6, 8)
    before = npu_attn.call_counts().get("tiled", 0)
    out = sdpa(q, q, q, backend=" Tiled ")
    assert npu_attn.call_counts().get("tiled", 0) == before + 1
    assert max_err(out, reference_sdpa(q, q, q)) <= 1e-5
    assert max_err(sdpa(q, q, q, backend="SDPA"), reference_sdpa(q, q, q)) <= 1e-5


@pytest.mark.parametrize("backend", [None, "tiled", "sdpa", "vanilla"])
def test_zero_scale_with_causal_has_finite_exact_gradients(backend):
    # Scores do not depend on q or k at scale 0, so their gradients are 0; with
    # loss = out.sum(), key j's value gradient is sum over queries i >= j of 1 / (i + 1).
    q, k, v = (
        t.requires_grad_() for t in (randn(1, 2, 5, 8), randn(1, 2, 7, 8), randn(1, 2, 7, 8))
    )
    sdpa(q, k, v, is_causal=True, scale=0.0, backend=backend).sum().backward()
    weights = torch.tensor([sum(1.0 / (i + 1) for i in range(j, 5)) for j in range(7)])
    assert q.grad.abs().max() <= 1e-6 and k.grad.abs().max() <= 1e-6
    assert max_err(v.grad, weights.view(1, 1, 7, 1).expand(1, 2, 7, 8)) <= 1e-5


# --------------------------------------------------------------------------- 6a. any rank
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "q_shape, kv_shape",
    [
        ((2, 3, 4, 17, 16), (2, 3, 4, 23, 16)),  # 5-D video latents (B, F, H, L, D)
        ((2, 1, 3, 2, 9, 8), (2, 1, 3, 2, 6, 8)),  # 6-D
        ((17, 16), (23, 16)),  # 2-D (L, D)
    ],
    ids=["5d", "6d", "2d"],
)
def test_any_number_of_leading_dims_like_torch(q_shape, kv_shape, dtype):
    q = randn(*q_shape, dtype=dtype)
    k, v = randn(*kv_shape, dtype=dtype), randn(*kv_shape, dtype=dtype)
    mask = torch.rand(q_shape[-2], kv_shape[-2]) > 0.2
    for kwargs in ({}, {"attn_mask": mask, "is_causal": True}):
        ref = reference_sdpa(q, k, v, **kwargs)
        out = sdpa(q, k, v, **kwargs)
        assert out.shape == ref.shape == F.scaled_dot_product_attention(q, k, v).shape
        assert out.dtype == dtype
        assert max_err(out, ref) <= tol(ref, 1e-5 if dtype == torch.float32 else 1e-12)


def test_five_dimensional_mask_and_gradients():
    q, k, v = randn(2, 3, 2, 13, 16), randn(2, 3, 2, 19, 16), randn(2, 3, 2, 19, 16)
    mask = torch.rand(2, 1, 1, 13, 19) > 0.2  # per video, shared by frames and heads
    grad_out = randn(2, 3, 2, 13, 16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sdpa(*leaves, attn_mask=mask).backward(grad_out)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_sdpa(*refs, attn_mask=mask)
    ref.backward(grad_out.double())
    assert max_err(sdpa(q, k, v, attn_mask=mask), ref.detach()) <= tol(ref.detach())
    for ours, theirs in zip(leaves, refs):
        assert max_err(ours.grad, theirs.grad) <= tol(theirs.grad, 1e-4)


def test_numpy_inputs_take_any_rank_too():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 2, 10, 8), dtype=np.float32)
    k = rng.standard_normal((1, 3, 2, 12, 8), dtype=np.float32)  # batch 1 broadcasts
    v = rng.standard_normal((1, 3, 2, 12, 8), dtype=np.float32)
    out = sdpa(q, k, v)
    ref = reference_sdpa(*map(torch.from_numpy, (q, k, v)))
    assert isinstance(out, np.ndarray) and out.shape == tuple(ref.shape)
    assert max_err(torch.from_numpy(out), ref) <= 1e-5


def test_one_dimensional_inputs_raise_naming_the_argument():
    q = randn(2, 8, 16)
    with pytest.raises(ValueError, match=r"value must have at least 2 dimensions .* \(16,\)"):
        sdpa(q, q, q[0, 0])
    with pytest.raises(ValueError, match="attn_mask must have at most 5 dimensions"):
        sdpa(q[None, None], q[None, None], q[None, None], torch.zeros(1, 1, 1, 1, 8, 8))


# --------------------------------------------------------------------------- 6b. broadcast
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_key_value_batch_and_heads_of_one_broadcast_like_torch(dtype):
    q = randn(3, 4, 10, 16, dtype=dtype)
    for k_shape in ((1, 4, 14, 16), (3, 1, 14, 16), (1, 1, 14, 16)):
        k, v = randn(*k_shape, dtype=dtype), randn(*k_shape, dtype=dtype)
        theirs = F.scaled_dot_product_attention(q, k, v)  # torch broadcasts on CPU
        ref = reference_sdpa(q, k, v)
        out = sdpa(q, k, v)
        assert out.shape == theirs.shape == (3, 4, 10, 16), k_shape
        assert max_err(out, ref) <= tol(ref, 1e-5 if dtype == torch.float32 else 1e-12)
    # A query batch of 1 against key/value batches of 3 broadcasts the other way.
    k, v = randn(3, 4, 14, 16, dtype=dtype), randn(3, 4, 14, 16, dtype=dtype)
    assert sdpa(q[:1], k, v).shape == F.scaled_dot_product_attention(q[:1], k, v).shape


def test_broadcast_key_value_gradients_are_summed():
    q, k, v = randn(3, 2, 10, 16), randn(1, 2, 14, 16), randn(1, 2, 14, 16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sdpa(*leaves).sum().backward()
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    reference_sdpa(*refs).sum().backward()
    for ours, theirs in zip(leaves, refs):
        assert ours.grad.shape == ours.shape
        assert max_err(ours.grad, theirs.grad) <= tol(theirs.grad, 1e-4)


@pytest.mark.parametrize(
    "q_shape, k_shape, v_dim",
    [
        ((2, 1, 5, 8), (2, 2, 0, 8), 8),  # no keys, heads broadcast: torch keeps the query's 1
        ((2, 1, 5, 8), (2, 2, 0, 8), 4),
        ((1, 2, 5, 8), (2, 2, 0, 8), 8),  # no keys, batch broadcast
        ((5, 8), (2, 0, 8), 8),  # 2-D query against 3-D keys
        ((1, 3, 1, 5, 8), (2, 1, 2, 0, 8), 8),  # 5-D
        ((2, 1, 0, 8), (2, 2, 3, 8), 8),  # no queries
        ((2, 1, 5, 8), (2, 2, 3, 8), 0),  # no value channels
        ((2, 1, 5, 0), (2, 2, 3, 0), 4),  # head dim 0 with keys: torch broadcasts (uniform P)
    ],
)
def test_empty_calls_with_broadcast_dims_have_torchs_shape(q_shape, k_shape, v_dim):
    # torch 2.13 returns a call without keys, queries or value channels in the query's own
    # leading dims; npu_attn returned the broadcast shape.
    q = randn(*q_shape).requires_grad_()
    k = randn(*k_shape).requires_grad_()
    v = randn(*k_shape[:-1], v_dim).requires_grad_()
    theirs = F.scaled_dot_product_attention(q, k, v)
    out = sdpa(q, k, v)
    assert out.shape == theirs.shape
    assert max_err(out.detach(), theirs.detach()) <= 1e-6
    out.sum().backward()  # gradients reach every input, in its own shape
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    if k_shape[-2] == 0:
        assert not q.grad.any()  # the output is zeros whatever the query
    arrays = [t.detach().numpy() for t in (q, k, v)]
    assert sdpa(*arrays).shape == tuple(theirs.shape)
    _, lse = sdpa(q.detach(), k.detach(), v.detach(), return_lse=True)
    assert lse.shape == theirs.shape[:-1]
    if k_shape[-2] == 0:
        assert torch.isneginf(lse).all()  # no key: log of an empty sum


# --------------------------------------------------------------------------- 6c. mask dtype
def test_float32_mask_with_bfloat16_query_is_accepted_like_torch():
    q, k, v = (randn(2, 3, 40, 32).bfloat16() for _ in range(3))
    mask = randn(40, 40)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # torch 2.13 accepts it
    ours = sdpa(q, k, v, attn_mask=mask)
    ref = reference_sdpa(q, k, v, mask)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert max_err(ours, ref) <= 2 * max_err(theirs, ref) + 1e-6
    # float16 masks with a bfloat16 query: torch refuses, npu_attn names the difference.
    with pytest.raises(TypeError, match=r"attn_mask must be bool, float32 or the query's dtype"):
        sdpa(q, k, v, attn_mask=mask.half())


def test_float32_mask_with_float64_query_matches_the_reference():
    # torch 2.13's CPU flash kernel accepts this pair but computes wrong values at these
    # sizes (errors ~3); npu_attn casts the mask to float64 first.
    q, k, v = (randn(2, 3, 50, 16, dtype=torch.float64) for _ in range(3))
    mask = randn(50, 50)
    ref = reference_sdpa(q, k, v, mask)
    assert max_err(sdpa(q, k, v, attn_mask=mask), ref) <= 1e-12


# --------------------------------------------------------------------------- 6d. 3-D + 4-D
def test_three_dimensional_query_with_four_dimensional_key_value():
    q, k, v = randn(4, 10, 16), randn(2, 4, 14, 16), randn(2, 4, 14, 16)
    theirs = F.scaled_dot_product_attention(q, k, v)
    out = sdpa(q, k, v)
    assert out.shape == theirs.shape == (2, 4, 10, 16)
    assert max_err(out, reference_sdpa(q, k, v)) <= 1e-5
    # ... and the other way round.
    assert sdpa(k, q, q).shape == F.scaled_dot_product_attention(k, q, q).shape == (2, 4, 14, 16)


# --------------------------------------------------------------------------- 6e. autocast
def test_bfloat16_autocast_gives_bfloat16_like_torch():
    q, k, v = randn(2, 3, 40, 32), randn(2, 3, 50, 32), randn(2, 3, 50, 32)
    mask = torch.rand(40, 50) > 0.2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        ours = sdpa(q, k, v, attn_mask=mask)
        ours64 = sdpa(q.double(), k.double(), v.double())  # autocast leaves float64 alone
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert ours64.dtype == torch.float64
    ref = reference_sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert max_err(ours, ref) <= 2 * max_err(theirs, ref) + 1e-6
    # Gradients reach the float32 leaves in float32.
    leaf = q.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sdpa(leaf, k, v).float().sum().backward()
    assert leaf.grad.dtype == torch.float32 and torch.isfinite(leaf.grad).all()


# --------------------------------------------------------------------------- 6f. layout
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_output_is_viewable_wherever_torchs_is(dtype):
    bhsd = [randn(2, 3, 30, 16, dtype=dtype) for _ in range(3)]
    bshd = [randn(2, 30, 3, 16, dtype=dtype).transpose(1, 2) for _ in range(3)]
    cases = {
        "bhsd": bhsd,
        "bhsd-dv": [*bhsd[:2], randn(2, 3, 30, 8, dtype=dtype)],
        "bshd-dv": [*bshd[:2], randn(2, 30, 3, 8, dtype=dtype).transpose(1, 2)],
        "bshd-3d-mask": [*bshd, torch.rand(3, 30, 30) > 0.2],
        "bshd-kv-broadcast": [bshd[0], bshd[1][:1], bshd[2][:1]],
        "bshd": bshd,
        "bshd-mask": [*bshd, torch.rand(30, 30) > 0.2],
        # a query expanded over heads (stride 0): torch's output is contiguous
        "expanded-heads": [bhsd[0][:, :1].expand(2, 3, 30, 16), *bhsd[1:]],
        "expanded-heads-one-query": [bhsd[0][:, :1, :1].expand(2, 3, 1, 16), *bhsd[1:]],
    }
    for name, args in cases.items():
        theirs = F.scaled_dot_product_attention(*args)
        ours = sdpa(*args)
        if theirs.is_contiguous():
            assert ours.is_contiguous(), name
            ours.view(-1)
        else:  # torch stores (B, L, H, D) here (its flash kernel follows the query's layout)
            assert ours.stride() == theirs.stride(), name


# --------------------------------------------------------------------------- 7. transforms
@contextlib.contextmanager
def warns_once(text: str):
    """npu_attn's RuntimeWarning containing `text`; torch's own warnings on these paths (its
    vmap fallback's performance note, a lazy torch.jit.script deprecation) are not ours."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    ours = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(ours) == 1 and text in ours[0], ours


def _reference_per_example(q, k, v):
    return torch.stack([reference_sdpa(*t) for t in zip(q, k, v)])


def test_vmap_falls_back_to_torch_with_a_warning():
    q, k, v = randn(3, 2, 10, 16), randn(3, 2, 12, 16), randn(3, 2, 12, 16)
    with warns_once("does not support torch.func.vmap in its C++ kernel"):
        out = torch.func.vmap(sdpa)(q, k, v)
    assert max_err(out, _reference_per_example(q, k, v)) <= 1e-5


def test_torch_func_grad_works():
    q, k, v = randn(2, 2, 10, 16), randn(2, 2, 12, 16), randn(2, 2, 12, 16)
    with warns_once("does not support torch.func.grad"):
        grad = torch.func.grad(lambda x: sdpa(x, k, v).sum())(q)
    leaf = q.double().requires_grad_()
    reference_sdpa(leaf, k, v).sum().backward()
    assert max_err(grad, leaf.grad) <= tol(leaf.grad, 1e-4)


def _finite_difference(q, k, v, dq, eps=1e-6):
    q, k, v, dq = (t.double() for t in (q, k, v, dq))
    return (reference_sdpa(q + eps * dq, k, v) - reference_sdpa(q - eps * dq, k, v)) / (2 * eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_mode_ad_dual_tensors_get_correct_tangents(dtype):
    q, k, v, dq = (randn(1, 2, 9, 8, dtype=dtype) for _ in range(4))
    expected = _finite_difference(q, k, v, dq)
    with fwAD.dual_level():
        with warns_once("does not support forward-mode AD"):
            out = sdpa(fwAD.make_dual(q, dq), k, v)
        primal, tangent = fwAD.unpack_dual(out)
    assert tangent is not None, "the tangent was dropped"
    assert max_err(primal, reference_sdpa(q, k, v)) <= 1e-5
    assert max_err(tangent, expected) <= tol(expected, 1e-4)


def test_torch_func_jvp_works():
    q, k, v, dq = (randn(1, 2, 9, 8) for _ in range(4))
    with warns_once("does not support torch.func.jvp (forward-mode AD)"):
        _, tangent = torch.func.jvp(lambda x: sdpa(x, k, v), (q,), (dq,))
    expected = _finite_difference(q, k, v, dq)
    assert max_err(tangent, expected) <= tol(expected, 1e-4)


def test_forced_kernel_backend_under_a_transform_is_a_clear_error():
    q = randn(3, 2, 10, 16)
    with pytest.raises(NotImplementedError, match="torch.func.vmap with backend='tiled'"):
        torch.func.vmap(lambda x: sdpa(x, x, x, backend="tiled"))(q)


@pytest.mark.parametrize("kind", ["coo", "csr"])
@pytest.mark.parametrize("position", ["query", "key", "value", "attn_mask"])
def test_sparse_tensors_are_refused_naming_the_argument(position, kind):
    q, k, v = randn(1, 2, 5, 8), randn(1, 2, 6, 8), randn(1, 2, 6, 8)
    args = {"query": q, "key": k, "value": v, "attn_mask": torch.rand(5, 6) > 0.5}
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore")
        sparse = args[position].to_sparse() if kind == "coo" else args[position].to_sparse_csr()
    args[position] = sparse
    with pytest.raises(TypeError, match=f"does not support sparse tensors: {position} has layout"):
        sdpa(**args)


def test_nested_tensors_are_refused_naming_the_argument():
    nested = torch.nested.nested_tensor([randn(2, 5, 8), randn(2, 7, 8)], layout=torch.jagged)
    with pytest.raises(TypeError, match="does not support nested tensors: query is a torch.nested"):
        sdpa(nested, nested, nested)


def test_numpy_float16_is_supported():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 30, 16)).astype(np.float16) for _ in range(3))
    mask = rng.standard_normal((30, 30)).astype(np.float16)  # widened to float32 internally
    out = sdpa(q, k, v, attn_mask=mask)
    assert isinstance(out, np.ndarray) and out.dtype == np.float16
    tq, tk, tv, tm = map(torch.from_numpy, (q, k, v, mask))
    ref = reference_sdpa(tq, tk, tv, tm)
    theirs = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm)
    assert max_err(torch.from_numpy(out), ref) <= 2 * max_err(theirs, ref) + 1e-6
    with pytest.raises(TypeError, match="query: NumPy arrays must be float32 or float16"):
        sdpa(*(a.astype(np.float64) for a in (q, k, v)))
    with pytest.raises(TypeError, match="query, key and value must have one dtype"):
        sdpa(q, k.astype(np.float32), v)


def test_user_tensors_are_not_modified_by_broadcasting_and_casts():
    q, k, v = randn(2, 3, 10, 16), randn(1, 3, 14, 16), randn(1, 3, 14, 16)
    mask = randn(10, 14, dtype=torch.float64)
    args = (q, k, v)
    copies = [t.clone() for t in (*args, mask)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sdpa(*args)
    sdpa(*(t.double() for t in args), mask, is_causal=True)
    sdpa(q[None], k[None], v[None], mask.float(), is_causal=True)
    for original, copy in zip((*args, mask), copies):
        assert torch.equal(original, copy)


# --------------------------------------------------------------------------- 8. the fast path
# Common calls (plain 4-D CPU tensors, no mask, no autograd/autocast/transform, tiled chosen)
# skip the broadcast plan and backend selection (_fast_cpu_call). It must return exactly what the
# general path returns, and step aside everywhere else.
@pytest.fixture
def fast_path_spy(monkeypatch):
    """Counts the calls the fast path served; ``general()`` turns it off."""
    from npu_attn.attention import functional

    real = functional._fast_cpu_call
    served = []

    def spy(*args):
        result = real(*args)
        served.append(result is not None)
        return result

    monkeypatch.setattr(functional, "_fast_cpu_call", spy)

    class Spy:
        def served(self) -> list:
            return served

        def general(self):
            monkeypatch.setattr(functional, "_fast_cpu_call", lambda *args: None)

    return Spy()


def _fast_path_inputs(layout: str, dtype: torch.dtype, heads_kv: int):
    g = torch.Generator().manual_seed(3)
    if layout == "bhld":
        q = torch.randn(2, 4, 37, 40, generator=g).to(dtype)
        k, v = (torch.randn(2, heads_kv, 29, 40, generator=g).to(dtype) for _ in range(2))
    elif layout == "blhd":  # diffusers' projections viewed as heads: (B, L, H, D) storage
        q = torch.randn(2, 37, 4, 40, generator=g).to(dtype).transpose(1, 2)
        k, v = (
            torch.randn(2, 29, heads_kv, 40, generator=g).to(dtype).transpose(1, 2)
            for _ in range(2)
        )
    else:  # every last dim strided
        q = torch.randn(2, 4, 37, 80, generator=g).to(dtype)[..., ::2]
        k, v = (torch.randn(2, heads_kv, 29, 80, generator=g).to(dtype)[..., ::2] for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["bhld", "blhd", "strided"])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"is_causal": True}, {"scale": 0.3}, {"enable_gqa": True}, {"return_lse": True}],
    ids=["plain", "causal", "scale", "gqa", "lse"],
)
def test_common_calls_take_the_fast_path_and_equal_the_general_path(
    fast_path_spy, dtype, layout, kwargs
):
    q, k, v = _fast_path_inputs(layout, dtype, 2 if kwargs.get("enable_gqa") else 4)
    npu_attn.reset_call_counts()
    fast = sdpa(q, k, v, **kwargs)
    assert fast_path_spy.served() == [True]
    fast_path_spy.general()
    general = sdpa(q, k, v, **kwargs)
    assert npu_attn.call_counts().get("tiled") == 2  # both ran the tiled kernel
    fast, general = (x if isinstance(x, tuple) else (x,) for x in (fast, general))
    for a, b in zip(fast, general):
        assert torch.equal(a, b) and a.stride() == b.stride() and a.dtype == b.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["bhld", "blhd", "strided"])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"is_causal": True}, {"enable_gqa": True}, {"return_lse": True}],
    ids=["plain", "causal", "gqa", "lse"],
)
def test_calls_that_need_gradients_take_the_fast_path_with_the_same_gradients(
    fast_path_spy, dtype, layout, kwargs
):
    inputs = _fast_path_inputs(layout, dtype, 2 if kwargs.get("enable_gqa") else 4)
    grad_out = torch.randn(2, 4, 37, 40, generator=torch.Generator().manual_seed(4)).to(dtype)

    def run():
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        result = sdpa(*leaves, **kwargs)
        out, lse = result if isinstance(result, tuple) else (result, None)
        loss = (out * grad_out).sum() + (lse.sum() if lse is not None else 0)
        loss.backward()
        return out, [t.grad for t in leaves]

    fast_out, fast_grads = run()
    assert fast_path_spy.served() == [True]
    node = fast_out.grad_fn
    if dtype != torch.float32:  # rounded from the float32 output kept for the backward
        assert type(node).__name__ == "ToCopyBackward0"
        node = node.next_functions[0][0]
    assert type(node).__name__ == "_EagerAttentionBackward"
    fast_path_spy.general()
    general_out, general_grads = run()
    assert torch.equal(fast_out, general_out) and fast_out.stride() == general_out.stride()
    for name, a, b in zip(("dq", "dk", "dv"), fast_grads, general_grads):
        assert torch.equal(a, b), name


def _under_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "case",
    ["mask", "float64", "backend_sdpa", "default_sdpa", "autocast", "three_dims", "empty"],
)
def test_fast_path_steps_aside_where_the_general_path_decides(fast_path_spy, case):
    q, k, v = _fast_path_inputs("bhld", torch.float32, 4)
    kwargs, context = {}, contextlib.nullcontext()
    if case == "mask":
        kwargs["attn_mask"] = torch.ones(37, 29, dtype=torch.bool)
    elif case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "backend_sdpa":
        kwargs["backend"] = "sdpa"
    elif case == "default_sdpa":
        npu_attn.set_attention_strategy(None, "sdpa")
    elif case == "autocast":
        context = _under_autocast()
    elif case == "three_dims":
        q, k, v = q[0], k[0], v[0]
    else:
        q = q[:, :, :0]
    npu_attn.reset_call_counts()
    try:
        with context:
            out = sdpa(q, k, v, **kwargs)
    finally:
        npu_attn.reset_attention_strategy(None)
    assert not any(fast_path_spy.served())
    mask = {"attn_mask": kwargs["attn_mask"]} if "attn_mask" in kwargs else {}
    ref = F.scaled_dot_product_attention(q.detach().double(), k.double(), v.double(), **mask)
    assert max_err(out.detach().double(), ref) <= (1e-2 if case == "autocast" else 1e-5)
    if case in ("backend_sdpa", "default_sdpa"):
        assert npu_attn.call_counts().get("sdpa") == 1
    if case == "autocast":
        assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("how", ["backend", "default"])
def test_tiled_asked_for_by_name_takes_the_fast_path(fast_path_spy, how):
    q, k, v = _fast_path_inputs("blhd", torch.bfloat16, 4)
    try:
        if how == "default":
            npu_attn.set_attention_strategy(None, "tiled")
            out = sdpa(q, k, v)
        else:
            out = sdpa(q, k, v, backend="tiled")
    finally:
        npu_attn.reset_attention_strategy(None)
    assert fast_path_spy.served() == [True]
    fast_path_spy.general()
    assert torch.equal(out, sdpa(q, k, v, backend="tiled"))
