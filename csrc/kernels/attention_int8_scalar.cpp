// scalar variant of the int8 attention forward (attention_int8_impl.h). Portable baseline.
#define NPU_ATTN_VEC_BYTES 16
#include "attention_int8_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_int8_scalar(const AttentionParams& params) {
  attention_int8_tiled(params);
}

}  // namespace npu_attn::kernels
