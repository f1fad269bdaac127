"""Which kernel variant runs each dtype on this machine: measured, not assumed.

The C++ core compiles several variants of the kernels (see ``npu_attn.runtime.available_isas()``).
Which one is fastest depends on the CPU, not only on what it supports: on a Sapphire Rapids
Xeon bfloat16 runs fastest on AMX tiles and ``vdpbf16ps`` loses to widening to float32, while
on an AMD Zen 4 (no AMX) ``vdpbf16ps`` is about twice as fast as widening. So on first use of a
dtype on a machine, npu_attn times the variants that run different code for that dtype on a
few representative shapes (one per shape class: self-attention, cross-attention with few keys,
a large head dim), keeps the fastest per dtype (and per shape class where another variant is
clearly faster there), caches the result under the CPU's fingerprint in
``$NPU_ATTN_CACHE_DIR/kernel_variants.json`` (default ``~/.cache/npu_attn``, next to ``auto``'s
cache) and logs the choice once.

The bfloat16 backward is measured on its own, on the first backward call (inference never
pays for it): its kernels (float32 FMA after widening, ``vdpbf16ps`` pairs, AMX tiles) differ
from the forward's, and on an AMX machine the fastest forward and the fastest backward may come
from different variants. It is cached next to the forward's choice (key ``"bfloat16
backward"``). Until then, and for float32 and float16 (whose backward code differs between
variants only in vector width, as the forward's does), the backward runs on the forward's
variant.

The int8 forward (the lossy opt-in ``int8`` strategy) has its own choice, one for every
dtype: its candidates are the variants with different int8 kernels (``int8_kernel`` in the
variant table), measured on the self-attention shape in float32 on its first call and cached
under the key ``"int8"``.

Whether the int8 kernel pays, and from which length, is measured too, per dtype, on its first
int8 call: the int8 kernel against the exact kernel the dtype runs (:func:`tune_int8_pays`),
on a longer self-attention shape (``INT8_COMPARISON_SHAPE``, where quantizing gains most) and
on shorter ones (``INT8_SHORT_LENGTHS``), where its per-token passes weigh more. Where the exact
kernel is the faster of the two on the long shape (bfloat16 on an AMX CPU, whose exact kernel
runs both products on bfloat16 tiles with the softmax pipelined between them: the int8 kernel
ran at 0.44-0.58x its speed on Sapphire Rapids), the ``int8`` strategy runs the exact kernel for
that dtype: faster and exact. Otherwise it runs the int8 kernel on calls from the shortest
measured length on which int8 won, and on every longer one (:func:`int8_min_scores`): the
break-even differs between CPU classes (Zen 3: 192-256 tokens; Sapphire Rapids with AVX-512
hidden: 384-512). The long shape is measured at other head dims too (``INT8_OTHER_HEAD_DIMS``):
calls with a head dim below the smallest from which int8 won at every larger one run the exact
kernel (:func:`int8_min_head_dim`; bfloat16 on Zen 4), and int8 pays where it won at the
largest. Cached under ``"int8 pays <dtype>"``.

Overrides: ``NPU_ATTN_ISA=name`` or ``npu_attn.runtime.set_isa(name)`` force one variant;
``NPU_ATTN_TUNE=0`` skips measuring and keeps the C++ rule (the most specialised runnable
variant). ``python -m npu_attn doctor --tune`` measures again.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from .cache import MeasurementCache, build_digest
from .extension import _C

logger = logging.getLogger("npu_attn")

DTYPES = ("float32", "bfloat16", "float16")

# One representative shape per C++ shape class: (batch, heads, len_q, len_k, head_dim). Small
# enough that measuring every variant of one dtype takes well under a second.
REPRESENTATIVE_SHAPES = {
    "self-attention": (1, 4, 512, 512, 64),
    "cross-attention": (2, 4, 512, 77, 64),
    "large head dim": (1, 1, 256, 512, 512),
}
# The int8-or-exact comparison (int8_pays): self-attention long enough for quantizing to gain
# where it can (Zen 3: int8 1.03x tiled at 1024 tokens, 1.07x at 2304), ~30 ms per call at one
# thread on an AVX2 core.
INT8_COMPARISON_SHAPE = (1, 2, 2048, 2048, 64)
# Shorter self-attention lengths (batch 1, INT8_SHORT_HEADS heads, the same head dim) for the
# shortest call the int8 kernel runs: the first is the shortest any CPU runs it on
# (ops.INT8_MIN_SCORES). With AVX-512 hidden on Sapphire Rapids (2 threads, head dim 64) int8
# ran at 0.87-0.95x the exact kernel's speed at 256 tokens, 0.99-1.03x at 512, 1.06-1.07x at 1024.
INT8_SHORT_LENGTHS = (256, 512, 1024)
INT8_SHORT_HEADS = 4
# The comparison length at the smallest head dim of the named diffusion models (SD-1.5's 40) and
# at Flux's 128: the softmax and the per-score passes (the probabilities' 16-bit codes) cost the
# same at any head dim, the products grow with it. On Zen 4 in bfloat16 (the exact kernel on
# vdpbf16ps) int8 ran SD-1.5 64x64 (head dim 40) at 0.93x the exact kernel's speed, SDXL 64x64
# (64) at 1.04x, Flux (128) at 1.11x and the VAE (512) at 1.27x; in float32 (the exact kernel on
# FMA) at 1.67x, 1.95x, 2.12x and 2.32x.
INT8_OTHER_HEAD_DIMS = (40, 128)
# The backward's shapes: the common head dim and Flux's; one overall choice (no shape classes).
BACKWARD_DTYPES = ("bfloat16",)
BACKWARD_SHAPES = {
    "head dim 64": (1, 4, 256, 256, 64),
    "head dim 128": (1, 2, 256, 256, 128),
}
REPEATS = 7
# A variant is kept for one shape class only when it beats the dtype's overall choice there by
# more than this: a smaller difference is within the noise of a shared machine.
CLASS_MARGIN = 0.10
# A candidate whose first run is this much slower than the fastest first run so far is dropped
# after that run (e.g. the portable variant next to AVX-512): it cannot win, and timing it more
# would make first use slow.
HOPELESS_RATIO = 4.0

_lock = threading.RLock()  # reentrant: tune_int8_pays holds it across tune() and tune_int8()
_decided: dict[str, dict] = {}  # dtype -> {"choice": {class: variant}, "reason": str, ...}
_decided_backward: dict[str, dict] = {}  # dtype -> {"choice": variant or None, "source": ...}
_pinned: Optional[str] = None  # set_isa(name): every dtype, no measuring


# --------------------------------------------------------------------------- cache
_CACHE = MeasurementCache("kernel_variants.json")


def cache_path() -> Path:
    return _CACHE.path


def fingerprint() -> str:
    """This CPU (model and the features dispatch uses), the variants that run on it and the
    npu_attn build: a cached choice is reused only where all of them are the same."""
    cpu = _C.cpu_info()
    build = _C.build_info()
    from .._version import __version__

    parts = [
        cpu["vendor"],
        cpu["model"],
        cpu["signature"],
        " ".join(cpu["features"]),
        " ".join(cpu["runnable_isas"]),
        build["compiler"],
        __version__,
        build_digest(),
    ]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def _backward_key(dtype: str) -> str:
    return f"{dtype} backward"


# --------------------------------------------------------------------------- measuring
def candidates(dtype: str) -> list[str]:
    """Runnable variants that run different code for ``dtype``: one per distinct forward
    kernel (the first, least specialised, variant of each), most specialised first."""
    seen: dict[str, str] = {}
    for row in _C.variants():
        if row["runnable"]:
            seen.setdefault(row["forward_kernel"][dtype], row["name"])
    return list(reversed(list(seen.values())))


def backward_candidates(dtype: str) -> list[str]:
    """Runnable variants with different backward code for ``dtype``: one per distinct backward
    kernel (``backward_from`` in the variant table), most specialised first; none for the
    dtypes whose backward follows the forward's choice."""
    if dtype not in BACKWARD_DTYPES:
        return []
    seen: dict[str, str] = {}
    for row in _C.variants():
        if row["runnable"]:
            seen.setdefault(row["backward_from"], row["name"])
    return list(reversed(list(seen.values())))


