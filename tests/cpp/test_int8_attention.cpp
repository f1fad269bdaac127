// The lossy int8 forward (attention_int8_impl.h) against the double-precision reference, for
// every variant this CPU can run: accuracy on activations shaped like a diffusion model's, the
// integer part identical across variants, determinism, and the float kernel's semantics (masks,
// causal, GQA, layouts, empty and fully masked rows, NaN).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attention.h"
#include "attention_cases.h"
#include "dispatch.h"
#include "reference.h"
#include "test_support.h"
#if defined(NPU_ATTN_TEST_VNNI_EMULATION)
#include "vnni_emulated.h"
#endif

namespace npu_attn::testing {
namespace {

// Inputs like a diffusion model's attention activations (SageAttention's observation): keys
// carry per-channel offsets about ten times their per-token spread, and a few query channels are
// about eight times the others.
void make_diffusion_like(const Case& c, Problem& pr, uint32_t seed) {
  std::mt19937 rng(seed + 11);
  std::normal_distribution<float> offset(0.0f, 10.0f);
  std::vector<float> channel_offset(c.head_dim);
  for (float& x : channel_offset) x = offset(rng);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads_kv; ++h)
      for (int64_t j = 0; j < c.len_k; ++j)
        for (int64_t d = 0; d < c.head_dim; ++d) pr.k.at({b, h, j, d}) += channel_offset[d];
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads_q; ++h)
      for (int64_t i = 0; i < c.len_q; ++i)
        for (int64_t d = 0; d < c.head_dim; d += 16) pr.q.at({b, h, i, d}) *= 8.0f;
}

struct Accuracy {
  double cosine;       // of the whole output against the reference
  double relative_l1;  // sum |out - ref| / sum |ref|
};

Accuracy compare(const FloatTensor& out, const FloatTensor& ref) {
  double dot = 0, nn = 0, rr = 0, l1 = 0, ref_l1 = 0;
  const auto& s = out.shape;
  for (int64_t i0 = 0; i0 < s[0]; ++i0)
    for (int64_t i1 = 0; i1 < s[1]; ++i1)
      for (int64_t i2 = 0; i2 < s[2]; ++i2)
        for (int64_t i3 = 0; i3 < s[3]; ++i3) {
          const double x = out.storage[out.offset({i0, i1, i2, i3})];
          const double y = ref.storage[ref.offset({i0, i1, i2, i3})];
          dot += x * y;
          nn += x * x;
          rr += y * y;
          l1 += std::fabs(x - y);
          ref_l1 += std::fabs(y);
        }
  if (rr == 0) return {nn == 0 ? 1.0 : 0.0, nn == 0 ? 0.0 : INFINITY};
  return {dot / std::sqrt(nn * rr), l1 / ref_l1};
}

// int8 output of `isa` against the float64 reference output `ref` of the same problem in any
// layout (fill_normal fills logical order), computed first if empty.
Accuracy int8_accuracy(const Case& c, Isa isa, bool diffusion_like, std::optional<FloatTensor>& ref,
                       uint32_t seed = 1) {
  Problem pr;
  build(c, pr, seed);
  if (diffusion_like) make_diffusion_like(c, pr, seed);
  run_attention_int8(make_attention_params(pr.args), isa);
  if (!ref) {
    compute_reference(pr);
    ref = pr.ref_out;
  }
  return compare(pr.out, *ref);
}

Accuracy int8_accuracy(const Case& c, Isa isa, bool diffusion_like, uint32_t seed = 1) {
  std::optional<FloatTensor> ref;
  return int8_accuracy(c, isa, diffusion_like, ref, seed);
}

void expect_accurate(const Case& c, Isa isa, bool diffusion_like, double min_cosine, double max_l1,
                     std::optional<FloatTensor>& ref) {
  SCOPED_TRACE(c.describe() + " isa=" + isa_name(isa) + (diffusion_like ? " diffusion-like" : ""));
  const Accuracy a = int8_accuracy(c, isa, diffusion_like, ref);
  EXPECT_GE(a.cosine, min_cosine);
  EXPECT_LE(a.relative_l1, max_l1);
}

void expect_accurate(const Case& c, Isa isa, bool diffusion_like, double min_cosine,
                     double max_l1) {
  std::optional<FloatTensor> ref;
  expect_accurate(c, isa, diffusion_like, min_cosine, max_l1, ref);
}

