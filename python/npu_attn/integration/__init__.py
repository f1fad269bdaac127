"""diffusers integration: attention processors and strategy switching, the dispatcher backend,
the SDPA redirect, and the one reader of a pipeline's components."""
