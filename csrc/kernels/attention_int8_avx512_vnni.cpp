// avx512_vnni variant of the int8 attention forward (attention_int8_impl.h). Built with the
// avx512 flags and -mavx512vnni, on 32-byte vectors: the same code as avx_vnni (the code the
// tests also run on an emulation of vpdpbusd on any AVX2 CPU), EVEX-encoded, so it can use 32
// ymm registers. A 64-byte form (twice the products per instruction on CPUs with two 512-bit
// units) needs its own register blocks and has not been written.
#define NPU_ATTN_VEC_BYTES 32
#include "attention_int8_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_int8_avx512_vnni(const AttentionParams& params) {
  attention_int8_tiled(params);
}

}  // namespace npu_attn::kernels
