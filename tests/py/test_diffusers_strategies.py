"""set_attention_strategy on real (tiny, randomly initialised) diffusers models of every family.

Tolerance: float32 outputs must match the model's own default output within
1e-4 * max(1, max|default|) (observed differences are ~1e-6: different summation orders).
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

import npu_attn
from npu_attn.attention import strategies
from npu_attn.attention.auto import AutoSelector
from tiny_models import FAMILIES, run_unet, tiny_unet, tiny_vae, unet_inputs

STRATEGIES = ["vanilla", "sdpa", "tiled", "auto"]  # "npu" needs an Ascend NPU
# Which implementation must have served the attention calls for each strategy.
SERVED_BY = {"vanilla": "vanilla", "sdpa": "sdpa", "tiled": "tiled"}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("NPU_ATTN_STRATEGY", raising=False)
    monkeypatch.delenv("DIFFUSERS_ATTENTION_TYPE", raising=False)
    monkeypatch.delenv("NPU_ATTN_TOME", raising=False)
    monkeypatch.delenv("NPU_ATTN_DEEPCACHE", raising=False)
    strategies.auto_selector.forget()
    npu_attn.reset_attention_strategy(None)
    strategies.reset_call_counts()
    yield
    npu_attn.reset_attention_strategy(None)


def close(out, ref):
    tol = 1e-4 * max(1.0, float(ref.abs().max()))
    err = float((out - ref).abs().max())
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_family_matches_its_default_output(family, strategy):
    build, run, has_masks = FAMILIES[family]
    model = build()
    originals = {n: m.processor for n, m in model.named_modules() if hasattr(m, "set_processor")}
    n_processors = len(originals)
    for masks in (False, True) if has_masks else (False,):
        with torch.no_grad():
            ref = run(model, masks)
            applied = npu_attn.set_attention_strategy(model, strategy)
            assert npu_attn.attention_strategy_of(model) == {strategy: n_processors}
            strategies.reset_call_counts()
            out = run(model, masks)
            npu_attn.reset_attention_strategy(model)
        assert applied == strategy
        close(out, ref)
        counts = strategies.call_counts()
        classic_vanilla = all(type(p) is AttnProcessor2_0 for p in originals.values())
        if strategy in SERVED_BY and not (strategy == "vanilla" and classic_vanilla):
            assert counts.get(SERVED_BY[strategy], 0) > 0, counts
        if strategy == "tiled":
            assert "tiled->sdpa" not in counts, counts
    # reset restores the very same processor objects
    restored = {n: m.processor for n, m in model.named_modules() if hasattr(m, "set_processor")}
    assert restored.keys() == originals.keys()
    assert all(restored[n] is originals[n] for n in originals)


def test_vanilla_on_classic_attention_is_diffusers_attn_processor():
    unet = tiny_unet()
    npu_attn.set_attention_strategy(unet, "vanilla")
    assert all(type(p) is AttnProcessor for p in unet.attn_processors.values())
    assert npu_attn.attention_strategy_of(unet) == {"vanilla": len(unet.attn_processors)}
    npu_attn.set_attention_strategy(unet, "tiled")  # switching again wraps the originals
    assert npu_attn.attention_strategy_of(unet) == {"tiled": len(unet.attn_processors)}
    npu_attn.reset_attention_strategy(unet)
    assert all(type(p) is AttnProcessor2_0 for p in unet.attn_processors.values())


def test_matmul_processor_models_still_switch():
    unet = tiny_unet()
    unet.set_attn_processor(AttnProcessor())  # a user who had switched to vanilla already
    with torch.no_grad():
        ref = run_unet(unet)
        npu_attn.set_attention_strategy(unet, "tiled")
        out = run_unet(unet)
    close(out, ref)
    assert strategies.call_counts().get("tiled", 0) > 0
    npu_attn.reset_attention_strategy(unet)
    assert all(type(p) is AttnProcessor for p in unet.attn_processors.values())


def test_wrapped_processor_keeps_the_signature_diffusers_filters_on():
    unet = tiny_unet()
    before = {n: inspect.signature(p.__call__) for n, p in unet.attn_processors.items()}
    npu_attn.set_attention_strategy(unet, "tiled")
    after = {n: inspect.signature(p.__call__) for n, p in unet.attn_processors.items()}
    assert before == after


class GainProcessor(AttnProcessor2_0):
    """A processor with its own keyword, like IP-Adapter's ``ip_adapter_masks``."""

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        gain=1.0,
    ):
        out = super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, temb)
        return out * gain


