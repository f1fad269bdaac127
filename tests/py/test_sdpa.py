"""npu_attn.scaled_dot_product_attention against torch's SDPA computed in float64.

Error bound used throughout (float32 kernel): max|out - ref64| <= 1e-5 * max(1, max|ref64|).
"""

from __future__ import annotations

import math
import random
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import npu_attn
from conftest import max_err, reference_sdpa

REL_TOL = 1e-5
MASK_KINDS = ["none", "bool4d", "bool2d", "keypad", "float4d", "float_heads", "float2d"]


def tolerance(ref: torch.Tensor) -> float:
    finite = ref[torch.isfinite(ref)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return REL_TOL * max(1.0, scale)


def make_mask(kind, b, h, lq, lk, gen):
    if kind == "none":
        return None
    if kind == "bool4d":
        return torch.rand(b, h, lq, lk, generator=gen) > 0.3
    if kind == "bool2d":
        return torch.rand(lq, lk, generator=gen) > 0.3
    if kind == "keypad":  # diffusers-style key padding mask, broadcast over heads and queries
        lengths = torch.randint(1, lk + 1, (b,), generator=gen)
        return (torch.arange(lk)[None, :] < lengths[:, None]).view(b, 1, 1, lk)
    shape = {"float4d": (b, h, lq, lk), "float_heads": (b, 1, lq, lk), "float2d": (lq, lk)}[kind]
    mask = torch.randn(*shape, generator=gen)
    mask[torch.rand(*shape, generator=gen) > 0.8] = float("-inf")
    return mask


def make_qkv(b, hq, hkv, lq, lk, d, dv, layout, gen):
    """Random q, k, v in (B,H,L,D) logical shape, stored as BHSD or BSHD (a permuted view)."""

    def one(h, length, dim):
        if layout == "bshd":
            return torch.randn(b, length, h, dim, generator=gen).transpose(1, 2)
        return torch.randn(b, h, length, dim, generator=gen)

    return one(hq, lq, d), one(hkv, lk, d), one(hkv, lk, dv)


def check_case(b, hq, hkv, lq, lk, d, dv, layout, mask_kind, causal, seed, scale=None):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, layout, gen)
    mask = make_mask(mask_kind, b, hq, lq, lk, gen)
    gqa = hq != hkv
    ref = reference_sdpa(q, k, v, mask, causal, scale, gqa)
    out = npu_attn.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )
    assert out.shape == ref.shape and out.dtype == torch.float32
    err = max_err(out, ref)
    assert err <= tolerance(ref), (
        f"B{b} Hq{hq} Hkv{hkv} Lq{lq} Lk{lk} D{d} Dv{dv} {layout} {mask_kind} "
        f"causal={causal}: err {err:.3g}"
    )


def random_cases(n, seed):
    rng = random.Random(seed)
    dims = [1, 8, 16, 40, 59, 64, 72, 80, 96, 128, 160, 256]
    cases = []
    for i in range(n):
        hkv = rng.choice([1, 2, 3])
        cases.append(
            (
                rng.choice([1, 2]),
                hkv * rng.choice([1, 1, 2, 4]),
                hkv,
                rng.choice([1, 5, 77, 128, 200, 333]),
                rng.choice([1, 7, 77, 128, 257, 400]),
                (d := rng.choice(dims)),
                d if rng.random() < 0.8 else rng.choice(dims),
                rng.choice(["bhsd", "bshd"]),
                rng.choice(MASK_KINDS),
                rng.random() < 0.3,
                1000 + i,
            )
        )
    return cases


@pytest.mark.parametrize("case", random_cases(80, seed=7), ids=lambda c: "-".join(map(str, c)))
def test_random_shapes_match_torch_float64(case):
    check_case(*case)


@pytest.mark.parametrize("d", [40, 59, 64, 72, 80, 96, 128, 160, 256, 512])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_head_dims_self_and_cross_attention(d, layout):
    check_case(2, 2, 2, 150, 150, d, d, layout, "none", False, d)
    check_case(2, 2, 2, 150, 77, d, d, layout, "keypad", False, d + 1)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("causal", [False, True])
def test_every_mask_kind_with_and_without_causal(mask_kind, causal):
    check_case(2, 4, 4, 130, 130, 64, 64, "bshd", mask_kind, causal, 3)
    check_case(1, 4, 2, 300, 90, 40, 40, "bhsd", mask_kind, causal, 4)  # Lq > Lk, GQA


