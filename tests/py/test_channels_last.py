"""accelerate(pipe, channels_last=True): the UNet and VAE in channels-last memory format,
exact up to summation order, composing with the other methods, undone exactly."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

import npu_attn
from npu_attn.accel.token_merging import ModelFamilyError
from tiny_accel_models import generate, sd3_pipeline, sd15_pipeline, sdxl_pipeline
from tiny_models import tiny_flux

STEPS = 3


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("NPU_ATTN_TOME", "NPU_ATTN_DEEPCACHE", "NPU_ATTN_BLOCK_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("NPU_ATTN_CHANNELS_LAST", raising=False)


def conv_layouts(model) -> set[str]:
    """The memory formats of a model's 4-D weights (1x1 kernels, the same in both, skipped)."""
    layouts = set()
    for p in model.parameters():
        if p.dim() == 4 and p.shape[2:] != (1, 1):
            cl = p.is_contiguous(memory_format=torch.channels_last)
            layouts.add("channels_last" if cl and not p.is_contiguous() else "contiguous")
    return layouts


def images(pipe):
    latents = generate(pipe, steps=STEPS)
    with torch.no_grad():
        return latents, pipe.vae.decode(latents).sample


def close(out, ref, relative=1e-4):  # fp32, another summation order
    tol = relative * max(1.0, float(ref.abs().max()))
    err = float((out - ref).abs().max())
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("make", [sd15_pipeline, sdxl_pipeline], ids=["sd15", "sdxl"])
def test_one_call_one_undo_and_same_images(make):
    pipe = make()
    latents, image = images(pipe)
    applied = npu_attn.accelerate(pipe, channels_last=True)
    assert applied == {"channels_last": {"components": ["unet", "vae"]}}
    assert conv_layouts(pipe.unet) == conv_layouts(pipe.vae) == {"channels_last"}
    assert npu_attn.acceleration_of(pipe) == applied
    fast_latents, fast_image = images(pipe)
    close(fast_latents, latents)
    close(fast_image, image)
    assert npu_attn.reset_acceleration(pipe) == ["channels_last"]
    assert conv_layouts(pipe.unet) == conv_layouts(pipe.vae) == {"contiguous"}
    assert npu_attn.acceleration_of(pipe) == {}
    again = images(pipe)
    assert torch.equal(again[0], latents) and torch.equal(again[1], image)


def test_composes_with_token_merging_deep_cache_and_tiled():
    pipe = sd15_pipeline()
    npu_attn.set_attention_strategy(pipe, "tiled")
    npu_attn.accelerate(pipe, token_merging={"ratio": 0.5, "seed": 3}, deep_cache=2)
    lossy = generate(pipe, steps=STEPS)
    # re-applying Token Merging restarts its seeded destination draws, as for the first image
    npu_attn.accelerate(pipe, token_merging={"ratio": 0.5, "seed": 3}, channels_last=True)
    assert set(npu_attn.acceleration_of(pipe)) == {"token_merging", "deep_cache", "channels_last"}
    close(generate(pipe, steps=STEPS), lossy)
    assert npu_attn.reset_acceleration(pipe, "channels_last") == ["channels_last"]
    assert set(npu_attn.acceleration_of(pipe)) == {"token_merging", "deep_cache"}
    assert conv_layouts(pipe.unet) == {"contiguous"}
    npu_attn.reset_acceleration(pipe)
    npu_attn.reset_attention_strategy(pipe)


def test_false_restores_and_a_pickled_pipeline_keeps_it():
    pipe = sd15_pipeline()
    npu_attn.accelerate(pipe, channels_last=True)
    copy = pickle.loads(pickle.dumps(pipe))
    assert npu_attn.acceleration_of(copy) == {"channels_last": {"components": ["unet", "vae"]}}
    assert npu_attn.accelerate(pipe, channels_last=False) == {"channels_last": {"components": []}}
    assert conv_layouts(pipe.unet) == {"contiguous"} and npu_attn.acceleration_of(pipe) == {}


def test_a_bare_model_and_a_transformer_pipeline():
    unet = sd15_pipeline().unet
    assert npu_attn.accelerate(unet, channels_last=True)["channels_last"]["components"] == [
        "UNet2DConditionModel"
    ]
    assert conv_layouts(unet) == {"channels_last"}
    npu_attn.reset_acceleration(unet)
    assert conv_layouts(unet) == {"contiguous"}
    pipe = sd3_pipeline()  # the VAE, and the transformer's convolutional patch embedding
    assert npu_attn.accelerate(pipe, channels_last=True)["channels_last"]["components"] == [
        "transformer",
        "vae",
    ]
    npu_attn.reset_acceleration(pipe)


def test_bad_values_and_models_without_convolutions(monkeypatch, caplog):
    pipe = sd15_pipeline()
    with pytest.raises(TypeError, match="channels_last must be True or False, got 1"):
        npu_attn.accelerate(pipe, channels_last=1)
    with pytest.raises(ModelFamilyError, match="FluxTransformer2DModel has none"):
        npu_attn.accelerate(tiny_flux(), channels_last=True)
    with pytest.raises(TypeError, match="takes a diffusers pipeline or a model, got str"):
        npu_attn.accelerate("unet", channels_last=True)
    monkeypatch.setenv("NPU_ATTN_CHANNELS_LAST", "maybe")
    with pytest.raises(ValueError, match="NPU_ATTN_CHANNELS_LAST must be 1 or 0"):
        npu_attn.accelerate(pipe)
    assert npu_attn.acceleration_of(pipe) == {}
    monkeypatch.setenv("NPU_ATTN_CHANNELS_LAST", "1")
    with caplog.at_level(logging.WARNING, logger="npu_attn"):
        assert npu_attn.accelerate(tiny_flux()) == {}  # the environment skips, with a warning
    assert "NPU_ATTN_CHANNELS_LAST=1 ignored for FluxTransformer2DModel" in caplog.text
    assert npu_attn.accelerate(pipe) == {"channels_last": {"components": ["unet", "vae"]}}
    npu_attn.reset_acceleration(pipe)


def test_compiles_with_fullgraph():
    """Only a layout: npu_attn.compile(..., fullgraph=True) accepts it (unlike the caches)."""
    pipe = sd15_pipeline()
    npu_attn.accelerate(pipe, channels_last=True)
    plain = generate(pipe, steps=2)
    npu_attn.compile(pipe, "tiled", backend="eager", fullgraph=True)
    close(generate(pipe, steps=2), plain)
    npu_attn.reset_compile(pipe)
    npu_attn.reset_attention_strategy(pipe)
    npu_attn.reset_acceleration(pipe)
