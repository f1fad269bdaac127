#include "dispatch.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "kernels/kernels.h"

namespace npu_attn {
namespace {

bool runs_scalar(const CpuFeatures&) {
  return true;
}
bool runs_avx2(const CpuFeatures& f) {
  return f.avx2 && f.fma && f.f16c;
}
bool runs_avx512(const CpuFeatures& f) {
  return runs_avx2(f) && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
}
bool runs_avx512_bf16(const CpuFeatures& f) {
  return runs_avx512(f) && f.avx512_bf16;
}
bool runs_amx_bf16(const CpuFeatures& f) {
  return runs_avx512_bf16(f) && f.amx_tile && f.amx_bf16;
}

// The variant table: adding a variant is one kernel translation unit (plus its compile flags in
// CMakeLists.txt) and one row here. forward_kernel is indexed by ElementType (fp32, bf16, fp16).
std::vector<KernelVariant> build_table() {
  std::vector<KernelVariant> rows = {
      {Isa::kScalar,
       "scalar",
       "any CPU (portable C++)",
       runs_scalar,
       kernels::attention_forward_scalar,
       kernels::attention_backward_scalar,
       kernels::fma_peak_gflops_scalar,
       {"portable fp32", "portable fp32", "portable fp32"}},
  };
#if defined(NPU_ATTN_HAVE_AVX2)
  rows.push_back({Isa::kAvx2,
                  "avx2",
                  "AVX2, FMA, F16C",
                  runs_avx2,
                  kernels::attention_forward_avx2,
                  kernels::attention_backward_avx2,
                  kernels::fma_peak_gflops_avx2,
                  {"avx2 fp32 FMA", "avx2 fp32 FMA", "avx2 fp32 FMA"}});
#endif
#if defined(NPU_ATTN_HAVE_AVX512)
  rows.push_back({Isa::kAvx512,
                  "avx512",
                  "AVX-512 F/BW/VL/DQ + AVX2, FMA, F16C",
                  runs_avx512,
                  kernels::attention_forward_avx512,
                  kernels::attention_backward_avx512,
                  kernels::fma_peak_gflops_avx512,
                  {"avx512 fp32 FMA", "avx512 fp32 FMA", "avx512 fp32 FMA"}});
  rows.push_back({Isa::kAvx512Bf16,
                  "avx512_bf16",
                  "avx512 + AVX512-BF16 (vdpbf16ps)",
                  runs_avx512_bf16,
                  kernels::attention_forward_avx512_bf16,
                  kernels::attention_backward_avx512,
                  kernels::fma_peak_gflops_avx512,
                  {"avx512 fp32 FMA", "avx512_bf16 vdpbf16ps", "avx512 fp32 FMA"}});
  rows.push_back({Isa::kAmxBf16,
                  "amx_bf16",
                  "avx512_bf16 + AMX-TILE, AMX-BF16 and the OS's permission to use AMX",
                  runs_amx_bf16,
                  kernels::attention_forward_amx_bf16,
                  kernels::attention_backward_avx512,
                  kernels::fma_peak_gflops_avx512,
                  {"avx512 fp32 FMA", "amx_bf16 AMX tiles", "avx512 fp32 FMA"}});
#endif
  return rows;
}

// The variant active per (element type, shape class); -1 until first use.
std::atomic<int> g_active[kElementTypeCount][kShapeClassCount] = {
    {-1, -1, -1}, {-1, -1, -1}, {-1, -1, -1}};

int index_of(ElementType element) {
  return static_cast<int>(element);
}

std::string cannot_run_message(Isa isa) {
  return std::string("kernel variant '") + isa_name(isa) +
         "' cannot run here (compiled: " + (isa_compiled(isa) ? "yes" : "no") +
         ", CPU support: " + (isa_supported_by_cpu(isa) ? "yes" : "no") + ")";
}

const KernelVariant& runnable_variant(Isa isa) {
  if (!isa_supported_by_cpu(isa)) throw std::runtime_error(cannot_run_message(isa));
  return kernel_variant(isa);
}

}  // namespace

const std::vector<KernelVariant>& kernel_variants() {
  static const std::vector<KernelVariant> table = build_table();
  return table;
}

const KernelVariant& kernel_variant(Isa isa) {
  for (const KernelVariant& row : kernel_variants())
    if (row.isa == isa) return row;
  throw std::runtime_error(std::string("kernel variant '") + isa_name(isa) +
                           "' is not compiled into this build");
}

const char* isa_name(Isa isa) {
  // Names of variants that are not compiled are still known (for messages and parsing).
  static const char* const kNames[] = {"scalar", "avx2", "avx512", "avx512_bf16", "amx_bf16"};
  const int i = static_cast<int>(isa);
  return i >= 0 && i < 5 ? kNames[i] : "unknown";
}

std::optional<Isa> parse_isa(const std::string& name) {
  for (int i = 0; i < 5; ++i)
    if (name == isa_name(static_cast<Isa>(i))) return static_cast<Isa>(i);
  return std::nullopt;
}

std::string isa_choices() {
  std::string out;
  for (int i = 0; i < 5; ++i)
    out += std::string(out.empty() ? "" : ", ") + isa_name(static_cast<Isa>(i));
  return out;
}

const char* element_type_name(ElementType element) {
  switch (element) {
    case ElementType::kFloat32:
      return "float32";
    case ElementType::kBFloat16:
      return "bfloat16";
    case ElementType::kFloat16:
      return "float16";
  }
  return "unknown";
}

bool isa_compiled(Isa isa) {
  for (const KernelVariant& row : kernel_variants())
    if (row.isa == isa) return true;
  return false;
}

bool isa_runs_on(Isa isa, const CpuFeatures& features) {
  for (const KernelVariant& row : kernel_variants())
    if (row.isa == isa) return row.runs_on(features);
  return false;
}

bool isa_supported_by_cpu(Isa isa) {
  return isa_runs_on(isa, cpu_features());
}

std::vector<Isa> compiled_isas() {
  std::vector<Isa> out;
  for (const KernelVariant& row : kernel_variants()) out.push_back(row.isa);
  return out;
}

std::vector<Isa> runnable_isas(const CpuFeatures& features) {
  std::vector<Isa> out;
  for (const KernelVariant& row : kernel_variants())
    if (row.runs_on(features)) out.push_back(row.isa);
  return out;
}

std::vector<Isa> runnable_isas() {
  return runnable_isas(cpu_features());
}

Isa default_isa(ElementType element, const CpuFeatures& features) {
  const std::vector<Isa> runnable = runnable_isas(features);  // never empty: scalar runs anywhere
  const char* best = kernel_variant(runnable.back()).forward_kernel[index_of(element)];
  for (Isa isa : runnable)
    if (std::strcmp(kernel_variant(isa).forward_kernel[index_of(element)], best) == 0) return isa;
  return runnable.back();
}

Isa default_isa(ElementType element) {
  return default_isa(element, cpu_features());
}

Isa select_isa_from_environment(ElementType element) {
  const char* requested = std::getenv("NPU_ATTN_ISA");
  if (requested == nullptr || *requested == '\0') return default_isa(element);
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
                             "': this CPU cannot run it (runnable here: " +
                             isa_name(runnable_isas().back()) + " and below)");
  }
  return *isa;
}

