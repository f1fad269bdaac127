"""npu_attn as a backend of diffusers' attention dispatcher (model.set_attention_backend).

Real diffusers (the pinned version) and its tiny Flux transformer, which computes attention
through dispatch_attention_fn; the outputs are compared with diffusers' own native backend.
"""

from __future__ import annotations

import enum

import pytest
import torch
from diffusers.models import attention_dispatch
from diffusers.models.attention_dispatch import AttentionBackendName, attention_backend

import npu_attn
from npu_attn.attention import strategies
from npu_attn.integration import dispatcher as diffusers_backend
from npu_attn.integration.wrapping import attention_modules
from test_graph_mode import attention_nodes, captured_call
from tiny_models import call_in_dtype, run_flux, tiny_flux


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    strategies.auto_selector.forget()
    strategies.reset_call_counts()
    torch._dynamo.reset()
    # model.set_attention_backend also sets diffusers' process-wide active backend: restored
    # here so the tests after these do not inherit it
    registry = attention_dispatch._AttentionBackendRegistry
    active = registry._active_backend
    yield
    registry.set_active_backend(active)
    torch._dynamo.reset()


def close(out, ref, tol):
    err = float((out.float() - ref.float()).abs().max())
    assert err <= tol * max(1.0, float(ref.abs().max())), f"max error {err:.3g}"


def test_registration_adds_names_and_leaves_diffusers_own_backends_alone():
    registry = attention_dispatch._AttentionBackendRegistry
    native = registry._backends[AttentionBackendName.NATIVE]
    before = set(AttentionBackendName.__members__)
    assert npu_attn.register_diffusers_backends() == ["npu_attn", "npu_attn_auto"]
    assert npu_attn.register_diffusers_backends() == ["npu_attn", "npu_attn_auto"]  # idempotent
    values = {m.value for m in AttentionBackendName.__members__.values()}
    assert {"npu_attn", "npu_attn_auto"} <= values
    assert set(AttentionBackendName.__members__) - before <= {"NPU_ATTN", "NPU_ATTN_AUTO"}
    assert AttentionBackendName("npu_attn") is AttentionBackendName.NPU_ATTN
    assert isinstance(AttentionBackendName.NPU_ATTN, AttentionBackendName)
    assert registry._backends[AttentionBackendName.NATIVE] is native
    assert "npu_attn" not in registry._supports_context_parallel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend, strategy", [("npu_attn", "tiled"), ("npu_attn_auto", None)])