def test_explicit_scale_and_zero_scale():
    check_case(1, 2, 2, 64, 64, 32, 32, "bhsd", "none", False, 5, scale=0.37)
    check_case(1, 2, 2, 64, 64, 32, 32, "bhsd", "float4d", False, 6, scale=0.0)


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    group=st.integers(1, 3),
    lq=st.integers(1, 140),
    lk=st.integers(1, 140),
    d=st.integers(1, 100),
    layout=st.sampled_from(["bhsd", "bshd"]),
    mask_kind=st.sampled_from(MASK_KINDS),
    causal=st.booleans(),
)
def test_hypothesis_shapes(b, hkv, group, lq, lk, d, layout, mask_kind, causal):
    check_case(b, hkv * group, hkv, lq, lk, d, d, layout, mask_kind, causal, lq * 1000 + lk)


def test_three_dimensional_inputs():
    q, k, v = torch.randn(3, 50, 16), torch.randn(3, 70, 16), torch.randn(3, 70, 16)
    out = npu_attn.scaled_dot_product_attention(q, k, v)
    assert out.shape == (3, 50, 16)
    assert max_err(out, reference_sdpa(q, k, v)) <= 1e-5


def test_non_contiguous_inputs_and_output_layout():
    base = torch.randn(2, 300, 3, 64)
    q = base[:, ::2, :, :40].transpose(1, 2)  # strided in L and D
    k = torch.randn(2, 3, 40, 90).transpose(2, 3)  # D is not the innermost dim
    v = torch.randn(2, 3, 90, 40)
    out = npu_attn.scaled_dot_product_attention(q, k, v)
    assert max_err(out, reference_sdpa(q, k, v)) <= 1e-5
    # torch's CPU SDPA returns a contiguous tensor here (key's last dim has stride 90, so it
    # does not run its flash kernel): so does npu_attn, and out.view(-1) works on both.
    assert out.is_contiguous() and F.scaled_dot_product_attention(q, k, v).is_contiguous()
    # With (B, L, H, D) inputs, as diffusers passes them, torch's flash kernel stores the
    # output (B, L, H, D) and so does npu_attn: reshaping to (B, L, H*D) next is free.
    k, v = (torch.randn(2, 90, 3, 40).transpose(1, 2) for _ in range(2))
    out = npu_attn.scaled_dot_product_attention(q, k, v)
    assert max_err(out, reference_sdpa(q, k, v)) <= 1e-5
    assert out.transpose(1, 2).is_contiguous()
    assert out.stride() == F.scaled_dot_product_attention(q, k, v).stride()


def test_expanded_inputs_with_zero_strides():
    k = torch.randn(1, 1, 50, 32).expand(2, 4, 50, 32)
    v = torch.randn(1, 4, 50, 32).expand(2, 4, 50, 32)
    q = torch.randn(2, 4, 20, 32)
    out = npu_attn.scaled_dot_product_attention(q, k, v)
    assert max_err(out, reference_sdpa(q, k, v)) <= 1e-5


def test_fully_masked_rows_match_torch_zeros():
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[2] = False
    fmask = torch.zeros(6, 5)
    fmask[4] = float("-inf")
    for m in (mask, fmask):
        ours, lse = npu_attn.scaled_dot_product_attention(q, k, v, attn_mask=m, return_lse=True)
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        row = 2 if m.dtype == torch.bool else 4
        assert torch.equal(ours[:, :, row], torch.zeros_like(ours[:, :, row]))
        assert torch.equal(theirs[:, :, row], ours[:, :, row])  # torch 2.13 CPU returns 0 too
        assert torch.isinf(lse[:, :, row]).all() and (lse[:, :, row] < 0).all()
        assert max_err(ours, theirs) <= 1e-5


def test_empty_dimensions_match_torch():
    for qs, ks in [((1, 1, 0, 4), (1, 1, 3, 4)), ((1, 1, 3, 4), (1, 1, 0, 4)), ((0, 1, 3, 4),) * 2]:
        q, k, v = torch.randn(*qs), torch.randn(*ks), torch.randn(*ks)
        ours = npu_attn.scaled_dot_product_attention(q, k, v)
        theirs = F.scaled_dot_product_attention(q, k, v)
        assert ours.shape == theirs.shape
        assert torch.equal(ours, theirs)


