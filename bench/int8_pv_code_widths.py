"""What the code widths of P and V cost P·V in the int8 kernel: a float64 model.

The int8 kernel (csrc/kernels/attention_int8_impl.h) computes P·V on integer codes: P in
[0, 1] as unsigned codes with each query's rounding error carried to its next key, V per
channel and 512-key tile as signed codes (scale max|v| / limit). This model applies the same
rounding in float64 and prints the relative L1 distance of the normalised output from exact
P·V, for the kernel's 16-bit scheme (14-bit P, 11-bit V on `vpmaddwd`) and for the 8-bit
schemes `vpmaddubsw` could take without saturating its 16-bit pair sums (2 x |p| x |v| <=
32767: 7-bit P with 8-bit V, or 8-bit P with 7-bit V), and for VNNI's `vpdpbusd` (unsigned
8-bit P times signed 8-bit V into int32, nothing to saturate): P's step 1/255, or each query's
P scaled by its maximum over the key tile (a per-query scale per tile, applied to O^T's query
lanes after the tile). Gaussian queries, keys and values; the score temperature sharpens the
rows (1: diffuse, 3: peaked).

    python bench/int8_pv_code_widths.py     # numpy only, about a minute
"""

from __future__ import annotations

import numpy as np

SCHEMES = (  # (label, P code maximum, V code limit, P scaled per query and key tile)
    ("14-bit P, 11-bit V (the kernel)", 16383, 1023, False),
    ("14-bit P, 8-bit V", 16383, 127, False),
    ("8-bit P, 7-bit V (vpmaddubsw)", 255, 63, False),
    ("7-bit P, 8-bit V (vpmaddubsw)", 127, 127, False),
    ("8-bit P, 8-bit V (vpdpbusd)", 255, 127, False),
    ("8-bit P per query and tile, 8-bit V (vpdpbusd)", 255, 127, True),
)
CASES = ((4096, 64, 1.0), (4096, 64, 3.0), (1024, 80, 1.0), (4096, 512, 1.0))  # (keys, D, temp)
KEY_TILE = 512


def probability_codes(p: np.ndarray, code_max: int, per_tile: bool = False) -> np.ndarray:
    """P rounded to steps of 1 / code_max (per_tile: of each row's maximum over the key tile
    / code_max), each row's rounding error carried to its next key."""
    out = np.empty_like(p)
    carry = np.zeros(p.shape[0])
    step = np.full(p.shape[0], 1.0 / code_max)
    for key in range(p.shape[1]):
        if per_tile and key % KEY_TILE == 0:
            tile_max = p[:, key : key + KEY_TILE].max(axis=1)
            step = np.where(tile_max > 0, tile_max, 1.0) / code_max
        x = p[:, key] + carry
        code = np.clip(np.rint(x / step), 0, code_max)
        carry = x - code * step
        out[:, key] = code * step
    return out


def value_codes(v: np.ndarray, limit: int) -> np.ndarray:
    """V rounded per channel and key tile to `limit` steps of max|v| / limit."""
    out = np.empty_like(v)
    for start in range(0, v.shape[0], KEY_TILE):
        tile = v[start : start + KEY_TILE]
        scale = np.abs(tile).max(axis=0) / limit
        out[start : start + KEY_TILE] = np.rint(tile / scale) * scale
    return out


def main() -> None:
    rng = np.random.default_rng(0)
    print("| keys, head dim, temperature | " + " | ".join(s[0] for s in SCHEMES) + " |")
    print("|---" * (len(SCHEMES) + 1) + "|")
    for keys, dim, temperature in CASES:
        q = rng.standard_normal((256, dim))
        k = rng.standard_normal((keys, dim))
        v = rng.standard_normal((keys, dim))
        scores = temperature * q @ k.T / np.sqrt(dim)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        row_sums = p.sum(axis=1, keepdims=True)
        exact = p @ v / row_sums
        errors = []
        for _, p_max, v_limit, per_tile in SCHEMES:
            approx = probability_codes(p, p_max, per_tile) @ value_codes(v, v_limit) / row_sums
            errors.append(np.abs(approx - exact).sum() / np.abs(exact).sum())
        row = " | ".join(f"{e:.1e}" for e in errors)
        print(f"| {keys}, {dim}, {temperature:g} | {row} |")


if __name__ == "__main__":
    main()
