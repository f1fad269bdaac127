"""torch_npu installed but not importable (CANN's set_env.sh not sourced, or a CANN / torch
version mismatch) is a reason the NPU is unavailable, not a crash: the DeviceManager, the
doctor, ``set_attention_strategy`` and ``auto`` report it, and the CPU path works.

A broken ``torch_npu`` package (its import raises what a real one raises without CANN's
libraries) is put first on the path of a fresh interpreter. transformers (5.23) imports
torch_npu unguarded when it can find it, so the model is built before the broken package
appears on the path, as it is where transformers tolerates the failure."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ERRORS = {
    "ImportError": 'ImportError("libhccl.so: cannot open shared object file: No such file or '
    'directory")',
    "OSError": 'OSError("libascendcl.so: cannot open shared object file")',
}


def run(tmp_path: Path, error: str, *args: str, on_path: bool = True):
    """A fresh interpreter with a broken torch_npu in tmp_path/site, on its path or not (the
    script then adds it itself)."""
    package = tmp_path / "site" / "torch_npu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"raise {ERRORS[error]}\n")
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    first = [str(tmp_path / "site")] if on_path else []
    path = os.pathsep.join([*first, str(HERE), *(os.path.abspath(p) for p in inherited if p)])
    env = dict(os.environ, PYTHONPATH=path, NPU_ATTN_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )


def script(code: str) -> tuple[str, str]:
    return ("-c", textwrap.dedent(code))


@pytest.mark.parametrize("error", sorted(ERRORS))
def test_the_library_works_on_the_cpu_and_names_the_import_error(tmp_path, error):
    result = run(
        tmp_path,
        error,
        *script(
            f"""
            import importlib.util, sys
            import pytest, torch
            from tiny_models import tiny_unet, unet_inputs

            unet = tiny_unet()
            sys.path.insert(0, "site")
            import npu_attn

            assert importlib.util.find_spec("torch_npu") is not None  # installed, broken
            dm = npu_attn.DeviceManager()
            assert dm.device.type == "cpu", dm.device
            reason = dm.info()["strategies"]["npu"]
            assert reason.startswith("NPU unavailable: {error}: lib"), reason
            assert npu_attn.set_attention_strategy(unet, "auto") == "auto"
            with torch.no_grad():
                out = unet(**unet_inputs(masks=True)).sample
            assert torch.isfinite(out).all()
            with pytest.raises(ValueError, match="'npu' is unavailable: NPU unavailable: {error}"):
                npu_attn.set_attention_strategy(unet, "npu")
            q = torch.randn(1, 2, 8, 16)
            with pytest.raises(ValueError, match="NPU unavailable: {error}"):
                npu_attn.scaled_dot_product_attention(q, q, q, backend="npu")
            print("ok")
            """
        ),
        on_path=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_the_doctor_reports_the_import_error(tmp_path):
    result = run(tmp_path, "ImportError", "-m", "npu_attn", "doctor")
    assert result.returncode == 0, result.stderr
    assert "NPU unavailable: ImportError: libhccl.so" in result.stdout
    assert "Traceback" not in result.stderr


def test_torchair_graph_mode_refuses_without_an_npu(tmp_path):
    result = run(
        tmp_path,
        "ImportError",
        *script(
            """
            import sys
            import pytest, torch
            from tiny_models import tiny_unet

            unet = tiny_unet()
            sys.path.insert(0, "site")
            import npu_attn

            with pytest.raises(RuntimeError, match="torchair.*needs torch_npu: NPU unavailable"):
                npu_attn.compile(unet, "tiled", backend="torchair")
            assert npu_attn.compiled_components(unet) == {}  # nothing changed
            print("ok")
            """
        ),
        on_path=False,
    )
    assert result.returncode == 0, result.stderr
