"""The demo's --weights path (a real local diffusers folder) and its errors. The default run
(--model tiny) is exercised by the README test."""

from __future__ import annotations

import os
import subprocess
import sys

from npu_attn.demo import build_pipeline


def run_demo(tmp_path, *args):
    env = dict(os.environ, NPU_ATTN_CACHE_DIR=str(tmp_path / "cache"), NPU_ATTN_DTYPE="float32")
    return subprocess.run(
        [sys.executable, "-m", "npu_attn", "demo", *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=env,
    )


def test_demo_runs_a_local_diffusers_folder(tmp_path):
    build_pipeline("tiny").save_pretrained(tmp_path / "model")
    result = run_demo(
        tmp_path,
        "--weights",
        str(tmp_path / "model"),
        "--steps",
        "1",
        "--strategies",
        "sdpa,tiled",
        "--out",
        str(tmp_path / "out"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"weights from {tmp_path / 'model'}" in result.stdout
    assert (tmp_path / "out" / "image.png").is_file()
    assert "| tiled |" in result.stdout and "| sdpa |" in result.stdout


def test_demo_refuses_a_folder_that_is_not_a_diffusers_model(tmp_path):
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "weights.bin").write_bytes(b"\0" * 16)
    result = run_demo(tmp_path, "--weights", str(tmp_path / "notamodel"))
    assert result.returncode == 2
    assert "is not a diffusers model folder: no model_index.json" in result.stderr
