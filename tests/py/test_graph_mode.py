"""Graph mode: torch.compile runs the chosen strategy inside the compiled graph.

Graph breaks are counted with torch._dynamo.explain; compiled outputs are compared with eager
outputs of the same strategy. Most compiled runs use the aot_eager backend (dynamo + AOTAutograd,
the part that decides what the graph contains); a few use inductor, the default backend users
get, which takes ~40 s per tiny model to compile on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline

import npu_attn
from npu_attn.attention import ops, strategies
from tiny_models import FAMILIES, call_in_dtype, run_unet, tiny_unet, tiny_vae, unet_inputs

STRATEGIES = ["tiled", "sdpa", "vanilla", "auto"]
FULLGRAPH_FAMILIES = ["unet", "vae", "sd3", "flux"]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    strategies.auto_selector.forget()
    torch._dynamo.reset()
    strategies.reset_call_counts()
    yield
    torch._dynamo.reset()


def captured_call(model, run, masks):
    """The (args, kwargs) the family's runner passes to model.forward, so the compiled call
    gets exactly the eager inputs (built outside the traced region)."""
    seen = {}
    forward = model.forward

    def record(*args, **kwargs):
        seen["call"] = (args, kwargs)
        return forward(*args, **kwargs)

    model.forward = record
    try:
        with torch.no_grad():
            run(model, masks)
    finally:
        del model.forward
    return seen["call"]


def attention_nodes(explanation) -> dict[str, int]:
    kinds = {"npu_attn": 0, "aten_sdpa": 0}
    for graph in explanation.graphs:
        for node in graph.graph.nodes:
            if node.op != "call_function":
                continue
            target = str(node.target)
            if "npu_attn" in target:
                kinds["npu_attn"] += 1
            elif "scaled_dot_product_attention" in target:
                kinds["aten_sdpa"] += 1
    return kinds


def close(out, ref, dtype=torch.float32):
    tol = TOLERANCE[dtype] * max(1.0, float(ref.abs().max()))
    err = float((out.float() - ref.float()).abs().max())
    assert err <= tol, f"compiled vs eager: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FULLGRAPH_FAMILIES)
def test_switched_models_trace_in_one_graph_with_the_chosen_attention(family, strategy):
    build, run, masks = FAMILIES[family]
    model = build()
    args, kwargs = captured_call(model, run, masks)
    npu_attn.set_attention_strategy(model, strategy)
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(*args, **kwargs)
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    nodes = attention_nodes(explanation)
    if strategy == "tiled":  # the registered op, not torch's SDPA
        assert nodes["npu_attn"] > 0 and nodes["aten_sdpa"] == 0, nodes
    elif strategy == "sdpa":
        assert nodes["aten_sdpa"] > 0 and nodes["npu_attn"] == 0, nodes
    elif strategy == "vanilla":  # matmul -> softmax -> matmul
        assert nodes == {"npu_attn": 0, "aten_sdpa": 0}, nodes
    else:  # auto: a per-shape choice made while tracing, one of the two kernels
        assert nodes["npu_attn"] + nodes["aten_sdpa"] > 0, nodes
        assert strategies.auto_selector.choices(), "auto chose nothing while tracing"


def test_hidream_breaks_only_where_it_breaks_without_npu_attn():
    """HiDream's MoE routing (bincount, .item()) breaks dynamo's graph with or without
    npu_attn; the attention adds no break of its own."""
    build, run, masks = FAMILIES["hidream"]
    model = build()
    args, kwargs = captured_call(model, run, masks)
    with torch.no_grad():
        plain = torch._dynamo.explain(model)(*args, **kwargs)
        npu_attn.set_attention_strategy(model, "tiled")
        torch._dynamo.reset()
        switched = torch._dynamo.explain(model)(*args, **kwargs)
    assert switched.graph_break_count == plain.graph_break_count
    reasons = " ".join(str(b.reason) for b in switched.break_reasons)
    assert "ContextVar" not in reasons and "npu_attn" not in reasons
    assert attention_nodes(switched)["npu_attn"] > 0


@pytest.mark.parametrize(
    ("family", "strategy", "dtype"),
    [
        ("unet", "tiled", torch.float32),
        ("unet", "tiled", torch.bfloat16),
        ("unet", "auto", torch.float32),
        ("unet", "sdpa", torch.bfloat16),
        ("flux", "tiled", torch.float32),
        ("flux", "tiled", torch.bfloat16),
        ("sd3", "vanilla", torch.float32),
    ],
)
def test_compiled_output_equals_eager_with_masks(family, strategy, dtype):
    build, run, masks = FAMILIES[family]  # masks: UNet encoder mask, Flux joint mask
    model = build()
    args, kwargs = captured_call(model, run, masks)  # float32 inputs, then everything in dtype
    model = model.to(dtype)
    args, kwargs = call_in_dtype(args, kwargs, dtype)
    npu_attn.set_attention_strategy(model, strategy)
    with torch.no_grad():
        eager = model(*args, **kwargs).sample
        strategies.reset_call_counts()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        out = compiled(*args, **kwargs).sample
    close(out, eager, dtype)
    if strategy == "tiled":  # the kernel ran inside the compiled graph
        assert strategies.call_counts().get("tiled", 0) > 0


def test_inductor_compiles_tiled_unet_with_mask_and_matches_eager():
    model = tiny_unet()
    inputs = unet_inputs(masks=True)
    npu_attn.set_attention_strategy(model, "tiled")
    with torch.no_grad():
        eager = model(**inputs).sample
        strategies.reset_call_counts()
        out = torch.compile(model, fullgraph=True)(**inputs).sample
    close(out, eager)
    assert strategies.call_counts().get("tiled", 0) > 0


def test_switching_strategy_after_compiling_recompiles():
    """dynamo guards on the processors, so a switch takes effect on the next call."""
    model = tiny_unet()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        npu_attn.set_attention_strategy(model, "tiled")
        tiled = run_unet(compiled)
        assert strategies.call_counts().get("tiled", 0) > 0
        npu_attn.set_attention_strategy(model, "sdpa")
        strategies.reset_call_counts()
        sdpa = run_unet(compiled)
        assert strategies.call_counts().get("tiled", 0) == 0, "a stale tiled graph ran"
        npu_attn.reset_attention_strategy(model)
        eager_sdpa = run_unet(model)
        npu_attn.set_attention_strategy(model, "tiled")
        run_unet(compiled)
        assert strategies.call_counts().get("tiled", 0) > 0
    close(sdpa, eager_sdpa)
    close(tiled, eager_sdpa)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_backward_through_a_compiled_tiled_model(backend, monkeypatch):
    """LoRA-style fine-tuning on CPU: gradients of a compiled model equal eager ones, and the
    compiled backward runs npu_attn's backward kernel."""
    model = tiny_unet().train()
    npu_attn.set_attention_strategy(model, "tiled")
    params = [p for n, p in model.named_parameters() if "attn" in n and n.endswith("weight")]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)

    def loss_of(m):
        return run_unet(m, True).float().pow(2).mean()

    loss_of(model).backward()
    eager = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    calls = {"backward": 0}
    real = ops.backward_cpu

    def counting(*args, **kwargs):
        calls["backward"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "backward_cpu", counting)
    loss_of(torch.compile(model, fullgraph=True, backend=backend)).backward()
    assert calls["backward"] > 0
    for got, want in zip((p.grad for p in params), eager):
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-6)


