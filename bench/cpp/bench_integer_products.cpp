// How many multiply-adds per second each AVX2 product instruction sequence sustains on this
// core, with register operands (nothing from memory), against the float32 FMA loop.
//
// The int8 kernel (attention_int8_impl.h) is only as fast as these: Q·Kᵀ uses the 8-bit
// sequence (vpmaddubsw, then vpmaddwd against ones to widen the saturating 16-bit pair sums,
// then vpaddd), P·V the 16-bit one (vpmaddwd, vpaddd). The 8-bit sequence with 16-bit
// accumulation (vpaddsw) is the ceiling of a scheme whose sums may not leave 16 bits.
//   build/cpp/bench/cpp/npu_attn_bench_integer_products
// Each benchmark reports GMAC (per second: "GMAC=49.3/s" is 49.3 G): multiply-adds of the products'
// inputs, so 8 per float32 FMA, 16 per vpmaddwd, 32 per vpmaddubsw. Compare the ratios, not the
// rates, on a shared VM. Skipped where the CPU has no AVX2 (and on other architectures).
#include <benchmark/benchmark.h>

#include <cstdint>

#include "dispatch.h"

namespace {

constexpr int64_t kUnrolls = 1 << 14;  // loop trips per benchmark iteration

#if defined(__x86_64__)
#define NPU_ATTN_REPEAT8(X) X X X X X X X X

// Ten independent accumulators: enough to hide the FMA's 4-5 cycle latency on two pipes.
void fma_loop(int64_t trips) {
  for (int64_t i = 0; i < trips; ++i)
    asm volatile(
        NPU_ATTN_REPEAT8(
            "vfmadd231ps %%ymm14, %%ymm15, %%ymm0\n vfmadd231ps %%ymm14, %%ymm15, %%ymm1\n"
            "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n vfmadd231ps %%ymm14, %%ymm15, %%ymm3\n"
            "vfmadd231ps %%ymm14, %%ymm15, %%ymm4\n vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n"
            "vfmadd231ps %%ymm14, %%ymm15, %%ymm6\n vfmadd231ps %%ymm14, %%ymm15, %%ymm7\n"
            "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n vfmadd231ps %%ymm14, %%ymm15, %%ymm9\n")::
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9");
}
constexpr double kFmaMacsPerTrip = 8 * 10 * 8;

// One product (MUL) into a scratch register and its sum added into an accumulator (ADD), on
// four independent register pairs.
#define NPU_ATTN_PRODUCT_AND_SUM(MUL, ADD)                                  \
  MUL " %%ymm14, %%ymm15, %%ymm0\n " ADD " %%ymm0, %%ymm8, %%ymm8\n " MUL   \
      " %%ymm14, %%ymm15, %%ymm1\n " ADD " %%ymm1, %%ymm9, %%ymm9\n " MUL   \
      " %%ymm14, %%ymm15, %%ymm2\n " ADD " %%ymm2, %%ymm10, %%ymm10\n " MUL \
      " %%ymm14, %%ymm15, %%ymm3\n " ADD " %%ymm3, %%ymm11, %%ymm11\n"

void words_loop(int64_t trips) {
  for (int64_t i = 0; i < trips; ++i)
    asm volatile(NPU_ATTN_REPEAT8(NPU_ATTN_PRODUCT_AND_SUM("vpmaddwd", "vpaddd"))::
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm8", "xmm9", "xmm10", "xmm11");
}
constexpr double kWordsMacsPerTrip = 8 * 4 * 16;

void bytes_widened_loop(int64_t trips) {
  for (int64_t i = 0; i < trips; ++i)
    asm volatile(
        NPU_ATTN_REPEAT8("vpmaddubsw %%ymm14, %%ymm15, %%ymm0\n vpmaddwd %%ymm0, %%ymm13, %%ymm0\n"
                         "vpaddd %%ymm0, %%ymm8, %%ymm8\n"
                         "vpmaddubsw %%ymm14, %%ymm15, %%ymm1\n vpmaddwd %%ymm1, %%ymm13, %%ymm1\n"
                         "vpaddd %%ymm1, %%ymm9, %%ymm9\n"
                         "vpmaddubsw %%ymm14, %%ymm15, %%ymm2\n vpmaddwd %%ymm2, %%ymm13, %%ymm2\n"
                         "vpaddd %%ymm2, %%ymm10, %%ymm10\n"
                         "vpmaddubsw %%ymm14, %%ymm15, %%ymm3\n vpmaddwd %%ymm3, %%ymm13, %%ymm3\n"
                         "vpaddd %%ymm3, %%ymm11, %%ymm11\n")::
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm8", "xmm9", "xmm10", "xmm11");
}
constexpr double kBytesMacsPerTrip = 8 * 4 * 32;

void bytes_16bit_sums_loop(int64_t trips) {
  for (int64_t i = 0; i < trips; ++i)
    asm volatile(NPU_ATTN_REPEAT8(NPU_ATTN_PRODUCT_AND_SUM("vpmaddubsw", "vpaddsw"))::
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm8", "xmm9", "xmm10", "xmm11");
}

void bench_products(benchmark::State& state, void (*loop)(int64_t), double macs_per_trip) {
  if (!npu_attn::isa_supported_by_cpu(npu_attn::Isa::avx2)) {
    state.SkipWithError("no AVX2 on this CPU");
    return;
  }
  for (auto _ : state) loop(kUnrolls);
  state.counters["GMAC"] = benchmark::Counter(kUnrolls * macs_per_trip * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK_CAPTURE(bench_products, fp32_vfmadd231ps, fma_loop, kFmaMacsPerTrip);
BENCHMARK_CAPTURE(bench_products, int16_vpmaddwd, words_loop, kWordsMacsPerTrip);
BENCHMARK_CAPTURE(bench_products, int8_vpmaddubsw_widened, bytes_widened_loop, kBytesMacsPerTrip);
BENCHMARK_CAPTURE(bench_products, int8_vpmaddubsw_16bit_sums, bytes_16bit_sums_loop,
                  kBytesMacsPerTrip);
#endif

}  // namespace

BENCHMARK_MAIN();
