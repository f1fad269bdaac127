"""``python -m npu_attn ui``: the web page, driven as a user would.

The server is started as a subprocess on a free loopback port and driven over real HTTP by
Gradio's Python client (generation, cancelling, comparing, and every bad input answered with
its message while the server stays up) and by a real browser: Debian's ``chromium`` headless
through Selenium and ``chromium-driver``. With ``NPU_ATTN_UI_SCREENSHOT=PATH`` the browser
test also saves its screenshot there (docs/images/web-ui.png is made this way). Each model
family generates one step through the shared builders, in this process.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from gradio_client import Client
from gradio_client.exceptions import AppError

import npu_attn
from frozen_helpers import tensors_kept_by_generated_code
from npu_attn.accel.base import ModelFamilyError
from npu_attn.accel.registry import acceleration_of, check_acceleration
from npu_attn.tools import studio as studio_module
from npu_attn.tools import ui
from npu_attn.tools.pipelines import (
    ARCHITECTURES,
    FAMILIES,
    architecture_summary,
    build_pipeline,
    load_pipeline,
)
from npu_attn.tools.studio import (
    ACCELERATIONS,
    FAMILY_ACCELERATIONS,
    LOCAL_MODEL,
    InputError,
    Request,
    Studio,
    model_label,
)

# The tiny architecture of each family: seconds per image on 2 cores.
TINY_OF_FAMILY = {FAMILIES[m]: m for m in ARCHITECTURES if m.startswith("tiny")}
SERVER_START_SECONDS = 120
PACKAGE_PARENT = str(Path(npu_attn.__file__).resolve().parents[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict[str, str]:
    """The tests' own npu_attn (source tree or installed) for the server subprocess."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")]))
    return env


