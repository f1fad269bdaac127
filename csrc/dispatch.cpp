#include "dispatch.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels/kernels.h"

namespace npu_attn {
namespace {

std::atomic<int> g_active{-1};  // -1: not chosen yet

#if defined(__x86_64__) || defined(__i386__)
// __builtin_cpu_supports also checks that the OS saves the wider registers (XGETBV).
bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && cpu_has_avx2();
}
bool cpu_has_avx512_bf16() {
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}
// AMX needs the CPU feature bits and, on Linux 5.16+, the process's permission to use the tile
// data state (arch_prctl ARCH_REQ_XCOMP_PERM), requested once here. Without the permission the
// first tile instruction would kill the process with SIGILL, so no permission = no AMX.
bool cpu_has_amx_bf16() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!cpu_has_avx512_bf16() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
    if (!tile || !bf16) return false;
#if defined(__linux__)
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
#else
    return false;
#endif
  }();
  return usable;
}
#else
bool cpu_has_avx2() {
  return false;
}
bool cpu_has_avx512() {
  return false;
}
bool cpu_has_avx512_bf16() {
  return false;
}
bool cpu_has_amx_bf16() {
  return false;
}
#endif

constexpr Isa kAllIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16,
                            Isa::kAmxBf16};

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
    case Isa::kAmxBf16:
      return "amx_bf16";
  }
  return "unknown";
}

std::optional<Isa> parse_isa(const std::string& name) {
  for (Isa isa : kAllIsas)
    if (name == isa_name(isa)) return isa;
  return std::nullopt;
}

std::string isa_choices() {
  std::string out;
  for (Isa isa : kAllIsas) out += std::string(out.empty() ? "" : ", ") + isa_name(isa);
  return out;
}

bool isa_compiled(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
#if defined(NPU_ATTN_HAVE_AVX2)
    case Isa::kAvx2:
      return true;
#endif
#if defined(NPU_ATTN_HAVE_AVX512)
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
    case Isa::kAmxBf16:
      return true;
#endif
    default:
      return false;
  }
}

bool isa_supported_by_cpu(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return cpu_has_avx2();
    case Isa::kAvx512:
      return cpu_has_avx512();
    case Isa::kAvx512Bf16:
      return cpu_has_avx512_bf16();
    case Isa::kAmxBf16:
      return cpu_has_amx_bf16();
  }
  return false;
}

std::vector<Isa> compiled_isas() {
  std::vector<Isa> out;
  for (Isa isa : kAllIsas)
    if (isa_compiled(isa)) out.push_back(isa);
  return out;
}

std::vector<Isa> runnable_isas() {
  std::vector<Isa> out;
  for (Isa isa : compiled_isas())
    if (isa_supported_by_cpu(isa)) out.push_back(isa);
  return out;
}

Isa best_isa() {
  for (Isa isa : {Isa::kAmxBf16, Isa::kAvx512, Isa::kAvx2})
    if (isa_compiled(isa) && isa_supported_by_cpu(isa)) return isa;
  return Isa::kScalar;
}

Isa select_isa_from_environment() {
  const char* requested = std::getenv("NPU_ATTN_ISA");
  if (requested == nullptr || *requested == '\0') return best_isa();
  const std::optional<Isa> isa = parse_isa(requested);
  if (!isa) {
    throw std::runtime_error(std::string("NPU_ATTN_ISA='") + requested +
                             "' is not a kernel variant; expected one of " + isa_choices());
  }
  if (!isa_compiled(*isa)) {
    throw std::runtime_error(std::string("NPU_ATTN_ISA='") + requested +
                             "': this build of npu_attn does not contain that variant");
  }
  if (!isa_supported_by_cpu(*isa)) {
    throw std::runtime_error(std::string("NPU_ATTN_ISA='") + requested +
                             "': this CPU cannot run it (best available: " + isa_name(best_isa()) +
                             ")");
  }
  return *isa;
}

