"""DeepCache on tiny SD-1.5 and SDXL pipelines (real block structure, diffusers' own
``__call__``), against the ``DeepCache`` package's ``DeepCacheSDHelper`` where it is installed;
diffusers' own cache hooks on a transformer (Flux)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from diffusers import FirstBlockCacheConfig

from npu_attn.accel.deep_cache import (
    DeepCacheOptions,
    apply_deep_cache,
    deep_cache_of,
    remove_deep_cache,
)
from npu_attn.accel.token_merging import ModelFamilyError
from tiny_accel_models import generate, sd15_pipeline, sdxl_pipeline, tiny_sd15_unet
from tiny_models import run_flux, tiny_flux

PIPELINES = {"sd15": sd15_pipeline, "sdxl": sdxl_pipeline}
STEPS = 5
needs_deepcache = pytest.mark.skipif(
    importlib.util.find_spec("DeepCache") is None,
    reason="DeepCache (test-only reference: pip install --no-deps DeepCache==0.1.1) missing",
)


def generate_with_deepcache_package(pipe, interval: int, branch: int) -> torch.Tensor:
    from DeepCache import DeepCacheSDHelper

    helper = DeepCacheSDHelper(pipe=pipe)
    helper.set_params(cache_interval=interval, cache_branch_id=branch)
    helper.enable()
    try:
        return generate(pipe, steps=STEPS)
    finally:
        helper.disable()
        for module in pipe.unet.modules():  # its disable() leaves bound methods behind
            module.__dict__.pop("forward", None)


def generate_with_ours(pipe, interval: int, branch: int) -> torch.Tensor:
    apply_deep_cache(pipe, {"cache_interval": interval, "cache_branch_id": branch})
    try:
        return generate(pipe, steps=STEPS)
    finally:
        remove_deep_cache(pipe)


@needs_deepcache
@pytest.mark.parametrize("family", PIPELINES)
@pytest.mark.parametrize(("interval", "branch"), [(3, 0), (2, 1), (2, 3), (4, 5)])
def test_equals_the_deepcache_package(family, interval, branch):
    pipe = PIPELINES[family]()
    plain = generate(pipe, steps=STEPS)
    ours = generate_with_ours(pipe, interval, branch)
    reference = generate_with_deepcache_package(pipe, interval, branch)
    assert torch.equal(ours, reference), float((ours - reference).abs().max())
    assert float((ours - plain).abs().max()) > 1e-3  # steps really were skipped


@needs_deepcache
def test_bfloat16_equals_the_deepcache_package():
    pipe = sd15_pipeline().to(dtype=torch.bfloat16)
    ours = generate_with_ours(pipe, 3, 0)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, generate_with_deepcache_package(pipe, 3, 0))


@pytest.mark.parametrize("family", PIPELINES)
def test_interval_one_is_bit_identical_and_reset_restores_everything(family):
    pipe = PIPELINES[family]()
    before = _forward_state(pipe.unet)
    plain = generate(pipe, steps=3)
    assert apply_deep_cache(pipe, 1) == {
        "cache_interval": 1,
        "cache_branch_id": 0,
        "skipped_steps": 0,
    }
    assert torch.equal(generate(pipe, steps=3), plain)
    apply_deep_cache(pipe, 2)  # replaces the earlier setting
    assert not torch.equal(generate(pipe, steps=3), plain)
    assert remove_deep_cache(pipe) is True
    assert _forward_state(pipe.unet) == before
    assert torch.equal(generate(pipe, steps=3), plain)
    assert deep_cache_of(pipe) is None
    assert remove_deep_cache(pipe) is False


def _forward_state(model):
    """Per module: has an instance ``forward``, and how many hooks."""
    return [
        ("forward" in m.__dict__, len(m._forward_pre_hooks), len(m._forward_hooks))
        for m in model.modules()
    ]


def test_skips_the_steps_between_refreshes_and_restarts_with_each_generation():
    pipe = sd15_pipeline()
    apply_deep_cache(pipe, 3)
    first = generate(pipe, steps=STEPS)
    assert deep_cache_of(pipe)["skipped_steps"] == 3  # steps 1, 2 and 4 of 0..4
    assert torch.equal(generate(pipe, steps=STEPS), first)  # no stale cache across runs
    assert deep_cache_of(pipe)["skipped_steps"] == 6
    smaller = generate(pipe, steps=STEPS, size=16)  # another shape: a fresh cycle, no crash
    assert smaller.shape[-1] == 8


def test_a_one_step_generation_does_not_leak_into_the_next():
    """A 1-step generation ends at step index 0, where the next generation starts: the next one
    still starts a new cache cycle. Caught: its first call counted as a second UNet call within
    the same step, and its skipped steps read the 1-step generation's deep features."""
    pipe = sd15_pipeline()
    apply_deep_cache(pipe, 3)
    first = generate(pipe, steps=STEPS)
    generate(pipe, steps=1, seed=1)  # other noise: other deep features at step 0
    assert torch.equal(generate(pipe, steps=STEPS), first)
    assert deep_cache_of(pipe)["skipped_steps"] == 6


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_runs_under_no_grad_and_inference_mode(context):
    pipe = sd15_pipeline()
    expected = generate_with_ours(pipe, 2, 0)
    apply_deep_cache(pipe, 2)
    with context():
        assert torch.equal(generate(pipe, steps=STEPS), expected)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, "cache_interval must be >= 1, got 0"),
        ("3", TypeError, "cache_interval must be an int"),
        (True, TypeError, "cache_interval must be an int"),
        (2.5, TypeError, "cache_interval must be an int"),
        ({"cache_interval": 2, "cache_branch_id": -1}, ValueError, "cache_branch_id must be >= 0"),
        ({"cache_interval": 2, "skip_mode": "uniform"}, TypeError, r"unknown options \['skip_"),
        ({"cache_branch_id": 1}, TypeError, "need a 'cache_interval'"),
    ],
)
def test_bad_options_raise(value, error, match):
    with pytest.raises(error, match=match):
        DeepCacheOptions.of(value)


