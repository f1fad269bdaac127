// The int8 kernel's VNNI and AMX-INT8 code compiled against vnni_emulation.h (and
// amx_emulation.h), for tests on CPUs without those units. Defined in vnni_emulated_kernels.cpp
// and amx_int8_emulated_kernels.cpp, which are built with the avx2 variant's flags: call only
// where that variant runs (isa_supported_by_cpu(Isa::avx2)).
#pragma once

#include <cstdint>

#include "attention_params.h"

namespace npu_attn::testing {

void attention_int8_vnni_emulated(const AttentionParams& params);
// The amx_int8 variant's int8 code on the software tile unit (amx_int8_emulated_kernels.cpp).
void attention_int8_amx_int8_emulated(const AttentionParams& params);

// One emulated instruction on eight int32 lanes: out = acc + the lane's four u x s byte products
// (vpdpbusd) or two a x b 16-bit products (vpdpwssd).
void dpbusd_emulated(const int32_t acc[8], const uint8_t u[32], const int8_t s[32], int32_t out[8]);
void dpwssd_emulated(const int32_t acc[8], const int16_t a[16], const int16_t b[16],
                     int32_t out[8]);

}  // namespace npu_attn::testing
