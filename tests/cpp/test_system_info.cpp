// System facts reported to the DeviceManager: plausible values, consistent with dispatch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "dispatch.h"
#include "heap_policy.h"
#include "system_info.h"
#include "workspace.h"

namespace npu_attn {
namespace {

TEST(SystemInfo, CpuFactsArePlausible) {
  const CpuInfo cpu = query_cpu_info();
  EXPECT_GE(cpu.logical_cores, 1);
  const CpuFeatures& f = cpu.features;
  const auto names = f.names();
  auto has = [&](const char* n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  // One detector: the reported features are the ones dispatch decides with.
  EXPECT_EQ(has("avx2"), f.avx2);
  EXPECT_EQ(has("amx_bf16"), f.amx_bf16);
  EXPECT_EQ(runnable_isas(f), runnable_isas());
  if (f.avx512_bf16) {
    EXPECT_TRUE(f.avx512f);
  }
  if (f.amx_bf16) {
    EXPECT_TRUE(f.amx_tile);
  }
#if defined(__x86_64__)
  EXPECT_FALSE(cpu.vendor.empty());
  if (!std::getenv("NPU_ATTN_DISABLE_FEATURES")) {
    EXPECT_TRUE(f.sse42);
  }
#elif defined(__aarch64__)
  if (!std::getenv("NPU_ATTN_DISABLE_FEATURES")) {
    EXPECT_TRUE(f.asimd);  // Linux reports HWCAP_ASIMD on every ARMv8-A core
  }
#endif
}

TEST(SystemInfo, MemoryFactsAreConsistent) {
  const MemoryInfo m = query_memory_info();
  EXPECT_GT(m.total_bytes, 0);
  EXPECT_GT(m.rss_bytes, 0);
  EXPECT_GE(m.peak_rss_bytes, m.rss_bytes);
  EXPECT_LE(m.available_bytes, m.total_bytes);
  float* block = workspace_alloc_floats(1 << 20);
  EXPECT_GE(query_memory_info().workspace_bytes, int64_t{4} << 20);
  workspace_free_floats(block, 1 << 20);
}

// A 64 MiB block: mapped with mmap under glibc's defaults; with heap reuse on it comes from the
// heap and stays in the process when freed (for the next step); off again returns it to the OS.
TEST(HeapPolicy, ReuseServesLargeBlocksFromTheHeapAndKeepsThem) {
  if (!heap_reuse_supported()) {
    GTEST_SKIP() << "the C heap is not glibc's here (a sanitizer's allocator or another libc): "
                    "its policy cannot be changed";
  }
  if (const char* emulator = std::getenv("NPU_ATTN_TEST_EMULATOR")) {
    // qemu-user runs madvise(MADV_DONTNEED) as a no-op, so freed pages stay resident there.
    GTEST_SKIP() << "under " << emulator << ", which does not return freed pages to the OS";
  }
  constexpr int64_t kBlock = int64_t{64} << 20;
  auto touched_block = [] {
    char* p = static_cast<char*>(std::malloc(kBlock));
    std::memset(p, 1, kBlock);  // every page resident
    return p;
  };
  ASSERT_TRUE(set_heap_reuse(false));
  const int64_t mmapped_before = heap_stats().mmapped_bytes;
  char* mapped = touched_block();
  EXPECT_GE(heap_stats().mmapped_bytes - mmapped_before, kBlock);
  std::free(mapped);

  ASSERT_TRUE(set_heap_reuse(true));
  EXPECT_TRUE(heap_reuse_enabled());
  char* from_heap = touched_block();
  EXPECT_EQ(heap_stats().mmapped_bytes, mmapped_before);
  std::free(from_heap);
  EXPECT_GE(heap_stats().free_bytes, kBlock);  // kept
  const int64_t rss_kept = query_memory_info().rss_bytes;

  ASSERT_TRUE(set_heap_reuse(false));
  EXPECT_FALSE(heap_reuse_enabled());
  EXPECT_LE(query_memory_info().rss_bytes, rss_kept - kBlock / 2);  // returned to the OS
}

}  // namespace
}  // namespace npu_attn
