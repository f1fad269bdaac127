#!/usr/bin/env bash
# Runs every test: lint, the C++ GoogleTest suite (normal, AArch64 under qemu-user, and
# ASan+UBSan builds) via ctest,
# then pytest. Expects scripts/setup.sh to have run. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
JOBS="$(nproc)"

echo "==> lint: ruff and clang-format"
ruff check python tests bench
ruff format --check python tests bench
find csrc tests/cpp bench -name '*.cpp' -o -name '*.h' | xargs clang-format --dry-run --Werror

echo "==> C++ tests (Release)"
cmake -S . -B build/cpp -G Ninja -DNPU_ATTN_BUILD_PYTHON=OFF -DNPU_ATTN_BUILD_BENCH=ON >/dev/null
cmake --build build/cpp -j "$JOBS"
ctest --test-dir build/cpp --output-on-failure -j "$JOBS"

echo "==> C++ tests on emulated CPUs (features masked in the detector)"
# The CPUs this project meets differ (AMX, AVX512-BF16 without AMX, AVX-512 without BF16 or
# VNNI, AVX2 only); masking the detector runs the dispatch tests, one reference grid per variant
# and the int8 grid as each of them would, whatever CPU this is. Variants a masked CPU cannot
# run are skipped with the reason.
for features in "amx_tile,amx_bf16" "avx_vnni,avx512_vnni,avx512_bf16,amx_tile,amx_bf16" \
  "avx512f,avx_vnni" "avx2"; do
  NPU_ATTN_DISABLE_FEATURES="$features" build/cpp/tests/cpp/npu_attn_cpp_tests --gtest_brief=1 \
    --gtest_filter='VariantTable.*:EmulatedCpu.*:EmulatedAmx.*:Kernels/EmulatedInt8Units.*:ThisCpu.*:SystemInfo.*:Kernels/EveryIsa.MatchesReferenceOnShapeGrid/*:Kernels/LowPrecision.ForwardAndBackwardMatchTheReference/*:Int8Variants.*'
done

echo "==> C++ tests on AArch64 (cross-built with g++-aarch64-linux-gnu, run under qemu-user)"
# Ascend NPUs sit in AArch64 hosts (Kunpeng): the core, its portable and neon variants and the
# whole GoogleTest suite, as built there (cmake/aarch64-linux-gnu.cmake).
cmake -S . -B build/aarch64 -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DNPU_ATTN_BUILD_PYTHON=OFF >/dev/null
cmake --build build/aarch64 -j "$JOBS"
# The portable scalar variant's long reference grids run natively above (Release and ASan);
# under qemu-user each costs minutes (the double-precision reference dominates), so here they
# run for the neon variant only. Every other scalar test still runs on AArch64.
ctest --test-dir build/aarch64 --output-on-failure -j "$JOBS" \
  -E '(MatchesReferenceOnShapeGrid|WorkspaceIsReleasedAndLinearInSequenceLength|AccurateOnDiffusionLikeActivations|MatchesReferenceWithMasksAndCausal|LargeKeyValueShapesMatchTheReferenceInBfloat16)/scalar$'
bash scripts/aarch64_python.sh  # the Python extension, built for and loaded by arm64 CPython

echo "==> C++ tests (AddressSanitizer + UndefinedBehaviorSanitizer)"
cmake -S . -B build/asan -G Ninja -DNPU_ATTN_BUILD_PYTHON=OFF -DNPU_ATTN_SANITIZE=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/asan -j "$JOBS"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build/asan --output-on-failure -j "$JOBS"

echo "==> Python tests"
# In up to four worker processes (pytest-xdist), a test file per worker at a time, so each
# file's module-scoped pipelines are still built once. Most of the suite's time is inductor
# compiling graphs in single-threaded Python, which leaves a core idle; on 2 cores two workers
# took 25 minutes instead of 36. Waiting OpenMP threads sleep instead of spinning, since two
# workers' thread teams share the cores (as ctest's processes do: tests/cpp/CMakeLists.txt).
PYTEST_WORKERS=$((JOBS < 4 ? JOBS : 4))
OMP_WAIT_POLICY=PASSIVE python -m pytest tests/py -n "$PYTEST_WORKERS" --dist loadfile \
  --durations=25  # the slowest tests, to keep CI within its budget
