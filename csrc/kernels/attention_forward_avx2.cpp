// avx2 variant of the tiled attention forward kernel. Built with -mavx2 -mfma -mf16c.
#define NPU_ATTN_VEC_BYTES 32
#include "attention_forward_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_forward_avx2(const AttentionParams& params) {
  attention_forward_tiled(params);
}

}  // namespace npu_attn::kernels