class Int8EveryIsa : public PerVariant {};

// The accuracy bar of the int8 strategy: cosine >= 0.999 and relative L1 <= 3e-2.
constexpr double kMinCosine = 0.999;
constexpr double kMaxRelativeL1 = 3e-2;

TEST_P(Int8EveryIsa, AccurateOnDiffusionLikeActivations) {
  std::vector<Case> cases;
  for (int64_t d : {40, 59, 64, 72, 80, 128, 160, 512}) {
    cases.push_back({1, 2, 2, 300, 600, d, d});  // two key tiles, a ragged one
    cases.push_back({2, 1, 1, 130, 77, d, d});   // cross-attention to 77 text tokens
  }
  cases.push_back({1, 1, 1, 1, 1, 64, 64});       // length 1
  cases.push_back({1, 3, 3, 1, 300, 40, 40});     // one query
  cases.push_back({1, 8, 2, 90, 120, 64, 64});    // GQA 4:1
  cases.push_back({1, 2, 2, 100, 100, 40, 130});  // Dv != D
  for (Case c : cases) {
    std::optional<FloatTensor> ref;  // one reference for the three layouts
    for (Layout layout : {Layout::kBHSD, Layout::kBSHD, Layout::kBHDS}) {
      c.layout = layout;
      expect_accurate(c, GetParam(), true, kMinCosine, kMaxRelativeL1, ref);
    }
  }
}

// K and V too large to stay in cache between tasks (over 32 MiB as float32), where the float
// side runs 128-query tiles (with 256-bit vectors where the core's L2 holds them: planned here
// for a 2 MiB L2 and for a 256 KiB one, so both heights run on any CPU). Referenced on sampled
// queries only (both sides of the tile boundaries and the ragged last tile); one thread, so the
// tall tiles are kept.
TEST_P(Int8EveryIsa, AccurateWithStreamedKeyValues) {
  const std::string skip = no_streamed_tiles_reason(GetParam());
  if (!skip.empty()) GTEST_SKIP() << skip;
  const Case c{1, 2, 1, 257, 8200, 512, 512};  // K and V: 8200 x 1024 floats, 33.6 MB
  const std::vector<int64_t> sampled = {0, 63, 64, 127, 128, 255, 256};
  for (int64_t l2_bytes : {int64_t{2} << 20, int64_t{256} << 10}) {
    SCOPED_TRACE("planned for an L2 of " + std::to_string(l2_bytes) + " bytes");
    PlanningL2 l2(l2_bytes);
    Problem pr;
    build(c, pr, 3);
    make_diffusion_like(c, pr, 3);
    pr.args.num_threads = 1;
    run_attention_int8(make_attention_params(pr.args), GetParam());
    const Problem sub = reference_for_sampled_queries(c, pr, sampled);
    FloatTensor out({1, c.heads_q, int64_t(sampled.size()), c.head_dim_v});
    for (int64_t h = 0; h < c.heads_q; ++h)
      for (size_t i = 0; i < sampled.size(); ++i)
        for (int64_t d = 0; d < c.head_dim_v; ++d)
          out.at({0, h, int64_t(i), d}) = pr.out.at({0, h, sampled[i], d});
    const Accuracy a = compare(out, sub.ref_out);
    EXPECT_GE(a.cosine, kMinCosine);
    EXPECT_LE(a.relative_l1, kMaxRelativeL1);
  }
}

TEST_P(Int8EveryIsa, AccurateOnGaussianInputs) {
  for (int64_t d : {40, 64, 160})
    expect_accurate({2, 2, 2, 200, 700, d, d}, GetParam(), false, kMinCosine, kMaxRelativeL1);
}

TEST_P(Int8EveryIsa, AccurateWithMasksAndCausal) {
  const std::vector<Case> bases = {{2, 4, 4, 97, 97, 64, 64},
                                   {1, 2, 2, 130, 77, 40, 40},
                                   {2, 4, 2, 70, 600, 80, 80},
                                   {1, 1, 1, 300, 90, 59, 59}};
  for (Case c : bases) {
    for (MaskCase m : {MaskCase::kNone, MaskCase::kBoolFull, MaskCase::kBoolKeyPadding,
                       MaskCase::kAdditiveFull, MaskCase::kAdditiveHeads}) {
      for (bool causal : {false, true}) {
        c.mask = m;
        c.causal = causal;
        expect_accurate(c, GetParam(), true, kMinCosine, kMaxRelativeL1);
      }
    }
  }
}

