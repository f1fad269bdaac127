"""npu_attn.parallel: CFG-parallel pipelines and ring / Ulysses attention on torch.distributed.

The multi-process tests start real processes on loopback (gloo, 1 thread each), the way
torchrun does (its environment variables; one test runs torchrun itself), and run the checks
in ``_parallel_workers.py``: each worker compares the parallel result with the same
computation done without parallelism and reports per check. Every launch has a hard deadline
after which its process groups are killed, and every worker's collectives time out sooner,
so nothing here can hang.

In-process tests cover what needs no peer: argument errors, the one-rank group, the scaling
model.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import npu_attn
from npu_attn import parallel
from npu_attn.parallel.scaling import MODEL_SHAPES, communication_per_step

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_parallel_workers.py"
PYTHON_DIR = Path(npu_attn.__file__).resolve().parents[1]
LAUNCH_DEADLINE = 240  # seconds for a whole launch; collectives inside time out after 60


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(
            p for p in (str(PYTHON_DIR), str(HERE), env.get("PYTHONPATH")) if p
        ),
        OMP_NUM_THREADS="1",
        NPU_ATTN_TUNE="0",  # no kernel-variant measurement in short-lived workers
        NPU_ATTN_CACHE_DIR=str(tmp_path / "cache"),
        MASTER_ADDR="127.0.0.1",
        WORKER_TIMEOUT="60",
        **extra,
    )
    return env


def _kill(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.killpg(process.pid, signal.SIGKILL)  # the worker and anything it started
    for process in processes:
        process.wait()


def _logs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}"
        for log in sorted(tmp_path.glob("*.log"))
    )


def run_ranks(commands: list[list[str]], env_of, tmp_path: Path, deadline: float):
    """Start one process per command (its own session, so it can be killed with everything
    it started), wait at most ``deadline`` seconds, return the exit codes."""
    processes = []
    try:
        for i, command in enumerate(commands):
            log = open(tmp_path / f"rank{i}.log", "w")  # noqa: SIM115 (closed by the child's exit)
            processes.append(
                subprocess.Popen(
                    command,
                    env=env_of(i),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd=tmp_path,
                )
            )
            log.close()
        end = time.monotonic() + deadline
        while any(p.poll() is None for p in processes):
            if time.monotonic() > end:
                pytest.fail(f"processes still running after {deadline} s\n{_logs(tmp_path)}")
            time.sleep(0.05)
        return [p.returncode for p in processes]
    finally:
        _kill(processes)


def launch(scenario: str, world: int, tmp_path: Path) -> dict[int, dict[str, str]]:
    """Run a worker scenario on ``world`` ranks; each rank's {check: "ok" | traceback}."""
    port = str(free_port())
    env = worker_env(tmp_path, MASTER_PORT=port, WORLD_SIZE=str(world))

    def env_of(rank: int) -> dict[str, str]:
        return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}

    command = [sys.executable, str(WORKER), scenario, str(tmp_path)]
    codes = run_ranks([command] * world, env_of, tmp_path, LAUNCH_DEADLINE)
    results = {}
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.is_file() else {}
    results["exit codes"] = codes
    results["logs"] = _logs(tmp_path)
    return results


def _check_names(scenario: str) -> list[str]:
    sys.path.insert(0, str(HERE))
    import _parallel_workers

    return [name for name, _ in _parallel_workers.CHECKS[scenario]]


# --------------------------------------------------------------------------- two ranks
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of every two-rank check (importing torch and diffusers dominates a launch,
    so the checks share one)."""
    return launch("core", 2, tmp_path_factory.mktemp("core"))


@pytest.mark.parametrize("name", _check_names("core"))
def test_two_ranks(two_ranks, name):
    for rank in (0, 1):
        outcome = two_ranks[rank].get(name, f"rank {rank} did not run it")
        assert outcome == "ok", f"rank {rank}:\n{outcome}\n{two_ranks['logs']}"


def test_two_rank_workers_exit_cleanly(two_ranks):
    assert two_ranks["exit codes"] == [0, 0], two_ranks["logs"]


@pytest.mark.parametrize("name", _check_names("unified"))
def test_four_ranks(four_ranks, name):
    for rank in range(4):
        outcome = four_ranks[rank].get(name, f"rank {rank} did not run it")
        assert outcome == "ok", f"rank {rank}:\n{outcome}\n{four_ranks['logs']}"


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Unified sequence parallelism needs a 2 x 2 mesh: four (tiny, one-thread) processes."""
    return launch("unified", 4, tmp_path_factory.mktemp("unified"))


def test_a_dead_peer_makes_the_other_rank_raise_not_hang(tmp_path):
    results = launch("crash", 2, tmp_path)
    assert results["exit codes"][1] == 3
    assert results[0]["a_dead_peer_raises_instead_of_hanging"] == "ok", results["logs"]


