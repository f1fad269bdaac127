// bfloat16 and float16 tensors: the kernels read and write them directly (computing in float32)
// and must agree with the double-precision reference given the same 16-bit inputs.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "amx_emulated.h"
#include "attention.h"
#include "attention_cases.h"
#include "bfloat16.h"
#include "dispatch.h"
#include "half.h"
#include "test_support.h"

namespace npu_attn::testing {
namespace {

using HalfTensor = OwnedTensor<uint16_t>;  // raw bfloat16 or float16 bits

uint16_t to_bits(float x, DType dtype) {
  if (dtype == DType::kFloat16) {
    const Half h = static_cast<Half>(x);
    uint16_t bits;
    std::memcpy(&bits, &h, sizeof(bits));
    return bits;
  }
  return bfloat16_bits(x);
}

float from_bits(uint16_t bits, DType dtype) {
  if (dtype == DType::kFloat16) {
    Half h;
    std::memcpy(&h, &bits, sizeof(h));
    return static_cast<float>(h);
  }
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// Same shape and memory layout as `t`, values rounded to `dtype`.
HalfTensor narrow(const FloatTensor& t, DType dtype) {
  HalfTensor h;
  h.shape = t.shape;
  h.strides = t.strides;
  h.storage.resize(t.storage.size());
  for (size_t i = 0; i < t.storage.size(); ++i) h.storage[i] = to_bits(t.storage[i], dtype);
  return h;
}

FloatTensor widen(const HalfTensor& h, DType dtype) {
  FloatTensor t;
  t.shape = h.shape;
  t.strides = h.strides;
  t.storage.resize(h.storage.size());
  for (size_t i = 0; i < h.storage.size(); ++i) t.storage[i] = from_bits(h.storage[i], dtype);
  return t;
}

// One unit in the last place at magnitude 1: results are rounded to the 16-bit type, so the
// kernel and the reference may differ by one rounding step of the largest value (plus float32
// vs double accumulation, far smaller).
double unit_roundoff(DType dtype) {
  return dtype == DType::kBFloat16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
}

class LowPrecision : public PerVariant {};

std::vector<Case> low_precision_shapes() {
  std::vector<Case> cases = {
      {2, 2, 2, 67, 67, 40, 40},     {2, 2, 2, 130, 77, 80, 80}, {1, 2, 2, 70, 90, 59, 59},
      {1, 8, 2, 90, 120, 64, 64},    {1, 1, 1, 1, 1, 64, 64},    {1, 2, 2, 100, 100, 40, 72},
      {2, 4, 4, 200, 200, 128, 128},
  };
  // Whole 32-key and 32-dim tiles: the AMX kernel reads K in place (BHSD and BSHD strides).
  cases.push_back({2, 3, 3, 96, 128, 64, 64});
  cases.push_back({1, 2, 2, 70, 64, 32, 32});
  cases.back().layout = Layout::kBSHD;
  cases.back().causal = true;
  cases[1].mask = MaskCase::kBoolKeyPadding;
  cases[2].mask = MaskCase::kAdditiveHeads;
  cases[3].causal = true;
  cases[5].layout = Layout::kBSHD;
  cases[6].layout = Layout::kBHDS;
  // Explicit scales: 0 (uniform weights; masked keys must stay excluded, not become NaN) with a
  // boolean mask, and a non-default one with an additive mask (added after scaling).
  cases.push_back({1, 2, 2, 50, 70, 40, 40});
  cases.back().mask = MaskCase::kBoolFull;
  cases.back().softmax_scale = 0.0;
  cases.push_back({1, 2, 2, 50, 70, 64, 64});
  cases.back().mask = MaskCase::kAdditiveFull;
  cases.back().softmax_scale = 0.3;
  return cases;
}

// A forward kernel under test: a variant through the dispatcher, or an emulated one.
using ForwardKernel = std::function<void(const AttentionParams&)>;

ForwardKernel variant_forward(Isa isa) {
  return [isa](const AttentionParams& params) { run_attention_forward(params, isa); };
}

// A problem's inputs rounded to a 16-bit type, the kernel's output and the reference's
// (the arguments point into these tensors, so the struct is filled in place).
struct HalfForward {
  HalfTensor q, k, v, out, ref_out;
  SdpaArguments args;  // the kernel's call: 16-bit inputs, `out`
};

// Runs the forward of `pr` in `dtype` on `kernel` and on the double-precision reference, and
// expects them to agree within one rounding of the 16-bit type.
void expect_forward_matches_reference(Problem& pr, DType dtype, const ForwardKernel& kernel,
                                      HalfForward& f) {
  f.q = narrow(pr.q, dtype);
  f.k = narrow(pr.k, dtype);
  f.v = narrow(pr.v, dtype);
  f.out = narrow(pr.out, dtype);
  f.ref_out = narrow(pr.ref_out, dtype);
  f.args = pr.args;
  f.args.query = f.q.view(dtype);
  f.args.key = f.k.view(dtype);
  f.args.value = f.v.view(dtype);
  f.args.out = f.out.view(dtype);
  kernel(make_attention_params(f.args));
  SdpaArguments ref_args = f.args;
  ref_args.out = f.ref_out.view(dtype);
  ref_args.lse = pr.ref_lse.view(DType::kFloat32);
  attention_reference(make_attention_params(ref_args));
  const FloatTensor got = widen(f.out, dtype), want = widen(f.ref_out, dtype);
  EXPECT_LE(max_abs_diff(got, want), unit_roundoff(dtype) * std::max(1.0, max_abs(want)));
}

TEST(BFloat16Rounding, RoundsToNearestEvenAndKeepsNaN) {
  auto bits_of = [](uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  };
  EXPECT_EQ(bfloat16_bits(1.0f), 0x3f80);
  EXPECT_EQ(bfloat16_bits(-2.0f), 0xc000);
  EXPECT_EQ(bfloat16_bits(bits_of(0x3f808000u)), 0x3f80);  // tie, even below: down
  EXPECT_EQ(bfloat16_bits(bits_of(0x3f818000u)), 0x3f82);  // tie, odd below: up to even
  EXPECT_EQ(bfloat16_bits(bits_of(0x3f808001u)), 0x3f81);  // above the tie: up
  EXPECT_EQ(bfloat16_bits(bits_of(0x7f7fffffu)), 0x7f80);  // FLT_MAX rounds to infinity
  EXPECT_EQ(bfloat16_bits(std::numeric_limits<float>::quiet_NaN()), 0x7fc0);
  EXPECT_EQ(bfloat16_bits(bits_of(0xffffffffu)), 0x7fc0);  // a NaN that would carry into inf
}

using BackwardKernel = std::function<void(const AttentionBackwardParams&)>;

BackwardKernel variant_backward(Isa isa) {
  return [isa](const AttentionBackwardParams& params) { run_attention_backward(params, isa); };
}

// The backward of `kernel` from the forward results in `f` (expect_forward_matches_reference)
// against the double-precision reference.
void expect_backward_matches_reference(const Problem& pr, const Case& c, DType dtype,
                                       const HalfForward& f, const BackwardKernel& kernel) {
  FloatTensor grad_out_f({c.batch, c.heads_q, c.len_q, c.head_dim_v}, order_for(c.layout));
  fill_normal(grad_out_f, 31);
  HalfTensor grad_out = narrow(grad_out_f, dtype);
  HalfTensor dq = narrow(pr.q, dtype), dk = narrow(pr.k, dtype), dv = narrow(pr.v, dtype);
  HalfTensor ref_dq = dq, ref_dk = dk, ref_dv = dv;
  SdpaBackwardArguments bwd;
  bwd.forward = f.args;
  bwd.grad_out = grad_out.view(dtype);
  bwd.grad_query = dq.view(dtype);
  bwd.grad_key = dk.view(dtype);
  bwd.grad_value = dv.view(dtype);
  kernel(make_attention_backward_params(bwd));
  bwd.grad_query = ref_dq.view(dtype);
  bwd.grad_key = ref_dk.view(dtype);
  bwd.grad_value = ref_dv.view(dtype);
  attention_backward_reference(make_attention_backward_params(bwd));
  for (auto [mine, ref] : {std::pair{&dq, &ref_dq}, {&dk, &ref_dk}, {&dv, &ref_dv}}) {
    const FloatTensor a = widen(*mine, dtype), b = widen(*ref, dtype);
    // The reference recomputes P in double, the kernel from the 16-bit-rounded output
    // (Delta = rowsum(dO * O)); two roundings of the gradient's scale are allowed.
    EXPECT_LE(max_abs_diff(a, b), 2 * unit_roundoff(dtype) * std::max(1.0, max_abs(b)));
  }
}

// A 16-bit call may write its output in float32 (AttentionParams::out_float32, which a backward
// reads for Delta = rowsum(dO * O)): the same values before their one rounding, so narrowed to
// the 16-bit type they are the 16-bit output bit for bit; the backward reading them matches
// the reference.
void expect_float32_output_is_the_unrounded_one(Problem& pr, const Case& c, DType dtype,
                                                const ForwardKernel& kernel,
                                                const BackwardKernel& backward) {
  HalfForward f;
  expect_forward_matches_reference(pr, dtype, kernel, f);
  FloatTensor out32 = pr.out;
  for (auto& x : out32.storage) x = NAN;  // an element the kernel does not write shows
  HalfForward f32;
  f32.args = f.args;  // f's 16-bit inputs
  f32.args.out = out32.view(DType::kFloat32);
  const AttentionParams params = make_attention_params(f32.args);
  ASSERT_TRUE(params.out_float32);
  kernel(params);
  EXPECT_EQ(narrow(out32, dtype).storage, f.out.storage);
  expect_backward_matches_reference(pr, c, dtype, f32, backward);
}

TEST_P(LowPrecision, ForwardAndBackwardMatchTheReference) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (const Case& c : low_precision_shapes()) {
      SCOPED_TRACE(c.describe() + " " + dtype_name(dtype) + " isa=" + isa_name(GetParam()));
      Problem pr;
      build(c, pr, 7);
      HalfForward f;
      expect_forward_matches_reference(pr, dtype, variant_forward(GetParam()), f);
      expect_backward_matches_reference(pr, c, dtype, f, variant_backward(GetParam()));
    }
  }
}

TEST_P(LowPrecision, Float32OutputIsTheUnroundedOutput) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (const Case& c : low_precision_shapes()) {
      SCOPED_TRACE(c.describe() + " " + dtype_name(dtype) + " isa=" + isa_name(GetParam()));
      Problem pr;
      build(c, pr, 7);
      expect_float32_output_is_the_unrounded_one(pr, c, dtype, variant_forward(GetParam()),
                                                 variant_backward(GetParam()));
    }
  }
}

