"""``python -m npu_attn bench --e2e --images``: the whole-image benchmark on tiny models.

The SDXL path (``--model tiny-sdxl``: SDXL's UNet structure with tiny widths, its Euler
scheduler, pooled prompt embeddings) runs end to end with every configuration through the
command line, in this process; the full-size configs are checked without running them.
Correctness only: timings on a shared machine are not asserted.
"""

from __future__ import annotations

import json
import logging
import math
import types

import pytest
import torch

import npu_attn
from frozen_helpers import tensors_kept_by_generated_code
from npu_attn import _C
from npu_attn.tools.bench_e2e import (
    GRAPH_IMAGE_CONFIGS,
    IMAGE_CONFIGS,
    REUSE,
    TRANSFORMER_IMAGE_CONFIGS,
    ConfigurationError,
    build_unet,
    check_image_configs,
    graph_config_groups,
    image_configs,
    images_markdown,
    is_graph_config,
    make_inputs,
    select_configs,
)
from npu_attn.tools.cli import main
from npu_attn.tools.pipelines import (
    ARCHITECTURES,
    MODELS,
    SDXL_MODELS,
    UNET_ARCHITECTURES,
    build_pipeline,
    prompt_embeddings,
    vae_scale_factor,
)
from tiny_accel_models import sd3_pipeline

LABELS = [config[0] for config in IMAGE_CONFIGS]


@pytest.fixture(scope="module")
def tiny_sdxl_report(tmp_path_factory):
    """bench --e2e --images 2 on tiny-sdxl at 32x32, every configuration, JSON and PNG."""
    out = tmp_path_factory.mktemp("images")
    argv = ["bench", "--e2e", "--images", "2", "--repeats", "1", "--model", "tiny-sdxl"]
    argv += ["--size", "32", "--json", str(out / "r.json"), "--plot", str(out / "r.png")]
    assert main([*argv, "--no-graph-mode"]) == 0  # graph mode: test_graph_mode_images below
    return out


def test_tiny_sdxl_images_run_every_configuration(tiny_sdxl_report, capsys):
    report = json.loads((tiny_sdxl_report / "r.json").read_text(encoding="utf-8"))
    assert report["model"] == "tiny-sdxl"
    assert report["size"] == 32
    assert report["steps"] == 2 and report["repeats"] == 1
    assert report["scheduler"] == "EulerDiscreteScheduler"  # SDXL's own
    assert list(report["seconds_per_image"]) == LABELS
    assert all(s > 0 for s in report["seconds_per_image"].values())
    assert report["speedup_vs_baseline"][LABELS[0]] == 1.0
    psnr = report["psnr_db_vs_baseline"]
    assert psnr[LABELS[0]] is None  # the reference
    # every other image was decoded and compared: finite or identical, never NaN
    assert all(psnr[n] > 10 for n in LABELS[1:]), psnr
    # the lossy configurations really changed something on the SDXL structure
    assert all(math.isfinite(psnr[n]) for n in LABELS if "ToMe" in n), psnr
    table = images_markdown(report)
    assert "tiny-sdxl pipeline (random weights), 32x32, 2 EulerDiscreteScheduler steps" in table
    assert "| ToMe 0.5 + DeepCache 3 + tiled |" in table


def test_tiny_sdxl_images_write_a_png_chart(tiny_sdxl_report):
    png = (tiny_sdxl_report / "r.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux", "tiny-hidream"])
