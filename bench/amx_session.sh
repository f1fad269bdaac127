#!/usr/bin/env bash
# What issue 16 still needs from a CPU with AMX (Sapphire Rapids or later), in one run.
#
# Nothing AMX has been measured since the AMX backward and the AMX forward restructure landed:
# every later run was on AMD CPUs without AMX (Zen 4, Zen 3), where the AMX kernels are
# tested on an emulated tile unit only. On an AMX machine this runs, in order:
#   1. every AMX test on the real tile unit, failing if any of them was skipped;
#   2. the bfloat16 forward and forward + backward over the model shapes (issue 16's targets:
#      >= 1.5x / >= 1.3x torch, no shape below 1.0x);
#   3. the AMX backward against the vdpbf16ps one, interleaved in one process (which one
#      `NPU_ATTN_TUNE=0` and C++ callers should get by rule: dispatch.h);
#   4. the float32 forward and its % of the FMA peak (>= 1.4x, >= 75% at B2 H8 L4096 D64).
# About 40 minutes on 2 cores. Needs `bash scripts/setup.sh` and the two builds of the README
# (build/cpp with tests, and the extension copied into python/npu_attn/).
# Usage: bash bench/amx_session.sh [python]   (default: .venv/bin/python); logs in bench_out/amx/
set -euo pipefail
PY=${1:-.venv/bin/python}
OUT=bench_out/amx
MODELS="SD,Flux,HiDream,VAE"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}

for flag in amx_tile amx_bf16; do
  if ! grep -q -w "$flag" /proc/cpuinfo; then
    echo "this CPU has no $flag (see /proc/cpuinfo): nothing here can be measured on it" >&2
    exit 1
  fi
done
mkdir -p "$OUT"
grep -m1 "model name" /proc/cpuinfo | tee "$OUT/cpu.txt"

echo "== 1. AMX tests on the tile unit"
ctest --test-dir build/cpp -R "amx|Amx" --output-on-failure | tee "$OUT/ctest.log"
if grep -q "did not run" "$OUT/ctest.log"; then
  echo "some AMX tests were skipped on an AMX CPU (see $OUT/ctest.log): the OS may not grant" \
    "AMX state (arch_prctl ARCH_REQ_XCOMP_PERM)" >&2
  exit 1
fi

echo "== 2. bfloat16 forward, and forward + backward"
"$PY" -m npu_attn bench --filter "$MODELS" --dtype bfloat16 --repeats 5 --no-memory \
  | tee "$OUT/bf16_forward.log"
"$PY" -m npu_attn bench --filter "$MODELS" --backward --dtype bfloat16 --repeats 3 --no-memory \
  | tee "$OUT/bf16_backward.log"

echo "== 3. AMX backward (B) against the vdpbf16ps backward (A), interleaved"
so=$(ls python/npu_attn/_C*.so)
cp "$so" "$OUT/a.so"
cp "$so" "$OUT/b.so"
"$PY" bench/ab_builds.py --a "$OUT/a.so" --b "$OUT/b.so" --backward --dtypes bfloat16 \
  --isa-a bfloat16=avx512_bf16 --isa bfloat16=amx_bf16 --repeats 7 --filter "$MODELS" \
  | tee "$OUT/ab_backward.log"

echo "== 4. float32 forward and the FMA-peak target"
"$PY" -m npu_attn bench --filter "$MODELS" --repeats 5 --no-memory | tee "$OUT/fp32_forward.log"
"$PY" -m npu_attn bench --filter target --repeats 5 | tee "$OUT/fp32_target.log"
echo "done: $OUT"
