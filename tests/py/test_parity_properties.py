"""Property tests: npu_attn is at least about as accurate as torch's own CPU SDPA, on any call.

Hypothesis draws the calls (shapes, head dims, GQA, layouts, masks that hide whole rows,
including with torch.finfo(float32).min as transformers' padding masks do, causal, explicit
and negative scales, the three input dtypes) and the property is relative: against the float64
reference computed from the same (rounded) inputs, npu_attn's error may exceed torch's own
error on that call only by a small factor plus a floor at the dtype's rounding. A fixed
tolerance would be either loose for the easy calls or wrong for the ill-conditioned ones
(large scales make float32 softmax sharp; bfloat16 outputs carry 2^-9 relative rounding).
The draws are derandomized, so CI runs the same examples everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import npu_attn
from conftest import reference_sdpa

MASKS = [
    "none",
    "bool",
    "bool_rows_hidden",
    "float",
    "min_float_padding",
    "min_float_rows_hidden",
    "keypad",
]
SCALES = [None, 0.05, 0.37, 3.0, -0.5]
# How much worse than torch npu_attn may be, plus a floor (relative to the largest reference
# value) under which differences are rounding noise: one rounding of the output dtype, and
# float32 arithmetic whose softmax error grows with the scores' magnitude (kappa, below: the
# kernels' exponentials and torch's round differently, ~16 units of float32 rounding per unit
# of score).
FACTOR = 2.0
OUTPUT_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FLOAT32_PER_SCORE = 1e-6
PROPERTY_SETTINGS = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _mask(kind, b, h, lq, lk, gen):
    if kind == "none":
        return None
    if kind == "bool":
        return torch.rand(b, h, lq, lk, generator=gen) > 0.3
    if kind == "bool_rows_hidden":  # some queries see no key at all
        mask = torch.rand(1, h, lq, lk, generator=gen) > 0.3
        mask[:, :, ::3] = False
        return mask
    if kind == "float":
        mask = torch.randn(b, 1, lq, lk, generator=gen)
        mask[torch.rand(b, 1, lq, lk, generator=gen) > 0.8] = float("-inf")
        return mask
    if kind == "min_float_rows_hidden":  # rows whose scores all round to the mask value
        mask = torch.zeros(1, 1, lq, lk)
        mask[:, :, ::3] = torch.finfo(torch.float32).min
        return mask
    if kind == "min_float_padding":  # transformers' additive padding masks
        lengths = torch.randint(0, lk + 1, (b,), generator=gen)
        hidden = torch.arange(lk)[None, :] >= lengths[:, None]
        return torch.zeros(b, 1, 1, lk).masked_fill(
            hidden.view(b, 1, 1, lk), torch.finfo(torch.float32).min
        )
    lengths = torch.randint(1, lk + 1, (b,), generator=gen)
    return (torch.arange(lk)[None, :] < lengths[:, None]).view(b, 1, 1, lk)


@st.composite
def calls(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16), max_len=160):
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 1, 2, 3]))
    lq = draw(st.integers(1, max_len))
    lk = draw(st.one_of(st.just(77), st.integers(1, max_len)))
    d = draw(st.sampled_from([8, 40, 59, 64, 72, 80, 128, 160]))
    dv = d if draw(st.booleans()) else draw(st.sampled_from([16, 40, 64]))
    return {
        "shape": (b, hkv * group, hkv, lq, lk, d, dv),
        "bshd": draw(st.booleans()),
        "mask": draw(st.sampled_from(MASKS)),
        # torch's SDPA takes a mask or is_causal, not both: keep the comparison like for like
        "causal": draw(st.booleans()),
        "scale": draw(st.sampled_from(SCALES)),
        "dtype": draw(st.sampled_from(dtypes)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _inputs(call, requires_grad=False):
    b, hq, hkv, lq, lk, d, dv = call["shape"]
    gen = torch.Generator().manual_seed(call["seed"])

    def one(h, length, dim):
        shape = (b, length, h, dim) if call["bshd"] else (b, h, length, dim)
        x = torch.randn(*shape, generator=gen).to(call["dtype"])
        x = x.transpose(1, 2) if call["bshd"] else x
        return x.detach().requires_grad_(requires_grad)

    q, k, v = one(hq, lq, d), one(hkv, lk, d), one(hkv, lk, dv)
    mask = None if call["causal"] else _mask(call["mask"], b, hq, lq, lk, gen)
    return q, k, v, mask


def _kwargs(call, mask):
    b, hq, hkv = call["shape"][:3]
    return {
        "attn_mask": mask,
        "is_causal": call["causal"],
        "scale": call["scale"],
        "enable_gqa": hq != hkv,
    }


def _torch_sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch's SDPA as the baseline. With a scale of 0 or below and is_causal, torch 2.13's CPU
    kernel masks before scaling and returns NaN (0 x -inf): there the causal mask is passed as
    a bool mask instead, which it gets right."""
    if is_causal and scale is not None and scale <= 0:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        is_causal = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


