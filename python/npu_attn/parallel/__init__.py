"""Scale out on ``torch.distributed``: CFG-parallel pipelines and sequence-parallel attention.

Two ways to use more than one process (on one machine or several; gloo on CPU, hccl / nccl
where the device has them, launched by ``torchrun``):

- **CFG-parallel** (:func:`enable_cfg_parallel`, :mod:`.cfg`): the unconditional and
  conditional halves of a guidance batch run on different ranks and are all-gathered after
  every denoiser call; every rank returns the same image. UNet and transformer pipelines
  (SD 1.5/2.1, SDXL, SD3, HiDream).
- **Context parallel** (:func:`enable_context_parallel`, :mod:`.context`): every rank holds a
  share of the tokens through the whole transformer (SD3, Flux, HiDream) and attention runs
  across ranks as ring attention (:func:`ring_attention`, :mod:`.ring`), Ulysses attention
  (:func:`ulysses_attention`, :mod:`.ulysses`) or both. Ring attention needs each block's
  log-sum-exp, which npu_attn's kernel returns with its gradient and torch's CPU SDPA does not.

Start-up: :func:`init_distributed` joins the group torchrun describes, with a timeout that
bounds every collective; every entry point checks that the ranks' inputs fit together before
any data moves, so mistakes raise on every rank instead of hanging (:mod:`._group`).

Example (``torchrun --nproc-per-node 2 script.py``)::

    import torch, npu_attn
    from npu_attn import parallel

    parallel.init_distributed()
    npu_attn.set_attention_strategy(pipe, "tiled")
    parallel.enable_cfg_parallel(pipe)
    image = pipe(prompt_embeds=..., negative_prompt_embeds=...,
                 generator=torch.Generator().manual_seed(0)).images[0]  # same on every rank
"""

from .cfg import cfg_parallel_of, disable_cfg_parallel, enable_cfg_parallel
from .context import context_parallel_of, disable_context_parallel, enable_context_parallel
from .group import (
    DEFAULT_TIMEOUT,
    RankDisagreement,
    comm_stats,
    default_backend,
    distributed_group,
    init_distributed,
    reset_comm_stats,
    shutdown_distributed,
)
from .ring import ring_attention
from .scaling import communication_per_step
from .ulysses import ulysses_attention

__all__ = [
    "DEFAULT_TIMEOUT",
    "RankDisagreement",
    "cfg_parallel_of",
    "comm_stats",
    "communication_per_step",
    "context_parallel_of",
    "default_backend",
    "disable_cfg_parallel",
    "disable_context_parallel",
    "distributed_group",
    "enable_cfg_parallel",
    "enable_context_parallel",
    "init_distributed",
    "reset_comm_stats",
    "ring_attention",
    "shutdown_distributed",
    "ulysses_attention",
]