def test_nan_and_inf_propagate_like_torch():
    q, k, v = torch.randn(1, 1, 10, 16), torch.randn(1, 1, 30, 16), torch.randn(1, 1, 30, 16)
    k_nan = k.clone()
    k_nan[0, 0, 4, 3] = float("nan")
    q_nan = q.clone()
    q_nan[0, 0, 2, 0] = float("nan")
    v_inf = v.clone()
    v_inf[0, 0, 7, 1] = float("inf")
    for args in ((q, k_nan, v), (q_nan, k, v), (q, k, v_inf)):
        ours = npu_attn.scaled_dot_product_attention(*args)
        theirs = reference_sdpa(*args)
        assert max_err(ours, theirs) <= 1e-5
    assert torch.isnan(npu_attn.scaled_dot_product_attention(q, k_nan, v)).all()


def test_large_logits_do_not_overflow():
    # Scores ~1e4. fp32 rounding of each score (~1e4 * 2^-24) bounds the achievable accuracy,
    # so we require being within 2x torch's own fp32 error, and finite.
    q = torch.randn(1, 2, 64, 64) * 1000
    k, v = torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64)
    ref = reference_sdpa(q, k, v)
    ours = npu_attn.scaled_dot_product_attention(q, k, v)
    theirs = F.scaled_dot_product_attention(q, k, v)
    assert torch.isfinite(ours).all()
    assert max_err(ours, ref) <= 2 * max_err(theirs, ref) + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", [None, "tiled"])
def test_min_float_padding_masks_match_torch(dtype, backend):
    # transformers builds padding masks from torch.finfo(float32).min: a row that hides every
    # key sees equal scores (each rounds to -FLT_MAX), so torch averages the values there; in
    # the other rows the hidden keys get weight 0. Row 1 hides all keys, row 3 every other one.
    q, k, v = (torch.randn(2, 3, n, 40).to(dtype) for n in (7, 9, 9))
    mask = torch.zeros(7, 9)
    mask[1] = torch.finfo(torch.float32).min
    mask[3, ::2] = torch.finfo(torch.float32).min
    ours, lse = npu_attn.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, backend=backend, return_lse=True
    )
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(ours).all() and torch.isfinite(lse).all()
    ref = reference_sdpa(q, k, v, mask)
    assert max_err(ours, ref) <= 2 * max_err(theirs, ref) + 1e-6
    assert torch.allclose(ours[:, :, 1].double(), v.double().mean(-2), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_grad", [False, True], ids=["kernel-backward", "torch-ops-backward"])
@pytest.mark.parametrize("causal_gqa", [False, True], ids=["plain", "causal-gqa"])
def test_min_float_padding_masks_have_exact_gradients(dtype, mask_grad, causal_gqa):
    # The row that hides every key averages the values: its probabilities are 1/9 each. Its
    # lse (-FLT_MAX + log 9) rounds to -FLT_MAX, so a backward that recomputes P as
    # exp(S - lse) gets 1 for each key, gradients 9x too large (torch 2.13's float32 CPU
    # kernel does that); npu_attn recomputes such rows' softmax exactly.
    gen = torch.Generator().manual_seed(11)
    heads_kv = 2 if causal_gqa else 4
    q = torch.randn(2, 4, 7, 40, generator=gen).to(dtype)
    k, v = (torch.randn(2, heads_kv, 9, 40, generator=gen).to(dtype) for _ in range(2))
    mask = torch.zeros(7, 9)
    mask[1] = torch.finfo(torch.float32).min
    mask[3, ::2] = torch.finfo(torch.float32).min
    grad_out = torch.randn(2, 4, 7, 40, generator=gen).to(dtype)
    flags = {"is_causal": causal_gqa, "enable_gqa": causal_gqa}

    def gradients(fn, *inputs, mask):
        out = fn(*inputs, attn_mask=mask, **flags)
        return torch.autograd.grad(out, inputs, grad_out.to(out.dtype))

    ref = gradients(reference_sdpa, *(x.double().requires_grad_() for x in (q, k, v)), mask=mask)
    ours = gradients(
        npu_attn.scaled_dot_product_attention,
        *(x.clone().requires_grad_() for x in (q, k, v)),
        mask=mask.clone().requires_grad_(mask_grad),
    )
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for name, o, r in zip("qkv", ours, ref):
        assert torch.isfinite(o).all(), name
        assert max_err(o, r) <= tolerance * max(1.0, float(r.abs().max())), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_left_padding_with_causal_and_lse_gradients_is_exact(dtype):
    # A decoder's batch with left padding: batch 0's first two keys are padding (a finfo.min
    # key mask), so with is_causal its first two queries see nothing else (rows with a huge
    # lse) while batch 1's rows at the same positions are ordinary; the loss also uses the
    # lse, so the backward gets grad_lse. Reference: the softmax written out in float64.
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, 2, 6, 16, generator=gen).to(dtype) for _ in range(3))
    mask = torch.zeros(2, 1, 1, 6)
    mask[0, ..., :2] = torch.finfo(torch.float32).min
    grad_out = torch.randn(2, 2, 6, 16, generator=gen)
    grad_lse = torch.randn(2, 2, 6, generator=gen)

    def loss(out, lse):
        return (out.double() * grad_out).sum() + (lse.double() * grad_lse).sum()

    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = npu_attn.scaled_dot_product_attention(
        *inputs, attn_mask=mask, is_causal=True, return_lse=True
    )
    ours = torch.autograd.grad(loss(out, lse), inputs)
    inputs64 = [x.double().requires_grad_() for x in (q, k, v)]
    scores = inputs64[0] @ inputs64[1].transpose(-1, -2) / 4.0 + mask.double()
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -math.inf)
    ref_out = torch.softmax(scores, -1) @ inputs64[2]
    # logsumexp written out around the detached row maximum: torch.logsumexp's own backward
    # reads exp(S - lse) and has the rounding problem under test, even in float64
    top = scores.amax(-1, keepdim=True).detach()
    ref_lse = (top + torch.exp(scores - top).sum(-1, keepdim=True).log()).squeeze(-1)
    ref = torch.autograd.grad(loss(ref_out, ref_lse), inputs64)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for name, o, r in zip("qkv", ours, ref):
        assert torch.isfinite(o).all(), name
        assert max_err(o, r) <= tolerance * max(1.0, float(r.abs().max())), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["eager", "op"])