def _torch_math_sdpa(*args, **kwargs):
    """torch's math backend: float32 throughout for float32 inputs, its gradients exact up to
    rounding (its flash backward gets rows a finfo.min mask hides entirely wrong)."""
    with sdpa_kernel(SDPBackend.MATH):
        return _torch_sdpa(*args, **kwargs)


def _torch_flash_sdpa(*args, **kwargs):
    """torch's CPU flash kernel (the call is rejected where it does not run it)."""
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return _torch_sdpa(*args, **kwargs)
    except RuntimeError:
        reject()


def _error(x, ref):
    """max |x - ref| over the entries where the reference is finite; NaN where x is not
    finite there (a finite reference must give a finite result)."""
    x, ref = x.double(), ref.double()
    finite = torch.isfinite(ref)
    if not torch.isfinite(x[finite]).all():
        return math.nan
    return float((x - ref)[finite].abs().max()) if finite.any() else 0.0


def _kappa(q, k, scale):
    """The largest |score| of the call, at least 1: how sharp its softmax can be."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[-3] // k.shape[-3]
    k = k.detach().double().repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.detach().double(), k.transpose(-1, -2)) * scale
    return max(1.0, float(scores.abs().max())) if scores.numel() else 1.0


def _bound(torch_err, ref, dtype, kappa, terms=0.0):
    """`terms`: the size of the terms whose cancellation makes the result (for gradients,
    dS = P (dP - Delta) cancels terms of size max|dP| however small the gradient is)."""
    finite = ref[torch.isfinite(ref)]
    size = float(finite.abs().max()) if finite.numel() else 0.0
    floor = OUTPUT_ROUNDING[dtype] + FLOAT32_PER_SCORE * kappa
    return FACTOR * torch_err + floor * max(1.0, size, terms)


def _largest_dp(grad_out, v):
    """max |dO V^T| of the call: dP, whose rows the softmax's backward subtracts Delta from."""
    group = grad_out.shape[-3] // v.shape[-3]
    v = v.detach().double().repeat_interleave(group, dim=-3)
    dp = torch.matmul(grad_out.double(), v.transpose(-1, -2))
    return float(dp.abs().max()) if dp.numel() else 0.0


def _describe(call):
    return ", ".join(f"{key}={value}" for key, value in call.items())


@PROPERTY_SETTINGS
@given(call=calls())
def test_forward_is_about_as_accurate_as_torch(call):
    q, k, v, mask = _inputs(call)
    kwargs = _kwargs(call, mask)
    ref = reference_sdpa(q, k, v, **kwargs)
    ours = npu_attn.scaled_dot_product_attention(q, k, v, **kwargs)
    theirs = _torch_sdpa(q, k, v, **kwargs)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, _describe(call)
    ours_err, torch_err = _error(ours, ref), _error(theirs, ref)
    assert not math.isnan(ours_err), f"non-finite output where the reference is finite: {call}"
    kappa = _kappa(q, k, call["scale"])
    bound = _bound(0.0 if math.isnan(torch_err) else torch_err, ref, call["dtype"], kappa)
    assert ours_err <= bound, f"{_describe(call)}: error {ours_err:.3g}, torch {torch_err:.3g}"