// `kernel`'s forward on pr's inputs narrowed to `dtype` (log-sum-exp into pr.lse).
// The 16-bit output starts as NaN, so an element the kernel does not write shows.
HalfTensor narrowed_forward(Problem& pr, DType dtype, const ForwardKernel& kernel) {
  HalfTensor q = narrow(pr.q, dtype), k = narrow(pr.k, dtype), v = narrow(pr.v, dtype);
  HalfTensor out = narrow(pr.out, dtype);
  for (auto& x : out.storage) x = to_bits(NAN, dtype);
  SdpaArguments args = pr.args;
  args.query = q.view(dtype);
  args.key = k.view(dtype);
  args.value = v.view(dtype);
  args.out = out.view(dtype);
  kernel(make_attention_params(args));
  return out;
}

// Shapes on which the AMX kernel runs several 32-query sub-tiles per task over each key block
// (query groups), with the tests' 2 threads: the first two because K and V outgrow its L2
// budget (kAmxGroupAboveBytes, 1 MiB; groups of 4), the last three because they have a single
// key block (kAmxMinUnitsPerTask: SD-1.5's 8x8 level, 64 keys at head dim 160, causal; 77 keys
// of cross-attention with a key-padding mask and a ragged last sub-tile of 4 queries; a 3-query
// sub-tile). Ragged last tasks (fewer sub-tiles), GQA, masks, and causal sub-tiles whose key
// ranges end in different key blocks (head dim 160: 160-key blocks, tasks of 128 queries).
// Forward only: the backward has no query groups. Every variant runs them (they are ordinary
// shapes elsewhere).
std::vector<Case> query_group_shapes() {
  std::vector<Case> cases = {{1, 4, 4, 260, 520, 512, 512},
                             {1, 8, 2, 300, 1700, 160, 160},
                             {2, 8, 8, 64, 64, 160, 160},
                             {2, 8, 4, 100, 77, 64, 64},
                             {1, 16, 16, 35, 40, 80, 80}};
  cases[0].mask = MaskCase::kAdditiveHeads;
  cases[1].causal = true;
  cases[2].causal = true;
  cases[3].mask = MaskCase::kBoolKeyPadding;
  return cases;
}

