// The one float -> bfloat16 rounding rule, shared by the kernels (vec_impl.h, whose vector
// stores apply the same rule lane by lane) and the test-only reference.
#pragma once

#include <cstdint>

namespace npu_attn {
namespace {  // internal linkage: each ISA variant's translation unit keeps its own copy

// Round to nearest even; NaN stays a (quiet) NaN instead of rounding up into infinity.
inline __attribute__((always_inline)) uint16_t bfloat16_bits(float x) {
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof(bits));
  if (x != x) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace
}  // namespace npu_attn
