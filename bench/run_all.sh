#!/usr/bin/env bash
# Runs every benchmark behind this machine's section of BENCHMARKS.md (well over an hour on a
# 2-core VM), writes the machine's report to bench/results/<machine>.md and regenerates
# BENCHMARKS.md from every report in bench/results/.
# <machine> is the CPU and its class (npu_attn.tools.bench_report.machine_slug(), e.g.
# amd-epyc-zen4-avx512-bf16); logs and JSON go to bench_out/<machine>/, plots to
# docs/benchmarks/<machine>/. To measure a smaller CPU class on this one, export the variables
# in BENCHMARKS.md's "Emulating another CPU class" first (the name then ends in -emulated).
# Usage: bash bench/run_all.sh [python]   (default: .venv/bin/python)
set -euo pipefail
PY=${1:-.venv/bin/python}
MODELS="SD,Flux,HiDream,VAE"
SLUG=$("$PY" -c 'from npu_attn.tools.bench_report import machine_slug; print(machine_slug())')
OUT=bench_out/$SLUG
mkdir -p "$OUT"
# the variables that emulate a smaller CPU, for the report's header
MASKS='NPU_ATTN_DISABLE_FEATURES|ATEN_CPU_CAPABILITY|ONEDNN_MAX_CPU_ISA|MKL_ENABLE_INSTRUCTIONS'
env | grep -E "^($MASKS)=" | sort > "$OUT/environment.txt" || true
"$PY" -m npu_attn bench --repeats 5 --json "$OUT/latest.json" --plots "$OUT" > "$OUT/full.log"
"$PY" -m npu_attn bench --filter target --repeats 5 > "$OUT/target.log"
"$PY" -m npu_attn bench --filter "$MODELS" --dtype bfloat16 --repeats 3 --no-memory --skip vanilla \
  > "$OUT/bf16.log"
"$PY" -m npu_attn bench --filter "$MODELS" --dtype float16 --repeats 3 --no-memory --skip vanilla \
  > "$OUT/fp16.log"
"$PY" -m npu_attn bench --filter "$MODELS" --backward --repeats 3 --no-memory > "$OUT/bwd.log"
"$PY" -m npu_attn bench --filter "$MODELS" --backward --dtype bfloat16 --repeats 3 --no-memory \
  > "$OUT/bwd_bf16.log"
NPU_ATTN_DTYPE=float32 "$PY" -m npu_attn demo --steps 3 --out "$OUT/demo_sd15_fp32" \
  > "$OUT/demo_sd15_fp32.log"
NPU_ATTN_DTYPE=bfloat16 "$PY" -m npu_attn demo --steps 3 --out "$OUT/demo_sd15_bf16" \
  > "$OUT/demo_sd15_bf16.log"
"$PY" -m npu_attn bench --e2e --dtype bfloat16 --repeats 3 --json "$OUT/e2e_bf16.json" \
  --plot "$OUT/e2e_bf16.png" > "$OUT/e2e_bf16.log"
"$PY" -m npu_attn bench --e2e --dtype float32 --repeats 3 --json "$OUT/e2e_fp32.json" \
  --plot "$OUT/e2e_fp32.png" > "$OUT/e2e_fp32.log"
"$PY" -m npu_attn bench --e2e --images 20 --dtype bfloat16 --repeats 2 \
  --json "$OUT/images_bf16.json" --plot "$OUT/images_bf16.png" > "$OUT/images_bf16.log"
"$PY" -m npu_attn bench --e2e --images 20 --dtype float32 --repeats 1 \
  --json "$OUT/images_fp32.json" --plot "$OUT/images_fp32.png" > "$OUT/images_fp32.log"
"$PY" -m npu_attn bench --e2e --images 20 --model sdxl --size 768 --dtype bfloat16 --repeats 1 \
  --json "$OUT/images_sdxl_bf16.json" --plot "$OUT/images_sdxl_bf16.png" \
  > "$OUT/images_sdxl_bf16.log"
"$PY" -m npu_attn bench --parallel --json "$OUT/parallel_fp32.json" > "$OUT/parallel_fp32.log"
"$PY" -m npu_attn bench --parallel --dtype bfloat16 --json "$OUT/parallel_bf16.json" \
  > "$OUT/parallel_bf16.log"
PLOTS=docs/benchmarks/$SLUG
mkdir -p "$PLOTS"
cp "$OUT/e2e_fp32.png" "$OUT/e2e_bf16.png" "$PLOTS/"
cp "$OUT/images_bf16.png" "$OUT/images_fp32.png" "$OUT/images_sdxl_bf16.png" "$PLOTS/"
cp "$OUT/bench_time.png" "$OUT/bench_memory.png" "$PLOTS/"
cp "$OUT/demo_sd15_fp32/strategies.png" "$PLOTS/demo_strategies.png"
cp "$OUT/demo_sd15_bf16/strategies.png" "$PLOTS/demo_strategies_bf16.png"
"$PY" bench/make_benchmarks_md.py --machine "$OUT" --into bench/results
"$PY" bench/make_benchmarks_md.py --merge bench/results > "$OUT/BENCHMARKS.md"
cp "$OUT/BENCHMARKS.md" BENCHMARKS.md
touch "$OUT/done.flag"
