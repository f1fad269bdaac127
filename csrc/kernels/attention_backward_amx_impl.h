// bfloat16 attention backward on AMX: the five tile products of the tiled backward
// (attention_backward_impl.h: same plan, items, Delta, masking, softmax recomputation, dQ
// reduction and determinism) on the tile unit, the element-wise work on AVX-512 as in the
// vdpbf16ps backward (attention_backward_bf16_impl.h), whose packers and rounding it shares.
//
// Each product is tile_product (amx_tiles_impl.h) on operands that are whole tiles:
//     S   = Q K^T    A: Q words      (64 queries x kw_pad)   B: K^T pairs (kw_pad x 64 keys)
//     dP  = dO V^T   A: dO words     (64 x vw_pad)           B: V^T pairs (vw_pad x 64)
//     dV += P^T dO   A: P^T words    (64 keys x 32 q-pairs)  B: dO pairs  (32 x dim_v_pad)
//     dK += dS^T Q   A: dS^T words   (64 keys x 32)          B: Q pairs   (32 x dim_pad)
//     dQ += dS K     A: dS words     (64 queries x 32 k-pairs) B: K pairs (32 x dim_pad)
// kw_pad / vw_pad: head-dim pair words rounded up to a tile row (32 head dims); dim_pad /
// dim_v_pad (the plan's) are whole 16-column tiles. P^T and dS^T words are 16x16 register
// transposes of the pairs along queries that the vdpbf16ps kernel uses. Every operand is
// written in full for every tile, padding included (zeros), so a padding row or column never
// multiplies stale scratch (which could hold NaN) and the products need no tail code; the
// accumulators of the key tile (dK, dV) are whole tiles of scratch, and dQ rows past the last
// query of a short tile go to scratch first.
// As in the vdpbf16ps kernel (and FlashAttention-2, torch's CPU backward for 16-bit inputs), P
// and dS are rounded to bfloat16 for the products; S, P, dP, dS, Delta and every accumulator
// are float32, and the scale is applied to S in float32 and to dK and dQ when written.
#pragma once
#include "amx_tiles_impl.h"
#include "attention_backward_bf16_impl.h"

namespace npu_attn {
namespace {

static_assert(kBwdBlockQ == 4 * kTileRows && kBwdBlockK == 4 * kTileRows,
              "query and key tiles are 64: whole 32-row blocks of tiles, 32 pair words deep");

// The vdpbf16ps backward's scratch with head-dim word rows padded to whole tiles (kw_pad, vw_pad
// words), plus the transposed P and dS and a dQ tile.
struct AmxBackwardScratch : PairBackwardScratch {
  uint32_t* pt_words;   // kBwdBlockK x kBwdBlockQ/2: P^T words (transpose of p_pairs)
  uint32_t* dst_words;  // kBwdBlockK x kBwdBlockQ/2: dS^T words
  float* dq_tile;       // kBwdBlockQ x dim_pad: dS K of a tile with fewer than 64 queries
  int64_t kw_pad, vw_pad;
};

inline int64_t tile_words_of(int64_t dim) {
  return round_up(max_i64(words_of(dim), 1), kTileWords);
}

// Pair words of rows [first, first + count) at `ld` words per row, zero past `dim` and in the
// rows from `count` to `rows`.
inline void pack_row_words_padded(const uint16_t* src, int64_t row_stride, int64_t col_stride,
                                  int64_t dim, int64_t first, int64_t count, int64_t rows,
                                  int64_t ld, uint32_t* dst) {
  const int64_t words = words_of(dim);
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t* row = dst + r * ld;
    int64_t w = 0;
    if (r < count) {
      pack_row_words(src, row_stride, col_stride, dim, first + r, 1, row);
      w = words;
    }
    for (; w < ld; ++w) row[w] = 0;
  }
}

// Pairs along rows of rows [first, first + count), `rows` / 2 pair rows of `ld` words, zero past
// `dim` and past the last row.
inline void pack_row_pairs_padded(const uint16_t* src, int64_t row_stride, int64_t col_stride,
                                  int64_t dim, int64_t first, int64_t count, int64_t rows,
                                  int64_t ld, uint32_t* dst) {
  pack_row_pairs(src, row_stride, col_stride, dim, first, count, ld, dst);
  for (int64_t i = ceil_div(count, 2) * ld; i < rows / 2 * ld; ++i) dst[i] = 0;
}

inline void zero_words(uint32_t* dst, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = 0;
}

// (rows x cols) words -> (cols x rows) words, both multiples of 16, by 16x16 register blocks.
inline void transpose_words(const uint32_t* src, int64_t rows, int64_t cols, uint32_t* dst) {
  for (int64_t i0 = 0; i0 < rows; i0 += 16) {
    for (int64_t j0 = 0; j0 < cols; j0 += 16) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (i0 + i) * cols + j0);
      transpose_16x16_words(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (j0 + j) * rows + i0, r[j]);
    }
  }
}

