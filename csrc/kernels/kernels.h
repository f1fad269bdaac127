// Entry points of the per-ISA kernel variants. Each is defined in its own translation unit,
// compiled with that ISA's flags (see CMakeLists.txt). Call them only through dispatch.h, which
// checks that the CPU can run the variant.
#pragma once

#include "../attention_params.h"

namespace npu_attn::kernels {

void attention_forward_scalar(const AttentionParams& params);
void attention_backward_scalar(const AttentionBackwardParams& params);
double fma_peak_gflops_scalar(int threads, double seconds);
#if defined(NPU_ATTN_HAVE_AVX2)
void attention_forward_avx2(const AttentionParams& params);
void attention_backward_avx2(const AttentionBackwardParams& params);
double fma_peak_gflops_avx2(int threads, double seconds);
#endif
#if defined(NPU_ATTN_HAVE_AVX512)
void attention_forward_avx512(const AttentionParams& params);
void attention_backward_avx512(const AttentionBackwardParams& params);
// The avx512 kernels, except bfloat16 forward, which uses AVX-512-BF16 dot products.
void attention_forward_avx512_bf16(const AttentionParams& params);
// The avx512 kernels, except bfloat16 forward, which runs on AMX tiles. Needs the OS permission
// for AMX state (dispatch.cpp asks for it).
void attention_forward_amx_bf16(const AttentionParams& params);
double fma_peak_gflops_avx512(int threads, double seconds);
#endif

}  // namespace npu_attn::kernels
