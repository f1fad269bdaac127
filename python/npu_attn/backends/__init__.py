"""Device backends reached through strategies (see :mod:`npu_attn.strategies`)."""