// Quantization is lossy: the check above must be able to fail. Rounding Q and K to 8 and 7 bits
// leaves a measurable error, far above the float32 kernel's 1e-5.
TEST_P(Int8EveryIsa, ErrorIsThatOfEightBitCodesNotZero) {
  const Accuracy a = int8_accuracy({1, 2, 2, 200, 700, 64, 64}, GetParam(), true);
  EXPECT_GT(a.relative_l1, 1e-4);
}

TEST_P(Int8EveryIsa, DeterministicAndIndependentOfThreads) {
  const Case c{2, 4, 2, 130, 600, 72, 72};
  Problem one, two;
  build(c, one, 3);
  build(c, two, 3);
  make_diffusion_like(c, one, 3);
  make_diffusion_like(c, two, 3);
  one.args.num_threads = 1;
  two.args.num_threads = 2;
  run_attention_int8(make_attention_params(one.args), GetParam());
  run_attention_int8(make_attention_params(two.args), GetParam());
  EXPECT_EQ(one.out.storage, two.out.storage);
  run_attention_int8(make_attention_params(two.args), GetParam());
  EXPECT_EQ(one.out.storage, two.out.storage);
}

TEST_P(Int8EveryIsa, FullyMaskedRowsAndEmptyKeysGiveZeros) {
  Case c{1, 2, 2, 40, 90, 64, 64};
  c.mask = MaskCase::kBoolFull;
  Problem pr;
  build(c, pr, 5);
  for (int64_t j = 0; j < c.len_k; ++j) pr.boolean.at({0, 1, 7, j}) = 0;
  run_attention_int8(make_attention_params(pr.args), GetParam());
  for (int64_t d = 0; d < c.head_dim_v; ++d) EXPECT_EQ(pr.out.at({0, 1, 7, d}), 0.0f);
  EXPECT_TRUE(std::isinf(pr.lse.at({0, 1, 7})));

  Case empty{1, 2, 2, 10, 0, 64, 64};
  Problem pe;
  build(empty, pe, 5);
  run_attention_int8(make_attention_params(pe.args), GetParam());
  for (float x : pe.out.storage) EXPECT_EQ(x, 0.0f);
}

TEST_P(Int8EveryIsa, MinFloatPaddingMasksKeepTheAccuracyBar) {
  // The int8 kernel's softmax is the float32 kernel's: rows a torch.finfo(float32).min mask
  // hides entirely average the values, and left padding beyond a key tile moves the running
  // maximum from -FLT_MAX (hide_keys_with_min_float).
  const Case c{1, 2, 2, 40, 700, 64, 64, Layout::kBHSD, MaskCase::kAdditiveFull};
  Problem pr;
  build(c, pr, 5);
  make_diffusion_like(c, pr, 5);
  hide_keys_with_min_float(pr, 560);
  run_attention_int8(make_attention_params(pr.args), GetParam());
  compute_reference(pr);
  const Accuracy a = compare(pr.out, pr.ref_out);
  EXPECT_GE(a.cosine, kMinCosine);
  EXPECT_LE(a.relative_l1, kMaxRelativeL1);
}

TEST_P(Int8EveryIsa, NanInAQueryOrKeyReachesTheOutput) {
  const Case c{1, 1, 1, 20, 30, 40, 40};
  Problem pr;
  build(c, pr, 9);
  pr.q.at({0, 0, 3, 5}) = NAN;
  run_attention_int8(make_attention_params(pr.args), GetParam());
  EXPECT_TRUE(std::isnan(pr.out.at({0, 0, 3, 0})));
  EXPECT_FALSE(std::isnan(pr.out.at({0, 0, 4, 0})));
  Problem pk;
  build(c, pk, 9);
  pk.k.at({0, 0, 11, 2}) = INFINITY;
  run_attention_int8(make_attention_params(pk.args), GetParam());
  EXPECT_TRUE(std::isnan(pk.out.at({0, 0, 0, 0})));
}

