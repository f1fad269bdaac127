// Facts about this machine that the DeviceManager and the doctor report, measured in C++.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace npu_attn {

// The ISA features the kernels care about: what the CPU reports and the OS enables (AVX/AVX-512
// register state saved by the OS; AMX tile data permitted for this process). Detected once, in
// one place, and read by dispatch, the doctor and the DeviceManager alike.
struct CpuFeatures {
  bool sse42 = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx_vnni = false;     // AVX-VNNI: vpdpbusd/vpdpwssd, VEX-encoded (ymm)
  bool avx512_vnni = false;  // AVX512-VNNI: the same products, EVEX-encoded
  bool avx512_bf16 = false;
  // AMX: only when the OS granted the permission
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  bool asimd = false;  // AArch64 Advanced SIMD (NEON): part of every ARMv8-A core
  std::vector<std::string> names() const;  // the ones present, e.g. {"avx2", "fma", ...}
};

// Every feature name CpuFeatures knows, for messages ("sse4.2, avx2, ...").
std::string cpu_feature_choices();

// The CpuFeatures member called `name` (e.g. "avx512_bf16" -> &CpuFeatures::avx512_bf16).
// Throws std::invalid_argument naming an unknown feature.
bool CpuFeatures::*cpu_feature_member(const std::string& name);

// `features` with the comma-separated names in `disabled` turned off (e.g. "amx_bf16,avx512f"),
// to emulate a smaller CPU; hiding avx2 or avx512f also hides the AVX-512 extensions and AMX.
// Throws std::invalid_argument naming an unknown feature.
CpuFeatures mask_cpu_features(CpuFeatures features, const std::string& disabled);

// This machine's features, detected on first use, minus the ones named in the environment
// variable NPU_ATTN_DISABLE_FEATURES (emulates CPUs without AMX, AVX512-BF16, AVX-512 ...).
// On the first call this also asks Linux for permission to use AMX tile data (arch_prctl).
const CpuFeatures& cpu_features();

struct CpuInfo {
  std::string vendor;  // e.g. "GenuineIntel"
  std::string model;   // brand string
  // CPUID family/model/stepping ("family 23 model 1 stepping 2"): virtual machines often show a
  // generic brand string ("AMD EPYC") for several generations, the signature tells them apart.
  // AArch64: "variant 0x1 revision 1"; empty where unknown.
  std::string signature;
  int logical_cores = 0;
  int64_t l1d_bytes = 0, l2_bytes = 0, l3_bytes = 0;  // 0 if unknown
  CpuFeatures features;                               // = cpu_features()
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

// The L2 size per core that the kernels' tile plans assume: cpu0's from sysfs, read once (0
// where sysfs does not say), unless set_planning_l2_bytes chose another size. Tests use the
// setter to run both sides of a rule on any machine; 0 returns to the detected size.
int64_t planning_l2_bytes();
void set_planning_l2_bytes(int64_t bytes);

}  // namespace npu_attn
