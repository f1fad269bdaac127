// amx_int8 variant of the int8 attention forward (attention_int8_impl.h). Built with the
// amx_bf16 flags (AVX-512, AVX512-VNNI, AMX) and -mamx-int8, on 64-byte vectors: Q K^T on AMX
// tiles (tdpbssd), P*V on vpdpwssd in zmm registers, the rest as in avx512_vnni. The tests run
// the same code on 32-byte vectors on the software tile unit (tests/cpp/amx_emulation.h) on any
// AVX2 CPU, and this build where the CPU has AMX-INT8.
#define NPU_ATTN_VEC_BYTES 64
#include "attention_int8_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_int8_amx_int8(const AttentionParams& params) {
  attention_int8_tiled(params);
}

}  // namespace npu_attn::kernels
