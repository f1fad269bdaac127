"""What diffusers' memory layout costs: npu_attn's `tiled` and torch's SDPA on the named model
shapes with contiguous (B, H, L, D) inputs (what `python -m npu_attn bench` times) and with
(B, L, H, D) storage viewed as (B, H, L, D), which diffusers' attention processors pass. All four
calls of a shape run in one process, interleaved (rounds balanced for the predecessor, as in
`bench`), and the medians are printed with the CPU. `bench --layout bshd` times the second
layout alone.

    python bench/layout_cost.py --filter "SD1.5,SDXL self 32x32" --rounds 9
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import npu_attn
from npu_attn.runtime.controls import cpu_identity
from npu_attn.tools.bench import make_inputs, model_cases
from npu_attn.tools.rounds import round_order

LAYOUTS = ("bhsd", "bshd")


def calls(case) -> dict:
    """The four calls of one shape: {"tiled bhsd": fn, "torch bhsd": fn, ...}."""
    out = {}
    for layout in LAYOUTS:
        q, k, v = make_inputs(dataclasses.replace(case, layout=layout))
        out[f"tiled {layout}"] = lambda q=q, k=k, v=v: npu_attn.scaled_dot_product_attention(
            q, k, v, backend="tiled"
        )
        out[f"torch {layout}"] = lambda q=q, k=k, v=v: (
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
        )
    return out


def medians(fns: dict, rounds: int) -> dict:
    times = {name: [] for name in fns}
    with torch.no_grad():
        for fn in fns.values():  # warm-up
            fn()
        for index in range(rounds):
            for name in round_order(list(fns), index):
                start = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--filter", default="SD1.5,SDXL self 32x32")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    wanted = [text.strip() for text in args.filter.split(",")]
    print(f"# CPU: {cpu_identity()}; {args.threads} threads; median of {args.rounds}")
    print(
        "| case | torch (B, H, L, D) ms | tiled (B, H, L, D) ms | speed-up "
        "| torch (B, L, H, D) ms | tiled (B, L, H, D) ms | speed-up |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case in model_cases():
        if not any(text in case.name for text in wanted):
            continue
        m = medians(calls(case), args.rounds)
        cells = []
        for layout in LAYOUTS:
            torch_ms, tiled_ms = m[f"torch {layout}"], m[f"tiled {layout}"]
            cells += [f"{torch_ms:.2f}", f"{tiled_ms:.2f}", f"{torch_ms / tiled_ms:.2f}x"]
        print(f"| {case.name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
