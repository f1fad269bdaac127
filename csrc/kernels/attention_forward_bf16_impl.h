// bfloat16 attention forward on AVX-512-BF16: both products use vdpbf16ps, which multiplies
// pairs of bfloat16 values and accumulates in float32 (twice the multiply rate of float32 FMA).
//
// Same algorithm and blocking as the float32 kernel (attention_forward_impl.h, whose blocking
// rules, masking, online softmax bookkeeping and output code this file reuses), run by the same
// driver (run_forward, forward_driver_impl.h) as Bf16PairFamily: vectorised along queries, one
// float32 lane per query. vdpbf16ps reduces over *pairs*, so the operands are
// stored as 32-bit words holding two bfloat16 values adjacent along the reduced dimension:
//     Q pairs   (head_dim/2 x queries)   word = (Q[q][2p], Q[q][2p+1])   from the query rows
//     K rows    (keys x head_dim/2)      word = (K[j][2p], K[j][2p+1])   K read in place
//     P pairs   (keys/2 x queries)       word = (P[2i][q], P[2i+1][q])   written by the softmax
//     V pairs   (keys/2 x head_dim_v)    word = (V[2i][c], V[2i+1][c])   packed once per pair
//               (rows padded by a cache line where they would alias in L1: packed_v_row_floats)
//   S^T[j][q]  = sum_p K[j][p] . Qp[p][q]       then * scale, mask, online softmax (float32)
//   O^T[c][q] += sum_i Vp[i][c] . Pp[i][q]
// Accumulation, softmax and the output are float32; P is rounded to bfloat16 before the second
// product, as torch's CPU kernel and FlashAttention do for 16-bit inputs.
//
// Included by attention_forward_avx512_bf16.cpp, and by the AMX kernel, which shares the pair
// layouts, scratch and the softmax (functions are `inline` so a TU that uses only some of them
// compiles without unused-function warnings; the anonymous namespace keeps them local either
// way).
#pragma once
#ifndef __AVX512BF16__
#error "attention_forward_bf16_impl.h needs -mavx512bf16"
#endif

#include <immintrin.h>

#include "attention_forward_impl.h"
#include "bf16_pairs_impl.h"

