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
