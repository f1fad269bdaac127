"""The torch op: autograd, torch.compile, float16/bfloat16, and backend routing.

Gradient bound (float32 kernel + the C++ float32 backward kernel vs torch's math backend in
float64): max|grad - ref| <= 1e-4 * max(1, max|ref|).
Low-precision bar (flash-attention's): max|out - ref64| <= 2 * max|torch_same_dtype - ref64|.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import npu_attn
from conftest import reference_sdpa
from npu_attn.attention import ops

GRAD_CASES = [
    # B, Hq, Hkv, Lq, Lk, D, Dv, mask, causal
    (2, 2, 2, 37, 53, 40, 40, None, False),
    (1, 4, 2, 64, 64, 72, 72, "bool", True),
    (2, 2, 1, 130, 77, 59, 32, "float", False),
    (1, 2, 2, 300, 300, 64, 64, "keypad", True),
    (1, 1, 1, 1, 5, 8, 8, None, False),
    (2, 2, 2, 70, 77, 80, 80, "float", True),  # cross-attention shape, odd head dim
    (1, 3, 3, 1, 1, 64, 64, None, False),  # length 1
]


def make(case, dtype=torch.float32, seed=0):
    b, hq, hkv, lq, lk, d, dv, mask_kind, causal = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, lk, dv, generator=g, dtype=dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, lq, lk, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(lq, lk, generator=g, dtype=dtype)
    elif mask_kind == "keypad":
        mask = torch.ones(b, 1, 1, lk, dtype=torch.bool)
        mask[..., lk - 17 :] = False
    return q, k, v, mask, causal


def grads(fn, q, k, v, mask, causal, grad_out):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, mask, causal)
    out.backward(grad_out)
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gradients_match_torch_math_in_float64(case):
    q, k, v, mask, causal = make(case)
    gqa = case[1] != case[2]
    grad_out = torch.randn(
        case[0], case[1], case[3], case[6], generator=torch.Generator().manual_seed(9)
    )

    def ours(q, k, v, mask, causal):
        return npu_attn.scaled_dot_product_attention(
            q, k, v, mask, is_causal=causal, enable_gqa=gqa
        )

    def ref(q, k, v, mask, causal):
        return reference_sdpa(q, k, v, mask, causal, None, gqa)

    _, *mine = grads(ours, q, k, v, mask, causal, grad_out)
    _, *theirs = grads(ref, q.double(), k.double(), v.double(), mask, causal, grad_out.double())
    for name, a, r in zip(("dq", "dk", "dv"), mine, theirs):
        tol = 1e-4 * max(1.0, float(r.abs().max()))
        assert float((a.double() - r).abs().max()) <= tol, name


def test_autograd_runs_the_cpp_backward_kernel(monkeypatch):
    calls = []
    real = ops.backward_cpu
    monkeypatch.setattr(ops, "backward_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v, mask, causal = make(GRAD_CASES[1])
    q.requires_grad_(True)
    npu_attn.scaled_dot_product_attention(
        q, k, v, mask, is_causal=causal, enable_gqa=True
    ).sum().backward()
    assert calls == [1] and q.grad is not None


def test_gradients_of_non_contiguous_inputs():
    # (B, L, H, D) projections viewed as (B, H, L, D), the layout diffusers produces; the output
    # gradient arrives expanded (stride 0) from .sum().
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 90, 3, 40, generator=g).transpose(1, 2) for _ in range(3))
    (mine_q, mine_k, mine_v) = (t.clone().requires_grad_(True) for t in (q, k, v))
    npu_attn.scaled_dot_product_attention(
        mine_q.transpose(1, 2).transpose(1, 2), mine_k, mine_v
    ).sum().backward()
    ref = [t.double().requires_grad_(True) for t in (q, k, v)]
    reference_sdpa(*ref).sum().backward()
    for a, r in zip((mine_q, mine_k, mine_v), ref):
        assert float((a.grad.double() - r.grad).abs().max()) <= 1e-4 * max(
            1.0, float(r.grad.abs().max())
        )


def test_gradient_of_the_log_sum_exp_output():
    # torch.ops.npu_attn.sdpa_forward returns (out, lse); a loss using lse sends grad_lse to the
    # kernel, which folds it into Delta.
    q, k, v, mask, causal = make((1, 2, 1, 33, 45, 24, 24, "bool", True))
    mask = mask | torch.eye(33, 45, dtype=torch.bool)  # no fully masked row (lse = -inf)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, lse = torch.ops.npu_attn.sdpa_forward(q, k, v, mask, causal, None, True)
    (out.square().sum() + 0.5 * lse.sum()).backward()
    ref = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    kr, vr = (t.repeat_interleave(2, dim=1) for t in ref[1:])
    scores = ref[0] @ kr.transpose(-1, -2) / 24**0.5
    keep = mask & torch.ones(33, 45, dtype=torch.bool).tril()
    scores = scores.masked_fill(~keep, float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)
    ref_out = torch.softmax(scores, -1) @ vr
    (ref_out.square().sum() + 0.5 * ref_lse.sum()).backward()
    for a, r in zip((q, k, v), ref):
        assert float((a.grad.double() - r.grad).abs().max()) <= 1e-4 * max(
            1.0, float(r.grad.abs().max())
        )


@pytest.mark.parametrize("causal", [False, True])
def test_cpp_backward_agrees_with_finite_differences(causal):
    """Gradcheck-style check of the float32 kernel: the directional derivative of a float64
    loss, by central differences, against <gradient from the C++ backward, direction>."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 19, 24, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(19, 19, generator=g, dtype=torch.float64)
    weights = torch.randn(1, 2, 19, 24, generator=g, dtype=torch.float64)

    def loss(q, k, v):
        return float((reference_sdpa(q, k, v, mask, causal) * weights).sum())

    leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
    out = npu_attn.scaled_dot_product_attention(*leaves, mask.float(), is_causal=causal)
    (out * weights.float()).sum().backward()
    eps = 1e-4
    for i in range(3):
        direction = torch.randn(q.shape, generator=g, dtype=torch.float64)
        plus = [t.clone() for t in (q, k, v)]
        minus = [t.clone() for t in (q, k, v)]
        plus[i] += eps * direction
        minus[i] -= eps * direction
        numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
        analytic = float((leaves[i].grad.double() * direction).sum())
        assert abs(numeric - analytic) <= 1e-4 * max(1.0, abs(numeric)), (i, numeric, analytic)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_meet_the_flash_attention_bar(dtype):
    """max|grad - ref64| <= 2 * max|torch's same-dtype grad - ref64| for dQ, dK and dV."""
    for seed, case in enumerate(GRAD_CASES[:3]):
        q, k, v, mask, causal = make(case, dtype=dtype, seed=seed)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(dtype)
        gqa = case[1] != case[2]
        grad_out = torch.randn(case[0], case[1], case[3], case[6], dtype=dtype)

        def ours(q, k, v, mask, causal, gqa=gqa):
            return npu_attn.scaled_dot_product_attention(
                q, k, v, mask, is_causal=causal, enable_gqa=gqa
            )

        def theirs(q, k, v, mask, causal, gqa=gqa):
            if causal and mask is not None:  # torch refuses both: fold causal into the mask
                keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
                mask, causal = mask & keep, False
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
            )

        def ref(q, k, v, mask, causal, gqa=gqa):
            return reference_sdpa(q, k, v, mask, causal, None, gqa)

        _, *mine = grads(ours, q, k, v, mask, causal, grad_out)
        _, *torch_grads = grads(theirs, q, k, v, mask, causal, grad_out)
        _, *exact = grads(ref, q.double(), k.double(), v.double(), mask, causal, grad_out.double())
        for name, a, t, r in zip(("dq", "dk", "dv"), mine, torch_grads, exact):
            assert a.dtype == dtype
            ours_err = float((a.double() - r).abs().max())
            torch_err = float((t.double() - r).abs().max())
            assert ours_err <= 2 * torch_err + 1e-6, (case, name, ours_err, torch_err)


