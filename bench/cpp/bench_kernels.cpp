// Micro-benchmarks of the tiled forward kernel and the lossy int8 one, per ISA variant and
// element type, on diffusion shapes, without Python in the way (the per-call cost of short
// shapes is visible here, and `perf record` sees the kernels' symbols).
//   build/cpp/bench/cpp/npu_attn_bench_kernels --benchmark_filter='amx_bf16/bfloat16'
//   build/cpp/bench/cpp/npu_attn_bench_kernels --benchmark_filter='^avx2/(int8-)?float32/b2h8'
// Reports GFLOP/s (4 * B * H * Lq * Lk * D flops per forward; the int8 rows count the exact
// kernel's flops, so their rates compare directly).
#include <benchmark/benchmark.h>

#include <random>
#include <string>
#include <vector>

#include "attention.h"
#include "bfloat16.h"
#include "dispatch.h"

namespace {

struct Shape {
  int64_t batch, heads, len_q, len_k, head_dim;
};

// Element types benchmarked: float32 and bfloat16 (what CPU users run).
template <typename T>
struct ElementTraits;
template <>
struct ElementTraits<float> {
  static constexpr npu_attn::DType kDType = npu_attn::DType::kFloat32;
  static float from(float x) { return x; }
};
template <>
struct ElementTraits<uint16_t> {
  static constexpr npu_attn::DType kDType = npu_attn::DType::kBFloat16;
  static uint16_t from(float x) { return npu_attn::bfloat16_bits(x); }
};

// Which forward a benchmark runs: the exact tiled kernel or the lossy int8 one.
enum class Kernel { kExact, kInt8 };

template <typename T>
void bench_forward(benchmark::State& state, npu_attn::Isa isa, Shape s, Kernel kernel) {
  if (!npu_attn::isa_supported_by_cpu(isa)) {
    state.SkipWithError("ISA not supported by this CPU");
    return;
  }
  std::mt19937 rng(0);
  std::normal_distribution<float> dist;
  auto make = [&](int64_t len) {
    std::vector<T> data(s.batch * s.heads * len * s.head_dim);
    for (auto& x : data) x = ElementTraits<T>::from(dist(rng));
    return data;
  };
  std::vector<T> q = make(s.len_q), k = make(s.len_k), v = make(s.len_k), out = make(s.len_q);
  auto view = [&](std::vector<T>& data, int64_t len) {
    npu_attn::TensorView t;
    t.data = data.data();
    t.dtype = ElementTraits<T>::kDType;
    t.shape = {s.batch, s.heads, len, s.head_dim};
    t.strides = {s.heads * len * s.head_dim, len * s.head_dim, s.head_dim, 1};
    return t;
  };
  npu_attn::SdpaArguments args;
  args.query = view(q, s.len_q);
  args.key = view(k, s.len_k);
  args.value = view(v, s.len_k);
  args.out = view(out, s.len_q);
  args.num_threads = static_cast<int>(state.range(0));
  const npu_attn::AttentionParams params = npu_attn::make_attention_params(args);
  for (auto _ : state) {
    if (kernel == Kernel::kInt8) {
      npu_attn::run_attention_int8(params, isa);
    } else {
      npu_attn::run_attention_forward(params, isa);
    }
    benchmark::DoNotOptimize(out.data());
  }
  const double flops = 4.0 * s.batch * s.heads * s.len_q * s.len_k * s.head_dim;
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}

// The int8 kernel a variant runs ("" if none).
std::string int8_kernel_name(npu_attn::Isa isa) {
  const npu_attn::KernelVariant& variant = npu_attn::kernel_variant(isa);
  return variant.int8_forward != nullptr && variant.int8_kernel != nullptr ? variant.int8_kernel
                                                                           : "";
}

void register_all() {
  const std::pair<const char*, Shape> shapes[] = {
      {"sd15_self_4096_d40", {2, 8, 4096, 4096, 40}},
      {"sd15_cross_4096x77_d40", {2, 8, 4096, 77, 40}},
      {"b2h8_4096_d64", {2, 8, 4096, 4096, 64}},
      {"sd15_self_1024_d80", {2, 8, 1024, 1024, 80}},
      {"sd15_self_256_d160", {2, 8, 256, 256, 160}},
      {"sd15_self_64_d160", {2, 8, 64, 64, 160}},
      {"vae_mid_4096_d512", {1, 1, 4096, 4096, 512}},
  };
  const auto add = [](const std::string& name, auto* function, npu_attn::Isa isa, Shape shape,
                      Kernel kernel) {
    benchmark::RegisterBenchmark(name.c_str(), function, isa, shape, kernel)
        ->Arg(1)
        ->Arg(2)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  };
  const std::vector<npu_attn::Isa> isas = npu_attn::runnable_isas();
  for (size_t i = 0; i < isas.size(); ++i) {
    const npu_attn::Isa isa = isas[i];
    const std::string label = std::string(npu_attn::isa_name(isa)) + "/";
    // Rows whose int8 kernel the row before already runs are not repeated.
    const std::string int8_kernel = int8_kernel_name(isa);
    const bool own_int8 =
        !int8_kernel.empty() && (i == 0 || int8_kernel != int8_kernel_name(isas[i - 1]));
    for (const auto& [name, shape] : shapes) {
      add(label + "float32/" + name, bench_forward<float>, isa, shape, Kernel::kExact);
      add(label + "bfloat16/" + name, bench_forward<uint16_t>, isa, shape, Kernel::kExact);
      if (!own_int8) continue;
      add(label + "int8-float32/" + name, bench_forward<float>, isa, shape, Kernel::kInt8);
      add(label + "int8-bfloat16/" + name, bench_forward<uint16_t>, isa, shape, Kernel::kInt8);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
