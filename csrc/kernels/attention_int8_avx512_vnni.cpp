// avx512_vnni variant of the int8 attention forward (attention_int8_impl.h). Built with the
// avx512 flags and -mavx512vnni, on 64-byte vectors: Q K^T on vpdpbusd and P*V on vpdpwssd in
// zmm registers, the softmax and conversions 16 lanes wide. The integer sums are those of the
// avx2 kernel (tests/cpp: Int8IntegerUnits), the arithmetic around them the float32 kernel's.
#define NPU_ATTN_VEC_BYTES 64
#include "attention_int8_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_int8_avx512_vnni(const AttentionParams& params) {
  attention_int8_tiled(params);
}

}  // namespace npu_attn::kernels
