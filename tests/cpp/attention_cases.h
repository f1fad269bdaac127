// Attention problems shared by the forward and backward kernel tests: shapes, memory layouts,
// mask kinds, and the owning tensors plus SdpaArguments that describe one forward call.
#pragma once

#include <cfloat>
#include <cmath>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attention.h"
#include "dispatch.h"
#include "reference.h"
#include "system_info.h"
#include "test_support.h"

namespace npu_attn::testing {

// kBHDS stores the head dim outermost within a head (a transposed view): not unit-stride
// along D, which exercises the kernel's packing path.
enum class Layout { kBHSD, kBSHD, kBHDS };
enum class MaskCase { kNone, kBoolFull, kBool2D, kBoolKeyPadding, kAdditiveFull, kAdditiveHeads };

struct Case {
  int64_t batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v;
  Layout layout = Layout::kBHSD;
  MaskCase mask = MaskCase::kNone;
  bool causal = false;
  float input_scale = 1.0f;                            // multiplies q to produce large logits
  std::optional<double> softmax_scale = std::nullopt;  // `scale` argument (default 1/sqrt(D))

  std::string describe() const {
    std::ostringstream os;
    os << "B" << batch << " Hq" << heads_q << " Hkv" << heads_kv << " Lq" << len_q << " Lk" << len_k
       << " D" << head_dim << " Dv" << head_dim_v << (layout == Layout::kBSHD ? " BSHD" : " BHSD")
       << " mask" << static_cast<int>(mask) << (causal ? " causal" : "") << " qscale" << input_scale
       << (softmax_scale ? " scale" + std::to_string(*softmax_scale) : "");
    return os.str();
  }
};

inline std::vector<int> order_for(Layout layout) {
  switch (layout) {
    case Layout::kBSHD:
      return {0, 2, 1, 3};
    case Layout::kBHDS:
      return {0, 1, 3, 2};
    default:
      return {0, 1, 2, 3};
  }
}

struct Problem {
  FloatTensor q, k, v, out, lse, ref_out, ref_lse;
  FloatTensor additive;
  BoolTensor boolean;
  SdpaArguments args;
};

// The float64 reference of pr's inputs (its arguments, mask included) into pr.ref_out and
// pr.ref_lse.
inline void compute_reference(Problem& pr) {
  SdpaArguments ref_args = pr.args;
  ref_args.out = pr.ref_out.view(DType::kFloat32);
  ref_args.lse = pr.ref_lse.view(DType::kFloat32);
  attention_reference(make_attention_params(ref_args));
}

inline void build_mask(const Case& c, Problem& pr, uint32_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution keep(0.7);
  auto fill_bool = [&](std::vector<int64_t> shape) {
    pr.boolean = BoolTensor(shape);
    for (auto& x : pr.boolean.storage) x = keep(rng);
    pr.args.attn_mask = pr.boolean.view(DType::kBool);
  };
  auto fill_additive = [&](std::vector<int64_t> shape) {
    pr.additive = FloatTensor(shape);
    fill_normal(pr.additive, seed + 7);
    // Some -inf entries, like a padding mask expressed additively.
    for (size_t i = 0; i < pr.additive.storage.size(); i += 5) pr.additive.storage[i] = -INFINITY;
    pr.args.attn_mask = pr.additive.view(DType::kFloat32);
  };
  switch (c.mask) {
    case MaskCase::kNone:
      break;
    case MaskCase::kBoolFull:
      fill_bool({c.batch, c.heads_q, c.len_q, c.len_k});
      break;
    case MaskCase::kBool2D:
      fill_bool({c.len_q, c.len_k});
      break;
    case MaskCase::kBoolKeyPadding: {
      fill_bool({c.batch, 1, 1, c.len_k});
      // Pad the tail of each sequence (all queries then see a prefix).
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t j = 0; j < c.len_k; ++j) pr.boolean.at({b, 0, 0, j}) = j < c.len_k - b;
      break;
    }
    case MaskCase::kAdditiveFull:
      fill_additive({c.batch, c.heads_q, c.len_q, c.len_k});
      break;
    case MaskCase::kAdditiveHeads:
      fill_additive({c.batch, 1, c.len_q, c.len_k});
      break;
  }
}