// A non-finite value reaches its channel of every query (exact attention: 0 * NaN is NaN) and no
// other channel.
TEST_P(Int8EveryIsa, NanOrInfInAValueReachesItsChannel) {
  const Case c{1, 1, 1, 20, 30, 40, 40};
  for (float bad : {NAN, INFINITY}) {
    Problem pr;
    build(c, pr, 9);
    pr.v.at({0, 0, 11, 2}) = bad;
    run_attention_int8(make_attention_params(pr.args), GetParam());
    for (int64_t i = 0; i < c.len_q; ++i) {
      EXPECT_FALSE(std::isfinite(pr.out.at({0, 0, i, 2})));
      EXPECT_TRUE(std::isfinite(pr.out.at({0, 0, i, 3})));
    }
  }
}

// One key far above a long tail of equal scores: each tail probability is e^-10 = 4.5e-5 of the
// top one, a code of 0.74 at the integer P*V's absolute step of 1 / 16383, and values with a
// common offset turn a rounding bias of the tail into an output error (rounding every tail
// code to 1 measured a 5% relative L1 here). The tail's codes must keep its total weight.
TEST_P(Int8EveryIsa, ALongTailOfSmallProbabilitiesKeepsItsWeight) {
  const Case c{1, 1, 1, 64, 4096, 64, 64};
  Problem pr;
  build(c, pr, 2);
  for (float& x : pr.q.storage) x = 0.0f;
  for (float& x : pr.k.storage) x = 0.0f;
  for (float& x : pr.v.storage) x = 1.0f + 0.1f * x;  // a common offset
  for (int64_t i = 0; i < c.len_q; ++i) pr.q.at({0, 0, i, 0}) = 1.0f;
  pr.k.at({0, 0, 7, 0}) = 10.0f * std::sqrt(64.0f);  // score 10 after the 1 / sqrt(D) scale
  run_attention_int8(make_attention_params(pr.args), GetParam());
  compute_reference(pr);
  EXPECT_LE(compare(pr.out, pr.ref_out).relative_l1, 3e-3);
}

// With Q = 0 every score is exactly 0 (zero codes), so the output is the mean of V over the
// keys and its error is P*V's alone: float32 FMA (exact to rounding) or, on AVX2, 11-bit value
// codes (about 1e-3 relative L1 on Gaussian values).
TEST_P(Int8EveryIsa, ValueProductErrorAlone) {
  for (int64_t d : {40, 64, 160, 512}) {
    const Case c{1, 2, 2, 70, 700, d, d};
    Problem pr;
    build(c, pr, 6);
    for (float& x : pr.q.storage) x = 0.0f;
    run_attention_int8(make_attention_params(pr.args), GetParam());
    compute_reference(pr);
    SCOPED_TRACE(c.describe());
    EXPECT_LE(compare(pr.out, pr.ref_out).relative_l1, 2e-3);
  }
}

// The largest sums the integer P*V can make: every probability 1 (Q = 0) and every value at its
// channel's maximum, over 512 keys (four full 128-key passes): each pass sums 64 key pairs of
// 2 * 16383 * 1023, just under 2^31. An overflow would wrap to a negative sum.
TEST_P(Int8EveryIsa, FullIntegerPassesDoNotOverflow) {
  const Case c{1, 1, 1, 16, 512, 8, 8};
  Problem pr;
  build(c, pr, 3);
  for (float& x : pr.q.storage) x = 0.0f;
  for (int64_t j = 0; j < c.len_k; ++j)
    for (int64_t d = 0; d < c.head_dim_v; ++d) pr.v.at({0, 0, j, d}) = d % 2 ? -3.0f : 3.0f;
  run_attention_int8(make_attention_params(pr.args), GetParam());
  for (int64_t i = 0; i < c.len_q; ++i)
    for (int64_t d = 0; d < c.head_dim_v; ++d)
      EXPECT_NEAR(pr.out.at({0, 0, i, d}), d % 2 ? -3.0f : 3.0f, 1e-4f);
}

INSTANTIATE_TEST_SUITE_P(Kernels, Int8EveryIsa, ::testing::ValuesIn(compiled_isas()),
                         variant_test_name);

