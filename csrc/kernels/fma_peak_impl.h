// ISA-neutral FMA throughput probe, compiled into each per-ISA translation unit next to the
// attention kernel (same NPU_ATTN_VEC_BYTES). It measures this machine's fp32 FMA peak so the
// benchmark can report a kernel's efficiency without assuming clock speeds or port counts.
#ifndef NPU_ATTN_VEC_BYTES
#error "define NPU_ATTN_VEC_BYTES before including fma_peak_impl.h"
#endif

#include <omp.h>

#include <cstdint>

namespace npu_attn {
namespace {

typedef float PeakVec __attribute__((vector_size(NPU_ATTN_VEC_BYTES)));
constexpr int kPeakLanes = NPU_ATTN_VEC_BYTES / static_cast<int>(sizeof(float));
// Independent FMA chains: enough to cover latency x ports (4 x 2) while leaving registers for
// the two constants (16 registers below AVX-512, 32 with it).
constexpr int kPeakChains = NPU_ATTN_VEC_BYTES == 64 ? 16 : 12;

volatile float g_peak_sink;

// Runs `iterations` rounds of kPeakChains dependent FMAs. The result goes to a volatile global:
// a side effect, so the compiler can neither drop the loop nor move it across the timer calls
// (a pure computation could legally be scheduled after omp_get_wtime()).
void fma_chains(int64_t iterations, float seed) {
  PeakVec acc[kPeakChains];
  const PeakVec mul = PeakVec{} + 0.999999f;
  const PeakVec add = PeakVec{} + 1e-7f;
  for (int c = 0; c < kPeakChains; ++c) acc[c] = PeakVec{} + (seed + static_cast<float>(c));
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kPeakChains; ++c) acc[c] = acc[c] * mul + add;
  }
  float sum = 0.0f;
  for (int c = 0; c < kPeakChains; ++c)
    for (int l = 0; l < kPeakLanes; ++l) sum += acc[c][l];
  g_peak_sink = sum;
}

// GFLOP/s of `threads` threads each running fma_chains for about `seconds`.
double measure_fma_peak(int threads, double seconds) {
  // Calibrate on one thread so the timed run lasts about `seconds`.
  int64_t iterations = 1 << 16;
  for (;;) {
    const double start = omp_get_wtime();
    fma_chains(iterations, 1.0f);
    const double elapsed = omp_get_wtime() - start;
    if (elapsed > seconds / 8 || iterations > (int64_t{1} << 34)) {
      iterations = static_cast<int64_t>(iterations * seconds / (elapsed > 0 ? elapsed : 1e-9));
      break;
    }
    iterations *= 4;
  }
  double elapsed = 0;
#pragma omp parallel num_threads(threads)
  {
#pragma omp barrier
    const double start = omp_get_wtime();
    fma_chains(iterations, static_cast<float>(omp_get_thread_num()));
    const double mine = omp_get_wtime() - start;
#pragma omp critical
    elapsed = mine > elapsed ? mine : elapsed;
  }
  const double flops = 2.0 * kPeakLanes * kPeakChains * static_cast<double>(iterations) * threads;
  return flops / elapsed / 1e9;
}

}  // namespace
}  // namespace npu_attn
