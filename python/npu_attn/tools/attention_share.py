"""How much of a denoising step is attention, and what a faster attention kernel should give.

``bench --e2e`` measures whole UNet steps; this module explains them. It records every call
the diffusers default step makes to ``torch.nn.functional.scaled_dot_product_attention``
(shapes, strides, dtype, flags), replays those calls alone with torch's SDPA and with
npu_attn's kernels (``tiled``, and the lossy ``int8``; fresh tensors of the same layouts,
interleaved rounds, medians), and predicts each one's step from the ``sdpa`` step:

    predicted = sdpa step - attention time x (1 - 1 / attention speed-up)

A measured step close to the prediction says the speed-up reaches the step intact;
one slower than predicted says something around the kernel costs time (layout copies,
dispatch, cache effects of a long step on the other operators). :func:`timed_attention_calls`
tells those apart: it times the same calls inside the measured steps, so a miss splits into
the attention calls themselves (slower in the step than replayed alone) and the rest of the
step (slower next to one kernel than next to another).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..runtime.timing import interleaved_medians


@dataclass(frozen=True)
class RecordedCall:
    """One kind of SDPA call: the tensors' shapes and strides, the dtype and the flags."""

    shapes: tuple[tuple[int, ...], ...]  # query, key, value
    strides: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    is_causal: bool
    scale: Optional[float]
    enable_gqa: bool

    def label(self) -> str:
        (b, h, lq, d), (_, hk, lk, _), (_, _, _, dv) = self.shapes
        heads = f"H{h}" if h == hk else f"H{h}/{hk}"
        values = "" if dv == d else f" Dv{dv}"
        return f"B{b} {heads} Lq{lq} Lk{lk} D{d}{values}"


@contextlib.contextmanager
def _sdpa_wrapped(wrap: Callable[[Callable], Callable]):
    """Within the block, ``torch.nn.functional.scaled_dot_product_attention`` is ``wrap`` of
    the function found there (torch's, or npu_attn's routing shim); restored afterwards, also
    on errors."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = wrap(original)
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


def record_attention_calls(step: Callable[[], Any]) -> Counter:
    """The SDPA calls one run of ``step`` makes, counted by kind. Calls with a mask, dropout
    or other than 4-D tensors are left out (the diffusers UNets make none)."""
    calls: Counter = Counter()

    def wrap(original):
        def recording(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
            plain = attn_mask is None and dropout_p == 0.0 and set(kw) <= {"scale", "enable_gqa"}
            if plain and query.dim() == key.dim() == value.dim() == 4:
                tensors = (query, key, value)
                calls[
                    RecordedCall(
                        shapes=tuple(tuple(t.shape) for t in tensors),
                        strides=tuple(t.stride() for t in tensors),
                        dtype=query.dtype,
                        is_causal=bool(is_causal),
                        scale=kw.get("scale"),
                        enable_gqa=bool(kw.get("enable_gqa", False)),
                    )
                ] += 1
            return original(query, key, value, attn_mask, dropout_p, is_causal, **kw)

        return recording

    with _sdpa_wrapped(wrap):
        step()
    return calls


@contextlib.contextmanager
def timed_attention_calls():
    """Within the block, the seconds spent in SDPA calls (whichever strategy a wrapped
    processor routes them to) add up in the yielded one-element list. Eager steps only: a
    compiled graph guards on the function and would recompile. The demo's timer
    (``demo.time_attention``) wraps a strategy's runner instead, which diffusers' own
    processors (the ``sdpa`` baseline here) never call: hence this hook on the function."""
    from ..integration import redirect

    # The routing shim goes in first, under the timer: installed later, it would replace it.
    redirect.install()
    spent = [0.0]

    def wrap(original):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return timed

    with _sdpa_wrapped(wrap):
        yield spent


def _tensors(call: RecordedCall, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Fresh random query, key and value with the recorded shapes and strides."""
    tensors = []
    for shape, stride in zip(call.shapes, call.strides):
        t = torch.empty_strided(shape, stride, dtype=call.dtype)
        tensors.append(t.copy_(torch.randn(shape, generator=generator)))
    return tuple(tensors)


def _runner(call: RecordedCall, strategy: str, tensors: tuple) -> Callable[[], Any]:
    from ..attention.functional import scaled_dot_product_attention

    flags = {"is_causal": call.is_causal, "scale": call.scale, "enable_gqa": call.enable_gqa}
    if strategy == "sdpa":
        return lambda: torch.nn.functional.scaled_dot_product_attention(*tensors, **flags)
    return lambda: scaled_dot_product_attention(*tensors, backend=strategy, **flags)


