"""The report of ``python -m npu_attn bench``: the machine it ran on, the Markdown table and the
PNG plots.

Kept apart from :mod:`npu_attn.tools.bench`, which chooses the cases and times them: this
module only turns a finished report (a dict, also written as JSON) into what people read.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import platform
import re
from pathlib import Path
from typing import Optional

COMPETITORS = ("vanilla", "sdpa", "tiled", "int8")  # int8: lossy, forward only


DTYPES = ("float32", "bfloat16", "float16")


# The peak is the best of a few short probes: with 2 threads on a VM, one probe reads low
# whenever the hypervisor takes a vCPU for a moment (117 to 228 GFLOP/s back to back on one
# Zen 4 VM), and a low peak would overstate every "% of peak" in the report.
PEAK_PROBES = 3
PEAK_PROBE_SECONDS = 0.2


def measured_peak(isa: str, dtype: str, threads: int) -> float:
    """Peak GFLOP/s of the compute path variant ``isa`` uses for ``dtype``: the best of
    PEAK_PROBES probes (an upper bound is only ever under-measured)."""
    from ..runtime.extension import _C

    return max(_C.peak_gflops(isa, dtype, threads, PEAK_PROBE_SECONDS) for _ in range(PEAK_PROBES))


def compute_peaks(threads: int) -> dict:
    """Per dtype, the measured peak GFLOP/s of the compute path (fp32 FMA, vdpbf16ps, AMX
    tiles) that the variant running its self-attention here uses: the limit "% of peak" refers
    to. dtypes whose variants run one compute path (on an AVX2 CPU all three run fp32 FMA)
    share one peak, the best of all their probes: they measure the same units, and separate
    readings let one slow stretch of a VM halve a dtype's peak (94 against 179 GFLOP/s in one
    run) and put its rows over 100%."""
    from ..runtime import controls as _runtime
    from ..runtime.extension import _C

    rows = {v["name"]: v for v in _C.variants()}
    paths: dict[tuple[str, str], list[str]] = {}
    for dtype in DTYPES:
        isa = _runtime.active_isa(dtype)
        paths.setdefault((isa, rows[isa]["forward_kernel"][dtype]), []).append(dtype)
    peaks = {}
    for (isa, compute), dtypes in paths.items():
        gflops = round(max(measured_peak(isa, dtype, threads) for dtype in dtypes), 1)
        for dtype in dtypes:
            peaks[dtype] = {"variant": isa, "compute": compute, "gflops": gflops}
    return peaks


def machine_info(threads: int) -> dict:
    import torch

    from .._version import __version__
    from ..runtime import controls as _runtime

    isa = _runtime.active_isa("float32")
    variants = _runtime.kernel_variants()
    # per dtype: the measured peak of the compute path its self-attention variant runs on
    peaks = compute_peaks(threads)
    return {
        "cpu": _runtime.cpu_identity(),
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "kernel_isa": isa,
        # which variant runs each dtype and shape class, and why (measured / forced)
        "kernel_variants": {
            dtype: {"choice": v["choice"], "source": v["source"]} for dtype, v in variants.items()
        },
        "fma_peak_gflops": peaks["float32"]["gflops"],  # float32 runs on `isa`'s FMA path
        "peak_gflops": peaks,
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "npu_attn": __version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


# CPU generations by CPUID family and model range, for brand strings that do not name one
# (virtual machines show "AMD EPYC" or "Intel Xeon Processor" for every generation).
_GENERATIONS = {
    ("amd", 23): ((0x00, 0x2F, "zen1"), (0x30, 0xFF, "zen2")),
    ("amd", 25): (
        (0x00, 0x0F, "zen3"),
        (0x10, 0x1F, "zen4"),
        (0x20, 0x5F, "zen3"),
        (0x60, 0xAF, "zen4"),
    ),
    ("amd", 26): ((0x00, 0xFF, "zen5"),),
    ("intel", 6): (
        (85, 85, "skylake"),
        (106, 106, "ice-lake"),
        (108, 108, "ice-lake"),
        (143, 143, "sapphire-rapids"),
        (173, 173, "granite-rapids"),
        (207, 207, "emerald-rapids"),
    ),
}


def cpu_generation(brand: str, signature: str) -> str:
    """``zen3``, ``sapphire-rapids`` ... from the CPUID signature ("family 25 model 1 stepping
    1"); ``f25-m1`` for a family/model not in the table, "" without a signature."""
    found = re.search(r"family (\d+) model (\d+)", signature or "")
    if not found:
        return ""
    family, model = int(found.group(1)), int(found.group(2))
    vendor = "amd" if "amd" in brand.lower() else "intel" if "intel" in brand.lower() else ""
    for low, high, name in _GENERATIONS.get((vendor, family), ()):
        if low <= model <= high:
            return name
    return f"f{family}-m{model}"


def machine_slug(
    model: Optional[str] = None,
    features: Optional[list] = None,
    masked: Optional[bool] = None,
    signature: Optional[str] = None,
) -> str:
    """A file-name-safe name for this machine and its CPU class, e.g. ``amd-epyc-zen4-avx512-bf16``
    or ``intel-xeon-platinum-8480-amx``: the CPU's brand string without trademarks, clock and
    core count (plus the generation from the CPUID signature when the brand string names no
    model number), then the class of the best kernels it can run (``amx``, ``avx512-bf16``,
    ``avx512``, ``avx2`` or ``portable``), then ``-emulated`` when NPU_ATTN_DISABLE_FEATURES
    hides features (the class then is the emulated one). bench/run_all.sh writes its results
    under this name. Arguments default to this machine's (for tests).
    """
    if model is None:
        from ..runtime import controls as _runtime

        model = _runtime.cpu_model()
    if features is None or signature is None:
        from ..runtime.extension import _C

        info = _C.cpu_info()
        features = info["features"] if features is None else features  # masked already
        signature = info["signature"] if signature is None else signature
    if masked is None:
        masked = bool(os.environ.get("NPU_ATTN_DISABLE_FEATURES", "").strip(" ,"))
    noise = r"\((?:r|tm|c)\)|\b(?:cpu|processor)\b|@\s*[\d.]+\s*[gm]hz|\b\d+-core\b"
    name = re.sub(noise, " ", model.lower())
    name = re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cpu"
    generation = cpu_generation(model, signature)
    if generation and not re.search(r"\d", name):  # "amd-epyc": which one?
        name = f"{name}-{generation}"
    features = set(features)
    if "amx_bf16" in features:
        cpu_class = "amx"
    elif "avx512_bf16" in features:
        cpu_class = "avx512-bf16"
    elif "avx512f" in features:
        cpu_class = "avx512"
    elif "avx2" in features:
        cpu_class = "avx2"
    else:
        cpu_class = "portable"
    return f"{name}-{cpu_class}" + ("-emulated" if masked else "")


def geomean(values) -> float:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _fmt_mem(b: Optional[int]) -> str:
    if b is None:
        return "-"
    return f"{b / 2**20:,.0f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB"


def _time_cell(results: dict, name: str) -> str:
    x = results.get(name, {})  # reports from before a competitor existed lack it
    if "median_ms" not in x:
        return x.get("skipped", "-").replace("skipped: ", "")
    return f"{x['median_ms']:.1f} [{x['min_ms']:.1f}-{x['max_ms']:.1f}]"


def _variants_text(machine: dict) -> str:
    """e.g. "float32 `avx512`, bfloat16 `amx_bf16` (measured 2026-11-22 on 2 threads)"."""
    variants = machine.get("kernel_variants")
    if not variants:  # reports written before variants were chosen per dtype
        return f"`{machine['kernel_isa']}`"
    parts = []
    for dtype, v in variants.items():
        names = sorted(set(v["choice"].values()))
        parts.append(f"{dtype} `{'/'.join(names)}` ({v['source']})")
    return ", ".join(parts)


def _peaks_text(m: dict) -> str:
    peaks = m.get("peak_gflops") or {
        "float32": {"compute": "fp32 FMA", "gflops": m["fma_peak_gflops"]}
    }
    return ", ".join(f"{p['compute']} {p['gflops']:.0f} GFLOP/s ({d})" for d, p in peaks.items())


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs; {m['threads']} threads for "
        f"every competitor; npu_attn kernel variants {_variants_text(m)}; measured peaks "
        f"{_peaks_text(m)}; torch {m['torch']} (CPU capability "
        f"{m['torch_cpu_capability']}); {m['date']}.",
        "",
        "Times are medians of interleaved runs (min-max in brackets); speed-up is torch SDPA "
        "time / npu_attn tiled time; memory is the peak RSS growth of one call in a fresh "
        "process (inputs excluded, output included). % of peak is relative to the measured "
        "peak of the compute path the dtype's self-attention variant runs on.",
        "",
        "| case | shape | vanilla ms | torch SDPA ms | npu_attn tiled ms | speed-up | "
        "tiled GFLOP/s | % of peak | peak mem vanilla / SDPA / tiled | "
        "int8 ms (lossy) | int8 vs tiled | int8 rel. L1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["cases"]:
        r = row["results"]
        cell = functools.partial(_time_cell, r)
        tiled = r["tiled"]
        mem = row.get("memory", {})
        lines.append(
            f"| {row['case']} | {row['dims']} | {cell('vanilla')} | {cell('sdpa')} | "
            f"{cell('tiled')} | {tiled.get('speedup_vs_sdpa', 0):.2f}x | "
            f"{tiled['gflops']:.0f} | {tiled['pct_peak']:.0f}% | "
            f"{_fmt_mem(mem.get('vanilla'))} / {_fmt_mem(mem.get('sdpa'))} / "
            f"{_fmt_mem(mem.get('tiled'))} | {cell('int8')} | {_int8_ratio(r)} | "
            f"{_int8_error(row)} |"
        )
    s = report["summary"]
    if math.isnan(s["geomean_speedup_models"]):  # e.g. --filter target: no model shape ran
        lines += ["", "No named model shape in this run, so no geometric mean over them."]
        return "\n".join(lines)
    lines += [
        "",
        f"Geometric-mean speed-up of npu_attn tiled over torch SDPA on the named model shapes: "
        f"**{s['geomean_speedup_models']:.2f}x** (slowest case {s['min_speedup_models']:.2f}x, "
        f"{s['min_speedup_case']}).",
    ]
    if s.get("geomean_int8_vs_tiled_models"):
        lines += [
            "",
            f"int8 (lossy, opt-in) over tiled on the named model shapes: "
            f"**{s['geomean_int8_vs_tiled_models']:.2f}x** geometric mean "
            f"(slowest {s['min_int8_vs_tiled_models']:.2f}x). Relative L1 is against torch "
            "SDPA on the benchmark's Gaussian inputs (the accuracy on diffusion-like "
            "activations is in docs/int8-attention.md); rows marked \"exact kernel\" are too "
            "small to gain from quantizing (too few scores per head, or fewer than 128 keys), "
            "shorter than the length from which the int8 kernel measured faster on this CPU, "
            "or in a dtype whose exact kernel measured faster at every length (`doctor` shows "
            "those choices), and int8 runs the exact kernel there.",
        ]
    return "\n".join(lines)


def _int8_ratio(results: dict) -> str:
    """tiled time / int8 time, or "-" where int8 did not run."""
    tiled, int8 = results.get("tiled", {}), results.get("int8", {})
    if "median_ms" not in tiled or "median_ms" not in int8:
        return "-"
    return f"{tiled['median_ms'] / int8['median_ms']:.2f}x"


def _int8_error(row: dict) -> str:
    error = row.get("int8_relative_l1")
    if error is None:
        return "-"
    return f"{error:.1e} (exact kernel)" if row.get("int8_runs_exact_kernel") else f"{error:.1e}"


def plot(report: dict, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["cases"] if r["group"] == "sweep"]
    if not rows:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    lengths = [int(r["dims"].split("Lq")[1].split()[0]) for r in rows]
    written = []
    for what, key, ylabel in (
        ("time", "median_ms", "milliseconds per call"),
        ("memory", None, "peak extra memory (MiB)"),
    ):
        if key is None and not any(r.get("memory") for r in rows):
            continue  # --no-memory: nothing to plot
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in COMPETITORS:
            xs, ys = [], []
            for n, r in zip(lengths, rows):
                if key is None:
                    value = r.get("memory", {}).get(name)
                    value = None if value is None else value / 2**20
                else:
                    value = r["results"][name].get(key)
                if value is not None:
                    xs.append(n)
                    ys.append(value)
            if xs:
                ax.plot(xs, ys, marker="o", label={"tiled": "npu_attn tiled"}.get(name, name))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (B1 H8 D64 self-attention)")
        ax.set_ylabel(ylabel)
        m = report["machine"]
        ax.set_title(f"{what}: {m['threads']} threads, {m['cpu'][:40]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        path = directory / f"bench_{what}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
