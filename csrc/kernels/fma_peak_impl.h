// Peak-throughput probes, compiled into each per-ISA translation unit next to its kernels. They
// measure what this machine's compute paths can do, so the benchmark reports a kernel's
// efficiency against the limit of the path it runs on, without assuming clock speeds or port
// counts:
//   measure_fma_peak     fp32 FMA on NPU_ATTN_VEC_BYTES vectors (the float32-compute kernels)
//   measure_dpbf16_peak  vdpbf16ps (bfloat16 pair dot products, needs -mavx512bf16)
//   measure_amx_peak     tdpbf16ps on AMX tiles (needs -mamx-tile -mamx-bf16 and the OS grant)
// Each probe runs independent accumulation chains (enough to hide latency on every port) and
// writes the result to a volatile global: a side effect, so the compiler can neither drop the
// loop nor move it across the timer calls.
#pragma once
#ifndef NPU_ATTN_VEC_BYTES
#error "define NPU_ATTN_VEC_BYTES before including fma_peak_impl.h"
#endif

#include <omp.h>

#include <cstdint>

#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles_impl.h"  // the tile configuration the AMX kernels use
#endif

namespace npu_attn {
namespace {

volatile float g_peak_sink;

// GFLOP/s of `threads` threads each running `work(iterations, seed)` for about `seconds`, where
// one iteration is `flops_per_iteration` floating-point operations.
template <typename Work>
double measure_peak(Work work, double flops_per_iteration, int threads, double seconds) {
  // Calibrate on one thread so the timed run lasts about `seconds`.
  int64_t iterations = 1 << 12;
  for (;;) {
    const double start = omp_get_wtime();
    work(iterations, 1.0f);
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
    work(iterations, static_cast<float>(omp_get_thread_num()));
    const double mine = omp_get_wtime() - start;
#pragma omp critical
    elapsed = mine > elapsed ? mine : elapsed;
  }
  return flops_per_iteration * static_cast<double>(iterations) * threads / elapsed / 1e9;
}

// ---------------------------------------------------------------- fp32 FMA
typedef float PeakVec __attribute__((vector_size(NPU_ATTN_VEC_BYTES)));
constexpr int kPeakLanes = NPU_ATTN_VEC_BYTES / static_cast<int>(sizeof(float));
// Independent chains: enough to cover latency x ports (4 x 2) while leaving registers for the
// two constants (16 registers below AVX-512, 32 with it).
constexpr int kPeakChains = NPU_ATTN_VEC_BYTES == 64 ? 16 : 12;

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

[[maybe_unused]] double measure_fma_peak(int threads, double seconds) {
  return measure_peak(fma_chains, 2.0 * kPeakLanes * kPeakChains, threads, seconds);
}

// ---------------------------------------------------------------- vdpbf16ps
#if defined(__AVX512BF16__)
// One vdpbf16ps: 16 float32 lanes, each += two bfloat16 products: 64 flops.
constexpr int kDpChains = 16;

void dpbf16_chains(int64_t iterations, float seed) {
  __m512 acc[kDpChains];
  for (int c = 0; c < kDpChains; ++c) acc[c] = _mm512_set1_ps(seed + static_cast<float>(c));
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kDpChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  __m512 total = acc[0];
  for (int c = 1; c < kDpChains; ++c) total = _mm512_add_ps(total, acc[c]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, total);
  g_peak_sink = lanes[0] + lanes[15];
}

[[maybe_unused]] double measure_dpbf16_peak(int threads, double seconds) {
  return measure_peak(dpbf16_chains, 64.0 * kDpChains, threads, seconds);
}
#endif

// ---------------------------------------------------------------- AMX tdpbf16ps
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Eight 16-row x 64-byte tiles (kTileConfig): four float32 accumulators (16x16), two A tiles (16
// rows x 32 bfloat16) and two B tiles (16 pair rows x 16 columns): a 2x2 block of products per
// iteration, each 16 x 16 x 32 multiply-adds.
constexpr double kAmxFlopsPerIteration = 4 * 2.0 * 16 * 16 * 32;

void amx_chains(int64_t iterations, float seed) {
  alignas(64) uint16_t a[16 * 32];
  alignas(64) uint16_t b[16 * 32];
  alignas(64) float c[16 * 16];
  for (int i = 0; i < 16 * 32; ++i) {
    a[i] = 0x3f80;  // 1.0
    b[i] = 0x3a83;  // ~1e-3
  }
  configure_tiles();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
  for (int64_t i = 0; i < iterations; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  _tile_release();
  g_peak_sink = c[0] + seed;
}

// Needs the OS permission for AMX state: only call when cpu_features() reports amx_bf16.
[[maybe_unused]] double measure_amx_peak(int threads, double seconds) {
  return measure_peak(amx_chains, kAmxFlopsPerIteration, threads, seconds);
}
#endif

}  // namespace
}  // namespace npu_attn
