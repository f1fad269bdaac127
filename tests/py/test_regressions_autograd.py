"""Regressions found by fuzzing: higher-order gradients, torch.compile of the backward, and
pickling a switched model.

1. ``torch.autograd.grad(..., create_graph=True)`` through the op returned a gradient with no
   graph, so a gradient penalty was silently dropped. Bound (float32 kernel vs torch's math
   backend in float64): max|grad - ref| <= 1e-4 * max(1, max|ref|), as for first-order grads.
2. ``torch.compile(fullgraph=True)`` with inputs that require grad failed tracing the backward
   (the kernel was called on FakeTensors); the backward is now a custom op with a fake.
3. ``torch.save``/``pickle`` of a model after ``set_attention_strategy`` failed: the wrapper
   processor classes are made at run time and could not be found by name.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

import npu_attn
from conftest import reference_sdpa
from npu_attn.attention import ops, strategies
from tiny_models import tiny_unet


def assert_close_to(a: torch.Tensor, ref: torch.Tensor, what) -> None:
    tol = 1e-4 * max(1.0, float(ref.abs().max()))
    err = float((a.double() - ref).abs().max())
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


# --------------------------------------------------------------------------- 1. double backward
DOUBLE_BACKWARD_CASES = [
    # Hq, Hkv, Lq, Lk, mask, causal
    (2, 2, 37, 45, None, False),
    (4, 2, 33, 33, "bool", True),  # GQA, bool mask and causal together
    (2, 2, 20, 30, "float_grad", False),  # a float mask that itself requires grad
]


def _double_backward(fn, q, k, v, mask, weights):
    """Gradients of a loss with a gradient penalty: L = sum(o^2) + sum(w * dL0/dq^2) + ..."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    if mask is not None and mask.requires_grad:
        mask = mask.detach().clone().requires_grad_(True)
        leaves.append(mask)
    out = fn(*leaves[:3], mask)
    first = torch.autograd.grad(out.pow(2).sum(), leaves, create_graph=True)
    assert all(g.requires_grad for g in first), "gradient returned without a graph"
    penalty = sum((w * g.pow(2)).sum() for w, g in zip(weights, first))
    (out.pow(2).sum() + penalty).backward()
    return [g.detach() for g in first], [t.grad for t in leaves]


@pytest.mark.parametrize("case", DOUBLE_BACKWARD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_double_backward_matches_torch_math_in_float64(case):
    hq, hkv, lq, lk, mask_kind, causal = case
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, hq, lq, 24, generator=g)
    k = torch.randn(2, hkv, lk, 24, generator=g)
    v = torch.randn(2, hkv, lk, 16, generator=g)
    mask = None
    if mask_kind == "bool":
        mask = (torch.rand(2, 1, lq, lk, generator=g) > 0.3) | torch.eye(lq, lk, dtype=torch.bool)
    elif mask_kind == "float_grad":
        mask = torch.randn(1, 1, lq, lk, generator=g).requires_grad_(True)
    shapes = [q.shape, k.shape, v.shape] + ([mask.shape] if mask_kind == "float_grad" else [])
    weights = [torch.rand(s, generator=g) for s in shapes]
    gqa = hq != hkv

    def ours(q, k, v, mask):
        return npu_attn.scaled_dot_product_attention(
            q, k, v, mask, is_causal=causal, enable_gqa=gqa
        )

    def ref(q, k, v, mask):
        return reference_sdpa(q, k, v, mask, causal, None, gqa)

    mine = _double_backward(ours, q, k, v, mask, weights)
    mask64 = None if mask is None or mask.dtype == torch.bool else mask.double()
    exact = _double_backward(
        ref,
        q.double(),
        k.double(),
        v.double(),
        mask if mask64 is None else mask64.requires_grad_(True),
        [w.double() for w in weights],
    )
    for order, mine_grads, exact_grads in zip(("first", "second"), mine, exact):
        assert len(mine_grads) == len(exact_grads)
        for name, a, r in zip(("dq", "dk", "dv", "dmask"), mine_grads, exact_grads):
            assert_close_to(a, r, f"{order}-order {name}")