def wait_until_serving(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = log.read_text(encoding="utf-8", errors="replace")
            raise AssertionError(f"the server exited ({process.returncode}):\n{output}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the server did not answer on {url} in {SERVER_START_SECONDS} s")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``python -m npu_attn ui --port P --allow-local-models`` (loopback): its URL. Its output
    goes to a file (a pipe nobody reads could fill and block it)."""
    port = free_port()
    log = tmp_path_factory.mktemp("ui") / "server.log"
    command = [sys.executable, "-m", "npu_attn", "ui", "--port", str(port)]
    with log.open("w", encoding="utf-8") as output:
        process = subprocess.Popen(
            [*command, "--allow-local-models"],
            env=subprocess_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_until_serving(process, url, log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def client(server):
    return Client(server, verbose=False)


def generate_args(**changes) -> list:
    """/generate's inputs in the page's order: model, folder, prompt, dtype, strategy, one flag
    per acceleration, their settings, steps, size, seed, images."""
    values = {
        "model": "tiny",
        "folder": "",
        "prompt": "",
        "dtype": "float32",
        "strategy": "auto",
        **{name: False for name in ACCELERATIONS},
        "tome_ratio": 0.5,
        "deep_cache_interval": 3,
        "block_cache_threshold": 0.1,
        "steps": 2,
        "size": 64,
        "seed": 0,
        "images": 1,
    }
    values.update(changes)
    return list(values.values())


def assert_server_up(client) -> None:
    """A normal generation still works: the server survived what came before."""
    gallery, timing = client.predict(*generate_args(), api_name="/generate")
    assert len(gallery) == 1 and "s / step" in timing


# --------------------------------------------------------------------------- over HTTP
def test_generates_tiny_images_with_their_time_per_step(client):
    gallery, timing = client.predict(*generate_args(images=2), api_name="/generate")
    assert len(gallery) == 2
    for entry in gallery:
        assert Path(entry["image"]).stat().st_size > 0
    assert timing.count("s / step") == 2
    assert "image 2 of 2" in timing and "attention" in timing


BAD_INPUTS = {
    "acceleration the family cannot take": (
        {"block_cache": True},
        "First Block Cache cannot run on Stable Diffusion 1.5/2.1 UNet models",
    ),
    "size the model cannot take": ({"size": 63}, "size 63 px: this model takes multiples of 8"),
    "transformer size over its maximum": (
        {"model": "tiny-hidream", "size": 256},
        "this model takes at most 64 px",
    ),
    "estimated memory over the available": (
        {"model": "sdxl", "size": 4096, "images": 8},
        "needs about",
    ),
    "two compile modes": ({"compile": True, "freeze": True}, "choose compile or compile + freeze"),
    "steps out of range": ({"steps": 0}, "Value 0 is less than minimum value 1"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_its_message(client, case):
    changes, message = BAD_INPUTS[case]
    with pytest.raises(AppError) as error:
        client.predict(*generate_args(**changes), api_name="/generate")
    assert message in str(error.value)


def test_a_folder_that_is_not_a_diffusers_model_gets_its_message(client, tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"not a model")
    args = generate_args(model=LOCAL_MODEL, folder=str(tmp_path))
    with pytest.raises(AppError) as error:
        client.predict(*args, api_name="/generate")
    assert "is not a diffusers model folder: no model_index.json" in str(error.value)


def test_a_local_diffusers_folder_generates(client, tmp_path):
    build_pipeline("tiny").save_pretrained(tmp_path)  # a real folder (no text encoders)
    args = generate_args(model=LOCAL_MODEL, folder=str(tmp_path), size=64)
    gallery, timing = client.predict(*args, api_name="/generate")
    assert len(gallery) == 1 and "s / step" in timing


def test_a_local_folder_loads_in_the_requested_dtype(tmp_path, monkeypatch):
    """The weights are read in the request's dtype (not loaded as float32 and cast, which holds
    both copies at once)."""
    build_pipeline("tiny").save_pretrained(tmp_path)  # float32 weights on disk
    pipe = load_pipeline(tmp_path, torch_dtype=torch.bfloat16)
    assert pipe.unet.dtype == torch.bfloat16 and pipe.vae.dtype == torch.bfloat16
    asked = []

    def recording_load(directory, torch_dtype=None):
        asked.append(torch_dtype)
        return load_pipeline(directory, torch_dtype=torch_dtype)

    monkeypatch.setattr(studio_module, "load_pipeline", recording_load)
    studio = Studio(allow_local_models=True)
    request = Request(model=LOCAL_MODEL, folder=str(tmp_path), dtype="bfloat16")
    assert studio.pipeline(request).unet.dtype == torch.bfloat16
    assert asked == [torch.bfloat16]


def test_a_folder_that_is_no_model_leaves_the_loaded_model_loaded(tmp_path):
    studio = Studio(allow_local_models=True)
    loaded = studio.pipeline(Request(model="tiny"))
    with pytest.raises(InputError, match="no model_index.json"):
        studio.pipeline(Request(model=LOCAL_MODEL, folder=str(tmp_path)))
    assert studio.pipeline(Request(model="tiny")) is loaded  # not rebuilt


def test_code_in_a_model_folder_never_runs(tmp_path):
    """A folder whose model_index.json names a pipeline class in its own pipeline.py: loading
    it would run that file; the UI refuses instead (never trust_remote_code)."""
    marker = tmp_path / "ran"
    (tmp_path / "pipeline.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n", encoding="utf-8"
    )
    index = '{"_class_name": ["pipeline", "Custom"], "_diffusers_version": "0.42.1"}'
    (tmp_path / "model_index.json").write_text(index, encoding="utf-8")
    studio = Studio(allow_local_models=True)
    with pytest.raises(InputError, match="trust_remote_code"):
        list(studio.generate(Request(model=LOCAL_MODEL, folder=str(tmp_path))))
    assert not marker.exists()


def test_the_server_stays_up_after_bad_inputs(client):
    for changes, _ in BAD_INPUTS.values():
        with pytest.raises(AppError):
            client.predict(*generate_args(**changes), api_name="/generate")
    assert_server_up(client)


def test_cancel_stops_between_steps(client):
    job = client.submit(*generate_args(steps=100, images=2), api_name="/generate")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # cancel once the denoising loop runs
        progress = job.status().progress_data
        if progress and progress[0].index:
            break
        time.sleep(0.1)
    client.predict(api_name="/cancel")
    gallery, timing = job.result(timeout=120)
    assert len(gallery) == 1  # the second image never started
    assert "cancelled after step" in timing
    assert "cancelled after step 100" not in timing  # it stopped between steps, not at the end
    assert_server_up(client)


def test_compare_gives_chart_and_table(client):
    chart, table = client.predict(
        "tiny", "", "float32", 0, 2, 64, ["tiled"], 1, api_name="/compare"
    )
    assert Path(chart).read_bytes().startswith(b"\x89PNG")
    rows = {row[0]: row for row in table["data"]}
    assert set(rows) == {"sdpa (diffusers default)", "tiled"}
    assert rows["sdpa (diffusers default)"][3:] == ["1.00x", "reference"]
    assert float(rows["tiled"][1]) > 0  # seconds per step


# --------------------------------------------------------------------------- command line
def test_without_gradio_it_says_how_to_install():
    code = (
        "import sys; sys.modules['gradio'] = None\n"
        "from npu_attn.tools.cli import main\n"
        "sys.exit(main(['ui']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "pip install 'npu_attn[ui]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_another_host_is_warned_about(monkeypatch, capsys):
    launched = {}

    class FakeApp:
        def queue(self, **options):
            launched["queue"] = options
            return self

        def launch(self, **options):
            launched["launch"] = options

    monkeypatch.setattr(ui, "Studio", lambda **options: options)
    monkeypatch.setattr(ui, "build_app", lambda studio, model: FakeApp())
    assert ui.main(["--host", "0.0.0.0", "--port", "7999"]) == 0
    assert "warning: listening on 0.0.0.0" in capsys.readouterr().err
    assert launched["launch"]["server_name"] == "0.0.0.0"
    assert launched["launch"]["share"] is False  # no public tunnel, even with GRADIO_SHARE set
    assert launched["queue"]["default_concurrency_limit"] == 1  # one generation at a time
    assert launched["queue"]["max_size"] == ui.QUEUE_SIZE
    assert ui.main([]) == 0
    assert "warning" not in capsys.readouterr().err  # loopback by default
    assert ui.is_loopback("::1") and ui.is_loopback("localhost")


def test_choosing_a_model_shows_the_accelerations_of_its_family():
    import gradio as gr

    _, _, model_changed = ui.handlers(gr, Studio())
    updates = model_changed("tiny-flux")
    shown = {
        name for name, update in zip(ACCELERATIONS, updates) if update["visible"]
    }  # one update per acceleration checkbox first
    assert shown == set(FAMILY_ACCELERATIONS["flux"])
    size, compare_size, configs = updates[len(ACCELERATIONS) : len(ACCELERATIONS) + 3]
    assert size["value"] == compare_size["value"] == 64
    assert "block cache 0.1" in configs["choices"]


def test_memory_is_estimated_for_one_image_at_a_time():
    """Images are generated one pipeline call each: eight SD-1.5 images at 512px need one
    image's activations, not eight (about 5 GiB in float32, accepted on a 24 GiB machine)."""
    from npu_attn.tools.pipelines import estimated_memory_bytes

    one = estimated_memory_bytes("sd15", 512, "float32", 1)
    studio = Studio()
    if (studio.available_memory_bytes() or 0) < 2 * one:
        pytest.skip("less than twice one SD-1.5 image's memory is available here")
    studio.check(Request(model="sd15", size=512, images=8))  # no InputError