namespace npu_attn {
namespace {

static_assert(kLanes == 16, "the bfloat16 kernel is written for 512-bit vectors");

typedef uint32_t UnalignedWord __attribute__((aligned(2), may_alias));

NPU_ATTN_VEC_INLINE __m512bh load_pairs(const uint32_t* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

// c[r][v] (+)= sum_i A(r, i) . b[i][v]: like broadcast_fma_block, but every element is a pair
// of bfloat16 (one 32-bit word) and each step is one vdpbf16ps.
template <ALayout Layout, bool Accumulate, int Rows, int Vecs>
void pair_dot_block(const UnalignedWord* a, int64_t lda, const uint32_t* b, int64_t ldb,
                    int64_t depth, float* c, int64_t ldc) {
  const int64_t row_step = Layout == ALayout::kRowMajor ? lda : 1;
  const int64_t depth_step = Layout == ALayout::kRowMajor ? 1 : lda;
  __m512 acc[Rows][Vecs];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < Vecs; ++v)
      acc[r][v] = Accumulate ? _mm512_loadu_ps(c + r * ldc + v * kLanes) : _mm512_setzero_ps();
  for (int64_t i = 0; i < depth; ++i) {
    __m512bh bi[Vecs];
#pragma GCC unroll 4
    for (int v = 0; v < Vecs; ++v) bi[v] = load_pairs(b + i * ldb + v * kLanes);
    const UnalignedWord* ai = a + i * depth_step;
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(ai[r * row_step]));
#pragma GCC unroll 4
      for (int v = 0; v < Vecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, bi[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < Vecs; ++v) _mm512_storeu_ps(c + r * ldc + v * kLanes, acc[r][v]);
}

template <ALayout Layout, bool Accumulate>
void pair_dot(const UnalignedWord* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t depth,
              int64_t rows, int64_t vecs, float* c, int64_t ldc) {
  const int64_t row_step = Layout == ALayout::kRowMajor ? lda : 1;
  for_each_register_block(rows, vecs, [&](auto block_rows, auto block_vecs, int64_t r, int64_t v0) {
    pair_dot_block<Layout, Accumulate, decltype(block_rows)::value, decltype(block_vecs)::value>(
        a + r * row_step, lda, b + v0 * kLanes, ldb, depth, c + r * ldc + v0 * kLanes, ldc);
  });
}

// S^T comes out of the products unscaled. An additive mask must be added to scaled scores, and
// scale == 0 would turn masked -inf into NaN inside the softmax, so then scale here and return 1;
// otherwise leave it to softmax_update_pairs and return the scale it still has to apply.
inline float scale_scores_if_needed(const AttentionParams& p, int64_t keys, int64_t lanes,
                                    float* st, int64_t ld) {
  if (p.mask_kind != MaskKind::kAdditive && p.scale > 0.0f) return p.scale;
  scale_score_rows(st, ld, keys, lanes / kLanes, p.scale);
  return 1.0f;
}

// ---------------------------------------------------------------- plan
// Operand layout of the pair kernels (the AMX kernel fills one in for its padded operands).
struct PairLayout {
  bool k_in_place;       // bfloat16 K rows with unit stride and an even head_dim: read directly
  int64_t k_words;       // words per packed K row (and query-pair rows): ceil(head_dim / 2)
  int64_t v_pairs;       // ceil(len_k / 2)
  int64_t block_k;       // keys per tile (even)
  int64_t block_q;       // queries per task: the leading dimension of every scratch buffer
  int64_t pv_key_pairs;  // key pairs per O^T += V^T P^T pass
  int64_t v_row_words;   // words per packed V pair row: head_dim_v, padded (packed_v_row_floats)
};

struct PairPlan {
  ForwardSchedule schedule;
  PairLayout layout;
};

// One thread's scratch of the pair kernels.
struct PairScratch {
  ThreadScratch f32;  // st (scores), ot, m, l as in the float32 kernel (qt unused)
  uint32_t* qp;       // k_words x block_q: query pairs (zero in padding lanes)
  uint32_t* pp;       // (block_k / 2) x block_q: probability pairs
};

// Floats (4-byte units) of PairScratch with `ot_rows` rows of O^T.
inline int64_t pair_scratch_words(const PairLayout& l, int64_t ot_rows) {
  return l.block_q * (l.block_k + ot_rows + 2) + l.block_q * (l.k_words + l.block_k / 2);
}

inline PairScratch carve_pair_scratch(const PairLayout& l, int64_t ot_rows, float* base) {
  PairScratch s{};
  s.f32.st = base;
  s.f32.ot = s.f32.st + l.block_k * l.block_q;
  s.f32.m = s.f32.ot + ot_rows * l.block_q;
  s.f32.l = s.f32.m + l.block_q;
  s.qp = reinterpret_cast<uint32_t*>(s.f32.l + l.block_q);
  s.pp = s.qp + l.k_words * l.block_q;
  return s;
}

// The plan of the vdpbf16ps kernel: the float32 kernel's blocking rules (kKeyTile, the query
// tile rule, kPackBudgetBytes), with key tiles rounded to whole key pairs.
inline PairPlan plan_pairs(const AttentionParams& p, int threads) {
  PairPlan plan{};
  PairLayout& l = plan.layout;
  ForwardSchedule& s = plan.schedule;
  l.k_in_place = p.k_stride[3] == 1 && p.head_dim % 2 == 0 && p.k_stride[2] % 2 == 0;
  l.k_words = (p.head_dim + 1) / 2;
  l.v_pairs = (p.len_k + 1) / 2;
  l.block_k = round_up(min_i64(kKeyTile, max_i64(p.len_k, 1)), 2);
  l.block_q = query_tile_for(p, threads, false);  // K as bfloat16 pairs, never float panels
  l.pv_key_pairs = pv_key_chunk_for(p) / 2;
  l.v_row_words = packed_v_row_floats(p);
  s.block_q = l.block_q;
  s.pack_tiles = ceil_div(p.len_k, l.block_k);  // V always (as key pairs), K unless in place
  s.pair_floats = l.v_pairs * l.v_row_words + (l.k_in_place ? 0 : p.len_k * l.k_words);
  s.pairs_per_chunk = pairs_per_pack_budget(p, s.pair_floats, kPackBudgetBytes);
  s.scratch_floats = pair_scratch_words(l, p.head_dim_v);
  return plan;
}

// ---------------------------------------------------------------- packing
// The bfloat16 row packers of the pair layouts (also used by attention_backward_bf16_impl.h).
inline int64_t words_of(int64_t dim) {
  return (dim + 1) / 2;
}

// Element (r, c) of a strided bfloat16 matrix as raw bits.
inline uint32_t bits_at(const uint16_t* src, int64_t row_stride, int64_t col_stride, int64_t r,
                        int64_t c) {
  return src[r * row_stride + c * col_stride];
}

// Rows [first, first + count) as pair words along the row, `words` per row: word w of row r =
// (x[r][2w], x[r][2w + 1]), zero past `dim`.
inline void pack_row_words(const uint16_t* src, int64_t row_stride, int64_t col_stride, int64_t dim,
                           int64_t first, int64_t count, uint32_t* dst) {
  const int64_t words = words_of(dim);
  for (int64_t r = 0; r < count; ++r) {
    uint32_t* row = dst + r * words;
    const int64_t at = first + r;
    if (col_stride == 1 && dim % 2 == 0) {
      __builtin_memcpy(row, src + at * row_stride, dim * sizeof(uint16_t));
      continue;
    }
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t high =
          2 * w + 1 < dim ? bits_at(src, row_stride, col_stride, at, 2 * w + 1) : 0;
      row[w] = bits_at(src, row_stride, col_stride, at, 2 * w) | high << 16;
    }
  }
}

// The same rows transposed into pairs along the rows, (words x width): word [w][r] =
// (x[first + r][2w], x[first + r][2w + 1]), zero for r >= count.
inline void pack_transposed_words(const uint16_t* src, int64_t row_stride, int64_t col_stride,
                                  int64_t dim, int64_t first, int64_t count, int64_t width,
                                  uint32_t* dst) {
  const int64_t words = words_of(dim);
  for (int64_t w = 0; w < words; ++w) {
    uint32_t* out = dst + w * width;
    const bool has_high = 2 * w + 1 < dim;
    for (int64_t r = 0; r < count; ++r) {
      const uint32_t high =
          has_high ? bits_at(src, row_stride, col_stride, first + r, 2 * w + 1) : 0;
      out[r] = bits_at(src, row_stride, col_stride, first + r, 2 * w) | high << 16;
    }
    for (int64_t r = count; r < width; ++r) out[r] = 0;
  }
}

// Rows [first, first + count) in pairs of rows, ceil(count / 2) rows of `padded` (>= dim) words:
// word [i][c] = (x[first + 2i][c], x[first + 2i + 1][c]), zero past `dim` and past the last row.
#pragma GCC diagnostic push  // GCC PR105593 (_mm512_cvtepu16_epi32), as for transpose_16x16_words
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
inline void pack_row_pairs(const uint16_t* src, int64_t row_stride, int64_t col_stride, int64_t dim,
                           int64_t first, int64_t count, int64_t padded, uint32_t* dst) {
  for (int64_t i = 0; 2 * i < count; ++i) {
    const uint16_t* lo = src + (first + 2 * i) * row_stride;
    const bool has_hi = 2 * i + 1 < count;
    const uint16_t* hi = lo + row_stride;
    uint32_t* out = dst + i * padded;
    if (col_stride == 1) {
      for (int64_t c = 0; c < padded; c += kLanes) {
        const int64_t n = max_i64(0, min_i64(kLanes, dim - c));
        const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
        const __m512i l = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, lo + c));
        const __m512i h = has_hi ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, hi + c))
                                 : _mm512_setzero_si512();
        const __mmask16 out_mask = static_cast<__mmask16>((1u << min_i64(kLanes, padded - c)) - 1);
        _mm512_mask_storeu_epi32(out + c, out_mask, _mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
      }
      continue;
    }
    for (int64_t c = 0; c < dim; ++c) {
      const uint32_t high = has_hi ? hi[c * col_stride] : 0;
      out[c] = lo[c * col_stride] | high << 16;
    }
    for (int64_t c = dim; c < padded; ++c) out[c] = 0;
  }
}
#pragma GCC diagnostic pop

