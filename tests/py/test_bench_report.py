"""The attention benchmark's report text (python -m npu_attn bench)."""

from __future__ import annotations

import os
import re

import pytest

from npu_attn.tools import bench_report


def report_without_model_rows() -> dict:
    """What ``bench --filter target`` produces: cases, none of them a named model shape."""
    machine = bench_report.machine_info(threads=1)  # this machine, peaks measured
    summary = {
        "geomean_speedup_models": float("nan"),
        "min_speedup_models": float("nan"),
        "min_speedup_case": "-",
    }
    return {"machine": machine, "cases": [], "summary": summary}


def test_a_run_without_model_shapes_says_so_instead_of_printing_nan():
    text = bench_report.markdown(report_without_model_rows())
    assert "No named model shape in this run" in text
    assert "nan" not in text.lower()


def test_the_peak_is_the_best_of_several_probes(monkeypatch):
    # A probe disturbed by the hypervisor reads low; the report's peak is the highest reading.
    readings = iter([150.0, 228.0, 201.0])
    calls = []

    def probe(isa, dtype, threads, seconds):
        calls.append((isa, dtype, threads))
        return next(readings)

    monkeypatch.setattr(bench_report, "PEAK_PROBES", 3)
    from npu_attn import _C

    monkeypatch.setattr(_C, "peak_gflops", probe)
    assert bench_report.measured_peak("avx2", "float32", 2) == 228.0
    assert calls == [("avx2", "float32", 2)] * 3


def test_dtypes_on_one_compute_path_share_its_best_peak(monkeypatch):
    # On an AVX2 CPU float32, bfloat16 and float16 all run the fp32 FMA path: one slow stretch
    # of a VM while bfloat16's probes ran must not halve bfloat16's peak (rows over 100%).
    from npu_attn import _C
    from npu_attn.runtime import controls

    monkeypatch.setattr(controls, "active_isa", lambda dtype: "avx2")
    readings = {"float32": 180.0, "bfloat16": 94.0, "float16": 94.0}
    monkeypatch.setattr(_C, "peak_gflops", lambda isa, dtype, threads, seconds: readings[dtype])
    peaks = bench_report.compute_peaks(threads=2)
    assert {dtype: peak["gflops"] for dtype, peak in peaks.items()} == {
        "float32": 180.0,
        "bfloat16": 180.0,
        "float16": 180.0,
    }
    assert {peak["compute"] for peak in peaks.values()} == {"avx2 fp32 FMA"}


def test_dtypes_on_different_compute_paths_keep_their_own_peaks(monkeypatch):
    # avx512_bf16 runs float32 on fp32 FMA and bfloat16 on vdpbf16ps: different units.
    from npu_attn import _C
    from npu_attn.runtime import controls

    variants = {v["name"]: v for v in _C.variants()}
    kernels = variants["avx512_bf16"]["forward_kernel"]
    assert kernels["float32"] != kernels["bfloat16"]
    monkeypatch.setattr(controls, "active_isa", lambda dtype: "avx512_bf16")
    readings = {"float32": 400.0, "bfloat16": 1500.0, "float16": 390.0}
    monkeypatch.setattr(_C, "peak_gflops", lambda isa, dtype, threads, seconds: readings[dtype])
    peaks = bench_report.compute_peaks(threads=2)
    assert peaks["bfloat16"]["gflops"] == 1500.0
    for dtype in ("float32", "float16"):
        if kernels[dtype] == kernels["float32"]:
            assert peaks[dtype]["gflops"] == 400.0


AMX_CPU = ["sse4.2", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]


SPR = "family 6 model 143 stepping 8"
ZEN1, ZEN3, ZEN4 = (
    "family 23 model 1 stepping 2",
    "family 25 model 1 stepping 1",
    "family 25 model 17 stepping 1",
)


@pytest.mark.parametrize(
    "model, features, masked, signature, slug",
    [
        ("Intel(R) Xeon(R) Platinum 8480+", AMX_CPU, False, SPR, "intel-xeon-platinum-8480-amx"),
        ("Intel(R) Xeon(R) Processor", AMX_CPU, False, SPR, "intel-xeon-sapphire-rapids-amx"),
        ("AMD EPYC 9R14 96-Core Processor", AMX_CPU[:6], False, ZEN4, "amd-epyc-9r14-avx512-bf16"),
        ("AMD EPYC", AMX_CPU[:6], False, ZEN4, "amd-epyc-zen4-avx512-bf16"),
        ("AMD EPYC", AMX_CPU[:5], False, "", "amd-epyc-avx512"),
        # one brand string, two generations: two reports, not one overwriting the other
        ("AMD EPYC", AMX_CPU[:4], False, ZEN3, "amd-epyc-zen3-avx2"),
        ("AMD EPYC", AMX_CPU[:4], False, ZEN1, "amd-epyc-zen1-avx2"),
        ("AMD EPYC", AMX_CPU[:4], False, "family 99 model 7 stepping 0", "amd-epyc-f99-m7-avx2"),
        # an AVX2 run emulated on a bigger CPU: the features are already masked
        ("AMD EPYC", AMX_CPU[:4], True, ZEN4, "amd-epyc-zen4-avx2-emulated"),
        (
            "Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz",
            AMX_CPU[:4],
            False,
            "family 6 model 158 stepping 10",
            "intel-core-i7-8700-avx2",
        ),
        ("aarch64", [], False, "variant 0x1 revision 1", "aarch64-portable"),
        ("", [], False, "", "cpu-portable"),
    ],
)
def test_the_machine_slug_names_the_cpu_and_its_class(model, features, masked, signature, slug):
    assert bench_report.machine_slug(model, features, masked, signature) == slug