def tiny_pipeline():
    return StableDiffusionPipeline(
        vae=tiny_vae(),
        text_encoder=None,
        tokenizer=None,
        unet=tiny_unet(),
        scheduler=DDIMScheduler(num_train_timesteps=1000),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def run_pipeline(pipe):
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 9, 8, generator=g)
    return pipe(
        prompt_embeds=embeds,
        negative_prompt_embeds=torch.zeros_like(embeds),
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="np",
        generator=torch.Generator().manual_seed(1),
    ).images


def test_compile_convenience_compiles_reports_and_resets(capsys):
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    npu_attn.set_attention_strategy(pipe, "tiled")
    eager = run_pipeline(pipe)
    # backend="eager": dynamo's graph capture without code generation, fast. (aot_eager fails on
    # diffusers' VAE decoder in torch 2.13 with or without npu_attn: "Expected
    # X.is_contiguous(memory_format)"; inductor works but takes ~40 s here.)
    applied = npu_attn.compile(pipe, "tiled", backend="eager", fullgraph=True)
    assert applied == {"unet": "tiled", "vae.decoder": "tiled"}
    assert npu_attn.compiled_components(pipe) == {"unet": None, "vae.decoder": None}
    strategies.reset_call_counts()
    out = run_pipeline(pipe)
    assert strategies.call_counts().get("tiled", 0) > 0
    assert abs(out - eager).max() <= 1e-4
    seconds = npu_attn.compiled_components(pipe)
    assert all(s is not None and s > 0 for s in seconds.values()), seconds
    err = capsys.readouterr().err
    assert "npu_attn.compile: unet compiled in" in err
    assert "npu_attn.compile: vae.decoder compiled in" in err
    npu_attn.reset_compile(pipe)
    assert pipe.unet._compiled_call_impl is None and pipe.vae.decoder._compiled_call_impl is None
    assert npu_attn.compiled_components(pipe) == {}
    assert abs(run_pipeline(pipe) - eager).max() <= 1e-6


