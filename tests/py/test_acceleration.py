"""accelerate / reset_acceleration: one call, one undo, from options or the environment, and
composition of Token Merging, DeepCache and every attention strategy."""

from __future__ import annotations

import logging

import pytest
import torch

import npu_attn
from npu_attn.accel.registry import accelerate_from_environment, environment_options
from npu_attn.accel.token_merging import ModelFamilyError
from npu_attn.attention import strategies
from tiny_accel_models import (
    frozen_graph_runs,
    generate,
    generate_transformer,
    hidream_pipeline,
    run,
    sd3_pipeline,
    sd15_pipeline,
    sdxl_pipeline,
    tiny_sd15_unet,
)
from tiny_models import tiny_flux

STRATEGIES = ["vanilla", "sdpa", "tiled", "auto"]  # "npu" needs an Ascend NPU
TOME = {"ratio": 0.5, "seed": 3}
STEPS = 4


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("NPU_ATTN_STRATEGY", "DIFFUSERS_ATTENTION_TYPE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("NPU_ATTN_TOME", "NPU_ATTN_DEEPCACHE", "NPU_ATTN_BLOCK_CACHE"):
        monkeypatch.delenv(name, raising=False)
    strategies.auto_selector.forget()
    npu_attn.reset_attention_strategy(None)
    yield
    npu_attn.reset_attention_strategy(None)


def close(out, ref, relative=1e-4):
    tol = relative * max(1.0, float(ref.abs().max()))
    err = float((out - ref).abs().max())
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


def module_state(model):
    """What accelerate may change: instance forwards and hooks, per module."""
    return [
        ("forward" in m.__dict__, len(m._forward_pre_hooks), len(m._forward_hooks))
        for m in model.modules()
    ]


@pytest.mark.parametrize("make", [sd15_pipeline, sdxl_pipeline], ids=["sd15", "sdxl"])
def test_one_call_one_undo(make):
    pipe = make()
    state = module_state(pipe.unet)
    plain = generate(pipe, steps=STEPS)
    applied = npu_attn.accelerate(pipe, token_merging=0.5, deep_cache=3)
    assert applied["token_merging"]["ratio"] == 0.5
    assert applied["deep_cache"]["cache_interval"] == 3
    assert set(npu_attn.acceleration_of(pipe)) == {"token_merging", "deep_cache"}
    assert not torch.equal(generate(pipe, steps=STEPS), plain)
    assert npu_attn.reset_acceleration(pipe) == ["token_merging", "deep_cache"]
    assert module_state(pipe.unet) == state
    assert npu_attn.acceleration_of(pipe) == {}
    assert torch.equal(generate(pipe, steps=STEPS), plain)
    assert npu_attn.reset_acceleration(pipe) == []


def test_disabled_settings_are_bit_identical():
    pipe = sd15_pipeline()
    plain = generate(pipe, steps=STEPS)
    npu_attn.accelerate(pipe, token_merging=0.0, deep_cache=1)
    assert torch.equal(generate(pipe, steps=STEPS), plain)


def test_nothing_is_enabled_by_default():
    pipe = sd15_pipeline()
    assert npu_attn.accelerate(pipe) == {}
    assert accelerate_from_environment(pipe) == {}
    assert npu_attn.acceleration_of(pipe) == {}
    npu_attn.set_attention_strategy(pipe, "tiled")
    assert npu_attn.acceleration_of(pipe) == {}


def test_resetting_one_method_keeps_the_other():
    pipe = sd15_pipeline()
    npu_attn.accelerate(pipe, token_merging=TOME)
    tome_only = generate(pipe, steps=STEPS)
    npu_attn.accelerate(pipe, token_merging=TOME, deep_cache=2)
    assert npu_attn.reset_acceleration(pipe, "deep_cache") == ["deep_cache"]
    assert set(npu_attn.acceleration_of(pipe)) == {"token_merging"}
    npu_attn.accelerate(pipe, token_merging=TOME)  # same seed again: same destinations
    assert torch.equal(generate(pipe, steps=STEPS), tome_only)
    with pytest.raises(ValueError, match="method must be one of"):
        npu_attn.reset_acceleration(pipe, "tome")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_composes_with_every_attention_strategy(strategy):
    pipe = sd15_pipeline()
    processors = 16 * 2  # 16 transformer blocks, self- and cross-attention each
    npu_attn.accelerate(pipe, token_merging=TOME, deep_cache=2)
    accelerated = generate(pipe, steps=STEPS)
    # Acceleration first, then the strategy.
    npu_attn.accelerate(pipe, token_merging=TOME, deep_cache=2)  # a fresh seed and cache
    npu_attn.set_attention_strategy(pipe, strategy)
    strategies.reset_call_counts()
    close(generate(pipe, steps=STEPS), accelerated)
    if strategy in ("sdpa", "tiled"):
        assert strategies.call_counts().get(strategy, 0) > 0, strategies.call_counts()
    # Resetting the strategy keeps the acceleration.
    npu_attn.reset_attention_strategy(pipe)
    assert set(npu_attn.acceleration_of(pipe)) == {"token_merging", "deep_cache"}
    npu_attn.accelerate(pipe, token_merging=TOME, deep_cache=2)
    assert torch.equal(generate(pipe, steps=STEPS), accelerated)
    # The strategy first, then acceleration; resetting the acceleration keeps the strategy.
    npu_attn.reset_acceleration(pipe)
    npu_attn.set_attention_strategy(pipe, strategy)
    strategy_only = generate(pipe, steps=STEPS)
    npu_attn.accelerate(pipe, token_merging=TOME, deep_cache=2)
    close(generate(pipe, steps=STEPS), accelerated)
    npu_attn.reset_acceleration(pipe)
    assert npu_attn.attention_strategy_of(pipe.unet) == {strategy: processors}
    assert torch.equal(generate(pipe, steps=STEPS), strategy_only)
    npu_attn.reset_attention_strategy(pipe)


def test_bfloat16_composes_with_tiled():
    pipe = sd15_pipeline().to(dtype=torch.bfloat16)
    npu_attn.accelerate(pipe, token_merging=TOME, deep_cache=2)
    reference = generate(pipe, steps=STEPS)
    npu_attn.set_attention_strategy(pipe, "tiled")
    npu_attn.accelerate(pipe, token_merging=TOME, deep_cache=2)
    strategies.reset_call_counts()
    out = generate(pipe, steps=STEPS)
    assert strategies.call_counts().get("tiled", 0) > 0
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    close(out.float(), reference.float(), relative=5e-2)  # bf16 rounding of the attention


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_unet_runs_under_no_grad_and_inference_mode(context):
    unet = tiny_sd15_unet()
    npu_attn.set_attention_strategy(unet, "tiled")
    npu_attn.accelerate(unet, token_merging=TOME)
    with context():
        out = run(unet)
    assert torch.isfinite(out).all()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["token_merging", "deep_cache"])
