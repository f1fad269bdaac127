"""The doctor's checks of an Ascend NPU: what ``python -m npu_attn doctor`` reports there.

On an Ascend host the usual failures are environmental (CANN not sourced, a CANN / driver /
torch_npu version mismatch, no device visible to the process), and the one numerical risk is the
fused kernel itself: the ``npu`` strategy's translation of SDPA's arguments (mask polarity,
layout, scale, GQA) checked against npu_attn's own CPU kernel on the same inputs.

Every torch_npu call made here is checked against the real torch_npu 2.13.0 release's sources
(tests/py/test_torch_npu_release.py); what the calls return is known only on hardware.
"""

from __future__ import annotations

from typing import Any, Callable

# The CANN components whose versions are reported: ``torch_npu.npu.utils.get_cann_version``'s
# module names (the toolkit as a whole, and the driver, which is installed separately and is
# the usual mismatch).
CANN_COMPONENTS = ("CANN", "DRIVER")


def _attempt(call: Callable[[], Any]) -> Any:
    """The call's result, or the error it raised as text (the doctor reports, never crashes)."""
    try:
        return call()
    except Exception as error:
        return f"unknown ({type(error).__name__}: {error})"


def versions(torch_npu) -> dict[str, Any]:
    """CANN and driver versions as torch_npu reports them."""
    return {
        component: _attempt(lambda c=component: torch_npu.npu.utils.get_cann_version(module=c))
        for component in CANN_COMPONENTS
    }


def devices() -> dict[str, Any]:
    """How many NPUs this process sees, and the first one's name."""
    import torch

    count = _attempt(torch.npu.device_count)
    name = _attempt(lambda: torch.npu.get_device_name(0)) if count and count != 0 else None
    return {"device_count": count, "device_name": name}


def fused_attention_smoke_test(device, dtype=None) -> dict[str, Any]:
    """The ``npu`` strategy (torch_npu's fused kernel) against npu_attn's CPU kernel on the same
    inputs: a GQA + boolean-mask case in float16 (the fused kernel takes 16-bit inputs only).

    Passes when the NPU's error against float64 attention is at most twice the CPU kernel's at
    the same input precision, plus 1e-3 of the output's magnitude (the two accumulate in
    different orders)."""
    import torch

    from ..attention import strategies
    from .self_test import inputs, reference

    dtype = dtype or torch.float16
    q, k, v, mask = (t.to(dtype) if t.is_floating_point() else t for t in inputs())
    try:
        with torch.no_grad():
            on_device = [t.to(device) for t in (q, k, v, mask)]
            npu_out = strategies.RUNNERS["npu"](*on_device, 0.0, False, None, True).cpu()
            cpu_out = strategies.tiled_attention(q, k, v, mask, 0.0, False, None, True)
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    ref = reference(q, k, v, mask)
    npu_error = float((npu_out.double() - ref).abs().max())
    cpu_error = float((cpu_out.double() - ref).abs().max())
    tolerance = 2 * cpu_error + 1e-3 * max(1.0, float(ref.abs().max()))
    return {
        "ok": npu_error <= tolerance,
        "dtype": str(dtype).replace("torch.", ""),
        "max_abs_error": npu_error,
        "cpu_kernel_error": cpu_error,
        "max_abs_difference_from_cpu": float((npu_out.double() - cpu_out.double()).abs().max()),
        "tolerance": tolerance,
    }


def collect(npu_visible: bool) -> dict[str, Any]:
    """The doctor's NPU section: why the NPU is unavailable, or versions, devices and the
    fused-attention smoke test on ``npu:0``."""
    import torch

    from ..runtime import ascend

    torch_npu, reason = ascend.torch_npu()
    if torch_npu is None:
        return {"available": False, "reason": reason}
    report: dict[str, Any] = {"available": npu_visible, "versions": versions(torch_npu)}
    report.update(devices())
    if not npu_visible:
        report["reason"] = "torch_npu imports, but no NPU is visible to this process"
        return report
    report["fused_attention"] = fused_attention_smoke_test(torch.device("npu", 0))
    return report


def render(report: dict[str, Any]) -> list[str]:
    """The NPU section's lines in the doctor's text report."""
    if "versions" not in report:
        return [f"  unavailable: {report['reason']}"]
    v = report["versions"]
    lines = [
        f"  CANN {v['CANN']}, driver {v['DRIVER']}; devices: {report['device_count']}"
        + (f" ({report['device_name']})" if report.get("device_name") else "")
    ]
    if not report["available"]:
        return lines + [f"  unavailable: {report['reason']}"]
    t = report["fused_attention"]
    if "error" in t:
        return lines + [f"  fused attention ({t.get('dtype', 'float16')}) FAILED: {t['error']}"]
    lines.append(
        f"  fused attention vs the CPU kernel ({t['dtype']}): "
        f"{'ok' if t['ok'] else 'FAILED'} (max error {t['max_abs_error']:.1e}, CPU kernel "
        f"{t['cpu_kernel_error']:.1e}, bound {t['tolerance']:.1e})"
    )
    return lines
