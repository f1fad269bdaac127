"""The processes test_parallel.py starts: ``python _parallel_workers.py SCENARIO OUT_DIR``, one
per rank, with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK).

Every rank runs the scenario's checks in order and writes ``OUT_DIR/rank<r>.json``: for each
check "ok" or the traceback. Checks compare against the same computation without parallelism,
done by the same process on the full inputs (every rank builds identical tensors and models
from fixed seeds), so the single-process reference and the sharded run see the same numbers.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import npu_attn  # noqa: E402
from npu_attn import parallel  # noqa: E402
from npu_attn.parallel import RankDisagreement  # noqa: E402

CHECKS: dict[str, list[tuple[str, Callable[[], None]]]] = {}


def check(*scenarios: str):
    """Register a check (its function name is its test name) under scenarios."""

    def register(fn):
        for scenario in scenarios:
            CHECKS.setdefault(scenario, []).append((fn.__name__, fn))
        return fn

    return register


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


# --------------------------------------------------------------------------- helpers
def full_inputs(b=2, hq=4, hkv=4, length=16, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, length, d, generator=g)
    k = torch.randn(b, hkv, length, d, generator=g)
    v = torch.randn(b, hkv, length, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def shard_bounds(sizes):
    start = sum(sizes[: rank()])
    return start, start + sizes[rank()]


def shard(t, sizes, dim=2):
    start, stop = shard_bounds(sizes)
    return t.narrow(dim, start, stop - start)


def reference64(q, k, v, mask=None, is_causal=False, enable_gqa=False):
    """torch's math SDPA in float64 (causal folded into the mask, as conftest does)."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        if mask is None:
            mask = causal
        elif mask.dtype == torch.bool:
            mask = mask & causal
        else:
            mask = mask.masked_fill(~causal, float("-inf"))
    out = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=enable_gqa
    )
    return torch.nan_to_num(out)  # fully masked rows: 0, as npu_attn returns them


