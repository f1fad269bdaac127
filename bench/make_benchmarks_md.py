"""Assemble BENCHMARKS.md from the outputs of the benchmark commands it lists.

Usage (after running the commands in BENCHMARKS.md's header, which write bench_out/; the script
bench/run_all.sh runs all of them and then this):
    python bench/make_benchmarks_md.py bench_out > BENCHMARKS.md
The text around the tables (targets, profile notes) lives here so the numbers always come
straight from the logs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table_lines(log: Path) -> list[str]:
    lines = [
        line
        for line in log.read_text(encoding="utf-8").splitlines()
        if "attention cases" not in line
    ]
    keep = [line for line in lines if line.startswith(("|", "Machine:", "Geometric"))]
    return keep


def demo_table(results: Path) -> list[str]:
    rows = json.loads(results.read_text(encoding="utf-8"))
    out = [
        "| strategy | s / step | attention share | peak extra memory | latents rel. error vs "
        "sdpa | image PSNR vs sdpa |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = "-" if r["attention_share"] is None else f"{100 * r['attention_share']:.0f}%"
        if r["strategy"] == "sdpa" and r.get("label", "sdpa") == "sdpa":
            error = psnr = "reference"
        else:
            error = f"{r['latents_relative_error_vs_sdpa']:.1e}"
            value = r["image_psnr_db_vs_sdpa"]
            psnr = "identical" if value is None else f"{value:.1f} dB"
        out.append(
            f"| {r.get('label', r['strategy'])} | {r['seconds_per_step']:.2f} | {share} | "
            f"{r['peak_memory_bytes'] / 2**20:,.0f} MiB | {error} | {psnr} |"
        )
        if "one_time_measuring_seconds" in r:
            out.append(
                f"| (auto's one-time measuring: {r['one_time_measuring_seconds']:.1f} s, "
                f"{r['shapes_measured']} shapes) | | | | | |"
            )
    return out


def e2e_table(report: Path) -> list[str]:
    """The end-to-end table (python -m npu_attn bench --e2e --json ...)."""
    from npu_attn.bench_e2e import markdown

    return markdown(json.loads(report.read_text(encoding="utf-8"))).splitlines()


def images_table(report: Path) -> list[str]:
    """Seconds per image with Token Merging / DeepCache (bench --e2e --images N [--model sdxl]
    --json ...)."""
    from npu_attn.bench_e2e import images_markdown

    return images_markdown(json.loads(report.read_text(encoding="utf-8"))).splitlines()


def parallel_table(report: Path) -> list[str]:
    """CFG-parallel against one process (python -m npu_attn bench --parallel --json ...)."""
    from npu_attn.bench_parallel import markdown

    return markdown(json.loads(report.read_text(encoding="utf-8"))).splitlines()


def scaling_rows() -> list[str]:
    """The context-parallel communication model (computed, not measured)."""
    from npu_attn.bench_parallel import scaling_table

    return scaling_table()


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out")
    full = table_lines(root / "full.log")
    target = [line for line in table_lines(root / "target.log") if line.startswith("|")]

    def rows_and_mean(name):
        return [line for line in table_lines(root / name) if line.startswith(("|", "Geometric"))]

    bf16, fp16 = rows_and_mean("bf16.log"), rows_and_mean("fp16.log")
    bwd, bwd_bf16 = rows_and_mean("bwd.log"), rows_and_mean("bwd_bf16.log")
    e2e = e2e_table(root / "e2e_bf16.json")
    e2e_fp32 = e2e_table(root / "e2e_fp32.json")
    images = images_table(root / "images_bf16.json")
    images_fp32 = images_table(root / "images_fp32.json")
    images_sdxl = images_table(root / "images_sdxl_bf16.json")
    demo = demo_table(root / "demo_sd15_fp32" / "results.json")
    demo_bf16 = demo_table(root / "demo_sd15_bf16" / "results.json")
    parallel_fp32 = parallel_table(root / "parallel_fp32.json")
    parallel_bf16 = parallel_table(root / "parallel_bf16.json")
    text = Path(__file__).with_name("benchmarks_template.md").read_text(encoding="utf-8")
    for key, lines in (
        ("FULL", full),
        ("TARGET", target),
        ("BF16", bf16),
        ("FP16", fp16),
        ("BWD", bwd),
        ("BWD_BF16", bwd_bf16),
        ("DEMO", demo),
        ("E2E_BF16", e2e),
        ("E2E_FP32", e2e_fp32),
        ("IMAGES_BF16", images),
        ("IMAGES_FP32", images_fp32),
        ("IMAGES_SDXL_BF16", images_sdxl),
        ("DEMO_BF16", demo_bf16),
        ("PARALLEL_FP32", parallel_fp32),
        ("PARALLEL_BF16", parallel_bf16),
        ("PARALLEL_SCALING", scaling_rows()),
    ):
        text = text.replace(f"{{{key}}}", "\n".join(lines))
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
