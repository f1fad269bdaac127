"""The step prediction of ``bench --e2e``: the diffusers default step's attention calls are
recorded with their layouts, replayed alone with each kernel, and predict the tiled step."""

from __future__ import annotations

import pytest
import torch

import npu_attn
from npu_attn.tools import attention_share
from npu_attn.tools.attention_share import (
    RecordedCall,
    attention_seconds,
    predicted_step,
    prediction_markdown,
    record_attention_calls,
    step_predictions,
)
from tiny_accel_models import run, tiny_sd15_unet


def attention_modules(unet) -> int:
    from diffusers.models.attention_processor import Attention

    return sum(isinstance(m, Attention) for m in unet.modules())


def test_one_default_step_records_every_attention_call_with_its_layout():
    unet = tiny_sd15_unet()
    npu_attn.reset_attention_strategy(unet)
    before = torch.nn.functional.scaled_dot_product_attention  # (npu_attn's shim, once used)
    calls = record_attention_calls(lambda: run(unet))
    assert sum(calls.values()) == attention_modules(unet)  # one call per attention module
    assert torch.nn.functional.scaled_dot_product_attention is before
    for call in calls:
        (b, h, lq, d), (_, _, lk, _), _ = call.shapes
        assert call.dtype == torch.float32 and not call.is_causal
        # diffusers' head split is a transpose of [B, L, H, D]: not contiguous
        assert call.strides[0] == (lq * h * d, d, h * d, 1)
        assert call.label().startswith(f"B{b} H{h} Lq{lq} Lk{lk} D{d}")
    replayed = attention_share._tensors(next(iter(calls)), torch.Generator().manual_seed(0))
    assert [t.stride() for t in replayed] == list(next(iter(calls)).strides)


def test_the_recorder_is_removed_when_the_step_fails():
    def failing_step():
        raise RuntimeError("boom")

    before = torch.nn.functional.scaled_dot_product_attention
    with pytest.raises(RuntimeError, match="boom"):
        record_attention_calls(failing_step)
    assert torch.nn.functional.scaled_dot_product_attention is before


def test_calls_with_a_mask_are_not_recorded():
    q = torch.randn(1, 2, 8, 16)
    mask = torch.ones(8, 8, dtype=torch.bool)

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    calls = record_attention_calls(step)
    assert list(calls.values()) == [1] and next(iter(calls)).is_causal


def test_replayed_seconds_add_up_per_kind_and_count():
    call = RecordedCall(
        shapes=((2, 2, 64, 40), (2, 2, 77, 40), (2, 2, 77, 40)),
        strides=((5120, 2560, 40, 1), (6160, 3080, 40, 1), (6160, 3080, 40, 1)),
        dtype=torch.float32,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    )
    seconds = attention_seconds({call: 3}, rounds=2)
    for strategy in ("sdpa", "tiled"):
        kinds = {k: v for k, v in seconds[strategy].items() if k != "total"}
        assert list(kinds) == ["B2 H2 Lq64 Lk77 D40"]
        assert seconds[strategy]["total"] == pytest.approx(sum(kinds.values()))
        assert seconds[strategy]["total"] > 0


def test_prediction_arithmetic_and_report(monkeypatch):
    # a step of 10 s with 4 s of attention, made 2x faster: 8 s
    assert predicted_step(10.0, 4.0, 2.0) == pytest.approx(8.0)
    assert predicted_step(10.0, 4.0, 1.0) == pytest.approx(10.0)
    fake = {
        "sdpa": {"B2 H8": 4.0, "total": 4.0},
        "tiled": {"B2 H8": 2.0, "total": 2.0},
        "int8": {"B2 H8": 1.0, "total": 1.0},
    }
    replayed = []

    def attention_seconds(calls, strategies, rounds):
        replayed.append(strategies)
        return {s: fake[s] for s in strategies}

    monkeypatch.setattr(attention_share, "attention_seconds", attention_seconds)
    predictions = step_predictions(10.0, {"tiled": 8.4, "int8": 7.0}, {"call": 32}, rounds=1)
    assert replayed == [("sdpa", "tiled", "int8")]  # one interleaved replay for both
    tiled, int8 = predictions["tiled"], predictions["int8"]
    assert tiled["attention_speedup"] == pytest.approx(2.0)
    assert tiled["predicted_step"] == pytest.approx(8.0)
    assert tiled["measured_vs_predicted"] == pytest.approx(0.05)
    assert int8["predicted_step"] == pytest.approx(7.0)  # 4 s of attention made 4x faster
    assert int8["measured_vs_predicted"] == pytest.approx(0.0)
    text = prediction_markdown(tiled)
    assert "| **total** (32 calls) | 4.000 | 2.000 | 2.00x |" in text
    assert "Attention is 40% of the sdpa step" in text and "+5.0% against" in text
    assert "| sdpa s | int8 s |" in prediction_markdown(int8)