inline void build(const Case& c, Problem& pr, uint32_t seed) {
  const auto order = order_for(c.layout);
  pr.q = FloatTensor({c.batch, c.heads_q, c.len_q, c.head_dim}, order);
  pr.k = FloatTensor({c.batch, c.heads_kv, c.len_k, c.head_dim}, order);
  pr.v = FloatTensor({c.batch, c.heads_kv, c.len_k, c.head_dim_v}, order);
  pr.out = FloatTensor({c.batch, c.heads_q, c.len_q, c.head_dim_v}, order);
  pr.ref_out = FloatTensor({c.batch, c.heads_q, c.len_q, c.head_dim_v});
  pr.lse = FloatTensor({c.batch, c.heads_q, c.len_q});
  pr.ref_lse = FloatTensor({c.batch, c.heads_q, c.len_q});
  fill_normal(pr.q, seed, c.input_scale);
  fill_normal(pr.k, seed + 1);
  fill_normal(pr.v, seed + 2);
  std::fill(pr.out.storage.begin(), pr.out.storage.end(), NAN);  // every element must be written
  pr.args.query = pr.q.view(DType::kFloat32);
  pr.args.key = pr.k.view(DType::kFloat32);
  pr.args.value = pr.v.view(DType::kFloat32);
  pr.args.out = pr.out.view(DType::kFloat32);
  pr.args.lse = pr.lse.view(DType::kFloat32);
  pr.args.is_causal = c.causal;
  pr.args.scale = c.softmax_scale;
  pr.args.enable_gqa = c.heads_q != c.heads_kv;
  pr.args.num_threads = 2;
  build_mask(c, pr, seed + 3);
}

// A float mask of -FLT_MAX, as transformers builds padding masks from torch.finfo(float32).min,
// written over pr.additive (MaskCase::kAdditiveFull): rows 0, 3, 6, ... hide every key (their
// scores all round to -FLT_MAX, in double too, so their softmax is uniform: the mean of the
// values), the other rows the first `hidden_keys` keys (left padding: beyond one key tile, 512
// keys, the running maximum moves from -FLT_MAX to a finite score) and every fourth key.
inline void hide_keys_with_min_float(Problem& pr, int64_t hidden_keys) {
  const auto& s = pr.additive.shape;
  for (int64_t b = 0; b < s[0]; ++b)
    for (int64_t h = 0; h < s[1]; ++h)
      for (int64_t i = 0; i < s[2]; ++i)
        for (int64_t j = 0; j < s[3]; ++j)
          if (i % 3 == 0 || j < hidden_keys || j % 4 == 0) pr.additive.at({b, h, i, j}) = -FLT_MAX;
}

// Why `isa` never runs the taller query tiles of streamed K/V (kStreamedQueryTile: vectors of
// 256 bits and wider only), or "" if it can: its float32 kernel's name says its vector width.
inline std::string no_streamed_tiles_reason(Isa isa) {
  const std::string fp32_kernel =
      kernel_variant(isa).forward_kernel[static_cast<int>(ElementType::kFloat32)];
  if (fp32_kernel.find("avx") != std::string::npos) return "";
  return "the " + fp32_kernel + " kernel keeps 64-query tiles (256-bit and wider vectors only)";
}

// Sets the L2 size the kernels' tile plans assume (planning_l2_bytes), for one scope.
struct PlanningL2 {
  explicit PlanningL2(int64_t bytes) { set_planning_l2_bytes(bytes); }
  ~PlanningL2() { set_planning_l2_bytes(0); }
  PlanningL2(const PlanningL2&) = delete;
  PlanningL2& operator=(const PlanningL2&) = delete;
};

// The float64 reference for a few queries of a problem too large to reference whole (no mask,
// not causal, one batch): a problem of only the `sampled` queries of every head of `pr` (built
// from `c`), with pr's K and V, whose ref_out holds their reference outputs.
inline Problem reference_for_sampled_queries(const Case& c, const Problem& pr,
                                             const std::vector<int64_t>& sampled) {
  Case sub_case = c;
  sub_case.len_q = static_cast<int64_t>(sampled.size());
  Problem sub;
  build(sub_case, sub, 0);
  sub.k.storage = pr.k.storage;
  sub.v.storage = pr.v.storage;
  for (int64_t h = 0; h < c.heads_q; ++h)
    for (size_t i = 0; i < sampled.size(); ++i)
      for (int64_t d = 0; d < c.head_dim; ++d)
        sub.q.at({0, h, int64_t(i), d}) = pr.q.storage[pr.q.offset({0, h, sampled[i], d})];
  compute_reference(sub);
  return sub;
}

}  // namespace npu_attn::testing
