#!/usr/bin/env bash
# Sets up everything on a fresh Debian/Ubuntu machine: system packages, a Python venv in .venv
# with pinned dependencies, and npu_attn built and installed into it. Safe to re-run (it also
# rebuilds the extension after C++ changes).
set -euo pipefail
cd "$(dirname "$0")/.."

# g++-aarch64-linux-gnu and qemu-user: the C++ suite cross-built for AArch64 (Ascend hosts) and run
# emulated (scripts/test.sh).
APT_PACKAGES=(g++ make binutils libeigen3-dev libgtest-dev libbenchmark-dev libdlpack-dev clang-format
  g++-aarch64-linux-gnu qemu-user
  chromium chromium-driver)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "==> installing Debian packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# torch==2.13.0 (pinned) ships wheels for this Python; prefer 3.11 where several exist.
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
echo "==> installing Python dependencies (requirements-dev.txt)"
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt \
  "cmake>=3.20,<5" "ninja>=1.11,<2" 2>&1 | grep -v "^WARNING: Location" || true
# Test-only references Token Merging and DeepCache are compared against. Their metadata would
# pull other torch/diffusers versions, so they are installed without dependencies (theirs are
# already pinned above).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "tomesd==0.1.3" \
  "DeepCache==0.1.1" 2>&1 | grep -v "^WARNING: Location" || true
# stable-diffusion.cpp, the per-image benchmark's CPU-native competitor (bench --e2e --images
# --sdcpp), built from source for this CPU (a few minutes): its test loads the exported SD-1.5
# with the real engine. If it cannot build here, that test is skipped with the reason.
if ! .venv/bin/python -c "import stable_diffusion_cpp" 2>/dev/null; then
  echo "==> building stable-diffusion-cpp-python==0.4.7 (bench extra, from source)"
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" .venv/bin/python -m pip install -q \
    --disable-pip-version-check --no-deps "stable-diffusion-cpp-python==0.4.7" 2>&1 \
    | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import stable_diffusion_cpp" 2>/dev/null \
    || echo "    (it did not build: its test will be skipped)"
fi
# The web UI's extra (npu_attn[ui]: Gradio...), its list read from pyproject.toml so the pins
# live in one place; chromium and chromium-driver above are its browser tests' browser.
echo "==> installing the web UI's dependencies (the ui extra)"
mkdir -p build
.venv/bin/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['ui']))" \
  >build/ui-requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check -r build/ui-requirements.txt \
  2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"

# The Ascend boundary tests read the real torch_npu release's op schemas, docs and Python
# sources without importing it (it needs CANN's libraries): the wheel is downloaded and the files
# they read are unpacked into build/, outside every import path, so it can never shadow a real
# installation or change a CPU run.
TORCH_NPU_RELEASE=build/torch_npu_release
if [ ! -f "$TORCH_NPU_RELEASE/torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml" ]; then
  echo "==> downloading torch-npu==2.13.0 for the Ascend boundary tests (not installed)"
  .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps "torch-npu==2.13.0" \
    --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
    -d build/torch_npu_wheel 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python tests/py/torch_npu_release.py unpack build/torch_npu_wheel "$TORCH_NPU_RELEASE"
fi

# The AArch64 Python extension check (scripts/aarch64_python.sh): Debian's arm64 CPython headers
# to build against, and an arm64 CPython and NumPy, unpacked into build/ (never installed), to
# load it with under qemu-user.
AARCH64_PYTHON=build/aarch64-python
ROOT_OR_SUDO=""
[ "$(id -u)" -eq 0 ] || ROOT_OR_SUDO="sudo"
if ! dpkg -s libpython3.11-dev:arm64 >/dev/null 2>&1; then
  echo "==> installing Debian's arm64 CPython headers (libpython3.11-dev:arm64)"
  dpkg --print-foreign-architectures | grep -qx arm64 || $ROOT_OR_SUDO dpkg --add-architecture arm64
  $ROOT_OR_SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $ROOT_OR_SUDO apt-get install -y -qq --no-install-recommends \
    libpython3.11-dev:arm64
fi
if [ ! -x "$AARCH64_PYTHON/root/usr/bin/python3.11" ]; then
  echo "==> unpacking an arm64 CPython for the AArch64 extension check"
  mkdir -p "$AARCH64_PYTHON/debs"
  (cd "$AARCH64_PYTHON/debs" && apt-get download -qq python3.11-minimal:arm64 \
    libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 libexpat1:arm64 zlib1g:arm64 \
    libffi8:arm64 libbz2-1.0:arm64 liblzma5:arm64 2>&1 | grep -v "unsandboxed" || true)
  for deb in "$AARCH64_PYTHON"/debs/*.deb; do dpkg -x "$deb" "$AARCH64_PYTHON/root"; done
  # The extension's C++ and OpenMP runtimes, from the cross toolchain (the C library comes from
  # libc6:arm64, installed with the headers above).
  cp -a /usr/aarch64-linux-gnu/lib/libgomp.so* /usr/aarch64-linux-gnu/lib/libstdc++.so* \
    /usr/aarch64-linux-gnu/lib/libgcc_s.so* "$AARCH64_PYTHON/root/usr/lib/aarch64-linux-gnu/"
fi
if [ ! -d "$AARCH64_PYTHON/site/numpy" ]; then
  .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps "numpy>=1.26,<2.3" \
    --only-binary=:all: --python-version 3.11 --platform manylinux2014_aarch64 \
    -d "$AARCH64_PYTHON/wheels" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m zipfile -e "$AARCH64_PYTHON"/wheels/numpy-*.whl "$AARCH64_PYTHON/site"
fi

echo "==> building and installing npu_attn"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps . \
  2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import npu_attn; print('npu_attn', npu_attn.__version__, 'kernel:', npu_attn.runtime.active_isa())"
