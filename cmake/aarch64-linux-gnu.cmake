# Cross-compiles the C++ core and its GoogleTest suite for AArch64 Linux (the Ascend hosts'
# Kunpeng CPUs) with Debian's g++-aarch64-linux-gnu, and runs the tests under qemu-user:
#   cmake -S . -B build/aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
#         -DNPU_ATTN_BUILD_PYTHON=OFF
#   cmake --build build/aarch64 && ctest --test-dir build/aarch64
# ctest and gtest_discover_tests start every test binary through CMAKE_CROSSCOMPILING_EMULATOR.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# -E tells the tests they run emulated (a few observe the OS, which qemu-user only imitates).
# LD_LIBRARY_PATH keeps the C library the cross toolchain's, matching its dynamic loader: where
# Debian's own libc6:arm64 is installed too (multiarch, /lib/aarch64-linux-gnu), the loader
# would otherwise pick that one, and a loader and C library from different builds hang.
set(CMAKE_CROSSCOMPILING_EMULATOR
    qemu-aarch64;-L;/usr/aarch64-linux-gnu;-E;NPU_ATTN_TEST_EMULATOR=qemu-user;-E;LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib)

# Libraries come from the cross sysroot only; the header-only packages (Eigen, DLPack) and
# GoogleTest's sources (built for the target, tests/cpp/CMakeLists.txt) are found on the host.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
