"""Every code example in README.md runs.

- ```python blocks run in order, in one fresh interpreter, after a prelude that provides what
  the README calls "any diffusers pipeline you already have": ``pipe`` is the demo's tiny
  Stable Diffusion pipeline (real diffusers, random weights) and ``prompt_embeds`` /
  ``negative_prompt_embeds`` match it.
- ```bash lines that run ``python -m npu_attn ...`` are executed; ``bench`` is limited to one
  small case (same code path, shorter CI). The setup and test commands are what CI itself runs
  (.ci/run), so they are exercised there.
- ```diff blocks show a change and are not programs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

PRELUDE = textwrap.dedent(
    """
    import torch
    from npu_attn.tools.pipelines import build_pipeline

    pipe = build_pipeline("tiny")
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    prompt_embeds = torch.randn(1, 77, 32, generator=g)
    negative_prompt_embeds = torch.randn(1, 77, 32, generator=g)
    """
)


def blocks(language: str) -> list[str]:
    text = README.read_text(encoding="utf-8")
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def run(cmd, tmp_path, **kwargs):
    env = dict(os.environ, NPU_ATTN_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env, **kwargs
    )


def test_readme_has_examples():
    assert len(blocks("python")) >= 4
    assert any("python -m npu_attn" in b for b in blocks("bash"))


def test_python_examples_run(tmp_path):
    script = PRELUDE + "\n".join(
        f"\n# --- README block {i}\n{b}" for i, b in enumerate(blocks("python"))
    )
    (tmp_path / "readme_examples.py").write_text(script, encoding="utf-8")
    result = run([sys.executable, "readme_examples.py"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tiled" in result.stdout


def _cli_lines():
    lines = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("python -m npu_attn"):
                lines.append(line)
    return lines


@pytest.mark.parametrize("line", _cli_lines())
def test_cli_examples_run(line, tmp_path):
    args = shlex.split(line)[1:]
    if args[2] == "bench":
        args += ["--filter", "sweep L256", "--repeats", "1", "--no-memory"]
    result = run([sys.executable, *args], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    if args[2] == "demo":
        out = tmp_path / "npu_attn_out" / "demo"
        assert (out / "image.png").is_file() and (out / "strategies.png").is_file()
        assert "| tiled |" in result.stdout
