"""``python -m npu_attn bench``: which attention strategy wins on *this* machine.

Every competitor runs in this one process, on the same tensors, interleaved (round-robin after
a warm-up, in orders balanced for which one ran before), with the same thread count; the report
gives medians and spreads, the speed-up over torch's SDPA, GFLOP/s and the percentage of this
machine's peak for the compute path the dtype runs on (fp32 FMA, vdpbf16ps or AMX tiles, each
measured by a small C++ probe, not assumed). Peak memory is measured honestly: one fresh
subprocess per (case, strategy), reporting the growth of its peak RSS during one call.

Shapes are taken from real model configurations (batch 2 = classifier-free guidance):

- SD-1.5 at 512x512: 64x64 / 32x32 / 16x16 latents, 8 heads of 40 / 80 / 160, and
  cross-attention to 77 CLIP tokens.
- SD-2.1 at 768x768: 96x96 / 48x48 latents, head_dim 64 (5 / 10 heads), cross to 77.
- SDXL at 1024x1024: 64x64 / 32x32 latents, head_dim 64 (10 / 20 heads), cross to 77.
- SD3-medium at 1024x1024: joint attention over 4096 image + 333 text tokens, 24 heads of 64.
- Flux at 1024x1024: joint 4096 image + 512 text tokens, 24 heads of 128, batch 1 (guidance
  distilled, no CFG).
- HiDream-I1 at 1024x1024: 4096 image + 128 T5 + 128 Llama tokens (approximation of its
  concatenated text), 20 heads of 128.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from .arguments import at_least, on_requested_threads
from .bench_report import COMPETITORS, geomean, machine_info, markdown, plot
from .rounds import round_order

# Above this many bytes for one materialised score matrix, vanilla is skipped (it needs about
# three such buffers: scores, probabilities, and the softmax temporaries).
VANILLA_SCORE_LIMIT = 3 << 30


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    heads: int
    len_q: int
    len_k: int
    head_dim: int
    group: str = "model"  # "model" (named shapes), "target" or "sweep"
    dtype: str = "float32"
    backward: bool = False  # time forward + backward instead of forward only
    layout: str = "bhsd"  # storage: "bhsd" contiguous, "bshd" as diffusers' processors pass it

    @property
    def flops(self) -> float:
        """Forward: 4 B H Lq Lk D. Backward (recomputing P, then dV, dP, dQ, dK): 2.5x that."""
        forward = 4.0 * self.batch * self.heads * self.len_q * self.len_k * self.head_dim
        return forward * (3.5 if self.backward else 1.0)

    @property
    def score_bytes(self) -> int:
        return 4 * self.batch * self.heads * self.len_q * self.len_k

    @property
    def dims(self) -> str:
        extra = "" if self.dtype == "float32" else f" {self.dtype}"
        extra += " fwd+bwd" if self.backward else ""
        extra += "" if self.layout == "bhsd" else f" {self.layout}"
        return f"B{self.batch} H{self.heads} Lq{self.len_q} Lk{self.len_k} D{self.head_dim}{extra}"


def model_cases() -> list[Case]:
    return [
        Case("SD1.5 self 64x64", 2, 8, 4096, 4096, 40),
        Case("SD1.5 cross 64x64", 2, 8, 4096, 77, 40),
        Case("SD1.5 self 32x32", 2, 8, 1024, 1024, 80),
        Case("SD1.5 cross 32x32", 2, 8, 1024, 77, 80),
        Case("SD1.5 self 16x16", 2, 8, 256, 256, 160),
        # The UNet's mid-block: the shortest sequence with the largest head dim.
        Case("SD1.5 self 8x8", 2, 8, 64, 64, 160),
        Case("SD2.1 self 96x96", 2, 5, 9216, 9216, 64),
        Case("SD2.1 cross 96x96", 2, 5, 9216, 77, 64),
        Case("SD2.1 self 48x48", 2, 10, 2304, 2304, 64),
        Case("SDXL self 64x64", 2, 10, 4096, 4096, 64),
        Case("SDXL cross 64x64", 2, 10, 4096, 77, 64),
        Case("SDXL self 32x32", 2, 20, 1024, 1024, 64),
        Case("SD3-medium joint", 2, 24, 4429, 4429, 64),
        Case("Flux joint", 1, 24, 4608, 4608, 128),
        Case("HiDream joint", 2, 20, 4352, 4352, 128),
        # The VAE decoder's mid-block attention: one head over every latent pixel.
        Case("VAE mid-block 512px", 1, 1, 4096, 4096, 512),
        Case("VAE mid-block 1024px", 1, 1, 16384, 16384, 512),
    ]


def sweep_cases(lengths=(256, 512, 1024, 2048, 4096, 8192, 16384)) -> list[Case]:
    return [Case(f"sweep L{n}", 1, 8, n, n, 64, "sweep") for n in lengths]


def target_cases() -> list[Case]:
    """The shape the efficiency target is stated on (% of the measured FMA peak)."""
    return [Case("target B2 H8 L4096 D64", 2, 8, 4096, 4096, 64, "target")]


# --------------------------------------------------------------------------- competitors
def competitor_functions() -> dict[str, Callable]:
    import torch.nn.functional as F

    from ..attention import strategies
    from ..attention.functional import scaled_dot_product_attention

    def int8(q, k, v):
        return scaled_dot_product_attention(q, k, v, backend="int8")

    return {
        "vanilla": strategies.vanilla_attention,
        "sdpa": F.scaled_dot_product_attention,
        "tiled": scaled_dot_product_attention,
        "int8": int8,
    }


def make_inputs(case: Case, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    tensors = []
    for n in (case.len_q, case.len_k, case.len_k):
        if case.layout == "bshd":  # (B, L, H, D) storage viewed as (B, H, L, D), as diffusers'
            # processors call SDPA: rows heads * head_dim apart
            t = torch.randn(case.batch, n, case.heads, case.head_dim, generator=g).transpose(1, 2)
        else:
            t = torch.randn(case.batch, case.heads, n, case.head_dim, generator=g)
        tensors.append(t.to(dtype).detach().requires_grad_(case.backward))
    return tuple(tensors)


def call(fn, q, k, v, backward: bool):
    """One forward (under no_grad) or forward + backward."""
    import torch

    if not backward:
        with torch.no_grad():
            return fn(q, k, v)
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(torch.ones_like(out))
    return out


# Competitors `--skip` may leave out: torch's SDPA and tiled are the comparison itself.
OPTIONAL_COMPETITORS = ("vanilla", "int8")


def runnable(case: Case, name: str) -> Optional[str]:
    """None if `name` should run on `case`, else why it is skipped."""
    if name == "vanilla" and case.score_bytes > VANILLA_SCORE_LIMIT:
        return f"skipped: needs ~{3 * case.score_bytes / 2**30:.0f} GiB for scores"
    if name == "int8" and case.backward:
        return "skipped: forward only"
    return None


def time_case(case: Case, names, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call for each competitor, interleaved round-robin after a warm-up, each
    round in the order :func:`round_order` gives."""
    fns = competitor_functions()
    q, k, v = make_inputs(case)
    active = [n for n in names if runnable(case, n) is None]
    times: dict[str, list[float]] = {n: [] for n in active}
    for _ in range(warmup):
        for n in active:
            call(fns[n], q, k, v, case.backward)
    for round_index in range(repeats):
        for n in round_order(active, round_index):
            start = time.perf_counter()
            call(fns[n], q, k, v, case.backward)
            times[n].append(time.perf_counter() - start)
    return times


