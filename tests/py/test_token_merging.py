"""Token Merging: tomesd's algorithm on SD-1.5 and SDXL UNets (tiny, real block structure).

The reference is tomesd 0.1.3 itself (a test-only dependency), which still runs unchanged on
diffusers 0.42.1 (it patches ``BasicTransformerBlock``; the blocks of these configurations take
its code path). Both sides draw the destination choice from a generator seeded the same way, so
the outputs must be *equal*, not merely close.
"""

from __future__ import annotations

import pytest
import torch

from npu_attn.accel.token_merging import (
    TokenMergingOptions,
    apply_token_merging,
    remove_token_merging,
    token_merging_of,
)
from tiny_accel_models import run, tiny_sd15_unet, tiny_sdxl_unet, unet_call_args
from tiny_models import tiny_flux, tiny_vae

try:
    import tomesd
except ImportError:  # the reference comparisons skip; the rest still runs
    tomesd = None
needs_tomesd = pytest.mark.skipif(
    tomesd is None,
    reason="tomesd (test-only reference: pip install --no-deps tomesd==0.1.3) missing",
)

SEED = 7


def run_tomesd(unet, calls: int = 1, dtype=torch.float32, batch: int = 2, **options):
    """tomesd's outputs for ``calls`` consecutive UNet calls, its generator seeded like ours."""
    tomesd.apply_patch(unet, **options)
    unet._tome_info["args"]["generator"] = torch.Generator().manual_seed(SEED)
    try:
        with torch.no_grad():
            return [run(unet, dtype, batch=batch) for _ in range(calls)]
    finally:
        tomesd.remove_patch(unet)


def run_ours(unet, calls: int = 1, dtype=torch.float32, batch: int = 2, **options):
    apply_token_merging(unet, {**options, "seed": SEED})
    try:
        with torch.no_grad():
            return [run(unet, dtype, batch=batch) for _ in range(calls)]
    finally:
        remove_token_merging(unet)


TOMESD_OPTIONS = [
    {"ratio": 0.5},  # tomesd's defaults: self-attention only, highest resolution
    {"ratio": 0.3, "merge_crossattn": True, "merge_mlp": True},
    {"ratio": 0.6, "max_downsample": 2, "use_rand": False},
    {"ratio": 0.75, "max_downsample": 4, "sx": 3, "sy": 2},  # 3 divides no token grid
]


@needs_tomesd
@pytest.mark.parametrize("options", TOMESD_OPTIONS, ids=str)
def test_sd15_equals_tomesd(options):
    unet = tiny_sd15_unet()
    with torch.no_grad():
        plain = run(unet)
    ours = run_ours(unet, calls=2, **options)
    reference = run_tomesd(
        unet,
        calls=2,
        max_downsample=options.get("max_downsample", 1),
        **{k: v for k, v in options.items() if k != "max_downsample"},
    )
    for mine, theirs in zip(ours, reference):  # the second call draws new destinations
        assert torch.equal(mine, theirs), float((mine - theirs).abs().max())
    assert float((ours[0] - plain).abs().max()) > 1e-3  # tokens really merged


@needs_tomesd
def test_odd_batch_uses_top_left_destinations_like_tomesd():
    unet = tiny_sd15_unet()
    ours = run_ours(unet, ratio=0.5, batch=1)
    assert torch.equal(ours[0], run_tomesd(unet, ratio=0.5, batch=1)[0])


@needs_tomesd
def test_bfloat16_equals_tomesd():
    unet = tiny_sd15_unet().to(torch.bfloat16)
    ours = run_ours(unet, dtype=torch.bfloat16, ratio=0.5)[0]
    assert torch.equal(ours, run_tomesd(unet, dtype=torch.bfloat16, ratio=0.5)[0])


@needs_tomesd
def test_sdxl_merges_at_its_highest_attention_resolution_and_equals_tomesd_there():
    unet = tiny_sdxl_unet()
    applied = apply_token_merging(unet, 0.5)
    assert applied["max_downsample"] == 2  # SDXL has no attention at full resolution
    remove_token_merging(unet)
    with torch.no_grad():
        plain = run(unet)
    ours = run_ours(unet, ratio=0.5)[0]
    assert float((ours - plain).abs().max()) > 1e-3
    # tomesd's default (max_downsample=1) does nothing on SDXL; at 2 it is the same algorithm.
    assert torch.equal(run_tomesd(unet, ratio=0.5)[0], plain)
    assert torch.equal(ours, run_tomesd(unet, ratio=0.5, max_downsample=2)[0])


