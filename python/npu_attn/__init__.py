"""npu_attn: fast, exact attention for diffusion models where CUDA flash-attention is missing.

The tiled (flash-style) C++ kernel computes exact attention in O(L) memory on any CPU, with a
kernel variant chosen for the machine at import (see :func:`active_isa`).

Quick start::

    import npu_attn
    out = npu_attn.scaled_dot_product_attention(q, k, v)   # same signature as torch's SDPA
"""

from ._runtime import (
    active_isa,
    available_isas,
    build_info,
    get_num_threads,
    set_isa,
    set_num_threads,
    workspace_stats,
)
from .functional import scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "active_isa",
    "available_isas",
    "build_info",
    "get_num_threads",
    "scaled_dot_product_attention",
    "set_isa",
    "set_num_threads",
    "workspace_stats",
]
