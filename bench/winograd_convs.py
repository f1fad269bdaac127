"""Winograd F(4x4, 3x3) against oneDNN's prepacked direct convolution (what a frozen inductor
graph runs) on the SD-1.5 UNet's float32 3x3 stride-1 convolutions at 512x512 with CFG batch 2:
the per-shape numbers behind ``npu_attn.compile(..., float32_convs="auto")``.

Each shape: both calls interleaved after a warm-up, medians and minimums of ``--repeats``
rounds, the direct convolution's GFLOP/s, the speed-up, and what "auto" would choose from
these full-size minimums (auto compares minimums against WINOGRAD_MIN_SPEEDUP, after cutting
shapes over ~16 GFLOP to fewer images or rows: here the larger 64x64 and 32x32 ones, whose
per-tile work is the same). Prints a markdown table headed by the machine.

    python bench/winograd_convs.py --threads 2 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from npu_attn import _C
from npu_attn.graph import frozen_conv
from npu_attn.graph.frozen_conv import WINOGRAD_MIN_SPEEDUP

# (input channels, output channels, latent edge, how many in the UNet), batch 2.
SD15_SHAPES = [
    (320, 320, 64, 7),
    (640, 320, 64, 2),
    (960, 320, 64, 1),
    (640, 640, 64, 1),
    (320, 640, 32, 1),
    (640, 640, 32, 6),
    (960, 640, 32, 1),
    (1280, 640, 32, 1),
    (1920, 640, 32, 1),
    (1280, 1280, 32, 1),
    (640, 1280, 16, 1),
    (1280, 1280, 16, 7),
    (1920, 1280, 16, 1),
    (2560, 1280, 16, 2),
    (1280, 1280, 8, 11),
    (2560, 1280, 8, 3),
]


def measure(c: int, k: int, edge: int, repeats: int) -> dict:
    times = frozen_conv.time_both(2, c, k, edge, edge, repeats)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"Machine: {_C.cpu_info()['model']}, {args.threads} threads; torch {torch.__version__}")
    print("| 2 x C -> K, latent | count | oneDNN direct | Winograd | speed-up (medians) | auto |")
    print("|---|---|---|---|---|---|")
    for c, k, edge, count in SD15_SHAPES:
        result = measure(c, k, edge, args.repeats)
        direct, wino = result["direct"], result["winograd"]
        gflops = 2 * 2 * c * k * edge * edge * 9 / direct[0] / 1e9
        choice = "Winograd" if direct[1] / wino[1] >= WINOGRAD_MIN_SPEEDUP else "direct"
        print(
            f"| 2 x {c} -> {k}, {edge}x{edge} | {count} | {direct[0] * 1e3:.1f} ms "
            f"({gflops:.0f} GFLOP/s) | {wino[0] * 1e3:.1f} ms | {direct[0] / wino[0]:.2f}x | "
            f"{choice} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