def attention_seconds(
    calls: Counter, strategies: tuple[str, ...] = ("sdpa", "tiled"), rounds: int = 5
) -> dict[str, dict[str, float]]:
    """Per strategy: seconds of each kind of call (median of ``rounds`` interleaved rounds,
    after a warm-up) times its count, by :meth:`RecordedCall.label`, and ``"total"``."""
    generator = torch.Generator().manual_seed(0)
    runners = {}
    for call in calls:
        tensors = _tensors(call, generator)
        for strategy in strategies:
            runners[(strategy, call)] = _runner(call, strategy, tensors)
    with torch.no_grad():
        medians = interleaved_medians(runners, rounds)
    seconds: dict[str, dict[str, float]] = {s: {} for s in strategies}
    for (strategy, call), median in medians.items():
        label = call.label()
        per_kind = median * calls[call]
        seconds[strategy][label] = seconds[strategy].get(label, 0.0) + per_kind
    for strategy in strategies:
        seconds[strategy]["total"] = sum(seconds[strategy].values())
    return seconds


def predicted_step(sdpa_step: float, sdpa_attention: float, speedup: float) -> float:
    """The step time a kernel should reach: the ``sdpa`` step with its attention time divided
    by the kernel's attention speed-up."""
    return sdpa_step - sdpa_attention * (1.0 - 1.0 / speedup)


def step_predictions(
    sdpa_step: float,
    measured_steps: dict[str, float],
    calls: Counter,
    rounds: int = 5,
    in_step: Optional[dict[str, float]] = None,
) -> dict[str, dict[str, Any]]:
    """Per strategy of ``measured_steps`` (e.g. ``tiled``, ``int8``; their measured step
    seconds): the predicted step and how the measured one compares. One replay of the calls
    times every strategy (interleaved with ``sdpa``). ``in_step``: the attention seconds timed
    inside the measured steps (:func:`timed_attention_calls`) per strategy, ``sdpa`` included,
    which split each step into its attention and the rest."""
    seconds = attention_seconds(calls, ("sdpa", *measured_steps), rounds=rounds)
    sdpa_attention = seconds["sdpa"]["total"]
    predictions = {}
    for strategy, measured_step in measured_steps.items():
        speedup = sdpa_attention / seconds[strategy]["total"]
        predicted = predicted_step(sdpa_step, sdpa_attention, speedup)
        predictions[strategy] = {
            "strategy": strategy,
            "calls": sum(calls.values()),
            "attention_seconds": {s: seconds[s] for s in ("sdpa", strategy)},
            "attention_share_of_sdpa_step": sdpa_attention / sdpa_step,
            "attention_speedup": speedup,
            "sdpa_step": sdpa_step,
            "predicted_step": predicted,
            "measured_step": measured_step,
            "measured_vs_predicted": measured_step / predicted - 1.0,
        }
        if in_step and "sdpa" in in_step and strategy in in_step:
            steps = {"sdpa": sdpa_step, strategy: measured_step}
            predictions[strategy]["in_step"] = {
                s: {"attention": in_step[s], "rest": steps[s] - in_step[s]} for s in steps
            }
    return predictions


def _in_step_markdown(prediction: dict[str, Any]) -> str:
    """The sentence that splits the measured steps into attention and the rest."""
    strategy, replayed = prediction["strategy"], prediction["attention_seconds"]
    ours, sdpa = prediction["in_step"][strategy], prediction["in_step"]["sdpa"]
    return (
        f"Timed inside the steps, the {strategy} step's attention took {ours['attention']:.2f} s "
        f"({replayed[strategy]['total']:.2f} s replayed alone) and the rest of it "
        f"{ours['rest']:.2f} s; the sdpa step's attention {sdpa['attention']:.2f} s "
        f"({replayed['sdpa']['total']:.2f} s replayed) and the rest {sdpa['rest']:.2f} s."
    )


def prediction_markdown(prediction: dict[str, Any]) -> str:
    """One strategy's prediction as a short table and one line of conclusion."""
    strategy, seconds = prediction["strategy"], prediction["attention_seconds"]
    lines = [
        f"| attention calls of one step | sdpa s | {strategy} s | speed-up |",
        "|---|---|---|---|",
    ]
    for label in seconds["sdpa"]:
        sdpa, ours = seconds["sdpa"][label], seconds[strategy][label]
        name = f"**{label}** ({prediction['calls']} calls)" if label == "total" else label
        lines.append(f"| {name} | {sdpa:.3f} | {ours:.3f} | {sdpa / ours:.2f}x |")
    lines.append("")
    lines.append(
        f"Attention is {prediction['attention_share_of_sdpa_step']:.0%} of the sdpa step "
        f"({prediction['sdpa_step']:.2f} s); with its {prediction['attention_speedup']:.2f}x "
        f"the {strategy} step should take {prediction['predicted_step']:.2f} s and took "
        f"{prediction['measured_step']:.2f} s "
        f"({prediction['measured_vs_predicted']:+.1%} against the prediction)."
    )
    if "in_step" in prediction:
        lines.append(_in_step_markdown(prediction))
    return "\n".join(lines)