def test_a_branch_beyond_the_unet_and_other_targets_are_refused():
    pipe = sd15_pipeline()
    with pytest.raises(ValueError, match=r"cache_branch_id must be < 12 .*got 12"):
        apply_deep_cache(pipe, {"cache_interval": 2, "cache_branch_id": 12})
    assert _forward_state(pipe.unet) == _forward_state(tiny_sd15_unet())  # nothing changed
    with pytest.raises(ModelFamilyError, match="needs the pipeline, not a bare model"):
        apply_deep_cache(pipe.unet, 2)
    with pytest.raises(ModelFamilyError, match="applies to UNet pipelines"):
        apply_deep_cache(FluxLike(), 2)


class FluxLike:
    """Stands in for a Flux pipeline (its denoiser is ``transformer``)."""

    def __init__(self) -> None:
        self.transformer = tiny_flux()


def test_unet_calls_outside_the_pipeline_loop_explain_themselves():
    pipe = sd15_pipeline()
    pipe.scheduler.set_timesteps(4)
    apply_deep_cache(pipe, 2)
    sample = torch.randn(2, 4, 8, 8)
    text = torch.randn(2, 7, 8)
    with pytest.raises(RuntimeError, match="timestep 3.0 is not one of the pipeline scheduler"):
        pipe.unet(sample, torch.tensor(3), encoder_hidden_states=text)


def test_transformers_get_diffusers_own_cache_hooks():
    flux = FluxLike()
    with torch.no_grad():
        plain = run_flux(flux.transformer)
        # FirstBlockCache with threshold 0 never reuses a block's output: exact.
        applied = apply_deep_cache(flux, FirstBlockCacheConfig(threshold=0.0))
        assert applied == {"diffusers_cache": "FirstBlockCacheConfig"}
        with flux.transformer.cache_context("cond"):
            assert torch.equal(run_flux(flux.transformer), plain)
        assert remove_deep_cache(flux) is True
        assert torch.equal(run_flux(flux.transformer), plain)
    assert flux.transformer._cache_config is None
    with pytest.raises(ModelFamilyError, match="does not support diffusers' cache hooks"):
        apply_deep_cache(sd15_pipeline(), FirstBlockCacheConfig(threshold=0.1))


def test_under_torch_compile_steps_do_not_recompile():
    """DeepCache inside npu_attn.compile: the step bookkeeping runs outside the graph, so the
    compiled UNet specialises only on skipping or not (and the first step's empty cache), not
    on each timestep's value (which recompiled at every step until dynamo's limit of 8)."""
    import torch._dynamo.testing

    from npu_attn import accelerate
    from npu_attn.graph.mode import compile as compile_pipeline
    from npu_attn.tools.pipelines import build_pipeline, prompt_embeddings

    torch._dynamo.reset()
    pipe = build_pipeline("tiny")
    pipe.set_progress_bar_config(disable=True)
    accelerate(pipe, deep_cache=3)
    frames = torch._dynamo.testing.CompileCounter()  # counts compiled frames, runs them eagerly
    compile_pipeline(pipe, "tiled", backend=frames, show_progress=False)
    with torch.no_grad():
        pipe(
            **prompt_embeddings(pipe, torch.float32, "cpu"),
            num_inference_steps=12,
            height=64,
            width=64,
            output_type="pt",
        )
    assert 1 <= frames.frame_count <= 4, frames.frame_count
    # Another step count, and a 1-step generation (which ends where the next one starts), take
    # the graphs compiled already. Caught: after a 1-step image, the next image's first call
    # counted as a second call in the same step, whose cache keys recompiled the UNet.
    compiled = frames.frame_count
    for steps in (1, 5):
        with torch.no_grad():
            pipe(
                **prompt_embeddings(pipe, torch.float32, "cpu"),
                num_inference_steps=steps,
                height=64,
                width=64,
                output_type="pt",
            )
    assert frames.frame_count == compiled, f"{frames.frame_count - compiled} frames recompiled"
    torch._dynamo.reset()
