// VNNI's two integer dot products on AVX2, so the int8 kernel's VNNI code (attention_int8_impl.h,
// kVnniProducts: Q codes offset by 128, per-key offsets, vpdpwssd in P*V) is tested on every
// AVX2 CPU, not only on the VNNI machines a session happens to get. Included before the kernel
// header, it replaces GCC's AVX-VNNI intrinsics _mm256_dpbusd_avx_epi32 and
// _mm256_dpwssd_avx_epi32 by exact AVX2 equivalents.
//
// Arithmetic follows the instructions: vpdpbusd adds, to each int32 lane, the four products of
// its unsigned bytes of `u` and signed bytes of `s` (at most 4 x 255 x 128 in magnitude, no
// saturation; the int32 sum wraps); vpdpwssd adds the two products of its signed 16-bit halves.
// vpmaddwd on bytes widened to 16 bits gives the same pair sums exactly (|255 x 128| < 2^15 per
// product, pairs in int32).
//
// Test-only, and never part of the library.
#pragma once

#include <immintrin.h>  // first, so the definitions below replace GCC's

namespace npu_attn {
namespace {  // every emulated kernel's translation unit has its own copy: no shared symbols
namespace vnni_emulation {

inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  const __m256i low_bytes = _mm256_set1_epi16(0x00FF);
  const __m256i u_even = _mm256_and_si256(u, low_bytes);  // bytes 0, 2 of each word, zero-extended
  const __m256i u_odd = _mm256_srli_epi16(u, 8);          // bytes 1, 3
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8);  // sign-extended
  const __m256i s_odd = _mm256_srai_epi16(s, 8);
  const __m256i sums =
      _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd));
  return _mm256_add_epi32(acc, sums);
}

inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

}  // namespace vnni_emulation
}  // namespace
}  // namespace npu_attn

#define _mm256_dpbusd_avx_epi32(acc, u, s) ::npu_attn::vnni_emulation::dpbusd(acc, u, s)
#define _mm256_dpwssd_avx_epi32(acc, a, b) ::npu_attn::vnni_emulation::dpwssd(acc, a, b)
#define NPU_ATTN_VNNI_EMULATED 1
