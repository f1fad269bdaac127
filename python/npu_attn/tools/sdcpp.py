"""stable-diffusion.cpp as a competitor of the per-image benchmark (``bench --e2e --images N
--sdcpp f32,q8_0``): the CPU-native engine many users without a GPU run instead of diffusers.

stable-diffusion.cpp (ggml) is driven through its Python binding, ``stable-diffusion-cpp-python``,
which builds the C++ engine from source for the CPU it is installed on (``pip install
stable-diffusion-cpp-python==0.4.7``: a few minutes; a bench extra, never a run-time
dependency). It loads the *same* random-weight pipeline the other configurations time, written
as a diffusers folder (its ``unet/``, ``vae/`` and ``text_encoder/`` safetensors), so both run
the same network at the same size and number of steps, with classifier-free guidance.

What differs, and how the report says so:

- Prompts: diffusers' configurations take precomputed embeddings; stable-diffusion.cpp encodes
  its prompts with its own CLIP tokenizer and the folder's text encoder (random weights with
  SD-1.5's text-tower shapes, built here: the benchmark's pipelines carry none), about 0.5 s of
  its time per image on a 2-core Zen 3.
- Sampler and noise: it samples with its own Euler (one guided model call per step, as DDIM)
  and its own random numbers, so its images are not comparable pixel for pixel: the report
  gives no PSNR for them.
- Weight types: ``f32`` keeps the weights exact; ``f16`` and ``q8_0`` (8-bit blocks) are the
  types its users pick for speed and are lossy: reported as not exact. A ``+fa`` suffix turns on
  its flash attention (``--diffusion-fa``), which rounds K and V to float16: lossy too. On a
  2-core Zen 3 it cut a 512x512 SD-1.5 step from 36 s to 24 s (f32 weights).

Only SD-1.5-shaped pipelines (``sd15``): stable-diffusion.cpp recognises a model by its tensor
names and shapes, and SD-2.1 and SDXL would need their own text towers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

PACKAGE = "stable-diffusion-cpp-python==0.4.7"
# Weight type -> whether the network's weights stay exact in it.
WEIGHT_TYPES = {"f32": True, "f16": False, "q8_0": False}
# SD-1.5's text encoder (CLIP ViT-L/14's text tower), which stable-diffusion.cpp recognises by
# its 768-wide token embedding.
SD15_TEXT_ENCODER = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
}
PROMPT = "a photograph of an astronaut riding a horse"


def unavailable_reason() -> Optional[str]:
    """Why stable-diffusion.cpp cannot run here (not installed), or None."""
    try:
        import stable_diffusion_cpp  # noqa: F401
    except ImportError:
        return f"stable-diffusion.cpp is not installed (pip install {PACKAGE}; builds from source)"
    return None


FLASH_SUFFIX = "+fa"


def parse_weight_types(text: str) -> tuple[str, ...]:
    """``"f32,q8_0+fa"`` -> ("f32", "q8_0+fa"): weight types, each optionally with its flash
    attention; ValueError naming the valid ones."""
    types = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in types if t.removesuffix(FLASH_SUFFIX) not in WEIGHT_TYPES]
    if not types or unknown:
        raise ValueError(
            f"--sdcpp takes weight types from {', '.join(WEIGHT_TYPES)} (comma-separated, each "
            f"optionally with {FLASH_SUFFIX} for its flash attention), got {text!r}"
        )
    return types


def label_of(spec: str) -> str:
    """The report's label of a ``parse_weight_types`` item, saying whether it is exact."""
    weight_type = spec.removesuffix(FLASH_SUFFIX)
    flash = spec.endswith(FLASH_SUFFIX)
    lossy = [] if WEIGHT_TYPES[weight_type] else [f"{weight_type} weights"]
    lossy += ["float16 K/V"] if flash else []
    name = f"stable-diffusion.cpp {weight_type}" + (" + flash attention" if flash else "")
    return f"{name} ({'lossy: ' + ', '.join(lossy) if lossy else 'exact'})"


def check_pipeline(pipe, model: str) -> Optional[str]:
    """Why ``pipe`` cannot be fed to stable-diffusion.cpp, or None."""
    unet = getattr(pipe, "unet", None)
    sd15_like = (
        unet is not None
        and not hasattr(pipe, "text_encoder_2")  # SDXL
        and unet.config.cross_attention_dim == SD15_TEXT_ENCODER["hidden_size"]
    )
    if not sd15_like:
        return f"stable-diffusion.cpp is compared on SD-1.5 pipelines only, not {model}"
    return None


def export_folder(pipe, folder: Path, seed: int = 0) -> Path:
    """Writes ``pipe``'s UNet and VAE as a diffusers folder stable-diffusion.cpp loads, with a
    random-weight SD-1.5 text encoder (its safetensors keys under ``text_model.``, as
    stable-diffusion.cpp's loader and diffusers' checkpoints name them); returns the folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPTextConfig, CLIPTextModel

    folder = Path(folder)
    pipe.unet.save_pretrained(folder / "unet")
    pipe.vae.save_pretrained(folder / "vae")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        encoder = CLIPTextModel(CLIPTextConfig(**SD15_TEXT_ENCODER))
    tensors = {}
    for name, tensor in encoder.state_dict().items():
        key = name if name.startswith("text_model.") else f"text_model.{name}"
        tensors[key] = tensor.detach().float().contiguous()
    (folder / "text_encoder").mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "text_encoder" / "model.safetensors"))
    return folder


@dataclass
class SdCppRunner:
    """One stable-diffusion.cpp model (a weight type) loaded from an exported folder.

    Attributes:
        label: the report's configuration label.
        load_seconds: loading and converting the weights (reported apart, as compile times).
    """

    label: str
    load_seconds: float
    _engine: Any

    @classmethod
    def load(cls, folder: Path, spec: str, threads: int) -> SdCppRunner:
        """Loads ``folder`` (export_folder) as ``spec`` (a parse_weight_types item)."""
        from stable_diffusion_cpp import StableDiffusion

        start = time.perf_counter()
        engine = StableDiffusion(
            model_path=str(folder),
            wtype=spec.removesuffix(FLASH_SUFFIX),
            n_threads=threads,
            diffusion_flash_attn=spec.endswith(FLASH_SUFFIX),
            verbose=False,
        )
        return cls(label_of(spec), time.perf_counter() - start, engine)

    def image(self, steps: int, size: int, seed: int = 0):
        """(seconds, image as float32 (1, 3, size, size) in [0, 1]): one guided image."""
        import numpy as np
        import torch

        start = time.perf_counter()
        images = self._engine.generate_image(
            prompt=PROMPT,
            width=size,
            height=size,
            sample_steps=steps,
            cfg_scale=7.5,
            sample_method="euler",
            seed=seed,
        )
        seconds = time.perf_counter() - start
        if not images:
            raise RuntimeError(f"{self.label} returned no image")
        pixels = torch.from_numpy(np.asarray(images[0].convert("RGB"), dtype=np.float32) / 255.0)
        return seconds, pixels.permute(2, 0, 1).unsqueeze(0)