@PROPERTY_SETTINGS
@given(call=calls(dtypes=(torch.float32, torch.bfloat16), max_len=96))
def test_gradients_are_about_as_accurate_as_torch(call):
    """16-bit gradients are held to torch's flash backward, the algorithm npu_attn's kernels
    share (FlashAttention-2's): Delta = rowsum(dO * O) from the 16-bit output, P and dS rounded
    to 16 bits for the products. Where torch runs its math path instead (head dims of value and
    query differing, GQA, ...), it computes in float32 throughout and its gradients can be
    several times more accurate on sharp softmaxes (docs/troubleshooting.md)."""
    q, k, v, mask = _inputs(call, requires_grad=True)
    kwargs = _kwargs(call, mask)
    grad_out = torch.randn(
        npu_attn.scaled_dot_product_attention(q, k, v, **kwargs).shape,
        generator=torch.Generator().manual_seed(call["seed"] + 1),
    ).to(call["dtype"])

    def gradients(fn, *inputs):
        out = fn(*inputs, **kwargs)
        return torch.autograd.grad(out, inputs, grad_out.to(out.dtype))

    ref = gradients(
        lambda *a, **kw: reference_sdpa(*a, **kw),
        *(x.detach().double().requires_grad_() for x in (q, k, v)),
    )
    ours = gradients(npu_attn.scaled_dot_product_attention, q, k, v)
    baseline = _torch_math_sdpa if call["dtype"] == torch.float32 else _torch_flash_sdpa
    theirs = gradients(baseline, q, k, v)
    kappa = _kappa(q, k, call["scale"])
    terms = _largest_dp(grad_out, v)
    for name, o, t, r in zip("qkv", ours, theirs, ref):
        assert o.shape == t.shape and o.dtype == t.dtype, (name, _describe(call))
        ours_err, torch_err = _error(o, r), _error(t, r)
        assert not math.isnan(ours_err), f"d{name}: non-finite gradient: {_describe(call)}"
        torch_err = 0.0 if math.isnan(torch_err) else torch_err
        bound = _bound(torch_err, r, call["dtype"], kappa, terms)
        assert (
            ours_err <= bound
        ), f"d{name}, {_describe(call)}: error {ours_err:.3g}, torch {torch_err:.3g}"


def _plain_call(dtype, seed):
    """B1 H2 Lq64 Lk77 D64, no mask: the checks that the bounds are not vacuous."""
    return {
        "shape": (1, 2, 2, 64, 77, 64, 64),
        "bshd": False,
        "mask": "none",
        "causal": False,
        "scale": None,
        "dtype": dtype,
        "seed": seed,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_property_can_fail(dtype):
    """The bound is not vacuous: an output off by 3% (plus 0.03) breaks it."""
    call = _plain_call(dtype, seed=3)
    q, k, v, _ = _inputs(call)
    ref = reference_sdpa(q, k, v)
    theirs = F.scaled_dot_product_attention(q, k, v)
    wrong = (ref * 1.03 + 0.03).to(dtype)
    kappa = _kappa(q, k, None)
    assert _error(wrong, ref) > _bound(_error(theirs, ref), ref, dtype, kappa)


def test_the_gradient_property_can_fail():
    """Gradients 3% off break the gradient bound too (float32, a softmax of ordinary sharpness)."""
    call = _plain_call(torch.float32, seed=5)
    q, k, v, _ = _inputs(call, requires_grad=True)
    grad_out = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(6))
    inputs64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = torch.autograd.grad(reference_sdpa(*inputs64), inputs64, grad_out.double())
    theirs = torch.autograd.grad(_torch_math_sdpa(q, k, v), (q, k, v), grad_out)
    kappa, terms = _kappa(q, k, None), _largest_dp(grad_out, v)
    for t, r in zip(theirs, ref):
        wrong = r * 1.03
        assert _error(wrong, r) > _bound(_error(t, r), r, torch.float32, kappa, terms)