def test_runs_under_torch_compile(method):
    """Token Merging traces into the compiled graph (hooks included); DeepCache runs with graph
    breaks at its step bookkeeping. The "eager" backend checks what dynamo does with both
    without paying for inductor's code generation."""
    pipe = sd15_pipeline()
    options = {"token_merging": TOME} if method == "token_merging" else {"deep_cache": 2}
    npu_attn.accelerate(pipe, **options)
    eager = generate(pipe, steps=STEPS)
    npu_attn.accelerate(pipe, **options)
    npu_attn.compile(pipe, "tiled", backend="eager", show_progress=False)
    try:
        close(generate(pipe, steps=STEPS), eager)
    finally:
        npu_attn.reset_compile(pipe)
        torch._dynamo.reset()


@pytest.mark.slow
def test_graph_mode_traces_the_accelerations_once_and_never_falls_back_to_eager():
    """Token Merging + DeepCache under graph mode with inductor's freezing on (what
    ``npu_attn.compile(..., freeze=True)`` sets): three graphs (first step, refreshing step,
    cached step), none recompiled by a second image and no graph break that makes dynamo run a
    frame eagerly. Caught: DeepCache's cached tensors, reached through the UNet, were frozen
    into the graph and recompiled it at every refresh; ToMe's generator draws and bincount
    broke the graph inside the UNet's block loop, which then ran eagerly."""
    pipe = sd15_pipeline()
    npu_attn.accelerate(pipe, token_merging=TOME, deep_cache=2)
    runs = frozen_graph_runs(pipe, "tiled", lambda: generate(pipe, steps=STEPS))
    assert 0 < runs["first"] <= 4, f"{runs['first']} graphs"
    assert runs["total"] == runs["first"], "the second image recompiled"
    assert not runs["unimplemented"], runs["unimplemented"]