struct AmxTileBackward {
  typedef AmxBackwardScratch Scratch;
  static int64_t block_q(const AttentionParams&) { return kBwdBlockQ; }
  static int64_t block_k(const AttentionParams&) { return kBwdBlockK; }

  static int64_t scratch_floats(const AttentionBackwardParams& bp, const BackwardPlan& plan) {
    return pair_backward_scratch_floats(plan, tile_words_of(bp.fwd.head_dim),
                                        tile_words_of(bp.fwd.head_dim_v)) +
           2 * kBwdBlockK * kBwdBlockQ / 2 + kBwdBlockQ * plan.dim_pad;
  }

  // Also zeroes the K^T and V^T pair rows past the head dims once: pack_keys writes only the
  // rows before them.
  static Scratch carve(const AttentionBackwardParams& bp, const BackwardPlan& plan, float* base) {
    Scratch s{};
    s.kw_pad = tile_words_of(bp.fwd.head_dim);
    s.vw_pad = tile_words_of(bp.fwd.head_dim_v);
    static_cast<PairBackwardScratch&>(s) =
        carve_pair_backward_scratch(plan, s.kw_pad, s.vw_pad, base);
    s.pt_words =
        reinterpret_cast<uint32_t*>(base) + pair_backward_scratch_floats(plan, s.kw_pad, s.vw_pad);
    s.dst_words = s.pt_words + kBwdBlockK * kBwdBlockQ / 2;
    s.dq_tile = reinterpret_cast<float*>(s.dst_words + kBwdBlockK * kBwdBlockQ / 2);
    const int64_t kw = words_of(bp.fwd.head_dim), vw = words_of(bp.fwd.head_dim_v);
    zero_words(s.kt_pairs + kw * kBwdBlockK, (s.kw_pad - kw) * kBwdBlockK);
    zero_words(s.vt_pairs + vw * kBwdBlockK, (s.vw_pad - vw) * kBwdBlockK);
    return s;
  }

  // The tile configuration is per thread: loaded when a thread starts, released when it ends.
  static void enter_thread(Scratch&) { configure_tiles(); }
  static void leave_thread(Scratch&) { _tile_release(); }