// Every variant runs the same method: outputs differ where float32 rounding (FMA contraction,
// vector widths) moved a value across a code boundary, and by P*V's precision (float32 here,
// 16-bit codes with AVX2 and bfloat16 pairs with AVX512-BF16: about 1e-3 relative L1 on these
// Gaussian values, ValueProductErrorAlone),
// far below the method's own error (AccurateOnDiffusionLikeActivations: relative L1 up to 3e-2).
// P*V on bfloat16 pairs (the avx512_bf16 int8 kernel) rounds P and V to 8-bit mantissas, 2^-9
// each at most, so one output can move by about 2^-8 of the outputs' scale; 16-bit codes (V in
// 11 bits) and float32 stay within 2e-3.
double max_abs_bound(Isa isa) {
#if defined(__x86_64__)
  if (std::string(kernel_variant(isa).int8_kernel) == kernel_variant(Isa::avx512_bf16).int8_kernel)
    return 0x1p-8;
#endif
  (void)isa;
  return 2e-3;
}

TEST(Int8Variants, AgreeWithThePortableKernel) {
  const Case c{2, 4, 2, 130, 600, 80, 80};
  Problem portable;
  build(c, portable, 4);
  make_diffusion_like(c, portable, 4);
  run_attention_int8(make_attention_params(portable.args), Isa::scalar);
  for (Isa isa : runnable_isas()) {
    SCOPED_TRACE(isa_name(isa));
    Problem pr;
    build(c, pr, 4);
    make_diffusion_like(c, pr, 4);
    run_attention_int8(make_attention_params(pr.args), isa);
    EXPECT_LE(max_abs_diff(pr.out, portable.out),
              max_abs_bound(isa) * std::max(1.0, max_abs(portable.out)));
    EXPECT_LE(compare(pr.out, portable.out).relative_l1, 3e-3);
  }
}

TEST(Int8Variants, TheDefaultIsTheMostSpecialisedInt8Kernel) {
  const Isa chosen = default_int8_isa(cpu_features());
  EXPECT_TRUE(isa_supported_by_cpu(chosen));
  EXPECT_STREQ(kernel_variant(chosen).int8_kernel,
               kernel_variant(runnable_isas().back()).int8_kernel);
}

#if defined(__x86_64__)
// The x86 int8 kernels compute the AVX2 scheme's integer sums exactly on their own units (VNNI:
// Q codes + 128, minus 128 x the key's code sum; AMX: signed x signed bytes, K rows padded to
// whole tiles), and everything in floating point is the same source: each output must equal the
// avx2 int8 kernel's bit for bit on the whole grid (head dims, one query, 77 keys, GQA,
// Dv != D, layouts, masks, causal). `run` is the kernel under test.
using Int8Kernel = std::function<void(const AttentionParams&)>;

void expect_equal_to_avx2(const Int8Kernel& run, const Case& c, uint32_t seed) {
  SCOPED_TRACE(c.describe());
  Problem avx2, other;
  for (Problem* pr : {&avx2, &other}) {
    build(c, *pr, seed);
    make_diffusion_like(c, *pr, seed);
  }
  run_attention_int8(make_attention_params(avx2.args), Isa::avx2);
  run(make_attention_params(other.args));
  EXPECT_EQ(other.out.storage, avx2.out.storage);
  EXPECT_EQ(other.lse.storage, avx2.lse.storage);
}

void expect_equal_to_avx2_on_the_grid(const Int8Kernel& run) {
  std::vector<Case> cases;
  for (int64_t d : {40, 59, 64, 72, 80, 160, 512}) {
    cases.push_back({1, 2, 2, 130, 600, d, d});  // two key tiles, a ragged one
    cases.push_back({2, 1, 1, 64, 77, d, d});    // cross-attention to 77 text tokens
  }
  cases.push_back({1, 1, 1, 1, 1, 64, 64});       // length 1
  cases.push_back({1, 3, 3, 5, 17, 40, 40});      // keys one past a whole C tile, few queries
  cases.push_back({1, 8, 2, 90, 120, 64, 64});    // GQA 4:1
  cases.push_back({1, 2, 2, 100, 100, 40, 130});  // Dv != D
  uint32_t seed = 1;
  for (Case c : cases) {
    for (Layout layout : {Layout::kBHSD, Layout::kBSHD, Layout::kBHDS}) {
      c.layout = layout;
      expect_equal_to_avx2(run, c, seed++);
    }
  }
  for (MaskCase m : {MaskCase::kBoolFull, MaskCase::kBoolKeyPadding, MaskCase::kAdditiveHeads}) {
    for (bool causal : {false, true}) {
      Case c{2, 4, 2, 97, 300, 72, 72};
      c.mask = m;
      c.causal = causal;
      expect_equal_to_avx2(run, c, seed++);
    }
  }
}

