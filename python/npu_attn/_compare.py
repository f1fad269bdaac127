"""``python -m npu_attn compare``: npu_attn's kernel against torch's SDPA on diffusion shapes.

Prints, per shape, the max error of each against a float64 reference and their median times
(interleaved runs, same thread count). A quick proof on *this* machine; the full benchmark is
``python -m npu_attn bench``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from . import _runtime
from .functional import scaled_dot_product_attention


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    len_q: int
    len_k: int
    head_dim: int


# Stable Diffusion 1.5 at 512x512 with classifier-free guidance (batch 2): the UNet's largest
# self-attention (64x64 latent tokens, 8 heads of 40) and its cross-attention to 77 text tokens.
SHAPES = (
    Shape("SD1.5 self-attn 64x64", 2, 8, 4096, 4096, 40),
    Shape("SD1.5 cross-attn 64x64 -> 77", 2, 8, 4096, 77, 40),
    Shape("SD1.5 self-attn 32x32", 2, 8, 1024, 1024, 80),
)


def _seconds(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def compare(repeats: int = 5) -> list[dict]:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    rows = []
    for shape in SHAPES:
        q = torch.randn(shape.batch, shape.heads, shape.len_q, shape.head_dim)
        k = torch.randn(shape.batch, shape.heads, shape.len_k, shape.head_dim)
        v = torch.randn(shape.batch, shape.heads, shape.len_k, shape.head_dim)
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
            ours = scaled_dot_product_attention(q, k, v)
            theirs = F.scaled_dot_product_attention(q, k, v)
            # Warm up, then interleave so both see the same machine state.
            t_ours, t_torch = [], []
            for _ in range(repeats):
                t_ours.append(_seconds(scaled_dot_product_attention, q, k, v))
                t_torch.append(_seconds(F.scaled_dot_product_attention, q, k, v))
        rows.append(
            {
                "shape": shape.name,
                "dims": f"B{shape.batch} H{shape.heads} Lq{shape.len_q} Lk{shape.len_k} "
                f"D{shape.head_dim}",
                "err_npu_attn": float((ours.double() - ref).abs().max()),
                "err_torch": float((theirs.double() - ref).abs().max()),
                "ms_npu_attn": statistics.median(t_ours) * 1e3,
                "ms_torch": statistics.median(t_torch) * 1e3,
            }
        )
    return rows


def main(repeats: int = 5) -> int:
    import torch

    print(
        f"npu_attn {_runtime.active_isa()} kernel vs torch {torch.__version__} SDPA, "
        f"{_runtime.get_num_threads()} threads, float32, median of {repeats} interleaved runs"
    )
    rows = compare(repeats)
    header = f"{'shape':32} {'dims':30} {'max err ours':>12} {'max err torch':>13} "
    header += f"{'ours ms':>9} {'torch ms':>9} {'speed-up':>8}"
    print(header)
    for r in rows:
        print(
            f"{r['shape']:32} {r['dims']:30} {r['err_npu_attn']:12.2e} {r['err_torch']:13.2e} "
            f"{r['ms_npu_attn']:9.2f} {r['ms_torch']:9.2f} {r['ms_torch'] / r['ms_npu_attn']:7.2f}x"
        )
    worst = max(r["err_npu_attn"] for r in rows)
    ok = worst <= 1e-5
    print(
        f"agreement with the float64 reference: {'OK' if ok else 'FAILED'} (max error {worst:.2e})"
    )
    return 0 if ok else 1
