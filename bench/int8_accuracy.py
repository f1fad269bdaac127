"""The int8 strategy's accuracy per named model shape: the table of docs/int8-attention.md.

Inputs shaped like diffusion-model activations (keys with per-channel offsets ~10x their
per-token spread, every 16th query channel ~8x the others: the same generator as
tests/py/test_int8_attention.py), float32 and bfloat16, against float64 exact attention of the
same inputs; next to it what the exact ``tiled`` kernel's bfloat16 output rounding costs.

    python bench/int8_accuracy.py            # prints the Markdown table and the machine
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import npu_attn
from npu_attn.tools.bench_report import machine_info

# (label, Lq, Lk, D), as tests/py/test_int8_attention.py's MODEL_SHAPES
SHAPES = (
    ("SD-1.5 64x64", 4096, 4096, 40),
    ("SD-1.5 32x32", 1024, 1024, 80),
    ("SD-1.5 16x16", 256, 256, 160),
    ("SD-1.5 cross", 4096, 77, 40),
    ("SDXL 64x64", 4096, 4096, 64),
    ("SD3 / Flux 1024 joint", 4429, 4429, 128),
    ("VAE mid-block", 4096, 4096, 512),
)


def diffusion_like(lq, lk, d, heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, lq, d, generator=g)
    k = torch.randn(1, heads, lk, d, generator=g) + 10 * torch.randn(1, heads, 1, d, generator=g)
    v = torch.randn(1, heads, lk, d, generator=g)
    q[..., ::16] *= 8
    return q, k, v


def accuracy(out, ref) -> tuple[float, float]:
    a, b = out.double().flatten(), ref.double().flatten()
    return float(a @ b / (a.norm() * b.norm())), float((a - b).abs().sum() / b.abs().sum())


def main() -> int:
    m = machine_info(torch.get_num_threads())
    print(f"Machine: {m['cpu']}; int8 kernel variant {npu_attn._C.int8_isa()}; {m['date']}.\n")
    print(
        "| shape | Lq x Lk, D | cosine (fp32) | relative L1 (fp32) | relative L1 (bf16) "
        "| bf16 exact kernel, relative L1 |"
    )
    print("|---|---|---|---|---|---|")
    for label, lq, lk, d in SHAPES:
        q, k, v = diffusion_like(lq, lk, d, heads=1 if d >= 128 else 2)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        cosine, l1 = accuracy(npu_attn.scaled_dot_product_attention(q, k, v, backend="int8"), ref)
        low = [t.bfloat16() for t in (q, k, v)]  # measured against the bfloat16 inputs' result
        ref_low = F.scaled_dot_product_attention(*(t.double() for t in low))
        int8_low = npu_attn.scaled_dot_product_attention(*low, backend="int8")
        exact_low = npu_attn.scaled_dot_product_attention(*low, backend="tiled")
        _, l1_bf16 = accuracy(int8_low, ref_low)
        _, l1_exact = accuracy(exact_low, ref_low)
        print(
            f"| {label} | {lq} x {lk}, {d} | {cosine:.5f} | {l1:.1e} | {l1_bf16:.1e} "
            f"| {l1_exact:.1e} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