def test_transformer_families_run_their_image_configurations(model, tmp_path):
    """--images on a transformer family: First Block Cache instead of Token Merging and
    DeepCache, through the same builders as the demo and the UI."""
    report_path = tmp_path / "r.json"
    argv = ["bench", "--e2e", "--images", "2", "--repeats", "1", "--model", model]
    argv += ["--no-graph-mode"]  # graph mode on a transformer: test_transformer_graph_mode
    assert main([*argv, "--dtype", "float32", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text(encoding="utf-8"))
    labels = [config[0] for config in TRANSFORMER_IMAGE_CONFIGS]
    assert list(report["seconds_per_image"]) == labels
    assert all(report["seconds_per_step"][n] > 0 for n in labels)
    assert report["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    assert all(report["psnr_db_vs_baseline"][n] > 10 for n in labels[1:])


def test_the_step_benchmark_takes_unets_only(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--e2e", "--model", "tiny-flux"])
    assert exit_info.value.code == 2
    assert "use --images for tiny-flux" in capsys.readouterr().err


def test_a_per_image_configuration_in_step_mode_is_refused_with_the_step_labels(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--e2e", "--model", "tiny", "--configs", "DeepCache"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--configs: 'deepcache' matches no configuration" in err
    assert "compiled tiled" in err and "need --images" in err


@pytest.mark.parametrize("model", ["sdx", "sd-xl", "flux-dev", "sd35"])
def test_unknown_model_is_refused_with_the_choices(model, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--e2e", "--images", "2", "--model", model])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid choice: '{model}'" in err
    assert all(name in err for name in ARCHITECTURES), err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--images", "0"], "--images must be >= 1"),
        (
            ["--images", "2", "--size", "100"],
            "--size: size 100 px: this model takes multiples of 8",
        ),
        (["--images", "2", "--repeats", "0"], "--repeats must be >= 1"),
        (["--images", "2", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
    ],
)
def test_bad_numbers_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--e2e", "--model", "tiny-sdxl", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_configuration_that_does_not_apply_is_named_before_anything_runs():
    with pytest.raises(ConfigurationError, match=r"configuration 'ToMe 0\.5' cannot run on sd3"):
        check_image_configs(sd3_pipeline(), "sd3")


def test_sdxl_configs_accept_every_image_configuration():
    check_image_configs(build_pipeline("tiny-sdxl"), "tiny-sdxl")  # raises if one does not


def test_sdxl_is_stable_diffusion_xl_base_architecture():
    """The full-size config, built on the meta device (no memory, nothing run): SDXL base
    1.0's UNet has 2,567,463,684 parameters, its pipeline needs pooled embeddings of 1280."""
    overrides, size, cross, vae = SDXL_MODELS["sdxl"]
    with torch.device("meta"):
        from diffusers import UNet2DConditionModel

        unet = UNet2DConditionModel(**overrides)
    assert sum(p.numel() for p in unet.parameters()) == 2_567_463_684
    assert (size, cross, vae) == (1024, 2048, (128, 256, 512, 512))
    kwargs = prompt_embeddings(types.SimpleNamespace(unet=unet), torch.bfloat16, "cpu")
    assert kwargs["prompt_embeds"].shape == (1, 77, 2048)
    assert kwargs["negative_pooled_prompt_embeds"].shape == (1, 1280)
    assert kwargs["prompt_embeds"].dtype == torch.bfloat16
    sd15 = prompt_embeddings(build_pipeline("tiny"), torch.float32, "cpu")
    assert set(sd15) == {"prompt_embeds", "negative_prompt_embeds"}


def test_step_benchmark_inputs_carry_sdxl_added_conditions():
    """``bench --e2e`` (per step) on an SDXL UNet: one eager call with its inputs."""
    unet = build_unet("tiny-sdxl")
    inputs = make_inputs(unet, 64, torch.float32, vae_scale_factor("tiny-sdxl"))
    assert set(inputs["added_cond_kwargs"]) == {"text_embeds", "time_ids"}
    with torch.no_grad():
        out = unet(**inputs).sample
    assert out.shape == (2, 4, 32, 32) and torch.isfinite(out).all()
    assert "added_cond_kwargs" not in make_inputs(build_unet("tiny"), 64, torch.float32, 2)


def test_architecture_tables_do_not_overlap():
    """Each architecture name builds one pipeline class: the tables do not overlap, and the
    step benchmark (UNets alone) offers the UNet architectures only."""
    from npu_attn.tools.pipelines import SD3_MODELS

    assert not set(SDXL_MODELS) & set(MODELS)
    assert not set(SD3_MODELS) & set(UNET_ARCHITECTURES)


def test_sd_images_still_run(tmp_path, capsys):
    """The SD-1.5-style pipeline (DDIM, no pooled embeddings) through the same path, without
    diffusers' and transformers' configuration chatter: neither library logs a warning while it
    runs (their loggers' own handlers write to the stderr of whenever they were set up, so the
    records are caught on the loggers, not in the captured output)."""
    records = []
    catcher = logging.Handler()
    catcher.emit = records.append
    libraries = [logging.getLogger(name) for name in ("diffusers", "transformers")]
    argv = ["bench", "--e2e", "--images", "1", "--repeats", "1", "--model", "tiny"]
    argv += ["--no-graph-mode", "--dtype", "bfloat16"]  # a cast diffusers warns about
    for library in libraries:
        library.addHandler(catcher)
    try:
        assert main([*argv, "--size", "32", "--json", str(tmp_path / "r.json")]) == 0
    finally:
        for library in libraries:
            library.removeHandler(catcher)
    report = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert report["scheduler"] == "DDIMScheduler"
    assert list(report["seconds_per_image"]) == LABELS
    chatter = [r.getMessage() for r in records if r.levelno < logging.ERROR]
    assert chatter == []
    assert "| sdpa (diffusers default) |" in capsys.readouterr().out  # the table still prints


def test_step_benchmark_eager_rows_predict_the_tiled_and_int8_steps(tmp_path, capsys):
    """bench --e2e (per step) on the tiny UNet with --configs eager: no compiles; the eager
    sdpa, tiled, int8 and channels-last rows; a prediction for tiled and for int8."""
    argv = ["bench", "--e2e", "--model", "tiny", "--size", "64", "--dtype", "float32"]
    argv += ["--repeats", "1", "--no-openvino", "--configs", "eager"]
    assert main([*argv, "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert list(report["seconds_per_step"]) == [
        "eager sdpa",
        "eager tiled",
        "eager int8 (lossy)",
        "eager tiled + channels-last",
    ]
    predictions = report["step_predictions"]
    assert list(predictions) == ["tiled", "int8"]
    for strategy, prediction in predictions.items():
        assert (
            prediction["measured_step"]
            == report["seconds_per_step"][
                {"tiled": "eager tiled", "int8": "eager int8 (lossy)"}[strategy]
            ]
        )
        assert 0 < prediction["predicted_step"] <= prediction["sdpa_step"] * 10
        # the measured steps split into their attention (timed inside) and the rest
        split = prediction["in_step"]
        assert list(split) == ["sdpa", strategy]
        for name, step in (
            ("sdpa", prediction["sdpa_step"]),
            (strategy, prediction["measured_step"]),
        ):
            assert 0 < split[name]["attention"] < step
            assert split[name]["rest"] == pytest.approx(step - split[name]["attention"])
    text = capsys.readouterr().out
    assert "| sdpa s | tiled s |" in text and "| sdpa s | int8 s |" in text
    assert "Timed inside the steps, the int8 step's attention took" in text


def test_the_heap_reuse_row_alone_runs_with_reuse_and_in_its_steady_state():
    """The step benchmark's ``+ heap reuse`` row: reuse on and one untimed call first (the
    first step after switching fills the heap); every other row: reuse off, nothing extra."""
    import npu_attn
    from npu_attn import _C
    from npu_attn.tools.bench_e2e import FROZEN, REUSE, _set_heap_reuse

    if not _C.heap_reuse_supported():
        pytest.skip("the C heap is not glibc's in this process: no heap reuse row")
    calls = []
    try:
        _set_heap_reuse(f"compiled tiled{FROZEN}{REUSE}", lambda: calls.append("reuse"))
        assert npu_attn.runtime.cpu_memory_reuse_enabled() and calls == ["reuse"]
        _set_heap_reuse(f"compiled tiled{FROZEN}", lambda: calls.append("frozen"))
        assert not npu_attn.runtime.cpu_memory_reuse_enabled() and calls == ["reuse"]
    finally:
        npu_attn.runtime.reuse_cpu_memory(False)


def test_graph_mode_images_run_on_a_compiled_copy_and_leave_the_pipeline_eager(tmp_path):
    """The fastest recipe's graph-mode configuration (ToMe + DeepCache + compiled + frozen
    tiled, and its heap-reuse row) runs on its own compiled copy of the pipeline, its compile
    time reported apart, the benchmarked pipeline itself never compiled, and its frozen
    constants freed with it.

    One compiled copy: each compile of even the tiny model takes 2-3 minutes of inductor on 2
    cores. This one is the copy only this test compiles with inductor (test_acceleration
    traces ToMe + DeepCache under the freezing flag with a counting backend, no inductor); the
    exact compiled + frozen UNet is compared with eager in test_graph_mode, and the grouping of
    several copies with their heap-reuse rows is checked without compiling below."""
    report_path = tmp_path / "r.json"
    argv = ["bench", "--e2e", "--images", "3", "--repeats", "1", "--model", "tiny-sdxl"]
    argv += ["--size", "32", "--dtype", "float32", "--json", str(report_path)]
    groups = graph_config_groups([c for c in image_configs("sdxl") if is_graph_config(c[2])])
    assert len(groups) >= 2 and "ToMe" in groups[-1][0][0] and "DeepCache" in groups[-1][0][0]
    graph_labels = [c[0] for c in groups[-1]]
    assert main([*argv, "--configs", ",".join(graph_labels)]) == 0
    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert list(report["seconds_per_image"]) == [LABELS[0], *graph_labels]
    # the heap-reuse row runs on its sibling's compiled copy: no compile of its own
    compiled = [n for n in graph_labels if not n.endswith(REUSE)]
    assert set(report["compile_and_warm_up_seconds"]) == set(compiled) and len(compiled) == 1
    psnr = report["psnr_db_vs_baseline"]
    # lossy by Token Merging and DeepCache alone (42.8-43.4 dB on Zen 3): a compiled copy that
    # computed another model than the pipeline's would be far below
    assert all(psnr[n] > 30 for n in graph_labels), psnr
    assert not npu_attn.runtime.cpu_memory_reuse_enabled()  # back off after the reuse rows
    assert "Graph mode, compile + warm-up image" in images_markdown(report)
    # The configuration's frozen constants were freed with it (inductor's generated modules
    # would keep them): none is left in a generated module after the run.
    assert not tensors_kept_by_generated_code()


def test_heap_reuse_rows_share_their_siblings_copy_and_run_with_reuse(monkeypatch):
    """Each ``+ heap reuse`` row is timed on the compiled copy of the row without it,
    interleaved with that row, with reuse on after an untimed 1-step image (the heap filled as
    the images before would fill it); every other graph row with reuse off."""
    from npu_attn.graph import mode as graph_mode
    from npu_attn.tools import bench_e2e

    if not _C.heap_reuse_supported():
        pytest.skip("the C heap is not glibc's in this process: no heap reuse rows")
    prepared, warm_ups, timed = [], [], []

    def prepare(pipe, strategy, options, embeds, size):
        prepared.append(options)
        return types.SimpleNamespace(options=options), 1.0

    monkeypatch.setattr(bench_e2e, "prepare_graph_config", prepare)

    def warm_up(twin, embeds, steps, size):
        warm_ups.append(steps)

    monkeypatch.setattr(bench_e2e, "timed_image", warm_up)
    monkeypatch.setattr(graph_mode, "release_compiled_graphs", lambda: None)
    record = lambda twin, label: timed.append((label, runtime_reuse()))  # noqa: E731
    setup = bench_e2e.run_graph_configs(None, GRAPH_IMAGE_CONFIGS, {}, 32, 2, record)
    groups = bench_e2e.graph_config_groups(GRAPH_IMAGE_CONFIGS)
    assert len(prepared) == len(groups) == 3 and list(setup) == [g[0][0] for g in groups]
    labels = [c[0] for c in GRAPH_IMAGE_CONFIGS]
    expected = [labels[0], labels[1]] * 2 + [labels[2]] * 2 + [labels[3], labels[4]] * 2
    assert [label for label, _ in timed] == expected
    assert all(reuse == label.endswith(REUSE) for label, reuse in timed), timed
    # one untimed image each time reuse is switched on, with the warm-up's steps (the graphs
    # it compiled: a 1-step image took new ones with DeepCache and recompiled)
    assert warm_ups == [bench_e2e.GRAPH_WARM_UP_STEPS] * 4
    assert not runtime_reuse()


def runtime_reuse() -> bool:
    import npu_attn

    return npu_attn.runtime.cpu_memory_reuse_enabled()


def test_configurations_are_selected_by_label():
    configs = image_configs("sd")
    assert [c[0] for c in select_configs(configs, "DeepCache 3 + tiled")] == [
        LABELS[0],
        "ToMe 0.5 + DeepCache 3 + tiled",
        "ToMe 0.5 + DeepCache 3 + tiled + channels-last",
    ]
    assert select_configs(configs, None) == configs
    # a whole label selects that configuration only
    assert [c[0] for c in select_configs(configs, "Compiled tiled (frozen)")] == [
        LABELS[0],
        "compiled tiled (frozen)",
    ]
    assert image_configs("sd", graph=False) == IMAGE_CONFIGS
    with pytest.raises(ValueError, match="'warp drive' matches no configuration"):
        select_configs(configs, "warp drive")


def test_transformer_graph_mode(tmp_path):
    """The transformer families' graph-mode configuration (compiled + frozen tiled) on Flux."""
    report_path = tmp_path / "r.json"
    argv = ["bench", "--e2e", "--images", "2", "--repeats", "1", "--model", "tiny-flux"]
    argv += ["--dtype", "float32", "--configs", "compiled tiled (frozen)"]
    assert main([*argv, "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert list(report["seconds_per_image"]) == [
        "sdpa (diffusers default)",
        "compiled tiled (frozen)",
    ]
    assert report["psnr_db_vs_baseline"]["compiled tiled (frozen)"] > 60  # exact


def test_configurations_whose_strategy_cannot_run_on_the_device_are_refused_first():
    """A pipeline off the CPU (here on the meta device, standing in for an NPU) cannot run the
    tiled or int8 configurations: refused before anything runs, and the web UI's compare tab
    does not offer them."""
    from npu_attn.tools.ui import compare_labels

    pipe = build_pipeline("tiny")
    pipe.unet.to("meta")
    with pytest.raises(ConfigurationError, match="'tiled' cannot run on tiny: the tiled kernel"):
        check_image_configs(pipe, "tiny")
    check_image_configs(pipe, "tiny", IMAGE_CONFIGS[:1] + IMAGE_CONFIGS[2:6])  # sdpa ones run
    on_cpu, off_cpu = compare_labels("tiny"), compare_labels("tiny", torch.device("meta"))
    assert {"tiled", "int8 (lossy attention)"} <= set(on_cpu)
    assert off_cpu == [label for label, strategy, _ in IMAGE_CONFIGS if strategy == "sdpa"]
