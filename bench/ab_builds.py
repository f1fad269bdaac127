"""A/B two builds of npu_attn's C++ kernels in one process: did a refactor or a kernel change
make anything slower?

Loads two compiled ``_C`` extension modules (e.g. this tree's and one built from an older
commit with ``git worktree add /tmp/old <commit>`` and a plain CMake build), runs the same
forward (or, with ``--backward``, backward) call on the same inputs through each, interleaved
A, B, A, B..., with the same kernel variant and thread count (or ``--isa-a`` for A), and prints
the median times and B/A ratios per model shape and dtype, with the CPU it ran on.

    python bench/ab_builds.py --a /tmp/old/b/python/npu_attn/_C*.so \\
        --b python/npu_attn/_C*.so --threads 2 --dtypes float32 bfloat16 float16
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from npu_attn.runtime.controls import cpu_identity
from npu_attn.tools.bench import model_cases

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_extension(path: str, alias: str):
    """Import the ``_C`` extension at ``path`` under a private package name, so two builds can
    live in one process (the init symbol PyInit__C only requires the last name part ``_C``)."""
    loader = importlib.machinery.ExtensionFileLoader(f"{alias}._C", path)
    spec = importlib.util.spec_from_file_location(f"{alias}._C", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def make_runner(ext, q, k, v, isa: str, threads: int, backward: bool = False, int8: bool = False):
    """A call of build ``ext`` on (q, k, v), and a function giving what it wrote as float32:
    the forward's output (the lossy int8 forward's with ``int8``), or with ``backward`` the
    backward alone (from this build's own forward, run once here) and its dQ, dK and dV
    concatenated."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32)
    dlpack = torch.utils.dlpack.to_dlpack

    def forward_int8() -> None:
        ext.forward_int8(*(dlpack(t) for t in (q, k, v, out)), num_threads=threads, isa=isa)

    if int8:
        return forward_int8, out.float

    def forward() -> None:
        ext.forward(
            *(dlpack(t) for t in (q, k, v, out)),
            lse=dlpack(lse),
            num_threads=threads,
            isa=isa,
        )

    if not backward:
        return forward, out.float
    forward()
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    grads = [torch.empty_like(t) for t in (q, k, v)]

    def run_backward() -> None:
        ext.backward(
            *(dlpack(t) for t in (q, k, v, out, lse, grad_out, *grads)),
            num_threads=threads,
            isa=isa,
        )

    return run_backward, lambda: torch.cat([g.float().flatten() for g in grads])


def time_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ab_case(
    case,
    dtype,
    builds,
    isas: list[str],
    threads: int,
    repeats: int,
    backward: bool = False,
    int8: bool = False,
    layout: str = "bhsd",
) -> tuple[float, float, float]:
    """Median seconds of build A and B (variants ``isas``) on one case, and the max |A - B| of
    their outputs. ``layout`` "bshd": q, k, v (and so the outputs) are (B, L, H, D) storage
    viewed as (B, H, L, D), as diffusers' attention processors pass them."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        make_tensor(case.batch, case.heads, n, case.head_dim, layout, gen).to(dtype)
        for n in (case.len_q, case.len_k, case.len_k)
    )
    runners = [
        make_runner(ext, q, k, v, isa, threads, backward, int8) for ext, isa in zip(builds, isas)
    ]
    for run, _ in runners:  # warm-up: workspaces, page faults, AMX state
        run()
    # Rounds alternate the order (A B, B A, ...): on a 2-vCPU VM whichever build ran first in
    # a round measured up to 8% slower on the long shapes, the same build on both sides too.
    times = [[], []]
    for round_index in range(repeats):
        order = (0, 1) if round_index % 2 == 0 else (1, 0)
        for i in order:
            times[i].append(time_once(runners[i][0]))
    diff = (runners[0][1]() - runners[1][1]()).abs().max().item()
    return statistics.median(times[0]), statistics.median(times[1]), diff


def make_tensor(batch: int, heads: int, length: int, dim: int, layout: str, gen) -> torch.Tensor:
    """A (batch, heads, length, dim) Gaussian tensor stored as ``layout`` ("bhsd" contiguous;
    "bshd" a transposed view of (batch, length, heads, dim))."""
    if layout == "bshd":
        return torch.randn(batch, length, heads, dim, generator=gen).transpose(1, 2)
    return torch.randn(batch, heads, length, dim, generator=gen)


def selected_cases(filter_text: str) -> list:
    """The named model shapes, or those whose name contains one of the comma-separated texts."""
    wanted = [text.strip() for text in filter_text.split(",") if text.strip()]
    return [case for case in model_cases() if not wanted or any(t in case.name for t in wanted)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="path of build A's _C*.so (the baseline)")
    parser.add_argument("--b", required=True, help="path of build B's _C*.so (the change)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--filter",
        default="",
        help="only model shapes whose name contains one of these comma-separated texts",
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--layout",
        choices=("bhsd", "bshd"),
        default="bhsd",
        help="bhsd: contiguous (B, H, L, D) tensors (as `bench` times); bshd: (B, L, H, D) "
        "storage viewed as (B, H, L, D), as diffusers' attention processors pass them",
    )
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument(
        "--isa",
        action="append",
        default=[],
        metavar="DTYPE=VARIANT",
        help="variant per dtype (default: each build's active variant for the dtype), "
        "e.g. --isa bfloat16=amx_bf16",
    )
    parser.add_argument(
        "--isa-a",
        action="append",
        default=[],
        metavar="DTYPE=VARIANT",
        help="a different variant for build A only (to compare two variants of one build, pass "
        "a copy of its .so as --a: one path cannot be loaded twice)",
    )
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument(
        "--backward",
        action="store_true",
        help="time the backward call alone (each build's gradients from its own forward)",
    )
    kind.add_argument(
        "--int8",
        action="store_true",
        help="time the lossy int8 forward (forward_int8) instead of the exact one",
    )
    args = parser.parse_args(argv)
    builds = [load_extension(args.a, "npu_attn_ab_a"), load_extension(args.b, "npu_attn_ab_b")]
    pinned = dict(item.split("=", 1) for item in args.isa)
    pinned_a = dict(item.split("=", 1) for item in args.isa_a)
    info = {"cpu": cpu_identity()}
    kind = "backward" if args.backward else "int8 forward" if args.int8 else "forward"
    print(f"# A/B ({kind}): {args.a} vs {args.b}")
    print(
        f"# CPU: {info['cpu']}; {args.threads} threads; median of {args.repeats}; "
        f"layout {args.layout}"
    )
    print("| shape | dtype | variant (A / B) | A ms | B ms | B/A | max abs diff |")
    print("|---|---|---|---:|---:|---:|---:|")
    ratios: dict[str, list[float]] = {}
    for dtype_name in args.dtypes:
        active = builds[1].int8_isa() if args.int8 else builds[1].active_isa(dtype_name)
        isa_b = pinned.get(dtype_name) or active
        isas = [pinned_a.get(dtype_name, isa_b), isa_b]
        for case in selected_cases(args.filter):
            a, b, diff = ab_case(
                case,
                DTYPES[dtype_name],
                builds,
                isas,
                args.threads,
                args.repeats,
                args.backward,
                args.int8,
                args.layout,
            )
            ratios.setdefault(dtype_name, []).append(b / a)
            variant = isa_b if isas[0] == isa_b else f"{isas[0]} / {isa_b}"
            print(
                f"| {case.name} | {dtype_name} | {variant} | {a * 1e3:.1f} | {b * 1e3:.1f} "
                f"| {b / a:.3f} | {diff:.2g} |",
                flush=True,
            )
    for dtype_name, values in ratios.items():
        geomean = statistics.geometric_mean(values)
        low, high = min(values), max(values)
        print(f"# {dtype_name}: B/A geomean {geomean:.3f}, min {low:.3f}, max {high:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