def test_cross_attention_kwargs_pass_through_to_the_wrapped_processor(caplog):
    unet = tiny_unet()
    unet.set_attn_processor(GainProcessor())
    with torch.no_grad():
        ref = run_unet(unet, cross_attention_kwargs={"gain": 1.5})
        npu_attn.set_attention_strategy(unet, "tiled")
        out = run_unet(unet, cross_attention_kwargs={"gain": 1.5})
        plain = run_unet(unet)
    close(out, ref)
    assert float((out - plain).abs().max()) > 1e-3  # the keyword really reached the processor
    # Unknown keys are ignored with diffusers' own warning, as without npu_attn.
    with caplog.at_level(logging.WARNING), torch.no_grad():
        run_unet(unet, cross_attention_kwargs={"not_a_keyword": 1})
    assert "not_a_keyword" in caplog.text


def test_tiny_stable_diffusion_pipeline_matches_and_resets():
    unet, vae = tiny_unet(), tiny_vae()
    scheduler = DDIMScheduler(num_train_timesteps=1000)
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    embeds, negative = torch.randn(1, 9, 8, generator=g), torch.randn(1, 9, 8, generator=g)

    def generate():
        return pipe(
            prompt_embeds=embeds,
            negative_prompt_embeds=negative,
            num_inference_steps=3,
            guidance_scale=5.0,
            height=64,
            width=64,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        ).images

    originals = dict(unet.attn_processors)
    reference = generate()
    assert npu_attn.set_attention_strategy(pipe, "tiled") == "tiled"
    assert npu_attn.attention_strategy_of(pipe.vae) == {"tiled": 2}
    tiled = generate()
    assert strategies.call_counts().get("tiled", 0) > 0
    assert abs(tiled - reference).max() <= 1e-4
    npu_attn.reset_attention_strategy(pipe)
    assert all(unet.attn_processors[n] is p for n, p in originals.items())
    assert abs(generate() - reference).max() == 0


def test_float64_models_run_on_every_cpu_strategy(monkeypatch):
    # npu_attn's kernels take 16- and 32-bit floats: auto runs torch's SDPA for float64, and
    # the kernel strategies fall back to it with a one-time warning instead of failing.
    monkeypatch.setattr(strategies, "_fallback_warned", set())
    model = tiny_unet().double()
    inputs = {
        k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in unet_inputs(True).items()
    }
    with torch.no_grad():
        reference = model(**inputs).sample
        for strategy in ("auto", "tiled", "int8"):
            npu_attn.set_attention_strategy(model, strategy)
            if strategy == "auto":
                out = model(**inputs).sample
            else:
                with pytest.warns(RuntimeWarning, match="float64 inputs"):
                    out = model(**inputs).sample
            npu_attn.reset_attention_strategy(model)
            assert torch.allclose(out, reference, rtol=0, atol=1e-12), strategy


def test_auto_takes_the_masks_npu_attn_broadcasts():
    # 0-D and 1-D masks broadcast in npu_attn; torch's SDPA (auto's sdpa candidate) needs 2-D.
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 8)
    for mask in (torch.rand(12) > 0.3, torch.randn(12), torch.tensor(True)):
        expected = strategies.RUNNERS["tiled"](q, k, v, mask)
        for strategy in ("auto", "sdpa", "vanilla"):
            out = strategies.RUNNERS[strategy](q, k, v, mask)
            assert torch.allclose(out, expected, atol=1e-5), (strategy, mask.shape)


def test_auto_never_picks_vanilla_for_16_bit_inputs():
    # vanilla rounds 16-bit scores before the softmax: far less accurate than sdpa or tiled.
    q, k = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    assert "vanilla" in AutoSelector.candidates(q, k)
    for dtype in (torch.bfloat16, torch.float16):
        assert AutoSelector.candidates(q.to(dtype), k.to(dtype)) == ["tiled", "sdpa"]


def test_auto_measures_once_and_reuses_the_cached_choice(caplog):
    unet = tiny_unet()
    assert npu_attn.set_attention_strategy(unet, "auto") == "auto"
    with caplog.at_level(logging.INFO, logger="npu_attn"), torch.no_grad():
        first = run_unet(unet)
        measured = strategies.auto_selector.measurements
        second = run_unet(unet)
    assert measured > 0
    assert strategies.auto_selector.measurements == measured  # second call: cache only
    assert torch.equal(first, second)
    assert "npu_attn auto:" in caplog.text  # the choice is reported
    choices = strategies.auto_selector.choices()
    assert set(choices.values()) <= {"tiled", "sdpa", "vanilla"} and choices
    # A new process (fresh selector) reads the choices from the per-machine cache file.
    fresh = AutoSelector(strategies.RUNNERS.__getitem__)
    assert AutoSelector.cache_path().exists()
    for key, choice in choices.items():
        assert fresh.cached_choice(key)["choice"] == choice