def int8_candidates() -> list[str]:
    """Runnable variants with different int8 kernels, most specialised first."""
    seen: dict[str, str] = {}
    for row in _C.variants():
        if row["runnable"]:
            seen.setdefault(row["int8_kernel"], row["name"])
    return list(reversed(list(seen.values())))


def _inputs(dtype: str, shape: tuple, seed: int = 0):
    """q, k, v and the output for one shape, as NumPy arrays (float32/float16) or torch
    tensors (bfloat16, which NumPy lacks)."""
    b, h, lq, lk, d = shape
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((b, h, n, d), dtype=np.float32) for n in (lq, lk, lk)]
    if dtype == "bfloat16":
        import torch
        from torch.utils.dlpack import to_dlpack

        tensors = [torch.from_numpy(a).to(torch.bfloat16) for a in arrays]
        out = torch.empty((b, h, lq, d), dtype=torch.bfloat16)
        return [to_dlpack(t) for t in tensors], to_dlpack(out), (tensors, out)
    np_dtype = np.float32 if dtype == "float32" else np.float16
    arrays = [a.astype(np_dtype) for a in arrays]
    out = np.empty((b, h, lq, d), dtype=np_dtype)
    return arrays, out, None


def measure(dtype: str, repeats: int = REPEATS) -> dict[str, dict[str, float]]:
    """CPU milliseconds of each candidate variant per shape class: one thread, best of
    ``repeats``, interleaved so every candidate sees the same machine state.

    Why one thread and CPU time (``time.thread_time``), not wall time on every thread: on a
    shared 2-core machine one descheduled OpenMP thread stalls a whole parallel call for a
    scheduler time slice (~10 ms), which swamps millisecond calls and made wall-clock choices
    random under load. The calling thread's CPU time is immune to that, and the variants split
    work across threads the same way, so their per-core cost ranks them. Hopeless candidates
    keep only their first time."""
    result: dict[str, dict[str, float]] = {}
    for shape_class, shape in REPRESENTATIVE_SHAPES.items():
        (q, k, v), out, keep = _inputs(dtype, shape)

        def run(name, q=q, k=k, v=v, out=out):
            start = time.thread_time()
            _C.forward(q, k, v, out, num_threads=1, isa=name)
            return time.thread_time() - start

        result[shape_class] = _interleaved_best(candidates(dtype), run, repeats)
        del keep
    return result


