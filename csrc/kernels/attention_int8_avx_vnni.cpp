// avx_vnni variant of the int8 attention forward (attention_int8_impl.h). Built with the avx2
// flags and -mavxvnni: Q K^T on vpdpbusd, P*V on vpdpwssd (VEX-encoded, ymm registers).
#define NPU_ATTN_VEC_BYTES 32
#include "attention_int8_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_int8_avx_vnni(const AttentionParams& params) {
  attention_int8_tiled(params);
}

}  // namespace npu_attn::kernels
