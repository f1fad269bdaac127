"""The benchmark reports stay consistent with the script that runs the benchmarks.

bench/run_all.sh writes one machine's logs to bench_out/<machine>/; bench/make_benchmarks_md.py
turns them into bench/results/<machine>.md (--machine, from bench/machine_template.md) and merges
every machine's report into BENCHMARKS.md (--merge, from bench/benchmarks_template.md and
bench/changelog.md). Checked here: every placeholder of each template is filled by its mode,
every file the machine mode reads is one that run_all.sh writes (so a regeneration cannot
silently drop or break a section), the committed BENCHMARKS.md is what --merge makes of the
committed reports, and no document speaks of work sessions.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
RUN_ALL = (BENCH / "run_all.sh").read_text(encoding="utf-8")
PLACEHOLDER = re.compile(r"\{([A-Z0-9_]+)\}")
# What the repository's hook rejects in BENCHMARKS.md, README.md and docs/.
SESSION_WORDING = re.compile(
    r"\bsessions? [0-9]|(this|last|previous|earlier|next|same) session", re.IGNORECASE
)


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "make_benchmarks_md", BENCH / "make_benchmarks_md.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = load_generator()


@pytest.mark.parametrize(
    "template, mode",
    [("machine_template.md", "machine_report"), ("benchmarks_template.md", "merged_report")],
)
def test_every_template_placeholder_is_filled_by_its_mode(template, mode):
    placeholders = set(PLACEHOLDER.findall((BENCH / template).read_text(encoding="utf-8")))
    filled = set(re.findall(r'"([A-Z0-9_]+)":', inspect.getsource(getattr(GENERATOR, mode))))
    assert placeholders, "no placeholders found: the pattern no longer matches the template"
    assert placeholders == filled, (placeholders - filled, filled - placeholders)


def test_fill_refuses_a_missing_or_an_unused_value():
    with pytest.raises(KeyError):
        GENERATOR.fill("{A} {B}", {"A": "a"})
    with pytest.raises(KeyError):
        GENERATOR.fill("{A}", {"A": "a", "B": "b"})
    assert GENERATOR.fill("{A} {A}", {"A": "{B}"}) == "{B} {B}"


def test_every_file_the_machine_mode_reads_is_written_by_run_all():
    read = set(re.findall(r'root / "([\w.]+)"', inspect.getsource(GENERATOR.machine_report)))
    written = set(re.findall(r'"\$OUT/([\w.]+)', RUN_ALL))
    assert read, "no reads found: the pattern no longer matches the generator"
    assert read <= written, read - written


def test_run_all_writes_per_machine_and_merges_the_reports():
    assert re.search(r"^OUT=bench_out/\$SLUG$", RUN_ALL, re.MULTILINE)
    assert "machine_slug()" in RUN_ALL
    assert '--machine "$OUT" --into bench/results' in RUN_ALL
    assert "--merge bench/results" in RUN_ALL
    commands = [line for line in RUN_ALL.splitlines() if not line.startswith("#")]
    # every output goes under "$OUT" (or the machine's plot folder), none straight to bench_out/
    assert [line for line in commands if "bench_out/" in line] == ["OUT=bench_out/$SLUG"]


def test_every_machine_report_is_named_after_a_cpu_class():
    reports = sorted((BENCH / "results").glob("*.md"))
    assert reports, "bench/results/ holds no machine report"
    for path in reports:
        cpu_class, _ = GENERATOR.cpu_class(path.stem)  # raises for a name without a class
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", path.stem), path.name
        assert path.read_text(encoding="utf-8").startswith("# "), f"{path.name}: no title"
        assert not PLACEHOLDER.search(path.read_text(encoding="utf-8")), path.name


def test_the_sections_follow_the_cpu_classes_in_order():
    order = [GENERATOR.cpu_class(f"x-{c}")[0] for _, group in GENERATOR.SECTIONS for c in group]
    assert order == ["portable", "avx2", "avx512", "avx512-bf16", "amx"]
    assert GENERATOR.cpu_class("amd-epyc-avx2-emulated") == ("avx2", True)
    assert GENERATOR.cpu_class("intel-xeon-platinum-8480-amx") == ("amx", False)
    with pytest.raises(ValueError):
        GENERATOR.cpu_class("notes")


def test_benchmarks_md_is_the_merge_of_the_committed_reports():
    merged = GENERATOR.merged_report(BENCH / "results")
    assert not PLACEHOLDER.search(merged)
    committed = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert committed == merged, (
        "BENCHMARKS.md is out of date: "
        "python bench/make_benchmarks_md.py --merge bench/results > BENCHMARKS.md"
    )


def test_no_document_speaks_of_work_sessions():
    documents = [ROOT / "BENCHMARKS.md", *BENCH.glob("*.md"), *(BENCH / "results").glob("*.md")]
    for path in documents:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not SESSION_WORDING.search(line), f"{path.relative_to(ROOT)}:{number}: {line}"
