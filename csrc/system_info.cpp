#include "system_info.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "workspace.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
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
void fill_identity(CpuInfo& info) {
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
  // Older Intel brand strings are right-justified: trim both ends (as Linux's "model name").
  const std::string model = brand;
  const size_t first = model.find_first_not_of(' ');
  info.model = first == std::string::npos
                   ? ""
                   : model.substr(first, model.find_last_not_of(' ') - first + 1);
  if (__get_cpuid(1, &a, &b, &c, &d)) {
    // The displayed family/model add the extended fields (Intel SDM vol. 2A, CPUID leaf 1).
    const unsigned base_family = (a >> 8) & 0xf, base_model = (a >> 4) & 0xf;
    const unsigned family = base_family == 0xf ? base_family + ((a >> 20) & 0xff) : base_family;
    const unsigned model_id = base_family == 0x6 || base_family == 0xf
                                  ? (((a >> 16) & 0xf) << 4) + base_model
                                  : base_model;
    info.signature = "family " + std::to_string(family) + " model " + std::to_string(model_id) +
                     " stepping " + std::to_string(a & 0xf);
  }
}

// Linux 5.16+ hands out the AMX tile data state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM); without it the first tile instruction kills the process with SIGILL.
bool os_permits_amx() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtileData = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
#else
  return false;
#endif
}

CpuFeatures detect_features() {
  CpuFeatures f;
  // __builtin_cpu_supports also checks that the OS saves the AVX/AVX-512 register state.
  f.sse42 = __builtin_cpu_supports("sse4.2");
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  unsigned a = 0, b = 0, c = 0, d = 0;
  // CPUID leaf 7: subleaf 1 EAX bit 4 AVX-VNNI, bit 5 AVX512-BF16; subleaf 0 ECX bit 11
  // AVX512-VNNI. Each needs the register state its base (AVX2 or AVX-512 F) already checked.
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) {
    f.avx_vnni = f.avx2 && (a & (1u << 4));
    f.avx512_bf16 = f.avx512f && (a & (1u << 5));
  }
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx512_vnni = f.avx512f && (c & (1u << 11));
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22), int8 = d & (1u << 25);
    if (tile && bf16 && f.avx512f && os_permits_amx()) {
      f.amx_tile = f.amx_bf16 = true;
      f.amx_int8 = int8;
    }
  }
  return f;
}
#elif defined(__aarch64__)
// AArch64 has no CPUID a user program may read: Linux reports the implementer and part in
// /proc/cpuinfo and the features in the auxiliary vector.
void fill_identity(CpuInfo& info) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
    const std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (key == "CPU implementer" && info.vendor.empty()) info.vendor = "ARM implementer " + value;
    if (key == "CPU part" && info.model.empty()) info.model = "AArch64 part " + value;
    if (key == "CPU variant" && info.signature.empty()) info.signature = "variant " + value;
    if (key == "CPU revision" && info.signature.find("revision") == std::string::npos)
      info.signature += (info.signature.empty() ? "revision " : " revision ") + value;
  }
}

CpuFeatures detect_features() {
  CpuFeatures f;
#if defined(__linux__)
  f.asimd = getauxval(AT_HWCAP) & HWCAP_ASIMD;
#else
  f.asimd = true;  // mandatory in ARMv8-A
#endif
  return f;
}
#else
void fill_identity(CpuInfo&) {}
CpuFeatures detect_features() {
  return {};
}
#endif

// The one list of feature names: name and member, in the order they are reported.
struct FeatureField {
  const char* name;
  bool CpuFeatures::*member;
};
constexpr FeatureField kFeatureFields[] = {
    {"sse4.2", &CpuFeatures::sse42},
    {"avx2", &CpuFeatures::avx2},
    {"fma", &CpuFeatures::fma},
    {"f16c", &CpuFeatures::f16c},
    {"avx512f", &CpuFeatures::avx512f},
    {"avx512bw", &CpuFeatures::avx512bw},
    {"avx512vl", &CpuFeatures::avx512vl},
    {"avx512dq", &CpuFeatures::avx512dq},
    {"avx_vnni", &CpuFeatures::avx_vnni},
    {"avx512_vnni", &CpuFeatures::avx512_vnni},
    {"avx512_bf16", &CpuFeatures::avx512_bf16},
    {"amx_tile", &CpuFeatures::amx_tile},
    {"amx_bf16", &CpuFeatures::amx_bf16},
    {"amx_int8", &CpuFeatures::amx_int8},
    {"asimd", &CpuFeatures::asimd},
};

}  // namespace

std::vector<std::string> CpuFeatures::names() const {
  std::vector<std::string> out;
  for (const auto& field : kFeatureFields)
    if (this->*field.member) out.emplace_back(field.name);
  return out;
}

std::string cpu_feature_choices() {
  std::string out;
  for (const auto& field : kFeatureFields) out += std::string(out.empty() ? "" : ", ") + field.name;
  return out;
}

bool CpuFeatures::*cpu_feature_member(const std::string& name) {
  for (const auto& field : kFeatureFields)
    if (name == field.name) return field.member;
  throw std::invalid_argument("unknown CPU feature '" + name + "'; expected some of " +
                              cpu_feature_choices());
}

CpuFeatures mask_cpu_features(CpuFeatures features, const std::string& disabled) {
  std::stringstream list(disabled);
  std::string name;
  while (std::getline(list, name, ',')) {
    while (!name.empty() && name.front() == ' ') name.erase(name.begin());
    while (!name.empty() && name.back() == ' ') name.pop_back();
    if (name.empty()) continue;
    features.*cpu_feature_member(name) = false;
  }
  // A hidden base feature hides the extensions built on it, as on a real CPU: no AVX2 means no
  // AVX-VNNI; no AVX2 or no AVX-512 F means no AVX-512 extensions and no AMX either.
  if (!features.avx2) features.avx_vnni = false;
  if (!features.avx2 || !features.avx512f) {
    features.avx512f = features.avx512bw = features.avx512vl = features.avx512dq = false;
    features.avx512_vnni = features.avx512_bf16 = false;
    features.amx_tile = features.amx_bf16 = features.amx_int8 = false;
  }
  if (!features.amx_tile) features.amx_bf16 = features.amx_int8 = false;
  return features;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = [] {
    const char* disabled = std::getenv("NPU_ATTN_DISABLE_FEATURES");
    try {
      return mask_cpu_features(detect_features(), disabled ? disabled : "");
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(std::string("NPU_ATTN_DISABLE_FEATURES: ") + e.what());
    }
  }();
  return features;
}

CpuInfo query_cpu_info() {
  CpuInfo info;
  fill_identity(info);
  info.features = cpu_features();
  info.logical_cores = static_cast<int>(std::thread::hardware_concurrency());
  info.l1d_bytes = cache_bytes(1, "Data");
  info.l2_bytes = cache_bytes(2, "Unified");
  info.l3_bytes = cache_bytes(3, "Unified");
  return info;
}

namespace {
std::atomic<int64_t> l2_override{0};
}  // namespace

int64_t planning_l2_bytes() {
  static const int64_t detected = cache_bytes(2, "Unified");
  const int64_t chosen = l2_override.load(std::memory_order_relaxed);
  return chosen > 0 ? chosen : detected;
}

void set_planning_l2_bytes(int64_t bytes) {
  l2_override.store(bytes > 0 ? bytes : 0, std::memory_order_relaxed);
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
