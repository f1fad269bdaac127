"""``python -m npu_attn demo``: real runs of the tiny model (1 step) in a subprocess.

One bfloat16 run (shared by several tests, it is the slow part) checks what the table reports
and what the demo leaves behind; the --weights path (a real local diffusers folder) and its
errors run in float32. Correctness only: timings on a shared machine are not asserted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types

import pytest

from npu_attn.tools.pipelines import build_pipeline

# Lines diffusers and transformers print about configurations, casts and optional packages
# (each was in the demo's output before it silenced them).
THIRD_PARTY_CHATTER = re.compile(
    r"but are not expected|FutureWarning|DeprecationWarning|should be kept in float32"
    r"|^\[transformers\]|steps_offset|low cpu memory usage",
    re.M,
)


def subprocess_pythonpath() -> str:
    """PYTHONPATH with relative entries made absolute: the demo runs in another directory and
    must import the npu_attn under test (``PYTHONPATH=python pytest`` would otherwise fall back
    to an installed copy)."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(os.path.abspath(entry) for entry in entries if entry)


def run_demo(tmp_path, *args, dtype="float32"):
    env = dict(
        os.environ,
        NPU_ATTN_CACHE_DIR=str(tmp_path / "cache"),
        NPU_ATTN_DTYPE=dtype,
        PYTHONPATH=subprocess_pythonpath(),
    )
    for name in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY"):  # would keep the chatter
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "npu_attn", "demo", *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=env,
    )


