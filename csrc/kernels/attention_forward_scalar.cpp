// scalar variant of the tiled attention forward kernel. Portable baseline: no -m flags beyond the
// target default (SSE2 on x86-64).
#define NPU_ATTN_VEC_BYTES 16
#include "attention_forward_impl.h"
#include "fma_peak_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_forward_scalar(const AttentionParams& params) {
  attention_forward_tiled(params);
}

// Every dtype runs on fp32 FMA here.
double peak_gflops_scalar(ElementType, int threads, double seconds) {
  return measure_fma_peak(threads, seconds);
}

}  // namespace npu_attn::kernels