def int8_runs_exact_kernel(case: Case) -> bool:
    """Whether the int8 strategy gives this call to the exact kernel (too small to gain from
    quantizing, or a dtype whose exact kernel is faster on this CPU:
    ops.int8_runs_exact_kernel)."""
    import torch

    from ..attention import ops

    return ops.int8_runs_exact_kernel(
        case.len_q, case.len_k, getattr(torch, case.dtype), case.head_dim
    )


def check_agreement(case: Case, names=COMPETITORS) -> tuple[float, Optional[float]]:
    """Max |tiled - sdpa| on the case (a benchmark of a wrong kernel is worthless), and the
    lossy int8 kernel's relative L1 error against sdpa (None where it does not run)."""
    import torch

    fns = competitor_functions()
    q, k, v = make_inputs(case, seed=1)
    with torch.no_grad():
        ref = fns["sdpa"](q, k, v).float()
        diff = fns["tiled"](q, k, v).float() - ref
        int8_error = None
        if "int8" in names and runnable(case, "int8") is None:
            int8_error = float((fns["int8"](q, k, v).float() - ref).abs().sum() / ref.abs().sum())
    return float(diff.abs().max()), int8_error


# --------------------------------------------------------------------------- memory
_MEMORY_SNIPPET = """
import json, sys, torch, npu_attn
from npu_attn.runtime.memory import measure_peak
from npu_attn.tools.bench import Case, competitor_functions, make_inputs
case = Case(**json.loads(sys.argv[1])); name = sys.argv[2]
torch.set_num_threads(int(sys.argv[3]))
q, k, v = make_inputs(case)
fn = competitor_functions()[name]
from npu_attn.tools.bench import call
small = [t.detach()[:, :, :8].clone().requires_grad_(case.backward) for t in (q, k, v)]
call(fn, *small, case.backward)  # load lazily initialised code outside the window
with measure_peak() as m:
    call(fn, q, k, v, case.backward)
print(json.dumps({"peak_extra_bytes": m.extra_bytes, "exact": m.exact}))
"""