def test_double_backward_through_the_log_sum_exp_output():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 21, 16, generator=g) for _ in range(3))
    weights = torch.rand(1, 2, 21, 16, generator=g)

    def penalised(q, k, v, attend):
        first = torch.autograd.grad(attend(q, k, v), q, create_graph=True)[0]
        (weights.to(first.dtype) * first.pow(2)).sum().backward()

    def ours(q, k, v):
        out, lse = torch.ops.npu_attn.sdpa_forward(q, k, v, None, True, None, False)
        return out.pow(2).sum() + 0.5 * lse.sum()

    def ref(q, k, v):
        scores = (q @ k.transpose(-1, -2) / 4.0).masked_fill(
            torch.ones(21, 21, dtype=torch.bool).triu(1), float("-inf")
        )
        return (torch.softmax(scores, -1) @ v).pow(2).sum() + 0.5 * torch.logsumexp(
            scores, -1
        ).sum()

    mine = [t.clone().requires_grad_(True) for t in (q, k, v)]
    exact = [t.double().requires_grad_(True) for t in (q, k, v)]
    penalised(*mine, ours)
    penalised(*exact, ref)
    for name, a, r in zip(("dq", "dk", "dv"), mine, exact):
        assert_close_to(a.grad, r.grad, name)


def test_first_order_backward_still_uses_the_kernel_and_builds_no_graph(monkeypatch):
    used = []
    real = ops.attention_backward
    monkeypatch.setattr(ops, "attention_backward", lambda *a, **k: used.append(1) or real(*a, **k))
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    grad_q = torch.autograd.grad(npu_attn.scaled_dot_product_attention(q, k, v).sum(), q)[0]
    assert used == [] and not grad_q.requires_grad


EAGER_VS_OP_CASES = [
    # Hq, Hkv, Lq, Lk, mask, causal, lse in the loss, double backward
    (2, 2, 37, 45, None, False, False, False),
    (4, 2, 33, 33, "bool", True, True, False),  # GQA, bool mask, causal, grad_lse
    (2, 2, 20, 30, "float", False, True, False),
    (2, 2, 20, 30, "float_grad", False, False, False),  # d(mask): the torch-ops backward
    (2, 1, 17, 21, None, True, True, True),  # create_graph: the torch-ops backward
]


@pytest.mark.parametrize("case", EAGER_VS_OP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_eager_autograd_and_the_registered_op_give_identical_gradients(case):
    # Eager calls take a plain autograd.Function (the op's dispatch costs more than a small
    # call); it must run the same kernels and gradient rule as the op torch.compile records.
    hq, hkv, lq, lk, mask_kind, causal, with_lse, double = case
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, hq, lq, 24, generator=g)
    k, v = (torch.randn(1, hkv, lk, 24, generator=g) for _ in range(2))
    mask = None
    if mask_kind == "bool":
        mask = (torch.rand(lq, lk, generator=g) > 0.3) | torch.eye(lq, lk, dtype=torch.bool)
    elif mask_kind is not None:
        mask = torch.randn(1, 1, lq, lk, generator=g)

    def gradients(attention):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        m = mask
        if mask_kind == "float_grad":
            m = mask.clone().requires_grad_(True)
            leaves.append(m)
        out, lse = attention(*leaves[:3], m)
        loss = out.square().sum() + (0.5 * lse.sum() if with_lse else 0)
        grads = torch.autograd.grad(loss, leaves, create_graph=double)
        if double:
            grads = torch.autograd.grad(sum(gr.square().sum() for gr in grads), leaves)
        return out, grads

    def eager(q, k, v, m):
        return npu_attn.scaled_dot_product_attention(
            q, k, v, m, is_causal=causal, enable_gqa=hq != hkv, return_lse=True
        )

    def registered_op(q, k, v, m):
        return torch.ops.npu_attn.sdpa_forward(q, k, v, m, causal, None, hq != hkv)

    out, mine = gradients(eager)
    assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
    _, theirs = gradients(registered_op)
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), mine, theirs):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_reentrant", "save_on_cpu"])
def test_activation_checkpointing_and_saved_tensor_hooks_give_the_same_gradients(how):
    # Training code recomputes attention in backward (checkpoint) or moves saved tensors
    # (saved-tensor hooks); the eager autograd.Function must behave like any torch op there.
    from torch.utils.checkpoint import checkpoint

    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 3, 33, 24, generator=g) for _ in range(3))

    def attention(q, k, v):
        return npu_attn.scaled_dot_product_attention(q, k, v, is_causal=True)

    def gradients(run):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        run(*leaves).square().sum().backward()
        return [t.grad for t in leaves]

    plain = gradients(attention)
    if how == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            other = gradients(attention)
    else:
        reentrant = how == "checkpoint_reentrant"
        other = gradients(lambda *t: checkpoint(attention, *t, use_reentrant=reentrant))
    for name, a, b in zip(("dq", "dk", "dv"), plain, other):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- 2. torch.compile
class MaskedSelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 96)

    def forward(self, x, mask):
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 4, 8).unbind(2)
        out = npu_attn.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, is_causal=True
        )
        return out.transpose(1, 2).reshape(x.shape)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_forward_and_backward_match_eager(backend, monkeypatch):
    torch.manual_seed(0)
    model = MaskedSelfAttention()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 50, 32, generator=g)
    mask = torch.rand(2, 1, 50, 50, generator=g) > 0.2
    grad_out = torch.randn(2, 50, 32, generator=g)

    def run(fn):
        model.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_(True)
        out = fn(leaf, mask)
        out.backward(grad_out)
        return [out.detach(), leaf.grad, *(p.grad for p in model.parameters())]

    eager = run(model)
    calls = []
    real = ops.backward_cpu
    monkeypatch.setattr(ops, "backward_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch._dynamo.reset()
    try:
        compiled = run(torch.compile(model, fullgraph=True, backend=backend))
    finally:
        torch._dynamo.reset()
    assert calls, "the compiled backward did not run npu_attn's backward kernel"
    for name, a, r in zip(("out", "dx", "dW", "db"), compiled, eager):
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-5), name


def test_backward_op_is_registered_with_a_fake_for_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q = mode.from_tensor(torch.empty(2, 6, 7, 16))
        k = mode.from_tensor(torch.empty(2, 3, 9, 16))
        v = mode.from_tensor(torch.empty(2, 3, 9, 24))
        out = mode.from_tensor(torch.empty(2, 6, 7, 24))
        lse = mode.from_tensor(torch.empty(2, 6, 7))
        dq, dk, dv = torch.ops.npu_attn.sdpa_backward(
            out, q, k, v, None, out, lse, None, False, None, True
        )
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()


# --------------------------------------------------------------------------- 3. pickling
@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    npu_attn.reset_attention_strategy(None)
    strategies.reset_call_counts()
    yield
    npu_attn.reset_attention_strategy(None)


def unet_inputs():
    g = torch.Generator().manual_seed(1)
    return {
        "sample": torch.randn(2, 4, 32, 32, generator=g),
        "timestep": torch.tensor(10),
        "encoder_hidden_states": torch.randn(2, 9, 8, generator=g),
    }


def _torch_roundtrip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _pickle_roundtrip(model):
    return pickle.loads(pickle.dumps(model))


def _run_served_by(model):
    strategies.reset_call_counts()
    with torch.no_grad():
        out = model(**unet_inputs()).sample
    return out, strategies.call_counts()


@pytest.mark.parametrize(
    "roundtrip", [_torch_roundtrip, _pickle_roundtrip], ids=["torch", "pickle"]
)
@pytest.mark.parametrize("strategy", ["tiled", "vanilla", "sdpa"])
def test_switched_unet_pickles_and_keeps_its_strategy(isolated, roundtrip, strategy):
    unet = tiny_unet()
    original_types = [type(p) for p in unet.attn_processors.values()]
    npu_attn.set_attention_strategy(unet, strategy)
    before, served = _run_served_by(unet)
    # vanilla on classic Attention modules is diffusers' own AttnProcessor (not counted)
    assert strategy == "vanilla" or served.get(strategy), served
    loaded = roundtrip(unet)
    assert loaded is not unet
    assert npu_attn.attention_strategy_of(loaded) == npu_attn.attention_strategy_of(unet)
    after, served_after = _run_served_by(loaded)
    assert served_after == served
    assert torch.allclose(after, before, rtol=0, atol=1e-6)
    # The loaded model still resets to (copies of) its original processors.
    npu_attn.reset_attention_strategy(loaded)
    assert npu_attn.attention_strategy_of(loaded) == {"original": len(original_types)}
    assert [type(p) for p in loaded.attn_processors.values()] == original_types