def test_auto_measures_again_at_another_thread_count():
    """A choice measured at one thread count says nothing about another: the selector keeps
    choices per thread count (and kernel variant), in memory as in the cache file."""
    from npu_attn.runtime import controls

    selector = strategies.auto_selector
    q = torch.randn(1, 2, 96, 16)
    with controls.threads_for_run(1):
        selector(q, q, q)
        at_one = selector.measurements
        assert len(selector.choices()) == 1
    with controls.threads_for_run(2):
        assert selector.choices() == {}  # nothing measured at this count yet
        selector(q, q, q)
        assert selector.measurements == at_one + 1
    with controls.threads_for_run(1):
        selector(q, q, q)
        assert selector.measurements == at_one + 1  # kept for 1 thread
    selector.forget()
    assert selector.choices() == {}
    with controls.threads_for_run(1):
        selector(q, q, q)  # read back from the file, not measured
        assert selector.measurements == at_one + 1 and len(selector.choices()) == 1


def test_auto_measures_again_when_the_variant_of_the_inputs_dtype_changes(monkeypatch):
    """set_isa can change the variant that runs bfloat16 and leave float32's (a CPU that
    measured avx512 for float32 and amx_bf16 for bfloat16, then set_isa("avx512")): bfloat16
    choices measured under the old variant are not served under the new one, float32's are."""
    from npu_attn.runtime import controls

    selector = strategies.auto_selector
    selector.forget()
    real_active_isa = controls.active_isa
    bfloat16_variant = ["measured-variant"]

    def active_isa(dtype="float32"):
        return bfloat16_variant[0] if dtype == "bfloat16" else real_active_isa(dtype)

    monkeypatch.setattr(controls, "active_isa", active_isa)
    q32 = torch.randn(1, 2, 80, 16)
    q16 = q32.bfloat16()
    selector(q32, q32, q32)
    selector(q16, q16, q16)
    measured = selector.measurements
    assert len(selector.choices()) == 2
    bfloat16_variant[0] = "pinned-variant"
    assert len(selector.choices()) == 1  # float32's choice still holds
    selector(q32, q32, q32)
    assert selector.measurements == measured
    selector(q16, q16, q16)
    assert selector.measurements == measured + 1
    selector.forget()
    selector(q16, q16, q16)  # read back from the file, under the new variant's fingerprint
    assert selector.measurements == measured + 1


def test_unknown_and_unavailable_strategies_explain_themselves():
    unet = tiny_unet()
    with pytest.raises(ValueError, match="valid strategies: vanilla, sdpa, tiled, npu, auto"):
        npu_attn.set_attention_strategy(unet, "flash")
    with pytest.raises(ValueError, match="'npu' is unavailable: torch_npu is not installed"):
        npu_attn.set_attention_strategy(unet, "npu")
    assert npu_attn.attention_strategy_of(unet) == {"original": len(unet.attn_processors)}
    with pytest.raises(TypeError, match="diffusers pipeline"):
        npu_attn.set_attention_strategy("unet", "tiled")
    with pytest.raises(TypeError, match="unexpected options"):
        npu_attn.set_attention_strategy(unet, "tiled", speed="max")
    for not_a_name in (1, ["tiled"]):  # before: AttributeError: ... has no attribute 'strip'
        with pytest.raises(TypeError, match=r"strategy must be a str \(one of vanilla, sdpa"):
            npu_attn.set_attention_strategy(unet, not_a_name)
    assert npu_attn.attention_strategy_of(unet) == {"original": len(unet.attn_processors)}


def test_default_strategy_from_none_target_and_environment(monkeypatch, caplog):
    unet = tiny_unet()
    assert npu_attn.set_attention_strategy(None, "vanilla") == "vanilla"
    assert npu_attn.set_attention_strategy(unet) == "vanilla"
    npu_attn.reset_attention_strategy(None)
    monkeypatch.setenv("NPU_ATTN_STRATEGY", "tiled")
    assert npu_attn.set_attention_strategy(unet) == "tiled"
    monkeypatch.delenv("NPU_ATTN_STRATEGY")
    monkeypatch.setenv("DIFFUSERS_ATTENTION_TYPE", "sdpa")  # the seeds' variable
    from npu_attn.attention import config

    monkeypatch.setattr(config, "_alias_noted", False)
    with caplog.at_level(logging.WARNING, logger="npu_attn"):
        assert npu_attn.set_attention_strategy(unet) == "sdpa"
        npu_attn.set_attention_strategy(unet)
    assert caplog.text.count("diffusers itself never reads this variable") == 1
    with pytest.raises(ValueError, match="unknown attention strategy"):
        npu_attn.set_attention_strategy(None, "fastest")


