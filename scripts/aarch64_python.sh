#!/usr/bin/env bash
# The Python extension as an AArch64 host (Kunpeng, next to an Ascend NPU) builds it: npu_attn._C
# cross-built against Debian's arm64 CPython headers with the same CMake variant selection, then
# loaded by an arm64 CPython under qemu-user and checked against float64 NumPy
# (tests/aarch64/check_python_extension.py). scripts/setup.sh provides the headers and unpacks
# the arm64 CPython and NumPy into build/aarch64-python (never installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=build/aarch64-python
cmake -S . -B build/aarch64-py -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DNPU_ATTN_BUILD_TESTS=OFF -DNPU_ATTN_BUILD_PYTHON=ON \
  -Dpybind11_DIR="$(.venv/bin/python -m pybind11 --cmakedir)" \
  -DPython_INCLUDE_DIR=/usr/include/python3.11 \
  -DPython_LIBRARY=/usr/lib/aarch64-linux-gnu/libpython3.11.so \
  -DPYTHON_MODULE_EXTENSION=.cpython-311-aarch64-linux-gnu.so >/dev/null
cmake --build build/aarch64-py -j "$(nproc)"
qemu-aarch64 -L "$PREFIX/root" -E PYTHONPATH="$PWD/$PREFIX/site" "$PREFIX/root/usr/bin/python3.11" \
  tests/aarch64/check_python_extension.py \
  build/aarch64-py/python/npu_attn/_C.cpython-311-aarch64-linux-gnu.so
