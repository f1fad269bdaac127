// avx512 variant of the tiled attention backward kernel. Built with -mavx512f -mavx512bw -mavx512vl
// -mavx512dq -mfma.
#define NPU_ATTN_VEC_BYTES 64
#include "attention_backward_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_backward_avx512(const AttentionBackwardParams& params) {
  attention_backward_tiled(params);
}

}  // namespace npu_attn::kernels