@pytest.mark.parametrize("model", ["tiny", "tiny-hidream"])
def test_cfg_parallel_demo_under_torchrun(tmp_path, model):
    """The documented command: ``torchrun --nproc-per-node 2 -m npu_attn demo --parallel cfg``
    (a tiny UNet and a tiny transformer family that takes CFG, two steps)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = (
        [str(torchrun)] if torchrun.is_file() else [sys.executable, "-m", "torch.distributed.run"]
    )
    port = str(free_port())
    command = [
        *launcher,
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "-m",
        "npu_attn",
        "demo",
        "--parallel",
        "cfg",
        "--model",
        model,
        "--steps",
        "2",
        "--out",
        str(tmp_path / "out"),
    ]
    env = worker_env(tmp_path)
    codes = run_ranks([command], lambda _: env, tmp_path, LAUNCH_DEADLINE)
    log = _logs(tmp_path)
    assert codes == [0], log
    assert "CFG-parallel over 2 processes" in log, log
    assert "every rank returned the same latents" in log, log
    assert (tmp_path / "out" / "image.png").is_file(), log


# --------------------------------------------------------------------------- in-process
@pytest.fixture
def one_rank_group():
    """A one-process gloo group in this process (no port: an in-memory store)."""
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()


def test_entry_points_explain_how_to_start_torch_distributed(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="missing RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        parallel.init_distributed()
    with pytest.raises(RuntimeError, match="enable_cfg_parallel needs torch.distributed"):
        parallel.enable_cfg_parallel(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="enable_context_parallel needs torch.distributed"):
        parallel.enable_context_parallel(torch.nn.Linear(2, 2))
    from npu_attn.tools.demo import main as demo_main

    assert demo_main(["--parallel", "cfg", "--model", "tiny"]) == 2
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err


def test_bad_arguments_name_what_was_expected(one_rank_group):
    from tiny_models import tiny_unet

    with pytest.raises(ValueError, match="on_indivisible must be one of"):
        parallel.enable_cfg_parallel(tiny_unet(), on_indivisible="skip")
    with pytest.raises(TypeError, match="pipeline with a `unet` or `transformer`"):
        parallel.enable_cfg_parallel(object())
    with pytest.raises(ValueError, match="context parallel supports"):
        parallel.enable_context_parallel(tiny_unet())
    with pytest.raises(ValueError, match="must equal the world size"):
        parallel.enable_context_parallel(_tiny_sd3(), ring_degree=2)
    with pytest.raises(ValueError, match="ring_degree must be >= 1"):
        parallel.enable_context_parallel(_tiny_sd3(), ring_degree=0)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="query must be 4-D"):
        parallel.ring_attention(q[0], q, q)
    with pytest.raises(TypeError, match="float64 is not supported"):
        parallel.ring_attention(q.double(), q.double(), q.double())
    with pytest.raises(ValueError, match="enable_gqa=True"):
        parallel.ulysses_attention(q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match="attn_mask of shape"):
        parallel.ring_attention(q, q, q, torch.ones(3, 4, dtype=torch.bool))


def _tiny_sd3():
    from tiny_models import tiny_sd3

    return tiny_sd3()


@pytest.fixture
def one_thread():
    """Tiny models run in milliseconds on one thread; with two, a core busy with anything else
    stalls every parallel region (100x slower on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_one_rank_is_the_single_process_computation(one_rank_group, one_thread):
    """World size 1: ring and Ulysses are plain attention, CFG-parallel changes nothing."""
    from tiny_accel_models import generate, sd15_pipeline

    q, k, v = (torch.randn(2, 4, 12, 16, requires_grad=True) for _ in range(3))
    single = npu_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = torch.autograd.grad(single.sum(), (q, k, v))
    for fn in (parallel.ring_attention, parallel.ulysses_attention):
        out = fn(q, k, v, is_causal=True)
        assert torch.allclose(out, single, atol=1e-6)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, expected))
    pipe = sd15_pipeline()
    reference = generate(pipe, steps=2)
    parallel.enable_cfg_parallel(pipe)
    assert torch.equal(generate(pipe, steps=2), reference)
    assert parallel.cfg_parallel_of(pipe)["split_calls"] == 2
    assert parallel.disable_cfg_parallel(pipe) and not parallel.disable_cfg_parallel(pipe)
    assert not pipe.unet._forward_pre_hooks and not pipe.unet._forward_hooks


def test_ring_and_ulysses_take_a_negative_scale(one_rank_group, one_thread):
    # torch accepts a negative scale (npu_attn runs it as the query negated); with is_causal
    # torch 2.13 itself returns NaN there, so the reference is the single-process call.
    q, k, v = (torch.randn(1, 2, 10, 8, requires_grad=True) for _ in range(3))
    single = npu_attn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=-0.8)
    expected = torch.autograd.grad(single.sum(), (q, k, v))
    for fn in (parallel.ring_attention, parallel.ulysses_attention):
        out = fn(q, k, v, is_causal=True, scale=-0.8)
        assert torch.allclose(out, single, atol=1e-6)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, expected))


