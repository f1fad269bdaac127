// The work timed by bench_amx_overlap.cpp, built with the amx_bf16 variant's flags (the
// benchmark's registration and main are not, so a CPU without AVX-512 gets a skip, not SIGILL).
#define NPU_ATTN_VEC_BYTES 64
#include <immintrin.h>

#include <cstdint>

#include "bench_amx_overlap.h"
#include "kernels/amx_tiles_impl.h"
#include "kernels/vec_impl.h"

namespace npu_attn::bench {
namespace {

constexpr int64_t kScoreRows = 64;  // S^T rows cycled through (2 vectors of 16 queries each)

struct Buffers {
  alignas(64) uint16_t a[2 * 16 * 32];  // two A tiles (16 rows of 32 bfloat16)
  alignas(64) uint16_t b[2 * 16 * 32];  // two B tiles
  alignas(64) float scores[kScoreRows * 32];
  alignas(64) uint16_t pairs[kScoreRows * 32];
};

NPU_ATTN_VEC_INLINE void tile_step(const Buffers& buf) {
  _tile_loadd(4, buf.a, 64);
  _tile_loadd(5, buf.a + 16 * 32, 64);
  _tile_loadd(6, buf.b, 64);
  _tile_loadd(7, buf.b + 16 * 32, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// `vectors` exponentials (an even count: two per score row) with their sum and bfloat16 pairs.
NPU_ATTN_VEC_INLINE void vector_portion(Buffers& buf, int64_t vectors, int64_t& row, Vec& sum) {
  const Vec shift = splat(3.0f);
  for (int64_t v = 0; v < vectors; v += 2, row = (row + 1) % kScoreRows) {
    const Vec e0 = exp_nonpositive(load(buf.scores + row * 32) - shift);
    const Vec e1 = exp_nonpositive(load(buf.scores + row * 32 + 16) - shift);
    sum += e0 + e1;
    _mm512_store_si512(buf.pairs + row * 32,
                       reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
  }
}

}  // namespace

float run_overlap_steps(OverlapWork work, int64_t vectors, int64_t steps) {
  static Buffers buf;
  for (auto& x : buf.a) x = 0x3f80;  // bfloat16 1.0
  for (auto& x : buf.b) x = 0x3f80;
  for (int64_t i = 0; i < kScoreRows * 32; ++i) buf.scores[i] = static_cast<float>(i % 17) * 0.1f;
  configure_tiles();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  Vec sum = splat(0.0f);
  int64_t row = 0;
  for (int64_t s = 0; s < steps; ++s) {
    if (work != OverlapWork::kVectors) tile_step(buf);
    if (work != OverlapWork::kTiles) vector_portion(buf, vectors, row, sum);
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  float total = out[0];
  for (int i = 0; i < kLanes; ++i) total += sum[i];
  return total;  // returned so nothing is optimised away
}

}  // namespace npu_attn::bench