def test_local_folders_are_off_unless_allowed(tmp_path):
    request = Request(model=LOCAL_MODEL, folder=str(tmp_path))
    with pytest.raises(InputError, match="start the server with --allow-local-models"):
        Studio().check(request)


# --------------------------------------------------------------------------- every family
@pytest.mark.parametrize("family", list(FAMILY_ACCELERATIONS))
def test_each_family_generates_one_step(family):
    studio = Studio()
    request = Request(model=TINY_OF_FAMILY[family], steps=1, strategy="tiled")
    (image,) = studio.generate(request)
    size = ARCHITECTURES[request.model][1]
    assert image.image.size == (size, size)
    assert image.steps_done == 1 and image.seconds_per_step > 0
    assert 0 < image.attention_share <= 1  # tiled runs through npu_attn's timed runner


@pytest.mark.parametrize(
    ("model", "accelerations"),
    [
        ("tiny", ("token_merging", "deep_cache", "channels_last")),
        ("tiny-sd3", ("block_cache", "channels_last")),
    ],
)
def test_accelerations_apply_for_the_generation_only(model, accelerations):
    studio = Studio()
    request = Request(model=model, steps=3, accelerations=accelerations)
    during = []
    (image,) = studio.generate(
        request, lambda _: during.append(set(acceleration_of(studio.pipeline(request))))
    )
    assert image.steps_done == 3
    assert during == [set(accelerations)] * 3  # on while generating
    assert acceleration_of(studio.pipeline(request)) == {}  # removed afterwards