  // Key tile t.k0 of K (as K^T pairs and pairs along keys) and V (as V^T pairs); the pair rows
  // past the head dims stay zero from carve().
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
    pack_row_pairs_padded(k, p.k_stride[2], p.k_stride[3], p.head_dim, t.k0, t.keys, kBwdBlockK,
                          plan.dim_pad, s.k_pairs);
  }

  // Q and dO rows of the query tile in both layouts, zero past its rows.
  static void pack_queries(const AttentionBackwardParams& bp, const BackwardPlan& plan,
                           const TileCoords& t, Scratch& s) {
    const AttentionParams& p = bp.fwd;
    const uint16_t* q =
        static_cast<const uint16_t*>(p.q) + t.batch * p.q_stride[0] + t.head * p.q_stride[1];
    const uint16_t* g = static_cast<const uint16_t*>(bp.grad_out) +
                        t.batch * bp.grad_out_stride[0] + t.head * bp.grad_out_stride[1];
    const int64_t* gs = bp.grad_out_stride;
    pack_row_words_padded(q, p.q_stride[2], p.q_stride[3], p.head_dim, t.q0, t.rows, kBwdBlockQ,
                          s.kw_pad, s.q_words);
    pack_row_words_padded(g, gs[2], gs[3], p.head_dim_v, t.q0, t.rows, kBwdBlockQ, s.vw_pad,
                          s.do_words);
    pack_row_pairs_padded(q, p.q_stride[2], p.q_stride[3], p.head_dim, t.q0, t.rows, kBwdBlockQ,
                          plan.dim_pad, s.q_pairs);
    pack_row_pairs_padded(g, gs[2], gs[3], p.head_dim_v, t.q0, t.rows, kBwdBlockQ, plan.dim_v_pad,
                          s.do_pairs);
  }

  // P and dS (float32, t.rows valid rows) rounded to the three bfloat16 layouts of the
  // products, zero past the rows.
  static void round_probs_and_dscores(const TileCoords& t, Scratch& s) {
    constexpr int64_t kKeyVecs = kBwdBlockK / kLanes;
    const int64_t pair_rows = ceil_div(t.rows, 2);
    round_row_pairs(s.probs, t.rows, kKeyVecs, s.p_pairs);
    round_row_pairs(s.dscores, t.rows, kKeyVecs, s.ds_pairs);
    zero_words(s.p_pairs + pair_rows * kBwdBlockK, (kBwdBlockQ / 2 - pair_rows) * kBwdBlockK);
    zero_words(s.ds_pairs + pair_rows * kBwdBlockK, (kBwdBlockQ / 2 - pair_rows) * kBwdBlockK);
    round_row_words(s.dscores, t.rows, kKeyVecs, s.ds_words);
    zero_words(s.ds_words + t.rows * kBwdBlockK / 2, (kBwdBlockQ - t.rows) * kBwdBlockK / 2);
    transpose_words(s.p_pairs, kBwdBlockQ / 2, kBwdBlockK, s.pt_words);
    transpose_words(s.ds_pairs, kBwdBlockQ / 2, kBwdBlockK, s.dst_words);
  }

  // All the work of one (query tile, key tile): accumulates into s.dk, s.dv and dq_rows.
  template <typename T>
  static void tile(const AttentionBackwardParams& bp, const BackwardPlan& plan, const TileCoords& t,
                   const float* delta, Scratch& s, float* dq_rows) {
    const AttentionParams& p = bp.fwd;
    pack_queries(bp, plan, t, s);
    // S = Q K^T and dP = dO V^T over whole tiles: padding keys and rows come out 0 (or NaN
    // from a NaN input, which the reference propagates too); the element-wise steps below run
    // on every key column, so padding keys get P = dS = 0.
    tile_product<false>(s.q_words, s.kw_pad, s.kt_pairs, kBwdBlockK, kBwdBlockQ, s.kw_pad,
                        kBwdBlockK, s.probs, kBwdBlockK);
    tile_product<false>(s.do_words, s.vw_pad, s.vt_pairs, kBwdBlockK, kBwdBlockQ, s.vw_pad,
                        kBwdBlockK, s.dscores, kBwdBlockK);
    TileCoords all_keys = t;
    all_keys.key_vecs = kBwdBlockK / kLanes;
    scale_scores(all_keys, p.scale, s.probs);
    if (p.mask_kind != MaskKind::kNone || p.is_causal) mask_scores(p, t, kBwdBlockK, s.probs);
    scores_to_probs(p, all_keys, kBwdBlockK, s.probs);
    probs_to_dscores(all_keys, kBwdBlockK, delta + (t.batch * p.heads_q + t.head) * p.len_q + t.q0,
                     s.probs, s.dscores);
    round_probs_and_dscores(t, s);
    // dV += P^T dO;  dK += dS^T Q;  dQ += dS K   (scale applied when dK and dQ are written)
    tile_product<true>(s.pt_words, kBwdBlockQ / 2, s.do_pairs, plan.dim_v_pad, kBwdBlockK,
                       kBwdBlockQ / 2, plan.dim_v_pad, s.dv, plan.dim_v_pad);
    tile_product<true>(s.dst_words, kBwdBlockQ / 2, s.q_pairs, plan.dim_pad, kBwdBlockK,
                       kBwdBlockQ / 2, plan.dim_pad, s.dk, plan.dim_pad);
    if (t.rows == kBwdBlockQ) {
      tile_product<true>(s.ds_words, kBwdBlockK / 2, s.k_pairs, plan.dim_pad, kBwdBlockQ,
                         kBwdBlockK / 2, plan.dim_pad, dq_rows, plan.dim_pad);
      return;
    }
    // A short last query tile: its dQ rows end the item's buffer, so whole tiles would write
    // past them.
    tile_product<false>(s.ds_words, kBwdBlockK / 2, s.k_pairs, plan.dim_pad, kBwdBlockQ,
                        kBwdBlockK / 2, plan.dim_pad, s.dq_tile, plan.dim_pad);
    for (int64_t i = 0; i < t.rows * plan.dim_pad; i += kLanes)
      store(dq_rows + i, load(dq_rows + i) + load(s.dq_tile + i));
  }

  // dK's products used the unscaled queries.
  static float dk_factor(const AttentionParams& p) { return p.scale; }
};

// The bfloat16 backward on AMX tiles (bfloat16 tensors only).
inline void attention_backward_bf16_amx(const AttentionBackwardParams& bp) {
  run_backward<BFloat16, AmxTileBackward>(bp);
}

}  // namespace
}  // namespace npu_attn
