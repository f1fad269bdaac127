"""``python -m npu_attn bench --parallel``: what scaling out buys on this machine, and what it
would send over the network on N machines.

1. **CFG-parallel, measured**: seconds per denoising step of the demo's pipeline (SD-1.5's
   architecture with random weights at 512x512 by default, guidance batch of 2, the ``tiled``
   strategy), in one process with T threads and in W processes with T / W threads each,
   CFG-parallel, alternating for ``--rounds`` rounds (medians reported). The W processes are
   started here the way torchrun starts them (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
   ``WORLD_SIZE`` on 127.0.0.1). The bytes each rank sent per step are counted
   (:func:`npu_attn.parallel.comm_stats`).
2. **Context parallel, modelled**: bytes per step and rank for ring and Ulysses attention at
   FLUX.1-dev, HiDream-I1 and SD3-medium sizes (1024x1024, bfloat16) for N = 2 to 16 ranks
   (:mod:`npu_attn.parallel.scaling`), with the time that takes at 10 Gbit/s.

Under torchrun (``torchrun --nproc-per-node 2 -m npu_attn.tools.bench_parallel``, or
``--nnodes`` for several machines) only the CFG-parallel measurement runs, in the processes
torchrun started; rank 0 prints it.

On one machine, W processes share its cores, memory bandwidth and caches with each other: a
gain over one process using all the cores comes only from work that does not parallelise
well inside one process (small GEMMs, Python overhead, the scheduler). Expect little or none;
the point of CFG-parallel is two devices or two machines.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Optional

from .arguments import at_least

RESULT_MARKER = "NPU_ATTN_BENCH_PARALLEL "
LINK_BYTES_PER_SECOND = 10e9 / 8  # 10 Gbit/s Ethernet
WORLDS = (2, 4, 8, 16)


# --------------------------------------------------------------------------- measuring
def _pipeline(args: argparse.Namespace, rank: int):
    """The demo's pipeline in ``args.dtype`` with the ``tiled`` strategy, and a function that
    runs a generation of n steps (latents only, no decode)."""
    import torch

    from ..integration.processors import set_attention_strategy
    from .pipelines import ARCHITECTURES, build_pipeline, prompt_embeddings

    dtype = getattr(torch, args.dtype)
    pipe = build_pipeline(args.model).to("cpu", dtype)
    size = args.size or ARCHITECTURES[args.model][1]
    set_attention_strategy(pipe, "tiled")
    pipe.set_progress_bar_config(disable=rank != 0, leave=False)
    embeds = prompt_embeddings(pipe, dtype, "cpu")

    def generate(steps: int) -> None:
        with torch.no_grad():
            pipe(
                **embeds,
                num_inference_steps=steps,
                guidance_scale=7.5,
                height=size,
                width=size,
                output_type="latent",
                generator=torch.Generator().manual_seed(0),
            )

    return pipe, size, generate


def prepare_cfg(args: argparse.Namespace, parallel: bool) -> Callable[[], dict[str, Any]]:
    """Builds the demo pipeline in this process (CFG-parallel over the initialised group if
    ``parallel``), runs ``args.warmup`` untimed steps, and returns a function that times
    ``args.steps`` steps: seconds per step and bytes sent per step."""
    import torch.distributed as dist

    from ..parallel import comm_stats, enable_cfg_parallel, reset_comm_stats
    from ..runtime import controls as _runtime

    pipe, size, generate = _pipeline(args, dist.get_rank() if parallel else 0)
    if parallel:
        enable_cfg_parallel(pipe)
    generate(args.warmup)  # first calls: kernel variant choice, allocator, thread pools

    def measure() -> dict[str, Any]:
        if parallel:
            dist.barrier()  # start the clock together
        reset_comm_stats()
        start = time.perf_counter()
        generate(args.steps)
        seconds = time.perf_counter() - start
        return {
            "processes": dist.get_world_size() if parallel else 1,
            "threads_per_process": _runtime.get_num_threads(),
            "seconds_per_step": seconds / args.steps,
            "bytes_sent_per_step": sum(comm_stats().values()) / args.steps,
            "model": args.model,
            "size": size,
            "dtype": args.dtype,
        }

    return measure


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median seconds per step (the lower middle one for an even count), with
    every round's seconds per step under ``"rounds"``."""
    ordered = sorted(runs, key=lambda run: run["seconds_per_step"])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    middle["rounds"] = [run["seconds_per_step"] for run in runs]
    return middle


