// The AMX kernels compiled against the software tile unit (amx_emulation.h), for tests on CPUs
// without AMX. Defined in amx_emulated_kernels.cpp, which is built with the avx512_bf16
// variant's flags: call only where that variant runs (isa_supported_by_cpu(Isa::avx512_bf16)).
#pragma once

#include "attention_params.h"

namespace npu_attn::testing {

void attention_forward_amx_emulated(const AttentionParams& params);
void attention_backward_amx_emulated(const AttentionBackwardParams& params);

}  // namespace npu_attn::testing