@pytest.mark.parametrize("make", [tiny_sd15_unet, tiny_sdxl_unet], ids=["sd15", "sdxl"])
def test_ratio_zero_is_bit_identical_and_reset_restores_everything(make):
    unet = make()
    hooks_before = _hook_counts(unet)
    keys_before = list(unet.state_dict())
    with torch.no_grad():
        plain = run(unet)
        apply_token_merging(unet, {"ratio": 0.0, "merge_crossattn": True, "merge_mlp": True})
        assert torch.equal(run(unet), plain)
        apply_token_merging(unet, 0.5)  # replaces the earlier setting
        assert not torch.equal(run(unet), plain)
        assert list(unet.state_dict()) == keys_before  # the module tree is untouched
        assert remove_token_merging(unet) is True
        assert torch.equal(run(unet), plain)
    assert _hook_counts(unet) == hooks_before
    assert token_merging_of(unet) is None
    assert remove_token_merging(unet) is False


def _hook_counts(model):
    return [
        (len(m._forward_pre_hooks), len(m._forward_hooks), type(m).forward is m.forward.__func__)
        for m in model.modules()
    ]


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_runs_under_no_grad_and_inference_mode(context):
    unet = tiny_sd15_unet()
    expected = run_ours(unet, ratio=0.5)[0]
    apply_token_merging(unet, {"ratio": 0.5, "seed": SEED})
    with context():
        assert torch.equal(run(unet), expected)


def test_keyword_sample_and_gradients_work():
    unet = tiny_sd15_unet()
    apply_token_merging(unet, 0.5)
    args, kwargs = unet_call_args(unet)
    out = unet(sample=args[0], timestep=args[1], **kwargs).sample  # keywords, with autograd
    out.square().mean().backward()
    assert unet.conv_in.weight.grad is not None


def test_the_same_seed_gives_the_same_output_and_another_seed_differs():
    unet = tiny_sd15_unet()
    first = run_ours(unet, ratio=0.5)[0]
    assert torch.equal(run_ours(unet, ratio=0.5)[0], first)
    apply_token_merging(unet, {"ratio": 0.5, "seed": SEED + 1})
    with torch.no_grad():
        assert not torch.equal(run(unet), first)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (1.0, ValueError, r"ratio must be in \[0, 1\), got 1.0"),
        (-0.1, ValueError, r"ratio must be in \[0, 1\)"),
        ("0.5", TypeError, "ratio must be a number"),
        (True, TypeError, "ratio must be a number"),
        (float("nan"), TypeError, "ratio must be a number"),
        ({"ratio": 0.5, "speed": 2}, TypeError, r"unknown options \['speed'\]"),
        ({"sx": 2}, TypeError, "need a 'ratio'"),
        ({"ratio": 0.5, "sx": 0}, ValueError, "sx must be >= 1"),
        ({"ratio": 0.5, "max_downsample": 1.5}, TypeError, "max_downsample must be an int"),
        ({"ratio": 0.5, "merge_mlp": 1}, TypeError, "merge_mlp must be True or False"),
    ],
)
def test_bad_options_raise(value, error, match):
    with pytest.raises(error, match=match):
        TokenMergingOptions.of(value)


@pytest.mark.parametrize("make", [tiny_flux, tiny_vae], ids=["flux", "vae"])
def test_other_model_families_are_refused(make):
    with pytest.raises(ValueError, match="token_merging applies to UNet models"):
        apply_token_merging(make(), 0.5)


def test_mlp_merging_refuses_feed_forward_chunking():
    unet = tiny_sd15_unet()
    from diffusers.models.attention import BasicTransformerBlock

    for block in unet.modules():
        if isinstance(block, BasicTransformerBlock):
            block.set_chunk_feed_forward(1, dim=1)  # what the pipelines' chunking option does
    with pytest.raises(ValueError, match="merge_mlp cannot be combined with feed-forward"):
        apply_token_merging(unet, {"ratio": 0.5, "merge_mlp": True})
    assert _hook_counts(unet) == _hook_counts(tiny_sd15_unet())  # nothing left behind
