"""Attention strategies: what each one computes, where it can run, and the ``auto`` choice.

Every strategy is a function with torch SDPA's positional signature
``(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> Tensor``:

- ``vanilla``: explicit matmul -> softmax -> matmul in torch (materialises the scores; what
  diffusers' ``AttnProcessor`` does).
- ``sdpa``: torch's ``scaled_dot_product_attention`` (whatever backend torch picks).
- ``tiled``: npu_attn's tiled C++ kernel (CPU tensors).
- ``npu``: ``torch_npu.npu_fusion_attention`` (Ascend NPU tensors, fp16/bf16).
- ``auto``: per device: on CPU a short measurement of ``tiled`` vs ``sdpa`` (and ``vanilla``
  for small problems) on each real attention shape, cached per machine and shape (under
  autograd the measured time is forward + backward, cached separately); on an Ascend NPU
  ``npu``; elsewhere ``sdpa``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from . import _redirect, _runtime
from ._backends import npu as npu_backend
from ._backends.registry import needs_grad
from .functional import scaled_dot_product_attention as tiled_sdpa

logger = logging.getLogger("npu_attn")

STRATEGIES = ("vanilla", "sdpa", "tiled", "npu", "auto")
StrategyFn = Callable[..., torch.Tensor]


# --------------------------------------------------------------------------- call counts
_counts_lock = threading.Lock()
_counts: dict[str, int] = {}


def _count(name: str) -> None:
    with _counts_lock:
        _counts[name] = _counts.get(name, 0) + 1


def call_counts() -> dict[str, int]:
    """How many attention calls each implementation served in this process (``tiled`` counts
    only calls npu_attn's kernel computed; ``tiled->sdpa`` counts its fallbacks)."""
    with _counts_lock:
        return dict(_counts)


def reset_call_counts() -> None:
    with _counts_lock:
        _counts.clear()


# --------------------------------------------------------------------------- implementations
def vanilla_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """matmul -> softmax -> matmul, materialising (B, H, Lq, Lk) scores. Rows whose keys are
    all masked give 0, as torch's SDPA does (a plain softmax would give NaN)."""
    _count("vanilla")
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    lq, lk = query.shape[-2], key.shape[-2]
    if is_causal:
        causal = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    probs = probs.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p)
    return torch.matmul(probs, value)


def torch_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    _count("sdpa")
    return _redirect.call_original(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    )


_fallback_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _fallback_warned:
        _fallback_warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def tiled_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """npu_attn's kernel (differentiable). Calls it cannot serve (dropout, non-CPU tensors) go
    to torch's SDPA with a one-time warning instead of failing inside a model."""
    reason = None
    if query.device.type != "cpu":
        reason = f"tensors on {query.device}"
    elif dropout_p > 0.0:
        reason = "dropout_p > 0 (training)"
    if reason is not None:
        _warn_once(
            "tiled:" + reason, f"npu_attn 'tiled': {reason}; using torch SDPA for these calls"
        )
        _count("tiled->sdpa")
        return torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    _count("tiled")
    return tiled_sdpa(
        query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, backend="tiled"
    )


def npu_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    _count("npu")
    return npu_backend.fusion_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    )


# --------------------------------------------------------------------------- availability
def unavailable_reason(strategy: str, device: Optional[torch.device] = None) -> Optional[str]:
    """Why ``strategy`` cannot run for a model on ``device`` (None: it can)."""
    device_type = torch.device(device).type if device is not None else "cpu"
    if strategy in ("vanilla", "sdpa", "auto"):
        return None
    if strategy == "tiled":
        if device_type != "cpu":
            return f"the tiled kernel runs on CPU tensors; the model is on {device_type}"
        return None
    if strategy == "npu":
        return npu_backend.unavailable_reason(device_type)
    return f"unknown strategy {strategy!r}"


def check_strategy(strategy: str, device: Optional[torch.device] = None) -> str:
    """Validate a strategy name for a device; ValueError listing valid ones and reasons."""
    if strategy not in STRATEGIES:
        raise ValueError(
            f"unknown attention strategy {strategy!r}; valid strategies: {', '.join(STRATEGIES)}"
        )
    reason = unavailable_reason(strategy, device)
    if reason is not None:
        others = [s for s in STRATEGIES if unavailable_reason(s, device) is None]
        raise ValueError(
            f"attention strategy {strategy!r} is unavailable: {reason}. "
            f"Available here: {', '.join(others)}"
        )
    return strategy


