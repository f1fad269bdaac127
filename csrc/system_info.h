// Facts about this machine that the DeviceManager and the doctor report, measured in C++.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace npu_attn {

struct CpuInfo {
  std::string vendor;  // e.g. "GenuineIntel"
  std::string model;   // brand string
  int logical_cores = 0;
  int64_t l1d_bytes = 0, l2_bytes = 0, l3_bytes = 0;  // 0 if unknown
  // ISA features the CPU reports (and, for AVX/AVX-512, the OS enables).
  bool sse42 = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512_bf16 = false;
  bool amx_tile = false, amx_bf16 = false;
  std::vector<std::string> feature_names() const;  // the ones present
};

struct MemoryInfo {
  int64_t total_bytes = 0;           // physical memory
  int64_t available_bytes = 0;       // MemAvailable
  int64_t rss_bytes = 0;             // this process now
  int64_t peak_rss_bytes = 0;        // this process, high-water mark
  int64_t workspace_bytes = 0;       // held by npu_attn kernels now
  int64_t workspace_peak_bytes = 0;  // and at peak
};

CpuInfo query_cpu_info();
MemoryInfo query_memory_info();

}  // namespace npu_attn
