#!/usr/bin/env bash
# Runs every benchmark behind BENCHMARKS.md (well over an hour on a 2-core VM), then regenerates it.
# Usage: bash bench/run_all.sh [python]   (default: .venv/bin/python)
set -euo pipefail
PY=${1:-.venv/bin/python}
MODELS="SD,Flux,HiDream,VAE"
mkdir -p bench_out
"$PY" -m npu_attn bench --repeats 5 --json bench_out/latest.json --plots bench_out > bench_out/full.log
"$PY" -m npu_attn bench --filter target --repeats 5 > bench_out/target.log
"$PY" -m npu_attn bench --filter "$MODELS" --dtype bfloat16 --repeats 3 --no-memory > bench_out/bf16.log
"$PY" -m npu_attn bench --filter "$MODELS" --dtype float16 --repeats 3 --no-memory > bench_out/fp16.log
"$PY" -m npu_attn bench --filter "$MODELS" --backward --repeats 3 --no-memory > bench_out/bwd.log
"$PY" -m npu_attn bench --filter "$MODELS" --backward --dtype bfloat16 --repeats 3 --no-memory \
  > bench_out/bwd_bf16.log
NPU_ATTN_DTYPE=float32 "$PY" -m npu_attn demo --steps 3 --out bench_out/demo_sd15_fp32 \
  > bench_out/demo_sd15_fp32.log
NPU_ATTN_DTYPE=bfloat16 "$PY" -m npu_attn demo --steps 3 --out bench_out/demo_sd15_bf16 \
  > bench_out/demo_sd15_bf16.log
"$PY" -m npu_attn bench --e2e --dtype bfloat16 --repeats 3 --json bench_out/e2e_bf16.json \
  --plot bench_out/e2e_bf16.png > bench_out/e2e_bf16.log
"$PY" -m npu_attn bench --e2e --dtype float32 --repeats 3 --json bench_out/e2e_fp32.json \
  --plot bench_out/e2e_fp32.png > bench_out/e2e_fp32.log
"$PY" -m npu_attn bench --e2e --images 20 --dtype bfloat16 --repeats 2 \
  --json bench_out/images_bf16.json --plot bench_out/images_bf16.png > bench_out/images_bf16.log
"$PY" -m npu_attn bench --e2e --images 20 --dtype float32 --repeats 1 \
  --json bench_out/images_fp32.json --plot bench_out/images_fp32.png > bench_out/images_fp32.log
"$PY" -m npu_attn bench --e2e --images 20 --model sdxl --size 768 --dtype bfloat16 --repeats 1 \
  --json bench_out/images_sdxl_bf16.json --plot bench_out/images_sdxl_bf16.png \
  > bench_out/images_sdxl_bf16.log
"$PY" -m npu_attn bench --parallel --json bench_out/parallel_fp32.json > bench_out/parallel_fp32.log
"$PY" -m npu_attn bench --parallel --dtype bfloat16 --json bench_out/parallel_bf16.json \
  > bench_out/parallel_bf16.log
mkdir -p docs/benchmarks
cp bench_out/e2e_fp32.png docs/benchmarks/e2e_fp32.png
cp bench_out/e2e_bf16.png docs/benchmarks/e2e_bf16.png
cp bench_out/images_bf16.png bench_out/images_fp32.png bench_out/images_sdxl_bf16.png \
  docs/benchmarks/
cp bench_out/bench_time.png bench_out/bench_memory.png docs/benchmarks/
cp bench_out/demo_sd15_fp32/strategies.png docs/benchmarks/demo_strategies.png
cp bench_out/demo_sd15_bf16/strategies.png docs/benchmarks/demo_strategies_bf16.png
"$PY" bench/make_benchmarks_md.py bench_out > BENCHMARKS.md
touch bench_out/done.flag