@pytest.mark.parametrize("mode", ["compile", "freeze"])
def test_graph_mode_applies_for_the_generation_only(mode):
    """compile / compile + freeze from the page: the denoiser runs compiled (torch.compile,
    frozen weights for "freeze") during the generation, in one graph (no attention timer
    splitting it at each attention call), and eager again afterwards."""
    from torch._dynamo.utils import counters

    from npu_attn.graph.mode import compiled_components

    studio = Studio()
    request = Request(model="tiny", steps=2, strategy="tiled", accelerations=(mode,))
    during = []
    counters.clear()
    (image,) = studio.generate(
        request, lambda _: during.append(compiled_components(studio.pipeline(request)))
    )
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert image.steps_done == 2 and image.seconds_per_step > 0
    assert image.attention_share is None and "graph mode" in image.untimed_because
    assert "not timed (graph mode" in ui.timing_markdown([image], 1)
    assert during and all("unet" in compiled for compiled in during), during
    assert during[-1]["unet"] is not None  # called: its first call was timed
    assert compiled_components(studio.pipeline(request)) == {}  # eager afterwards
    # Inductor's generated code keeps no frozen weights after the request (a float32 SD-1.5
    # request would leave ~6.7 GB there otherwise).
    assert not tensors_kept_by_generated_code()


def test_graph_mode_requests_release_their_compiled_code(monkeypatch):
    """Every compile request compiles afresh; its compiled code is dropped afterwards, so a
    long-running server never reaches dynamo's recompile limit (and silently runs eagerly)."""
    from npu_attn.tools.studio import configured

    resets = []
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(True))
    studio = Studio()
    for accelerations in ((), ("compile",), ("freeze",)):
        request = Request(model="tiny", strategy="tiled", accelerations=accelerations)
        with configured(studio.pipeline(request), request):
            pass
    assert resets == [True, True]  # the two graph-mode requests only


@pytest.mark.parametrize("model", ["sd15", "flux", "hidream"])
def test_full_width_models_generate_one_step(model):
    """The page's full-size SD-1.5 and the full-width, reduced-depth Flux and HiDream-I1 (random
    weights, 1.4-2.3B parameters) really generate, at a small size to stay quick."""
    (image,) = Studio().generate(Request(model=model, steps=1, size=128, strategy="tiled"))
    assert image.image.size == (128, 128) and image.steps_done == 1


def test_flux_and_hidream_are_full_width_at_reduced_depth():
    """Their published widths (built on the meta device: nothing allocated), with 2 + 4 of
    their blocks; the model menu labels them with parameters and estimated memory."""
    flux, hidream = architecture_summary("flux")[1], architecture_summary("hidream")[1]
    assert flux.num_attention_heads * flux.attention_head_dim == 3072  # FLUX.1-dev
    assert (flux.joint_attention_dim, flux.num_layers, flux.num_single_layers) == (4096, 2, 4)
    assert hidream.num_attention_heads * hidream.attention_head_dim == 2560  # HiDream-I1
    assert tuple(hidream.caption_channels) == (4096, 4096)
    assert (hidream.num_layers, hidream.num_single_layers) == (2, 4)
    assert model_label("flux") == (
        "flux: Flux transformer, 1,394.0M parameters, ~6.19 GiB at 512px float32"
    )


@pytest.mark.parametrize("family", list(FAMILY_ACCELERATIONS))
def test_the_page_offers_exactly_the_accelerations_the_family_takes(family):
    """The UI's table agrees with npu_attn.accelerate: a method it hides is one the library
    refuses for the family, and one it offers is accepted."""
    pipe = build_pipeline(TINY_OF_FAMILY[family])
    values = {"token_merging": 0.5, "deep_cache": 3, "block_cache": 0.1, "channels_last": True}
    for method, value in values.items():
        if method in FAMILY_ACCELERATIONS[family]:
            check_acceleration(pipe, **{method: value})
        else:
            with pytest.raises(ModelFamilyError):
                check_acceleration(pipe, **{method: value})


