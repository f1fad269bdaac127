"""The attention benchmark's report text (python -m npu_attn bench)."""

from __future__ import annotations

from npu_attn import bench_report


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
