// bfloat16 attention backward on AVX-512-BF16: the five tile products of the tiled backward
// (attention_backward_impl.h: same plan, items, Delta, masking, softmax recomputation and dQ
// reduction) on vdpbf16ps, which multiplies pairs of bfloat16 values and accumulates in float32.
//
// vdpbf16ps reduces over *pairs*, so every operand is stored as 32-bit words holding two
// bfloat16 values adjacent along the reduced dimension (pair_dot of attention_forward_bf16_impl.h
// broadcasts one word of A and reads rows of words of B):
//     S   = Q K^T    reduced over head_dim:  A = Q words (query rows),  B = K^T pairs (dim x keys)
//     dP  = dO V^T   reduced over head_dim_v: A = dO words,             B = V^T pairs
//     dV += P^T dO   reduced over queries:   A = P pairs (along queries), B = dO pairs (along q.)
//     dK += dS^T Q   reduced over queries:   A = dS pairs (along queries), B = Q pairs
//     dQ += dS K     reduced over keys:      A = dS words (along keys),  B = K pairs (along keys)
// As in FlashAttention-2's and torch's CPU backward for 16-bit inputs, P and dS are rounded to
// bfloat16 for the products; S, P, dP, dS, Delta and every accumulator are float32. The scale
// is applied to S in float32 (before the mask) and to dK and dQ when they are written, so the
// bfloat16 inputs are used exactly as given. Odd head dims, odd tile lengths and padding keys
// are zero halves of the last word, so no product needs tail code.
#pragma once
#ifndef __AVX512BF16__
#error "attention_backward_bf16_impl.h needs -mavx512bf16"
#endif

#include "attention_backward_impl.h"
#include "attention_forward_bf16_impl.h"

namespace npu_attn {
namespace {

static_assert(kBwdBlockK % 32 == 0 && kBwdBlockQ % 2 == 0,
              "key tiles are whole 32-key rows of dS words; query tiles whole pairs");

struct PairBackwardScratch {
  uint32_t* kt_pairs;  // k_words x kBwdBlockK: K^T pairs (K[j][2w], K[j][2w+1]), zero keys after
  uint32_t* vt_pairs;  // v_words x kBwdBlockK: V^T pairs
  uint32_t* k_pairs;   // kBwdBlockK/2 x dim_pad: (K[2i][c], K[2i+1][c]), zero after the keys
  float* dk;           // kBwdBlockK x dim_pad: dK accumulator of the key tile (unscaled)
  float* dv;           // kBwdBlockK x dim_v_pad: dV accumulator of the key tile
  uint32_t* q_words;   // kBwdBlockQ x k_words: Q rows as pair words
  uint32_t* do_words;  // kBwdBlockQ x v_words: dO rows as pair words
  uint32_t* q_pairs;   // kBwdBlockQ/2 x dim_pad: (Q[2i][c], Q[2i+1][c]), zero after the rows
  uint32_t* do_pairs;  // kBwdBlockQ/2 x dim_v_pad: dO pairs along queries
  float* probs;        // kBwdBlockQ x kBwdBlockK: S, then P
  float* dscores;      // kBwdBlockQ x kBwdBlockK: dP, then dS
  uint32_t* p_pairs;   // kBwdBlockQ/2 x kBwdBlockK: P pairs along queries
  uint32_t* ds_pairs;  // kBwdBlockQ/2 x kBwdBlockK: dS pairs along queries
  uint32_t* ds_words;  // kBwdBlockQ x kBwdBlockK/2: dS pairs along keys
};

// float32 rows (queries x kBwdBlockK) -> pairs along the rows (rows/2 x kBwdBlockK words),
// rounded to nearest even; an odd last row pairs with zeros.
inline void round_row_pairs(const float* src, int64_t rows, int64_t key_vecs, uint32_t* dst) {
  for (int64_t i = 0; 2 * i < rows; ++i) {
    const float* lo = src + 2 * i * kBwdBlockK;
    const bool has_hi = 2 * i + 1 < rows;
    for (int64_t j = 0; j < key_vecs * kLanes; j += kLanes) {
      const Vec hi = has_hi ? load(lo + kBwdBlockK + j) : splat(0.0f);
      _mm512_storeu_si512(dst + i * kBwdBlockK + j, pack_pairs(load(lo + j), hi));
    }
  }
}

// float32 rows -> pair words along each row (rows x kBwdBlockK/2), rounded to nearest even:
// vcvtne2ps2bf16 of 32 consecutive values is 16 words (x[2w], x[2w+1]) in order.
inline void round_row_words(const float* src, int64_t rows, int64_t key_vecs, uint32_t* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * kBwdBlockK;
    uint32_t* out = dst + r * (kBwdBlockK / 2);
    for (int64_t j = 0; j < key_vecs * kLanes; j += 2 * kLanes) {
      const Vec hi = j + kLanes < key_vecs * kLanes ? load(row + j + kLanes) : splat(0.0f);
      _mm512_storeu_si512(out + j / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, load(row + j)));
    }
  }
}

