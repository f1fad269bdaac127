// Does the core run the softmax's AVX-512 work while the AMX tile unit computes?
//
// The AMX forward (attention_forward_amx_impl.h) interleaves the exponentials of one unit with
// the tile steps of its neighbours' products, expecting the two engines to overlap. This times
// the two kinds of work of one product step alone and interleaved, as that kernel issues them:
//   tiles:   one step of the products, 2 A and 2 B tile loads and four tdpbf16ps (2x2 block)
//   vectors: `vectors` exponentials of 16 floats each (exp_nonpositive), their running sum and
//            bfloat16 pairs stored, like exp_pair_row's work per portion
//   both:    a step of tiles, then its vectors
// Perfect overlap makes `both` the larger of the two; none makes it their sum.
//   build/cpp/bench/cpp/npu_attn_bench_amx_overlap
// Each benchmark reports time_per_step (in seconds, "n" for ns). Skipped where the CPU has no
// AMX-BF16 (or the OS does not grant its state).
#include "bench_amx_overlap.h"

#include <benchmark/benchmark.h>

#include <cstdint>

#include "dispatch.h"

namespace {

using npu_attn::bench::OverlapWork;

constexpr int64_t kSteps = 1 << 16;

void bench_overlap(benchmark::State& state, OverlapWork work) {
  if (!npu_attn::isa_supported_by_cpu(npu_attn::Isa::amx_bf16)) {
    state.SkipWithError("no AMX-BF16 on this CPU (or the OS does not grant its state)");
    return;
  }
  for (auto _ : state)
    benchmark::DoNotOptimize(npu_attn::bench::run_overlap_steps(work, state.range(0), kSteps));
  state.counters["time_per_step"] = benchmark::Counter(
      static_cast<double>(kSteps),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

// Vectors per step: the AMX forward hands out about 16 per step at head dims 64 (128-key
// blocks: 64 pair rows over 16 tile steps, 4 exponentials of 16 floats per pair row).
void vector_counts(benchmark::internal::Benchmark* b) {
  for (int64_t v : {4, 8, 16, 32}) b->Arg(v);
}

BENCHMARK_CAPTURE(bench_overlap, tiles, OverlapWork::kTiles)->Arg(0);
BENCHMARK_CAPTURE(bench_overlap, vectors, OverlapWork::kVectors)->Apply(vector_counts);
BENCHMARK_CAPTURE(bench_overlap, both, OverlapWork::kBoth)->Apply(vector_counts);

}  // namespace

BENCHMARK_MAIN();
