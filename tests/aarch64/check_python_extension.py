"""The npu_attn._C extension as built for AArch64, loaded by an AArch64 CPython (under qemu-user,
scripts/aarch64_python.sh): it imports, reports the variants CMake compiled for the target, and
each runnable variant computes attention that matches a float64 NumPy reference.

Run as: python check_python_extension.py PATH/TO/_C.cpython-311-aarch64-linux-gnu.so
(torch has no part here: the extension takes NumPy arrays through DLPack.)
"""

import importlib.machinery
import importlib.util
import platform
import sys

import numpy as np


def load_extension(path):
    loader = importlib.machinery.ExtensionFileLoader("_C", path)
    spec = importlib.util.spec_from_file_location("_C", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def reference(q, k, v, mask, scale):
    """float64 attention; k and v have fewer heads than q (grouped-query attention)."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float64), group, axis=1)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    scores = q.astype(np.float64) @ k.transpose(0, 1, 3, 2) * scale
    scores = np.where(mask, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


def check_variant(_C, isa, rng):
    # head dim 40 (SD-1.5), 77 keys (text tokens), 4 query heads over 2 key/value heads, a mask
    q = rng.standard_normal((2, 4, 67, 40), dtype=np.float32)
    k = rng.standard_normal((2, 2, 77, 40), dtype=np.float32)
    v = rng.standard_normal((2, 2, 77, 40), dtype=np.float32)
    mask = rng.random((2, 1, 67, 77)) > 0.2
    mask[..., 0] = True  # no fully masked row
    out = np.empty_like(q)
    scale = 1.0 / np.sqrt(q.shape[-1])
    _C.forward(q, k, v, out, attn_mask=mask, scale=scale, enable_gqa=True, isa=isa)
    error = float(np.abs(out - reference(q, k, v, mask, scale)).max())
    assert error < 1e-5, f"{isa}: max error {error:.2e}"
    return error


def main(path):
    assert platform.machine() == "aarch64", platform.machine()
    _C = load_extension(path)
    compiled = _C.build_info()["compiled_isas"]
    assert compiled == ["scalar", "neon"], compiled  # only the variants AArch64 can run
    runnable = _C.runnable_isas()
    assert "neon" in runnable, (runnable, _C.cpu_info()["features"])
    rng = np.random.default_rng(0)
    for isa in runnable:
        error = check_variant(_C, isa, rng)
        print(f"aarch64 python extension: {isa} forward matches float64 (max error {error:.1e})")
    versions = f"CPython {platform.python_version()}, numpy {np.__version__}"
    print(f"aarch64 python extension: ok ({versions})")


if __name__ == "__main__":
    main(sys.argv[1])
