"""Accelerated models and pipelines survive pickle, torch.save/torch.load and copy.deepcopy:
the copy carries on exactly where the original is (Token Merging's generator state, DeepCache's
and the block cache's schedule and cached tensors) and still resets to the plain model."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import npu_attn
from npu_attn.accel.block_cache import block_cache_of
from npu_attn.accel.token_merging import apply_token_merging, remove_token_merging, token_merging_of
from tiny_accel_models import (
    generate,
    generate_transformer,
    hidream_pipeline,
    run,
    sd3_pipeline,
    sd15_pipeline,
    tiny_sd3_transformer,
    tiny_sd15_unet,
    transformer_call,
)


def pickled(obj):
    return pickle.loads(pickle.dumps(obj))


def torch_saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUNDTRIPS = {"pickle": pickled, "torch.save": torch_saved, "deepcopy": copy.deepcopy}


def module_state(model):
    return [
        ("forward" in m.__dict__, len(m._forward_pre_hooks), len(m._forward_hooks))
        for m in model.modules()
    ]


@pytest.mark.parametrize("roundtrip", ROUNDTRIPS)
def test_a_token_merging_unet_copies_with_its_generator(roundtrip):
    unet = tiny_sd15_unet()
    with torch.no_grad():
        plain = run(unet)
        apply_token_merging(unet, {"ratio": 0.5, "seed": 3})
        run(unet)  # the generator has moved on: the copy must continue from here
        copied = ROUNDTRIPS[roundtrip](unet)
        assert token_merging_of(copied) == token_merging_of(unet)
        merged = run(unet)
        assert torch.equal(run(copied), merged)
        assert not torch.equal(merged, plain)
        assert remove_token_merging(copied) is True
        assert torch.equal(run(copied), plain)
        assert token_merging_of(unet) is not None  # the original keeps its own
    assert module_state(copied) == module_state(tiny_sd15_unet())


@pytest.mark.parametrize("roundtrip", ROUNDTRIPS)
def test_an_accelerated_pipeline_copies_with_its_deep_cache_and_token_merging(roundtrip):
    pipe = sd15_pipeline()
    plain = generate(pipe, steps=4)
    npu_attn.accelerate(pipe, token_merging={"ratio": 0.5, "seed": 3}, deep_cache=3)
    generate(pipe, steps=4)
    copied = ROUNDTRIPS[roundtrip](pipe)
    state = copied.unet._npu_attn_deep_cache
    assert state._pipe() is copied  # attached to the copy, not to the original
    accelerated = generate(pipe, steps=4)
    assert torch.equal(generate(copied, steps=4), accelerated)
    assert not torch.equal(accelerated, plain)
    assert npu_attn.acceleration_of(copied) == npu_attn.acceleration_of(pipe)
    assert npu_attn.reset_acceleration(copied) == ["token_merging", "deep_cache"]
    assert torch.equal(generate(copied, steps=4), plain)
    assert module_state(copied.unet) == module_state(tiny_sd15_unet())


def test_a_unet_copied_without_its_pipeline_asks_to_be_attached_again():
    pipe = sd15_pipeline()
    npu_attn.accelerate(pipe, deep_cache=2)
    expected = generate(pipe, steps=4)
    other = type(pipe)(**{**pipe.components, "unet": pickled(pipe.unet)})
    other.set_progress_bar_config(disable=True)
    with pytest.raises(RuntimeError, match="no longer attached to its pipeline"):
        generate(other, steps=4)
    npu_attn.accelerate(other, deep_cache=2)
    assert torch.equal(generate(other, steps=4), expected)


@pytest.mark.parametrize("roundtrip", ROUNDTRIPS)
@pytest.mark.parametrize("make", [sd3_pipeline, hidream_pipeline], ids=["sd3", "hidream"])
def test_a_block_cached_pipeline_copies(make, roundtrip):
    pipe = make()
    plain = generate_transformer(pipe)
    npu_attn.accelerate(pipe, block_cache={"interval": 2})
    generate_transformer(pipe)
    copied = ROUNDTRIPS[roundtrip](pipe)
    cached = generate_transformer(pipe)
    assert torch.equal(generate_transformer(copied), cached)
    assert not torch.equal(cached, plain)
    assert block_cache_of(copied) == block_cache_of(pipe)
    assert npu_attn.reset_acceleration(copied) == ["block_cache"]
    assert torch.equal(generate_transformer(copied), plain)
    assert module_state(copied.transformer) == module_state(make().transformer)


def test_a_block_cached_model_copied_mid_generation_continues_it():
    model = tiny_sd3_transformer()
    npu_attn.accelerate(model, block_cache={"interval": 3})
    transformer_call(model, 900.0)  # computes every block and caches the residual
    copied = pickled(model)
    assert torch.equal(
        transformer_call(copied, 800.0), transformer_call(model, 800.0)
    )  # both reuse
    assert block_cache_of(copied)["skipped_calls"] == 1