def test_16bit_gradients_read_the_unrounded_output(dtype, path):
    # Delta = rowsum(dO * O) meets dP in dS = P * (dP - Delta), a difference of nearly equal
    # terms where a softmax is sharp: from the 16-bit output, its rounding dominates dQ and dK
    # (FlashAttention-2's and torch's CPU flash backward's error). The forward keeps a float32
    # output for the backward; the same kernel fed the 16-bit output is the comparison.
    from npu_attn.attention import ops

    scale, errors = 5.0, {"float32 output": [0.0, 0.0], "16-bit output": [0.0, 0.0]}
    saved = []  # what autograd keeps for the backward
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        q = (torch.randn(2, 4, 96, 8, generator=gen) * 4).to(dtype)  # sharp softmaxes
        k, v, grad_out = (torch.randn(2, 4, 96, 8, generator=gen).to(dtype) for _ in range(3))
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            if path == "eager":
                out = npu_attn.scaled_dot_product_attention(*inputs, scale=scale, backend="tiled")
            else:  # the registered op, as under torch.compile
                out = ops.op_forward_with_grad(*inputs, None, False, scale, False)[0]
        assert out.dtype == dtype
        assert any(t.dtype == torch.float32 and t.shape == out.shape for t in saved)
        ours = torch.autograd.grad(out, inputs, grad_out)
        x64 = [x.double().requires_grad_() for x in (q, k, v)]
        ref = torch.autograd.grad(reference_sdpa(*x64, scale=scale), x64, grad_out.double())
        out16, lse = ops.forward_cpu(q, k, v, None, False, scale, False)
        rounded = ops.kernel_backward(grad_out, q, k, v, None, out16, lse, False, scale, False)
        for i in range(2):  # dQ and dK (dV does not read Delta)
            errors["float32 output"][i] += max_err(ours[i], ref[i])
            errors["16-bit output"][i] += max_err(rounded[i], ref[i])
    for i, name in enumerate("qk"):
        assert errors["float32 output"][i] <= 0.7 * errors["16-bit output"][i], (name, errors)