// The forward-only checks, for the dispatcher's variants and the emulated AMX kernel alike.
void expect_empty_keys_give_zeros(const ForwardKernel& kernel) {
  constexpr DType dtype = DType::kBFloat16;
  Case c{2, 8, 8, 70, 0, 64, 64};  // enough tasks for query groups of the AMX kernel
  Problem pr;
  build(c, pr, 9);
  const HalfTensor out = narrowed_forward(pr, dtype, kernel);
  for (float x : widen(out, dtype).storage) EXPECT_EQ(x, 0.0f);
  for (float x : pr.lse.storage) EXPECT_EQ(x, -INFINITY);
}

void expect_query_group_shapes_match(const ForwardKernel& kernel, const std::string& name) {
  for (const Case& c : query_group_shapes()) {
    SCOPED_TRACE(c.describe() + " " + name);
    Problem pr;
    build(c, pr, 11);
    HalfForward f;
    expect_forward_matches_reference(pr, DType::kBFloat16, kernel, f);
  }
}

void expect_masked_rows_and_nan_handled(const ForwardKernel& kernel, const std::string& name) {
  const DType dtype = DType::kBFloat16;
  Case c{1, 2, 2, 40, 70, 32, 32};
  for (int variant = 0; variant < 2; ++variant) {
    SCOPED_TRACE(name + (variant ? " NaN key" : " masked rows"));
    Problem pr;
    build(c, pr, 5);
    if (variant == 0) {  // rows 0, 3, 6, ... see no key: output 0, lse -inf
      pr.boolean = BoolTensor({c.len_q, c.len_k});
      for (int64_t i = 0; i < c.len_q; ++i)
        for (int64_t j = 0; j < c.len_k; ++j) pr.boolean.at({i, j}) = (i % 3 != 0);
      pr.args.attn_mask = pr.boolean.view(DType::kBool);
    } else {  // one NaN key: every output NaN, like the reference
      pr.k.at({0, 1, 7, 3}) = NAN;
    }
    const FloatTensor got = widen(narrowed_forward(pr, dtype, kernel), dtype);
    for (int64_t h = 0; h < c.heads_q; ++h) {
      for (int64_t i = 0; i < c.len_q; ++i) {
        const float first = got.storage[got.offset({0, h, i, 0})];
        if (variant == 1) {
          EXPECT_EQ(std::isnan(first), h == 1) << h << " " << i;
        } else if (i % 3 == 0) {
          EXPECT_EQ(pr.lse.at({0, h, i}), -INFINITY);
          for (int64_t d = 0; d < c.head_dim_v; ++d)
            EXPECT_EQ(got.storage[got.offset({0, h, i, d})], 0.0f);
        } else {
          EXPECT_TRUE(std::isfinite(pr.lse.at({0, h, i})));
          EXPECT_TRUE(std::isfinite(first));
        }
      }
    }
  }
}

