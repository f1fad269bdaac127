"""What users run: ``python -m npu_attn`` (cli), doctor, bench (kernel, per image, scale-out and
their report) and demo, on pipeline builders they share."""
