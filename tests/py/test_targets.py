"""npu_attn.components: the one place a pipeline's denoiser is found (Token Merging, DeepCache,
block caching, CFG-parallel, context parallel) and a feature's state is kept on a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from npu_attn.components import StateAttribute, denoiser_of
from tiny_accel_models import sd3_pipeline, sd15_pipeline


def test_denoiser_of_accepts_a_pipeline_or_a_bare_model():
    unet_pipe, transformer_pipe = sd15_pipeline(), sd3_pipeline(layers=1)
    assert denoiser_of(unet_pipe) is unet_pipe.unet
    assert denoiser_of(transformer_pipe) is transformer_pipe.transformer
    assert denoiser_of(transformer_pipe, ("transformer",)) is transformer_pipe.transformer
    model = torch.nn.Linear(2, 2)
    assert denoiser_of(model) is model
    assert denoiser_of(model, ("transformer",)) is model  # a model is taken as it is


def test_denoiser_of_rejects_other_objects_naming_what_was_expected():
    with pytest.raises(
        TypeError,
        match=r"target must be a diffusers pipeline with a `unet` or `transformer`, or the "
        r"denoiser model itself, got object",
    ):
        denoiser_of(object())
    unet_pipe = sd15_pipeline()
    with pytest.raises(
        TypeError,
        match=r"pipeline with a `transformer` \(SD3, Flux\), or the transformer model itself, "
        r"got StableDiffusionPipeline",
    ):
        denoiser_of(unet_pipe, ("transformer",), families="SD3, Flux")
    assert denoiser_of(unet_pipe, ("transformer",), required=False) is None
    assert denoiser_of(SimpleNamespace(unet="not a model"), required=False) is None


def test_state_attribute_is_plain_and_undone_before_it_is_forgotten():
    model, value = torch.nn.Linear(2, 2), torch.nn.Linear(1, 1)
    state = StateAttribute("_npu_attn_test_state")
    assert state.get(model) is None and state.get(None) is None
    state.set(model, value)
    assert state.get(model) is value
    assert list(model.children()) == [] and set(model.state_dict()) == {"weight", "bias"}

    def failing_undo(_state):
        raise RuntimeError("undo failed")

    with pytest.raises(RuntimeError, match="undo failed"):
        state.remove(model, failing_undo)
    assert state.get(model) is value  # kept: removing again retries
    undone = []
    assert state.remove(model, undone.append) is True
    assert undone == [value] and state.get(model) is None
    assert state.remove(model, undone.append) is False and undone == [value]
    assert state.remove(None) is False