def test_float_mask_gradient():
    q, k, v, _, _ = make((1, 2, 2, 20, 30, 16, 16, None, False))
    bias = torch.randn(1, 1, 20, 30, requires_grad=True)
    npu_attn.scaled_dot_product_attention(q, k, v, bias).sum().backward()
    ref_bias = bias.detach().double().requires_grad_(True)
    reference_sdpa(q, k, v, ref_bias).sum().backward()
    assert torch.allclose(bias.grad.double(), ref_bias.grad, atol=1e-5)


class ReferenceForwardOurBackward(torch.autograd.Function):
    """float64 forward (torch math) + npu_attn's backward routine, for gradcheck."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal):
        out = reference_sdpa(q, k, v, mask, causal)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if mask is not None:
            scores = scores + mask
        if causal:
            scores = scores.masked_fill(
                torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf")
            )
        ctx.save_for_backward(q, k, v, mask, out, torch.logsumexp(scores, -1))
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        dq, dk, dv, dmask = ops.attention_backward(
            grad_out,
            q,
            k,
            v,
            mask,
            out,
            lse,
            ctx.causal,
            None,
            False,
            mask is not None and mask.requires_grad,
        )
        return dq, dk, dv, dmask, None


@pytest.mark.parametrize("causal", [False, True])
def test_backward_routine_passes_float64_gradcheck(causal):
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 2, 6, 5, dtype=torch.float64, generator=g, requires_grad=True)
        for _ in range(3)
    )
    mask = torch.randn(1, 1, 6, 6, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(ReferenceForwardOurBackward.apply, (q, k, v, mask, causal))


class TinyAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 4, 8).unbind(2)
        out = npu_attn.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2).reshape(x.shape)


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    model = TinyAttention().eval()
    x = torch.randn(2, 50, 32)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert torch.allclose(eager, compiled, atol=1e-6)


def _traced(tracer, model, example):
    if tracer == "make_fx":
        from torch.fx.experimental.proxy_tensor import make_fx

        return make_fx(model)(example)
    return torch.jit.trace(model, example, check_trace=False)


# jit.trace warns wherever Python reads a traced shape (the argument checks): expected there.
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("tracer", ["make_fx", "jit_trace"])
def test_traced_graphs_record_the_op_and_compute_on_new_inputs(tracer, grad):
    # A tracer records the torch ops that run. Called directly, the kernel reads memory through
    # DLPack, which a tracer does not see: make_fx under no_grad used to record the empty
    # output buffer, so the graph returned garbage for every input. Tracers now get the op.
    torch.manual_seed(0)
    model = TinyAttention().eval()
    example, fresh = torch.randn(2, 50, 32), torch.randn(2, 50, 32)
    with torch.set_grad_enabled(grad):
        traced = _traced(tracer, model, example)
    with torch.no_grad():
        assert torch.allclose(traced(fresh), model(fresh), atol=1e-6)
    if tracer == "make_fx":
        targets = [str(node.target) for node in traced.graph.nodes]
        assert "npu_attn.sdpa_forward.default" in targets


class _OpLog:
    """A TorchDispatchMode that records the name of every op that runs under it."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class OpLog(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.names = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.names.append(str(func))
                return func(*args, **(kwargs or {}))

        return OpLog()