def test_diffusers_own_context_parallel_still_fails_on_cpu(one_rank_group):
    """Why enable_context_parallel does not call ModelMixin.enable_parallelism: on a CPU-only
    torch its device lookup divides by torch.accelerator.device_count() == 0 (diffusers
    0.42.1). If this starts passing, diffusers fixed it and npu_attn could call it."""
    from diffusers import ContextParallelConfig

    from tiny_models import tiny_flux

    assert torch.accelerator.device_count() == 0
    with pytest.raises(ZeroDivisionError):
        tiny_flux().enable_parallelism(config=ContextParallelConfig(ring_degree=2))


def test_the_scaling_model():
    """Ring traffic per rank stays ~2 K/V tensors per layer at any size; Ulysses' falls as
    1/N; they are equal at N = 2; CFG moves one output per step."""
    for name in MODEL_SHAPES:
        ring = [communication_per_step(name, n, "ring") for n in (2, 4, 8)]
        ulysses = [communication_per_step(name, n, "ulysses") for n in (2, 4, 8)]
        assert ring[0] == ulysses[0]
        assert ring[0] < ring[1] < ring[2] and ulysses[0] > ulysses[1] > ulysses[2]
    flux = MODEL_SHAPES["flux-dev"]
    kv = flux.tensor_bytes(flux.kv_heads, 2)
    gather = flux.output_elements * 2 // 2
    assert communication_per_step("flux-dev", 2, "ring") == flux.attention_layers * kv + gather
    assert communication_per_step("flux-dev", 1, "cfg") == 0
    with pytest.raises(ValueError, match="method must be one of"):
        communication_per_step("flux-dev", 2, "tree")
    with pytest.raises(ValueError, match="world must be a positive int"):
        communication_per_step("flux-dev", 0, "ring")


def test_bench_reports_and_command_line(capsys):
    """The benchmark's tables (the measurement itself is left to `python -m npu_attn bench
    --parallel`, which takes minutes at SD-1.5 size) and its command-line wiring."""
    from npu_attn.tools import bench_parallel
    from npu_attn.tools.cli import main

    single = {"processes": 1, "threads_per_process": 2, "seconds_per_step": 2.0}
    split = {"processes": 2, "threads_per_process": 1, "seconds_per_step": 1.6}
    rows = bench_parallel.cfg_table(
        {**single, "bytes_sent_per_step": 0}, {**split, "bytes_sent_per_step": 16384}
    )
    assert rows[2] == "| 1 process(es) x 2 thread(s) | 2.000 | 1.00x | 0 |"
    assert rows[3] == "| 2 process(es) x 1 thread(s), CFG-parallel | 1.600 | 1.25x | 16,384 |"
    assert "1.25x" in bench_parallel.honest_note(single, split)
    assert "no gain" in bench_parallel.honest_note(single, {**split, "seconds_per_step": 2.0})
    runs = [{**split, "seconds_per_step": t} for t in (1.9, 1.5, 1.7)]
    median = bench_parallel.median_run(runs)
    assert median["seconds_per_step"] == 1.7 and median["rounds"] == [1.9, 1.5, 1.7]
    assert bench_parallel.median_run(runs[:2])["seconds_per_step"] == 1.5  # lower middle
    machine = {"cpu": "Test CPU", "logical_cpus": 2, "torch": "2.13.0", "date": "today"}
    info = {"bytes_sent_per_step": 0, "model": "sd15", "size": 512, "dtype": "float32"}
    report = {
        "machine": machine,
        "single": {**single, **info, "rounds": [2.0, 2.1, 1.9]},
        "cfg_parallel": {**split, **info},
    }
    text = bench_parallel.markdown(report)
    assert text.startswith("Machine: Test CPU, 2 logical CPUs")
    assert "medians of 3 interleaved rounds" in text and "| 1.600 | 1.25x |" in text
    busy = bench_parallel.busy_cpus(0.05)
    assert busy is None or 0.0 <= busy <= (os.cpu_count() or 1) + 1e-6
    table = bench_parallel.scaling_table()
    assert len(table) == 2 + len(MODEL_SHAPES) * len(bench_parallel.WORLDS)
    assert "| FLUX.1-dev 1024px | 2 | 1,614 | 1,614 |" in "\n".join(table)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--parallel", "--help"])
    assert exit_info.value.code == 0
    assert "python -m npu_attn bench --parallel" in capsys.readouterr().out
    for option in ("--steps", "--warmup", "--world", "--rounds", "--threads"):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "--parallel", option, "0"])
        assert exit_info.value.code == 2
        assert f"argument {option}: must be >= 1, got 0" in capsys.readouterr().err


def test_the_demo_leaves_a_process_group_it_did_not_create(one_rank_group, tmp_path, capsys):
    """A script that made its own group and calls the demo in-process keeps its group: the
    demo closes only a group it joined itself."""
    from npu_attn.tools.demo import main as demo_main

    code = demo_main(
        ["--parallel", "cfg", "--model", "tiny", "--steps", "2", "--out", str(tmp_path)]
    )
    assert code == 0, capsys.readouterr()
    assert "every rank returned the same latents" in capsys.readouterr().out
    assert dist.is_initialized()
    with parallel.distributed_group() as (rank, world):  # the mechanism both tools use
        assert (rank, world) == (0, 1)
    assert dist.is_initialized()