// Packs V of keys [k0, k0 + count) (k0 even) as key pairs, and K rows if not read in place.
inline void pack_pair_rows(const AttentionParams& p, const PairLayout& l, int64_t pair, int64_t k0,
                           int64_t count, uint32_t* dst) {
  const int64_t b = pair / p.heads_kv, hkv = pair % p.heads_kv;
  const uint16_t* v = static_cast<const uint16_t*>(p.v) + b * p.v_stride[0] + hkv * p.v_stride[1];
  pack_row_pairs(v, p.v_stride[2], p.v_stride[3], p.head_dim_v, k0, count, l.v_row_words,
                 dst + (k0 / 2) * l.v_row_words);
  if (l.k_in_place) return;
  const uint16_t* k = static_cast<const uint16_t*>(p.k) + b * p.k_stride[0] + hkv * p.k_stride[1];
  pack_row_words(k, p.k_stride[2], p.k_stride[3], p.head_dim, k0, count,
                 dst + l.v_pairs * l.v_row_words + k0 * l.k_words);
}

// ---------------------------------------------------------------- one query tile
// Transposes 16 rows of 16 32-bit words in registers: r[i] word w -> r[w] word i.
// (GCC 12's unpack/shuffle intrinsics start from _mm512_undefined_epi32(), which its
// -Wmaybe-uninitialized reports at every inlined use: a known false positive, GCC PR105593.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
inline void transpose_16x16_words(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}
#pragma GCC diagnostic pop

