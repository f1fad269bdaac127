// neon variant of the tiled attention forward kernel (AArch64). Built with -march=armv8-a:
// 128-bit vectors, and 32 vector registers for 6 x 4 register blocks (vec_impl.h).
#define NPU_ATTN_VEC_BYTES 16
#define NPU_ATTN_VEC_REGISTERS 32
#include "attention_forward_impl.h"
#include "fma_peak_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_forward_neon(const AttentionParams& params) {
  attention_forward_tiled(params);
}

// Every dtype runs on fp32 FMA here (float16 and bfloat16 are widened when packed).
double peak_gflops_neon(ElementType, int threads, double seconds) {
  return measure_fma_peak(threads, seconds);
}

}  // namespace npu_attn::kernels
