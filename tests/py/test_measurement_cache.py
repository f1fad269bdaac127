"""The one measurement cache (kernel variants and ``auto`` choices): its versioned file
format, files written before the format number existed, and a cache that cannot be written."""

from __future__ import annotations

import json

import pytest

from npu_attn.attention.auto import AutoSelector
from npu_attn.runtime import cache, variant_choice


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_ATTN_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_both_kinds_of_measurement_share_one_directory_and_format(cache_dir):
    assert variant_choice.cache_path() == cache_dir / "kernel_variants.json"
    assert AutoSelector.cache_path() == cache_dir / "auto_strategy.json"
    store = cache.MeasurementCache("x.json")
    store.store("machine-a", "float32", {"choice": "avx2"})
    store.store("machine-b", "float32", {"choice": "scalar"})
    data = json.loads((cache_dir / "x.json").read_text())
    assert data == {
        "format": cache.FORMAT,
        "machine-a": {"float32": {"choice": "avx2"}},
        "machine-b": {"float32": {"choice": "scalar"}},
    }
    assert store.get("machine-a", "float32") == {"choice": "avx2"}
    assert store.get("machine-a", "bfloat16") is None
    assert store.get("machine-c", "float32") is None


def test_a_file_from_before_the_format_number_is_read(cache_dir):
    (cache_dir / "x.json").write_text(json.dumps({"fp": {"k": {"choice": "tiled"}}}))
    store = cache.MeasurementCache("x.json")
    assert store.get("fp", "k") == {"choice": "tiled"}
    store.store("fp", "k2", {"choice": "sdpa"})  # kept, and stamped with the format
    data = json.loads((cache_dir / "x.json").read_text())
    assert data["format"] == cache.FORMAT and data["fp"]["k"] == {"choice": "tiled"}


def test_a_newer_or_broken_file_is_a_miss_not_an_error(cache_dir):
    store = cache.MeasurementCache("x.json")
    (cache_dir / "x.json").write_text(json.dumps({"format": cache.FORMAT + 1, "fp": {"k": {}}}))
    assert store.get("fp", "k") is None
    (cache_dir / "x.json").write_text("{not json")
    assert store.get("fp", "k") is None
    (cache_dir / "x.json").write_text("[1, 2]")
    assert store.get("fp", "k") is None


def test_an_unwritable_cache_costs_nothing_but_the_entry(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("NPU_ATTN_CACHE_DIR", str(blocker / "sub"))  # a path under a file
    store = cache.MeasurementCache("x.json")
    store.store("fp", "k", {"choice": "tiled"})
    assert store.get("fp", "k") is None


def test_a_rebuilt_extension_is_measured_again(monkeypatch):
    """Both fingerprints name the extension's file, not only the version: a kernel rebuilt
    under the same version must not inherit its predecessor's timings."""
    import npu_attn.attention.auto as auto

    digest = cache.build_digest()
    assert len(digest) == 16 and digest != "unknown"  # the real file was read
    before = (variant_choice.fingerprint(), AutoSelector.fingerprint())
    monkeypatch.setattr(variant_choice, "build_digest", lambda: "another build")
    monkeypatch.setattr(auto, "build_digest", lambda: "another build")
    after = (variant_choice.fingerprint(), AutoSelector.fingerprint())
    assert after[0] != before[0] and after[1] != before[1]


class _OtherGeneration:
    """The extension seen from another generation of the same brand string: virtual machines
    show "AMD EPYC" for Zen 1 and Zen 3 alike; only the CPUID signature differs."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def cpu_info(self):
        info = dict(self._real.cpu_info())
        info["signature"] = "family 99 model 99 stepping 99"
        return info


def test_another_cpu_generation_with_the_same_brand_string_is_measured_again(monkeypatch):
    from npu_attn.runtime import controls

    before = (variant_choice.fingerprint(), AutoSelector.fingerprint())
    monkeypatch.setattr(variant_choice, "_C", _OtherGeneration(variant_choice._C))
    monkeypatch.setattr(controls, "_C", _OtherGeneration(controls._C))
    after = (variant_choice.fingerprint(), AutoSelector.fingerprint())
    assert after[0] != before[0] and after[1] != before[1]
    assert controls.cpu_identity().endswith("(family 99 model 99 stepping 99)")


def test_the_cpu_signature_is_the_one_linux_reports():
    """family/model/stepping computed from CPUID leaf 1 as /proc/cpuinfo shows them (x86)."""
    import platform
    import re
    from pathlib import Path

    from npu_attn import _C

    signature = _C.cpu_info()["signature"]
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
        pytest.skip("the CPUID signature is checked against Linux's /proc/cpuinfo on x86")
    fields = dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in cpuinfo.read_text().splitlines())
        if key.strip() in ("cpu family", "model", "stepping")
    )
    family, model, stepping = fields["cpu family"], fields["model"], fields["stepping"]
    expected = f"family {family} model {model} stepping {stepping}"
    assert re.fullmatch(r"family \d+ model \d+ stepping \d+", signature)
    assert signature == expected