def test_flux_through_the_dispatcher_equals_native_attention(backend, strategy, dtype):
    npu_attn.register_diffusers_backends()
    model = tiny_flux()
    args, kwargs = captured_call(model, run_flux, True)  # float32 inputs, then all in dtype
    model = model.to(dtype)
    args, kwargs = call_in_dtype(args, kwargs, dtype)
    with torch.no_grad():
        reference = model(*args, **kwargs).sample
        model.set_attention_backend(backend)
        strategies.reset_call_counts()
        out = model(*args, **kwargs).sample
    counts = strategies.call_counts()
    if strategy is not None:
        assert counts.get(strategy, 0) > 0, counts
    else:  # auto answers each shape with one of the strategies it measured
        assert sum(counts.values()) > 0, counts
    close(out, reference, 1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("other_backend", ["npu_attn", "npu_attn_auto"])
def test_a_switched_model_keeps_its_strategy_whatever_backend_another_model_set(other_backend):
    # diffusers' set_attention_backend on one model sets the process-wide active backend, which
    # processors without a backend of their own follow; a model switched with
    # set_attention_strategy runs its own strategy regardless.
    npu_attn.register_diffusers_backends()
    tiny_flux().set_attention_backend(other_backend)
    model = tiny_flux()
    original = [m.processor for _, m in attention_modules(model)]
    npu_attn.set_attention_strategy(model, "sdpa")
    strategies.reset_call_counts()
    with torch.no_grad():
        out = run_flux(model)
    counts = strategies.call_counts()
    assert counts.get("sdpa", 0) > 0 and counts.get("tiled", 0) == 0, counts
    with torch.no_grad():
        npu_attn.reset_attention_strategy(model)
        assert [m.processor for _, m in attention_modules(model)] == (original)
        assert all(p._attention_backend is None for p in original)  # the user's, unchanged
        strategies.reset_call_counts()
        reference = run_flux(model)  # now it follows the active backend, as diffusers does
    assert strategies.call_counts(), "the restored model should reach npu_attn's backend"
    close(out, reference, 1e-5)


def test_diffusers_context_manager_selects_npu_attn():
    npu_attn.register_diffusers_backends()
    model = tiny_flux()
    with torch.no_grad():
        reference = run_flux(model)
        with attention_backend("npu_attn"):
            out = run_flux(model)
    assert strategies.call_counts().get("tiled", 0) > 0
    close(out, reference, 1e-5)


def test_compiled_flux_runs_the_registered_op_in_one_graph_and_recompiles_on_switch():
    npu_attn.register_diffusers_backends()
    model = tiny_flux()
    args, kwargs = captured_call(model, run_flux, True)
    model.set_attention_backend("npu_attn")
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(*args, **kwargs)
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    nodes = attention_nodes(explanation)
    assert nodes["npu_attn"] > 0 and nodes["aten_sdpa"] == 0, nodes

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        tiled = compiled(*args, **kwargs).sample
        model.set_attention_backend("native")
        strategies.reset_call_counts()
        native = compiled(*args, **kwargs).sample
        assert strategies.call_counts().get("tiled", 0) == 0, "a stale npu_attn graph ran"
        eager = model(*args, **kwargs).sample
    close(tiled, eager, 1e-4)
    close(native, eager, 1e-4)


def test_the_backend_looks_its_runner_up_on_every_call():
    """A wrapper put around a strategy's runner and removed again (the demo's attention timer)
    must not stay in diffusers' registry, which is filled once per process: it did, when the
    registration happened under the timer, and every later compiled graph broke at the timer's
    time.perf_counter."""
    from npu_attn.tools.demo import time_attention

    model = tiny_flux()
    spent, restore = time_attention("tiled")
    try:
        npu_attn.register_diffusers_backends()  # maybe the first registration: under the timer
        model.set_attention_backend("npu_attn")
        with torch.no_grad():
            run_flux(model)
        timed_calls = spent[1]
    finally:
        restore()
    with torch.no_grad():
        run_flux(model)
    assert timed_calls > 0, "the backend did not reach the wrapped runner"
    assert spent[1] == timed_calls, "the removed wrapper still runs"


def test_what_the_backend_cannot_do_raises_clearly(monkeypatch):
    monkeypatch.setattr(strategies, "_fallback_warned", set())  # warnings are once per process
    npu_attn.register_diffusers_backends()
    fn = attention_dispatch._AttentionBackendRegistry._backends[AttentionBackendName.NPU_ATTN]
    q = torch.randn(1, 5, 2, 8)
    out = fn(q, q, q)
    close(
        out,
        torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in (q, q, q))
        ).transpose(1, 2),
        1e-5,
    )
    with pytest.raises(ValueError, match="return_lse=True"):
        fn(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="context parallelism"):
        fn(q, q, q, _parallel_config=object())
    with pytest.warns(RuntimeWarning, match="dropout_p > 0"):  # as the tiled strategy: says so
        fn(q, q, q, dropout_p=0.1)


def test_missing_dispatcher_internals_are_named(monkeypatch):
    monkeypatch.delattr(attention_dispatch, "_AttentionBackendRegistry")
    with pytest.raises(diffusers_backend.DiffusersBackendUnavailable, match="0.42.1"):
        npu_attn.register_diffusers_backends()


def test_enum_extension_on_a_fresh_enum():
    class Names(str, enum.Enum):
        A = "a"

    member = diffusers_backend._add_enum_member(Names, "B", "b")
    assert diffusers_backend._add_enum_member(Names, "B", "b") is member
    assert Names("b") is Names.B is member and member.value == "b" and member.name == "B"
    assert [m.value for m in Names] == ["a", "b"] and Names.__members__["B"] is member
    assert member == "b" and isinstance(member, str)
