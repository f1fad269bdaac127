// avx2 variant of the int8 attention forward (attention_int8_impl.h). Built with -mavx2 -mfma
// -mf16c: vpmaddubsw products.
#define NPU_ATTN_VEC_BYTES 32
#include "attention_int8_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_int8_avx2(const AttentionParams& params) {
  attention_int8_tiled(params);
}

}  // namespace npu_attn::kernels