def table_rows(stdout: str) -> dict[str, list[str]]:
    """The demo's table: row label -> the other cells."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 6 and cells[0] != "strategy":
            rows[cells[0]] = cells[1:]
    return rows


@pytest.fixture(scope="module")
def bf16_demo(tmp_path_factory):
    """The tiny model for one step in bfloat16, with a fresh auto cache."""
    tmp_path = tmp_path_factory.mktemp("demo_bf16")
    out = tmp_path / "out"
    result = run_demo(
        tmp_path, "--model", "tiny", "--steps", "1", "--out", str(out), dtype="bfloat16"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    return {"result": result, "tmp_path": tmp_path, "out": out, "json": results}


def test_demo_output_has_no_third_party_configuration_warnings(bf16_demo):
    result = bf16_demo["result"]
    output = result.stdout + result.stderr
    assert THIRD_PARTY_CHATTER.findall(output) == [], output
    # npu_attn's own log lines are still shown.
    assert "npu_attn: unet: 8 attention processors -> auto" in output
    assert "npu_attn auto: q(" in output


def test_bf16_table_has_relative_error_psnr_and_a_float32_reference(bf16_demo):
    stdout = bf16_demo["result"].stdout
    assert "| latents rel. error vs sdpa | image PSNR vs sdpa |" in stdout
    rows = table_rows(stdout)
    assert rows["sdpa"][-2:] == ["reference", "reference"]
    floor, tiled = rows["sdpa, float32"], rows["tiled"]
    for cells in (floor, tiled, rows["vanilla"]):
        float(cells[-2])  # a relative error
        assert re.fullmatch(r"\d+\.\d dB|identical", cells[-1]), cells

    # results.json has the same rows and columns, and the numbers mean what the note says:
    # tiled in bfloat16 is as far from sdpa as bfloat16's own rounding (sdpa in float32).
    by_label = {r["label"]: r for r in bf16_demo["json"]}
    assert set(by_label) == set(rows)
    assert by_label["sdpa, float32"]["dtype"] == "float32"
    assert by_label["tiled"]["dtype"] == "bfloat16"
    floor_error = by_label["sdpa, float32"]["latents_relative_error_vs_sdpa"]
    assert 0 < by_label["tiled"]["latents_relative_error_vs_sdpa"] < 10 * floor_error
    assert by_label["sdpa"]["image_psnr_db_vs_sdpa"] is None  # identical to itself
    assert by_label["tiled"]["image_psnr_db_vs_sdpa"] > 20
    assert (bf16_demo["out"] / "strategies.png").is_file()


def test_auto_steady_state_row_is_separate_from_its_measuring_cost(bf16_demo):
    stdout = bf16_demo["result"].stdout
    rows = table_rows(stdout)
    assert "auto (steady state)" in rows and "auto" not in rows
    assert re.search(r"auto's one-time measuring cost: \d+\.\d\d s .*measured \d+ new", stdout)
    auto = next(r for r in bf16_demo["json"] if r["strategy"] == "auto")
    assert auto["label"] == "auto (steady state)"
    assert auto["shapes_measured"] >= 1  # the cache was empty: the first run measured
    assert auto["one_time_measuring_seconds"] >= 0
    assert auto["first_run_seconds_per_step"] > 0


def test_vae_decode_runs_without_autograd(bf16_demo):
    cache = bf16_demo["tmp_path"] / "cache" / "auto_strategy.json"
    entries = [
        key
        for fingerprint, shapes in json.loads(cache.read_text()).items()
        if fingerprint != "format"  # the cache file's format number (npu_attn.runtime.cache)
        for key in shapes
    ]
    assert any(key.startswith("q(1, 1, ") for key in entries), entries  # the VAE's attention
    assert [key for key in entries if key.endswith(" fwd+bwd")] == []


def test_demo_runs_a_local_diffusers_folder(tmp_path):
    build_pipeline("tiny").save_pretrained(tmp_path / "model")
    # A config attribute this diffusers version does not know (as in folders saved by another
    # version): diffusers warns about it, the demo must not pass that on.
    config_path = tmp_path / "model" / "unet" / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["an_attribute_from_another_version"] = 1
    config_path.write_text(json.dumps(config), encoding="utf-8")
    result = run_demo(
        tmp_path,
        "--weights",
        str(tmp_path / "model"),
        "--steps",
        "1",
        "--strategies",
        "tiled",
        "--out",
        str(tmp_path / "out"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"weights from {tmp_path / 'model'}" in result.stdout
    assert (tmp_path / "out" / "image.png").is_file()
    rows = table_rows(result.stdout)
    assert "tiled" in rows and "sdpa" in rows  # sdpa is added: the accuracy reference
    assert "sdpa, float32" not in rows  # float32 needs no rounding reference
    assert THIRD_PARTY_CHATTER.findall(result.stdout + result.stderr) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--steps", "-2"], "argument --steps: must be >= 1, got -2"),
        (["--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["--strategies", "tiled,tield"], "--strategies: unknown 'tield'; choose from vanilla"),
        (["--size", "100"], "--size: size 100 px: this model takes multiples of 8 px"),
    ],
)
def test_demo_refuses_bad_arguments_before_building_anything(args, message, capsys):
    # Before: --steps 0 divided by zero inside diffusers, --steps -2 and --threads 0 ran,
    # a misspelt strategy was skipped, --size 100 failed in diffusers after the build.
    from npu_attn.tools.demo import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "tiny", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_refuses_a_size_the_local_folder_cannot_take(tmp_path):
    build_pipeline("tiny").save_pretrained(tmp_path / "model")
    result = run_demo(tmp_path, "--weights", str(tmp_path / "model"), "--size", "100")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "error: --size: size 100 px: this model takes multiples of 8 px" in result.stderr
    assert "denoising" not in result.stdout


def test_demo_refuses_a_folder_that_is_not_a_diffusers_model(tmp_path):
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "weights.bin").write_bytes(b"\0" * 16)
    result = run_demo(tmp_path, "--weights", str(tmp_path / "notamodel"))
    assert result.returncode == 2
    assert "is not a diffusers model folder: no model_index.json" in result.stderr


def run_accelerated_demo(tmp_path, model: str, strategies: str) -> dict[str, list[str]]:
    """3 steps of ``model`` under ``strategies`` plus the ToMe 0.5 + DeepCache 2 row; the
    table's rows (the run must succeed)."""
    result = run_demo(
        tmp_path,
        *("--model", model, "--steps", "3", "--strategies", strategies),
        *("--tome", "0.5", "--deepcache", "2", "--out", str(tmp_path / "out")),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{model} architecture" in result.stdout
    return table_rows(result.stdout)


def test_demo_runs_auto_with_token_merging_and_deepcache_as_a_separate_row(tmp_path):
    rows = run_accelerated_demo(tmp_path, "tiny", "sdpa")
    accelerated = rows["auto + ToMe 0.5 + DeepCache 2"]
    # lossy: a real deviation from the exact sdpa run, while the exact rows stay exact
    assert float(accelerated[3]) > 1e-4
    assert float(rows["auto (steady state)"][3]) < 1e-4


def test_demo_runs_the_sdxl_architecture_with_token_merging_and_deepcache(tmp_path):
    """SDXL's pipeline (pooled embeddings and added time conditions) through the demo: every
    strategy, and the accelerated row, which merges at SDXL's highest attention resolution."""
    rows = run_accelerated_demo(tmp_path, "tiny-sdxl", "sdpa,tiled")
    assert float(rows["tiled"][3]) < 1e-4  # exact
    assert float(rows["auto + ToMe 0.5 + DeepCache 2"][3]) > 1e-4  # lossy, so it really ran
    assert (tmp_path / "out" / "image.png").is_file()


def test_demo_runs_sd3_with_first_block_cache_as_a_separate_row(tmp_path):
    """SD3's pipeline (joint text tokens, pooled embeddings, flow matching, a shifted VAE
    latent) through the demo, and ``--block-cache``: a threshold high enough to skip must skip
    (the line says how often) and deviate, while ``tiled`` stays exact."""
    result = run_demo(
        tmp_path,
        *("--model", "tiny-sd3", "--steps", "4", "--strategies", "sdpa,tiled"),
        *("--block-cache", "5", "--out", str(tmp_path / "out")),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tiny-sd3 architecture" in result.stdout
    skipped = re.search(r"skipped on (\d+) of (\d+) transformer calls", result.stdout)
    assert skipped is not None, result.stdout
    assert 0 < int(skipped[1]) < int(skipped[2]) == 4  # the first call of a generation runs
    rows = table_rows(result.stdout)
    assert float(rows["tiled"][3]) < 1e-4
    assert float(rows["auto + First Block Cache 5.0"][3]) > 1e-4
    assert (tmp_path / "out" / "image.png").is_file()


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-hidream"])
def test_demo_runs_flux_and_hidream_with_first_block_cache(tmp_path, model):
    """Flux's (packed latents, distilled guidance, diffusers' FirstBlockCache) and HiDream's
    (T5 + Llama text, the pipeline's own size rescaling, npu_attn's block cache) pipelines
    through the demo, with the same builders as the UI and ``bench --e2e --images``."""
    result = run_demo(
        tmp_path,
        *("--model", model, "--steps", "2", "--strategies", "sdpa,tiled"),
        *("--block-cache", "0.1", "--out", str(tmp_path / "out")),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{model} architecture" in result.stdout
    rows = table_rows(result.stdout)
    assert float(rows["tiled"][3]) < 1e-4  # exact
    assert "auto + First Block Cache 0.1" in rows
    assert (tmp_path / "out" / "image.png").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "tiny-sd3", "--deepcache", "2"], "applies to UNet pipelines"),
        (["--model", "tiny-sd3", "--tome", "0.5"], "token_merging"),
        (["--model", "tiny", "--block-cache", "0.1"], "block_cache applies to transformer"),
        (["--model", "tiny-sd3", "--block-cache", "-1"], "block_cache"),
    ],
)
def test_demo_refuses_an_acceleration_the_model_cannot_take_before_running(tmp_path, args, message):
    result = run_demo(tmp_path, *args, "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "denoising" not in result.stdout + result.stderr  # nothing ran
    assert not (tmp_path / "out" / "results.json").exists()


def test_sd3_is_stable_diffusion_3_medium_architecture():
    """The full-size config, built on the meta device (nothing run): SD3 medium's transformer
    has 2,028,328,000 parameters and takes 333 joint text tokens of 4096 and pooled 2048."""
    import torch
    from diffusers import SD3Transformer2DModel

    from npu_attn.tools.pipelines import SD3_MODELS, prompt_embeddings

    overrides, size, joint, vae = SD3_MODELS["sd3"]
    with torch.device("meta"):
        transformer = SD3Transformer2DModel(**overrides)
    assert sum(p.numel() for p in transformer.parameters()) == 2_028_328_000
    assert (size, joint, vae) == (512, 4096, (128, 256, 512, 512))
    pipe = types.SimpleNamespace(unet=None, transformer=transformer)
    kwargs = prompt_embeddings(pipe, torch.bfloat16, "cpu")
    assert kwargs["prompt_embeds"].shape == (1, 333, 4096)
    assert kwargs["negative_pooled_prompt_embeds"].shape == (1, 2048)


def test_random_weights_are_the_same_every_build_and_leave_the_callers_rng_alone():
    """Every process builds the same random-weight models (seed 0), and building one does not
    reseed the caller's global RNG."""
    import torch

    from npu_attn.tools.bench_e2e import build_unet
    from npu_attn.tools.pipelines import build_denoiser

    def state_after(build):
        torch.manual_seed(123)
        built = build()
        return built, torch.rand(4)

    untouched = state_after(lambda: None)[1]
    first, after_pipeline = state_after(lambda: build_pipeline("tiny"))
    second, _ = state_after(lambda: build_pipeline("tiny"))
    assert torch.equal(after_pipeline, untouched)
    for a, b in zip(first.unet.parameters(), second.unet.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(state_after(lambda: build_denoiser("tiny"))[1], untouched)
    assert torch.equal(state_after(lambda: build_unet("tiny"))[1], untouched)
