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

`--whole-scheme` models the whole int8 kernel instead (Q·Kᵀ as the kernel quantizes it: query
channel factors, K smoothed per key tile, per-token codes; then P·V in each width) on the
accuracy report's shapes and inputs (bench/int8_accuracy.py: keys with per-channel offsets,
query outlier channels, as in the accuracy test), against float64 exact attention. The kernel's
own error on the same inputs is printed first: it checks the model (its 16-bit column).

    python bench/int8_pv_code_widths.py                  # numpy only, about a minute
    python bench/int8_pv_code_widths.py --whole-scheme   # torch and npu_attn, about a minute
"""

from __future__ import annotations

import sys
from pathlib import Path

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


def value_codes(v: np.ndarray, limit: int, smoothed: bool = False) -> np.ndarray:
    """V rounded per channel and key tile to `limit` steps of max|v| / limit (smoothed: of
    V minus the tile's per-channel mean, which is added back exactly)."""
    out = np.empty_like(v)
    for start in range(0, v.shape[0], KEY_TILE):
        tile = v[start : start + KEY_TILE]
        mean = tile.mean(axis=0) if smoothed else np.zeros(v.shape[1])
        scale = np.abs(tile - mean).max(axis=0) / limit
        out[start : start + KEY_TILE] = np.rint((tile - mean) / scale) * scale + mean
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


WHOLE_SCHEME_PV = (  # (label, P code maximum, V code limit, P per query and tile, V smoothed)
    ("14-bit P, 11-bit V (the kernel)", 16383, 1023, False, False),
    ("8-bit P per query and tile, 11-bit V", 255, 1023, True, False),
    ("14-bit P, 8-bit V", 16383, 127, False, False),
    ("8-bit P per query and tile, 8-bit V (vpdpbusd)", 255, 127, True, False),
    ("the same, V smoothed per tile", 255, 127, True, True),
)


def int8_codes(x: np.ndarray) -> np.ndarray:
    """Per-row codes in [-127, 127], dequantized (the kernel's per-token Q and K codes)."""
    scale = np.abs(x).max(axis=1, keepdims=True) / 127
    scale = np.where(scale > 0, scale, 1.0)
    return np.clip(np.rint(x / scale), -127, 127) * scale


def int8_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Q·Kᵀ / sqrt(D) as the kernel computes it: query channel factors c_d (moved into K), K
    smoothed by each key tile's mean (added back exactly), per-token 8-bit codes."""
    qs = q / np.sqrt(q.shape[1])
    channel_max = np.abs(qs).max(axis=0)
    factors = np.sqrt(channel_max / channel_max.mean())
    factors = np.where(factors > 0, factors, 1.0)
    q_codes = int8_codes(qs / factors)
    scores = np.empty((q.shape[0], k.shape[0]))
    for start in range(0, k.shape[0], KEY_TILE):
        tile = k[start : start + KEY_TILE]
        mean = tile.mean(axis=0)
        k_codes = int8_codes((tile - mean) * factors)
        scores[:, start : start + KEY_TILE] = q_codes @ k_codes.T + (qs @ mean)[:, None]
    return scores


def relative_l1(out: np.ndarray, exact: np.ndarray) -> float:
    return float(np.abs(out - exact).sum() / np.abs(exact).sum())


def whole_scheme() -> None:
    """The table of --whole-scheme: the accuracy report's shapes and inputs
    (bench/int8_accuracy.py, the same as the accuracy test's)."""
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import int8_accuracy
    import npu_attn
    from npu_attn.attention import ops

    ops.INT8_MIN_SCORES = ops.INT8_MIN_KEYS = 0  # the int8 kernel on every shape, as the test
    print("| shape | the kernel | " + " | ".join(s[0] for s in WHOLE_SCHEME_PV) + " |")
    print("|---" * (len(WHOLE_SCHEME_PV) + 2) + "|")
    for label, lq, lk, dim in int8_accuracy.SHAPES:
        heads = 1 if dim >= 128 else 2
        q, k, v = int8_accuracy.diffusion_like(lq, lk, dim, heads)
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())[0].numpy()
        measured = npu_attn.scaled_dot_product_attention(q, k, v, backend="int8")[0].double()

        qs, ks, vs = (x[0].double().numpy() for x in (q, k, v))
        scores = [int8_scores(qs[h], ks[h]) for h in range(heads)]
        row = [relative_l1(measured.numpy(), exact)]
        for _, p_max, v_limit, per_tile, smoothed in WHOLE_SCHEME_PV:
            out = []
            for h in range(heads):
                p = np.exp(scores[h] - scores[h].max(axis=1, keepdims=True))
                values = value_codes(vs[h], v_limit, smoothed)
                out.append(probability_codes(p, p_max, per_tile) @ values / p.sum(axis=1)[:, None])
            row.append(relative_l1(np.stack(out), exact))
        print(f"| {label} | " + " | ".join(f"{e:.2e}" for e in row) + " |", flush=True)


if __name__ == "__main__":
    whole_scheme() if "--whole-scheme" in sys.argv[1:] else main()
