// neon variant of the int8 attention forward (attention_int8_impl.h). Built with -march=armv8-a
// (AArch64).
#define NPU_ATTN_VEC_BYTES 16
#define NPU_ATTN_VEC_REGISTERS 32
#include "attention_int8_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_int8_neon(const AttentionParams& params) {
  attention_int8_tiled(params);
}

}  // namespace npu_attn::kernels