def test_compile_rejects_what_it_cannot_compile():
    with pytest.raises(TypeError, match="diffusers pipeline or a torch.nn.Module"):
        npu_attn.compile(object())
    with pytest.raises(ValueError, match="unknown attention strategy"):
        npu_attn.compile(tiny_unet(), "fastest")


def test_frozen_compile_matches_eager_and_refuses_changed_weights():
    """freeze=True: inductor's freezing makes the weights constants of the graph, prepacked
    copies for convolutions and linears (proved by calling the compiled graph past the guard
    after the weights changed: it does not compute what the eager model now computes), so the
    guard refuses inference calls once the weights changed."""
    model = tiny_unet()
    inputs = unet_inputs(masks=True)
    npu_attn.set_attention_strategy(model, "tiled")
    with torch.no_grad():
        eager = model(**inputs).sample
        # An unfrozen graph of the same module compiled first must not be reused for the
        # frozen compile (dynamo's cache would find its guards satisfied).
        close(torch.compile(model, fullgraph=True)(**inputs).sample, eager)
        npu_attn.compile(model, "tiled", freeze=True, fullgraph=True, show_progress=False)
        strategies.reset_call_counts()
        close(model(**inputs).sample, eager)
        assert strategies.call_counts().get("tiled", 0) > 0
        close(model(**inputs).sample, eager)  # unchanged weights: calls go on
        for p in model.parameters():
            p.mul_(1.5)
        past_the_guard = model._compiled_call_impl.compiled(**inputs).sample
        with pytest.raises(npu_attn.FrozenWeightsChanged, match="reset_compile"):
            model(**inputs)
    npu_attn.reset_compile(model)
    with torch.no_grad():
        changed = model(**inputs).sample
    assert not torch.allclose(changed, eager, atol=1e-3)
    err = float((past_the_guard - changed).abs().max())
    assert err > 1e-3, "the frozen graph saw every new weight: freezing did not happen"


def test_freeze_needs_inductor():
    with pytest.raises(ValueError, match="freeze=True needs backend='inductor'"):
        npu_attn.compile(tiny_unet(), "tiled", freeze=True, backend="aot_eager")


def test_every_frozen_model_is_compiled_whatever_came_before():
    """dynamo keeps at most ``recompile_limit`` (8) graphs per code object and runs the code
    eagerly beyond that, with a log line only. Frozen graphs guard on their weights' identity:
    with one entry function for every frozen model, the ninth frozen model of a process (or the
    ninth input shape across them) ran eagerly. With a limit of 1 here, the second model must
    still compile."""
    from torch._dynamo.utils import counters

    models = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(2)]
    x = torch.randn(2, 8)
    graphs_before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        for model in models:
            npu_attn.compile(model, None, freeze=True, show_progress=False)
            model(x)
    assert counters["stats"]["unique_graphs"] - graphs_before == len(models)


def test_frozen_graphs_of_two_models_stay_apart():
    """Two models of one architecture with different weights, both frozen: each call computes
    with its own weights (a frozen graph's constants are not reused for another model)."""
    first, second = tiny_unet(), tiny_unet()
    with torch.no_grad():
        for p in second.parameters():
            p.mul_(1.25)
    inputs = unet_inputs(masks=False)
    with torch.no_grad():
        eager = [m(**inputs).sample for m in (first, second)]
        for m in (first, second):
            npu_attn.compile(m, "tiled", freeze=True, show_progress=False)
        for m, want in zip((first, second), eager):
            close(m(**inputs).sample, want)