def test_dispatch_modes_see_the_op_in_forward_and_backward():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = (torch.randn(2, 3, 7, 16) for _ in range(3))
    with FakeTensorMode() as mode:
        out = npu_attn.scaled_dot_product_attention(*(mode.from_tensor(t) for t in (q, k, v)))
    assert out.shape == (2, 3, 7, 16)
    with _OpLog() as log:
        logged = npu_attn.scaled_dot_product_attention(q, k, v)
    assert "npu_attn.sdpa_forward.default" in log.names
    assert torch.allclose(logged, reference_sdpa(q, k, v).float(), atol=1e-5)
    # A forward run eagerly, its backward under a mode: the backward op shows there too.
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = npu_attn.scaled_dot_product_attention(*leaves)
    with _OpLog() as log:
        out.sum().backward()
    assert "npu_attn.sdpa_backward.default" in log.names
    ref = [t.double().requires_grad_(True) for t in (q, k, v)]
    reference_sdpa(*ref).sum().backward()
    for a, r in zip(leaves, ref):
        assert torch.allclose(a.grad.double(), r.grad, atol=1e-4)


@pytest.mark.parametrize("transform", ["grad", "vjp"])
def test_func_transforms_over_closed_over_inputs_that_require_grad(transform):
    # The attention inputs come from outside the transform (not wrapped by it) and require
    # grad: the call still runs under the transform's interpreter, which takes the op.
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    expected = reference_sdpa(q.detach(), k, v).sum()

    def f(x):
        return (npu_attn.scaled_dot_product_attention(q, k, v) * x).sum()

    x = torch.tensor(2.0)
    if transform == "grad":
        got = torch.func.grad(f)(x)
    else:
        _, pullback = torch.func.vjp(f, x)
        (got,) = pullback(torch.tensor(1.0))
    assert abs(float(got.detach()) - float(expected)) < 1e-4


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_tensor_subclass_inputs_run_through_the_op(grad):
    # A __torch_dispatch__ wrapper holds no data of its own: DLPack would read the wrapper
    # (a segfault before), the op is unwrapped by the subclass and runs on the inner tensors.
    from torch.testing._internal.logging_tensor import LoggingTensor

    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    wrapped = [LoggingTensor(t.clone()) for t in (q, k, v)]
    wrapped[0].requires_grad_(grad)
    out = npu_attn.scaled_dot_product_attention(*wrapped)
    assert type(out) is LoggingTensor
    assert torch.allclose(out.elem, reference_sdpa(q, k, v).float(), atol=1e-5)
    if grad:
        out.sum().backward()
        ref_q = q.double().requires_grad_(True)
        reference_sdpa(ref_q, k, v).sum().backward()
        assert torch.allclose(wrapped[0].grad.elem.double(), ref_q.grad, atol=1e-4)


