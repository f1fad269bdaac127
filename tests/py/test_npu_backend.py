"""The SDPA -> torch_npu.npu_fusion_attention translation (npu_attn.backends.npu).

MOCK AT A HARDWARE BOUNDARY: no Ascend NPU or torch_npu exists here. A stand-in ``torch_npu``
module implements npu_fusion_attention's *documented* semantics (BNSD layout, atten_mask
True = masked, pse added to the scores, scale, head_num) with plain torch on CPU, so a wrong
translation (uninverted mask, wrong layout, wrong scale) produces wrong numbers, which these
tests compare against torch's own SDPA. Behaviour on real NPU hardware is unverified.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from npu_attn.attention.backends import npu as npu_backend


class FakeTorchNpu(types.ModuleType):
    def __init__(self):
        super().__init__("torch_npu")
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        self.calls = []

    def npu_fusion_attention(
        self,
        query,
        key,
        value,
        head_num,
        input_layout,
        pse=None,
        padding_mask=None,
        atten_mask=None,
        scale=1.0,
        keep_prob=1.0,
        pre_tockens=2147483647,
        next_tockens=2147483647,
        **kwargs,
    ):
        self.calls.append(
            dict(
                layout=input_layout,
                head_num=head_num,
                scale=scale,
                keep_prob=keep_prob,
                pre=pre_tockens,
                next=next_tockens,
                mask=atten_mask,
                pse=pse,
                dtype=query.dtype,
            )
        )
        assert input_layout == "BNSD" and query.shape[1] == head_num
        scores = (query.float() @ key.float().transpose(-1, -2)) * scale
        if pse is not None:
            scores = scores + pse.float()
        if atten_mask is not None:
            scores = scores.masked_fill(atten_mask, float("-inf"))
        probs = torch.softmax(scores, -1).nan_to_num(0.0)
        return ((probs @ value.float()).to(query.dtype), None, None)


@pytest.fixture
def fake_npu(monkeypatch):
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def reference(q, k, v, **kwargs):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)


def test_bool_mask_is_inverted_and_layout_scale_follow_torch(fake_npu):
    q, k, v = (torch.randn(2, 4, 12, 16, dtype=torch.bfloat16) for _ in range(3))
    keep = torch.rand(2, 1, 1, 12) > 0.3
    keep[..., 0] = True
    out = npu_backend.fusion_attention(q, k, v, keep)
    call = fake_npu.calls[-1]
    assert call["layout"] == "BNSD" and call["head_num"] == 4
    assert call["scale"] == pytest.approx(1 / math.sqrt(16))
    assert call["keep_prob"] == 1.0 and call["pre"] == call["next"] == 65536
    assert torch.equal(call["mask"], ~keep.expand(2, 1, 12, 12))  # True = masked for torch_npu
    assert out.dtype == torch.bfloat16
    ref = reference(q, k, v, attn_mask=keep)
    assert (out.float() - ref).abs().max() <= 2e-2  # bf16 output rounding


def test_additive_mask_goes_to_pse_and_causal_to_upper_triangle(fake_npu):
    q, k, v = (torch.randn(1, 2, 10, 8, dtype=torch.float16) for _ in range(3))
    bias = torch.randn(1, 1, 10, 10, dtype=torch.float16)
    out = npu_backend.fusion_attention(q, k, v, bias, 0.0, False, 0.5)
    assert fake_npu.calls[-1]["pse"].shape == (1, 2, 10, 10)
    assert fake_npu.calls[-1]["scale"] == 0.5
    ref = reference(q, k, v, attn_mask=bias.float(), scale=0.5)
    assert (out.float() - ref).abs().max() <= 1e-2
    out = npu_backend.fusion_attention(q, k, v, None, 0.0, True)
    assert torch.equal(
        fake_npu.calls[-1]["mask"][0, 0], torch.ones(10, 10, dtype=torch.bool).triu(1)
    )
    assert (out.float() - reference(q, k, v, is_causal=True)).abs().max() <= 1e-2


def test_gqa_dropout_and_fp32_fallback(fake_npu):
    q = torch.randn(1, 4, 6, 8, dtype=torch.float16)
    k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float16) for _ in range(2))
    out = npu_backend.fusion_attention(q, k, v, None, 0.0, False, None, True)
    ref = reference(q, k, v, enable_gqa=True)
    assert (out.float() - ref).abs().max() <= 1e-2
    npu_backend.fusion_attention(q, k, v, None, 0.25, False, None, True)
    assert fake_npu.calls[-1]["keep_prob"] == 0.75
    calls = len(fake_npu.calls)
    q32 = torch.randn(1, 2, 6, 8)
    out32 = npu_backend.fusion_attention(q32, q32, q32)  # fused kernel is fp16/bf16 only
    assert len(fake_npu.calls) == calls  # went to torch SDPA, like diffusers does
    assert torch.allclose(out32, F.scaled_dot_product_attention(q32, q32, q32))


def test_availability_reasons(fake_npu, monkeypatch):
    assert npu_backend.unavailable_reason("npu") is None
    assert "on cpu" in npu_backend.unavailable_reason("cpu")
    monkeypatch.delitem(sys.modules, "torch_npu")
    assert "torch_npu is not installed" in npu_backend.unavailable_reason("npu")


def test_float32_fallback_keeps_npu_attn_semantics_for_causal_calls():
    # float32 goes to torch's own SDPA; npu_attn's semantics still hold there: a mask together
    # with is_causal (torch's math path refuses it) and scale 0 with is_causal (torch 2.13
    # returns NaN: it scales after the causal mask).
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    out = npu_backend.fusion_attention(q, k, v, None, 0.0, True, 0.0)
    expected = torch.stack([v[..., : i + 1, :].mean(-2) for i in range(5)], -2)
    assert torch.isfinite(out).all() and (out - expected).abs().max() <= 1e-6
    keep = torch.rand(5, 7) > 0.3
    keep[:, 0] = True
    out = npu_backend.fusion_attention(q, k, v, keep, 0.0, True, None)
    both = keep & torch.ones(5, 7, dtype=torch.bool).tril()
    assert (out - reference(q, k, v, attn_mask=both)).abs().max() <= 1e-5
