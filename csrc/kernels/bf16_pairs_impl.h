// Two float32 vectors -> one vector of bfloat16 pairs: the operand layout of vdpbf16ps. Used by
// the exact bfloat16 kernels (attention_forward_bf16_impl.h: P's pairs) and by the avx512_bf16
// int8 kernel (attention_int8_impl.h: P's and V's pairs).
#pragma once
#ifndef __AVX512BF16__
#error "bf16_pairs_impl.h needs -mavx512bf16"
#endif

#include <immintrin.h>

namespace npu_attn {
namespace {

// (lo[q], hi[q]) per lane, rounded to nearest even (vcvtne2ps2bf16 puts lo in words 0-15 and hi
// in 16-31; vpermw interleaves).
inline __attribute__((always_inline)) __m512i pack_pairs(__m512 lo, __m512 hi) {
  const __m512i interleave =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

}  // namespace
}  // namespace npu_attn
