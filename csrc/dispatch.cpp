#include "dispatch.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "kernels/kernels.h"

namespace npu_attn {
namespace {

// The names in variants.def, compiled or not, indexed by Isa.
constexpr const char* kIsaNames[] = {
#define NPU_ATTN_VARIANT(name, ...) #name,
#include "kernels/variants.def"
#undef NPU_ATTN_VARIANT
};
static_assert(sizeof(kIsaNames) / sizeof(kIsaNames[0]) == kIsaCount);

std::vector<bool CpuFeatures::*> parse_features(const std::string& names) {
  std::vector<bool CpuFeatures::*> out;
  std::stringstream list(names);
  std::string name;
  while (list >> name) out.push_back(cpu_feature_member(name));
  return out;
}

// A row's required features: those of the row it builds on (already in `rows`) plus its own.
std::vector<bool CpuFeatures::*> required_features(const std::vector<KernelVariant>& rows,
                                                   const std::string& builds_on,
                                                   const std::string& own) {
  std::vector<bool CpuFeatures::*> required;
  if (builds_on != "none") {
    auto base = std::find_if(rows.begin(), rows.end(),
                             [&](const KernelVariant& row) { return row.name == builds_on; });
    if (base == rows.end())
      throw std::logic_error("variants.def: a variant builds on '" + builds_on +
                             "', which is not an earlier compiled row");
    required = base->required;
  }
  for (bool CpuFeatures::*feature : parse_features(own)) required.push_back(feature);
  return required;
}

// The compiled rows of variants.def, in its order.
std::vector<KernelVariant> build_table() {
  std::vector<KernelVariant> rows;
#define NPU_ATTN_VARIANT(name, arch, builds_on, flags, features, needs, forward_from,     \
                         backward_from, peak_from, fp32_kernel, bf16_kernel, fp16_kernel, \
                         int8_from, int8_kernel)                                          \
  NPU_ATTN_IF_##arch(rows.push_back({Isa::name,                                           \
                                     #name,                                               \
                                     needs,                                               \
                                     required_features(rows, #builds_on, features),       \
                                     kernels::attention_forward_##forward_from,           \
                                     kernels::attention_backward_##backward_from,         \
                                     #backward_from,                                      \
                                     kernels::peak_gflops_##peak_from,                    \
                                     {fp32_kernel, bf16_kernel, fp16_kernel},             \
                                     kernels::attention_int8_##int8_from,                 \
                                     int8_kernel});)
#include "kernels/variants.def"
#undef NPU_ATTN_VARIANT
  return rows;
}

// The variant active per (element type, shape class); -1 until first use.
std::atomic<int> g_active[kElementTypeCount][kShapeClassCount] = {
    {-1, -1, -1}, {-1, -1, -1}, {-1, -1, -1}};
// The int8 forward's variant (every element type and shape); -1 until first use.
std::atomic<int> g_active_int8{-1};

// The backward's variant per element type; -1: the forward's (g_active).
std::atomic<int> g_active_backward[kElementTypeCount] = {-1, -1, -1};

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

bool KernelVariant::runs_on(const CpuFeatures& features) const {
  return std::all_of(required.begin(), required.end(),
                     [&](bool CpuFeatures::*feature) { return features.*feature; });
}

const char* isa_name(Isa isa) {
  // Names of variants that are not compiled are still known (for messages and parsing).
  const int i = static_cast<int>(isa);
  return i >= 0 && i < kIsaCount ? kIsaNames[i] : "unknown";
}

std::optional<Isa> parse_isa(const std::string& name) {
  for (int i = 0; i < kIsaCount; ++i)
    if (name == isa_name(static_cast<Isa>(i))) return static_cast<Isa>(i);
  return std::nullopt;
}

std::string isa_choices() {
  std::string out;
  for (int i = 0; i < kIsaCount; ++i)
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
  for (int e = 0; e < kElementTypeCount; ++e) {
    set_active_isa(isa, static_cast<ElementType>(e));
    g_active_backward[e].store(-1);
  }
}

Isa active_backward_isa(ElementType element, ShapeClass shape) {
  const int chosen = g_active_backward[index_of(element)].load();
  return chosen < 0 ? active_isa(element, shape) : static_cast<Isa>(chosen);
}

void set_active_backward_isa(Isa isa, ElementType element) {
  runnable_variant(isa);  // throws if this CPU cannot run it
  g_active_backward[index_of(element)].store(static_cast<int>(isa));
}

void clear_active_backward_isa(ElementType element) {
  g_active_backward[index_of(element)].store(-1);
}

void run_attention_forward(const AttentionParams& params) {
  run_attention_forward(params, active_isa(params.element, shape_class(params)));
}

void run_attention_forward(const AttentionParams& params, Isa isa) {
  runnable_variant(isa).forward(params);
}

Isa default_int8_isa(const CpuFeatures& features) {
  const std::vector<Isa> runnable = runnable_isas(features);
  const char* best = kernel_variant(runnable.back()).int8_kernel;
  for (Isa isa : runnable)
    if (std::strcmp(kernel_variant(isa).int8_kernel, best) == 0) return isa;
  return runnable.back();
}

Isa active_int8_isa() {
  int current = g_active_int8.load();
  if (current < 0) {
    const char* requested = std::getenv("NPU_ATTN_ISA");
    const Isa chosen = requested != nullptr && *requested != '\0'
                           ? select_isa_from_environment(ElementType::kFloat32)
                           : default_int8_isa(cpu_features());
    g_active_int8.compare_exchange_strong(current, static_cast<int>(chosen));
    current = g_active_int8.load();
  }
  return static_cast<Isa>(current);
}

void set_active_int8_isa(Isa isa) {
  runnable_variant(isa);  // throws if this CPU cannot run it
  g_active_int8.store(static_cast<int>(isa));
}

void run_attention_int8(const AttentionParams& params) {
  run_attention_int8(params, active_int8_isa());
}

void run_attention_int8(const AttentionParams& params, Isa isa) {
  runnable_variant(isa).int8_forward(params);
}

void run_attention_backward(const AttentionBackwardParams& params) {
  run_attention_backward(params, active_backward_isa(params.fwd.element, shape_class(params.fwd)));
}

void run_attention_backward(const AttentionBackwardParams& params, Isa isa) {
  runnable_variant(isa).backward(params);
}

double measure_peak_gflops(Isa isa, ElementType element, int threads, double seconds) {
  const KernelVariant& variant = runnable_variant(isa);
  if (threads < 1 || !(seconds > 0)) throw std::invalid_argument("threads >= 1 and seconds > 0");
  return variant.peak_gflops(element, threads, seconds);
}

}  // namespace npu_attn
