// Tiled backward kernel vs the double-precision reference, for every ISA this CPU can run.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>

#include "attention.h"
#include "attention_cases.h"
#include "dispatch.h"
#include "test_support.h"
#include "workspace.h"

namespace npu_attn::testing {
namespace {

// A forward problem plus everything its backward needs: the forward is run first (with the
// same ISA) to produce the out and lse the backward consumes, as autograd does.
struct BackwardProblem {
  Problem fwd;
  FloatTensor grad_out, grad_lse, dq, dk, dv, ref_dq, ref_dk, ref_dv;
  SdpaBackwardArguments args;
};

// `customize` may change the forward problem (e.g. its mask) before the forward runs.
void build_backward(const Case& c, BackwardProblem& pr, uint32_t seed, bool with_grad_lse, Isa isa,
                    const std::function<void(Problem&)>& customize = nullptr) {
  build(c, pr.fwd, seed);
  if (customize) customize(pr.fwd);
  run_attention_forward(make_attention_params(pr.fwd.args), isa);
  const auto order = order_for(c.layout);
  pr.grad_out = FloatTensor({c.batch, c.heads_q, c.len_q, c.head_dim_v}, order);
  fill_normal(pr.grad_out, seed + 20);
  pr.dq = FloatTensor({c.batch, c.heads_q, c.len_q, c.head_dim}, order);
  pr.dk = FloatTensor({c.batch, c.heads_kv, c.len_k, c.head_dim}, order);
  pr.dv = FloatTensor({c.batch, c.heads_kv, c.len_k, c.head_dim_v}, order);
  for (FloatTensor* t : {&pr.dq, &pr.dk, &pr.dv})  // every element must be written
    std::fill(t->storage.begin(), t->storage.end(), NAN);
  pr.ref_dq = FloatTensor(pr.dq.shape);
  pr.ref_dk = FloatTensor(pr.dk.shape);
  pr.ref_dv = FloatTensor(pr.dv.shape);
  pr.args.forward = pr.fwd.args;
  pr.args.grad_out = pr.grad_out.view(DType::kFloat32);
  if (with_grad_lse) {
    pr.grad_lse = FloatTensor({c.batch, c.heads_q, c.len_q});
    fill_normal(pr.grad_lse, seed + 21);
    pr.args.grad_lse = pr.grad_lse.view(DType::kFloat32);
  }
  pr.args.grad_query = pr.dq.view(DType::kFloat32);
  pr.args.grad_key = pr.dk.view(DType::kFloat32);
  pr.args.grad_value = pr.dv.view(DType::kFloat32);
}

// The float64 reference's gradients of one problem (bhsd).
struct BackwardReference {
  FloatTensor dq, dk, dv;
};

BackwardReference run_reference(BackwardProblem& pr) {
  SdpaBackwardArguments ref = pr.args;
  ref.grad_query = pr.ref_dq.view(DType::kFloat32);
  ref.grad_key = pr.ref_dk.view(DType::kFloat32);
  ref.grad_value = pr.ref_dv.view(DType::kFloat32);
  attention_backward_reference(make_attention_backward_params(ref));
  return {pr.ref_dq, pr.ref_dk, pr.ref_dv};
}

// fp32 kernel vs double reference. Each gradient is a sum over up to L_k (or L_q) products of
// O(1) terms in fp32, and dS = P (dP - Delta) subtracts nearly equal numbers. Measured errors
// are 1e-6 to 6e-6 of the gradient's magnitude on this grid; 5e-5 leaves room for other
// summation orders and still catches any wrong term (a missing mask, a wrong tile, a dropped
// scale are O(1) errors).
// `ref` is the reference of the same problem in any layout (fill_normal fills logical order);
// computed first if empty.
void expect_backward_matches(const Case& c, Isa isa, std::optional<BackwardReference>& ref,
                             bool with_grad_lse, uint32_t seed) {
  SCOPED_TRACE(c.describe() + " isa=" + isa_name(isa) + (with_grad_lse ? " grad_lse" : ""));
  BackwardProblem pr;
  build_backward(c, pr, seed, with_grad_lse, isa);
  run_attention_backward(make_attention_backward_params(pr.args), isa);
  if (!ref) ref = run_reference(pr);
  const double rel = 5e-5;
  EXPECT_LE(max_abs_diff(pr.dq, ref->dq), rel * std::max(1.0, max_abs(ref->dq)));
  EXPECT_LE(max_abs_diff(pr.dk, ref->dk), rel * std::max(1.0, max_abs(ref->dk)));
  EXPECT_LE(max_abs_diff(pr.dv, ref->dv), rel * std::max(1.0, max_abs(ref->dv)));
}

void expect_backward_matches(const Case& c, Isa isa, bool with_grad_lse = false,
                             uint32_t seed = 1) {
  std::optional<BackwardReference> ref;
  expect_backward_matches(c, isa, ref, with_grad_lse, seed);
}

class BackwardEveryIsa : public PerVariant {};

TEST_P(BackwardEveryIsa, MatchesReferenceOnShapeGrid) {
  std::vector<Case> cases;
  for (int64_t d : {1, 8, 40, 59, 64, 72, 80, 128, 160}) {
    cases.push_back({1, 2, 2, 67, 67, d, d});
    cases.push_back({2, 1, 1, 130, 77, d, d});  // cross-attention to 77 text tokens
  }
  cases.push_back({1, 1, 1, 1, 1, 64, 64});      // length 1
  cases.push_back({1, 3, 3, 1, 300, 40, 40});    // one query, many keys
  cases.push_back({1, 2, 2, 300, 1, 40, 40});    // many queries, one key
  cases.push_back({2, 2, 2, 520, 330, 64, 64});  // several tiles both ways
  // Around the key counts where the AVX2 float32 kernel takes one tile of 65-128 keys
  for (int64_t keys : {64, 65, 128, 129}) cases.push_back({1, 2, 2, 70, keys, 40, 40});
  cases.push_back({1, 2, 2, 100, 100, 64, 40});  // Dv != D
  cases.push_back({1, 2, 2, 100, 100, 40, 130});
  cases.push_back({1, 8, 2, 90, 120, 64, 64});  // GQA 4:1
  cases.push_back({2, 6, 3, 50, 50, 72, 72});   // GQA 2:1
  cases.push_back({3, 5, 1, 33, 47, 24, 24});   // MQA
  // Large head dims (the VAE mid-block's 512; 384), several tiles both ways, on each side alone
  // and on both
  cases.push_back({1, 1, 1, 130, 140, 512, 512});
  cases.push_back({1, 2, 2, 70, 100, 384, 64});
  cases.push_back({1, 2, 2, 70, 100, 40, 512});
  for (Case c : cases) {
    std::optional<BackwardReference> ref;  // one reference for the three layouts
    for (Layout layout : {Layout::kBHSD, Layout::kBSHD, Layout::kBHDS}) {
      c.layout = layout;
      expect_backward_matches(c, GetParam(), ref, /*with_grad_lse=*/false, /*seed=*/1);
    }
  }
}

TEST_P(BackwardEveryIsa, MatchesReferenceWithMasksAndCausal) {
  const std::vector<Case> bases = {
      {2, 4, 2, 97, 97, 64, 64},
      {1, 2, 2, 130, 77, 40, 40},
      {1, 1, 1, 300, 90, 59, 59},  // Lq > Lk with causal: top-left alignment
      {1, 2, 2, 5, 200, 32, 32},   // Lq < Lk
      // Head dim 128, where the AVX2 float32 kernel takes 128-query tiles: several of them, the
      // last partial, GQA 2:1, causal with Lq > Lk and Lq < Lk
      {1, 2, 1, 300, 260, 128, 128},
      {2, 1, 1, 140, 150, 128, 128},
      // 128-query tiles over one tile of all 128 keys (AVX2 float32), GQA 2:1, Lq > Lk
      {1, 2, 1, 200, 128, 128, 128},
  };
  for (Case c : bases) {
    for (MaskCase m :
         {MaskCase::kNone, MaskCase::kBoolFull, MaskCase::kBool2D, MaskCase::kBoolKeyPadding,
          MaskCase::kAdditiveFull, MaskCase::kAdditiveHeads}) {
      for (bool causal : {false, true}) {
        c.mask = m;
        c.causal = causal;
        c.layout = causal ? Layout::kBSHD : Layout::kBHSD;
        expect_backward_matches(c, GetParam());
      }
    }
  }
}

TEST_P(BackwardEveryIsa, GradientOfLseIsIncluded) {
  expect_backward_matches({2, 2, 1, 70, 90, 40, 40}, GetParam(), /*with_grad_lse=*/true);
  Case masked{1, 2, 2, 64, 64, 32, 32};
  masked.causal = true;
  expect_backward_matches(masked, GetParam(), /*with_grad_lse=*/true);
}

TEST_P(BackwardEveryIsa, LargeLogitsStayFinite) {
  Case c{1, 2, 2, 65, 130, 64, 64};
  c.input_scale = 30.0f;  // scores ~ 30 * N(0, 1) * sqrt(64)/8: saturated softmax rows
  BackwardProblem pr;
  build_backward(c, pr, 4, false, GetParam());
  run_attention_backward(make_attention_backward_params(pr.args), GetParam());
  run_reference(pr);
  for (const FloatTensor* t : {&pr.dq, &pr.dk, &pr.dv})
    for (float x : t->storage) ASSERT_TRUE(std::isfinite(x));
  // Saturated softmax: each score carries ~|s| * 2^-24 rounding, so compare loosely.
  EXPECT_LE(max_abs_diff(pr.dv, pr.ref_dv), 1e-3 * std::max(1.0, max_abs(pr.ref_dv)));
  EXPECT_LE(max_abs_diff(pr.dq, pr.ref_dq), 1e-2 * std::max(1.0, max_abs(pr.ref_dq)));
}

TEST_P(BackwardEveryIsa, FullyMaskedRowsGetZeroGradient) {
  Case c{1, 2, 2, 40, 70, 32, 32};
  BackwardProblem pr;
  build_backward(c, pr, 5, false, GetParam(), [&](Problem& fwd) {
    fwd.boolean = BoolTensor({c.len_q, c.len_k});
    for (int64_t i = 0; i < c.len_q; ++i)  // rows 0, 3, 6, ... see no key
      for (int64_t j = 0; j < c.len_k; ++j) fwd.boolean.at({i, j}) = (i % 3 != 0);
    fwd.args.attn_mask = fwd.boolean.view(DType::kBool);
  });
  run_attention_backward(make_attention_backward_params(pr.args), GetParam());
  run_reference(pr);
  for (int64_t h = 0; h < c.heads_q; ++h)
    for (int64_t i = 0; i < c.len_q; i += 3)
      for (int64_t d = 0; d < c.head_dim; ++d) EXPECT_EQ(pr.dq.at({0, h, i, d}), 0.0f);
  EXPECT_LE(max_abs_diff(pr.dq, pr.ref_dq), 1e-4 * std::max(1.0, max_abs(pr.ref_dq)));
  EXPECT_LE(max_abs_diff(pr.dk, pr.ref_dk), 1e-4 * std::max(1.0, max_abs(pr.ref_dk)));
}

TEST_P(BackwardEveryIsa, EmptySequencesGiveZeroGradients) {
  for (Case c : {Case{1, 2, 2, 10, 0, 16, 16}, Case{1, 2, 2, 0, 10, 16, 16}}) {
    BackwardProblem pr;
    build_backward(c, pr, 9, false, GetParam());
    run_attention_backward(make_attention_backward_params(pr.args), GetParam());
    for (const FloatTensor* t : {&pr.dq, &pr.dk, &pr.dv}) {
      if (t->shape[2] == 0) continue;  // no elements (storage holds one placeholder)
      for (float x : t->storage) EXPECT_EQ(x, 0.0f);
    }
  }
}

TEST_P(BackwardEveryIsa, DeterministicAndThreadCountOnlyReordersSums) {
  // One pair: with two threads the key tiles are split between items and the private dQ
  // buffers summed, so dQ may differ from one thread in the last bits, never more.
  Case c{1, 1, 1, 200, 333, 72, 72};
  c.mask = MaskCase::kAdditiveHeads;
  BackwardProblem one, two, again;
  for (BackwardProblem* pr : {&one, &two, &again}) {
    build_backward(c, *pr, 3, false, GetParam());
    pr->args.forward.num_threads = pr == &one ? 1 : 2;
    run_attention_backward(make_attention_backward_params(pr->args), GetParam());
  }
  EXPECT_EQ(two.dq.storage, again.dq.storage);
  EXPECT_EQ(two.dk.storage, again.dk.storage);
  EXPECT_EQ(one.dk.storage, two.dk.storage);  // dK/dV rows have one owner either way
  EXPECT_EQ(one.dv.storage, two.dv.storage);
  EXPECT_LE(max_abs_diff(one.dq, two.dq), 1e-5 * std::max(1.0, max_abs(one.dq)));
}

TEST_P(BackwardEveryIsa, SplitKeyTilesFoldDqAcrossHeadsAndRowBlocks) {
  // One kv-head of a GQA group of four, three threads: the key tiles are split into six items
  // whose private dQ buffers are folded in blocks of rows that cross the group's heads
  // (4 x 300 rows). Against the reference, and identical when run again.
  Case c{1, 4, 1, 300, 333, 40, 40};
  BackwardProblem first, again;
  for (BackwardProblem* pr : {&first, &again}) {
    build_backward(c, *pr, 5, false, GetParam());
    pr->args.forward.num_threads = 3;
    run_attention_backward(make_attention_backward_params(pr->args), GetParam());
  }
  run_reference(first);
  EXPECT_LE(max_abs_diff(first.dq, first.ref_dq), 5e-5 * std::max(1.0, max_abs(first.ref_dq)));
  EXPECT_LE(max_abs_diff(first.dk, first.ref_dk), 5e-5 * std::max(1.0, max_abs(first.ref_dk)));
  EXPECT_LE(max_abs_diff(first.dv, first.ref_dv), 5e-5 * std::max(1.0, max_abs(first.ref_dv)));
  EXPECT_EQ(first.dq.storage, again.dq.storage);
}

TEST_P(BackwardEveryIsa, WorkspaceIsReleasedAndLinearInSequenceLength) {
  auto peak_for = [&](int64_t len) {
    Case c{1, 2, 2, len, len, 64, 64};
    BackwardProblem pr;
    build_backward(c, pr, 2, false, GetParam());
    workspace_reset_peak();
    const int64_t before = workspace_stats().current_bytes;
    run_attention_backward(make_attention_backward_params(pr.args), GetParam());
    EXPECT_EQ(workspace_stats().current_bytes, before);
    return workspace_stats().peak_bytes - before;
  };
  const int64_t small = peak_for(512), large = peak_for(2048);
  EXPECT_GT(small, 0);
  EXPECT_LE(large, 4 * small + (1 << 20));
  EXPECT_LT(large, 2048LL * 2048 * 4 / 4);  // far below one head's score matrix
}

INSTANTIATE_TEST_SUITE_P(Kernels, BackwardEveryIsa, ::testing::ValuesIn(compiled_isas()),
                         variant_test_name);

// ---------------------------------------------------------------- validation
struct ValidBackward : ::testing::Test {
  BackwardProblem pr;
  void SetUp() override { build_backward({1, 2, 2, 8, 9, 16, 12}, pr, 1, false, Isa::scalar); }
  std::string error_of(const SdpaBackwardArguments& args) {
    try {
      make_attention_backward_params(args);
    } catch (const ArgumentError& e) {
      return e.what();
    }
    return "";
  }
};

TEST_F(ValidBackward, AcceptsAValidCall) {
  EXPECT_EQ(error_of(pr.args), "");
}

TEST_F(ValidBackward, RequiresTheForwardLse) {
  SdpaBackwardArguments args = pr.args;
  args.forward.lse.reset();
  EXPECT_NE(error_of(args).find("lse"), std::string::npos);
}

TEST_F(ValidBackward, NamesAWrongGradientShape) {
  SdpaBackwardArguments args = pr.args;
  args.grad_key.shape = {1, 2, 8, 16};
  EXPECT_NE(error_of(args).find("grad_key must have shape (1, 2, 9, 16)"), std::string::npos);
  args = pr.args;
  args.grad_out.shape[3] = 16;
  EXPECT_NE(error_of(args).find("grad_out must have shape"), std::string::npos);
}

TEST_F(ValidBackward, RejectsBroadcastOutputsAndWrongDtypes) {
  SdpaBackwardArguments args = pr.args;
  args.grad_query.strides[2] = 0;
  EXPECT_NE(error_of(args).find("grad_query has overlapping memory"), std::string::npos);
  args = pr.args;
  args.grad_value.dtype = DType::kFloat64;
  EXPECT_NE(
      error_of(args).find("grad_value must be float32 (the same dtype as query), got float64"),
      std::string::npos);
  args = pr.args;
  args.grad_lse = pr.grad_out.view(DType::kFloat32);
  EXPECT_NE(error_of(args).find("grad_lse must have 3 dimensions"), std::string::npos);
}

}  // namespace
}  // namespace npu_attn::testing