def test_split_lse_keeps_the_key_counts_of_hidden_rows(monkeypatch):
    # What ring attention merges: a row a finfo.min mask hides has lse -FLT_MAX + log n, which
    # rounds to -FLT_MAX; split_lse gives it shift -FLT_MAX and rel log n (n: keys it sees,
    # causal included), in row blocks of any size, and leaves other rows' lse as rel.
    from npu_attn.attention import ops

    gen = torch.Generator().manual_seed(14)
    q = torch.randn(2, 4, 6, 16, generator=gen)
    k = torch.randn(2, 2, 6, 16, generator=gen)
    lowest = torch.finfo(torch.float32).min
    mask = torch.zeros(2, 1, 6, 6)
    mask[0, :, 1] = lowest
    mask[1, :, 4] = lowest
    _, lse = npu_attn.scaled_dot_product_attention(
        q, k, k, mask, is_causal=True, enable_gqa=True, return_lse=True
    )
    args = (q, k, mask, lse, True, None, True)
    shift, rel = ops.split_lse(*args)
    hidden = torch.zeros(2, 4, 6, dtype=torch.bool)
    hidden[0, :, 1] = hidden[1, :, 4] = True
    assert torch.equal(shift != 0, hidden)
    assert (shift[hidden] == lowest).all()
    counts = torch.tensor([2.0, 5.0]).repeat_interleave(4)  # keys j <= i of rows 1 and 4
    torch.testing.assert_close(rel[hidden], counts.log())
    assert torch.equal(rel[~hidden], lse[~hidden])
    monkeypatch.setattr(ops, "_BLOCK_BYTES", 1)  # one row per block
    assert all(torch.equal(a, b) for a, b in zip(ops.split_lse(*args), (shift, rel)))


@pytest.mark.parametrize("backward", ["kernel_backward", "backward_cpu"])
def test_a_key_shard_backward_reads_the_rows_global_lse(backward):
    # Ring attention runs the backward once per key shard with the lse of the rows over every
    # shard: P = exp(S - lse) is right there and a softmax over one shard's keys is not, so
    # shards run kernel_backward even for rows with a huge lse (scores ~1e6 here, where the
    # float32 lse carries ~6% in P: hence the tolerance); backward_cpu is for whole rows.
    from npu_attn.attention import ops

    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen) for n in (5, 12, 12))
    grad_out = torch.randn(1, 2, 5, 16, generator=gen)
    out, lse = npu_attn.scaled_dot_product_attention(q, k, v, scale=1e6, return_lse=True)
    assert (lse.abs() > 2**20).all()
    flags = (False, 1e6, False)  # is_causal, scale, enable_gqa
    whole = ops.backward_cpu(grad_out, q, k, v, None, out, lse, *flags)
    shards = [
        getattr(ops, backward)(grad_out, q, k[:, :, s], v[:, :, s], None, out, lse, *flags)
        for s in (slice(0, 6), slice(6, 12))
    ]
    dv = torch.cat([shard[2] for shard in shards], dim=2)
    close = max_err(dv, whole[2]) <= 0.15 * float(whole[2].abs().max())
    assert close == (backward == "kernel_backward")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1e7, 1e9, 1e10])
def test_huge_scores_match_torch(dtype, scale):
    # Scores up to ~1e11 (a huge scale): the top key of each row leads by far more than the
    # scores' rounding, so the softmax is one-hot and torch's result exact. The kernels' fused
    # exponential argument would move such rows by 2^(+-1000) (kFusedShiftLimit).
    q, k, v = (torch.randn(1, 2, n, 16).to(dtype) for n in (8, 70, 70))
    ours = npu_attn.scaled_dot_product_attention(q, k, v, scale=scale)
    theirs = F.scaled_dot_product_attention(q, k, v, scale=scale)
    assert torch.isfinite(ours).all()
    assert max_err(ours, theirs) <= 1e-6


def test_lse_matches_logsumexp_of_scores():
    q, k, v = torch.randn(2, 3, 40, 24), torch.randn(2, 3, 55, 24), torch.randn(2, 3, 55, 24)
    mask = torch.randn(2, 1, 40, 55)
    _, lse = npu_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    scores = (q.double() @ k.double().transpose(-1, -2)) / 24**0.5 + mask.double()
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)


def test_inputs_are_not_modified():
    q, k, v = torch.randn(1, 2, 33, 16), torch.randn(1, 2, 44, 16), torch.randn(1, 2, 44, 16)
    mask = torch.randn(33, 44)
    copies = [t.clone() for t in (q, k, v, mask)]
    npu_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for original, copy in zip((q, k, v, mask), copies):
        assert torch.equal(original, copy)


@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "mask"])
def test_inputs_that_require_grad_run_the_kernel_under_no_grad(with_mask):
    # The kernel exports only tensors that do not require grad (DLPack refuses the others):
    # these are detached for the call, and stay as the caller made them.
    q, k, v = (torch.randn(2, 3, 17, 40, requires_grad=True) for _ in range(3))
    mask = torch.randn(17, 17, requires_grad=True) if with_mask else None
    before = npu_attn.call_counts().get("tiled", 0)
    with torch.no_grad():
        out, lse = npu_attn.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, return_lse=True, backend="tiled"
        )
    assert npu_attn.call_counts().get("tiled", 0) == before + 1
    assert not out.requires_grad and not lse.requires_grad
    detached = [None if t is None else t.detach() for t in (q, k, v, mask)]
    assert max_err(out, reference_sdpa(*detached[:3], attn_mask=detached[3])) < 1e-5
    assert all(t.requires_grad and t.grad is None for t in (q, k, v))