# --------------------------------------------------------------------------- a real browser
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="Debian's chromium and chromium-driver are not installed (scripts/setup.sh does)",
)
def test_a_browser_generates_with_the_tiny_model(server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1280,1500")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        start = time.monotonic()
        driver.get(server)
        wait = WebDriverWait(driver, 60)
        button = wait.until(seen.element_to_be_clickable((By.ID, "generate")))
        assert button.text == "Generate"
        button.click()
        wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, "#gallery img")))
        wait.until(seen.text_to_be_present_in_element((By.ID, "timing"), "s / step"))
        assert time.monotonic() - start < 60
        assert "image 1 of 1" in driver.find_element(By.ID, "timing").text
        screenshot = os.environ.get("NPU_ATTN_UI_SCREENSHOT")
        if screenshot:  # the whole page from its top, the image and timing included
            driver.execute_script("window.scrollTo(0, 0)")
            save_screenshot(driver.get_screenshot_as_png(), Path(screenshot))
    finally:
        driver.quit()


def save_screenshot(png: bytes, path: Path) -> None:
    """The page as a small PNG for the docs (a 256-colour palette keeps it light)."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.quantize(colors=256).save(path, optimize=True)


@pytest.mark.parametrize(("model", "heads"), [("sd15", 8), ("sd21", 5), ("sdxl", 10)])
def test_memory_estimates_count_the_heads_the_unet_really_has(model, heads):
    """UNet configs name the head count attention_head_dim (diffusers' legacy naming): SD-1.5
    has 8 heads of 40 at 64x64, SD-2.1 5 of 64, SDXL 10 of 64 at its first attention level."""
    from npu_attn.tools.pipelines import FAMILIES, architecture_summary, attention_geometry

    config = architecture_summary(model)[1]
    assert attention_geometry(FAMILIES[model], config, 64)[2] == heads


def test_float16_sdxl_estimates_its_float32_decode():
    """SDXL's VAE asks to decode in float32 when the pipeline runs in float16 (force_upcast;
    bfloat16 is left alone): the estimate adds its weights and feature maps at 4 bytes each."""
    from npu_attn.tools.pipelines import ARCHITECTURES, estimated_memory_bytes, vae_summary

    vae_params, force_upcast = vae_summary("sdxl")
    assert force_upcast and vae_params > 80_000_000  # SDXL's VAE: 83.7M parameters
    bfloat16 = estimated_memory_bytes("sdxl", 1024, "bfloat16")
    float16 = estimated_memory_bytes("sdxl", 1024, "float16")
    decoder_elements = ARCHITECTURES["sdxl"][3][0] * 1024 * 1024 * 4
    assert float16 - bfloat16 == 2 * vae_params + 2 * decoder_elements
    # SD-1.5's pipeline decodes in its own dtype
    assert not vae_summary("sd15")[1]
    assert estimated_memory_bytes("sd15", 512, "float16") == estimated_memory_bytes(
        "sd15", 512, "bfloat16"
    )


@pytest.mark.parametrize(
    ("model", "decoder_dtype"), [("tiny-sdxl", "float32"), ("tiny", "float16")]
)
def test_float16_pipelines_decode_in_the_dtype_the_estimate_assumes(model, decoder_dtype):
    """The real diffusers pipelines in float16, with our architectures' VAEs: SDXL's runs its
    decoder in float32, SD-1.5's in float16 (both VAEs set force_upcast)."""
    from npu_attn.tools.pipelines import (
        FAMILIES,
        build_pipeline,
        decodes_in_float32,
        fit_size,
        prompt_embeddings,
    )

    pipe = build_pipeline(model).to(torch.float16)
    assert decodes_in_float32(FAMILIES[model], pipe.vae.config) == (decoder_dtype == "float32")
    fit_size(pipe, 32)
    seen = []
    pipe.vae.decoder.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    pipe(
        **prompt_embeddings(pipe, torch.float16, "cpu"),
        num_inference_steps=1,
        height=32,
        width=32,
        output_type="np",
    )
    assert seen == [getattr(torch, decoder_dtype)]
