// System facts reported to the DeviceManager: plausible values, consistent with dispatch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>

#include "dispatch.h"
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

}  // namespace
}  // namespace npu_attn