def test_numpy_inputs_return_numpy():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 20, 16), dtype=np.float32)
    k = rng.standard_normal((2, 3, 25, 16), dtype=np.float32)
    v = rng.standard_normal((2, 3, 25, 16), dtype=np.float32)
    mask = rng.standard_normal((20, 25)) > 0
    out = npu_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    ref = reference_sdpa(*map(torch.from_numpy, (q, k, v)), attn_mask=torch.from_numpy(mask))
    assert max_err(torch.from_numpy(out), ref) <= 1e-5


def test_numpy_read_only_and_negative_strides():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 20, 16), dtype=np.float32)[:, :, ::-1]  # negative stride
    k = rng.standard_normal((1, 2, 25, 16), dtype=np.float32)
    v = rng.standard_normal((1, 2, 25, 16), dtype=np.float32)
    k.flags.writeable = False
    mask = np.broadcast_to(np.zeros((1, 25), dtype=np.float32), (20, 25))  # read-only view
    out = npu_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = reference_sdpa(*(torch.from_numpy(np.array(a)) for a in (q, k, v)))  # writable copies
    assert max_err(torch.from_numpy(out), ref) <= 1e-5


def test_one_and_two_threads_give_identical_results():
    q, k, v = torch.randn(1, 2, 333, 72), torch.randn(1, 2, 257, 72), torch.randn(1, 2, 257, 72)
    try:
        npu_attn.runtime.set_num_threads(1)
        one = npu_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
        npu_attn.runtime.set_num_threads(2)
        two = npu_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        npu_attn.runtime.set_num_threads(None)
    assert torch.equal(one, two)


def test_thread_count_follows_torch_by_default():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert npu_attn.runtime.get_num_threads() == 1
        npu_attn.runtime.set_num_threads(2)
        assert npu_attn.runtime.get_num_threads() == 2
    finally:
        npu_attn.runtime.set_num_threads(None)
        torch.set_num_threads(before)
    assert npu_attn.runtime.get_num_threads() == before


def test_a_tool_runs_thread_count_is_restored_after_it_even_on_errors():
    before = torch.get_num_threads()
    with npu_attn.runtime.controls.threads_for_run(None) as count:
        assert count == before == npu_attn.runtime.get_num_threads()
    run_threads = npu_attn.runtime.controls.threads_for_run(before + 1)
    with pytest.raises(RuntimeError, match="inside"), run_threads as count:
        assert count == torch.get_num_threads() == npu_attn.runtime.get_num_threads()
        assert count == before + 1
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    try:  # npu_attn follows torch again, rather than keeping the run's count
        torch.set_num_threads(1)
        assert npu_attn.runtime.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_concurrent_python_threads_get_correct_results():
    problems = [
        (
            torch.randn(1, 4, 100 + i, 32),
            torch.randn(1, 4, 80 + i, 32),
            torch.randn(1, 4, 80 + i, 32),
        )
        for i in range(8)
    ]
    expected = [reference_sdpa(*p) for p in problems]
    errors: list[float] = [float("inf")] * len(problems)

    def work(i):
        for _ in range(5):
            out = npu_attn.scaled_dot_product_attention(*problems[i])
        errors[i] = max_err(out, expected[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(errors) <= 1e-5


def test_every_available_isa_is_correct():
    q, k, v = torch.randn(2, 4, 150, 80), torch.randn(2, 4, 77, 80), torch.randn(2, 4, 77, 80)
    mask = torch.rand(2, 1, 150, 77) > 0.2
    ref = reference_sdpa(q, k, v, mask)
    try:
        for isa in npu_attn.runtime.available_isas():
            npu_attn.runtime.set_isa(isa)
            assert npu_attn.runtime.active_isa() == isa
            assert max_err(npu_attn.scaled_dot_product_attention(q, k, v, mask), ref) <= 1e-5
    finally:
        npu_attn.runtime.set_isa(None)


def test_workspace_is_released():
    q = torch.randn(1, 2, 500, 64)
    npu_attn.scaled_dot_product_attention(q, q, q)
    stats = npu_attn.runtime.workspace_stats()
    assert stats["current_bytes"] == 0
    assert stats["peak_bytes"] > 0
