// amx_bf16 variant of the attention backward: bfloat16 on AMX tiles, the other dtypes on the
// avx512 float32 kernel. Built with the avx512 flags and -mavx512bf16 -mamx-tile -mamx-bf16.
#define NPU_ATTN_VEC_BYTES 64
#include "attention_backward_amx_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_backward_amx_bf16(const AttentionBackwardParams& params) {
  if (params.fwd.element == ElementType::kBFloat16) {
    attention_backward_bf16_amx(params);
  } else {
    attention_backward_tiled(params);
  }
}

}  // namespace npu_attn::kernels