def measure_memory(case: Case, name: str, threads: int) -> Optional[int]:
    """Peak RSS growth of one call in a fresh process (None if it failed)."""
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SNIPPET, json.dumps(asdict(case)), name, str(threads)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if result.returncode != 0:
        return None
    return int(json.loads(result.stdout.strip().splitlines()[-1])["peak_extra_bytes"])


# --------------------------------------------------------------------------- machine
# --------------------------------------------------------------------------- run + report
def summarise(case: Case, times: dict[str, list[float]], peak: float) -> dict:
    row = {"case": case.name, "group": case.group, "dims": case.dims, "results": {}}
    sdpa_median = statistics.median(times["sdpa"]) if times.get("sdpa") else None
    for name in COMPETITORS:
        if name not in times:
            # not runnable on this case, or left out of the run (--skip)
            reason = runnable(case, name) or f"skipped: left out (--skip {name})"
            row["results"][name] = {"skipped": reason}
            continue
        t = sorted(times[name])
        median = statistics.median(t)
        gflops = case.flops / median / 1e9
        row["results"][name] = {
            "median_ms": median * 1e3,
            "min_ms": t[0] * 1e3,
            "max_ms": t[-1] * 1e3,
            "gflops": gflops,
            "pct_peak": 100.0 * gflops / peak,
            "speedup_vs_sdpa": (sdpa_median / median) if sdpa_median else None,
        }
    return row


