"""Assemble the benchmark reports: one per machine, and BENCHMARKS.md from all of them.

Two modes (bench/run_all.sh runs both, after the benchmark commands):

    python bench/make_benchmarks_md.py --machine bench_out/<name> --into bench/results
        reads the logs and JSON the commands wrote to bench_out/<name>/ and writes that
        machine's report, bench/results/<name>.md, from bench/machine_template.md. <name> is
        npu_attn.tools.bench_report.machine_slug(): the CPU, its class, "-emulated" if masked.

    python bench/make_benchmarks_md.py --merge bench/results > BENCHMARKS.md
        writes BENCHMARKS.md from bench/benchmarks_template.md: every report in bench/results/,
        one section per CPU class (AVX2, AVX-512 and AVX512-BF16, AMX), then bench/changelog.md.

The numbers come straight from the logs; the text around them lives in the templates.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MACHINE_TEMPLATE = HERE / "machine_template.md"
MERGE_TEMPLATE = HERE / "benchmarks_template.md"
CHANGELOG = HERE / "changelog.md"

# The classes machine_slug() ends in, grouped into BENCHMARKS.md's sections, in this order.
SECTIONS = (
    ("CPUs without AVX2 (portable kernels)", ("portable",)),
    ("AVX2 CPUs", ("avx2",)),
    ("AVX-512 and AVX512-BF16 CPUs", ("avx512", "avx512-bf16")),
    ("AMX CPUs", ("amx",)),
)
CLASS_NAMES = {
    "portable": "portable kernels",
    "avx2": "AVX2",
    "avx512": "AVX-512",
    "avx512-bf16": "AVX512-BF16",
    "amx": "AMX",
}
# The environment variables that emulate a smaller CPU (bench/run_all.sh records them).
EMULATION_VARIABLES = (
    "NPU_ATTN_DISABLE_FEATURES",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
)


def fill(template: str, values: dict[str, str]) -> str:
    """``template`` with every ``{KEY}`` replaced; a placeholder without a value, or a value
    without a placeholder, is an error (so a section cannot be dropped silently)."""
    wanted = set(re.findall(r"\{([A-Z0-9_]+)\}", template))
    if wanted != set(values):
        raise KeyError(f"placeholders {sorted(wanted)} != values {sorted(values)}")
    return re.sub(r"\{([A-Z0-9_]+)\}", lambda m: values[m.group(1)], template)


def cpu_class(slug: str) -> tuple[str, bool]:
    """(class, emulated) from a machine_slug(): "amd-epyc-zen4-avx2-emulated" -> ("avx2", True)."""
    emulated = slug.endswith("-emulated")
    base = slug.removesuffix("-emulated")
    for name in sorted(CLASS_NAMES, key=len, reverse=True):
        if base == name or base.endswith("-" + name):
            return name, emulated
    raise ValueError(f"{slug!r} does not end in a CPU class ({', '.join(CLASS_NAMES)})")


# --- --machine: one machine's report from its bench_out directory --------------------------


def separated(lines: list[str]) -> list[str]:
    """``lines`` with a blank line between a table and the text around it (a text line right
    after a table would be read as one more row)."""
    out: list[str] = []
    for line in lines:
        if out and out[-1] and (line.startswith("|") != out[-1].startswith("|")):
            out.append("")
        out.append(line)
    return out


def table_lines(log: Path) -> list[str]:
    lines = [
        line
        for line in log.read_text(encoding="utf-8").splitlines()
        if "attention cases" not in line
    ]
    return [line for line in lines if line.startswith(("|", "Machine:", "Geometric"))]


def rows_and_mean(log: Path) -> list[str]:
    return separated([line for line in table_lines(log) if line.startswith(("|", "Geometric"))])


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
    from npu_attn.tools.bench_e2e import markdown

    return markdown(json.loads(report.read_text(encoding="utf-8"))).splitlines()


def images_table(report: Path) -> list[str]:
    """Seconds per image with Token Merging / DeepCache (bench --e2e --images N [--model sdxl]
    --json ...)."""
    from npu_attn.tools.bench_e2e import images_markdown

    return images_markdown(json.loads(report.read_text(encoding="utf-8"))).splitlines()


def parallel_table(report: Path) -> list[str]:
    """CFG-parallel against one process (python -m npu_attn bench --parallel --json ...)."""
    from npu_attn.tools.bench_parallel import markdown

    return markdown(json.loads(report.read_text(encoding="utf-8"))).splitlines()


def environment(path: Path) -> dict[str, str]:
    """The emulation variables bench/run_all.sh recorded (NAME=value lines)."""
    if not path.is_file():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text(encoding="utf-8").splitlines())
    return {k: v for k, v in (p for p in pairs if len(p) == 2) if k in EMULATION_VARIABLES and v}


def machine_header(slug: str, machine_line: str, env: dict[str, str]) -> tuple[str, str]:
    """The report's title and first paragraph: CPU, class, date, threads, emulation."""
    cls, emulated = cpu_class(slug)
    model = re.match(r"Machine: (.*?), \d+ logical CPUs", machine_line)
    threads = re.search(r"(\d+) threads for every competitor", machine_line)
    capability = re.search(r"CPU capability (\w+)", machine_line)
    date = re.search(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC", machine_line)
    model_text = model.group(1) if model else slug
    emulation = (
        "emulated: " + ", ".join(f"`{k}={v}`" for k, v in env.items())
        if env
        else "emulated"
        if emulated
        else "not emulated"
    )
    title = f"{model_text}, {CLASS_NAMES[cls]}" + (" (emulated)" if emulated else "")
    header = (
        f"The last `bash bench/run_all.sh` on this machine (`{slug}`): "
        f"{date.group(0) if date else 'date unknown'}, {model_text}, CPU class `{cls}`, "
        f"{threads.group(1) if threads else '?'} threads, torch CPU capability "
        f"{capability.group(1) if capability else '?'}; {emulation}. Each table's Machine line "
        "gives its own time and versions."
    )
    return title, header


def machine_report(root: Path) -> str:
    """The report of the machine whose bench_out directory is ``root``."""
    full = table_lines(root / "full.log")
    machine_line = next((line for line in full if line.startswith("Machine:")), "")
    title, header = machine_header(root.name, machine_line, environment(root / "environment.txt"))
    full = separated([line for line in full if line != machine_line])
    target = [line for line in table_lines(root / "target.log") if line.startswith("|")]
    values = {
        "TITLE": title,
        "HEADER": header,
        "SLUG": root.name,
        "FULL": "\n".join([machine_line, ""] + full),
        "TARGET": "\n".join(target),
        "BF16": "\n".join(rows_and_mean(root / "bf16.log")),
        "FP16": "\n".join(rows_and_mean(root / "fp16.log")),
        "BWD": "\n".join(rows_and_mean(root / "bwd.log")),
        "BWD_BF16": "\n".join(rows_and_mean(root / "bwd_bf16.log")),
        "DEMO": "\n".join(demo_table(root / "demo_sd15_fp32" / "results.json")),
        "DEMO_BF16": "\n".join(demo_table(root / "demo_sd15_bf16" / "results.json")),
        "E2E_BF16": "\n".join(e2e_table(root / "e2e_bf16.json")),
        "E2E_FP32": "\n".join(e2e_table(root / "e2e_fp32.json")),
        "IMAGES_BF16": "\n".join(images_table(root / "images_bf16.json")),
        "IMAGES_FP32": "\n".join(images_table(root / "images_fp32.json")),
        "IMAGES_SDXL_BF16": "\n".join(images_table(root / "images_sdxl_bf16.json")),
        "PARALLEL_FP32": "\n".join(parallel_table(root / "parallel_fp32.json")),
        "PARALLEL_BF16": "\n".join(parallel_table(root / "parallel_bf16.json")),
    }
    return fill(MACHINE_TEMPLATE.read_text(encoding="utf-8"), values)


# --- --merge: BENCHMARKS.md from every machine's report ------------------------------------


def demoted(text: str, levels: int) -> str:
    """Markdown ``text`` with every heading ``levels`` deeper (outside code blocks)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            line = "#" * levels + line
        out.append(line)
    return "\n".join(out)


def scaling_rows() -> list[str]:
    """The context-parallel communication model (computed, not measured)."""
    from npu_attn.tools.bench_parallel import scaling_table

    return scaling_table()


def machine_files(results: Path) -> list[tuple[str, list[Path]]]:
    """(section title, reports) for each CPU class present, in SECTIONS order."""
    files = sorted(results.glob("*.md"))
    classes = {f: cpu_class(f.stem) for f in files}
    order = [c for _, group in SECTIONS for c in group]
    sections = []
    for title, group in SECTIONS:
        members = [f for f in files if classes[f][0] in group]
        members.sort(key=lambda f: (order.index(classes[f][0]), classes[f][1], f.stem))
        if members:
            sections.append((title, members))
    return sections


def merged_report(results: Path) -> str:
    """BENCHMARKS.md: the template around every report in ``results`` and the changelog."""
    parts, index = [], []
    for title, members in machine_files(results):
        parts.append(f"## {title}")
        for path in members:
            # the reports link from bench/results/; BENCHMARKS.md sits two levels up
            text = path.read_text(encoding="utf-8").strip().replace("](../../", "](")
            parts.append(demoted(text, 2))
            heading = text.splitlines()[0].lstrip("# ")
            shown = path.resolve()
            if shown.is_relative_to(HERE.parent):
                shown = shown.relative_to(HERE.parent)
            index.append(f"- {title}: {heading} (`{shown}`)")
    values = {
        "MACHINE_LIST": "\n".join(index) or "- none yet: run `bash bench/run_all.sh`",
        "MACHINES": "\n\n".join(parts),
        "PARALLEL_SCALING": "\n".join(scaling_rows()),
        "CHANGELOG": demoted(CHANGELOG.read_text(encoding="utf-8").strip(), 1),
    }
    return fill(MERGE_TEMPLATE.read_text(encoding="utf-8"), values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--machine", type=Path, help="a bench_out/<name> directory")
    mode.add_argument("--merge", type=Path, help="the directory of machine reports")
    parser.add_argument("--into", type=Path, help="with --machine: where <name>.md goes")
    args = parser.parse_args(argv)
    if args.machine:
        if args.into is None:
            parser.error("--machine needs --into")
        args.into.mkdir(parents=True, exist_ok=True)
        path = args.into / f"{args.machine.resolve().name}.md"
        path.write_text(machine_report(args.machine.resolve()), encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(merged_report(args.merge))
    return 0


if __name__ == "__main__":
    sys.exit(main())
