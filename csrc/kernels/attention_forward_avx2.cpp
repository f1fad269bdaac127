// avx2 variant of the tiled attention forward kernel. Built with -mavx2 -mfma -mf16c.
#define NPU_ATTN_VEC_BYTES 32
#include "attention_forward_impl.h"
#include "fma_peak_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_forward_avx2(const AttentionParams& params) {
  attention_forward_tiled(params);
}

// Every dtype runs on fp32 FMA here.
double peak_gflops_avx2(ElementType, int threads, double seconds) {
  return measure_fma_peak(threads, seconds);
}

}  // namespace npu_attn::kernels