// Q^T pairs when query rows are contiguous along an even head_dim: a pair word is then one
// 32-bit load of two adjacent head dims, and 16 queries x 16 words are one register transpose
// (the strided scalar gather below cost as much as the AMX products on short key ranges).
inline void load_query_pairs_contiguous(const AttentionParams& p, const PairLayout& l,
                                        const QueryTile& tile, const uint16_t* q, uint32_t* qp) {
  const int64_t lanes = tile.vecs * kLanes;
  for (int64_t i0 = 0; i0 < lanes; i0 += 16) {
    for (int64_t w0 = 0; w0 < l.k_words; w0 += 16) {
      const int64_t words = min_i64(16, l.k_words - w0);
      const __mmask16 mask = static_cast<__mmask16>((1u << words) - 1);
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        r[i] = i0 + i < tile.rows
                   ? _mm512_maskz_loadu_epi32(mask, q + (i0 + i) * p.q_stride[2] + 2 * w0)
                   : _mm512_setzero_si512();
      }
      transpose_16x16_words(r);
      for (int64_t w = 0; w < words; ++w) _mm512_storeu_si512(qp + (w0 + w) * l.block_q + i0, r[w]);
    }
  }
}

inline void load_query_pairs(const AttentionParams& p, const PairLayout& l, const QueryTile& tile,
                             uint32_t* qp) {
  const uint16_t* q = static_cast<const uint16_t*>(p.q) + tile.batch * p.q_stride[0] +
                      tile.head * p.q_stride[1] + tile.q0 * p.q_stride[2];
  if (p.q_stride[3] == 1 && p.head_dim % 2 == 0) {
    load_query_pairs_contiguous(p, l, tile, q, qp);
    return;
  }
  const int64_t lanes = tile.vecs * kLanes;
  for (int64_t w = 0; w < l.k_words; ++w) {
    const int64_t d = 2 * w;
    const bool has_hi = d + 1 < p.head_dim;
    uint32_t* row = qp + w * l.block_q;
    for (int64_t i = 0; i < tile.rows; ++i) {
      const uint16_t* src = q + i * p.q_stride[2];
      const uint32_t high = has_hi ? src[(d + 1) * p.q_stride[3]] : 0;
      row[i] = src[d * p.q_stride[3]] | high << 16;
    }
    for (int64_t i = tile.rows; i < lanes; ++i) row[i] = 0;
  }
}

// 2^t for the probabilities P that are rounded to bfloat16 right after: max relative error
// 2.7e-6 (a degree-4 fit of 2^f on [-1/2, 1/2]; measured over 200k points in float32), 700x
// below the 2^-9 of the bfloat16 rounding that follows, in 8 vector operations where
// exp_nonpositive takes ~17 (the softmax's exponentials are most of a bfloat16 attention's
// time: the products run on AMX or vdpbf16ps). As in exp_nonpositive, results that would be
// below 2^-126 (masked keys: t = -inf) are exactly 0 and NaN stays NaN. Horner, not the
// Estrin scheme of exp2_nonpositive: with 512-bit operations on Zen 4 this pass is bound by
// throughput, and Estrin's extra multiply measured 1.00x (0.99-1.02x, bench_kernels, 2 threads).
#pragma GCC diagnostic push  // GCC PR105593, as for transpose_16x16_words
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
NPU_ATTN_VEC_INLINE Vec exp2_probability(Vec t) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(t, splat(-126.0f), _CMP_LT_OQ);  // false for NaN
  const Vec n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const Vec f = t - n;
  Vec poly = splat(9.570094756782055e-3f);
  poly = poly * f + splat(5.591785907745361e-2f);
  poly = poly * f + splat(2.402474433183670e-1f);
  poly = poly * f + splat(6.931217908859253e-1f);
  poly = poly * f + splat(9.999992847442627e-1f);
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), poly, n);
}
#pragma GCC diagnostic pop

