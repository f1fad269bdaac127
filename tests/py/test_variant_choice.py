"""Which kernel variant runs each dtype: measured on this machine, cached per CPU, overridable,
and correct on CPUs with and without AMX / AVX512-BF16 / AVX-512 (emulated by masking the
detector with NPU_ATTN_DISABLE_FEATURES in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import npu_attn
from conftest import max_err, reference_sdpa
from npu_attn import _C
from npu_attn.runtime import variant_choice

COMPILED = npu_attn.runtime.build_info()["compiled_isas"]
X86 = "avx512" in COMPILED
# CPUs this project has met, as feature masks over a machine that has at least their features.
EMULATED_CPUS = {
    "zen4 (avx512_bf16, no amx)": "amx_tile,amx_bf16,avx_vnni",
    "skylake (avx512, no vnni or bf16)": "avx512_vnni,avx512_bf16,amx_tile,amx_bf16,avx_vnni",
    "haswell (avx2 only)": "avx512f,avx_vnni",
    "no simd": "avx2",
}


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture
def fresh_choice(tmp_path, monkeypatch):
    """An empty variant cache and no in-process decision; restored afterwards."""
    monkeypatch.setenv("NPU_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NPU_ATTN_ISA", raising=False)
    monkeypatch.delenv("NPU_ATTN_TUNE", raising=False)
    variant_choice.forget()
    yield tmp_path
    npu_attn.runtime.set_isa(None)
    variant_choice.forget()


def test_decide_keeps_the_fastest_and_splits_classes_only_beyond_the_margin():
    ms = {
        "self-attention": {"a": 1.0, "b": 2.0},
        "cross-attention": {"a": 1.0, "b": 0.95},  # within the margin: stays with a
        "large head dim": {"a": 1.5, "b": 1.0},  # clearly faster: b for this class
    }
    assert variant_choice.decide(ms) == {
        "self-attention": "a",
        "cross-attention": "a",
        "large head dim": "b",
    }
    assert set(variant_choice.decide({"x": {"a": 2.0, "b": 1.0}}).values()) == {"b"}


def test_candidates_are_one_per_distinct_kernel_and_runnable():
    runnable = set(npu_attn.runtime.available_isas())
    for dtype in variant_choice.DTYPES:
        names = variant_choice.candidates(dtype)
        assert names and set(names) <= runnable
        kernels = [
            next(r for r in _C.variants() if r["name"] == n)["forward_kernel"][dtype] for n in names
        ]
        assert len(kernels) == len(set(kernels)), "two candidates run the same code"
    if "amx_bf16" in runnable:
        assert "amx_bf16" in variant_choice.candidates("bfloat16")
        assert "amx_bf16" not in variant_choice.candidates("float32")  # its fp32 is avx512's


def test_first_use_measures_caches_and_applies_the_fastest(fresh_choice):
    for dtype in variant_choice.DTYPES:
        entry = variant_choice.tune(dtype)
        assert set(entry["choice"]) == set(_C.shape_classes())
        for shape_class, variant in entry["choice"].items():
            assert _C.active_isa(dtype, shape_class) == variant  # what C++ will run
        if len(variant_choice.candidates(dtype)) > 1:
            assert entry["source"].startswith("measured")
            for shape_class, per in entry["ms"].items():
                chosen = per[entry["choice"][shape_class]]
                # kept because it measured fastest (or within the class margin of it)
                assert chosen * (1 - variant_choice.CLASS_MARGIN) <= min(per.values())
    cache = json.loads((fresh_choice / "kernel_variants.json").read_text())
    assert set(cache[variant_choice.fingerprint()]) == set(variant_choice.DTYPES)
    variant_choice.forget()
    again = variant_choice.tune("float32")
    if len(variant_choice.candidates("float32")) > 1:
        assert again["source"].endswith("cached")


def test_backward_candidates_are_one_per_distinct_backward_kernel():
    runnable = set(npu_attn.runtime.available_isas())
    names = variant_choice.backward_candidates("bfloat16")
    assert names and set(names) <= runnable
    rows = {r["name"]: r for r in _C.variants()}
    kernels = [rows[n]["backward_from"] for n in names]
    assert len(kernels) == len(set(kernels)), "two candidates run the same backward"
    assert set(kernels) == {rows[n]["backward_from"] for n in runnable}, "a backward is missing"
    assert variant_choice.backward_candidates("float32") == []  # follows the forward
    if "amx_bf16" in runnable:
        assert rows["amx_bf16"]["backward_from"] == "amx_bf16"  # the AMX backward


def test_the_bfloat16_backward_is_measured_on_its_own_at_the_first_backward(fresh_choice):
    q, k, v = (torch.randn(1, 2, 70, 64, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    out = npu_attn.scaled_dot_product_attention(q, k, v)
    assert "bfloat16" in variant_choice._decided
    assert "bfloat16" not in variant_choice._decided_backward, "inference measured the backward"
    out.float().sum().backward()
    entry = variant_choice._decided_backward["bfloat16"]
    if len(variant_choice.backward_candidates("bfloat16")) < 2:
        assert entry["choice"] is None  # the forward's variant
        assert _C.active_backward_isa("bfloat16") == _C.active_isa("bfloat16")
        return
    assert set(entry["ms"]) == set(variant_choice.BACKWARD_SHAPES)
    assert entry["choice"] == variant_choice.decide_backward(entry["ms"])
    assert _C.active_backward_isa("bfloat16") == entry["choice"]  # what C++ will run
    cache = json.loads((fresh_choice / "kernel_variants.json").read_text())
    cached = cache[variant_choice.fingerprint()]["bfloat16 backward"]
    assert cached["choice"] == entry["choice"]
    variant_choice.forget()
    assert variant_choice.tune_backward("bfloat16")["source"].endswith("cached")
    # set_isa pins the backward too; None returns to the measured choice.
    npu_attn.runtime.set_isa("scalar")
    assert _C.active_backward_isa("bfloat16") == "scalar"
    npu_attn.runtime.set_isa(None)
    variant_choice.ensure("bfloat16", backward=True)
    assert _C.active_backward_isa("bfloat16") == entry["choice"]


def test_the_float32_backward_follows_the_forward(fresh_choice):
    entry = variant_choice.tune_backward("float32")
    assert entry["choice"] is None and "forward" in entry["source"]
    assert _C.active_backward_isa("float32") == _C.active_isa("float32")


def test_decide_backward_takes_the_lowest_geometric_mean():
    ms = {"head dim 64": {"x": 1.0, "y": 4.0}, "head dim 128": {"x": 4.4, "y": 1.0}}
    assert variant_choice.decide_backward(ms) == "y"  # geometric means 2.10 and 2.00


def test_the_kernel_call_uses_the_chosen_variant(fresh_choice):
    # The first kernel call of a dtype chooses that dtype's variant before it runs.
    q, k, v = torch.randn(1, 2, 70, 40), torch.randn(1, 2, 90, 40), torch.randn(1, 2, 90, 40)
    out = npu_attn.scaled_dot_product_attention(q, k, v)
    assert "float32" in variant_choice._decided, "a kernel call did not choose a variant"
    assert max_err(out, reference_sdpa(q, k, v)) <= 1e-5


def test_set_isa_pins_every_dtype_and_none_returns_to_the_measurement(fresh_choice):
    npu_attn.runtime.set_isa("scalar")
    for dtype in variant_choice.DTYPES:
        assert npu_attn.runtime.active_isa(dtype) == "scalar"
        assert npu_attn.runtime.kernel_variants()[dtype]["source"] == "set_isa()"
    npu_attn.runtime.set_isa(None)
    measured = variant_choice.tune("float32")
    assert npu_attn.runtime.active_isa("float32") == measured["choice"]["self-attention"]
    with pytest.raises(ValueError, match="isa must be one of"):
        npu_attn.runtime.set_isa("sse9")


def test_set_isa_none_cannot_undo_a_choice_made_while_it_runs(fresh_choice, monkeypatch):
    # A tune() in another thread lands while set_isa(None) is applying the rule: afterwards C++
    # must run what the recorded decision says (before the fix the rule overwrote it, and the
    # recorded decision kept ensure() from ever correcting that).
    rule_variant = _C.default_isa("float32")
    others = [name for name in npu_attn.runtime.available_isas() if name != rule_variant]
    if not others:
        pytest.skip("this CPU runs one variant: a racing choice could not differ from the rule")
    racing = others[0]
    # The racing tune() measures `racing` as the fastest variant in every shape class.
    timings = {c: {racing: 1.0, rule_variant: 2.0} for c in _C.shape_classes()}
    monkeypatch.setattr(variant_choice, "candidates", lambda dtype: [rule_variant, racing])
    monkeypatch.setattr(variant_choice, "measure", lambda dtype: timings)
    rule = variant_choice._rule_choice
    racers: list[threading.Thread] = []

    def rule_with_a_racing_tune(dtype: str) -> dict[str, str]:
        if not racers:
            racers.append(threading.Thread(target=variant_choice.tune, args=("float32",)))
            racers[0].start()
            racers[0].join(timeout=0.5)  # time for it to finish, unless set_isa holds the lock
        return rule(dtype)

    monkeypatch.setattr(variant_choice, "_rule_choice", rule_with_a_racing_tune)
    npu_attn.runtime.set_isa(None)
    racers[0].join()
    assert variant_choice._decided["float32"]["choice"]["self-attention"] == racing
    for shape_class in _C.shape_classes():
        assert _C.active_isa("float32", shape_class) == racing


@pytest.mark.skipif(not X86, reason="needs an x86 build (AVX2 masked off in the detector)")
def test_set_isa_of_a_variant_this_cpu_cannot_run_changes_nothing(tmp_path):
    # With AVX2 masked off, the avx2 variant is compiled but cannot run: set_isa must raise,
    # record no pin, and leave attention working on the variant it had.
    result = _run(
        """
        import torch, npu_attn
        from npu_attn.runtime import variant_choice
        q = torch.randn(1, 2, 33, 40)
        before = npu_attn.scaled_dot_product_attention(q, q, q)
        try:
            npu_attn.runtime.set_isa("avx2")
        except RuntimeError as e:
            print("raised:", e)
        assert variant_choice._pinned is None, variant_choice._pinned
        after = npu_attn.scaled_dot_product_attention(q, q, q)
        assert torch.equal(before, after)
        print("active", npu_attn.runtime.active_isa("float32"))
        """,
        NPU_ATTN_DISABLE_FEATURES="avx2",
        NPU_ATTN_CACHE_DIR=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert "raised:" in result.stdout and "avx2" in result.stdout
    assert "active scalar" in result.stdout


def test_environment_variable_forces_one_variant(tmp_path):
    result = _run(
        """
        import npu_attn
        v = npu_attn.runtime.kernel_variants()
        print(sorted({n for d in v.values() for n in d["choice"].values()}), v["float32"]["source"])
        """,
        NPU_ATTN_ISA="scalar",
        NPU_ATTN_CACHE_DIR=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['scalar'] NPU_ATTN_ISA=scalar"
    assert not (tmp_path / "kernel_variants.json").exists(), "a forced variant measured anyway"


def test_tuning_can_be_disabled(tmp_path):
    result = _run(
        "import npu_attn; print(npu_attn.runtime.kernel_variants()['bfloat16']['source'])",
        NPU_ATTN_TUNE="0",
        NPU_ATTN_CACHE_DIR=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "rule (NPU_ATTN_TUNE=0)"


@pytest.mark.skipif(not X86, reason="feature masks emulate x86-64 CPUs")
@pytest.mark.parametrize("cpu", sorted(EMULATED_CPUS))
def test_emulated_cpus_choose_only_what_they_can_run_and_stay_correct(cpu, tmp_path):
    """On a CPU without AMX / AVX512-BF16 / AVX-512 the variant list, the measured choice and
    the results (fp32 and bf16 vs float64) are right."""
    result = _run(
        """
        import json, torch, npu_attn
        from conftest import reference_sdpa
        q, k, v = (torch.randn(2, 3, n, 72) for n in (65, 77, 77))
        errs = {}
        for dt in (torch.float32, torch.bfloat16):
            out = npu_attn.scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt))
            errs[str(dt)] = float((out.double() - reference_sdpa(q, k, v)).abs().max())
        print(json.dumps({"runnable": npu_attn.runtime.available_isas(),
                          "variants": npu_attn.runtime.kernel_variants(), "errs": errs}))
        """,
        NPU_ATTN_DISABLE_FEATURES=EMULATED_CPUS[cpu],
        NPU_ATTN_CACHE_DIR=str(tmp_path),
        PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    masked = set(EMULATED_CPUS[cpu].split(","))
    if masked & {"amx_tile", "amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f", "avx2"}:
        assert "amx_bf16" not in report["runnable"]
    if masked & {"avx512_bf16", "avx512_vnni", "avx512f", "avx2"}:
        assert "avx512_bf16" not in report["runnable"]
    if masked & {"avx512f", "avx2"}:
        assert "avx512" not in report["runnable"]
    if masked & {"avx512_vnni", "avx512f", "avx2"}:
        assert "avx512_vnni" not in report["runnable"]
    if masked & {"avx_vnni", "avx2"}:
        assert "avx_vnni" not in report["runnable"]
    if "avx2" in masked:
        assert report["runnable"] == ["scalar"]
    for entry in report["variants"].values():
        assert set(entry["choice"].values()) <= set(report["runnable"])
    assert report["errs"]["torch.float32"] <= 1e-5
    assert report["errs"]["torch.bfloat16"] <= 3e-2


def test_unknown_feature_mask_is_a_clear_error():
    bad = _run("import npu_attn", NPU_ATTN_DISABLE_FEATURES="avx9000")
    assert bad.returncode != 0
    assert "NPU_ATTN_DISABLE_FEATURES: unknown CPU feature 'avx9000'" in bad.stderr


def test_rejected_thread_count_keeps_the_previous_setting():
    """Regression: set_num_threads(2**31) raised TypeError but stored the value, and every
    later call failed until set_num_threads(None)."""
    npu_attn.runtime.set_num_threads(None)
    before = npu_attn.runtime.get_num_threads()
    for bad, error in ((2**31, ValueError), (0, ValueError), (-3, ValueError), (2.0, TypeError)):
        with pytest.raises(error, match="threads"):
            npu_attn.runtime.set_num_threads(bad)
        assert npu_attn.runtime.get_num_threads() == before
    q = torch.randn(1, 2, 16, 8)
    assert max_err(npu_attn.scaled_dot_product_attention(q, q, q), reference_sdpa(q, q, q)) < 1e-5
