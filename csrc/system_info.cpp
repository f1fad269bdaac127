#include "system_info.h"

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "workspace.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace npu_attn {
namespace {

// Value of "Field:   123 kB" lines in /proc files, in bytes (0 if absent).
int64_t proc_kib_field(const char* path, const char* field) {
  std::ifstream in(path);
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(in, line)) {
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') {
      std::istringstream rest(line.substr(n + 1));
      int64_t kib = 0;
      rest >> kib;
      return kib * 1024;
    }
  }
  return 0;
}

// Cache size for a level from sysfs (index0..3), e.g. "48K" -> 49152.
int64_t cache_bytes(int level, const char* type) {
  for (int index = 0; index < 8; ++index) {
    const std::string base = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream lvl(base + "/level"), typ(base + "/type"), size(base + "/size");
    int l = 0;
    std::string t, s;
    if (!(lvl >> l) || !(typ >> t) || !(size >> s)) continue;
    if (l != level || (t != type && t != "Unified")) continue;
    int64_t value = std::stoll(s);
    if (!s.empty() && (s.back() == 'K' || s.back() == 'k')) value *= 1024;
    if (!s.empty() && s.back() == 'M') value *= 1024 * 1024;
    return value;
  }
  return 0;
}

#if defined(__x86_64__) || defined(__i386__)
void fill_x86(CpuInfo& info) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d)) {
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    info.vendor = vendor;
  }
  char brand[49] = {};
  for (unsigned leaf = 0; leaf < 3; ++leaf) {
    if (!__get_cpuid(0x80000002 + leaf, &a, &b, &c, &d)) break;
    std::memcpy(brand + 16 * leaf, &a, 4);
    std::memcpy(brand + 16 * leaf + 4, &b, 4);
    std::memcpy(brand + 16 * leaf + 8, &c, 4);
    std::memcpy(brand + 16 * leaf + 12, &d, 4);
  }
  info.model = brand;
  while (!info.model.empty() && info.model.back() == ' ') info.model.pop_back();
  // __builtin_cpu_supports also checks that the OS saves the AVX/AVX-512 register state.
  info.sse42 = __builtin_cpu_supports("sse4.2");
  info.avx2 = __builtin_cpu_supports("avx2");
  info.fma = __builtin_cpu_supports("fma");
  info.f16c = __builtin_cpu_supports("f16c");
  info.avx512f = __builtin_cpu_supports("avx512f");
  info.avx512bw = __builtin_cpu_supports("avx512bw");
  info.avx512vl = __builtin_cpu_supports("avx512vl");
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) info.avx512_bf16 = info.avx512f && (a & (1u << 5));
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    info.amx_bf16 = d & (1u << 22);
    info.amx_tile = d & (1u << 24);
  }
}
#endif

}  // namespace

std::vector<std::string> CpuInfo::feature_names() const {
  std::vector<std::string> names;
  const std::pair<const char*, bool> all[] = {{"sse4.2", sse42},      {"avx2", avx2},
                                              {"fma", fma},           {"f16c", f16c},
                                              {"avx512f", avx512f},   {"avx512bw", avx512bw},
                                              {"avx512vl", avx512vl}, {"avx512_bf16", avx512_bf16},
                                              {"amx_tile", amx_tile}, {"amx_bf16", amx_bf16}};
  for (const auto& [name, present] : all)
    if (present) names.emplace_back(name);
  return names;
}

CpuInfo query_cpu_info() {
  CpuInfo info;
#if defined(__x86_64__) || defined(__i386__)
  fill_x86(info);
#endif
  info.logical_cores = static_cast<int>(std::thread::hardware_concurrency());
  info.l1d_bytes = cache_bytes(1, "Data");
  info.l2_bytes = cache_bytes(2, "Unified");
  info.l3_bytes = cache_bytes(3, "Unified");
  return info;
}

MemoryInfo query_memory_info() {
  MemoryInfo m;
  m.total_bytes = proc_kib_field("/proc/meminfo", "MemTotal");
  m.available_bytes = proc_kib_field("/proc/meminfo", "MemAvailable");
  if (m.total_bytes == 0) {
    m.total_bytes = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  }
  m.rss_bytes = proc_kib_field("/proc/self/status", "VmRSS");
  m.peak_rss_bytes = proc_kib_field("/proc/self/status", "VmHWM");
  const WorkspaceStats ws = workspace_stats();
  m.workspace_bytes = ws.current_bytes;
  m.workspace_peak_bytes = ws.peak_bytes;
  return m;
}

}  // namespace npu_attn