# --------------------------------------------------------------------------- auto
class AutoSelector:
    """Picks the fastest strategy per attention shape on CPU by measuring it once.

    The first call with a new shape (batch, heads, lengths, head dims, dtype, mask kind,
    causal) times the candidates on the real tensors, interleaved, and keeps the fastest; the
    choice is cached in memory and in ``$NPU_ATTN_CACHE_DIR/auto_strategy.json`` (default
    ``~/.cache/npu_attn``) under a fingerprint of this machine and software, and logged.
    """

    repeats = 3

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memory: dict[str, dict] = {}
        self.measurements = 0  # how many shapes were measured (not served from cache)

    # -- cache ---------------------------------------------------------------
    @staticmethod
    def cache_path() -> Path:
        root = os.environ.get("NPU_ATTN_CACHE_DIR") or os.path.join(
            os.path.expanduser("~"), ".cache", "npu_attn"
        )
        return Path(root) / "auto_strategy.json"

    @staticmethod
    def fingerprint() -> str:
        cpu = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("model name"):
                        cpu = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        from . import __version__

        parts = [
            cpu,
            str(os.cpu_count()),
            str(_runtime.get_num_threads()),
            torch.__version__,
            __version__,
            _runtime.active_isa(),
        ]
        return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]

    def _load_disk(self) -> dict:
        try:
            return json.loads(self.cache_path().read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def _store_disk(self, key: str, entry: dict) -> None:
        path = self.cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = self._load_disk()
            data.setdefault(self.fingerprint(), {})[key] = entry
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as e:  # a read-only home must not break inference
            logger.debug("npu_attn auto: cannot write %s: %s", path, e)

    def cached_choice(self, key: str) -> Optional[dict]:
        if key in self._memory:
            return self._memory[key]
        entry = self._load_disk().get(self.fingerprint(), {}).get(key)
        if entry is not None:
            self._memory[key] = entry
        return entry

    # -- measurement ----------------------------------------------------------
    @staticmethod
    def shape_key(query, key, value, attn_mask, is_causal, enable_gqa) -> str:
        mask = "none" if attn_mask is None else f"{attn_mask.dtype}{tuple(attn_mask.shape)}"
        return (
            f"q{tuple(query.shape)} k{tuple(key.shape)} v{tuple(value.shape)} {query.dtype} "
            f"mask={mask} causal={bool(is_causal)} gqa={bool(enable_gqa)}"
        )

    @staticmethod
    def candidates(query, key) -> list[str]:
        names = ["tiled", "sdpa"]
        b_h = query.numel() // max(query.shape[-1], 1) // max(query.shape[-2], 1)
        score_bytes = b_h * query.shape[-2] * key.shape[-2] * 4
        if score_bytes <= 64 << 20:  # vanilla only where its score matrix is small
            names.append("vanilla")
        return names

    @staticmethod
    def _forward_backward(name, args):
        """One training step of candidate `name` on detached copies of the inputs (the caller's
        graph is untouched): forward, then backward of the output's sum."""
        leaves = [
            t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in args[:4]
        ]
        out = RUNNERS[name](*leaves, *args[4:])
        out.sum().backward()

    def _measure(self, args, training: bool = False) -> dict:
        """Times every candidate, interleaved; under autograd a candidate's time is forward +
        backward. Returns the choice, the medians and (inference only) the chosen output."""
        names = self.candidates(args[0], args[1])
        times: dict[str, list[float]] = {n: [] for n in names}
        outputs = {}

        def run(name):
            if training:
                self._forward_backward(name, args)
            else:
                outputs[name] = RUNNERS[name](*args)

        for name in names:  # warm-up (for inference also the result we return)
            run(name)
        for _ in range(self.repeats):
            for name in names:  # interleaved: every candidate sees the same machine state
                start = time.perf_counter()
                run(name)
                times[name].append(time.perf_counter() - start)
        ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        choice = min(ms, key=ms.get)
        output = RUNNERS[choice](*args) if training else outputs[choice]
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
            return RUNNERS[name](*args)
        if dropout_p > 0.0:
            return torch_sdpa(*args)  # the only candidate with dropout
        training = needs_grad(query, key, value, attn_mask)
        key_str = self.shape_key(query, key, value, attn_mask, is_causal, enable_gqa)
        if training:  # chosen by forward + backward time, cached separately
            key_str += " fwd+bwd"
        entry = self.cached_choice(key_str)
        if entry is not None:
            return RUNNERS[entry["choice"]](*args)
        with self._lock:  # one measurement at a time: concurrent timing would be meaningless
            entry = self.cached_choice(key_str)
            if entry is not None:
                return RUNNERS[entry["choice"]](*args)
            result = self._measure(args, training)
            output = result.pop("_output")
            self._memory[key_str] = result
            self.measurements += 1
            self._store_disk(key_str, result)
        timings = ", ".join(f"{n} {t:.2f} ms" for n, t in sorted(result["ms"].items()))
        logger.info("npu_attn auto: %s -> %s (%s)", key_str, result["choice"], timings)
        return output

    def choices(self) -> dict[str, str]:
        """Shape -> chosen strategy, for every shape measured or loaded in this process."""
        return {k: v["choice"] for k, v in self._memory.items()}


auto_selector = AutoSelector()

RUNNERS: dict[str, StrategyFn] = {
    "vanilla": vanilla_attention,
    "sdpa": torch_sdpa,
    "tiled": tiled_attention,
    "npu": npu_attention,
    "auto": auto_selector,
}