def test_environment_applies_both(monkeypatch):
    monkeypatch.setenv("NPU_ATTN_TOME", "0.5")
    monkeypatch.setenv("NPU_ATTN_DEEPCACHE", " 3 ")
    assert environment_options() == {"token_merging": 0.5, "deep_cache": 3}
    pipe = sd15_pipeline()
    applied = accelerate_from_environment(pipe)
    assert applied == npu_attn.accelerate(pipe)
    assert applied["token_merging"]["ratio"] == 0.5
    assert applied["deep_cache"]["cache_interval"] == 3
    # Explicit options win over the environment.
    assert set(npu_attn.accelerate(pipe, deep_cache=2)) == {"deep_cache"}
    assert npu_attn.acceleration_of(pipe)["deep_cache"]["cache_interval"] == 2


@pytest.mark.parametrize(
    ("variable", "value", "match"),
    [
        ("NPU_ATTN_TOME", "half", "NPU_ATTN_TOME must be a token-merging ratio"),
        ("NPU_ATTN_TOME", "1.5", r"NPU_ATTN_TOME=1.5: token_merging ratio must be in \[0, 1\)"),
        ("NPU_ATTN_DEEPCACHE", "2.5", "NPU_ATTN_DEEPCACHE must be a DeepCache interval"),
        ("NPU_ATTN_DEEPCACHE", "0", "NPU_ATTN_DEEPCACHE=0: deep_cache cache_interval must be"),
        ("NPU_ATTN_BLOCK_CACHE", "high", "NPU_ATTN_BLOCK_CACHE must be a block-cache threshold"),
    ],
)
def test_bad_environment_values_name_the_variable(monkeypatch, variable, value, match):
    monkeypatch.setenv(variable, value)
    pipe = sd15_pipeline()
    with pytest.raises(ValueError, match=match):
        npu_attn.accelerate(pipe)
    assert npu_attn.acceleration_of(pipe) == {}


class FluxLike:
    """Stands in for a Flux pipeline (its denoiser is ``transformer``)."""

    def __init__(self) -> None:
        self.transformer = tiny_flux()


def test_environment_skips_methods_that_do_not_apply(monkeypatch, caplog):
    monkeypatch.setenv("NPU_ATTN_TOME", "0.5")
    monkeypatch.setenv("NPU_ATTN_DEEPCACHE", "3")
    with caplog.at_level(logging.WARNING, logger="npu_attn"):
        assert npu_attn.accelerate(FluxLike()) == {}
    assert "NPU_ATTN_TOME=0.5 ignored for FluxLike" in caplog.text
    assert "NPU_ATTN_DEEPCACHE=3 ignored for FluxLike" in caplog.text
    monkeypatch.setenv("NPU_ATTN_BLOCK_CACHE", "0.1")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="npu_attn"):
        assert set(npu_attn.accelerate(sd15_pipeline())) == {"token_merging", "deep_cache"}
    assert "NPU_ATTN_BLOCK_CACHE=0.1 ignored for StableDiffusionPipeline" in caplog.text
    # A bare UNet: Token Merging applies, DeepCache (which needs the pipeline) is skipped.
    unet = tiny_sd15_unet()
    assert set(npu_attn.accelerate(unet)) == {"token_merging"}


# Options both accelerate and check_acceleration refuse on an SD-1.5 pipeline.
BAD_SD15_OPTIONS = [
    ({"tome": 0.5}, TypeError, r"unknown options \['tome'\]"),
    ({"token_merging": 0.5, "deep_cache": 0}, ValueError, "cache_interval must be >= 1"),
]


@pytest.mark.parametrize("options, error, message", BAD_SD15_OPTIONS)
def test_bad_options_raise_before_anything_changes(options, error, message):
    pipe = sd15_pipeline()
    with pytest.raises(error, match=message):
        npu_attn.accelerate(pipe, **options)
    assert npu_attn.acceleration_of(pipe) == {}  # token merging was not applied either