def test_this_machines_slug_is_file_name_safe_and_names_its_class(monkeypatch):
    from npu_attn.runtime.extension import _C

    features = set(_C.cpu_info()["features"])
    expected = (
        "amx"
        if "amx_bf16" in features
        else "avx512-bf16"
        if "avx512_bf16" in features
        else "avx512"
        if "avx512f" in features
        else "avx2"
        if "avx2" in features
        else "portable"
    )
    masked = bool(os.environ.get("NPU_ATTN_DISABLE_FEATURES", "").strip(" ,"))
    slug = bench_report.machine_slug()
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", slug), slug
    assert slug.endswith(f"-{expected}" + ("-emulated" if masked else "")), slug
    # the emulation flag follows the environment variable the feature detector reads
    monkeypatch.setenv("NPU_ATTN_DISABLE_FEATURES", "amx_bf16")
    assert bench_report.machine_slug().endswith("-emulated")
    monkeypatch.setenv("NPU_ATTN_DISABLE_FEATURES", "")
    assert not bench_report.machine_slug().endswith("-emulated")


def test_int8_rows_the_exact_kernel_serves_are_marked(monkeypatch):
    from npu_attn.runtime import variant_choice
    from npu_attn.tools.bench import Case, int8_runs_exact_kernel

    # As measured on Sapphire Rapids: the exact bfloat16 kernel (AMX) is faster than int8;
    # float32's int8 kernel from 256 tokens (Zen 3), float16's from 512.
    min_tokens = {"bfloat16": None, "float32": 256, "float16": 512}
    monkeypatch.setattr(
        variant_choice,
        "int8_min_scores",
        lambda dtype: None if min_tokens[dtype] is None else min_tokens[dtype] ** 2,
    )
    # ...and, as on Zen 4 in bfloat16, float16's from head dim 64.
    monkeypatch.setattr(
        variant_choice, "int8_min_head_dim", lambda dtype: 64 if dtype == "float16" else 0
    )
    short, long = Case("8x8", 2, 8, 64, 64, 160), Case("16x16", 2, 8, 256, 256, 160)
    assert int8_runs_exact_kernel(short) and not int8_runs_exact_kernel(long)
    assert not int8_runs_exact_kernel(Case("64x64", 2, 8, 4096, 4096, 40))
    assert int8_runs_exact_kernel(Case("64x64", 2, 8, 4096, 4096, 40, dtype="float16"))
    assert int8_runs_exact_kernel(Case("16x16", 2, 8, 256, 256, 160, dtype="bfloat16"))
    assert int8_runs_exact_kernel(Case("16x16", 2, 8, 256, 256, 160, dtype="float16"))
    assert not int8_runs_exact_kernel(Case("32x32", 2, 8, 1024, 1024, 80, dtype="float16"))
    assert bench_report._int8_error({"int8_relative_l1": 5e-7, "int8_runs_exact_kernel": True}) == (
        "5.0e-07 (exact kernel)"
    )
    assert bench_report._int8_error({"int8_relative_l1": 8e-3}) == "8.0e-03"
    assert bench_report._int8_error({}) == "-"


@pytest.mark.parametrize("count", [2, 3, 4])
def test_competitors_follow_every_other_one_equally_often(monkeypatch, count):
    """What ran just before a short call changes its time, so the rounds' orders are balanced
    for the predecessor: over a full set of rounds each competitor runs right after each other
    one equally often (a fixed order gave the kernel column torch's SDPA as its predecessor in
    every round; a rotated one keeps the same neighbours)."""
    from npu_attn.tools import bench

    order = []
    names = ["vanilla", "sdpa", "tiled", "int8"][:count]
    fake = {n: (lambda q, k, v, n=n: order.append(n)) for n in names}
    monkeypatch.setattr(bench, "competitor_functions", lambda: fake)
    rounds = count if count % 2 == 0 else 2 * count
    times = bench.time_case(bench.Case("tiny", 1, 1, 4, 4, 8), names, rounds, warmup=0)
    assert {n: len(t) for n, t in times.items()} == dict.fromkeys(names, rounds)
    pairs = {(a, b): 0 for a in names for b in names if a != b}
    for start in range(0, len(order), count):
        one_round = order[start : start + count]
        assert sorted(one_round) == sorted(names)
        for before, after in zip(one_round, one_round[1:]):
            pairs[(before, after)] += 1
    assert len(set(pairs.values())) == 1, pairs