def max_abs(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def run_both(fn, q, k, v, sizes, mask=None, **kwargs):
    """(sharded output and grads, full single-process output and grads), both for this rank's
    rows; the loss weights are the same fixed random tensor in both. A mask with query rows
    is given to ``fn`` with this rank's rows (and every key)."""
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    full = npu_attn.scaled_dot_product_attention(qf, kf, vf, mask, **kwargs)
    weights = torch.randn(full.shape, generator=torch.Generator().manual_seed(9)).to(q.dtype)
    (full.float() * weights.float()).sum().backward()
    qs, ks, vs = (shard(t, sizes).clone().requires_grad_() for t in (q, k, v))
    local_mask = mask
    if mask is not None and mask.shape[-2] != 1:
        local_mask = shard(mask, sizes, dim=-2)
    out = fn(qs, ks, vs, local_mask, **kwargs)
    (out.float() * shard(weights, sizes).float()).sum().backward()
    sharded = (out, qs.grad, ks.grad, vs.grad)
    reference = tuple(shard(t, sizes) for t in (full, qf.grad, kf.grad, vf.grad))
    return sharded, reference


def assert_close(sharded, reference, tolerance, what):
    for name, a, b in zip(("out", "dq", "dk", "dv"), sharded, reference):
        err = max_abs(a, b)
        assert err <= tolerance, f"{what}: {name} differs by {err:.3g} (> {tolerance})"


def expect(error_type, match, fn):
    """fn() must raise exactly error_type (not a subclass) with `match` in its message."""
    try:
        fn()
    except Exception as error:
        assert type(error) is error_type, f"expected {error_type.__name__}, got {error!r}"
        assert match in str(error), f"expected {match!r} in: {error}"
        return error
    raise AssertionError(f"expected {error_type.__name__} ({match!r}), nothing raised")


METHODS = {"ring": parallel.ring_attention, "ulysses": parallel.ulysses_attention}


# --------------------------------------------------------------------------- attention
def _masks(b, h, length):
    g = torch.Generator().manual_seed(3)
    padding = torch.ones(b, 1, 1, length, dtype=torch.bool)
    padding[1, ..., -5:] = False  # key padding on the second sample (some shards all padded)
    additive = torch.randn(b, h, length, length, generator=g)
    rows = torch.rand(b, 1, length, length, generator=g) > 0.3
    rows[0, 0, 3] = False  # one query row with no key at all: output 0, lse -inf
    return {"none": None, "key padding": padding, "additive": additive, "bool rows": rows}


@check("core")
def ring_and_ulysses_match_single_process_fp32():
    for method, fn in METHODS.items():
        for sizes in ((8, 8), (9, 7)):
            q, k, v = full_inputs(length=sum(sizes))
            for name, mask in _masks(2, 4, sum(sizes)).items():
                for causal in (False, True):
                    sharded, reference = run_both(fn, q, k, v, sizes, mask, is_causal=causal)
                    what = f"{method} sizes={sizes} mask={name} causal={causal}"
                    assert_close(sharded, reference, 2e-5, what)


@check("core")
def ring_and_ulysses_match_single_process_bf16():
    """bfloat16 against float64: within twice the single-process kernel's own error (plus a
    bfloat16 rounding step, since ring partial outputs are rounded before they merge)."""
    for method, fn in METHODS.items():
        q, k, v = full_inputs(length=16, dtype=torch.bfloat16)
        for name, mask in _masks(2, 4, 16).items():
            if mask is not None and mask.dtype != torch.bool:
                mask = mask.to(torch.bfloat16)
            out = fn(*(shard(t, (8, 8)) for t in (q, k, v)), _local_rows(mask))
            single = npu_attn.scaled_dot_product_attention(q, k, v, mask)
            exact = shard(reference64(q, k, v, mask), (8, 8))
            own = max_abs(shard(single, (8, 8)), exact)
            err = max_abs(out, exact)
            assert err <= 2 * own + 2**-7, f"{method} mask={name}: {err:.3g} vs kernel {own:.3g}"
            sharded, reference = run_both(fn, q, k, v, (8, 8), mask)
            assert_close(sharded, reference, 0.1, f"{method} bf16 grads mask={name}")


def _local_rows(mask):
    if mask is None or mask.shape[-2] == 1:
        return mask
    return shard(mask, (8, 8), dim=-2)


def _min_float_masks(b, h, length):
    """Additive masks with torch.finfo(float32).min, the padding value of many pipelines: rows
    it hides in every shard (uniform attention over all keys in one call), rows it hides in the
    first shard only, and a key padding that hides the second shard entirely in one sample."""
    lowest = torch.finfo(torch.float32).min
    rows = torch.zeros(b, h, length, length)
    rows[0, :, 2] = lowest  # every key of this query, on every head
    rows[1, 1, 11] = lowest  # the same on one head of the second shard's rows
    rows[:, 0, 5, : length // 2] = lowest  # the first shard's keys only
    padding = torch.zeros(b, 1, 1, length)
    padding[1, ..., length // 2 :] = lowest
    return {"rows": rows, "rows + padding": rows + padding, "padding": padding}


@check("core")
def min_float_masks_match_single_process():
    """A finfo.min mask rounds the hidden rows' lse to -FLT_MAX in every shard, where their
    key counts are lost: the merge must weigh each shard by its own row sum, not by 1."""
    for method, fn in METHODS.items():
        q, k, v = full_inputs(length=16)
        for name, mask in _min_float_masks(2, 4, 16).items():
            for causal in (False, True):
                sharded, reference = run_both(fn, q, k, v, (8, 8), mask, is_causal=causal)
                what = f"{method} finfo.min mask={name} causal={causal}"
                assert_close(sharded, reference, 2e-5, what)
                exact = shard(reference64(q, k, v, mask, is_causal=causal), (8, 8))
                assert max_abs(sharded[0], exact) <= 2e-5, what


@check("core")
def grouped_query_attention_is_sharded_too():
    q, _, _ = full_inputs(hq=4)
    _, k, v = full_inputs(hkv=2, seed=1)
    for method, fn in METHODS.items():
        sharded, reference = run_both(fn, q, k, v, (8, 8), enable_gqa=True)
        assert_close(sharded, reference, 2e-5, f"{method} gqa")


@check("core")
def ring_returns_the_log_sum_exp_with_its_gradient():
    q, k, v = full_inputs()
    mask = _masks(2, 4, 16)["bool rows"]
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = npu_attn.scaled_dot_product_attention(qf, kf, vf, mask, return_lse=True)
    (out.sum() + 0.5 * torch.nan_to_num(lse, neginf=0.0).sum()).backward()
    qs, ks, vs = (shard(t, (8, 8)).clone().requires_grad_() for t in (q, k, v))
    out_s, lse_s = parallel.ring_attention(qs, ks, vs, shard(mask, (8, 8), -2), return_lse=True)
    (out_s.sum() + 0.5 * torch.nan_to_num(lse_s, neginf=0.0).sum()).backward()
    assert torch.equal(torch.isneginf(lse_s), torch.isneginf(shard(lse, (8, 8))))
    finite = torch.isfinite(lse_s)
    assert max_abs(lse_s[finite], shard(lse, (8, 8))[finite]) <= 1e-5
    grads = (qs.grad, ks.grad, vs.grad)
    full = tuple(shard(t, (8, 8)) for t in (qf.grad, kf.grad, vf.grad))
    assert_close((out_s, *grads), (shard(out, (8, 8)), *full), 2e-5, "ring lse gradient")


@check("core")
def communication_volume_matches_the_scaling_model():
    q, k, v = full_inputs()
    qs, ks, vs = (shard(t, (8, 8)) for t in (q, k, v))
    kv_bytes = (ks.numel() + vs.numel()) * 4
    parallel.reset_comm_stats()
    parallel.ring_attention(qs, ks, vs)
    assert parallel.comm_stats() == {"ring": (world() - 1) * kv_bytes}, parallel.comm_stats()
    parallel.reset_comm_stats()
    parallel.ulysses_attention(qs, ks, vs)
    local = (qs.numel() * 2 + ks.numel() + vs.numel()) * 4  # q, k, v in; output back
    assert parallel.comm_stats() == {"ulysses": local * (world() - 1) // world()}


# --------------------------------------------------------------------------- errors
@check("core")
def bad_calls_raise_on_every_rank_and_the_group_survives():
    q, k, v = full_inputs(hq=3, hkv=3)
    args = tuple(shard(t, (8, 8)) for t in (q, k, v))
    expect(ValueError, "divisible by the world size", lambda: parallel.ulysses_attention(*args))
    # ranks disagreeing on a shape
    d = 16 if rank() == 0 else 8
    q, k, v = full_inputs(d=d)
    args = tuple(shard(t, (8, 8)) for t in (q, k, v))
    expect(RankDisagreement, "head dim", lambda: parallel.ring_attention(*args))
    # one rank's invalid input: its own error there, RankDisagreement on the others
    q, k, v = full_inputs()
    args = [shard(t, (8, 8)) for t in (q, k, v)]
    if rank() == 1:
        args[1] = args[1].double()
        expect(TypeError, "key must have query's dtype", lambda: parallel.ring_attention(*args))
    else:
        expect(RankDisagreement, "rank(s) [1] rejected", lambda: parallel.ring_attention(*args))
    # a mask over the local keys only
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    args = [shard(t, (8, 8)) for t in (q, k, v)]
    expect(ValueError, "full key length", lambda: parallel.ring_attention(*args, mask))
    expect(ValueError, "dropout_p", lambda: parallel.ring_attention(*args, dropout_p=0.1))
    causal_sizes = (9, 7)
    qs = shard(q[:, :, :16], causal_sizes)
    expect(
        ValueError,
        "is_causal needs",
        lambda: parallel.ring_attention(qs, *args[1:], is_causal=True),
    )
    # and the group still works
    out = parallel.ring_attention(*args)
    single = npu_attn.scaled_dot_product_attention(q, k, v)
    assert max_abs(out, shard(single, (8, 8))) <= 2e-5


# --------------------------------------------------------------------------- CFG-parallel
def sd_pipeline():
    from tiny_accel_models import sd15_pipeline

    return sd15_pipeline()


def sd_generate(pipe, guidance=5.0, seed=0):
    from tiny_accel_models import TEXT_DIM

    g = torch.Generator().manual_seed(0)
    return pipe(
        prompt_embeds=torch.randn(1, 7, TEXT_DIM, generator=g),
        negative_prompt_embeds=torch.randn(1, 7, TEXT_DIM, generator=g),
        num_inference_steps=2,
        guidance_scale=guidance,
        height=32,
        width=32,
        output_type="latent",
        generator=torch.Generator().manual_seed(seed),
    ).images


def sd3_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from tiny_models import tiny_sd3, tiny_vae

    pipe = StableDiffusion3Pipeline(
        transformer=tiny_sd3(),
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


def sd3_generate(pipe, seed=0):
    g = torch.Generator().manual_seed(1)
    return pipe(
        prompt_embeds=torch.randn(1, 7, 32, generator=g),
        negative_prompt_embeds=torch.randn(1, 7, 32, generator=g),
        pooled_prompt_embeds=torch.randn(1, 64, generator=g),
        negative_pooled_prompt_embeds=torch.randn(1, 64, generator=g),
        num_inference_steps=2,
        guidance_scale=5.0,
        height=32,
        width=32,
        output_type="latent",
        generator=torch.Generator().manual_seed(seed),
    ).images


def hidream_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline

    from tiny_models import tiny_hidream, tiny_vae

    none = dict.fromkeys(
        [f"{kind}{n}" for kind in ("text_encoder", "tokenizer") for n in ("", "_2", "_3", "_4")]
    )
    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(),
        transformer=tiny_hidream(),
        **none,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def hidream_generate(pipe, seed=0):
    g = torch.Generator().manual_seed(2)
    return pipe(
        prompt_embeds_t5=torch.randn(1, 6, 8, generator=g),
        negative_prompt_embeds_t5=torch.randn(1, 6, 8, generator=g),
        # (Llama layers, batch, tokens, dim): 2 layers, so dim 0 equals the CFG batch of 2
        prompt_embeds_llama3=torch.randn(2, 1, 5, 4, generator=g),
        negative_prompt_embeds_llama3=torch.randn(2, 1, 5, 4, generator=g),
        pooled_prompt_embeds=torch.randn(1, 8, generator=g),
        negative_pooled_prompt_embeds=torch.randn(1, 8, generator=g),
        num_inference_steps=2,
        guidance_scale=5.0,
        height=32,
        width=32,
        output_type="latent",
        generator=torch.Generator().manual_seed(seed),
    ).images


def relative(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _cfg_matches(build, generate, what):
    pipe = build()
    reference = generate(pipe)
    info = parallel.enable_cfg_parallel(pipe)
    assert info["world_size"] == world() and info["rank"] == rank()
    latents = generate(pipe)
    assert parallel.cfg_parallel_of(pipe)["split_calls"] == 2  # one per step
    assert relative(latents, reference) <= 1e-5, f"{what}: {relative(latents, reference):.3g}"
    gathered = [torch.empty_like(latents) for _ in range(world())]
    dist.all_gather(gathered, latents.contiguous())
    assert all(torch.equal(g, latents) for g in gathered), f"{what}: ranks returned different"
    assert parallel.disable_cfg_parallel(pipe)
    assert parallel.cfg_parallel_of(pipe) is None
    assert torch.equal(generate(pipe), reference)


@check("core")
def cfg_parallel_unet_pipeline_matches_single_process():
    _cfg_matches(sd_pipeline, sd_generate, "SD UNet")


@check("core")
def cfg_parallel_sd3_pipeline_matches_single_process():
    _cfg_matches(sd3_pipeline, sd3_generate, "SD3")


@check("core")
def cfg_parallel_hidream_pipeline_matches_single_process():
    _cfg_matches(hidream_pipeline, hidream_generate, "HiDream")


@check("core")
def cfg_parallel_composes_with_an_attention_strategy():
    pipe = sd_pipeline()
    npu_attn.set_attention_strategy(pipe, "tiled")
    reference = sd_generate(pipe)
    parallel.enable_cfg_parallel(pipe)
    npu_attn.reset_call_counts()
    latents = sd_generate(pipe)
    assert npu_attn.call_counts().get("tiled", 0) > 0
    assert relative(latents, reference) <= 1e-5


@check("core")
def cfg_parallel_refuses_mismatched_ranks_and_indivisible_batches():
    pipe = sd_pipeline()
    parallel.enable_cfg_parallel(pipe)
    expect(RankDisagreement, "seeded generator", lambda: sd_generate(pipe, seed=rank()))
    expect(ValueError, "guidance_scale <= 1", lambda: sd_generate(pipe, guidance=1.0))
    reference_pipe = sd_pipeline()
    reference = sd_generate(reference_pipe, guidance=1.0)
    parallel.enable_cfg_parallel(pipe, on_indivisible="replicate")
    assert torch.equal(sd_generate(pipe, guidance=1.0), reference)
    assert parallel.cfg_parallel_of(pipe)["split_calls"] == 0


# --------------------------------------------------------------------------- context parallel
def _families():
    from tiny_models import run_flux, run_hidream, run_sd3, tiny_flux, tiny_hidream, tiny_sd3

    return {
        "sd3": (tiny_sd3, run_sd3),
        "flux": (tiny_flux, run_flux),
        "hidream": (tiny_hidream, run_hidream),
    }


@check("core")
def context_parallel_models_match_single_process():
    """Text lengths 7 (SD3, Flux) and 6 + 5 (HiDream) do not split evenly: uneven shards."""
    for family, (build, run) in _families().items():
        for degrees in ({"ring_degree": 2}, {"ulysses_degree": 2}):
            model = build()
            with torch.no_grad():
                reference = run(model)
                originals = [m.processor for _, m in _processors(model)]
                info = parallel.enable_context_parallel(model, **degrees)
                assert info["ring_degree"] * info["ulysses_degree"] == world()
                out = run(model)
                calls = parallel.context_parallel_of(model)["attention_calls"]
                assert calls == len(originals), (calls, len(originals))
                assert parallel.disable_context_parallel(model)
                assert [m.processor for _, m in _processors(model)] == originals
                again = run(model)
            err = relative(out, reference)
            assert err <= 1e-5, f"{family} {degrees}: relative error {err:.3g}"
            assert torch.equal(again, reference), f"{family}: not restored"


@check("core")
def context_parallel_sd3_pipeline_matches_single_process():
    """Through the pipeline: return_dict=False, a guidance batch of 2, 7 text tokens on 2 ranks."""
    pipe = sd3_pipeline()
    reference = sd3_generate(pipe)
    parallel.enable_context_parallel(pipe, ulysses_degree=2)
    latents = sd3_generate(pipe)
    assert parallel.context_parallel_of(pipe)["model_calls"] == 2
    assert relative(latents, reference) <= 1e-5, relative(latents, reference)


def _processors(model):
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "set_processor")]


def flux_inputs(dtype):
    """run_flux's inputs (tiny_models), in ``dtype``."""
    g = torch.Generator().manual_seed(4)
    return {
        "hidden_states": torch.randn(2, 64, 4, generator=g).to(dtype),
        "encoder_hidden_states": torch.randn(2, 7, 32, generator=g).to(dtype),
        "pooled_projections": torch.randn(2, 32, generator=g).to(dtype),
        "timestep": torch.tensor([0.5, 0.5]).to(dtype),
        "img_ids": torch.randn(64, 3, generator=g),
        "txt_ids": torch.zeros(7, 3),
    }


@check("core")
def context_parallel_bf16_and_over_a_strategy():
    build, _ = _families()["flux"]
    model = build().to(torch.bfloat16)
    npu_attn.set_attention_strategy(model, "tiled")
    wrapped = [m.processor for _, m in _processors(model)]
    with torch.no_grad():
        reference = model(**flux_inputs(torch.bfloat16)).sample.float()
        exact = build()(**flux_inputs(torch.float32)).sample
        parallel.enable_context_parallel(model)
        out = model(**flux_inputs(torch.bfloat16)).sample.float()
        parallel.disable_context_parallel(model)
    assert [m.processor for _, m in _processors(model)] == wrapped
    # bfloat16 rounding of the whole model dominates; sharding adds no more than it does
    assert relative(out, exact) <= 2 * relative(reference, exact) + 1e-3


@check("core")
def context_parallel_ring_trains_a_flux_model():
    """Gradients of the parameters, summed over ranks as data-parallel training would, equal
    the single-process gradients (ring backward through npu_attn's C++ kernel)."""
    build, run = _families()["flux"]
    single, sharded = build(), build()
    run(single).square().mean().backward()
    parallel.enable_context_parallel(sharded)
    run(sharded).square().mean().backward()
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        grad = b.grad if b.grad is not None else torch.zeros_like(b)
        dist.all_reduce(grad)
        reference = a.grad if a.grad is not None else torch.zeros_like(a)
        err = max_abs(grad, reference)
        assert err <= 1e-5 * max(1.0, float(reference.abs().max())), f"{name}: {err:.3g}"


@check("core")
def context_parallel_refuses_mismatched_inputs_and_masks():
    build, run = _families()["sd3"]
    model = build()
    parallel.enable_context_parallel(model)
    g = torch.Generator().manual_seed(rank())
    with torch.no_grad():
        expect(
            RankDisagreement,
            "differ from rank 0's",
            lambda: model(
                hidden_states=torch.randn(2, 4, 16, 16, generator=g),
                encoder_hidden_states=torch.randn(2, 7, 32),
                pooled_projections=torch.randn(2, 64),
                timestep=torch.tensor([1, 2]),
            ),
        )
    build, run = _families()["flux"]
    model = build()
    parallel.enable_context_parallel(model, ulysses_degree=2)
    with torch.no_grad():
        expect(NotImplementedError, "mask over the key sequence", lambda: run(model, masks=True))
    from diffusers import FluxTransformer2DModel

    three_heads = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    expect(
        ValueError,
        "must divide the model's 3 attention heads",
        lambda: parallel.enable_context_parallel(three_heads, ulysses_degree=2),
    )


# --------------------------------------------------------------------------- four ranks
@check("unified")
def unified_ring_and_ulysses_attention_matches_single_process():
    """2 x 2 ranks: all-to-all over heads inside each Ulysses pair, a ring across the pairs."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    ring = functools.partial(parallel.ring_attention, group=mesh["ring"].get_group())

    def unified(q, k, v, mask=None, **kwargs):
        group = mesh["ulysses"].get_group()
        return parallel.ulysses_attention(q, k, v, mask, group=group, attend=ring, **kwargs)

    sizes = (5, 4, 4, 3)
    q, k, v = full_inputs(length=sum(sizes))
    for name, mask in _masks(2, 4, sum(sizes)).items():
        for causal in (False, True):
            sharded, reference = run_both(unified, q, k, v, sizes, mask, is_causal=causal)
            assert_close(sharded, reference, 2e-5, f"unified mask={name} causal={causal}")


@check("unified")
def unified_context_parallel_sd3_matches_single_process():
    from tiny_models import tiny_sd3

    model = tiny_sd3()
    g = torch.Generator().manual_seed(3)
    inputs = {
        "hidden_states": torch.randn(2, 4, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=g),
        "pooled_projections": torch.randn(2, 64, generator=g),
        "timestep": torch.tensor([1, 2]),
    }
    with torch.no_grad():
        reference = model(**inputs).sample
        parallel.enable_context_parallel(model, ring_degree=2, ulysses_degree=2)
        out = model(**inputs).sample
        odd = {**inputs, "encoder_hidden_states": inputs["encoder_hidden_states"][:, :7]}
        expect(ValueError, "7 text tokens do not split evenly over 4", lambda: model(**odd))
    assert relative(out, reference) <= 1e-5, relative(out, reference)


# --------------------------------------------------------------------------- failure
@check("crash")
def a_dead_peer_raises_instead_of_hanging():
    q, k, v = full_inputs()
    args = [shard(t, (8, 8)) for t in (q, k, v)]
    if rank() == 1:
        os._exit(3)  # dies without a word, before the collective
    start = time.monotonic()
    try:
        parallel.ring_attention(*args)
    except RuntimeError as error:
        elapsed = time.monotonic() - start
        assert elapsed < 30, f"raised only after {elapsed:.0f} s: {error}"
        return
    raise AssertionError("ring_attention returned although its peer is dead")


# --------------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    scenario, out_dir = argv[0], Path(argv[1])
    warnings.simplefilter("ignore")  # third-party deprecation chatter; results go to JSON
    torch.set_num_threads(1)
    parallel.init_distributed(timeout=float(os.environ.get("WORKER_TIMEOUT", "60")))
    results = {}
    for name, fn in CHECKS[scenario]:
        torch.manual_seed(0)
        try:
            fn()
            results[name] = "ok"
        except BaseException:  # the report names every failure; the next check still runs
            results[name] = traceback.format_exc()
        (out_dir / f"rank{rank()}.json").write_text(json.dumps(results, indent=1))
    parallel.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
