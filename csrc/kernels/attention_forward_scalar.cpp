// scalar variant of the tiled attention forward kernel. Portable baseline: no -m flags beyond the
// target default (SSE2 on x86-64).
#define NPU_ATTN_VEC_BYTES 16
#include "attention_forward_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_forward_scalar(const AttentionParams& params) {
  attention_forward_tiled(params);
}

}  // namespace npu_attn::kernels