@pytest.mark.parametrize("heads_inside_sequence", [False, True], ids=["bhld", "blhd"])
def test_op_is_registered_with_a_fake_for_tracing(heads_inside_sequence):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def qkv():
        shapes = ((2, 3, 7, 16), (2, 3, 9, 16), (2, 3, 9, 24))
        if heads_inside_sequence:  # diffusers' projections viewed as heads
            return [torch.randn(b, n, h, d).transpose(1, 2) for b, h, n, d in shapes]
        return [torch.randn(*shape) for shape in shapes]

    q, k, v = qkv()
    real, _ = torch.ops.npu_attn.sdpa_forward(q, k, v, None, False, None, False)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out, lse = torch.ops.npu_attn.sdpa_forward(fq, fk, fv, None, False, None, False)
    assert out.shape == (2, 3, 7, 24) and lse.shape == (2, 3, 7)
    assert out.stride() == real.stride()  # the fake promises the real kernel's layout
    # Laid out like the query: free to view as (B, L, H * Dv) when the query came that way.
    assert out.transpose(1, 2).is_contiguous() == heads_inside_sequence
    assert out.is_contiguous() != heads_inside_sequence


@pytest.fixture(params=npu_attn.runtime.available_isas())
def each_isa(request):
    """Runs a test once per kernel variant this machine can run (bfloat16 has its own kernels
    on avx512_bf16 and amx_bf16), restoring the active variant afterwards."""
    npu_attn.runtime.set_isa(request.param)
    yield request.param
    npu_attn.runtime.set_isa(None)  # back to the measured choice


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_meets_the_flash_attention_bar(dtype, each_isa):
    for seed, case in enumerate(GRAD_CASES):
        q, k, v, mask, causal = make(case, dtype=dtype, seed=seed)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(dtype)
        gqa = case[1] != case[2]
        ref = reference_sdpa(q, k, v, mask, causal, None, gqa)
        ours = npu_attn.scaled_dot_product_attention(
            q, k, v, mask, is_causal=causal, enable_gqa=gqa
        )
        m, c = mask, causal
        if causal and mask is not None:  # torch's SDPA refuses both: fold causal into the mask
            keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            m, c = (
                (
                    mask & keep
                    if mask.dtype == torch.bool
                    else mask.masked_fill(~keep, float("-inf"))
                ),
                False,
            )
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c, enable_gqa=gqa)
        assert ours.dtype == dtype
        ours_err = float((ours.double() - ref).abs().max())
        torch_err = float((theirs.double() - ref).abs().max())
        assert ours_err <= 2 * torch_err + 1e-6, (case, ours_err, torch_err)