@on_requested_threads
def run(args) -> dict:
    from tqdm import tqdm

    from ..runtime import controls as _runtime

    threads = _runtime.get_num_threads()  # set by on_requested_threads
    cases = model_cases() + target_cases() + sweep_cases()
    cases = [
        dataclasses.replace(c, dtype=args.dtype, backward=args.backward, layout=args.layout)
        for c in cases
    ]
    if args.quick:
        cases = [c for c in cases if c.flops <= 6e10]
    if args.filter:
        wanted = [w.strip().lower() for w in args.filter.split(",") if w.strip()]
        cases = [c for c in cases if any(w in c.name.lower() for w in wanted)]
    competitors = tuple(n for n in COMPETITORS if n not in args.skip)
    info = machine_info(threads)
    report = {
        "machine": info,
        "command": " ".join(["python -m npu_attn bench", *args.argv]),
        "cases": [],
    }
    for case in tqdm(cases, desc="attention cases", unit="case"):
        err, int8_error = check_agreement(case, competitors)
        times = time_case(case, competitors, args.repeats)
        row = summarise(case, times, info["peak_gflops"][case.dtype]["gflops"])
        row["max_abs_diff_tiled_vs_sdpa"] = err
        row["int8_relative_l1"] = int8_error
        row["int8_runs_exact_kernel"] = "int8" in competitors and int8_runs_exact_kernel(case)
        if not args.no_memory:
            row["memory"] = {
                n: measure_memory(case, n, threads)
                for n in competitors
                if runnable(case, n) is None
            }
        report["cases"].append(row)
    model_rows = [r for r in report["cases"] if r["group"] == "model"]
    speedups = [(r["results"]["tiled"]["speedup_vs_sdpa"], r["case"]) for r in model_rows]
    if speedups:
        worst = min(speedups)
        report["summary"] = {
            "geomean_speedup_models": geomean(s for s, _ in speedups),
            "min_speedup_models": worst[0],
            "min_speedup_case": worst[1],
        }
        int8_ratios = [
            r["results"]["tiled"]["median_ms"] / r["results"]["int8"]["median_ms"]
            for r in model_rows
            if "median_ms" in r["results"].get("int8", {})
        ]
        if int8_ratios:
            report["summary"]["geomean_int8_vs_tiled_models"] = geomean(int8_ratios)
            report["summary"]["min_int8_vs_tiled_models"] = min(int8_ratios)
    else:
        report["summary"] = {
            "geomean_speedup_models": float("nan"),
            "min_speedup_models": float("nan"),
            "min_speedup_case": "-",
        }
    return report


def _competitor_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in OPTIONAL_COMPETITORS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"cannot skip {', '.join(unknown)}: --skip takes {', '.join(OPTIONAL_COMPETITORS)} "
            "(torch's SDPA and tiled are the comparison itself)"
        )
    return names


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--e2e" in argv:  # the end-to-end section has its own options (bench_e2e.py)
        from .bench_e2e import main as e2e_main

        return e2e_main([a for a in argv if a != "--e2e"])
    parser = argparse.ArgumentParser(
        prog="python -m npu_attn bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="only the smaller cases (~1 min)")
    parser.add_argument(
        "--filter", help="only cases whose name contains this text (comma-separated: any of them)"
    )
    parser.add_argument("--repeats", type=at_least(1), default=5, help="timed runs per competitor")
    parser.add_argument("--threads", type=at_least(1), help="threads for every competitor")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="input dtype (bfloat16 runs on AMX or AVX-512-BF16 kernels where the CPU has them; "
        "otherwise bf16/fp16 are computed in float32)",
    )
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument(
        "--layout",
        default="bhsd",
        choices=("bhsd", "bshd"),
        help="storage of q, k, v (always passed as (B, H, L, D)): bhsd contiguous (default), or "
        "bshd, (B, L, H, D) storage transposed, as diffusers' attention processors pass them",
    )
    parser.add_argument(
        "--skip",
        type=_competitor_list,
        default=(),
        metavar="NAMES",
        help="competitors to leave out, comma-separated: "
        f"{', '.join(OPTIONAL_COMPETITORS)} (e.g. vanilla: torch's unfused bfloat16 and float16 "
        "attention takes minutes a call on CPUs without bfloat16 hardware)",
    )
    parser.add_argument("--json", type=Path, help="write the full report as JSON here")
    parser.add_argument(
        "--plots",
        type=Path,
        default=Path("npu_attn_out"),
        help="folder for the PNG plots (default: npu_attn_out)",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    report = run(args)
    text = markdown(report)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")
        print(f"\nJSON report: {args.json}")
    for path in plot(report, args.plots):
        print(f"plot: {path}")
    return 0
