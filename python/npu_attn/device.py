"""DeviceManager: one script for Ascend NPU, CUDA, XPU, MPS or CPU.

Replaces hard-coded ``"cuda"`` and ``torch.cuda.*`` calls::

    dm = npu_attn.DeviceManager()              # or DeviceManager("cuda:1"), PREFERRED_DEVICE=npu
    pipe = pipe.to(dm.device, dm.dtype)
    image = pipe(prompt, generator=dm.create_generator(0)).images[0]
    print(dm.memory_summary())

Everything that touches a device goes through a small :class:`DeviceProbe` (availability, a
dtype smoke test, memory counters, cache, synchronisation, generators). :class:`TorchProbe`
is the real one; tests substitute a fake at exactly this seam to exercise the NPU/CUDA logic,
because no such hardware exists where npu_attn is developed (the CPU path is tested for real).
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import re
from pathlib import Path
from typing import Any, Optional

import torch

from .runtime import ascend
from .runtime import controls as _runtime
from .runtime.extension import _C

DETECTION_ORDER = ("npu", "cuda", "xpu", "mps", "cpu")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class DeviceProbe:
    """The device boundary. Methods take a device type ("npu", "cuda", ...) or a device."""

    def available(self, device_type: str) -> bool:
        raise NotImplementedError

    def device_count(self, device_type: str) -> int:
        raise NotImplementedError

    def dtype_works(self, device: torch.device, dtype: torch.dtype) -> bool:
        raise NotImplementedError

    def memory_stats(self, device: torch.device) -> dict[str, int]:
        raise NotImplementedError

    def empty_cache(self, device: torch.device) -> None:
        raise NotImplementedError

    def synchronize(self, device: torch.device) -> None:
        raise NotImplementedError

    def generator(self, device: torch.device) -> torch.Generator:
        raise NotImplementedError

    def make_device(self, device_type: str, index: int) -> torch.device:
        """The device object for a type and index (torch_npu registers "npu" with torch)."""
        return torch.device(device_type, index)


class TorchProbe(DeviceProbe):
    """Real devices through torch (and torch_npu for Ascend, imported only if installed)."""

    @staticmethod
    def _module(device_type: str):
        if device_type == "npu" and ascend.torch_npu()[0] is None:  # it registers torch.npu
            return None
        return getattr(torch, device_type, None) if device_type != "cpu" else None

    def available(self, device_type: str) -> bool:
        if device_type == "cpu":
            return True
        module = self._module(device_type)
        try:
            return bool(module is not None and module.is_available())
        except Exception:  # a broken driver reads as "not available", not a crash
            return False

    def device_count(self, device_type: str) -> int:
        if device_type == "cpu":
            return 1
        module = self._module(device_type)
        if module is None or not self.available(device_type):
            return 0
        return int(getattr(module, "device_count", lambda: 1)())

    def dtype_works(self, device: torch.device, dtype: torch.dtype) -> bool:
        """A real smoke test: matmul + softmax in `dtype` on `device` gives finite numbers."""
        try:
            x = torch.randn(16, 16, device=device, dtype=dtype)
            y = torch.softmax(x @ x.T, dim=-1).float().cpu()
            return bool(torch.isfinite(y).all())
        except Exception:
            return False

    def memory_stats(self, device: torch.device) -> dict[str, int]:
        module = self._module(device.type)
        if module is None or not hasattr(module, "memory_allocated"):
            return {}
        return {
            "allocated_bytes": int(module.memory_allocated(device)),
            "reserved_bytes": int(module.memory_reserved(device)),
            "peak_allocated_bytes": int(module.max_memory_allocated(device)),
        }

    def empty_cache(self, device: torch.device) -> None:
        module = self._module(device.type)
        if module is not None and hasattr(module, "empty_cache"):
            module.empty_cache()

    def synchronize(self, device: torch.device) -> None:
        module = self._module(device.type)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize(device)

    def generator(self, device: torch.device) -> torch.Generator:
        return torch.Generator(device=device)


def _fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class DeviceManager:
    """Chooses the device and dtype, and hides device-specific calls behind one interface.

    Args:
        preferred_device: e.g. ``"npu"``, ``"cuda:1"``, ``"cpu"``. Defaults to the
            ``PREFERRED_DEVICE`` environment variable, else the first available of
            npu, cuda, xpu, mps, cpu.
        probe: the device boundary (tests pass a fake; users never need to).

    Raises:
        ValueError: the requested device is unknown or not present on this machine.
    """

    def __init__(
        self, preferred_device: Optional[str] = None, *, probe: Optional[DeviceProbe] = None
    ) -> None:
        self.probe = probe or TorchProbe()
        requested = preferred_device or os.environ.get("PREFERRED_DEVICE") or None
        self.device = self._resolve_device(requested)
        self.dtype = self._resolve_dtype()

    # ------------------------------------------------------------------ choice
    @property
    def device_type(self) -> str:
        return self.device.type

    def _resolve_device(self, requested: Optional[str]) -> torch.device:
        if requested is None:
            for device_type in DETECTION_ORDER:
                if self.probe.available(device_type):
                    if device_type == "cpu":
                        return torch.device("cpu")
                    return self.probe.make_device(device_type, 0)
            return torch.device("cpu")
        # Parsed by hand: torch.device("npu") itself fails until torch_npu registers the type.
        match = re.fullmatch(r"([a-z]+)(?::(\d+))?", requested.strip().lower())
        if match is None:
            raise ValueError(
                f"preferred device {requested!r} is not a device name; expected one of "
                f"{', '.join(DETECTION_ORDER)} optionally with an index, e.g. 'cuda:1'"
            )
        device_type = match.group(1)
        index = int(match.group(2)) if match.group(2) else 0
        if device_type not in DETECTION_ORDER:
            raise ValueError(
                f"preferred device {requested!r}: npu_attn supports {', '.join(DETECTION_ORDER)}"
            )
        if not self.probe.available(device_type):
            raise ValueError(
                f"preferred device {requested!r} is not present: no {device_type} device is "
                f"available on this machine"
                + (" (is torch_npu installed?)" if device_type == "npu" else "")
            )
        if device_type == "cpu":
            return torch.device("cpu")
        count = self.probe.device_count(device_type)
        if index >= count:
            raise ValueError(
                f"preferred device {requested!r} is not present: found {count} {device_type} "
                f"device(s)"
            )
        return self.probe.make_device(device_type, index)

    def _resolve_dtype(self) -> torch.dtype:
        override = os.environ.get("NPU_ATTN_DTYPE")
        if override:
            key = override.strip().lower()
            if key not in _DTYPES:
                raise ValueError(
                    f"NPU_ATTN_DTYPE={override!r}: expected float32, float16 or bfloat16"
                )
            return _DTYPES[key]
        return self.best_dtype(self.device)

    def best_dtype(self, device: torch.device) -> torch.dtype:
        """bf16 -> fp16 -> fp32 by a real probe on accelerators. On CPU, bf16 only where the
        ISA computes it natively (AVX-512 BF16 or AMX-BF16) and it passes the probe, else
        fp32."""
        if device.type == "cpu":
            features = set(_C.cpu_info()["features"])
            fast_bf16 = bool({"avx512_bf16", "amx_bf16"} & features)
            if fast_bf16 and self.probe.dtype_works(device, torch.bfloat16):
                return torch.bfloat16
            return torch.float32
        for dtype in (torch.bfloat16, torch.float16):
            if self.probe.dtype_works(device, dtype):
                return dtype
        return torch.float32

    def working_dtypes(self, device: Optional[torch.device] = None) -> list[str]:
        """Dtypes that pass the smoke test on ``device`` (default: this manager's)."""
        device = device or self.device
        names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
        return [n for d, n in names.items() if self.probe.dtype_works(device, d)]

    # ------------------------------------------------------------------ services
    def create_generator(self, seed: int) -> torch.Generator:
        """A seeded generator on the device. Devices without their own generator fall back to a
        CPU generator (diffusers accepts it: latents are drawn on CPU and moved), so results
        are reproducible either way."""
        try:
            generator = self.probe.generator(self.device)
        except (RuntimeError, TypeError):
            generator = torch.Generator(device="cpu")
        return generator.manual_seed(int(seed))

    def memory_stats(self) -> dict[str, Any]:
        """Accelerators: allocated/reserved/peak bytes. CPU: process RSS and peak, npu_attn
        workspace now and at peak, system total and available memory."""
        if self.device.type == "cpu":
            m = _C.memory_info()
            return {
                "device": "cpu",
                "rss_bytes": m["rss_bytes"],
                "peak_rss_bytes": m["peak_rss_bytes"],
                "workspace_bytes": m["workspace_bytes"],
                "workspace_peak_bytes": m["workspace_peak_bytes"],
                "heap_free_bytes": m["heap_free_bytes"],  # kept for reuse (reuse_cpu_memory)
                "heap_reuse": m["heap_reuse"],
                "system_total_bytes": m["total_bytes"],
                "system_available_bytes": m["available_bytes"],
            }
        return {"device": str(self.device), **self.probe.memory_stats(self.device)}

    def memory_summary(self) -> str:
        stats = self.memory_stats()
        parts = [
            f"{k.replace('_bytes', '')}={_fmt_bytes(v)}"
            for k, v in stats.items()
            if k.endswith("_bytes")
        ]
        return f"[{stats['device']}] " + ", ".join(parts)

    def empty_cache(self) -> None:
        """Release cached device memory (accelerators) / run the garbage collector and return
        the C heap's free memory to the OS (CPU; see :meth:`reuse_cpu_memory`)."""
        gc.collect()
        if self.device.type != "cpu":
            self.probe.empty_cache(self.device)
        else:
            _runtime.release_cpu_memory()

    def reuse_cpu_memory(self, enabled: bool = True) -> None:
        """Keep freed CPU memory for reuse between steps: :func:`npu_attn.runtime.reuse_cpu_memory`
        (process-wide; CPU tensors on any device type)."""
        _runtime.reuse_cpu_memory(enabled)

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""
        if self.device.type != "cpu":
            self.probe.synchronize(self.device)

    def load_safetensors(self, path: str | os.PathLike, device: Optional[str] = None) -> dict:
        """Load a .safetensors file onto ``device`` (default: this manager's).

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file is truncated or not a safetensors file.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"safetensors file not found: {path}")
        target = str(device or self.device)
        try:
            return load_file(str(path), device=target)
        except (SafetensorError, ValueError, OSError, RuntimeError) as e:
            raise ValueError(
                f"{path} is not a valid safetensors file (truncated or another format): {e}"
            ) from e

    def set_memory_efficient_mode(self, pipe: Any) -> list[str]:
        """Turn on what ``pipe`` supports to save memory; returns what was turned on."""
        from .integration.processors import set_attention_strategy

        enabled = []
        strategy = set_attention_strategy(pipe, "auto")
        enabled.append(f"attention strategy: {strategy}")
        vae = getattr(pipe, "vae", None)
        for method, label in (("enable_slicing", "VAE slicing"), ("enable_tiling", "VAE tiling")):
            if vae is not None and hasattr(vae, method):
                getattr(vae, method)()
                enabled.append(label)
        offload = self.device.type != "cpu" and hasattr(pipe, "enable_model_cpu_offload")
        if offload and importlib.util.find_spec("accelerate") is not None:
            pipe.enable_model_cpu_offload(device=self.device)
            enabled.append("model CPU offload")
        return enabled

    def info(self) -> dict[str, Any]:
        from .attention import strategies

        return {
            "device": str(self.device),
            "device_type": self.device_type,
            "dtype": str(self.dtype).replace("torch.", ""),
            "cpu": _C.cpu_info(),
            "memory": self.memory_stats(),
            "threads": _runtime.get_num_threads(),
            "strategies": {
                s: strategies.unavailable_reason(s, self.device) or "available"
                for s in strategies.STRATEGIES
            },
        }

    def __repr__(self) -> str:
        return f"DeviceManager(device={self.device}, dtype={self.dtype})"
