// avx2 variant of the tiled attention backward kernel. Built with -mavx2 -mfma -mf16c.
#define NPU_ATTN_VEC_BYTES 32
#include "attention_backward_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_backward_avx2(const AttentionBackwardParams& params) {
  attention_backward_tiled(params);
}

}  // namespace npu_attn::kernels