// On the real units, where this CPU has them (AVX-VNNI, AVX512-VNNI, AMX-INT8; on any AVX2 CPU
// their code also runs on emulated units: EmulatedInt8Units below).
class Int8IntegerUnits : public PerVariant {};

TEST_P(Int8IntegerUnits, EqualTheAvx2KernelBitForBit) {
  const std::string kernel = kernel_variant(GetParam()).int8_kernel;
  if (kernel == kernel_variant(Isa::avx2).int8_kernel ||
      kernel == kernel_variant(Isa::scalar).int8_kernel)
    GTEST_SKIP() << "variant '" << isa_name(GetParam()) << "' runs the " << kernel
                 << " kernel, with no integer unit of its own";
  if (kernel == kernel_variant(Isa::avx512_bf16).int8_kernel)
    GTEST_SKIP() << "variant '" << isa_name(GetParam()) << "' runs P*V on bfloat16 pairs "
                 << "(vdpbf16ps), not on the avx2 kernel's 16-bit codes: its outputs differ by "
                    "P*V's rounding (Int8Variants.AgreeWithThePortableKernel and the accuracy "
                    "tests hold it)";
  const Isa isa = GetParam();
  expect_equal_to_avx2_on_the_grid(
      [isa](const AttentionParams& params) { run_attention_int8(params, isa); });
}

INSTANTIATE_TEST_SUITE_P(Kernels, Int8IntegerUnits, ::testing::ValuesIn(compiled_isas()),
                         variant_test_name);
#endif

#if defined(NPU_ATTN_TEST_VNNI_EMULATION)
// The int8 kernel's code for integer units this CPU may not have, on emulations of them, on any
// AVX2 CPU: the VNNI code (avx_vnni, avx512_vnni) on emulated vpdpbusd/vpdpwssd, and the AMX-INT8
// code (amx_int8) on the software tile unit: bit for bit the avx2 kernel's output, as on the real
// units (Int8IntegerUnits).
struct EmulatedKernel {
  const char* name;
  void (*run)(const AttentionParams& params);
};

class EmulatedInt8Units : public ::testing::TestWithParam<EmulatedKernel> {
 protected:
  void SetUp() override {
    if (!isa_supported_by_cpu(Isa::avx2))
      GTEST_SKIP() << "the emulated kernels are built with the avx2 variant's flags";
  }
};

TEST_P(EmulatedInt8Units, EqualsTheAvx2KernelBitForBit) {
  expect_equal_to_avx2_on_the_grid(GetParam().run);
}

// Not only equal to the avx2 kernel: the accuracy bar itself, and an error that is really there.
TEST_P(EmulatedInt8Units, AccurateOnDiffusionLikeActivations) {
  for (int64_t d : {40, 80, 160}) {
    const Case c{1, 2, 2, 300, 600, d, d};
    SCOPED_TRACE(c.describe());
    Problem pr;
    build(c, pr, 2);
    make_diffusion_like(c, pr, 2);
    GetParam().run(make_attention_params(pr.args));
    compute_reference(pr);
    const Accuracy a = compare(pr.out, pr.ref_out);
    EXPECT_GE(a.cosine, kMinCosine);
    EXPECT_LE(a.relative_l1, kMaxRelativeL1);
    EXPECT_GT(a.relative_l1, 1e-4);
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, EmulatedInt8Units,
                         ::testing::Values(EmulatedKernel{"vnni", attention_int8_vnni_emulated},
                                           EmulatedKernel{"amx_int8",
                                                          attention_int8_amx_int8_emulated}),
                         [](const ::testing::TestParamInfo<EmulatedKernel>& info) {
                           return std::string(info.param.name);
                         });
#endif

}  // namespace
}  // namespace npu_attn::testing
