// The AMX bfloat16 kernels on the software tile unit: the same source as the amx_bf16 variant
// (csrc/kernels/attention_forward_amx_impl.h,
// attention_backward_amx_impl.h), with the tile intrinsics replaced by
// amx_emulation.h. Built with the avx512_bf16 variant's flags (tests/cpp/CMakeLists.txt).
#define NPU_ATTN_VEC_BYTES 64
#include "amx_emulation.h"
// (the emulation must come first)
#include "amx_emulated.h"
#include "attention_backward_amx_impl.h"
#include "attention_forward_amx_impl.h"

namespace npu_attn::testing {

void attention_forward_amx_emulated(const AttentionParams& params) {
  attention_forward_bf16_amx(params);
}

void attention_backward_amx_emulated(const AttentionBackwardParams& params) {
  attention_backward_bf16_amx(params);
}

}  // namespace npu_attn::testing