// The probabilities of keys j and j + 1 (HasHi; else key j and a zero: an odd last key) for
// Vecs vectors of queries: exp(s * scale - shift) = 2^(s * factor - shift2), rounded to one
// row of bfloat16 pairs of P^T, and added to the row sums.
template <int Vecs, bool HasHi>
NPU_ATTN_VEC_INLINE void exp_pair_row(const float* st, int64_t ld, int64_t j, Vec factor,
                                      const Vec (&shift2)[Vecs], Vec (&sum)[Vecs], uint32_t* pp) {
#pragma GCC unroll 4
  for (int v = 0; v < Vecs; ++v) {
    const Vec lo = exp2_probability(load(st + j * ld + v * kLanes) * factor - shift2[v]);
    const Vec hi = HasHi
                       ? exp2_probability(load(st + (j + 1) * ld + v * kLanes) * factor - shift2[v])
                       : splat(0.0f);
    sum[v] += HasHi ? lo + hi : lo;
    _mm512_storeu_si512(pp + (j / 2) * ld + v * kLanes, pack_pairs(lo, hi));
  }
}

// Online softmax of one key tile (like softmax_update, sharing its first half,
// softmax_rescale) that writes P as bfloat16 pairs.
// `score_scale` is the factor still to apply to S^T: 1 when the caller already scaled it (it
// must when an additive mask was added), else p.scale (> 0), which then costs nothing extra:
// max(scale * s) = scale * max(s), and exp(s * scale - m) is one FMA like exp(s - m).
template <int Vecs>
void softmax_update_pairs(const AttentionParams& p, const PairLayout& l, int64_t keys,
                          float score_scale, PairScratch& ws) {
  const int64_t ld = l.block_q;
  const float* st = ws.f32.st;
  Vec shift[Vecs], sum[Vecs];
  softmax_rescale<Vecs, true>(p, ld, keys, st, score_scale, ws.f32, shift, sum);
  const float exp_scale = shift_huge_scores(ws.f32.st, ld, keys, score_scale, shift);
  // exp(s * scale - shift) = 2^(s * scale * log2(e) - shift * log2(e)): one FMA per score.
  const Vec factor = splat(exp_scale * kLog2e);
  Vec shift2[Vecs];
#pragma GCC unroll 4
  for (int v = 0; v < Vecs; ++v) shift2[v] = shift[v] * splat(kLog2e);
  int64_t j = 0;
  for (; j + 1 < keys; j += 2) exp_pair_row<Vecs, true>(st, ld, j, factor, shift2, sum, ws.pp);
  if (j < keys) exp_pair_row<Vecs, false>(st, ld, j, factor, shift2, sum, ws.pp);
#pragma GCC unroll 4
  for (int v = 0; v < Vecs; ++v) store(ws.f32.l + v * kLanes, load(ws.f32.l + v * kLanes) + sum[v]);
}

