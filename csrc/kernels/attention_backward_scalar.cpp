// scalar variant of the tiled attention backward kernel. Portable baseline: no -m flags beyond the
// target default (SSE2 on x86-64).
#define NPU_ATTN_VEC_BYTES 16
#include "attention_backward_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_backward_scalar(const AttentionBackwardParams& params) {
  attention_backward_tiled(params);
}

}  // namespace npu_attn::kernels