// S *= scale in float32 (the products see the bfloat16 inputs unscaled).
inline void scale_scores(const TileCoords& t, float scale, float* s) {
  const Vec factor = splat(scale);
  for (int64_t i = 0; i < t.rows; ++i)
    for (int64_t j = 0; j < t.key_vecs * kLanes; j += kLanes)
      store(s + i * kBwdBlockK + j, load(s + i * kBwdBlockK + j) * factor);
}

// ---------------------------------------------------------------- the tile kernel
// A PairBackwardScratch whose K^T/V^T pair rows and Q/dO word rows hold `kw` and `vw` words
// (the head dims' pair words; the AMX backward pads them to whole tiles): its floats, and its
// carving from `base`.
inline int64_t pair_backward_scratch_floats(const BackwardPlan& plan, int64_t kw, int64_t vw) {
  return kBwdBlockK * (kw + vw) + kBwdBlockK / 2 * plan.dim_pad +
         kBwdBlockK * (plan.dim_pad + plan.dim_v_pad) + kBwdBlockQ * (kw + vw) +
         kBwdBlockQ / 2 * (plan.dim_pad + plan.dim_v_pad) + 2 * kBwdBlockQ * kBwdBlockK +
         3 * (kBwdBlockQ / 2) * kBwdBlockK;
}

inline PairBackwardScratch carve_pair_backward_scratch(const BackwardPlan& plan, int64_t kw,
                                                       int64_t vw, float* base) {
  PairBackwardScratch s{};
  uint32_t* w = reinterpret_cast<uint32_t*>(base);
  s.kt_pairs = w;
  s.vt_pairs = s.kt_pairs + kw * kBwdBlockK;
  s.k_pairs = s.vt_pairs + vw * kBwdBlockK;
  s.dk = reinterpret_cast<float*>(s.k_pairs + kBwdBlockK / 2 * plan.dim_pad);
  s.dv = s.dk + kBwdBlockK * plan.dim_pad;
  s.q_words = reinterpret_cast<uint32_t*>(s.dv + kBwdBlockK * plan.dim_v_pad);
  s.do_words = s.q_words + kBwdBlockQ * kw;
  s.q_pairs = s.do_words + kBwdBlockQ * vw;
  s.do_pairs = s.q_pairs + kBwdBlockQ / 2 * plan.dim_pad;
  s.probs = reinterpret_cast<float*>(s.do_pairs + kBwdBlockQ / 2 * plan.dim_v_pad);
  s.dscores = s.probs + kBwdBlockQ * kBwdBlockK;
  s.p_pairs = reinterpret_cast<uint32_t*>(s.dscores + kBwdBlockQ * kBwdBlockK);
  s.ds_pairs = s.p_pairs + kBwdBlockQ / 2 * kBwdBlockK;
  s.ds_words = s.ds_pairs + kBwdBlockQ / 2 * kBwdBlockK;
  return s;
}

struct PairTileBackward {
  typedef PairBackwardScratch Scratch;
  static int64_t block_q(const AttentionParams&) { return kBwdBlockQ; }
  static int64_t block_k(const AttentionParams&) { return kBwdBlockK; }

  static int64_t scratch_floats(const AttentionBackwardParams& bp, const BackwardPlan& plan) {
    return pair_backward_scratch_floats(plan, words_of(bp.fwd.head_dim),
                                        words_of(bp.fwd.head_dim_v));
  }

  static Scratch carve(const AttentionBackwardParams& bp, const BackwardPlan& plan, float* base) {
    return carve_pair_backward_scratch(plan, words_of(bp.fwd.head_dim), words_of(bp.fwd.head_dim_v),
                                       base);
  }
  static void enter_thread(Scratch&) {}
  static void leave_thread(Scratch&) {}

  // Key tile t.k0 of K (as K^T pairs and pairs along keys) and V (as V^T pairs).
  template <typename T>
  static void pack_keys(const AttentionBackwardParams& bp, const BackwardPlan& plan,
                        const TileCoords& t, const T* k_typed, const T* v_typed, Scratch& s) {
    const AttentionParams& p = bp.fwd;
    const uint16_t* k = reinterpret_cast<const uint16_t*>(k_typed);
    const uint16_t* v = reinterpret_cast<const uint16_t*>(v_typed);
    pack_transposed_words(k, p.k_stride[2], p.k_stride[3], p.head_dim, t.k0, t.keys, kBwdBlockK,
                          s.kt_pairs);
    pack_transposed_words(v, p.v_stride[2], p.v_stride[3], p.head_dim_v, t.k0, t.keys, kBwdBlockK,
                          s.vt_pairs);
    pack_row_pairs(k, p.k_stride[2], p.k_stride[3], p.head_dim, t.k0, t.keys, plan.dim_pad,
                   s.k_pairs);
  }