def test_options_for_another_model_family_are_refused():
    with pytest.raises(ModelFamilyError, match="token_merging applies to UNet models"):
        npu_attn.accelerate(FluxLike(), token_merging=0.5)
    with pytest.raises(ModelFamilyError, match="deep_cache needs the pipeline"):
        npu_attn.accelerate(tiny_sd15_unet(), deep_cache=2)


def test_check_acceleration_raises_what_accelerate_would_and_changes_nothing():
    from diffusers import FirstBlockCacheConfig

    pipe = sd15_pipeline()
    for options, error, message in BAD_SD15_OPTIONS:
        with pytest.raises(error, match=message):
            npu_attn.check_acceleration(pipe, **options)
    with pytest.raises(ModelFamilyError, match="block_cache applies to transformer models"):
        npu_attn.check_acceleration(pipe, block_cache=0.1)
    with pytest.raises(ValueError, match="both cache the transformer's blocks; choose one"):
        npu_attn.check_acceleration(
            FluxLike(), deep_cache=FirstBlockCacheConfig(threshold=0.1), block_cache=0.1
        )
    npu_attn.check_acceleration(pipe, token_merging=0.5, deep_cache=3, channels_last=True)
    assert npu_attn.acceleration_of(pipe) == {}  # valid options are not applied


# --------------------------------------------------------------------------- block cache
@pytest.mark.parametrize("make", [sd3_pipeline, hidream_pipeline], ids=["sd3", "hidream"])
def test_block_cache_one_call_one_undo_and_environment(make, monkeypatch):
    pipe = make()
    state = module_state(pipe.transformer)
    plain = generate_transformer(pipe)
    applied = npu_attn.accelerate(pipe, block_cache={"interval": 2})
    assert applied["block_cache"]["implementation"] == "npu_attn"
    assert not torch.equal(generate_transformer(pipe), plain)
    assert npu_attn.acceleration_of(pipe)["block_cache"]["skipped_calls"] == 4  # of 8
    assert npu_attn.reset_acceleration(pipe) == ["block_cache"]
    assert module_state(pipe.transformer) == state
    assert torch.equal(generate_transformer(pipe), plain)
    monkeypatch.setenv("NPU_ATTN_BLOCK_CACHE", "0.2")
    monkeypatch.setenv("NPU_ATTN_TOME", "0.5")  # UNet only: skipped with a warning
    assert environment_options()["block_cache"] == 0.2
    assert accelerate_from_environment(pipe)["block_cache"]["threshold"] == 0.2
    npu_attn.set_attention_strategy(pipe, "tiled")  # applies the environment too
    assert set(npu_attn.acceleration_of(pipe)) == {"block_cache"}


def test_block_cache_composes_with_attention_strategies():
    pipe = sd3_pipeline()
    npu_attn.accelerate(pipe, block_cache={"interval": 2})
    cached = generate_transformer(pipe)
    npu_attn.set_attention_strategy(pipe, "tiled")
    strategies.reset_call_counts()
    close(generate_transformer(pipe), cached)
    assert strategies.call_counts().get("tiled", 0) > 0
    npu_attn.reset_acceleration(pipe)
    assert npu_attn.attention_strategy_of(pipe.transformer) == {"tiled": 3}


def test_block_cache_and_a_diffusers_cache_config_cannot_share_a_model():
    from diffusers import FirstBlockCacheConfig

    flux = FluxLike()
    with pytest.raises(ValueError, match="both cache the transformer's blocks; choose one"):
        npu_attn.accelerate(flux, deep_cache=FirstBlockCacheConfig(threshold=0.1), block_cache=0.1)
    assert npu_attn.acceleration_of(flux) == {}
    npu_attn.accelerate(flux, block_cache=0.1)
    with pytest.raises(ValueError, match="already has diffusers' FirstBlockCacheConfig enabled"):
        npu_attn.accelerate(flux, deep_cache=FirstBlockCacheConfig(threshold=0.1))
    assert npu_attn.reset_acceleration(flux) == ["block_cache"]
    assert flux.transformer._cache_config is None
    with pytest.raises(ModelFamilyError, match="block_cache applies to transformer models"):
        npu_attn.accelerate(sd15_pipeline(), block_cache=0.1)
