"""Token Merging (ToMe) for Stable Diffusion UNets: the tomesd algorithm, attached with hooks.

The algorithm is tomesd's (Bolya & Hoffman, "Token Merging for Fast Stable Diffusion", 2023;
``tomesd`` 0.1.3): in each ``BasicTransformerBlock`` whose resolution qualifies, the image tokens
are split into destinations (one per ``sx x sy`` cell, chosen at random from a seeded generator)
and sources; each source is matched to its most similar destination by cosine similarity of the
block's input tokens, the ``ratio * N`` best-matched sources are averaged into their
destinations before self-attention (and optionally cross-attention and the MLP), and the output
is unmerged by copying each destination's result back to the sources merged into it. The
matching is tomesd's operations in tomesd's order and the merge sums in tomesd's order and dtype,
so the output equals tomesd's bit for bit (tested); merge and unmerge are row gathers instead of
tomesd's per-element gathers and scatters (~3x less overhead per merged block).

Placement. tomesd merges only where the latent is not downsampled (``max_downsample=1``: the
highest-resolution transformer blocks, where attention is most expensive and merging hurts
least). SDXL has no transformer blocks at full resolution, so npu_attn's default
(``max_downsample=None``) means "the highest resolution that has transformer blocks": 1 for
SD-1.5/2.1 (exactly tomesd's default), 2 for SDXL. Pass an int to choose yourself.

Unlike tomesd, which swaps the blocks' classes for a copy of an older diffusers
``BasicTransformerBlock.forward``, npu_attn leaves diffusers' code untouched: a forward
pre-hook on each block computes the merge from the block's input, and hooks on ``attn1`` /
``attn2`` / ``ff`` merge their input and unmerge their output. Nothing else changes (the module
tree, state_dict keys and attention processors stay as they are, so every attention strategy
composes), and :func:`remove_token_merging` removes exactly those hooks.

ToMe is lossy: it is never enabled unless asked for (``ratio=0`` is exact: nothing merges).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..components import StateAttribute, denoiser_of
from .base import Method, ModelFamilyError, TensorStore, options_from

__all__ = [
    "ModelFamilyError",
    "TokenMergingOptions",
    "apply_token_merging",
    "bipartite_soft_matching_random2d",
    "check_token_merging",
    "remove_token_merging",
    "token_merging_of",
]

_STATE = StateAttribute("_npu_attn_token_merging")


Merge = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


# --------------------------------------------------------------------------- options
@dataclass(frozen=True)
class TokenMergingOptions:
    """tomesd's options (same names and meaning), plus ``seed`` for the destination choice.

    Attributes:
        ratio: fraction of a block's tokens removed by merging, in [0, 1) (tomesd caps it at
            ``1 - 1/(sx*sy)``, 0.75 by default; 0.5 or less is recommended).
        max_downsample: merge in blocks whose resolution is downsampled at most this much (1,
            2, 4 or 8); ``None``: the highest resolution that has transformer blocks.
        sx, sy: the destination grid's stride in x and y.
        use_rand: choose each cell's destination at random (else its top-left token); off
            for odd batch sizes, as in tomesd.
        merge_attn, merge_crossattn, merge_mlp: merge before self-attention (recommended),
            cross-attention, the feed-forward (not recommended).
        seed: seeds the destination choice (tomesd forks torch's global RNG instead).
    """

    ratio: float
    max_downsample: Optional[int] = None
    sx: int = 2
    sy: int = 2
    use_rand: bool = True
    merge_attn: bool = True
    merge_crossattn: bool = False
    merge_mlp: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or math.isnan(ratio):
            raise TypeError(f"token_merging ratio must be a number in [0, 1), got {ratio!r}")
        if not 0 <= ratio < 1:
            raise ValueError(f"token_merging ratio must be in [0, 1), got {ratio}")
        for name in ("sx", "sy", "seed"):
            _check_int(name, getattr(self, name), minimum=0 if name == "seed" else 1)
        if self.max_downsample is not None:
            _check_int("max_downsample", self.max_downsample, minimum=1)
        for name in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"token_merging {name} must be True or False")

    @classmethod
    def of(cls, value: Any) -> TokenMergingOptions:
        """Options from a ratio, a mapping of option names, or options."""
        return options_from(cls, value, "token_merging", "ratio")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"token_merging {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"token_merging {name} must be >= {minimum}, got {value}")


# --------------------------------------------------------------------------- the algorithm
def bipartite_soft_matching_random2d(
    metric: torch.Tensor,
    w: int,
    h: int,
    sx: int,
    sy: int,
    r: int,
    no_rand: bool = False,
    generator: Optional[torch.Generator] = None,
    cells: Optional[torch.Tensor] = None,
) -> tuple[Merge, Merge]:
    """tomesd's bipartite soft matching on a ``w x h`` token grid: merge and unmerge functions
    that remove ``r`` tokens from ``[B, N, C]`` tensors (``metric`` decides which).

    One destination per ``sx x sy`` cell (random when ``no_rand`` is False, drawn from
    ``generator``), the rest are sources; sources merge (mean) into their most cosine-similar
    destination, the ``r`` best matches first; unmerge copies each destination back to its
    sources. The matching is tomesd 0.1.3's ``merge.py`` op for op; merging and unmerging give
    tomesd's results bit for bit (tested) with fewer, cheaper operations (:class:`_RowPlan`).
    ``cells``: the random destinations drawn beforehand (:func:`draw_cells`), instead of
    drawing them here from ``generator``.
    """
    batch, tokens, _ = metric.shape
    if not _merges(w, h, sx, sy, r):
        return _identity, _identity
    with torch.no_grad():
        if cells is None and not no_rand:
            cells = draw_cells(w, h, sx, sy, generator, metric.device)
        a_idx, b_idx = _split_indices(w, h, sx, sy, cells, metric.device)
        src_pos, dst_pos = a_idx.view(-1), b_idx.view(-1)
        r = min(src_pos.numel(), r)  # cannot merge more tokens than there are sources
        kept, merged, merged_into = _match(metric, src_pos, dst_pos, r)
        plan = _RowPlan(tokens, src_pos, dst_pos, kept, merged, merged_into, metric.dtype)
    return plan.merge, plan.unmerge


def _match(
    metric: torch.Tensor, src_pos: torch.Tensor, dst_pos: torch.Tensor, r: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tomesd's matching: per batch row, the sources kept and the ``r`` sources merged (indices
    into ``src_pos``, best matches first) and the destination each merged source goes to."""
    metric = metric / metric.norm(dim=-1, keepdim=True)
    a = metric.index_select(1, src_pos)
    b = metric.index_select(1, dst_pos)
    scores = a @ b.transpose(-1, -2)
    node_max, node_idx = scores.max(dim=-1)
    edge_idx = node_max.argsort(dim=-1, descending=True)
    merged = edge_idx[:, :r]
    return edge_idx[:, r:], merged, torch.gather(node_idx, 1, merged)


class _RowPlan:
    """Merge and unmerge as row gathers over ``[B * N, C]``, planned once per block call.

    tomesd gathers and scatters with index tensors expanded over the channels, and its unmerge
    fills a zero tensor with three scatters; CPU kernels walk such indices element by element
    (~20 ms per merged SD-1.5 block at 512px in bf16). Here every token is one contiguous row:
    merging is two row gathers and an ``index_add_`` (the same sums in the same order as
    tomesd's ``scatter_reduce(..., "mean")``, in the input dtype, so the result is bit-identical),
    and unmerging is a single row gather from a precomputed map (~7x faster in all).
    """

    def __init__(
        self,
        tokens: int,
        src_pos: torch.Tensor,
        dst_pos: torch.Tensor,
        kept: torch.Tensor,
        merged: torch.Tensor,
        merged_into: torch.Tensor,
        dtype: torch.dtype,
    ) -> None:
        batch, r = merged.shape
        device = src_pos.device
        num_dst = dst_pos.numel()
        self.batch, self.tokens, self.num_dst = batch, tokens, num_dst
        self.kept_len = kept.shape[1]
        batch_rows = torch.arange(batch, device=device)[:, None]

        def rows_of(positions: torch.Tensor, per_batch: int) -> torch.Tensor:
            return (positions + batch_rows * per_batch).reshape(-1)

        kept_pos, merged_pos = src_pos[kept], src_pos[merged]  # token positions
        self.kept_rows = rows_of(kept_pos, tokens)
        self.merged_rows = rows_of(merged_pos, tokens)
        self.dst_rows = rows_of(dst_pos.expand(batch, num_dst), tokens)
        self.merged_slots = rows_of(merged_into, num_dst)  # rows of the [B * num_dst] means
        # Each mean's count (itself plus its sources), in the tokens' dtype (small integers,
        # exact) as tomesd's scatter_reduce divides.
        # (index_add_, not bincount: bincount's output shape depends on the data, which breaks
        # torch.compile's graph.)
        counts = torch.ones(batch * num_dst, dtype=torch.int64, device=device)
        counts.index_add_(0, self.merged_slots, torch.ones_like(self.merged_slots))
        self.counts = counts.to(dtype)[:, None]
        # Output token p of batch row b is row unmerge_rows[b * N + p] of the merged tensor.
        source = torch.empty(batch, tokens, dtype=torch.int64, device=device)
        arange = torch.arange(tokens, device=device)
        source.scatter_(
            1,
            dst_pos.expand(batch, num_dst),
            (self.kept_len + arange[:num_dst]).expand(batch, num_dst),
        )
        source.scatter_(1, kept_pos, arange[: self.kept_len].expand(batch, self.kept_len))
        source.scatter_(1, merged_pos, self.kept_len + merged_into)
        self.unmerge_rows = rows_of(source, tokens - r)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[-1]
        rows = x.reshape(-1, channels)
        kept = rows.index_select(0, self.kept_rows).view(self.batch, self.kept_len, channels)
        sums = rows.index_select(0, self.dst_rows)
        sums.index_add_(0, self.merged_slots, rows.index_select(0, self.merged_rows))
        means = (sums / self.counts.to(x.dtype)).view(self.batch, self.num_dst, channels)
        return torch.cat([kept, means], dim=1)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[-1]
        rows = x.reshape(-1, channels).index_select(0, self.unmerge_rows)
        return rows.view(self.batch, self.tokens, channels)


def _merges(w: int, h: int, sx: int, sy: int, r: int) -> bool:
    """Whether a merge removes anything: tokens to remove and at least one whole cell (tomesd
    would fail without one)."""
    return r > 0 and w >= sx and h >= sy


def draw_cells(
    w: int, h: int, sx: int, sy: int, generator: Optional[torch.Generator], device: torch.device
) -> torch.Tensor:
    """tomesd's random choice of each whole ``sx x sy`` cell's destination: ``[h // sy, w // sx,
    1]`` indices into the cell, drawn from ``generator``."""
    gen_device = generator.device if generator is not None else "cpu"
    return torch.randint(
        sy * sx, size=(h // sy, w // sx, 1), device=gen_device, generator=generator
    ).to(device)


def _split_indices(
    w: int, h: int, sx: int, sy: int, cells: Optional[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices of the sources and the destinations (one per whole ``sx x sy`` cell;
    ``cells`` chooses it in each, None: the top-left token)."""
    hsy, wsx = h // sy, w // sx
    if cells is None:
        rand_idx = torch.zeros(hsy, wsx, 1, device=device, dtype=torch.int64)
    else:
        rand_idx = cells
    # Destinations are -1, sources 0, so a (stable) argsort lists destinations first.
    cells = torch.zeros(hsy, wsx, sy * sx, device=device, dtype=torch.int64)
    cells.scatter_(dim=2, index=rand_idx, src=-torch.ones_like(rand_idx, dtype=rand_idx.dtype))
    cells = cells.view(hsy, wsx, sy, sx).transpose(1, 2).reshape(hsy * sy, wsx * sx)
    if hsy * sy < h or wsx * sx < w:  # the grid does not divide the image: edges are sources
        grid = torch.zeros(h, w, device=device, dtype=torch.int64)
        grid[: hsy * sy, : wsx * sx] = cells
    else:
        grid = cells
    order = grid.reshape(1, -1, 1).argsort(dim=1)
    num_dst = hsy * wsx
    return order[:, num_dst:, :], order[:, :num_dst, :]


# --------------------------------------------------------------------------- attaching it
class _State:
    """Per-model state: the options, the generator, the latent size, this call's destination
    draws and the hook handles.

    The draws happen in the UNet's pre-hook, outside torch.compile's graphs (dynamo cannot
    trace a torch.Generator: a draw inside a block broke the graph in a loop, and dynamo then
    ran the whole UNet eagerly): one per merging block, in the order the blocks run, so the
    generator advances exactly as tomesd's per-block draws do.
    """

    def __init__(self, options: TokenMergingOptions, max_downsample: int) -> None:
        self.options = options
        self.max_downsample = max_downsample
        self.generator = torch.Generator(device="cpu").manual_seed(options.seed)
        self.size: Optional[tuple[int, int]] = None
        self.handles: list[Any] = []
        self.blocks = 0
        self.block_downsamples: list[Optional[int]] = []  # per hooked block, in call order
        self._draws = TensorStore()  # this call's cells, by block index

    def __setstate__(self, state: dict[str, Any]) -> None:
        # States pickled before the draws moved to the pre-hook: their blocks draw when called.
        self.__dict__.update(state)
        self.__dict__.setdefault("block_downsamples", [])
        if "_draws" not in state:
            self._draws = TensorStore()

    def geometry(self, tokens: int, batch: int) -> Optional[tuple[int, int, int, bool]]:
        """tomesd's ``compute_merge`` geometry for a block input of ``tokens`` tokens: (w, h,
        r, random destinations), None where the block's resolution does not merge."""
        if self.size is None:
            raise RuntimeError("token merging: the UNet's input size is unknown (call the UNet)")
        height, width = self.size
        downsample = int(math.ceil(math.sqrt(height * width // tokens)))
        if downsample > self.max_downsample:
            return None
        w = int(math.ceil(width / downsample))
        h = int(math.ceil(height / downsample))
        r = int(tokens * self.options.ratio)
        # An odd batch cannot hold matching conditional/unconditional halves (tomesd's rule).
        use_rand = self.options.use_rand and batch % 2 == 0
        return w, h, r, use_rand

    def draws(self, geometry: Optional[tuple[int, int, int, bool]]) -> bool:
        """Whether a merge of this geometry draws random destinations (as
        :func:`bipartite_soft_matching_random2d` does)."""
        if geometry is None:
            return False
        w, h, r, use_rand = geometry
        return use_rand and _merges(w, h, self.options.sx, self.options.sy, r)

    def begin_call(self, sample: torch.Tensor) -> None:
        """The latent size, and every merging block's random destinations for this call."""
        height, width = sample.shape[2], sample.shape[3]
        self.size = (height, width)
        draws = self._draws.tensors
        draws.clear()
        for index, downsample in enumerate(self.block_downsamples):
            if downsample is None:  # not found in the UNet's block order: drawn in the block
                continue
            tokens = math.ceil(height / downsample) * math.ceil(width / downsample)
            geometry = self.geometry(tokens, sample.shape[0])
            if self.draws(geometry):
                w, h = geometry[0], geometry[1]
                options = self.options
                draws[index] = draw_cells(
                    w, h, options.sx, options.sy, self.generator, sample.device
                )

    def merge_functions(self, x: torch.Tensor, index: Optional[int]) -> tuple[Merge, Merge]:
        """tomesd's ``compute_merge``: merge/unmerge for hooked block ``index``'s input ``x``."""
        geometry = self.geometry(x.shape[1], x.shape[0])
        if geometry is None:
            return _identity, _identity
        w, h, r, use_rand = geometry
        sx, sy = self.options.sx, self.options.sy
        cells = self._draws.tensors.get(index) if use_rand else None
        if cells is not None and tuple(cells.shape[:2]) != (h // sy, w // sx):
            cells = None  # not the geometry foreseen: drawn now
        return bipartite_soft_matching_random2d(
            x, w, h, sx, sy, r, no_rand=not use_rand, generator=self.generator, cells=cells
        )


def _first_arg(args: tuple, kwargs: dict, name: str) -> torch.Tensor:
    return args[0] if args else kwargs[name]


def _replace_first_arg(args: tuple, kwargs: dict, name: str, value: torch.Tensor):
    if args:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, name: value}


# The hooks are small module-level classes rather than closures, so that a UNet carrying them
# pickles and deep-copies (the restored UNet merges exactly like the original: the generator's
# state travels with it).
class _Slot:
    """One block's merge/unmerge functions, alive for one call of the block (never pickled:
    they are per call and close over that call's indices)."""

    def __init__(self) -> None:
        self.merge: Merge = _identity
        self.unmerge: Merge = _identity

    def clear(self) -> None:
        self.merge = self.unmerge = _identity

    def __reduce__(self):
        return (_Slot, ())  # a copy starts empty


class _BeginCall:
    """The UNet's pre-hook: the latent size, which tells each block its downsampling, and the
    call's random draws (eager: see :class:`_State`)."""

    def __init__(self, state: _State) -> None:
        self.state = state

    @torch.compiler.disable
    def __call__(self, _unet, args, kwargs):
        self.state.begin_call(_first_arg(args, kwargs, "sample"))


class _RememberSize(_BeginCall):
    """The pre-hook's name in models pickled before the draws moved into it."""


class _ComputeMerge:
    """A block's pre-hook: merge/unmerge functions from the block's input."""

    index: Optional[int] = None  # hooks pickled before blocks had an index draw when called

    def __init__(self, state: _State, slot: _Slot, index: int) -> None:
        self.state = state
        self.slot = slot
        self.index = index

    def __call__(self, _block, args, kwargs):
        x = _first_arg(args, kwargs, "hidden_states")
        self.slot.merge, self.slot.unmerge = self.state.merge_functions(x, self.index)


class _Forget:
    """A block's hook: drop the per-call functions (do not keep their index tensors alive)."""

    def __init__(self, slot: _Slot) -> None:
        self.slot = slot

    def __call__(self, _block, _args, _output):
        self.slot.clear()


class _MergeInput:
    def __init__(self, slot: _Slot) -> None:
        self.slot = slot

    def __call__(self, _module, args, kwargs):
        x = _first_arg(args, kwargs, "hidden_states")
        return _replace_first_arg(args, kwargs, "hidden_states", self.slot.merge(x))


class _UnmergeOutput:
    def __init__(self, slot: _Slot) -> None:
        self.slot = slot

    def __call__(self, _module, _args, output):
        return self.slot.unmerge(output)


def _hook_merge_around(module: torch.nn.Module, slot: _Slot, state: _State) -> None:
    """Merge ``module``'s first input and unmerge its output with the block's functions."""
    state.handles.append(module.register_forward_pre_hook(_MergeInput(slot), with_kwargs=True))
    state.handles.append(module.register_forward_hook(_UnmergeOutput(slot)))


def _hook_block(block: torch.nn.Module, state: _State, index: int) -> None:
    options = state.options
    if options.merge_mlp and getattr(block, "_chunk_size", None) is not None:
        raise ValueError(
            "token_merging merge_mlp cannot be combined with feed-forward chunking "
            "(enable_forward_chunking); disable one of them"
        )
    slot = _Slot()
    state.handles.append(
        block.register_forward_pre_hook(_ComputeMerge(state, slot, index), with_kwargs=True)
    )
    state.handles.append(block.register_forward_hook(_Forget(slot)))
    targets = [
        (options.merge_attn, block.attn1),
        (options.merge_crossattn, getattr(block, "attn2", None)),
        (options.merge_mlp, block.ff),
    ]
    for enabled, module in targets:
        if enabled and module is not None:
            _hook_merge_around(module, slot, state)


def _unet_of(target: Any) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    unet = denoiser_of(target, ("unet",), required=False)
    if not isinstance(unet, UNet2DConditionModel):
        raise ModelFamilyError(
            "token_merging applies to UNet models (SD-1.5/2.1, SDXL: UNet2DConditionModel), "
            f"not to {type(unet if unet is not None else target).__name__}"
        )
    return unet


def _highest_attention_downsample(unet: torch.nn.Module) -> int:
    """The downsampling of the highest-resolution down block that has transformer blocks."""
    for index, block in enumerate(unet.down_blocks):
        if getattr(block, "attentions", None):
            return 2**index
    raise ModelFamilyError(
        f"token_merging applies to UNets with transformer blocks; {type(unet).__name__} has none"
    )


def _transformer_blocks(unet: torch.nn.Module) -> list[tuple[torch.nn.Module, Optional[int]]]:
    """Every transformer block with its downsampling, in the order the UNet calls them (down
    blocks, mid block, up blocks; None for blocks outside those, which draw when called)."""
    from diffusers.models.attention import BasicTransformerBlock

    def blocks_in(module: torch.nn.Module) -> list[torch.nn.Module]:
        return [m for m in module.modules() if isinstance(m, BasicTransformerBlock)]

    ordered: list[tuple[torch.nn.Module, Optional[int]]] = []
    downsample = 1
    for block in unet.down_blocks:
        ordered += [(b, downsample) for b in blocks_in(block)]
        downsample *= 2 if getattr(block, "downsamplers", None) else 1
    if unet.mid_block is not None:
        ordered += [(b, downsample) for b in blocks_in(unet.mid_block)]
    for block in unet.up_blocks:
        ordered += [(b, downsample) for b in blocks_in(block)]
        downsample //= 2 if getattr(block, "upsamplers", None) else 1
    seen = {id(b) for b, _ in ordered}
    return ordered + [(b, None) for b in blocks_in(unet) if id(b) not in seen]


def check_token_merging(target: Any, options: Any) -> TokenMergingOptions:
    """Validate ``options`` for ``target`` without changing anything (raises as
    :func:`apply_token_merging` would)."""
    options = TokenMergingOptions.of(options)
    unet = _unet_of(target)
    if options.max_downsample is None:
        _highest_attention_downsample(unet)
    return options


def apply_token_merging(target: Any, options: Any) -> dict[str, Any]:
    """Attach Token Merging to a pipeline's UNet (or a UNet); replaces an earlier setting.

    Args:
        target: a diffusers pipeline with a ``unet`` or a ``UNet2DConditionModel``.
        options: a ratio in [0, 1), a dict of :class:`TokenMergingOptions` fields, or options.

    Returns:
        The options applied (``max_downsample`` resolved) and ``blocks``: the number of
        transformer blocks hooked (merging happens in those at a qualifying resolution).

    Raises:
        ValueError, TypeError: a bad option, or a model that is not a UNet.
    """
    options = check_token_merging(target, options)
    unet = _unet_of(target)
    blocks = _transformer_blocks(unet)
    max_downsample = options.max_downsample or _highest_attention_downsample(unet)
    remove_token_merging(unet)
    state = _State(options, max_downsample)
    state.handles.append(unet.register_forward_pre_hook(_BeginCall(state), with_kwargs=True))
    try:
        for index, (block, downsample) in enumerate(blocks):
            _hook_block(block, state, index)
            state.block_downsamples.append(downsample)
    except Exception:
        _remove_handles(state)
        raise
    state.blocks = len(blocks)
    _STATE.set(unet, state)
    return token_merging_of(unet)


def _remove_handles(state: _State) -> None:
    for handle in state.handles:
        handle.remove()
    state.handles.clear()


def remove_token_merging(target: Any) -> bool:
    """Remove Token Merging's hooks; returns whether there were any."""
    return _STATE.remove(_unet_of(target), _remove_handles)


def token_merging_of(target: Any) -> Optional[dict[str, Any]]:
    """The Token Merging settings of a pipeline's UNet or a UNet, or None when off."""
    state = _STATE.get(denoiser_of(target, ("unet",), required=False))
    if state is None:
        return None
    applied = dataclasses.asdict(state.options)
    applied["max_downsample"] = state.max_downsample
    applied["blocks"] = state.blocks
    return applied


METHOD = Method(
    name="token_merging",
    variable="NPU_ATTN_TOME",
    parse=float,
    expected="a token-merging ratio in [0, 1)",
    check=check_token_merging,
    apply=apply_token_merging,
    remove=remove_token_merging,
    settings_of=token_merging_of,
)