def test_backends_declare_support_and_explain_refusals():
    listing = {b["name"]: b for b in npu_attn.backends()}
    assert list(listing) == ["tiled", "npu", "sdpa", "vanilla", "int8"]
    assert listing["tiled"]["devices"] == ["cpu"] and listing["tiled"]["grad"]
    # The lossy int8 kernel runs only when named (test_int8_attention.py).
    assert listing["int8"]["opt_in"] and not listing["int8"]["grad"]
    assert not any(b["opt_in"] for name, b in listing.items() if name != "int8")
    assert listing["npu"]["available"] is False and "torch_npu" in listing["npu"]["reason"]
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    # float64 is not a tiled dtype: the automatic choice falls through to torch's SDPA ...
    out = npu_attn.scaled_dot_product_attention(q, q, q)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, q, q))
    # ... and forcing tiled explains why it cannot run.
    with pytest.raises(ValueError, match="backend 'tiled' cannot run this call: dtype float64"):
        npu_attn.scaled_dot_product_attention(q, q, q, backend="tiled")
    meta = torch.empty(1, 2, 8, 16, device="meta")
    with pytest.raises(ValueError, match="device meta not supported"):
        npu_attn.scaled_dot_product_attention(meta, meta, meta, backend="tiled")
    with pytest.raises(ValueError, match="torch_npu is not installed"):
        npu_attn.scaled_dot_product_attention(q.half(), q.half(), q.half(), backend="npu")
    with pytest.raises(ValueError, match="unknown backend"):
        npu_attn.scaled_dot_product_attention(q, q, q, backend="flash")


def test_non_cpu_tensors_are_routed_not_refused():
    # The meta device stands in for an accelerator: routed to torch's SDPA, shapes propagate.
    meta = torch.empty(2, 4, 10, 16, device="meta")
    out = npu_attn.scaled_dot_product_attention(meta, meta, meta)
    assert out.device.type == "meta" and out.shape == (2, 4, 10, 16)


@pytest.mark.parametrize("default", ["sdpa", "vanilla", "int8"])
def test_a_default_that_cannot_return_the_lse_is_ignored_for_it(default):
    # Only tiled returns the log-sum-exp: with return_lse=True another default is passed over,
    # as a default that cannot run a call is.
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    expected = npu_attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    try:
        npu_attn.set_attention_strategy(None, default)
        out, lse = npu_attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    finally:
        npu_attn.reset_attention_strategy(None)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


def test_ops_refuse_integer_masks_and_other_ranks():
    q = torch.randn(1, 2, 8, 16)
    keep = torch.rand(8, 8) > 0.5
    for op in (torch.ops.npu_attn.sdpa_forward, torch.ops.npu_attn.sdpa_forward_int8):
        with pytest.raises(TypeError, match="attn_mask must be bool or floating point"):
            op(q, q, q, keep.int(), False, None, False)
        with pytest.raises(ValueError, match="take 4-D"):
            op(q[0], q[0], q[0], None, False, None, False)


def test_exported_programs_load_after_importing_npu_attn(tmp_path):
    # torch.export.load resolves torch.ops.npu_attn.* while loading: importing npu_attn after
    # torch registers them, as a fresh process that only loads the program needs.
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return npu_attn.scaled_dot_product_attention(q, k, v)

    q = torch.randn(1, 2, 8, 16)
    program = torch.export.export(Attention(), (q, q, q))
    path = tmp_path / "attention.pt2"
    torch.export.save(program, str(path))
    code = (
        "import torch, npu_attn; q = torch.randn(1, 2, 8, 16); "
        f"print(tuple(torch.export.load({str(path)!r}).module()(q, q, q).shape))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(1, 2, 8, 16)"


def test_default_strategy_applies_to_the_function():
    q = torch.randn(1, 2, 8, 16)
    try:
        npu_attn.set_attention_strategy(None, "vanilla")
        from npu_attn.attention import strategies

        strategies.reset_call_counts()
        npu_attn.scaled_dot_product_attention(q, q, q)
        assert strategies.call_counts().get("vanilla") == 1
    finally:
        npu_attn.reset_attention_strategy(None)
