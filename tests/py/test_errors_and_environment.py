"""Bad input raises a clear TypeError/ValueError naming the argument; never a crash.
Also: the NPU_ATTN_ISA override and the O(L) memory claim, each checked in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import npu_attn

sdpa = npu_attn.scaled_dot_product_attention


def qkv(b=1, h=2, lq=8, lk=10, d=16, dv=16, dtype=torch.float32):
    return (
        torch.randn(b, h, lq, d, dtype=dtype),
        torch.randn(b, h, lk, d, dtype=dtype),
        torch.randn(b, h, lk, dv, dtype=dtype),
    )


q0, k0, v0 = qkv()

BAD_CALLS = [
    # (description, call, exception, text that must appear in the message)
    # Any rank >= 2 works and batch sizes of 1 broadcast, as in torch; 1-D inputs and batch
    # sizes that cannot broadcast are errors (torch raises too).
    ("query rank", lambda: sdpa(q0[0, 0, 0], k0, v0), ValueError, "query must have at least 2"),
    ("key rank", lambda: sdpa(q0, k0[0, 0, 0], v0), ValueError, "key must have at least 2"),
    (
        "batch mismatch",
        lambda: sdpa(
            torch.randn(2, 2, 8, 16), torch.randn(3, 2, 10, 16), torch.randn(3, 2, 10, 16)
        ),
        ValueError,
        "batch",
    ),
    ("head_dim mismatch", lambda: sdpa(q0, torch.randn(1, 2, 10, 8), v0), ValueError, "head_dim"),
    ("value length", lambda: sdpa(q0, k0, torch.randn(1, 2, 9, 16)), ValueError, "value"),
    (
        "heads without gqa",
        lambda: sdpa(torch.randn(1, 4, 8, 16), k0, v0),
        ValueError,
        "enable_gqa=True",
    ),
    (
        "gqa not divisible",
        lambda: sdpa(torch.randn(1, 3, 8, 16), k0, v0, enable_gqa=True),
        ValueError,
        "multiple",
    ),
    ("int dtype", lambda: sdpa(*(t.int() for t in qkv())), TypeError, "dtype int32 not supported"),
    ("mixed dtypes", lambda: sdpa(q0.half(), k0, v0.half()), TypeError, "one dtype"),
    ("int query", lambda: sdpa(q0.int(), k0, v0), TypeError, "one dtype"),
    ("mask shape", lambda: sdpa(q0, k0, v0, torch.zeros(8, 9)), ValueError, "broadcast"),
    ("mask dtype", lambda: sdpa(q0, k0, v0, torch.zeros(8, 10).double()), TypeError, "attn_mask"),
    ("mask uint8", lambda: sdpa(q0, k0, v0, torch.zeros(8, 10, dtype=torch.uint8)), TypeError, ""),
    ("mask 5-D", lambda: sdpa(q0, k0, v0, torch.zeros(1, 1, 1, 8, 10)), ValueError, "at most 4"),
    ("mask type", lambda: sdpa(q0, k0, v0, [[True]]), TypeError, "attn_mask"),
    ("inf scale", lambda: sdpa(q0, k0, v0, scale=float("-inf")), ValueError, "scale"),
    ("backend type", lambda: sdpa(q0, k0, v0, backend=1), TypeError, "backend must be a string"),
    ("nan scale", lambda: sdpa(q0, k0, v0, scale=float("nan")), ValueError, "scale"),
    ("str scale", lambda: sdpa(q0, k0, v0, scale="1"), TypeError, "scale"),
    ("dropout", lambda: sdpa(q0, k0, v0, dropout_p=0.1), ValueError, "dropout_p"),
    ("is_causal type", lambda: sdpa(q0, k0, v0, is_causal=None), TypeError, "is_causal"),
    ("query type", lambda: sdpa([1.0], k0, v0), TypeError, "query must be a torch.Tensor"),
    ("mixed types", lambda: sdpa(q0, k0.numpy(), v0), TypeError, "key must be a torch.Tensor"),
    ("key None", lambda: sdpa(q0, None, v0), TypeError, "key must be a torch.Tensor"),
    ("value None", lambda: sdpa(q0, k0, None), TypeError, "value must be a torch.Tensor"),
    ("numpy float64", lambda: sdpa(*(t.double().numpy() for t in qkv())), TypeError, "float32"),
    ("device mix", lambda: sdpa(q0.to("meta"), k0, v0), ValueError, "one device"),
]


@pytest.mark.parametrize("call", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_clear_error(call):
    _, fn, exc, text = call
    with pytest.raises(exc) as info:
        fn()
    assert text in str(info.value)


def test_thread_settings_are_validated():
    with pytest.raises(ValueError, match="threads"):
        npu_attn.runtime.set_num_threads(0)
    with pytest.raises(TypeError, match="threads"):
        npu_attn.runtime.set_num_threads(1.5)
    with pytest.raises(ValueError, match="isa"):
        npu_attn.runtime.set_isa("sse9")


def _run_python(code: str, env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_isa_environment_override():
    for isa in npu_attn.runtime.available_isas():
        result = _run_python(
            "import npu_attn; print(npu_attn.runtime.active_isa())", {"NPU_ATTN_ISA": isa}
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == isa
    bad = _run_python("import npu_attn", {"NPU_ATTN_ISA": "avx9000"})
    assert bad.returncode != 0
    assert "NPU_ATTN_ISA='avx9000' is not a kernel variant" in bad.stderr


def test_isa_unsupported_by_cpu_is_a_clear_error():
    # Emulate a CPU without AVX-512 (NPU_ATTN_DISABLE_FEATURES masks the detector), so the test
    # means the same on every machine.
    compiled = npu_attn.runtime.build_info()["compiled_isas"]
    if "avx512" not in compiled:
        pytest.skip("this build has no avx512 variant (not an x86-64 build)")
    bad = _run_python(
        "import npu_attn", {"NPU_ATTN_ISA": "avx512", "NPU_ATTN_DISABLE_FEATURES": "avx512f"}
    )
    assert bad.returncode != 0 and "NPU_ATTN_ISA='avx512': this CPU cannot run it" in bad.stderr


@pytest.mark.slow
def test_memory_is_linear_in_sequence_length():
    """B1 H8 L16384 D64: the score matrix alone would be 8.6 GB; we must stay far below."""
    code = """
        import json, torch, npu_attn
        from npu_attn.runtime.memory import measure_peak
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 8, 16384, 64) for _ in range(3))
        with torch.no_grad():
            npu_attn.scaled_dot_product_attention(q[:, :, :64], k[:, :, :64], v[:, :, :64])
            with measure_peak() as m:
                out = npu_attn.scaled_dot_product_attention(q, k, v)
        ok = bool(torch.isfinite(out).all())
        print(json.dumps({"extra": m.extra_bytes, "exact": m.exact,
                          "ws": npu_attn.runtime.workspace_stats(), "ok": ok}))
    """
    result = _run_python(code, {})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    score_bytes = 8 * 16384 * 16384 * 4
    assert report["ok"] and report["exact"]
    # Output (32 MiB) + workspace; 1% of the score matrix is 86 MB.
    assert report["extra"] < 0.02 * score_bytes, report
    assert report["ws"]["peak_bytes"] < 0.01 * score_bytes, report


def test_numpy_output_is_written_in_place_only():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 4, 8), dtype=np.float32)
    before = q.copy()
    sdpa(q, q, q)
    assert np.array_equal(q, before)
