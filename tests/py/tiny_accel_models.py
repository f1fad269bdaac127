"""Tiny UNets and pipelines with the block structure of SD-1.5 and SDXL, and tiny SD3 and
HiDream pipelines (random weights, no downloads) for the Token Merging, DeepCache and block
cache tests: where transformer blocks sit decides where tokens merge and which branch or blocks
a cache skips, so the structure, not the size, must be real."""

from __future__ import annotations

import torch
from diffusers import (
    DDIMScheduler,
    FlowMatchEulerDiscreteScheduler,
    HiDreamImagePipeline,
    HiDreamImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)

from tiny_models import tiny_hidream, tiny_sd3, tiny_vae

TEXT_DIM = 8  # cross-attention (prompt embedding) width
POOLED_DIM = 8  # SDXL pooled text embedding width
TIME_EMBED_DIM = 4  # SDXL addition_time_embed_dim (6 time ids)


def tiny_sd15_unet() -> UNet2DConditionModel:
    """SD-1.5's layout: 3 cross-attention down blocks (the first at full resolution), 2 layers
    per block, a cross-attention mid block, mirrored up blocks."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=16,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=TEXT_DIM,
        attention_head_dim=2,
        norm_num_groups=4,
    ).eval()


def tiny_sdxl_unet() -> UNet2DConditionModel:
    """SDXL's layout: no attention at full resolution, transformer depth growing with depth,
    linear projections, and the added text/time conditions."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=16,
        block_out_channels=(8, 16, 16),
        layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 1, 2),
        attention_head_dim=(2, 4, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=6 * TIME_EMBED_DIM + POOLED_DIM,
        cross_attention_dim=TEXT_DIM,
        norm_num_groups=4,
    ).eval()


def unet_call_args(unet: UNet2DConditionModel, batch: int = 2, size: int = 16, seed: int = 1):
    """Positional (sample, timestep) and keyword arguments for one UNet call, as pipelines
    pass them (tomesd reads the sample positionally)."""
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, 4, size, size, generator=g)
    kwargs = {"encoder_hidden_states": torch.randn(batch, 7, TEXT_DIM, generator=g)}
    if unet.config.addition_embed_type == "text_time":
        kwargs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(batch, POOLED_DIM, generator=g),
            "time_ids": torch.tensor([[size * 2, size * 2, 0, 0, size * 2, size * 2]] * batch),
        }
    return (sample, torch.tensor(10)), kwargs


def run(unet: UNet2DConditionModel, dtype=torch.float32, **options) -> torch.Tensor:
    args, kwargs = unet_call_args(unet, **options)
    args = (args[0].to(dtype), args[1])
    kwargs["encoder_hidden_states"] = kwargs["encoder_hidden_states"].to(dtype)
    if "added_cond_kwargs" in kwargs:
        cond = kwargs["added_cond_kwargs"]
        cond["text_embeds"] = cond["text_embeds"].to(dtype)
    return unet(*args, **kwargs).sample