// Scores beyond the exponentials' fused argument (kFusedShiftLimit: a scale of 1e9), and a
// torch.finfo(float32).min padding mask (hide_keys_with_min_float), in `dtypes` (see
// EveryIsa.HugeScoresKeepTheirSoftmax and MinFloatMaskRowsMatchTheReference for the float32
// kernels).
void expect_extreme_scores_handled(const ForwardKernel& kernel, const std::string& name,
                                   const std::vector<DType>& dtypes) {
  for (DType dtype : dtypes) {
    for (int variant = 0; variant < 2; ++variant) {
      SCOPED_TRACE(name + (dtype == DType::kBFloat16 ? " bfloat16" : " float16") +
                   (variant ? " min-float mask" : " scale 1e9"));
      // Without a mask the pair kernels apply the scale in the exponentials (score_scale
      // != 1), so the huge-score path scales the scores itself there.
      Case c{1, 2, 2, 40, 700, 32, 32, Layout::kBHSD, MaskCase::kNone};
      if (variant == 0) c.softmax_scale = 1e9;
      if (variant == 1) c.mask = MaskCase::kAdditiveFull;
      Problem pr;
      build(c, pr, 5);
      if (variant == 1) hide_keys_with_min_float(pr, 560);
      HalfForward f;
      expect_forward_matches_reference(pr, dtype, kernel, f);
    }
  }
}

