// The int8 kernel's VNNI code (the avx_vnni and avx512_vnni variants' source,
// csrc/kernels/attention_int8_impl.h) on emulated VNNI instructions (vnni_emulation.h). Built
// with the avx2 variant's flags (tests/cpp/CMakeLists.txt).
#define NPU_ATTN_VEC_BYTES 32
#include "vnni_emulation.h"
// (the emulation must come first)
#include <cstring>

#include "attention_int8_impl.h"
#include "vnni_emulated.h"

static_assert(npu_attn::kVnniProducts, "the emulated build must take the kernel's VNNI path");

namespace npu_attn::testing {

void attention_int8_vnni_emulated(const AttentionParams& params) {
  attention_int8_tiled(params);
}

void dpbusd_emulated(const int32_t acc[8], const uint8_t u[32], const int8_t s[32],
                     int32_t out[8]) {
  __m256i a, x, y;
  std::memcpy(&a, acc, 32);
  std::memcpy(&x, u, 32);
  std::memcpy(&y, s, 32);
  const __m256i r = _mm256_dpbusd_avx_epi32(a, x, y);
  std::memcpy(out, &r, 32);
}

void dpwssd_emulated(const int32_t acc[8], const int16_t a[16], const int16_t b[16],
                     int32_t out[8]) {
  __m256i c, x, y;
  std::memcpy(&c, acc, 32);
  std::memcpy(&x, a, 32);
  std::memcpy(&y, b, 32);
  const __m256i r = _mm256_dpwssd_avx_epi32(c, x, y);
  std::memcpy(out, &r, 32);
}

}  // namespace npu_attn::testing
