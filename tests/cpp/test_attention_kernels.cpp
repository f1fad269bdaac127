// Tiled kernels vs the reference implementation, for every ISA variant this CPU can run.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>
#include <string>

#include "attention.h"
#include "attention_cases.h"
#include "dispatch.h"
#include "test_support.h"
#include "workspace.h"

namespace npu_attn::testing {
namespace {

// The float64 reference's output and lse of one problem (bhsd, like Problem::ref_out).
struct ForwardReference {
  FloatTensor out, lse;
};

// pr's output and lse against the reference's: fp32 accumulation against double, so the output
// within `rel_tol` of its magnitude, and each lse within 1e-5 relative.
void expect_close_to_reference(const Problem& pr, const ForwardReference& ref, double rel_tol) {
  const double tol = rel_tol * std::max(1.0, max_abs(ref.out));
  EXPECT_LE(max_abs_diff(pr.out, ref.out), tol);
  double lse_err = 0;
  for (size_t i = 0; i < pr.lse.storage.size(); ++i) {
    const float a = pr.lse.storage[i], b = ref.lse.storage[i];
    if (std::isinf(b)) {
      EXPECT_EQ(a, b) << "lse at " << i;
    } else {
      lse_err = std::max(lse_err, std::fabs(double(a) - b) / std::max(1.0, std::fabs(double(b))));
    }
  }
  EXPECT_LE(lse_err, 1e-5);
}

// Runs `isa` on the problem of `c` and checks it against `ref`, the reference of the same
// problem in any layout (fill_normal fills logical order); computes it first if `ref` is empty.
void expect_matches(const Case& c, Isa isa, std::optional<ForwardReference>& ref, uint32_t seed,
                    double rel_tol) {
  SCOPED_TRACE(c.describe() + " isa=" + isa_name(isa));
  Problem pr;
  build(c, pr, seed);
  AttentionParams params = make_attention_params(pr.args);
  run_attention_forward(params, isa);

  if (!ref) {
    compute_reference(pr);
    ref = ForwardReference{pr.ref_out, pr.ref_lse};
  }
  expect_close_to_reference(pr, *ref, rel_tol);
}

// Runs `isa` and the reference on the same problem and compares their outputs and lse.
void expect_matches_reference(const Case& c, Isa isa, uint32_t seed = 1, double rel_tol = 1e-5) {
  std::optional<ForwardReference> ref;
  expect_matches(c, isa, ref, seed, rel_tol);
}

// The same, for `c` in each layout, against one reference.
void expect_matches_reference_in_every_layout(Case c, Isa isa) {
  std::optional<ForwardReference> ref;
  for (Layout layout : {Layout::kBHSD, Layout::kBSHD, Layout::kBHDS}) {
    c.layout = layout;
    expect_matches(c, isa, ref, /*seed=*/1, /*rel_tol=*/1e-5);
  }
}

class EveryIsa : public PerVariant {};

std::vector<Case> shape_grid() {
  std::vector<Case> cases;
  // Odd and common head dims on self- and cross-attention shapes.
  for (int64_t d : {1, 8, 40, 59, 64, 72, 80, 96, 128, 160, 256, 512}) {
    cases.push_back({1, 2, 2, 67, 67, d, d});
    cases.push_back({2, 1, 1, 130, 77, d, d});  // cross-attention to 77 text tokens
  }
  cases.push_back({1, 1, 1, 1, 1, 64, 64});       // length 1
  cases.push_back({1, 3, 3, 1, 300, 40, 40});     // one query, many keys
  cases.push_back({1, 2, 2, 300, 1, 40, 40});     // many queries, one key
  cases.push_back({2, 4, 4, 1030, 600, 64, 64});  // several tiles both ways
  cases.push_back({1, 2, 2, 100, 100, 64, 40});   // Dv != D
  cases.push_back({1, 2, 2, 100, 100, 40, 130});
  cases.push_back({1, 8, 2, 90, 120, 64, 64});  // GQA 4:1
  cases.push_back({2, 6, 3, 50, 50, 72, 72});   // GQA 2:1
  cases.push_back({3, 5, 1, 33, 47, 24, 24});   // MQA
  // Head dims >= 384: K and V packed as panels of six keys / value channels where the variant
  // uses panels (AVX2), otherwise V rows that alias in L1 padded while K is read in place
  // (float32): several key tiles with a ragged last one and a ragged last panel, K and V of
  // different widths (panels for V only), GQA.
  cases.push_back({1, 2, 2, 100, 1100, 512, 512});
  cases.push_back({1, 2, 2, 80, 700, 64, 384});
  cases.push_back({1, 4, 2, 50, 530, 512, 512});
  // Long sequences from head dim 64 on: panels too (AVX2), with a ragged last panel and key
  // tile, Dv != D, GQA; with 32-query tiles (AVX2: kPanelQueryTile) and a ragged last one.
  cases.push_back({1, 2, 1, 2050, 2053, 128, 64});
  // 1024+ queries and keys below the panel lengths (256-bit vectors; a ragged last key tile):
  // V rows 128 floats apart copied to rows 144 apart, which do not alias in L1
  // (aliasing_v_rows); and (B, L, H, D) storage, whose K and V rows are copied to rows head_dim
  // apart (strided_rows_copied).
  cases.push_back({1, 1, 1, 1030, 1100, 128, 128});
  cases.push_back({1, 2, 2, 1030, 1100, 40, 40});
  return cases;
}

TEST_P(EveryIsa, MatchesReferenceOnShapeGrid) {
  for (const Case& c : shape_grid()) expect_matches_reference_in_every_layout(c, GetParam());
}

// K and V too large to stay in cache between tasks (over 32 MiB as float32): with 512-bit
// vectors the kernel then runs taller query tiles (kStreamedQueryTile, 128 queries), with
// 256-bit vectors where the core's L2 holds them (kStreamedTileMinL2). Too large for the double
// reference on every query (8.6 GFLOP), so the reference runs on sampled queries alone: both
// sides of the tile boundaries and the ragged last tile. One thread, so the four tasks that keep
// the tall tiles exist.
void expect_streamed_key_values_match(Isa isa) {
  const Case c{1, 2, 1, 257, 4100, 1024, 1024};  // K and V: 4100 x 2048 floats, 33.6 MB
  Problem pr;
  build(c, pr, 5);
  pr.args.num_threads = 1;
  run_attention_forward(make_attention_params(pr.args), isa);

  const std::vector<int64_t> sampled = {0, 127, 128, 255, 256};
  Problem sub = reference_for_sampled_queries(c, pr, sampled);
  const double tol = 1e-5 * std::max(1.0, max_abs(sub.ref_out));
  for (int64_t h = 0; h < c.heads_q; ++h)
    for (size_t i = 0; i < sampled.size(); ++i)
      for (int64_t d = 0; d < c.head_dim_v; ++d)
        ASSERT_NEAR(pr.out.at({0, h, sampled[i], d}), sub.ref_out.at({0, h, int64_t(i), d}), tol)
            << "query " << sampled[i] << " head " << h << " channel " << d;
}

// Planned for a 2 MiB L2 and for a 256 KiB one, whatever this CPU has, so both tile heights
// run with 256-bit vectors.
TEST_P(EveryIsa, StreamedKeyValuesMatchTheReferenceOnSampledQueries) {
  const std::string skip = no_streamed_tiles_reason(GetParam());
  if (!skip.empty()) GTEST_SKIP() << skip;
  for (int64_t l2_bytes : {int64_t{2} << 20, int64_t{256} << 10}) {
    SCOPED_TRACE("planned for an L2 of " + std::to_string(l2_bytes) + " bytes");
    PlanningL2 l2(l2_bytes);
    expect_streamed_key_values_match(GetParam());
  }
}

TEST_P(EveryIsa, MatchesReferenceWithMasksAndCausal) {
  const std::vector<Case> bases = {
      {2, 4, 4, 97, 97, 64, 64},    {1, 2, 2, 130, 77, 40, 40}, {2, 4, 2, 70, 300, 80, 80},
      {1, 1, 1, 300, 90, 59, 59},    // Lq > Lk with causal: top-left alignment
      {1, 2, 2, 5, 700, 32, 32},     // Lq < Lk
      {1, 2, 2, 70, 601, 512, 512},  // panels (AVX2): causal ends mid-panel, 2 key tiles
      {1, 2, 1, 40, 90, 64, 400},    // V panels only, GQA
  };
  for (Case c : bases) {
    for (MaskCase m :
         {MaskCase::kNone, MaskCase::kBoolFull, MaskCase::kBool2D, MaskCase::kBoolKeyPadding,
          MaskCase::kAdditiveFull, MaskCase::kAdditiveHeads}) {
      for (bool causal : {false, true}) {
        c.mask = m;
        c.causal = causal;
        c.layout = causal ? Layout::kBSHD : Layout::kBHSD;
        expect_matches_reference(c, GetParam());
      }
    }
  }
}

TEST_P(EveryIsa, LargeLogitsDoNotOverflow) {
  // Scores around 1e4: a naive exp would overflow to inf. The problem itself is ill-conditioned
  // in fp32: each score carries a rounding error of ~1e4 * 2^-24 ~ 6e-4, which moves the softmax
  // weights by that relative amount; so the bound is 1e-3 (a result of inf/NaN fails it).
  Case c{1, 2, 2, 65, 130, 64, 64};
  c.input_scale = 1000.0f;
  expect_matches_reference(c, GetParam(), 1, 1e-3);
  c.mask = MaskCase::kAdditiveFull;
  expect_matches_reference(c, GetParam(), 1, 1e-3);
}

TEST_P(EveryIsa, HugeScoresKeepTheirSoftmax) {
  // Scores ~1e10, from huge inputs or a huge scale: beyond the exponentials' fused argument
  // (kFusedShiftLimit), whose rounded shift would move P by 2^(+-860). The top key of each row
  // leads the next by far more than the scores' float32 rounding (~1e10 * 2^-24), so the
  // softmax is one-hot and the output well defined.
  Case c{1, 2, 2, 40, 70, 64, 64};
  c.input_scale = 1e10f;
  expect_matches_reference(c, GetParam());
  c.mask = MaskCase::kAdditiveFull;
  c.causal = true;
  expect_matches_reference(c, GetParam());
  c = Case{1, 2, 2, 40, 70, 64, 64};
  c.softmax_scale = 1e9;
  expect_matches_reference(c, GetParam());
}

TEST_P(EveryIsa, MinFloatMaskRowsMatchTheReference) {
  // Padding masks of torch.finfo(float32).min (hide_keys_with_min_float): whole rows hidden
  // (torch averages the values there), and 560 keys of left padding, more than a key tile.
  const Case c{1, 2, 2, 40, 700, 32, 32, Layout::kBHSD, MaskCase::kAdditiveFull};
  Problem pr;
  build(c, pr, 5);
  hide_keys_with_min_float(pr, 560);
  run_attention_forward(make_attention_params(pr.args), GetParam());
  compute_reference(pr);
  expect_close_to_reference(pr, ForwardReference{pr.ref_out, pr.ref_lse}, 1e-5);
}

TEST_P(EveryIsa, FullyMaskedRowsGiveZeroAndMinusInfLse) {
  Case c{1, 2, 2, 40, 70, 32, 32};
  Problem pr;
  build(c, pr, 5);
  pr.boolean = BoolTensor({c.len_q, c.len_k});
  for (int64_t i = 0; i < c.len_q; ++i)
    for (int64_t j = 0; j < c.len_k; ++j) pr.boolean.at({i, j}) = (i % 3 != 0);  // rows 0,3,..
  pr.args.attn_mask = pr.boolean.view(DType::kBool);
  run_attention_forward(make_attention_params(pr.args), GetParam());
  for (int64_t h = 0; h < c.heads_q; ++h) {
    for (int64_t i = 0; i < c.len_q; ++i) {
      const float lse = pr.lse.at({0, h, i});
      if (i % 3 == 0) {
        EXPECT_EQ(lse, -INFINITY);
        for (int64_t d = 0; d < c.head_dim_v; ++d) EXPECT_EQ(pr.out.at({0, h, i, d}), 0.0f);
      } else {
        EXPECT_TRUE(std::isfinite(lse));
      }
    }
  }
}

TEST_P(EveryIsa, EmptyKeysGiveZeros) {
  Case c{1, 2, 2, 10, 0, 16, 16};
  Problem pr;
  build(c, pr, 9);
  run_attention_forward(make_attention_params(pr.args), GetParam());
  for (float x : pr.out.storage) EXPECT_EQ(x, 0.0f);
  for (float x : pr.lse.storage) EXPECT_EQ(x, -INFINITY);
}

TEST_P(EveryIsa, NanAndInfPropagateLikeTheReference) {
  Case c{1, 1, 1, 20, 50, 16, 16};
  for (int variant = 0; variant < 3; ++variant) {
    Problem pr;
    build(c, pr, 11);
    if (variant == 0) pr.k.at({0, 0, 7, 3}) = NAN;       // one key NaN: every row NaN
    if (variant == 1) pr.q.at({0, 0, 4, 0}) = NAN;       // one query NaN: that row NaN
    if (variant == 2) pr.v.at({0, 0, 9, 2}) = INFINITY;  // inf value: that column inf
    run_attention_forward(make_attention_params(pr.args), GetParam());
    compute_reference(pr);
    SCOPED_TRACE(variant);
    EXPECT_LE(max_abs_diff(pr.out, pr.ref_out), 1e-5);  // NaN/inf positions must agree exactly
    if (variant == 0) {
      EXPECT_TRUE(std::isnan(pr.out.at({0, 0, 0, 0})));
    }
    if (variant == 1) {
      EXPECT_TRUE(std::isnan(pr.out.at({0, 0, 4, 0})));
      EXPECT_FALSE(std::isnan(pr.out.at({0, 0, 5, 0})));
    }
    if (variant == 2) {
      EXPECT_EQ(pr.out.at({0, 0, 0, 2}), INFINITY);
    }
  }
}

TEST_P(EveryIsa, ResultsAreIdenticalForOneAndTwoThreads) {
  Case c{1, 2, 2, 333, 257, 72, 72};
  c.mask = MaskCase::kAdditiveHeads;
  Problem one, two;
  build(c, one, 3);
  build(c, two, 3);
  one.args.num_threads = 1;
  two.args.num_threads = 2;
  run_attention_forward(make_attention_params(one.args), GetParam());
  run_attention_forward(make_attention_params(two.args), GetParam());
  EXPECT_EQ(one.out.storage, two.out.storage);
  EXPECT_EQ(one.lse.storage, two.lse.storage);
}

TEST_P(EveryIsa, WorkspaceIsReleasedAndLinearInSequenceLength) {
  // Peak workspace must not grow like Lq*Lk: 2x the length may cost at most ~2x the bytes.
  // (Both lengths reach 2048, where AVX2 packs K and V as panels: the same packing regime.)
  auto peak_for = [&](int64_t len) {
    Case c{1, 2, 2, len, len, 64, 64};
    Problem pr;
    build(c, pr, 2);
    workspace_reset_peak();
    const int64_t before = workspace_stats().current_bytes;
    run_attention_forward(make_attention_params(pr.args), GetParam());
    EXPECT_EQ(workspace_stats().current_bytes, before);
    return workspace_stats().peak_bytes - before;
  };
  const int64_t small = peak_for(2048), large = peak_for(4096);
  EXPECT_GT(small, 0);
  EXPECT_LE(large, 2 * small + (1 << 20));
  EXPECT_LT(large, 4096LL * 4096 * 4 / 8);  // far below one head's score matrix
}

INSTANTIATE_TEST_SUITE_P(Kernels, EveryIsa, ::testing::ValuesIn(compiled_isas()),
                         variant_test_name);

}  // namespace
}  // namespace npu_attn::testing