  // All the work of one (query tile, key tile): accumulates into s.dk, s.dv and dq_rows.
  template <typename T>
  static void tile(const AttentionBackwardParams& bp, const BackwardPlan& plan, const TileCoords& t,
                   const float* delta, Scratch& s, float* dq_rows) {
    const AttentionParams& p = bp.fwd;
    const int64_t kw = words_of(p.head_dim), vw = words_of(p.head_dim_v);
    const uint16_t* q =
        static_cast<const uint16_t*>(p.q) + t.batch * p.q_stride[0] + t.head * p.q_stride[1];
    const uint16_t* g = static_cast<const uint16_t*>(bp.grad_out) +
                        t.batch * bp.grad_out_stride[0] + t.head * bp.grad_out_stride[1];
    pack_row_words(q, p.q_stride[2], p.q_stride[3], p.head_dim, t.q0, t.rows, s.q_words);
    pack_row_words(g, bp.grad_out_stride[2], bp.grad_out_stride[3], p.head_dim_v, t.q0, t.rows,
                   s.do_words);
    pack_row_pairs(q, p.q_stride[2], p.q_stride[3], p.head_dim, t.q0, t.rows, plan.dim_pad,
                   s.q_pairs);
    pack_row_pairs(g, bp.grad_out_stride[2], bp.grad_out_stride[3], p.head_dim_v, t.q0, t.rows,
                   plan.dim_v_pad, s.do_pairs);
    const UnalignedWord* qw = reinterpret_cast<const UnalignedWord*>(s.q_words);
    const UnalignedWord* dow = reinterpret_cast<const UnalignedWord*>(s.do_words);
    // S = scale * Q K^T  and  dP = dO V^T   (rows: queries, columns: keys)
    pair_dot<ALayout::kRowMajor, false>(qw, kw, s.kt_pairs, kBwdBlockK, kw, t.rows, t.key_vecs,
                                        s.probs, kBwdBlockK);
    pair_dot<ALayout::kRowMajor, false>(dow, vw, s.vt_pairs, kBwdBlockK, vw, t.rows, t.key_vecs,
                                        s.dscores, kBwdBlockK);
    scale_scores(t, p.scale, s.probs);
    if (p.mask_kind != MaskKind::kNone || p.is_causal) mask_scores(p, t, kBwdBlockK, s.probs);
    scores_to_probs(p, t, kBwdBlockK, s.probs);
    probs_to_dscores(t, kBwdBlockK, delta + (t.batch * p.heads_q + t.head) * p.len_q + t.q0,
                     s.probs, s.dscores);
    round_row_pairs(s.probs, t.rows, t.key_vecs, s.p_pairs);
    round_row_pairs(s.dscores, t.rows, t.key_vecs, s.ds_pairs);
    round_row_words(s.dscores, t.rows, t.key_vecs, s.ds_words);
    // dV += P^T dO;  dK += dS^T Q;  dQ += dS K   (scale applied when dK and dQ are written)
    const int64_t query_pairs = ceil_div(t.rows, 2), key_pairs = ceil_div(t.keys, 2);
    pair_dot<ALayout::kColMajor, true>(reinterpret_cast<const UnalignedWord*>(s.p_pairs),
                                       kBwdBlockK, s.do_pairs, plan.dim_v_pad, query_pairs, t.keys,
                                       plan.dim_v_pad / kLanes, s.dv, plan.dim_v_pad);
    pair_dot<ALayout::kColMajor, true>(reinterpret_cast<const UnalignedWord*>(s.ds_pairs),
                                       kBwdBlockK, s.q_pairs, plan.dim_pad, query_pairs, t.keys,
                                       plan.dim_pad / kLanes, s.dk, plan.dim_pad);
    pair_dot<ALayout::kRowMajor, true>(reinterpret_cast<const UnalignedWord*>(s.ds_words),
                                       kBwdBlockK / 2, s.k_pairs, plan.dim_pad, key_pairs, t.rows,
                                       plan.dim_pad / kLanes, dq_rows, plan.dim_pad);
  }

  // dK's products used the unscaled queries.
  static float dk_factor(const AttentionParams& p) { return p.scale; }
};

// The bfloat16 backward on vdpbf16ps (bfloat16 tensors only).
inline void attention_backward_bf16_pairs(const AttentionBackwardParams& bp) {
  run_backward<BFloat16, PairTileBackward>(bp);
}

}  // namespace
}  // namespace npu_attn
