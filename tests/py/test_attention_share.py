"""The step prediction of ``bench --e2e``: the diffusers default step's attention calls are
recorded with their layouts, replayed alone with each kernel, and predict the tiled step."""

from __future__ import annotations

import time

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
    timed_attention_calls,
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


def test_attention_is_timed_inside_a_step_on_the_strategy_it_routes_to():
    unet = tiny_sd15_unet()
    npu_attn.set_attention_strategy(unet, "tiled")
    run(unet)  # the routing shim is in place from here on
    before = torch.nn.functional.scaled_dot_product_attention
    counts_before = npu_attn.call_counts().get("tiled", 0)
    with timed_attention_calls() as spent:
        start = time.perf_counter()
        run(unet)
        step = time.perf_counter() - start
    assert torch.nn.functional.scaled_dot_product_attention is before
    # every call reached npu_attn's kernel through the timer, and took part of the step
    assert npu_attn.call_counts()["tiled"] - counts_before == attention_modules(unet)
    assert 0 < spent[0] < step
    with timed_attention_calls() as untouched:
        pass
    assert untouched == [0.0]


def test_the_timer_is_removed_when_the_step_fails():
    before = torch.nn.functional.scaled_dot_product_attention
    with pytest.raises(RuntimeError, match="boom"), timed_attention_calls():
        raise RuntimeError("boom")
    # what was there, or the routing shim the timer installs first
    assert torch.nn.functional.scaled_dot_product_attention in (before, _shim())


def _shim():
    from npu_attn.integration import redirect

    return redirect._shim


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
    assert "in_step" not in tiled and "Timed inside" not in text  # no timings: no split

    # with the attention timed inside the steps: each step splits into attention and the rest
    timed = {"sdpa": 4.2, "tiled": 2.5, "int8": 1.1}
    split = step_predictions(10.0, {"tiled": 8.4}, {"call": 32}, rounds=1, in_step=timed)
    assert split["tiled"]["in_step"] == {
        "sdpa": {"attention": 4.2, "rest": pytest.approx(5.8)},
        "tiled": {"attention": 2.5, "rest": pytest.approx(5.9)},
    }
    assert (
        "Timed inside the steps, the tiled step's attention took 2.50 s (2.00 s replayed "
        "alone) and the rest of it 5.90 s; the sdpa step's attention 4.20 s (4.00 s replayed) "
        "and the rest 5.80 s." in prediction_markdown(split["tiled"])
    )
    assert "| sdpa s | int8 s |" in prediction_markdown(int8)
