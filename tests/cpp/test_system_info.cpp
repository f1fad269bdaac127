// System facts reported to the DeviceManager: plausible values, consistent with dispatch.
#include <gtest/gtest.h>

#include <algorithm>

#include "dispatch.h"
#include "system_info.h"
#include "workspace.h"

namespace npu_attn {
namespace {

TEST(SystemInfo, CpuFactsArePlausible) {
  const CpuInfo cpu = query_cpu_info();
  EXPECT_GE(cpu.logical_cores, 1);
  const auto names = cpu.feature_names();
  auto has = [&](const char* f) { return std::find(names.begin(), names.end(), f) != names.end(); };
  // The dispatcher's notion of AVX2/AVX-512 support must agree with the reported features.
  EXPECT_EQ(isa_supported_by_cpu(Isa::kAvx2), cpu.avx2 && cpu.fma && cpu.f16c);
  if (isa_supported_by_cpu(Isa::kAvx512)) {
    EXPECT_TRUE(has("avx512f") && has("avx512bw") && has("avx512vl"));
  }
  if (cpu.avx512_bf16) {
    EXPECT_TRUE(cpu.avx512f);
  }
#if defined(__x86_64__)
  EXPECT_FALSE(cpu.vendor.empty());
  EXPECT_TRUE(cpu.sse42);
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
