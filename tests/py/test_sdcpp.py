"""stable-diffusion.cpp as a per-image competitor (npu_attn.tools.sdcpp, bench --e2e --images
--sdcpp). The folder it loads is checked on a tiny pipeline everywhere; the real engine (the
published ``stable-diffusion-cpp-python``, built from source) runs where it is installed."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors import safe_open

from npu_attn.tools import sdcpp
from npu_attn.tools.bench_e2e import compare_images
from npu_attn.tools.cli import main
from npu_attn.tools.pipelines import build_pipeline, prompt_embeddings

NOT_INSTALLED = sdcpp.unavailable_reason()


def keys_of(path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def test_weight_types_parse_and_bad_ones_name_the_valid_ones():
    assert sdcpp.parse_weight_types(" f32, q8_0+fa ") == ("f32", "q8_0+fa")
    for bad in ("", "f32,int4", "fp32", "fa"):
        with pytest.raises(ValueError, match="weight types from f32, f16, q8_0"):
            sdcpp.parse_weight_types(bad)
    assert sdcpp.label_of("f32") == "stable-diffusion.cpp f32 (exact)"
    assert sdcpp.label_of("q8_0") == "stable-diffusion.cpp q8_0 (lossy: q8_0 weights)"
    assert sdcpp.label_of("f32+fa") == (
        "stable-diffusion.cpp f32 + flash attention (lossy: float16 K/V)"
    )


def test_the_exported_folder_is_what_its_diffusers_loader_reads(tmp_path):
    """unet/ and vae/ as diffusers saves them, and an SD-1.5 text encoder whose keys start with
    ``text_model.`` (stable-diffusion.cpp finds SD-1.5 by that token embedding's name and
    width; transformers 5 saves CLIPTextModel without the prefix)."""
    pipe = build_pipeline("tiny")
    folder = sdcpp.export_folder(pipe, tmp_path / "model")
    assert keys_of(folder / "unet" / "diffusion_pytorch_model.safetensors") == set(
        pipe.unet.state_dict()
    )
    assert keys_of(folder / "vae" / "diffusion_pytorch_model.safetensors") == set(
        pipe.vae.state_dict()
    )
    text = folder / "text_encoder" / "model.safetensors"
    names = keys_of(text)
    assert all(name.startswith("text_model.") for name in names)
    with safe_open(str(text), "pt") as f:
        embedding = f.get_tensor("text_model.embeddings.token_embedding.weight")
    assert tuple(embedding.shape) == (49408, 768)
    # The same seed gives the same text encoder; the caller's random state is left alone.
    state = torch.random.get_rng_state()
    again = sdcpp.export_folder(pipe, tmp_path / "again")
    assert torch.equal(torch.random.get_rng_state(), state)
    with safe_open(str(again / "text_encoder" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("text_model.embeddings.token_embedding.weight"), embedding)


@pytest.mark.parametrize("model", ["tiny", "tiny-sdxl"])
def test_pipelines_other_than_sd15_are_refused(model):
    reason = sdcpp.check_pipeline(build_pipeline(model), model)
    assert reason == f"stable-diffusion.cpp is compared on SD-1.5 pipelines only, not {model}"


def test_cli_errors(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--e2e", "--model", "tiny", "--sdcpp", "f32"])
    assert "--sdcpp compares whole images: use it with --images" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--e2e", "--images", "1", "--model", "tiny", "--sdcpp", "f8"])
    assert "--sdcpp takes weight types from f32, f16, q8_0" in capsys.readouterr().err
    # Not installed: a clear error naming the package, before anything is built.
    monkeypatch.setitem(sys.modules, "stable_diffusion_cpp", None)
    assert main(["bench", "--e2e", "--images", "1", "--model", "tiny", "--sdcpp", "f32"]) == 2
    assert f"pip install {sdcpp.PACKAGE}" in capsys.readouterr().err


@pytest.mark.skipif(NOT_INSTALLED is not None, reason=str(NOT_INSTALLED))
def test_stable_diffusion_cpp_runs_the_exported_sd15_next_to_diffusers(tmp_path):
    """The real engine loads the full-size SD-1.5 exported here and makes a guided image at a
    small size inside compare_images, interleaved with the diffusers default; its image gets no
    PSNR (another sampler and noise)."""
    pipe = build_pipeline("sd15")
    pipe.set_progress_bar_config(disable=True)
    folder = sdcpp.export_folder(pipe, tmp_path / "sd15")
    runner = sdcpp.SdCppRunner.load(folder, "f32", threads=torch.get_num_threads())
    seconds, image = runner.image(1, 64)
    assert seconds > 0 and image.shape == (1, 3, 64, 64)
    assert float(image.min()) >= 0.0 and float(image.max()) <= 1.0 and float(image.std()) > 0
    embeds = prompt_embeddings(pipe, torch.float32, "cpu")
    configs = (("sdpa (diffusers default)", "sdpa", {}),)
    report = compare_images(pipe, configs, embeds, 1, 64, 1, external=[runner])
    assert report["not_comparable"] == [runner.label]
    assert report["psnr_db_vs_baseline"][runner.label] is None
    assert report["seconds_per_image"][runner.label] > 0
    assert runner.label not in report["seconds_per_step"]