ShapeClass shape_class(const AttentionParams& params) {
  if (params.head_dim >= kLargeHeadDimMin || params.head_dim_v >= kLargeHeadDimMin)
    return ShapeClass::kLargeHeadDim;
  if (params.len_k <= kCrossAttentionMaxKeys) return ShapeClass::kCrossAttention;
  return ShapeClass::kSelfAttention;
}

const char* shape_class_name(ShapeClass shape) {
  switch (shape) {
    case ShapeClass::kSelfAttention:
      return "self-attention";
    case ShapeClass::kCrossAttention:
      return "cross-attention";
    case ShapeClass::kLargeHeadDim:
      return "large head dim";
  }
  return "unknown";
}

std::optional<ShapeClass> parse_shape_class(const std::string& name) {
  for (int i = 0; i < kShapeClassCount; ++i)
    if (name == shape_class_name(static_cast<ShapeClass>(i))) return static_cast<ShapeClass>(i);
  return std::nullopt;
}

Isa active_isa(ElementType element, ShapeClass shape) {
  std::atomic<int>& slot = g_active[index_of(element)][static_cast<int>(shape)];
  int current = slot.load();
  if (current < 0) {
    const int chosen = static_cast<int>(select_isa_from_environment(element));
    slot.compare_exchange_strong(current, chosen);
    current = slot.load();
  }
  return static_cast<Isa>(current);
}

void set_active_isa(Isa isa, ElementType element, ShapeClass shape) {
  runnable_variant(isa);  // throws if this CPU cannot run it
  g_active[index_of(element)][static_cast<int>(shape)].store(static_cast<int>(isa));
}

void set_active_isa(Isa isa, ElementType element) {
  for (int s = 0; s < kShapeClassCount; ++s)
    set_active_isa(isa, element, static_cast<ShapeClass>(s));
}

void set_active_isa(Isa isa) {
  for (int e = 0; e < kElementTypeCount; ++e) set_active_isa(isa, static_cast<ElementType>(e));
}

void run_attention_forward(const AttentionParams& params) {
  run_attention_forward(params, active_isa(params.element, shape_class(params)));
}

void run_attention_forward(const AttentionParams& params, Isa isa) {
  runnable_variant(isa).forward(params);
}

void run_attention_backward(const AttentionBackwardParams& params) {
  run_attention_backward(params, active_isa(params.fwd.element, shape_class(params.fwd)));
}

void run_attention_backward(const AttentionBackwardParams& params, Isa isa) {
  runnable_variant(isa).backward(params);
}

double measure_fma_peak_gflops(Isa isa, int threads, double seconds) {
  const KernelVariant& variant = runnable_variant(isa);
  if (threads < 1 || !(seconds > 0)) throw std::invalid_argument("threads >= 1 and seconds > 0");
  return variant.fma_peak_gflops(threads, seconds);
}

}  // namespace npu_attn
