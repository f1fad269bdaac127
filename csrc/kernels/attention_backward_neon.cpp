// neon variant of the tiled attention backward kernel (AArch64). Built with -march=armv8-a.
#define NPU_ATTN_VEC_BYTES 16
#define NPU_ATTN_VEC_REGISTERS 32
#include "attention_backward_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_backward_neon(const AttentionBackwardParams& params) {
  attention_backward_tiled(params);
}

}  // namespace npu_attn::kernels
