"""``python -m npu_attn doctor``: is this installation healthy, and what can it use?

Reports versions (Python, torch, torch_npu, diffusers, npu_attn and its build), the devices
found and the dtypes that really work on each, the kernel ISA variants, every attention
strategy with its availability (or why not), and a numerical self-test of each available
strategy and kernel variant against a float64 reference, and which kernel variant runs each
dtype and why (measured on this machine, cached, or forced). Exit code 0 when everything
available passes, 1 otherwise. ``--json`` prints a machine-readable report instead; ``--tune``
measures the kernel variants again (and updates the cache) before reporting. On an Ascend host
it also reports CANN and driver versions, the NPUs visible and a smoke test of the fused
attention kernel against the CPU kernel (doctor_ascend.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from typing import Any, Optional

from . import doctor_ascend
from .self_test import HEAD_DIM, lossy_self_test, self_test

# Lengths the int8 self-test looks for its kernel at: the int8 strategy leaves shorter calls
# to the exact kernel (ops.int8_runs_exact_kernel; the measured break-even is 256-512 tokens on
# the CPUs seen so far).
INT8_SELF_TEST_LENGTHS = (128, 256, 512, 1024, 2048, 4096)


def int8_runs_exact_kernel_in_self_test(length: int) -> bool:
    """Whether the int8 strategy gives the self-test's float32 call (``length`` queries and
    keys, head dim ``self_test.HEAD_DIM``) to the exact kernel on this CPU."""
    import torch

    from ..attention import ops

    return ops.int8_runs_exact_kernel(length, length, torch.float32, HEAD_DIM)


def int8_self_test(fn) -> dict[str, Any]:
    """The int8 strategy against the lossy bar, at the shortest of INT8_SELF_TEST_LENGTHS at
    which it runs the int8 kernel for float32 on this CPU, checking that it did; where the
    exact kernel is faster at every length (or at the self-test's head dim) here, at the
    shortest (what users get)."""
    from ..runtime import counts

    runs_kernel = [n for n in INT8_SELF_TEST_LENGTHS if not int8_runs_exact_kernel_in_self_test(n)]
    if not runs_kernel:
        return lossy_self_test(fn, INT8_SELF_TEST_LENGTHS[0])

    def int8_calls() -> int:
        return counts.snapshot().get("int8", 0)

    return lossy_self_test(fn, runs_kernel[0], kernel_calls=int8_calls)


# Strategies that trade exactness for speed, and their self-tests against the lossy bar.
LOSSY_STRATEGIES = {"int8": int8_self_test}


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_npu_status() -> str:
    """torch_npu's version, or why it cannot be used (installed but not importable)."""
    from ..runtime import ascend

    reason = ascend.unavailable_reason()
    if reason == ascend.NOT_INSTALLED:
        return "not installed"
    version = _version("torch_npu") or "installed"
    return version if reason is None else f"{version}; {reason}"


def collect(tune: bool = False) -> dict[str, Any]:
    import torch

    from ..attention import strategies
    from ..device import DETECTION_ORDER, DeviceManager, TorchProbe
    from ..runtime import controls as _runtime
    from ..runtime import variant_choice as _variant_choice
    from ..runtime.extension import _C

    report: dict[str, Any] = {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_npu": _torch_npu_status(),
            "diffusers": _version("diffusers") or "not installed",
            "transformers": _version("transformers") or "not installed",
            "npu_attn": _version("npu_attn") or "unknown",
        },
        "build": _C.build_info(),
        "cpu": _C.cpu_info(),
        "threads": _runtime.get_num_threads(),
    }
    probe = TorchProbe()
    devices = []
    for device_type in DETECTION_ORDER:
        if not probe.available(device_type):
            continue
        dm = DeviceManager(device_type, probe=probe)
        devices.append(
            {
                "device": str(dm.device),
                "best_dtype": str(dm.dtype).replace("torch.", ""),
                "working_dtypes": dm.working_dtypes(),
            }
        )
    report["devices"] = devices

    kernels, kernels_bf16 = {}, {}
    pinned_before = _variant_choice.pinned()
    try:
        for isa in _runtime.available_isas():
            _runtime.set_isa(isa)
            kernels[isa] = self_test(strategies.tiled_attention)
            # bfloat16 has its own kernels on avx512_bf16 and amx_bf16 (AMX also needs the
            # OS's permission): worth checking on the machine that will run them.
            kernels_bf16[isa] = self_test(strategies.tiled_attention, torch.bfloat16)
    finally:
        _runtime.set_isa(pinned_before)  # the caller's set_isa, else the measured choice
    report["kernel_variants"] = kernels
    report["kernel_variants_bf16"] = kernels_bf16
    report["variant_table"] = _C.variants()
    if tune:
        for dtype in _variant_choice.DTYPES:
            _variant_choice.tune(dtype, force=True)
            _variant_choice.tune_backward(dtype, force=True)
        _variant_choice.tune_int8(force=True)
    report["variant_choice"] = _runtime.kernel_variants()
    # The lossy int8 strategy: its kernel's variant, and per dtype whether it runs that kernel
    # or the exact one (measured faster on this CPU).
    report["int8_choice"] = {
        "variant": dict(_variant_choice.tune_int8()),
        "per_dtype": {
            dtype: dict(_variant_choice.tune_int8_pays(dtype, force=tune))
            for dtype in report["variant_choice"]
        },
    }
    report["variant_cache"] = str(_variant_choice.cache_path())

    strategy_report = {}
    npu_present = any(d["device"].startswith("npu") for d in devices)
    for name in strategies.STRATEGIES:
        device = torch.device("npu" if name == "npu" and npu_present else "cpu")
        reason = strategies.unavailable_reason(name, device)
        if reason is not None:
            strategy_report[name] = {"available": False, "reason": reason}
        elif name == "npu":
            strategy_report[name] = {"available": True, "self_test": "needs NPU tensors"}
        else:
            fn = strategies.RUNNERS[name]
            test = LOSSY_STRATEGIES[name](fn) if name in LOSSY_STRATEGIES else self_test(fn)
            strategy_report[name] = {"available": True, "self_test": test}
    report["strategies"] = strategy_report
    report["npu"] = doctor_ascend.collect(npu_present)
    tests = (
        list(kernels.values())
        + list(kernels_bf16.values())
        + [s["self_test"] for s in strategy_report.values() if isinstance(s.get("self_test"), dict)]
        + ([report["npu"]["fused_attention"]] if "fused_attention" in report["npu"] else [])
    )
    report["ok"] = all(t["ok"] for t in tests)
    return report


