"""Attention backends (registry) and device-specific paths; see :func:`npu_attn.backends`."""
