"""Attention itself: the SDPA-compatible function, the registered torch op, the backends that
compute a call (one module each, one row in ``backends/registry.py``), the strategies users name
and the measured ``auto`` choice between them."""
