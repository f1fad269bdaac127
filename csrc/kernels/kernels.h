// Entry points of the per-ISA kernel variants listed in variants.def. Each is defined in its
// variant's own translation units, compiled with that variant's flags (see CMakeLists.txt). Call
// them only through dispatch.h, which checks that the CPU can run the variant.
#pragma once

#include "../attention_params.h"
#include "variant_macros.h"

namespace npu_attn::kernels {

#define NPU_ATTN_VARIANT(name, arch, builds_on, flags, features, needs, forward_from,     \
                         backward_from, peak_from, fp32_kernel, bf16_kernel, fp16_kernel, \
                         int8_from, int8_kernel)                                          \
  NPU_ATTN_IF_##arch(                                                                     \
      void attention_forward_##forward_from(const AttentionParams& params);               \
      void attention_backward_##backward_from(const AttentionBackwardParams& params);     \
      double peak_gflops_##peak_from(ElementType element, int threads, double seconds);   \
      void attention_int8_##int8_from(const AttentionParams& params);)
#include "variants.def"
#undef NPU_ATTN_VARIANT

}  // namespace npu_attn::kernels