def _detail(t: dict[str, Any]) -> str:
    if "max_abs_error" in t:
        return f"max error {t['max_abs_error']:.1e}, bound {t['tolerance']:.1e}"
    return t["error"]


def _variant_lines(report: dict[str, Any]) -> list[str]:
    from ..runtime import variant_choice as _variant_choice

    lines = []
    for dtype, v in report["variant_choice"].items():
        names = set(v["choice"].values())
        if len(names) == 1:
            chosen = next(iter(names))
        else:
            chosen = ", ".join(f"{cls}: {name}" for cls, name in v["choice"].items())
        lines.append(f"  {dtype:9} {chosen}  [{v['source']}]")
        for shape_class, per in v.get("ms", {}).items():
            lines.append(f"  {'':9}   {shape_class}: {_variant_choice.format_timings(per)}")
        backward = v.get("backward")
        if backward:
            if backward["choice"] is None:  # the source says why it follows the forward
                lines.append(f"  {'':9}   backward: {backward['source']}")
            else:
                lines.append(f"  {'':9}   backward: {backward['choice']}  [{backward['source']}]")
            for label, per in backward.get("ms", {}).items():
                lines.append(f"  {'':9}     {label}: {_variant_choice.format_timings(per)}")
    int8 = report.get("int8_choice")
    if int8:
        variant = int8["variant"]
        lines.append(f"  {'int8':9} {variant['choice']}  [{variant['source']}]")
        for dtype, d in int8["per_dtype"].items():
            lines.append(f"  {'':9}   {dtype}: {_variant_choice.int8_scope(d)}  [{d['source']}]")
            for shape, ms in _variant_choice.int8_comparisons(d):
                lines.append(f"  {'':9}     {shape}: {_variant_choice.format_timings(ms)}")
    lines.append(f"  (cache: {report['variant_cache']}; `doctor --tune` measures again)")
    return lines


def render(report: dict[str, Any]) -> str:
    def mark(ok):
        return "ok" if ok else "FAILED"

    v = report["versions"]
    cpu = report["cpu"]
    b = report["build"]
    lines = [
        "npu_attn doctor",
        "",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"Build: {b['compiler']}, OpenMP {b['openmp']}, Eigen {b['eigen']}, "
        f"{b.get('build_type', '?')}; variants compiled: {', '.join(b['compiled_isas'])}",
        f"CPU: {cpu['model']} ({cpu['vendor']} {cpu.get('signature', '')}), "
        f"{cpu['logical_cores']} logical cores, "
        f"L2 {cpu['l2_bytes'] // 1024} KiB, features: {' '.join(cpu['features'])}",
        f"Kernel variants runnable here: {', '.join(cpu['runnable_isas'])}; "
        f"threads: {report['threads']}",
        "",
        "Devices:",
    ]
    for d in report["devices"]:
        lines.append(
            f"  {d['device']}: best dtype {d['best_dtype']}; working dtypes: "
            f"{', '.join(d['working_dtypes'])}"
        )
    lines += ["", "Kernel variant per dtype (and why):"]
    lines += _variant_lines(report)
    lines += ["", "Kernel variants (self-test vs float64 reference):"]
    for isa, t in report["kernel_variants"].items():
        t16 = report["kernel_variants_bf16"][isa]
        lines.append(
            f"  {isa:12} float32 {mark(t['ok'])} ({_detail(t)}); bfloat16 "
            f"{mark(t16['ok'])} ({_detail(t16)})"
        )
    lines += ["", "Attention strategies:"]
    for name, s in report["strategies"].items():
        if not s["available"]:
            lines.append(f"  {name:8} unavailable: {s['reason']}")
            continue
        t = s["self_test"]
        if isinstance(t, str):
            lines.append(f"  {name:8} available ({t})")
            continue
        detail = f"max error {t['max_abs_error']:.1e}" if "max_abs_error" in t else t["error"]
        if "relative_l1" in t:  # lossy: its own bar
            kernel = {True: "its kernel", False: "NOT its kernel", None: "the exact kernel"}
            detail = (
                f"lossy, {kernel[t['ran_lossy_kernel']]} at {t['tokens']} tokens: cosine "
                f"{t['cosine']:.5f}, relative L1 {t['relative_l1']:.1e}"
            )
        lines.append(f"  {name:8} available, self-test {mark(t['ok'])} ({detail})")
    lines += ["", "Ascend NPU:"] + doctor_ascend.render(report["npu"])
    lines += ["", "Overall: " + ("OK" if report["ok"] else "PROBLEMS FOUND")]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npu_attn doctor", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print a JSON report")
    parser.add_argument(
        "--tune",
        action="store_true",
        help="measure which kernel variant is fastest for each dtype again and cache it",
    )
    args = parser.parse_args(argv)
    report = collect(tune=args.tune)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
