// The float32 kernel's two products over K and V panels (broadcast_fma_panels, 256-bit vectors)
// as one task of the VAE mid-block runs them: 64 queries at head dim 512, key tiles of 510
// keys, S^T = K_tile Q^T into a 510 x 64 tile, then O^T += V_tile^T P^T. One thread, nothing
// else: how close the products come to the FMA peak by themselves, and how much of that they
// keep once K and V no longer stay in the caches (1020 keys: 4 MiB of K and V; 4080 keys, the
// VAE at 512px: 16 MiB, streamed once per task; 8160 keys: 32 MiB).
//   build/cpp/bench/cpp/npu_attn_bench_panel_products
// Reports GFLOP/s (2 flops per multiply-add). Skipped where the CPU has no AVX2 (and on other
// architectures).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "dispatch.h"

#if defined(__x86_64__)
#define NPU_ATTN_VEC_BYTES 32
#include "kernels/vec_impl.h"
#endif

namespace {

#if defined(__x86_64__)
constexpr int64_t kDim = 512;       // head dim of K and V
constexpr int64_t kQueries = 64;    // one task's query tile
constexpr int64_t kTileKeys = 510;  // kKeyTile rounded down to whole panels
constexpr int kVecs = kQueries / npu_attn::kLanes;

struct Buffer {
  explicit Buffer(int64_t floats)
      : data(static_cast<float*>(std::aligned_alloc(64, (floats * 4 + 63) / 64 * 64))) {
    for (int64_t i = 0; i < floats; ++i) data.get()[i] = static_cast<float>(i % 7) * 0.01f;
  }
  float* get() const { return data.get(); }
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data;
};

enum class Products { kScores, kValues, kBoth };

// state.range(0): keys (a multiple of 6).
void bench_panel_products(benchmark::State& state, Products products) {
  if (!npu_attn::isa_supported_by_cpu(npu_attn::Isa::avx2)) {
    state.SkipWithError("no AVX2 on this CPU");
    return;
  }
  using npu_attn::kBlockRows;
  const int64_t keys = state.range(0);
  Buffer k_panels(keys * kDim), v_panels(keys * kDim), qt(kDim * kQueries),
      st(kTileKeys * kQueries), ot(kDim * kQueries);
  const bool scores = products != Products::kValues, values = products != Products::kScores;
  for (auto _ : state) {
    for (int64_t k0 = 0; k0 < keys; k0 += kTileKeys) {
      const int64_t tile = std::min(kTileKeys, keys - k0);
      if (scores) {  // K panels: kBlockRows keys x kDim, one after another
        npu_attn::broadcast_fma_panels<false>(k_panels.get() + k0 * kDim, kBlockRows * kDim,
                                              qt.get(), kQueries, kDim, tile, kVecs, st.get(),
                                              kQueries);
      }
      if (values) {  // V panels: kBlockRows channels x every key
        npu_attn::broadcast_fma_panels<true>(v_panels.get() + k0 * kBlockRows, kBlockRows * keys,
                                             st.get(), kQueries, tile, kDim, kVecs, ot.get(),
                                             kQueries);
      }
    }
    benchmark::DoNotOptimize(ot.get());
    benchmark::DoNotOptimize(st.get());
  }
  const double flops = 2.0 * keys * kDim * kQueries * (scores && values ? 2 : 1);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
#else
enum class Products { kScores, kValues, kBoth };
void bench_panel_products(benchmark::State& state, Products) {
  state.SkipWithError("x86-64 only");
}
#endif

}  // namespace

BENCHMARK_CAPTURE(bench_panel_products, scores, Products::kScores)->Arg(1020)->Arg(4080);
BENCHMARK_CAPTURE(bench_panel_products, values, Products::kValues)->Arg(1020)->Arg(4080);
BENCHMARK_CAPTURE(bench_panel_products, both, Products::kBoth)->Arg(1020)->Arg(4080)->Arg(8160);

BENCHMARK_MAIN();