Isa active_isa() {
  int current = g_active.load();
  if (current < 0) {
    int chosen = static_cast<int>(select_isa_from_environment());
    g_active.compare_exchange_strong(current, chosen);
    current = g_active.load();
  }
  return static_cast<Isa>(current);
}

void set_active_isa(Isa isa) {
  if (!isa_compiled(isa) || !isa_supported_by_cpu(isa)) {
    throw std::runtime_error(std::string("kernel variant '") + isa_name(isa) +
                             "' cannot run here (compiled: " + (isa_compiled(isa) ? "yes" : "no") +
                             ", CPU support: " + (isa_supported_by_cpu(isa) ? "yes" : "no") + ")");
  }
  g_active.store(static_cast<int>(isa));
}

void run_attention_forward(const AttentionParams& params) {
  run_attention_forward(params, active_isa());
}

void run_attention_forward(const AttentionParams& params, Isa isa) {
  if (!isa_supported_by_cpu(isa)) {
    throw std::runtime_error(std::string("kernel variant '") + isa_name(isa) +
                             "' cannot run on this CPU");
  }
  switch (isa) {
#if defined(NPU_ATTN_HAVE_AVX512)
    case Isa::kAvx512Bf16:
      kernels::attention_forward_avx512_bf16(params);
      return;
    case Isa::kAmxBf16:
      kernels::attention_forward_amx_bf16(params);
      return;
    case Isa::kAvx512:
      kernels::attention_forward_avx512(params);
      return;
#endif
#if defined(NPU_ATTN_HAVE_AVX2)
    case Isa::kAvx2:
      kernels::attention_forward_avx2(params);
      return;
#endif
    case Isa::kScalar:
      kernels::attention_forward_scalar(params);
      return;
    default:
      break;
  }
  throw std::runtime_error(std::string("kernel variant '") + isa_name(isa) + "' is not compiled");
}

void run_attention_backward(const AttentionBackwardParams& params) {
  run_attention_backward(params, active_isa());
}

void run_attention_backward(const AttentionBackwardParams& params, Isa isa) {
  if (!isa_supported_by_cpu(isa)) {
    throw std::runtime_error(std::string("kernel variant '") + isa_name(isa) +
                             "' cannot run on this CPU");
  }
  switch (isa) {
#if defined(NPU_ATTN_HAVE_AVX512)
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:  // the backward has no bfloat16 dot-product variant (yet)
    case Isa::kAmxBf16:
      kernels::attention_backward_avx512(params);
      return;
#endif
#if defined(NPU_ATTN_HAVE_AVX2)
    case Isa::kAvx2:
      kernels::attention_backward_avx2(params);
      return;
#endif
    case Isa::kScalar:
      kernels::attention_backward_scalar(params);
      return;
    default:
      break;
  }
  throw std::runtime_error(std::string("kernel variant '") + isa_name(isa) + "' is not compiled");
}

double measure_fma_peak_gflops(Isa isa, int threads, double seconds) {
  if (!isa_supported_by_cpu(isa) || !isa_compiled(isa)) {
    throw std::runtime_error(std::string("kernel variant '") + isa_name(isa) + "' cannot run here");
  }
  if (threads < 1 || !(seconds > 0)) throw std::invalid_argument("threads >= 1 and seconds > 0");
  switch (isa) {
#if defined(NPU_ATTN_HAVE_AVX512)
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:  // float32 FMA peak: the denominator for float32 kernels
    case Isa::kAmxBf16:
      return kernels::fma_peak_gflops_avx512(threads, seconds);
#endif
#if defined(NPU_ATTN_HAVE_AVX2)
    case Isa::kAvx2:
      return kernels::fma_peak_gflops_avx2(threads, seconds);
#endif
    default:
      return kernels::fma_peak_gflops_scalar(threads, seconds);
  }
}

}  // namespace npu_attn