def test_deepcopy_and_state_dict_of_a_switched_unet_still_work(isolated):
    unet = tiny_unet()
    npu_attn.set_attention_strategy(unet, "tiled")
    before, _ = _run_served_by(unet)
    copied = copy.deepcopy(unet)
    assert npu_attn.attention_strategy_of(copied) == npu_attn.attention_strategy_of(unet)
    after, served = _run_served_by(copied)
    assert served.get("tiled") and torch.allclose(after, before, rtol=0, atol=1e-6)
    fresh = tiny_unet()
    fresh.load_state_dict(unet.state_dict())
    assert set(fresh.state_dict()) == set(unet.state_dict())


class GainProcessor(torch.nn.Module):
    """A processor that is an nn.Module with a weight (like IP-Adapter's)."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.tensor(1.5))
        self.base = AttnProcessor2_0()

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None
    ):
        residual = attn.residual_connection
        attn.residual_connection = False
        try:
            out = self.base(attn, hidden_states, encoder_hidden_states, attention_mask, temb)
        finally:
            attn.residual_connection = residual
        return self.gain * out + (hidden_states if residual else 0)


def test_switched_module_processors_pickle_with_their_weights(isolated):
    unet = tiny_unet()
    unet.set_attn_processor(GainProcessor())
    npu_attn.set_attention_strategy(unet, "tiled")
    before, served = _run_served_by(unet)
    assert served.get("tiled")
    loaded = _torch_roundtrip(unet)
    processors = list(loaded.attn_processors.values())
    assert all(isinstance(p, torch.nn.Module) and p.strategy == "tiled" for p in processors)
    assert all(float(p.inner.gain.detach()) == 1.5 for p in processors)
    assert any(k.endswith("inner.gain") for k in loaded.state_dict())
    after, served_after = _run_served_by(loaded)
    assert served_after == served and torch.allclose(after, before, rtol=0, atol=1e-6)


def test_a_pickle_naming_an_unknown_strategy_fails_to_load_clearly(isolated, monkeypatch):
    unet = tiny_unet()
    npu_attn.set_attention_strategy(unet, "tiled")
    saved = pickle.dumps(unet)
    monkeypatch.delitem(strategies.RUNNERS, "tiled")  # as an npu_attn without it would be
    with pytest.raises(ValueError, match="routes attention to strategy 'tiled', which this"):
        pickle.loads(saved)


LOAD_IN_A_FRESH_PROCESS = """
import json, sys, torch
saved = torch.load(sys.argv[1], weights_only=False)
from npu_attn import strategies, attention_strategy_of
with torch.no_grad():
    out = saved["model"](**saved["inputs"]).sample
print(json.dumps({
    "served": strategies.call_counts(),
    "strategy_of": attention_strategy_of(saved["model"]),
    "err": float((out - saved["expected"]).abs().max()),
}))
"""


def test_a_loaded_model_routes_attention_in_a_fresh_process(isolated, tmp_path):
    # A new process has not installed npu_attn's SDPA redirect: loading a switched model must
    # install it, or the model would silently run torch's SDPA.
    unet = tiny_unet()
    npu_attn.set_attention_strategy(unet, "tiled")
    expected, _ = _run_served_by(unet)
    path = tmp_path / "unet.pt"
    torch.save({"model": unet, "inputs": unet_inputs(), "expected": expected}, path)
    env = dict(os.environ, NPU_ATTN_CACHE_DIR=str(tmp_path / "cache"))
    package_root = os.path.dirname(os.path.dirname(npu_attn.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["strategy_of"] == npu_attn.attention_strategy_of(unet)
    assert report["served"].get("tiled") and "sdpa" not in report["served"], report
    assert report["err"] <= 1e-6, report
