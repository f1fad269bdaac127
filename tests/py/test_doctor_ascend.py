"""The doctor's Ascend section (npu_attn.tools.doctor_ascend): versions, devices and the
fused-attention smoke test against the CPU kernel.

MOCK AT A HARDWARE BOUNDARY: no NPU or CANN exists here. The stand-in torch_npu is
test_npu_backend's FakeTorchNpu (its npu_fusion_attention follows the documented semantics and
its signature is checked against the real release in test_torch_npu_release.py), computing on
CPU tensors, so the smoke test runs on device "cpu". The torch_npu calls made here are checked
against the real 2.13.0 release's sources in test_torch_npu_release.py.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from npu_attn.tools import doctor_ascend
from test_npu_backend import FakeTorchNpu


class AscendHost(FakeTorchNpu):
    """The stand-in with torch_npu.npu.utils.get_cann_version, as an Ascend host reports it."""

    def __init__(self, versions=None):
        super().__init__()
        versions = versions or {"CANN": "8.3.RC1", "DRIVER": "25.2.0"}

        def get_cann_version(module="CANN"):
            return versions[module]

        self.npu = types.SimpleNamespace(
            utils=types.SimpleNamespace(get_cann_version=get_cann_version)
        )


class UninvertedMask(AscendHost):
    """A fused kernel that reads the boolean mask with torch's polarity (True = attend): the
    mistake the smoke test exists to catch."""

    def npu_fusion_attention(self, query, key, value, head_num, input_layout, **kwargs):
        if kwargs.get("atten_mask") is not None:
            kwargs["atten_mask"] = ~kwargs["atten_mask"]
        return super().npu_fusion_attention(query, key, value, head_num, input_layout, **kwargs)


@pytest.fixture
def two_npus(monkeypatch):
    """torch.npu as torch_npu installs it, with two visible devices."""
    npu = types.SimpleNamespace(device_count=lambda: 2, get_device_name=lambda index: "Ascend910B3")
    monkeypatch.setattr(torch, "npu", npu, raising=False)


def test_the_smoke_test_passes_a_correct_fused_kernel(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", AscendHost())
    result = doctor_ascend.fused_attention_smoke_test(torch.device("cpu"))
    assert result["ok"], result
    assert result["dtype"] == "float16"
    assert 0 < result["max_abs_error"] <= result["tolerance"]
    assert result["cpu_kernel_error"] > 0  # both measured against float64, at float16 inputs


def test_the_smoke_test_catches_a_wrong_mask_polarity(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", UninvertedMask())
    result = doctor_ascend.fused_attention_smoke_test(torch.device("cpu"))
    assert not result["ok"]
    assert result["max_abs_error"] > 100 * result["tolerance"]


def test_a_failing_fused_kernel_is_reported_not_raised(monkeypatch):
    class Raises(AscendHost):
        def npu_fusion_attention(self, *args, **kwargs):
            raise RuntimeError("EZ9999: aclnnFlashAttentionScore failed")

    monkeypatch.setitem(sys.modules, "torch_npu", Raises())
    result = doctor_ascend.fused_attention_smoke_test(torch.device("cpu"))
    assert result == {"ok": False, "error": "RuntimeError: EZ9999: aclnnFlashAttentionScore failed"}


def test_versions_and_devices_as_torch_npu_reports_them(two_npus):
    assert doctor_ascend.versions(AscendHost()) == {"CANN": "8.3.RC1", "DRIVER": "25.2.0"}
    assert doctor_ascend.devices() == {"device_count": 2, "device_name": "Ascend910B3"}


def test_a_version_torch_npu_cannot_read_is_reported_as_unknown():
    def get_cann_version(module="CANN"):
        raise RuntimeError("ascend_toolkit_install.info not found")

    host = AscendHost()
    host.npu.utils.get_cann_version = get_cann_version
    versions = doctor_ascend.versions(host)
    assert versions["DRIVER"].startswith("unknown (RuntimeError: ascend_toolkit_install.info")


def test_the_section_on_a_host_whose_npus_are_not_visible(monkeypatch, two_npus):
    monkeypatch.setitem(sys.modules, "torch_npu", AscendHost())
    report = doctor_ascend.collect(npu_visible=False)
    assert report["available"] is False
    assert "no NPU is visible" in report["reason"]
    assert "fused_attention" not in report  # nothing to run it on
    lines = doctor_ascend.render(report)
    assert lines[0] == "  CANN 8.3.RC1, driver 25.2.0; devices: 2 (Ascend910B3)"
    assert "no NPU is visible" in lines[1]


def test_the_rendered_smoke_test(monkeypatch, two_npus):
    monkeypatch.setitem(sys.modules, "torch_npu", AscendHost())
    report = {
        "available": True,
        "versions": doctor_ascend.versions(AscendHost()),
        **doctor_ascend.devices(),
        "fused_attention": doctor_ascend.fused_attention_smoke_test(torch.device("cpu")),
    }
    text = "\n".join(doctor_ascend.render(report))
    assert "fused attention vs the CPU kernel (float16): ok (max error" in text


def test_without_torch_npu_the_section_says_so():
    report = doctor_ascend.collect(npu_visible=False)
    assert report["available"] is False
    assert "torch_npu is not installed" in report["reason"]
    assert doctor_ascend.render(report) == [f"  unavailable: {report['reason']}"]