TEST_P(LowPrecision, ExtremeScoresMatchTheReference) {
  expect_extreme_scores_handled(variant_forward(GetParam()), isa_name(GetParam()),
                                {DType::kBFloat16, DType::kFloat16});
}

TEST_P(LowPrecision, EmptyKeysGiveZerosInBfloat16) {
  expect_empty_keys_give_zeros(variant_forward(GetParam()));
}

TEST_P(LowPrecision, LargeKeyValueShapesMatchTheReferenceInBfloat16) {
  expect_query_group_shapes_match(variant_forward(GetParam()),
                                  std::string("isa=") + isa_name(GetParam()));
}

TEST_P(LowPrecision, FullyMaskedRowsAndNanInBfloat16) {
  expect_masked_rows_and_nan_handled(variant_forward(GetParam()), isa_name(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Kernels, LowPrecision, ::testing::ValuesIn(compiled_isas()),
                         variant_test_name);

#ifdef NPU_ATTN_TEST_AMX_EMULATION
// The AMX kernel on the software tile unit (amx_emulation.h): its tiling, packing and tile
// configuration are checked on every CPU that runs the avx512_bf16 variant, not only on AMX
// machines (where the LowPrecision suite runs the real one, and the last test compares both).
class EmulatedAmx : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!isa_supported_by_cpu(Isa::avx512_bf16)) {
      GTEST_SKIP() << "the emulated AMX kernel is built for the avx512_bf16 variant, which this "
                      "CPU cannot run (needs "
                   << kernel_variant(Isa::avx512_bf16).needs << ")";
    }
  }
  const ForwardKernel kernel_ = attention_forward_amx_emulated;
  const BackwardKernel backward_ = attention_backward_amx_emulated;
};

TEST_F(EmulatedAmx, ForwardAndBackwardMatchTheReferenceInBfloat16) {
  // The shared grid, plus head dims the AMX backward pads differently: SD-1.5's 160 (several
  // 32-wide tiles, a 2x1 column block), the VAE's 512, and a value head dim below the query's.
  std::vector<Case> cases = low_precision_shapes();
  cases.push_back({1, 4, 2, 70, 90, 160, 160});
  cases.back().causal = true;
  cases.push_back({1, 1, 1, 40, 130, 512, 512});
  cases.push_back({2, 2, 2, 33, 70, 96, 40});
  cases.back().mask = MaskCase::kAdditiveHeads;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.describe() + " emulated AMX");
    Problem pr;
    build(c, pr, 7);
    HalfForward f;
    expect_forward_matches_reference(pr, DType::kBFloat16, kernel_, f);
    expect_backward_matches_reference(pr, c, DType::kBFloat16, f, backward_);
    Problem again;
    build(c, again, 7);
    expect_float32_output_is_the_unrounded_one(again, c, DType::kBFloat16, kernel_, backward_);
  }
  expect_query_group_shapes_match(kernel_, "emulated AMX");
}

TEST_F(EmulatedAmx, EmptyKeysMaskedRowsAndNan) {
  expect_empty_keys_give_zeros(kernel_);
  expect_masked_rows_and_nan_handled(kernel_, "emulated AMX");
  expect_extreme_scores_handled(kernel_, "emulated AMX", {DType::kBFloat16});
}

// On an AMX machine: the emulation computes what the tile unit computes (up to the order of
// float32 additions inside tdpbf16ps, far below one bfloat16 rounding of the output).
TEST_F(EmulatedAmx, AgreesWithTheTileUnit) {
  if (!isa_supported_by_cpu(Isa::amx_bf16)) {
    GTEST_SKIP() << "this CPU has no AMX to compare the emulation with (needs "
                 << kernel_variant(Isa::amx_bf16).needs << ")";
  }
  for (const Case& c : low_precision_shapes()) {
    SCOPED_TRACE(c.describe());
    Problem hardware, emulated;
    build(c, hardware, 3);
    build(c, emulated, 3);
    const FloatTensor a =
        widen(narrowed_forward(hardware, DType::kBFloat16, variant_forward(Isa::amx_bf16)),
              DType::kBFloat16);
    const FloatTensor b =
        widen(narrowed_forward(emulated, DType::kBFloat16, kernel_), DType::kBFloat16);
    EXPECT_LE(max_abs_diff(a, b), unit_roundoff(DType::kBFloat16) * std::max(1.0, max_abs(b)));
  }
}
#endif

}  // namespace
}  // namespace npu_attn::testing
