"""Step-level accelerations (Token Merging, DeepCache, block caching, channels-last): one module
per method, one row per method in ``registry.py``, all applied with ``npu_attn.accelerate``."""