def sd15_pipeline() -> StableDiffusionPipeline:
    pipe = StableDiffusionPipeline(
        vae=tiny_vae(),
        text_encoder=None,
        tokenizer=None,
        unet=tiny_sd15_unet(),
        scheduler=DDIMScheduler(num_train_timesteps=1000),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sdxl_pipeline() -> StableDiffusionXLPipeline:
    pipe = StableDiffusionXLPipeline(
        vae=tiny_vae(),
        text_encoder=None,
        text_encoder_2=None,
        tokenizer=None,
        tokenizer_2=None,
        unet=tiny_sdxl_unet(),
        scheduler=DDIMScheduler(num_train_timesteps=1000),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, steps: int = 4, size: int = 32, seed: int = 0) -> torch.Tensor:
    """Latents of a short CFG generation (fixed prompt embeddings; ``seed`` draws the noise)."""
    g = torch.Generator().manual_seed(0)
    kwargs = {
        "prompt_embeds": torch.randn(1, 7, TEXT_DIM, generator=g),
        "negative_prompt_embeds": torch.randn(1, 7, TEXT_DIM, generator=g),
    }
    if isinstance(pipe, StableDiffusionXLPipeline):
        kwargs["pooled_prompt_embeds"] = torch.randn(1, POOLED_DIM, generator=g)
        kwargs["negative_pooled_prompt_embeds"] = torch.randn(1, POOLED_DIM, generator=g)
    return pipe(
        **kwargs,
        num_inference_steps=steps,
        guidance_scale=5.0,
        height=size,
        width=size,
        output_type="latent",
        generator=torch.Generator().manual_seed(seed),
    ).images


# --------------------------------------------------------------------------- transformers
SD3_TEXT_DIM = 32
SD3_POOLED_DIM = 64


def tiny_sd3_transformer(layers: int = 3) -> SD3Transformer2DModel:
    """SD3's MMDiT: joint blocks, the last one context_pre_only (it returns no text stream)."""
    return tiny_sd3(layers)


def tiny_hidream_transformer() -> HiDreamImageTransformer2DModel:
    """HiDream: 2 double-stream and 2 single-stream blocks."""
    return tiny_hidream(2)


def sd3_pipeline(layers: int = 3) -> StableDiffusion3Pipeline:
    pipe = StableDiffusion3Pipeline(
        transformer=tiny_sd3_transformer(layers),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def hidream_pipeline() -> HiDreamImagePipeline:
    pipe = HiDreamImagePipeline(
        transformer=tiny_hidream_transformer(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
        text_encoder_4=None,
        tokenizer_4=None,
    )
    # HiDream rescales every request to default_sample_size**2 latent pixels: keep it tiny.
    pipe.default_sample_size = 16
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate_transformer(pipe, steps: int = 8, size: int = 32, **options) -> torch.Tensor:
    """Latents of a short CFG generation of an SD3 or HiDream pipeline (fixed embeddings)."""
    g = torch.Generator().manual_seed(0)
    if isinstance(pipe, HiDreamImagePipeline):
        kwargs = {
            "prompt_embeds_t5": torch.randn(1, 6, 8, generator=g),
            "negative_prompt_embeds_t5": torch.randn(1, 6, 8, generator=g),
            "prompt_embeds_llama3": torch.randn(2, 1, 5, 4, generator=g),
            "negative_prompt_embeds_llama3": torch.randn(2, 1, 5, 4, generator=g),
            "pooled_prompt_embeds": torch.randn(1, 8, generator=g),
            "negative_pooled_prompt_embeds": torch.randn(1, 8, generator=g),
        }
    else:
        kwargs = {
            "prompt_embeds": torch.randn(1, 7, SD3_TEXT_DIM, generator=g),
            "negative_prompt_embeds": torch.randn(1, 7, SD3_TEXT_DIM, generator=g),
            "pooled_prompt_embeds": torch.randn(1, SD3_POOLED_DIM, generator=g),
            "negative_pooled_prompt_embeds": torch.randn(1, SD3_POOLED_DIM, generator=g),
        }
    return pipe(
        **kwargs,
        **options,
        num_inference_steps=steps,
        height=size,
        width=size,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    ).images


def transformer_call(model, timestep: float, seed: int = 0, tokens: int = 16) -> torch.Tensor:
    """One denoiser call at ``timestep`` with fixed inputs (a step loop without a scheduler)."""
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(2, 4, tokens, tokens, generator=g)
    t = torch.tensor([timestep, timestep])
    with torch.no_grad():
        if hasattr(model, "transformer_blocks"):
            return model(
                hidden_states=sample,
                encoder_hidden_states=torch.randn(2, 7, SD3_TEXT_DIM, generator=g),
                pooled_projections=torch.randn(2, SD3_POOLED_DIM, generator=g),
                timestep=t,
            ).sample
        return model(
            hidden_states=sample,
            timesteps=t,
            encoder_hidden_states_t5=torch.randn(2, 6, 8, generator=g),
            encoder_hidden_states_llama3=torch.randn(2, 2, 5, 4, generator=g),
            pooled_embeds=torch.randn(2, 8, generator=g),
        ).sample


def frozen_graph_runs(pipe, strategy: str, run) -> dict:
    """``run()`` twice under graph mode with inductor's freezing on (what ``npu_attn.compile(...,
    freeze=True)`` sets), counting what dynamo compiles: ``first`` graphs after the first run,
    ``total`` after the second, the ``unimplemented`` graph breaks (those that make dynamo run a
    frame eagerly) and the second run's ``output``. Compilation is reset afterwards."""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    import npu_attn

    counter = CompileCounter()
    counters.clear()
    try:
        with torch._inductor.config.patch(freezing=True):
            npu_attn.compile(pipe, strategy, backend=counter, show_progress=False)
            run()
            first = counter.frame_count
            output = run()
    finally:
        npu_attn.reset_compile(pipe)
        torch._dynamo.reset()
    return {
        "first": first,
        "total": counter.frame_count,
        "unimplemented": dict(counters["unimplemented"]),
        "output": output,
    }
