// avx512_bf16 variant of the int8 attention forward (attention_int8_impl.h). Built with the
// avx512_vnni flags and -mavx512bf16, on 64-byte vectors: Q K^T on vpdpbusd as in avx512_vnni,
// P*V on bfloat16 pairs (vdpbf16ps) instead of 16-bit integer codes (kBf16Values). Its outputs
// differ from the avx2 kernel's by P*V's rounding (bfloat16 against 16-bit codes).
#define NPU_ATTN_VEC_BYTES 64
#define NPU_ATTN_INT8_BF16_VALUES 1
#include "attention_int8_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_int8_avx512_bf16(const AttentionParams& params) {
  attention_int8_tiled(params);
}

}  // namespace npu_attn::kernels