def test_skipped_competitors_never_run_and_the_report_says_why(monkeypatch, tmp_path, capsys):
    """``--skip vanilla,int8``: torch's unfused 16-bit attention takes minutes a call on CPUs
    without bfloat16 hardware; the run leaves it out and each row names the option."""
    import json

    import torch

    import npu_attn
    from npu_attn.tools import bench

    calls = []
    real = bench.competitor_functions()
    counted = {n: (lambda q, k, v, n=n: calls.append(n) or real[n](q, k, v)) for n in real}
    monkeypatch.setattr(bench, "competitor_functions", lambda: counted)
    monkeypatch.setattr(bench, "model_cases", lambda: [bench.Case("tiny self", 1, 2, 16, 16, 8)])
    threads = torch.get_num_threads()
    out = tmp_path / "report.json"
    args = ["--filter", "tiny", "--skip", "vanilla,int8", "--repeats", "2", "--no-memory"]
    args += ["--threads", str(threads + 1)]
    assert bench.main(args + ["--json", str(out), "--plots", str(tmp_path)]) == 0
    # the run's thread count is its own: torch's is restored, and npu_attn follows torch again
    assert torch.get_num_threads() == threads
    assert npu_attn.runtime.get_num_threads() == threads
    assert json.loads(out.read_text())["machine"]["threads"] == threads + 1
    assert set(calls) == {"sdpa", "tiled"}
    row = json.loads(out.read_text())["cases"][0]["results"]
    assert row["vanilla"] == {"skipped": "skipped: left out (--skip vanilla)"}
    assert row["int8"] == {"skipped": "skipped: left out (--skip int8)"}
    assert "left out (--skip vanilla)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--skip", "sdpa"])
    assert "cannot skip sdpa" in capsys.readouterr().err
    for option, value in (("--repeats", "0"), ("--threads", "0")):  # before: a traceback, or
        with pytest.raises(SystemExit) as exit_info:  # the default thread count silently
            bench.main([option, value])
        assert exit_info.value.code == 2
        assert f"argument {option}: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("backward", [False, True])
def test_the_bshd_layout_times_diffusers_strided_views(monkeypatch, tmp_path, backward):
    """``--layout bshd``: every competitor gets (B, H, L, D) views of (B, L, H, D) storage, as
    diffusers' processors pass them (rows heads * head_dim apart), and the rows say so; the
    default stays contiguous (B, H, L, D)."""
    import dataclasses
    import json

    import torch

    from npu_attn.tools import bench

    case = bench.Case("tiny self", 2, 3, 16, 20, 8, backward=backward)
    q, k, v = bench.make_inputs(case)
    assert q.is_contiguous() and k.shape == (2, 3, 20, 8)
    strided = bench.make_inputs(dataclasses.replace(case, layout="bshd"))
    for t, n in zip(strided, (16, 20, 20)):
        assert t.shape == (2, 3, n, 8) and t.stride() == (n * 3 * 8, 8, 3 * 8, 1)
        assert t.is_leaf and t.requires_grad == backward

    seen = []
    real = bench.competitor_functions()
    recording = {
        n: (lambda q, k, v, f=f: seen.append(q.stride()) or f(q, k, v)) for n, f in real.items()
    }
    monkeypatch.setattr(bench, "competitor_functions", lambda: recording)
    monkeypatch.setattr(bench, "model_cases", lambda: [case])
    threads = torch.get_num_threads()
    out = tmp_path / "report.json"
    args = ["--filter", "tiny", "--skip", "vanilla,int8", "--repeats", "1", "--no-memory"]
    args += ["--layout", "bshd", "--json", str(out), "--plots", str(tmp_path)]
    args += ["--backward"] if backward else []
    assert bench.main(args) == 0
    assert torch.get_num_threads() == threads  # bench restores the caller's count
    assert seen and set(seen) == {(16 * 3 * 8, 8, 3 * 8, 1)}
    row = json.loads(out.read_text())["cases"][0]
    assert row["dims"].endswith(" bshd") and row["max_abs_diff_tiled_vs_sdpa"] < 1e-5
    assert "--layout bshd" in json.loads(out.read_text())["command"]
