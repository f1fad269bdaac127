"""How many bytes each rank sends per denoising step: the scaling model for N machines.

Notation, per attention layer: B batch, S joint sequence (image + text tokens), H query heads,
Hkv key/value heads, D head dim, e bytes per element, N ranks; E = B S H D e is the size of the
*full* query (and output) tensor, Ekv = B S Hkv D e of the full key (and value) tensor. Each
rank holds S / N tokens. Forward (inference) traffic leaving one rank:

- ring:    (N - 1) key/value shards          = 2 (N - 1) / N   * Ekv   per layer
- Ulysses: all-to-all of q, k, v and output  = (N - 1) / N**2 * (2 E + 2 Ekv)   per layer
- context parallel also gathers the transformer's output once per step: (N - 1) / N of it.
- CFG-parallel: one all_gather of the denoiser output per step: (N - 1) / N of it.

So per rank, ring traffic stays ~2 Ekv per layer however many machines join, while Ulysses
traffic falls as 1/N (at N = 2 they are equal); Ulysses is limited to N dividing the heads.
Backward (training) roughly doubles ring traffic (key/value shards again, plus float32 dK/dV
accumulators) and doubles Ulysses'. The 256-byte agreement header per call is left out.

These are exactly the bytes :func:`~npu_attn.parallel.comm_stats` counts for equal shards.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODEL_SHAPES", "ModelShape", "communication_per_step"]

METHODS = ("ring", "ulysses", "cfg")


@dataclass(frozen=True)
class ModelShape:
    """The attention work of one denoiser call (one step)."""

    name: str
    attention_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int  # joint sequence per attention call
    batch: int  # 2 with classifier-free guidance batched
    output_elements: int  # the denoiser output of one sample

    def tensor_bytes(self, heads: int, element_bytes: int) -> int:
        return self.batch * self.tokens * heads * self.head_dim * element_bytes


# Published configurations at 1024 x 1024 (latents 128 x 128 x 16 for Flux / SD3 / HiDream).
MODEL_SHAPES = {
    # FLUX.1-dev: 19 double + 38 single blocks, 24 heads of 128, 4096 image + 512 T5 tokens;
    # guidance-distilled, one sample per step.
    "flux-dev": ModelShape("FLUX.1-dev 1024px", 57, 24, 24, 128, 4096 + 512, 1, 16 * 128 * 128),
    # HiDream-I1: 16 double + 32 single blocks, 20 heads of 128; 4096 image tokens + 128 T5 +
    # 2 x 128 Llama tokens per block; CFG batch of 2.
    "hidream-i1": ModelShape(
        "HiDream-I1 1024px", 48, 20, 20, 128, 4096 + 3 * 128, 2, 16 * 128 * 128
    ),
    # SD3-medium: 24 joint blocks, 24 heads of 64, 4096 image + 333 text tokens; CFG batch 2.
    "sd3-medium": ModelShape("SD3-medium 1024px", 24, 24, 24, 64, 4096 + 333, 2, 16 * 128 * 128),
}


def communication_per_step(
    model: str | ModelShape, world: int, method: str, *, element_bytes: int = 2
) -> int:
    """Bytes one rank sends per denoising step (forward) with ``method`` ("ring", "ulysses"
    or "cfg") over ``world`` ranks, for a :data:`MODEL_SHAPES` name or a :class:`ModelShape`
    (``element_bytes``: 2 for bfloat16 / float16, 4 for float32)."""
    shape = MODEL_SHAPES[model] if isinstance(model, str) else model
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    n = world
    output = shape.batch * shape.output_elements * element_bytes
    gather = (n - 1) * output // n
    if method == "cfg":
        return gather
    full_q = shape.tensor_bytes(shape.heads, element_bytes)
    full_kv = shape.tensor_bytes(shape.kv_heads, element_bytes)
    if method == "ring":
        per_layer = 2 * (n - 1) * full_kv // n
    else:
        per_layer = (n - 1) * (2 * full_q + 2 * full_kv) // (n * n)
    return shape.attention_layers * per_layer + gather