def worker(args: argparse.Namespace) -> int:
    """One rank of the CFG-parallel measurement (started by :func:`launch` or by torchrun);
    rank 0 prints the result line."""
    import torch

    from ..parallel import distributed_group

    if args.threads:
        torch.set_num_threads(args.threads)
    with distributed_group() as (rank, _):
        result = prepare_cfg(args, parallel=True)()
    if rank == 0 and args.worker:  # for launch(), which parses it
        print(RESULT_MARKER + json.dumps(result), flush=True)
    elif rank == 0:  # under torchrun: for the user
        print("\n\n" + "\n".join(cfg_table(None, result)))
        print("\nContext parallelism, bytes each rank sends per step (scaling model):\n")
        print("\n".join(scaling_table()))
    return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args: argparse.Namespace, world: int, threads: int) -> dict[str, Any]:
    """Run :func:`worker` in ``world`` processes on this machine; rank 0's result."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.update(WORLD_SIZE=str(world), OMP_NUM_THREADS=str(threads))
    command = [sys.executable, "-m", "npu_attn.tools.bench_parallel", "--worker"]
    command += ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--dtype", args.dtype, "--threads", str(threads)]
    if args.size:
        command += ["--size", str(args.size)]
    processes = []
    try:
        for rank in range(world):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            stdout = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
            processes.append(subprocess.Popen(command, env=rank_env, stdout=stdout, text=True))
        output, _ = processes[0].communicate(timeout=args.timeout)
        for process in processes[1:]:
            process.wait(timeout=args.timeout)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    if any(p.returncode for p in processes):
        raise RuntimeError(
            f"a benchmark process failed (exit codes {[p.returncode for p in processes]})"
        )
    line = next(line for line in output.splitlines() if line.startswith(RESULT_MARKER))
    return json.loads(line[len(RESULT_MARKER) :])


# --------------------------------------------------------------------------- reporting
def cfg_table(single: Optional[dict[str, Any]], split: dict[str, Any]) -> list[str]:
    """Markdown rows: each configuration, its time per step, speed-up and bytes sent."""
    lines = [
        "| configuration | s / step | speed-up | bytes sent / step / rank |",
        "|---|---|---|---|",
    ]
    rows = [r for r in (single, split) if r is not None]
    for row in rows:
        name = f"{row['processes']} process(es) x {row['threads_per_process']} thread(s)"
        if row["processes"] > 1:
            name += ", CFG-parallel"
        speed = "-"  # under torchrun there is no single-process row to compare with
        if single is not None:
            speed = f"{single['seconds_per_step'] / row['seconds_per_step']:.2f}x"
        lines.append(
            f"| {name} | {row['seconds_per_step']:.3f} | {speed} | "
            f"{row['bytes_sent_per_step']:,.0f} |"
        )
    return lines


def scaling_table(element_bytes: int = 2) -> list[str]:
    """Markdown rows of the context-parallel scaling model (see npu_attn.parallel.scaling)."""
    from ..parallel.scaling import MODEL_SHAPES, communication_per_step

    lines = [
        "| model (1024px, bf16) | ranks | ring MB / step / rank | Ulysses MB / step / rank | "
        "ring s at 10 Gbit/s | CFG-parallel MB / step |",
        "|---|---|---|---|---|---|",
    ]
    for key, shape in MODEL_SHAPES.items():
        for n in WORLDS:
            ring = communication_per_step(key, n, "ring", element_bytes=element_bytes)
            cfg = communication_per_step(key, n, "cfg", element_bytes=element_bytes)
            if shape.heads % n == 0:
                ulysses = communication_per_step(key, n, "ulysses", element_bytes=element_bytes)
                ulysses_text = f"{ulysses / 1e6:,.0f}"
            else:
                ulysses_text = f"- ({shape.heads} heads)"
            cfg_text = f"{cfg / 1e6:.2f}" if shape.batch % n == 0 else "-"
            lines.append(
                f"| {shape.name} | {n} | {ring / 1e6:,.0f} | {ulysses_text} | "
                f"{ring / LINK_BYTES_PER_SECOND:.2f} | {cfg_text} |"
            )
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The measured part of a ``--json`` report as Markdown: machine, table, verdict."""
    machine, single, split = report["machine"], report["single"], report["cfg_parallel"]
    rounds = len(single.get("rounds", [single["seconds_per_step"]]))
    lines = [
        f"Machine: {machine['cpu']}, {machine['logical_cpus']} logical CPUs; torch "
        f"{machine['torch']}; {machine['date']}. {single['model']} at {single['size']}px, "
        f"{single['dtype']}, `tiled`; medians of {rounds} interleaved rounds.",
        "",
        *cfg_table(single, split),
        "",
        honest_note(single, split),
    ]
    return "\n".join(lines)


