"""BENCHMARKS.md's generator stays consistent with the script that runs the benchmarks: every
placeholder of the template is filled, and every file the generator reads is one that
bench/run_all.sh writes (so a regeneration cannot silently drop or break a section)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = (ROOT / "bench" / "benchmarks_template.md").read_text(encoding="utf-8")
GENERATOR = (ROOT / "bench" / "make_benchmarks_md.py").read_text(encoding="utf-8")
RUN_ALL = (ROOT / "bench" / "run_all.sh").read_text(encoding="utf-8")


def test_every_template_placeholder_is_filled_by_the_generator():
    placeholders = set(re.findall(r"\{([A-Z0-9_]+)\}", TEMPLATE))
    filled = set(re.findall(r'\(\s*"([A-Z0-9_]+)",', GENERATOR))
    assert placeholders, "no placeholders found: the pattern no longer matches the template"
    assert placeholders == filled, (placeholders - filled, filled - placeholders)


def test_every_file_the_generator_reads_is_written_by_run_all():
    read = set(re.findall(r'root / "([\w.]+)"', GENERATOR))
    written = set(re.findall(r"bench_out/([\w.]+)", RUN_ALL))
    assert read, "no reads found: the pattern no longer matches the generator"
    assert read <= written, read - written
