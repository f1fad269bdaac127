// The int8 kernel's AMX-INT8 code (the amx_int8 variant's source, csrc/kernels/
// attention_int8_impl.h) on the software tile unit (amx_emulation.h), with vpdpwssd emulated
// too (vnni_emulation.h) since the amx_int8 variant has AVX512-VNNI. Built with the avx2 variant's
// flags (tests/cpp/CMakeLists.txt).
#define NPU_ATTN_VEC_BYTES 32
#include "amx_emulation.h"
#include "vnni_emulation.h"
// (the emulations must come first)
#include "attention_int8_impl.h"
#include "vnni_emulated.h"

static_assert(npu_attn::kTileScores && !npu_attn::kOffsetQueryCodes,
              "the emulated build must take the kernel's AMX path (signed Q codes)");
static_assert(npu_attn::kVnniProducts, "P*V on vpdpwssd, as in the amx_int8 variant");

namespace npu_attn::testing {

void attention_int8_amx_int8_emulated(const AttentionParams& params) {
  attention_int8_tiled(params);
}

}  // namespace npu_attn::testing