def measure_int8(repeats: int = REPEATS) -> dict[str, dict[str, float]]:
    """CPU milliseconds of each int8 candidate on the float32 self-attention shape, measured
    like :func:`measure`."""
    (q, k, v), out, _ = _inputs("float32", REPRESENTATIVE_SHAPES["self-attention"])

    def run(name):
        start = time.thread_time()
        _C.forward_int8(q, k, v, out, num_threads=1, isa=name)
        return time.thread_time() - start

    return {"self-attention": _interleaved_best(int8_candidates(), run, repeats)}


def _interleaved_best(names: list[str], run, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` milliseconds of ``run(name)`` per candidate, interleaved; hopeless
    candidates keep only their first time."""
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up, and the cut for hopeless candidates
        run(name)
        times[name].append(run(name))
    best_first = min(t[0] for t in times.values())
    alive = [n for n in names if times[n][0] <= HOPELESS_RATIO * best_first]
    for _ in range(repeats - 1):
        for name in alive:
            times[name].append(run(name))
    return {n: min(t) * 1e3 for n, t in times.items()}


def measure_backward(dtype: str, repeats: int = REPEATS) -> dict[str, dict[str, float]]:
    """CPU milliseconds of each backward candidate per shape of BACKWARD_SHAPES, measured like
    :func:`measure` (one thread, best of ``repeats``, interleaved)."""
    import torch
    from torch.utils.dlpack import to_dlpack

    torch_dtype = getattr(torch, dtype)
    result: dict[str, dict[str, float]] = {}
    generator = torch.Generator().manual_seed(0)
    for label, (b, h, lq, lk, d) in BACKWARD_SHAPES.items():
        q, k, v = (
            torch.randn(b, h, n, d, generator=generator).to(torch_dtype) for n in (lq, lk, lk)
        )
        out = torch.empty_like(q)
        lse = torch.empty(b, h, lq)
        grad_out = torch.randn(b, h, lq, d, generator=generator).to(torch_dtype)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        _C.forward(*map(to_dlpack, (q, k, v, out)), lse=to_dlpack(lse), num_threads=1)
        operands = [to_dlpack(t) for t in (q, k, v, out, lse, grad_out, *grads)]

        def run(name, operands=operands):
            start = time.thread_time()
            _C.backward(*operands, num_threads=1, isa=name)
            return time.thread_time() - start

        result[label] = _interleaved_best(backward_candidates(dtype), run, repeats)
    return result


def decide(ms: dict[str, dict[str, float]]) -> dict[str, str]:
    """The variant per shape class from measured times: the dtype's overall choice is the
    variant with the lowest geometric-mean time over the classes; a class keeps its own
    fastest variant only when that beats the overall choice there by more than CLASS_MARGIN."""
    common = set.intersection(*(set(per.keys()) for per in ms.values()))
    overall = min(
        sorted(common),
        key=lambda n: sum(math.log(per[n]) for per in ms.values()),
    )
    choice = {}
    for shape_class, per in ms.items():
        fastest = min(per, key=per.get)
        better = per[fastest] < (1 - CLASS_MARGIN) * per[overall]
        choice[shape_class] = fastest if better else overall
    return choice


def decide_backward(ms: dict[str, dict[str, float]]) -> str:
    """The backward variant: the lowest geometric-mean time over the measured shapes."""
    common = set.intersection(*(set(per.keys()) for per in ms.values()))
    return min(sorted(common), key=lambda n: sum(math.log(per[n]) for per in ms.values()))


def format_timings(per: dict[str, float]) -> str:
    """``{variant: ms}`` as "fastest 1.00 ms, next 1.50 ms, ..."."""
    return ", ".join(f"{n} {t:.2f} ms" for n, t in sorted(per.items(), key=lambda x: x[1]))


def _describe(dtype: str, entry: dict[str, Any]) -> str:
    parts = [
        f"{shape_class}: {entry['choice'][shape_class]} ({format_timings(per)})"
        for shape_class, per in entry.get("ms", {}).items()
    ]
    backward = entry.get("backward")
    if backward and backward.get("ms"):
        timings = "; ".join(
            f"{label}: {format_timings(per)}" for label, per in backward["ms"].items()
        )
        parts.append(f"backward: {backward['choice']} ({timings})")
    return f"{dtype}: " + "; ".join(parts)


# --------------------------------------------------------------------------- the choice
def _apply(dtype: str, entry: dict[str, Any]) -> None:
    for shape_class, name in entry["choice"].items():
        _C.set_isa(name, dtype, shape_class)


def _environment_pin() -> Optional[str]:
    return os.environ.get("NPU_ATTN_ISA") or None


def _rule_choice(dtype: str) -> dict[str, str]:
    return {c: _C.default_isa(dtype) for c in _C.shape_classes()}


def _tuning_disabled() -> bool:
    return os.environ.get("NPU_ATTN_TUNE", "1").strip() == "0"


def _settle(
    key: str,
    force: bool,
    fixed: Optional[dict[str, Any]],
    rule: Callable[[], dict[str, Any]],
    still_valid: Callable[[dict[str, Any]], bool],
    measure: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """The protocol every decision here follows, in this order: a ``fixed`` answer (a pinned
    variant, a single candidate) stands; ``NPU_ATTN_TUNE=0`` takes the ``rule`` (unless
    ``force``); a cached entry under ``key`` serves while ``still_valid``; otherwise
    ``measure()`` (its entry gets the date, is cached and logged by the caller). Called under
    ``_lock``; returns the entry with its ``source``."""
    if fixed is not None:
        return fixed
    if _tuning_disabled() and not force:
        return rule()
    entry = None if force else _CACHE.get(fingerprint(), key)
    if entry is not None and still_valid(entry):
        return dict(entry, source=f"measured {entry.get('measured', '')}, cached")
    stamp = time.strftime("%Y-%m-%d")
    entry = dict(measure(), measured=stamp)
    _CACHE.store(fingerprint(), key, entry)
    return dict(entry, source=f"measured {stamp}")


def _pin() -> Optional[tuple[str, str]]:
    """The pinned variant and how (``set_isa()`` or ``NPU_ATTN_ISA=name``), None if none is."""
    if _pinned:
        return _pinned, "set_isa()"
    name = _environment_pin()
    return (name, f"NPU_ATTN_ISA={name}") if name else None


def tune(dtype: str, force: bool = False) -> dict[str, Any]:
    """Choose the variant for ``dtype`` (measuring unless cached, pinned or disabled), apply it
    to the C++ dispatcher and return the decision: ``choice`` (shape class -> variant),
    ``source`` and, when measured, ``ms`` (CPU milliseconds per shape class and candidate).
    ``force`` measures even if a cached choice exists."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    with _lock:
        if not force and dtype in _decided:
            return _decided[dtype]
        classes = _C.shape_classes()
        fixed, pin = None, _pin()
        if pin:
            fixed = {"choice": dict.fromkeys(classes, pin[0]), "source": pin[1]}
        elif len(candidates(dtype)) == 1 and not (_tuning_disabled() and not force):
            only = candidates(dtype)[0]  # (NPU_ATTN_TUNE=0 reports the rule, as it always did)
            fixed = {"choice": dict.fromkeys(classes, only), "source": "only variant"}

        def measured() -> dict[str, Any]:
            ms = measure(dtype)
            entry = {"choice": decide(ms), "ms": ms}
            logger.info(
                "npu_attn: kernel variants measured on this CPU, %s", _describe(dtype, entry)
            )
            return entry

        entry = _settle(
            dtype,
            force,
            fixed,
            rule=lambda: {"choice": _rule_choice(dtype), "source": "rule (NPU_ATTN_TUNE=0)"},
            still_valid=lambda cached: _usable(dtype, cached),
            measure=measured,
        )
        _apply(dtype, entry)
        _decided[dtype] = entry
        return entry


def _usable(dtype: str, entry: dict[str, Any]) -> bool:
    """A cached entry names only variants this CPU runs."""
    names = set(entry.get("choice", {}).values())
    return bool(names) and names <= set(_C.runnable_isas())


def tune_backward(dtype: str, force: bool = False) -> dict[str, Any]:
    """Choose the backward's variant for ``dtype`` like :func:`tune` (measured where its
    backward kernels differ, i.e. bfloat16 with more than one candidate; pinned, disabled or
    otherwise the forward's variant: ``choice`` None), apply it and return the decision."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    with _lock:
        tune(dtype)  # the forward's choice first: the backward follows it unless measured
        if not force and dtype in _decided_backward:
            return _decided_backward[dtype]
        fixed, pin = None, _pin()
        if pin:
            fixed = {"choice": None, "source": pin[1]}
        elif len(backward_candidates(dtype)) < 2:
            fixed = {"choice": None, "source": "the forward's variant"}

        def measured() -> dict[str, Any]:
            ms = measure_backward(dtype)
            entry = {"choice": decide_backward(ms), "ms": ms}
            logger.info(
                "npu_attn: kernel variants measured on this CPU, %s",
                _describe(dtype, {"choice": {}, "backward": entry}),
            )
            return entry

        entry = _settle(
            _backward_key(dtype),
            force,
            fixed,
            rule=lambda: {"choice": None, "source": "the forward's variant (NPU_ATTN_TUNE=0)"},
            still_valid=lambda cached: cached.get("choice") in _C.runnable_isas(),
            measure=measured,
        )
        _C.set_backward_isa(entry["choice"], dtype)
        _decided_backward[dtype] = entry
        return entry


_decided_int8: dict[str, Any] = {}
_decided_int8_pays: dict[str, dict] = {}  # dtype -> {"pays", "min_tokens", "source", ...}


def tune_int8(force: bool = False) -> dict[str, Any]:
    """Choose the int8 forward's variant like :func:`tune` (pinned, disabled, the only
    candidate, cached or measured), apply it and return the decision (``choice``: a variant)."""
    with _lock:
        if not force and _decided_int8:
            return _decided_int8
        names = int8_candidates()
        fixed, pin = None, _pin()
        if pin:
            fixed = {"choice": pin[0], "source": pin[1]}
        elif len(names) == 1:
            fixed = {"choice": names[0], "source": "only variant"}

        def measured() -> dict[str, Any]:
            ms = measure_int8()
            entry = {"choice": decide_backward(ms), "ms": ms}
            logger.info("npu_attn: int8 kernel measured on this CPU: %s", entry["choice"])
            return entry

        entry = _settle(
            "int8",
            force,
            fixed,
            rule=lambda: {"choice": _C.default_int8_isa(), "source": "rule (NPU_ATTN_TUNE=0)"},
            still_valid=lambda cached: cached.get("choice") in _C.runnable_isas(),
            measure=measured,
        )
        _C.set_int8_isa(entry["choice"])
        _decided_int8.clear()
        _decided_int8.update(entry)
        return entry


def ensure_int8() -> None:
    """Make sure the int8 forward's variant is chosen (cheap after the first call)."""
    if not _decided_int8:
        tune_int8()


def measure_int8_against_exact(
    dtype: str, shape: tuple = INT8_COMPARISON_SHAPE, repeats: int = REPEATS
) -> dict[str, float]:
    """CPU milliseconds of the chosen int8 kernel (``"int8"``) and of ``dtype``'s exact kernel
    (``"exact"``) on ``shape`` (batch, heads, len_q, len_k, head_dim), measured like
    :func:`measure`."""
    (q, k, v), out, keep = _inputs(dtype, shape)

    def run(name):
        start = time.thread_time()
        if name == "int8":
            _C.forward_int8(q, k, v, out, num_threads=1)
        else:
            _C.forward(q, k, v, out, num_threads=1)
        return time.thread_time() - start

    ms = _interleaved_best(["int8", "exact"], run, repeats)
    del keep
    return ms


def _short_shape(length: int) -> tuple:
    return (1, INT8_SHORT_HEADS, length, length, INT8_COMPARISON_SHAPE[-1])


def _head_dim_shape(head_dim: int) -> tuple:
    return INT8_COMPARISON_SHAPE[:-1] + (head_dim,)


def _won(ms: dict[str, float]) -> bool:
    return ms["int8"] < ms["exact"]


def decide_int8(
    long_ms: dict[str, float],
    short_ms: dict[int, dict[str, float]],
    head_dim_ms: Optional[dict[int, dict[str, float]]] = None,
) -> dict:
    """From the timings of the long shape (``long_ms``), of shorter ones at its head dim
    (``short_ms``, by length) and of the long length at other head dims (``head_dim_ms``):
    ``min_head_dim``, the smallest measured head dim from which the int8 kernel was faster at
    every larger one measured (0 where that is the smallest measured: no limit); ``pays``, it
    was faster at the largest; ``min_tokens``, the shortest measured length from which it was
    faster on every longer one at the long shape's head dim (that shape's length if it lost
    there). A length or head dim it lost on keeps every smaller one on the exact kernel, even
    one it won by noise. None where it does not pay."""
    by_head_dim = dict(head_dim_ms or {})
    by_head_dim[INT8_COMPARISON_SHAPE[-1]] = long_ms
    min_head_dim = None
    for head_dim in sorted(by_head_dim, reverse=True):
        if not _won(by_head_dim[head_dim]):
            break
        min_head_dim = head_dim
    if min_head_dim is None:
        return {"pays": False, "min_tokens": None, "min_head_dim": None}
    if min_head_dim == min(by_head_dim):
        min_head_dim = 0
    min_tokens = INT8_COMPARISON_SHAPE[2]
    for length in sorted(short_ms, reverse=True) if _won(long_ms) else ():
        if not _won(short_ms[length]):
            break
        min_tokens = length
    return {"pays": True, "min_tokens": min_tokens, "min_head_dim": min_head_dim}


def tune_int8_pays(dtype: str, force: bool = False) -> dict[str, Any]:
    """Decide whether the int8 strategy runs the int8 kernel for ``dtype`` (``pays``), and
    from how many tokens (``min_tokens``: calls with fewer than its square of scores per head
    run the exact kernel), or only the exact one, faster on this CPU: measured unless cached;
    with a pinned variant (``NPU_ATTN_ISA``, ``set_isa``) or ``NPU_ATTN_TUNE=0``, the int8
    kernel from the shortest measured length."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not force and dtype in _decided_int8_pays:
        return _decided_int8_pays[dtype]
    with _lock:
        # Both kernels chosen under the same hold, so a concurrent pin() or forget() cannot
        # empty a decision between choosing it and reading it.
        kernels = {"int8": tune_int8()["choice"], "exact": tune(dtype)["choice"]["self-attention"]}
        always = {"pays": True, "min_tokens": INT8_SHORT_LENGTHS[0], "min_head_dim": 0}
        fixed = dict(always, source="pinned variant: int8 kernel") if _pin() else None

        def measured() -> dict[str, Any]:
            ms = measure_int8_against_exact(dtype)
            short = {
                n: measure_int8_against_exact(dtype, _short_shape(n)) for n in INT8_SHORT_LENGTHS
            }
            head_dims = {
                d: measure_int8_against_exact(dtype, _head_dim_shape(d))
                for d in INT8_OTHER_HEAD_DIMS
            }
            entry = dict(decide_int8(ms, short, head_dims), kernels=kernels, ms=ms)
            entry["short_ms"] = {str(n): t for n, t in short.items()}  # JSON keys
            entry["head_dim_ms"] = {str(d): t for d, t in head_dims.items()}
            logger.info(
                "npu_attn: int8 on %s measured against the exact kernel: %s (%s)",
                dtype,
                int8_scope(entry),
                format_timings(ms),
            )
            return entry

        entry = _settle(
            f"int8 pays {dtype}",
            force,
            fixed,
            rule=lambda: dict(always, source="rule (NPU_ATTN_TUNE=0)"),
            # The two kernels compared: a cached answer holds only while both are still chosen
            # (and it says from which length and head dim; older entries are measured again).
            still_valid=lambda cached: (
                cached.get("kernels") == kernels
                and "min_tokens" in cached
                and "head_dim_ms" in cached
            ),
            measure=measured,
        )
        _decided_int8_pays[dtype] = entry
        return entry


def int8_pays(dtype: str) -> bool:
    """Whether int8 calls in ``dtype`` run the int8 kernel at all on this CPU
    (:func:`tune_int8_pays`; measured on the first call)."""
    return tune_int8_pays(dtype)["pays"]


def int8_min_scores(dtype: str) -> Optional[int]:
    """Scores per (batch, head) from which int8 calls in ``dtype`` run the int8 kernel on this
    CPU (None: never, the exact kernel is faster); :func:`tune_int8_pays`."""
    decision = tune_int8_pays(dtype)
    return decision["min_tokens"] ** 2 if decision["pays"] else None


def int8_min_head_dim(dtype: str) -> int:
    """The smallest head dim of int8 calls in ``dtype`` that run the int8 kernel on this CPU
    (0: any; :func:`tune_int8_pays`); smaller ones run the exact kernel."""
    return tune_int8_pays(dtype).get("min_head_dim") or 0


def int8_scope(decision: dict) -> str:
    """Which int8 calls run the int8 kernel, in words (logs, ``doctor``)."""
    if not decision["pays"]:
        return "exact kernel (faster here)"
    scope = f"int8 kernel from {decision['min_tokens']} tokens"
    if decision.get("min_head_dim"):
        scope += f" and head dim {decision['min_head_dim']}"
    return scope


def int8_comparisons(decision: dict) -> list[tuple[str, dict[str, float]]]:
    """The measured int8-against-exact timings behind a decision, labelled by shape ("B1 H2
    L2048 D64"): the comparison shape, then the other head dims and the shorter lengths, for
    ``doctor``; empty where nothing was measured."""
    if "ms" not in decision:
        return []

    def label(shape: tuple) -> str:
        batch, heads, length, _, head_dim = shape
        return f"B{batch} H{heads} L{length} D{head_dim}"

    rows = [(label(INT8_COMPARISON_SHAPE), decision["ms"])]
    for d, ms in sorted(decision.get("head_dim_ms", {}).items(), key=lambda x: int(x[0])):
        rows.append((label(_head_dim_shape(int(d))), ms))
    for n, ms in sorted(decision.get("short_ms", {}).items(), key=lambda x: -int(x[0])):
        rows.append((label(_short_shape(int(n))), ms))
    return rows


def ensure(dtype: str, backward: bool = False) -> None:
    """Make sure ``dtype``'s variant (with ``backward``, also its backward's) is chosen before
    a kernel call (cheap after the first)."""
    if dtype not in _decided:
        tune(dtype)
    if backward and dtype not in _decided_backward:
        tune_backward(dtype)


def pinned() -> Optional[str]:
    """The variant ``set_isa`` forced for every dtype, None if it did not."""
    return _pinned


def pin(name: Optional[str]) -> None:
    """``set_isa``: force one variant for every dtype (``None``: back to the measured choice)."""
    global _pinned
    # All under the lock: a tune() in another thread then either finishes first (and the rule
    # below replaces its choice, which is forgotten too) or starts after (and what it applies
    # is what _decided records); never the rule in C++ behind a decision that says otherwise.
    with _lock:
        if name is not None:
            # First, so a variant this CPU cannot run raises before anything is recorded: a
            # recorded pin would make every later kernel call raise too.
            _C.set_isa(name)  # the backward's too
            _C.set_int8_isa(name)
        _pinned = name
        _decided.clear()
        _decided_backward.clear()
        _decided_int8.clear()
        _decided_int8_pays.clear()
        if name is None:
            _C.set_int8_isa(_C.default_int8_isa())
            for dtype in DTYPES:  # the rule until the next use measures or loads the choice
                _apply(dtype, {"choice": _rule_choice(dtype)})
                _C.set_backward_isa(None, dtype)


def forget() -> None:
    """Drop the in-process decisions (tests; the disk cache stays)."""
    with _lock:
        _decided.clear()
        _decided_backward.clear()
        _decided_int8.clear()
        _decided_int8_pays.clear()


def report() -> dict[str, dict[str, Any]]:
    """Per dtype: the variant per shape class, where the choice came from and the timings,
    and ``backward``: the backward's decision (:func:`tune_backward`; measured now if not yet)."""
    return {
        dtype: dict(tune(dtype), backward=tune_backward(dtype))
        for dtype in DTYPES
        if _dtype_usable(dtype)
    }


def _dtype_usable(dtype: str) -> bool:
    return dtype != "bfloat16" or "torch" in sys.modules or _torch_importable()


def _torch_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None
