// Runtime ISA dispatch: which kernel variants were compiled, which the CPU can run, and which
// one is active. The active variant is chosen once (best supported, or NPU_ATTN_ISA) and can be
// changed explicitly, e.g. by tests that run every variant.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "attention_params.h"

namespace npu_attn {

// kAvx512Bf16 and kAmxBf16 are avx512 plus a bfloat16 forward kernel on AVX-512-BF16 dot
// products or on AMX tiles. best_isa() prefers amx_bf16, then avx512; avx512_bf16 is only used
// when asked for: vdpbf16ps issues at half the rate of FMA on the CPUs we know, so it was
// measured slower than widening to float32 (BENCHMARKS.md).
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmxBf16 = 4 };

const char* isa_name(Isa isa);
// "scalar" | "avx2" | "avx512" | "avx512_bf16" | "amx_bf16"
std::optional<Isa> parse_isa(const std::string& name);
std::string isa_choices();  // "scalar, avx2, avx512, avx512_bf16, amx_bf16", for messages

bool isa_compiled(Isa isa);
bool isa_supported_by_cpu(Isa isa);
std::vector<Isa> compiled_isas();
std::vector<Isa> runnable_isas();  // compiled and supported by this CPU, ascending
Isa best_isa();

// Selects the variant from NPU_ATTN_ISA if set, else the best one. Throws std::runtime_error
// naming the variable if it names an unknown variant or one this machine cannot run.
Isa select_isa_from_environment();

Isa active_isa();
void set_active_isa(Isa isa);  // throws std::runtime_error if not runnable here

// Runs the forward kernel of `isa` (default: the active one). Params must be validated.
void run_attention_forward(const AttentionParams& params);
void run_attention_forward(const AttentionParams& params, Isa isa);

// Runs the backward kernel of `isa` (default: the active one). Params must be validated.
void run_attention_backward(const AttentionBackwardParams& params);
void run_attention_backward(const AttentionBackwardParams& params, Isa isa);

// Measured fp32 FMA throughput (GFLOP/s) of `threads` threads using `isa`'s vectors for about
// `seconds`: the denominator of the benchmark's "percent of peak".
double measure_fma_peak_gflops(Isa isa, int threads, double seconds);

}  // namespace npu_attn