def honest_note(single: dict[str, Any], split: dict[str, Any]) -> str:
    speed = single["seconds_per_step"] / split["seconds_per_step"]
    if speed < 1.05:
        return (
            f"CFG-parallel on one machine: {speed:.2f}x - no gain here. The processes share "
            "this machine's cores and memory bandwidth; one process already uses all of them."
        )
    return (
        f"CFG-parallel on one machine: {speed:.2f}x with the same {split['processes']} x "
        f"{split['threads_per_process']} cores (work that one process does not parallelise "
        "well, split across processes)."
    )


def busy_cpus(seconds: float = 1.0) -> Optional[float]:
    """How many CPUs other processes kept busy over the next ``seconds`` (from /proc/stat;
    None where that does not exist). Unlike the load average, this does not remember the
    last minute (e.g. a benchmark that just finished)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return 0.0
    return (1.0 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


def busy_warning() -> str:
    """A warning when other processes keep the CPU busy ("" otherwise): a run with as many
    threads as cores then waits for the busy core at every parallel region, which can make it
    many times slower than a one-thread process and the comparison meaningless."""
    busy = busy_cpus()
    if busy is None or busy < 0.3:
        return ""
    return (
        f"warning: other processes keep {busy:.1f} CPUs busy before the benchmark starts; "
        "the timings below are not reliable"
    )


# --------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    from .pipelines import MODELS

    parser = argparse.ArgumentParser(
        prog="python -m npu_attn bench --parallel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="sd15", choices=sorted(MODELS))
    parser.add_argument("--size", type=int, help="image size (default: the model's)")
    parser.add_argument("--steps", type=at_least(1), default=3, help="timed steps (default 3)")
    parser.add_argument(
        "--warmup", type=at_least(1), default=1, help="untimed steps first (default 1)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--world", type=at_least(1), default=2, help="processes (default 2)")
    parser.add_argument(
        "--rounds",
        type=at_least(1),
        default=3,
        help="interleaved rounds of both configurations; medians are reported (default 3)",
    )
    parser.add_argument(
        "--threads", type=at_least(1), help="threads of the single process (default: all cores)"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    from .pipelines import quiet_third_party_warnings

    args = build_parser().parse_args(argv)
    with quiet_third_party_warnings():
        return compare(args)


def compare(args: argparse.Namespace) -> int:
    """One process against ``args.world`` CFG-parallel ones (or, when started as a rank, that
    rank's part)."""
    if args.worker or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by us or torchrun
        return worker(args)
    threads = args.threads or os.cpu_count() or 1
    per_process = max(1, threads // args.world)
    print(
        f"npu_attn bench --parallel: {args.model}, {args.dtype}, {args.steps} timed steps; "
        f"1 process x {threads} threads against {args.world} processes x {per_process} threads, "
        f"{args.rounds} alternating rounds"
    )
    busy = busy_warning()
    if busy:
        print(busy)
    from ..runtime.controls import threads_for_run

    singles, splits = [], []
    with threads_for_run(threads):  # the caller's thread counts come back afterwards
        measure_single = prepare_cfg(args, parallel=False)
        # Interleaved rounds: the machine's state (other load, turbo, memory) drifts alike over
        # both.
        for round_index in range(args.rounds):
            singles.append(measure_single())
            splits.append(launch(args, args.world, per_process))
            print(
                f"round {round_index + 1}/{args.rounds}: 1 process "
                f"{singles[-1]['seconds_per_step']:.3f} s/step, {args.world} processes "
                f"{splits[-1]['seconds_per_step']:.3f} s/step",
                flush=True,
            )
    single, split = median_run(singles), median_run(splits)
    from .bench_report import machine_info

    report = {"machine": machine_info(threads), "single": single, "cfg_parallel": split}
    print("\n" + markdown(report))
    print("\nContext parallelism, bytes each rank sends per step (forward; scaling model):\n")
    print("\n".join(scaling_table()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