inline void run_query_tile_pairs(const AttentionParams& p, const PairLayout& l,
                                 const UnalignedWord* k, int64_t k_row_words, const uint32_t* vp,
                                 const QueryTile& tile, PairScratch& ws) {
  const int64_t ld = l.block_q;
  load_query_pairs(p, l, tile, ws.qp);
  for (int64_t i = 0; i < tile.vecs * kLanes; ++i) {
    ws.f32.m[i] = kNegInf;
    ws.f32.l[i] = 0.0f;
  }
  for (int64_t c = 0; c < p.head_dim_v; ++c)
    for (int64_t i = 0; i < tile.vecs * kLanes; ++i) ws.f32.ot[c * ld + i] = 0.0f;

  const int64_t key_limit = p.is_causal ? min_i64(p.len_k, tile.q0 + tile.rows) : p.len_k;
  for (int64_t k0 = 0; k0 < key_limit; k0 += l.block_k) {
    const int64_t keys = min_i64(l.block_k, key_limit - k0);
    // S^T = K Q^T (pairs along head_dim), then scaled in float32 like the float32 kernel's
    // pre-scaled queries, so masks add to scaled scores.
    pair_dot<ALayout::kRowMajor, false>(k + k0 * k_row_words, k_row_words, ws.qp, ld, l.k_words,
                                        keys, tile.vecs, ws.f32.st, ld);
    const float rest_scale = scale_scores_if_needed(p, keys, tile.vecs * kLanes, ws.f32.st, ld);
    if (p.mask_kind != MaskKind::kNone) apply_user_mask(p, tile, k0, keys, ws.f32.st, ld);
    if (p.is_causal && k0 + keys > tile.q0) apply_causal(tile, k0, keys, ws.f32.st, ld);
    with_count<kTileQueryVecs>(tile.vecs, [&](auto vecs) {
      softmax_update_pairs<decltype(vecs)::value>(p, l, keys, rest_scale, ws);
    });
    // O^T += V^T P^T (pairs along keys); a tile's odd last key pairs with a zero.
    const int64_t key_pairs = (keys + 1) / 2;
    for (int64_t i0 = 0; i0 < key_pairs; i0 += l.pv_key_pairs) {
      const int64_t chunk = min_i64(l.pv_key_pairs, key_pairs - i0);
      pair_dot<ALayout::kColMajor, true>(
          reinterpret_cast<const UnalignedWord*>(vp + (k0 / 2 + i0) * l.v_row_words), l.v_row_words,
          ws.pp + i0 * ld, ld, chunk, p.head_dim_v, tile.vecs, ws.f32.ot, ld);
    }
  }
  Tiling t{};  // write_output reads only schedule.block_q
  t.schedule.block_q = l.block_q;
  write_output<BFloat16>(p, tile, t, ws.f32);
}

// ---------------------------------------------------------------- family traits
// The vdpbf16ps family for run_forward (forward_driver_impl.h); bfloat16 tensors only.
struct Bf16PairFamily {
  // The thread clamp counts tasks of one vector (16) of queries each.
  static constexpr int64_t kThreadClampQueries = kLanes;
  typedef PairPlan Plan;
  typedef PairScratch Scratch;

  static Plan make_plan(const AttentionParams& p, int threads) { return plan_pairs(p, threads); }
  static Scratch enter_thread(const AttentionParams& p, const Plan& plan, float* scratch) {
    return carve_pair_scratch(plan.layout, p.head_dim_v, scratch);
  }
  static void leave_thread(Scratch&) {}
  // Keys of tile `key_tile` (block_k of them, an even number) into the pair's packed words.
  static void pack(const AttentionParams& p, const Plan& plan, int64_t pair, int64_t key_tile,
                   float* pair_pack) {
    const PairLayout& l = plan.layout;
    const int64_t k0 = key_tile * l.block_k, count = min_i64(l.block_k, p.len_k - k0);
    pack_pair_rows(p, l, pair, k0, count, reinterpret_cast<uint32_t*>(pair_pack));
  }
  static void run(const AttentionParams& p, const Plan& plan, const QueryTask& task,
                  const float* pair_pack, Scratch& ws) {
    const PairLayout& l = plan.layout;
    const uint32_t* vp = reinterpret_cast<const uint32_t*>(pair_pack);
    const UnalignedWord* k;
    int64_t k_row_words;
    if (l.k_in_place) {
      k = reinterpret_cast<const UnalignedWord*>(static_cast<const uint16_t*>(p.k) +
                                                 task.tile.batch * p.k_stride[0] +
                                                 task.hkv * p.k_stride[1]);
      k_row_words = p.k_stride[2] / 2;
    } else {
      k = reinterpret_cast<const UnalignedWord*>(vp + l.v_pairs * l.v_row_words);
      k_row_words = l.k_words;
    }
    run_query_tile_pairs(p, l, k, k_row_words, vp, task.tile, ws);
  }
};

inline void attention_forward_bf16_pairs(const AttentionParams& p) {
  run_forward<Bf16PairFamily>(p);
}

}  // namespace
}  // namespace npu_attn
