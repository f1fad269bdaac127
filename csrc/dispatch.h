// Runtime ISA dispatch. One table (kernel_variants()) lists every kernel variant compiled into
// this build: its name, what the CPU and OS must support, its forward and backward kernels and
// its peak probe. Everything else (names, parsing, which variants run here, the doctor's and
// Python's lists, the tests' parameterisation) reads that table.
//
// A variant is active per element type: float32, bfloat16 and float16 may each run on the
// variant that is fastest for them on this machine. Before anyone measures (the Python package
// measures on first use and caches the result), the default for an element type is the most
// specialised runnable variant for it; NPU_ATTN_ISA forces one variant for every type.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "attention_params.h"
#include "system_info.h"

namespace npu_attn {

// Every variant in csrc/kernels/variants.def, compiled into this build or not (Isa::scalar,
// Isa::avx2, ...), in table order.
enum class Isa {
#define NPU_ATTN_VARIANT(name, ...) name,
#include "kernels/variants.def"
#undef NPU_ATTN_VARIANT
};
constexpr int kIsaCount = 0
#define NPU_ATTN_VARIANT(name, ...) +1
#include "kernels/variants.def"
#undef NPU_ATTN_VARIANT
    ;

constexpr int kElementTypeCount = 3;  // ElementType's values index per-type arrays

// Calls are grouped into shape classes because the fastest variant can differ between them
// (e.g. few keys make a variant's per-tile overheads dominate; a huge head dim changes which
// product dominates). A variant is active per (element type, shape class).
enum class ShapeClass : int { kSelfAttention = 0, kCrossAttention = 1, kLargeHeadDim = 2 };
constexpr int kShapeClassCount = 3;
constexpr int64_t kCrossAttentionMaxKeys = 128;  // e.g. 77 text tokens
constexpr int64_t kLargeHeadDimMin = 257;        // e.g. the VAE's single 512-wide head
ShapeClass shape_class(const AttentionParams& params);
const char* shape_class_name(ShapeClass shape);  // "self-attention" | "cross-attention" | ...
std::optional<ShapeClass> parse_shape_class(const std::string& name);

// One compiled row of the variant table (csrc/kernels/variants.def), least specialised first.
struct KernelVariant {
  Isa isa;
  const char* name;   // "scalar" | "avx2" | "avx512" | "avx512_bf16" | "amx_bf16"
  const char* needs;  // what the CPU (and OS) must support, for people
  std::vector<bool CpuFeatures::*> required;  // its own features and those it builds on
  bool runs_on(const CpuFeatures& features) const;
  void (*forward)(const AttentionParams& params);
  void (*backward)(const AttentionBackwardParams& params);
  // The variant whose backward this row runs (variants.def's backward_from): rows with equal
  // entries run the same backward code.
  const char* backward_from;
  // Measured peak GFLOP/s of the compute path the forward kernel uses for an element type
  // (fp32 FMA, vdpbf16ps or AMX tiles).
  double (*peak_gflops)(ElementType element, int threads, double seconds);
  // The forward kernel this variant runs for each ElementType, e.g. {"avx512 fp32 FMA",
  // "amx_bf16 AMX tiles", "avx512 fp32 FMA"}: variants with equal entries run the same code for
  // that type, so measuring one of them measures all.
  const char* forward_kernel[kElementTypeCount];
  // The lossy opt-in int8 forward (attention_int8_impl.h) and its kernel's name: rows with
  // equal names run the same code.
  void (*int8_forward)(const AttentionParams& params);
  const char* int8_kernel;
};

const std::vector<KernelVariant>& kernel_variants();  // the compiled ones, in table order
const KernelVariant& kernel_variant(Isa isa);         // throws if `isa` is not compiled

const char* isa_name(Isa isa);
std::optional<Isa> parse_isa(const std::string& name);
std::string isa_choices();                           // "scalar, avx2, ...", for messages
const char* element_type_name(ElementType element);  // "float32" | "bfloat16" | "float16"

bool isa_compiled(Isa isa);
bool isa_runs_on(Isa isa, const CpuFeatures& features);  // compiled and runnable there
bool isa_supported_by_cpu(Isa isa);                      // isa_runs_on(isa, cpu_features())
std::vector<Isa> compiled_isas();
std::vector<Isa> runnable_isas(const CpuFeatures& features);
std::vector<Isa> runnable_isas();  // on this CPU, least specialised first

// The variant used for `element` until something else is chosen: the most specialised variant
// runnable on `features` for that type (the first row running the same forward kernel as the
// last runnable row). A rule, not a measurement: the Python package measures and overrides it.
Isa default_isa(ElementType element, const CpuFeatures& features);
Isa default_isa(ElementType element);

// NPU_ATTN_ISA if set (for every element type), else default_isa(element). Throws
// std::runtime_error naming the variable for an unknown variant or one this CPU cannot run.
Isa select_isa_from_environment(ElementType element);

// The variant that runs `element` calls of `shape` (default: self-attention). The setters throw
// std::runtime_error if this CPU cannot run `isa`.
Isa active_isa(ElementType element = ElementType::kFloat32,
               ShapeClass shape = ShapeClass::kSelfAttention);
void set_active_isa(Isa isa);                       // every element type and shape class
void set_active_isa(Isa isa, ElementType element);  // every shape class of `element`
void set_active_isa(Isa isa, ElementType element, ShapeClass shape);

// The variant that runs `element` backward calls. Follows active_isa(element, shape) until
// set_active_backward_isa chooses one for `element` (the Python package measures the bfloat16
// backward separately: on AMX machines the fastest forward and backward can be different
// variants); set_active_isa(isa) for every type makes the backward follow again.
Isa active_backward_isa(ElementType element, ShapeClass shape = ShapeClass::kSelfAttention);
void set_active_backward_isa(Isa isa, ElementType element);
void clear_active_backward_isa(ElementType element);  // follow the forward's choice again

// Run the kernel of `isa` (default: the one active for params' element type and shape class;
// for the backward, active_backward_isa).
// Params must be validated (make_attention_params / make_attention_backward_params).
void run_attention_forward(const AttentionParams& params);
void run_attention_forward(const AttentionParams& params, Isa isa);
void run_attention_backward(const AttentionBackwardParams& params);
void run_attention_backward(const AttentionBackwardParams& params, Isa isa);

// The int8 forward (lossy, opt-in: never chosen for run_attention_forward). One variant runs it
// for every element type: NPU_ATTN_ISA if set, else the most specialised runnable row's int8
// kernel until set_active_int8_isa (the Python package measures the candidates).
Isa default_int8_isa(const CpuFeatures& features);
Isa active_int8_isa();
void set_active_int8_isa(Isa isa);  // throws std::runtime_error if this CPU cannot run it
void run_attention_int8(const AttentionParams& params);
void run_attention_int8(const AttentionParams& params, Isa isa);

// Measured throughput (GFLOP/s) of `threads` threads on the compute path `isa`'s forward kernel
// uses for `element` (fp32 FMA on its vectors, vdpbf16ps, AMX tiles), for about `seconds`: the
// denominator of the benchmark's "percent of peak".
double measure_peak_gflops(Isa isa, ElementType element, int threads, double seconds);

}  // namespace npu_attn
