"""``auto``: the fastest strategy per attention shape on CPU, measured once and cached.

The first call with a new shape (batch, heads, lengths, head dims, dtype, mask kind, causal)
times the candidates (``tiled``, ``sdpa``, and ``vanilla`` where its score matrix is small,
except in 16-bit types) on the real tensors, interleaved, and keeps the fastest; under
autograd the time is forward + backward, cached separately. The choice is kept in memory and in
``$NPU_ATTN_CACHE_DIR/auto_strategy.json`` (default ``~/.cache/npu_attn``) under a fingerprint
of this machine and software, and logged. On an Ascend NPU ``auto`` is ``npu``; on other
accelerators ``sdpa``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from ..runtime import controls as _runtime
from ..runtime.cache import MeasurementCache, build_digest
from ..runtime.timing import interleaved_medians
from ..runtime.variant_choice import DTYPES as KERNEL_DTYPES
from .backends import npu as npu_backend
from .backends.base import FLOATS, needs_grad

logger = logging.getLogger("npu_attn")

_CACHE = MeasurementCache("auto_strategy.json")


class AutoSelector:
    """Picks the fastest strategy per attention shape on CPU by measuring it once.

    The first call with a new shape (batch, heads, lengths, head dims, dtype, mask kind,
    causal) times the candidates on the real tensors, interleaved, and keeps the fastest; the
    choice is cached in memory and in ``$NPU_ATTN_CACHE_DIR/auto_strategy.json`` (default
    ``~/.cache/npu_attn``) under a fingerprint of this machine and software, and logged.
    """

    repeats = 3

    def __init__(self, runner: Callable[[str], Callable[..., torch.Tensor]]) -> None:
        """``runner(name)`` gives the SDPA-signature function of strategy ``name`` (the
        strategies layer passes its table, so measured and chosen calls are counted there)."""
        self._runner = runner
        self._lock = threading.Lock()
        self._memory: dict[tuple, dict] = {}  # by (*_context(dtype), dtype, shape key)
        self.measurements = 0  # how many shapes were measured (not served from cache)
        _SELECTORS[id(self)] = self  # traced calls name the selector by this constant

    # -- cache ---------------------------------------------------------------
    @staticmethod
    def cache_path() -> Path:
        return _CACHE.path

    @staticmethod
    def fingerprint(dtype: str = "float32") -> str:
        """The cache file's key for this machine and software, thread count and the kernel
        variant that runs ``dtype`` (a choice measured at 2 threads says nothing about 16)."""
        from .._version import __version__

        parts = [
            _runtime.cpu_identity(),
            str(os.cpu_count()),
            str(_runtime.get_num_threads()),
            torch.__version__,
            __version__,
            build_digest(),
            _variant_running(dtype),
        ]
        return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]

    @staticmethod
    def _context(dtype: str) -> tuple[int, str]:
        """What an in-memory choice holds for besides its shape: the parts of the fingerprint
        that can change within a process (threads, the variant running ``dtype``: ``set_isa``
        can change bfloat16's and leave float32's), cheaper to read per call."""
        return _runtime.get_num_threads(), _variant_running(dtype)

    def cached_choice(self, key: str, dtype: str = "float32") -> Optional[dict]:
        """The choice for shape ``key`` of ``dtype`` inputs in this context, from memory or the
        cache file; None if neither has one."""
        memory_key = (*self._context(dtype), dtype, key)
        entry = self._memory.get(memory_key)
        if entry is None:
            entry = _CACHE.get(self.fingerprint(dtype), key)
            if entry is not None:
                self._memory[memory_key] = entry
        return entry

    def _remember(self, key: str, dtype: str, result: dict) -> None:
        """Keeps a new measurement in memory and in the cache file."""
        self._memory[(*self._context(dtype), dtype, key)] = result
        self.measurements += 1
        _CACHE.store(self.fingerprint(dtype), key, result)

    def forget(self) -> None:
        """Drops the choices this process holds in memory, so the next call of each shape reads
        the cache file or measures again (delete :meth:`cache_path` to measure again
        everywhere)."""
        with self._lock:
            self._memory.clear()

    # -- measurement ----------------------------------------------------------
    @staticmethod
    def spec(query, key, value, attn_mask, is_causal, enable_gqa) -> tuple:
        """What the choice depends on, as plain Python values: shapes, dtype, mask kind,
        causal, GQA. Under torch.compile these are constants of the traced graph."""
        mask = None if attn_mask is None else (str(attn_mask.dtype), tuple(attn_mask.shape))
        shapes = (tuple(query.shape), tuple(key.shape), tuple(value.shape))
        return (*shapes, str(query.dtype), mask, bool(is_causal), bool(enable_gqa))

    @staticmethod
    def key_of(spec: tuple) -> str:
        q, k, v, dtype, mask, causal, gqa = spec
        mask_text = "none" if mask is None else f"{mask[0]}{mask[1]}"
        return f"q{q} k{k} v{v} {dtype} mask={mask_text} causal={causal} gqa={gqa}"

    @classmethod
    def shape_key(cls, query, key, value, attn_mask, is_causal, enable_gqa) -> str:
        return cls.key_of(cls.spec(query, key, value, attn_mask, is_causal, enable_gqa))

    @staticmethod
    def candidates(query, key) -> list[str]:
        names = ["tiled", "sdpa"]
        if query.dtype in (torch.bfloat16, torch.float16):
            # vanilla rounds the scores to the 16-bit type before the softmax (as diffusers'
            # AttnProcessor does): an error of |s| x 2^-9 in bfloat16 on every exponent, which
            # torch's SDPA and tiled avoid (float32 scores), so auto never trades it for speed.
            return names
        b_h = query.numel() // max(query.shape[-1], 1) // max(query.shape[-2], 1)
        score_bytes = b_h * query.shape[-2] * key.shape[-2] * 4
        if score_bytes <= 64 << 20:  # vanilla only where its score matrix is small
            names.append("vanilla")
        return names

    def _forward_backward(self, name, args):
        """One training step of candidate `name` on detached copies of the inputs (the caller's
        graph is untouched): forward, then backward of the output's sum."""
        leaves = [
            t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in args[:4]
        ]
        out = self._runner(name)(*leaves, *args[4:])
        out.sum().backward()

    def _measure(self, args, training: bool = False) -> dict:
        """Times every candidate, interleaved; under autograd a candidate's time is forward +
        backward. Returns the choice, the medians and (inference only) the chosen output."""
        names = self.candidates(args[0], args[1])
        outputs = {}

        def run(name):
            if training:
                self._forward_backward(name, args)
            else:
                outputs[name] = self._runner(name)(*args)

        # (the warm-up call of each also keeps, for inference, the result we return)
        calls = {name: functools.partial(run, name) for name in names}
        seconds = interleaved_medians(calls, self.repeats)
        ms = {n: s * 1e3 for n, s in seconds.items()}
        choice = min(ms, key=ms.get)
        output = self._runner(choice)(*args) if training else outputs[choice]
        return {"choice": choice, "ms": ms, "_output": output}

    def __call__(
        self,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if query.device.type != "cpu":
            name = "npu" if npu_backend.unavailable_reason(query.device.type) is None else "sdpa"
            return self._runner(name)(*args)
        if dropout_p > 0.0:
            return self._runner("sdpa")(*args)  # the only candidates with dropout
        if query.dtype not in FLOATS:  # float64: npu_attn's kernels take 16- and 32-bit floats
            return self._runner("sdpa")(*args)
        training = needs_grad(query, key, value, attn_mask)
        if torch.compiler.is_compiling():
            spec = self.spec(query, key, value, attn_mask, is_causal, enable_gqa)
            return self._runner(self._choice_while_tracing(spec, training))(*args)
        key_str = self.shape_key(query, key, value, attn_mask, is_causal, enable_gqa)
        if training:  # chosen by forward + backward time, cached separately
            key_str += " fwd+bwd"
        dtype = _dtype_name(query.dtype)
        entry = self.cached_choice(key_str, dtype)
        if entry is not None:
            return self._runner(entry["choice"])(*args)
        with self._lock:  # one measurement at a time: concurrent timing would be meaningless
            entry = self.cached_choice(key_str, dtype)
            if entry is not None:
                return self._runner(entry["choice"])(*args)
            result = self._measure(args, training)
            output = result.pop("_output")
            self._remember(key_str, dtype, result)
        timings = ", ".join(f"{n} {t:.2f} ms" for n, t in sorted(result["ms"].items()))
        logger.info("npu_attn auto: %s -> %s (%s)", key_str, result["choice"], timings)
        return output

    # -- torch.compile ----------------------------------------------------------
    def _choice_while_tracing(self, spec: tuple, training: bool) -> str:
        """The strategy for ``spec`` while torch.compile traces: shapes are known then, so the
        per-shape choice is made now (from the cache, or measured on random tensors of those
        shapes) and baked into the graph. Symbolic shapes (``dynamic=True``) cannot be
        measured: they get ``tiled`` (exact on every shape), with a warning."""
        shapes = spec[:3] + (() if spec[4] is None else (spec[4][1],))
        if not all(isinstance(d, int) for shape in shapes for d in shape):
            _warn_dynamic()
            return "tiled"
        return _resolve_traced_choice(id(self), spec, training)

    def choose_for_spec(self, spec: tuple, training: bool) -> str:
        """The cached choice for ``spec``, else measured now on random tensors of its shapes."""
        key_str = self.key_of(spec) + (" fwd+bwd" if training else "")
        dtype = _dtype_name(spec[3])
        entry = self.cached_choice(key_str, dtype)
        if entry is not None:
            return entry["choice"]
        with self._lock:
            entry = self.cached_choice(key_str, dtype)
            if entry is not None:
                return entry["choice"]
            result = self._measure(_random_args(spec, training), training)
            result.pop("_output")
            self._remember(key_str, dtype, result)
        timings = ", ".join(f"{n} {t:.2f} ms" for n, t in sorted(result["ms"].items()))
        logger.info("npu_attn auto: %s -> %s (%s)", key_str, result["choice"], timings)
        return result["choice"]

    def choices(self) -> dict[str, str]:
        """Shape -> chosen strategy, for every shape measured or loaded in this process at the
        current thread count and kernel variants."""
        return {
            key: entry["choice"]
            for (*context, dtype, key), entry in self._memory.items()
            if tuple(context) == self._context(dtype)
        }


def _dtype_name(dtype) -> str:
    """The dtype's name without "torch.", from a torch.dtype or from a spec's string."""
    return str(dtype).replace("torch.", "")


def _variant_running(dtype: str) -> str:
    """The kernel variant running ``dtype`` self-attention; float32's for dtypes the kernels do
    not take (``tiled`` converts or refuses those)."""
    return _runtime.active_isa(dtype if dtype in KERNEL_DTYPES else "float32")


_SELECTORS: dict[int, AutoSelector] = {}  # by id, so a traced call can name one by a constant
_dynamic_warned = False


@torch.compiler.assume_constant_result
def _resolve_traced_choice(selector_id: int, spec: tuple, training: bool) -> str:
    """Runs while dynamo traces (its result becomes a constant of the graph): auto's choice for
    one static attention shape."""
    return _SELECTORS[selector_id].choose_for_spec(spec, training)


def _random_args(spec: tuple, training: bool) -> tuple:
    """Random SDPA arguments with ``spec``'s shapes and dtype, to measure the candidates on
    while tracing (the traced tensors are fake)."""
    q_shape, k_shape, v_shape, dtype_name, mask, causal, gqa = spec
    dtype = getattr(torch, dtype_name.replace("torch.", ""))
    q, k, v = (
        torch.randn(shape, dtype=dtype).requires_grad_(training)
        for shape in (q_shape, k_shape, v_shape)
    )
    attn_mask = None
    if mask is not None:
        mask_dtype = getattr(torch, mask[0].replace("torch.", ""))
        if mask_dtype == torch.bool:
            attn_mask = torch.ones(mask[1], dtype=torch.bool)
        else:
            attn_mask = torch.zeros(mask[1], dtype=mask_dtype)
    return (q, k, v, attn_mask, 0.0, causal, None, gqa)


def _warn_dynamic() -> None:
    global _dynamic_warned
    if not _dynamic_warned:
        _dynamic_warned = True
        logger.warning(
            "npu_attn auto: torch.compile traced attention with symbolic shapes "
            "(dynamic=True), which cannot be measured per shape; using 'tiled' for them"
        )