def test_tiled_serves_autograd_with_the_same_gradients():
    unet = tiny_unet()
    run_unet(unet).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in unet.named_parameters() if p.grad is not None}
    unet.zero_grad(set_to_none=True)
    npu_attn.set_attention_strategy(unet, "tiled")
    run_unet(unet).square().mean().backward()  # e.g. LoRA fine-tuning on CPU
    counts = strategies.call_counts()
    assert counts.get("tiled", 0) > 0 and "tiled->sdpa" not in counts
    for name, grad in expected.items():
        got = dict(unet.named_parameters())[name].grad
        assert torch.allclose(got, grad, rtol=1e-3, atol=1e-6), name


def test_auto_under_autograd_chooses_by_forward_plus_backward():
    unet = tiny_unet()
    run_unet(unet).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in unet.named_parameters() if p.grad is not None}
    unet.zero_grad(set_to_none=True)
    npu_attn.set_attention_strategy(unet, "auto")
    run_unet(unet).square().mean().backward()
    training = {k: c for k, c in strategies.auto_selector.choices().items() if "fwd+bwd" in k}
    assert training and set(training.values()) <= {"tiled", "sdpa", "vanilla"}
    for name, grad in expected.items():
        got = dict(unet.named_parameters())[name].grad
        assert torch.allclose(got, grad, rtol=1e-3, atol=1e-6), name


def test_redirect_leaves_sdpa_outside_wrapped_processors_untouched():
    unet = tiny_unet()
    npu_attn.set_attention_strategy(unet, "vanilla")
    strategies.reset_call_counts()
    q = torch.randn(1, 2, 8, 4)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert strategies.call_counts() == {}
    assert torch.allclose(out, strategies.vanilla_attention(q, q, q), atol=1e-6)


def test_processors_look_their_runner_up_on_every_call():
    """A runner wrapped while the processors were made (the demo's attention timer) must not
    outlive its wrapper: the processors kept it, and any compiled graph of the model broke at
    the timer's time.perf_counter."""
    from npu_attn.tools.demo import time_attention

    unet = tiny_unet()
    spent, restore = time_attention("tiled")
    try:
        npu_attn.set_attention_strategy(unet, "tiled")
        with torch.no_grad():
            run_unet(unet)
        timed_calls = spent[1]
    finally:
        restore()
    strategies.reset_call_counts()
    with torch.no_grad():
        run_unet(unet)
    assert timed_calls > 0, "the processors did not reach the wrapped runner"
    assert spent[1] == timed_calls, "the removed wrapper still runs"
    assert strategies.call_counts().get("tiled", 0) > 0


def test_redirect_comes_back_when_torchs_function_is_put_back(monkeypatch):
    """Code that wraps F.scaled_dot_product_attention for a while and then restores the function
    it found (a call recorder) may have found torch's own, when npu_attn's first redirect was
    installed inside its window: the switched model must still reach its strategy after that,
    not fall silently through to torch."""
    from npu_attn.attention.backends.torch_sdpa import ORIGINAL_SDPA

    unet = tiny_unet()
    npu_attn.set_attention_strategy(unet, "tiled")
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", ORIGINAL_SDPA)
    strategies.reset_call_counts()
    with torch.no_grad():
        run_unet(unet)
    assert strategies.call_counts().get("tiled", 0) > 0
    assert torch.nn.functional.scaled_dot_product_attention is not ORIGINAL_SDPA


def test_compiled_model_reaches_its_strategy_when_torchs_function_is_put_back(monkeypatch):
    """The same, when torch.compile is what runs first after the restore: dynamo traces the
    wrapped processors, and the SDPA call it records must be the strategy's op, not torch's."""
    from npu_attn.attention.backends.torch_sdpa import ORIGINAL_SDPA

    unet = tiny_unet()
    npu_attn.set_attention_strategy(unet, "tiled")
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", ORIGINAL_SDPA)
    recorded = []

    def recording_backend(graph_module, example_inputs):
        recorded.extend(str(node.target) for node in graph_module.graph.nodes)
        return graph_module.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            run_unet(torch.compile(unet, backend=recording_backend))
    finally:
        torch._dynamo.reset()
    assert any("npu_attn.sdpa_forward" in target for target in recorded)
    assert not any("scaled_dot_product_attention" in target for target in recorded)
