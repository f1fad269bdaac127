// avx512_bf16 variant: the avx512 kernels plus the bfloat16 forward on vdpbf16ps. Built with the
// avx512 flags and -mavx512bf16.
#define NPU_ATTN_VEC_BYTES 64
#include "attention_forward_bf16_impl.h"
#include "fma_peak_impl.h"
#include "kernels.h"

namespace npu_attn::kernels {

void attention_forward_avx512_bf16(const AttentionParams& params) {
  if (params.element == ElementType::kBFloat16) {
    attention_forward_bf16_pairs(params);
  } else {
    attention_forward_tiled(params);
  }
}

// bfloat16 runs on vdpbf16ps, the other dtypes on fp32 FMA.
double peak_gflops_avx512_bf16(ElementType element, int threads, double seconds) {
  if (element == ElementType::kBFloat16) return measure_dpbf16_peak(threads, seconds);
  return measure_fma_peak(threads, seconds);
}

}  // namespace npu_attn::kernels
