// ISA-neutral tiled (FlashAttention-2 style) attention backward kernel.
//
// Compiled once per ISA like the forward (attention_backward_<isa>.cpp defines
// NPU_ATTN_VEC_BYTES and includes this file); same rules: anonymous namespace, no std::
// templates, so no symbol is shared between the ISA variants.
//
// Math, per (batch, head), with S = scale * Q K^T + mask, P = softmax(S), O = P V:
//     Delta_i = sum_c dO[i][c] * O[i][c] - dlse_i        (dlse: gradient of the lse output)
//     P       = exp(S - lse)                              recomputed from the saved lse
//     dV      = P^T dO
//     dS      = P o (dO V^T - Delta)                      (o: elementwise, Delta per row)
//     dQ      = scale * dS K          dK = scale * dS^T Q
// Nothing of size len_q x len_k is ever stored: P and dS exist one (query tile x key tile) at
// a time.
//
// Parallel structure: a work item owns a (batch, kv-head) pair and a range of key tiles, so its
// dK and dV rows are written by nobody else (GQA: the item walks every q-head of the group and
// sums into the same rows). dQ receives contributions from every key tile; it is accumulated in
// a private float32 buffer per item and written once. When there are too few pairs to keep every
// thread busy, the key tiles of a pair are split over several items and their private dQ
// buffers are summed in a final pass (deterministic: the order of the sum is fixed).
//
//   for each item (pair, key-tile range):                   parallel
//     for each key tile:  pack K^T, V^T, K rows;  dK = dV = 0
//       for each q-head of the group, each query tile (causal: only tiles that see the keys):
//         pack scale*Q and dO rows
//         S = (scale Q) K^T;  P = exp(S + mask - lse)             (rows: queries, vector: keys)
//         dP = dO V^T;  dS = P o (dP - Delta)
//         dV += P^T dO;  dK += dS^T (scale Q);  dQ_private += dS K
//       write dK, dV rows
//   dQ = scale * dQ_private (summed over splits)
// The packing and the products of one tile are a tile kernel (run_backward<T, Kernel>): here
// FloatTileBackward, every product on the broadcast_fma kernel of vec_impl.h (packed operands are
// padded with zeros to whole vectors, so head dims like 40, 59 or 72 need no tail code); for
// bfloat16 on AVX512-BF16, PairTileBackward in attention_backward_bf16_impl.h (vdpbf16ps); on
// AMX, AmxTileBackward in attention_backward_amx_impl.h.
#pragma once
#ifndef NPU_ATTN_VEC_BYTES
#error "define NPU_ATTN_VEC_BYTES before including attention_backward_impl.h"
#endif

#include <omp.h>

#include <cstdint>
#include <type_traits>

#include "../attention_params.h"
#include "../workspace.h"
#include "vec_impl.h"

namespace npu_attn {
namespace {

constexpr int64_t kBwdBlockQ = 64;  // queries per tile (the float32 kernel: BackwardPlan::block_q)
constexpr int64_t kBwdBlockK = 64;  // keys per tile (the float32 kernel: BackwardPlan::block_k)
// From this head dim the three accumulating products (dV, dK, dQ) walk their register blocks
// rows-outer (vec_impl.h's BlockOrder): each row block's A rows stay in L1 while B streams past.
// With columns outer, a column group's B slice is one line of every 2 KiB row at head dim 512,
// and those lines fall into two of L1's sets. A/B on Zen 3 (AVX2, 2 threads, outputs
// bit-identical): the VAE mid-block at 512px (head dim 512) 0.975-0.987x the time in float32
// over three runs, 0.981x with bfloat16 inputs; at head dims 64-160 (SD-1.5 32x32 and 16x16,
// SDXL 32x32) 0.997-1.015x, so only from here. Padding the rows by a cache line instead
// measured slower (1.05-1.09x). Only with 256-bit vectors: with AVX-512 a column group is four
// vectors, and that order was never measured there.
constexpr int64_t kBwdRowsOuterMinDim = 384;
constexpr bool kBwdRowsOuterMeasured = kVecBytes == 32;

bool accumulate_rows_outer(const AttentionParams& p) {
  if (!kBwdRowsOuterMeasured) return false;
  return p.head_dim >= kBwdRowsOuterMinDim || p.head_dim_v >= kBwdRowsOuterMinDim;
}

// Queries per tile of the float32 kernel: 128 at head dim 128 with 256-bit vectors, else
// kBwdBlockQ. dV += P^T dO and dK += dS^T Q are as deep as the query tile; at head dim 128 their
// 64-key accumulators (32 KiB each) no longer fit L1 beside their operands, and 128 queries
// reload and store them half as often per multiply-add (the sums run in the same order: outputs
// bit-identical). A/B on Zen 3 (AVX2, 2 threads, float32, 5-7 rounds, four runs in both orders):
// Flux and HiDream (head dim 128) 0.88-1.01x and 0.94-0.99x the time (about 0.96x each). Not
// elsewhere: SD-1.5 16x16 (head dim 160) 0.996-1.031x, head dims 40-80 1.00-1.06x (SD3,
// SD-1.5 64x64 and SD2.1 48x48 slower in three of four runs), and 1.10x at 512 (the VAE),
// where 128 Q and dO rows fill L2. Not measured with AVX-512, which keeps 64.
constexpr int64_t kBwdWideQueryTileDim = 128;

int64_t float_backward_block_q(const AttentionParams& p) {
  const bool wide =
      kVecBytes == 32 && p.head_dim == kBwdWideQueryTileDim && p.head_dim_v == kBwdWideQueryTileDim;
  return wide ? 2 * kBwdBlockQ : kBwdBlockQ;
}

// Keys per tile of the float32 kernel: one tile of them all when 65-128 keys (the 77 of a text
// encoder's cross-attention), with 256-bit vectors, else kBwdBlockK. With 64-key tiles the last
// 13 of 77 keys took a tile of their own: a whole pass of packing, two score products and a
// dQ product over every query, for a sixth of the keys (the sums run in the same order: outputs
// bit-identical). A/B on Zen 3 (AVX2, 2 threads, float32, 7 rounds, both orders): the four
// cross-attention shapes (77 keys, head dims 40-80) 0.93x the time (0.89-0.96x). 128-key tiles
// on long key sequences were not kept: head dim 40 (SD-1.5 64x64) 1.06x in both orders, head
// dims 64-160 0.93-1.03x.
constexpr int64_t kBwdOneTileMaxKeys = 2 * kBwdBlockK;

int64_t float_backward_block_k(const AttentionParams& p) {
  const bool one_tile = kVecBytes == 32 && p.len_k > kBwdBlockK && p.len_k <= kBwdOneTileMaxKeys;
  return one_tile ? kBwdOneTileMaxKeys : kBwdBlockK;
}

// ---------------------------------------------------------------- plan
struct BackwardPlan {
  int64_t group;      // q-heads per kv-head
  int64_t pairs;      // batch * heads_kv
  int64_t key_tiles;  // ceil(len_k / block_k)
  int64_t splits;     // items per pair (key tiles divided between them)
  int64_t items;      // pairs * splits
  int64_t dim_pad;    // head_dim rounded up to whole vectors
  int64_t dim_v_pad;  // head_dim_v rounded up to whole vectors
  int64_t dq_floats;  // one item's private dQ: group * len_q * dim_pad
  int64_t block_q;    // queries per tile: the tile kernel's choice
  int64_t block_k;    // keys per tile (a multiple of every kLanes): the tile kernel's choice
  int threads;
};

BackwardPlan plan_backward(const AttentionBackwardParams& bp, int64_t block_q, int64_t block_k) {
  const AttentionParams& p = bp.fwd;
  BackwardPlan plan{};
  plan.block_q = block_q;
  plan.block_k = block_k;
  plan.group = p.heads_q / p.heads_kv;
  plan.pairs = p.batch * p.heads_kv;
  plan.key_tiles = ceil_div(p.len_k, block_k);
  plan.dim_pad = round_up(max_i64(p.head_dim, 1), kLanes);
  plan.dim_v_pad = round_up(max_i64(p.head_dim_v, 1), kLanes);
  plan.dq_floats = plan.group * p.len_q * plan.dim_pad;
  const int64_t max_parallel = plan.pairs * max_i64(plan.key_tiles, 1);
  plan.threads = static_cast<int>(min_i64(max_i64(p.num_threads, 1), max_parallel));
  // One item per pair when the pairs alone balance the threads; otherwise split the key tiles
  // of each pair so that there are about two items per thread.
  plan.splits = 1;
  if (plan.pairs % plan.threads != 0 && plan.pairs < 4 * plan.threads) {
    plan.splits = min_i64(max_i64(plan.key_tiles, 1), ceil_div(2 * plan.threads, plan.pairs));
  }
  plan.items = plan.pairs * plan.splits;
  return plan;
}

// ---------------------------------------------------------------- per-thread scratch
struct BackwardScratch {
  float* kt;       // head_dim x block_k: K^T of the key tile, zero in padding keys
  float* vt;       // head_dim_v x block_k: V^T of the key tile, zero in padding keys
  float* k_rows;   // block_k x dim_pad: K rows, zero-padded
  float* dk;       // block_k x dim_pad: dK accumulator of the key tile
  float* dv;       // block_k x dim_v_pad: dV accumulator of the key tile
  float* q_rows;   // block_q x dim_pad: scale * Q rows, zero-padded
  float* do_rows;  // block_q x dim_v_pad: dO rows, zero-padded
  float* probs;    // block_q x block_k: P
  float* dscores;  // block_q x block_k: dP, then dS
};

int64_t backward_scratch_floats(const AttentionBackwardParams& bp, const BackwardPlan& plan) {
  const int64_t d = bp.fwd.head_dim, dv = bp.fwd.head_dim_v;
  return plan.block_k * (d + dv + 2 * plan.dim_pad + plan.dim_v_pad) +
         plan.block_q * (plan.dim_pad + plan.dim_v_pad + 2 * plan.block_k);
}

BackwardScratch carve_backward_scratch(const AttentionBackwardParams& bp, const BackwardPlan& plan,
                                       float* base) {
  BackwardScratch s{};
  s.kt = base;
  s.vt = s.kt + bp.fwd.head_dim * plan.block_k;
  s.k_rows = s.vt + bp.fwd.head_dim_v * plan.block_k;
  s.dk = s.k_rows + plan.block_k * plan.dim_pad;
  s.dv = s.dk + plan.block_k * plan.dim_pad;
  s.q_rows = s.dv + plan.block_k * plan.dim_v_pad;
  s.do_rows = s.q_rows + plan.block_q * plan.dim_pad;
  s.probs = s.do_rows + plan.block_q * plan.dim_v_pad;
  s.dscores = s.probs + plan.block_q * plan.block_k;
  return s;
}

void fill_zero(float* dst, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = 0.0f;
}

// ---------------------------------------------------------------- packing
// Rows [first, first + count) of a (len, dim) strided matrix, times `factor`, into rows of
// `padded` floats (zeros after `dim`).
template <typename T>
void pack_padded_rows(const T* src, int64_t row_stride, int64_t col_stride, int64_t dim,
                      int64_t first, int64_t count, float factor, int64_t padded, float* dst) {
  for (int64_t r = 0; r < count; ++r) {
    const T* s = src + (first + r) * row_stride;
    float* d = dst + r * padded;
    for (int64_t c = 0; c < dim; ++c) d[c] = to_float(s[c * col_stride]) * factor;
    for (int64_t c = dim; c < padded; ++c) d[c] = 0.0f;
  }
}

// The same rows transposed into a (dim x ld) matrix, zeros after `count` columns.
// Where the head dim is contiguous, whole kLanes x kLanes blocks go through registers
// (transpose_block): the scalar gather, one strided load per element, took ~19% of a float32
// backward at SD-1.5 8x8 (64 tokens, head dim 160), where K^T and V^T serve one query tile.
template <typename T>
void pack_transposed(const T* src, int64_t row_stride, int64_t col_stride, int64_t dim,
                     int64_t first, int64_t count, int64_t ld, float* dst) {
  const T* rows = src + first * row_stride;
  // Channels [0, vec_dim) x rows [0, vec_rows) in blocks; the rest of each row one by one.
  const int64_t vec_dim = col_stride == 1 ? dim / kLanes * kLanes : 0;
  const int64_t vec_rows = count / kLanes * kLanes;
  for (int64_t c0 = 0; c0 < vec_dim; c0 += kLanes) {
    for (int64_t r0 = 0; r0 < vec_rows; r0 += kLanes) {
      Vec block[kLanes];
      for (int i = 0; i < kLanes; ++i) block[i] = load_as_float(rows + (r0 + i) * row_stride + c0);
      transpose_block(block);
      for (int c = 0; c < kLanes; ++c) store(dst + (c0 + c) * ld + r0, block[c]);
    }
  }
  for (int64_t c = 0; c < dim; ++c) {
    float* d = dst + c * ld;
    const T* s = rows + c * col_stride;
    for (int64_t r = c < vec_dim ? vec_rows : 0; r < count; ++r) d[r] = to_float(s[r * row_stride]);
    for (int64_t r = count; r < ld; ++r) d[r] = 0.0f;
  }
}

// ---------------------------------------------------------------- the pieces of a tile
struct TileCoords {
  int64_t batch, head, hkv;    // head: q-head; hkv: its kv-head
  int64_t q0, rows;            // query tile
  int64_t k0, keys, key_vecs;  // key tile; key_vecs = ceil(keys / kLanes)
};

// Delta_i = sum_c dO[i][c] * O[i][c] - dlse_i for every (batch, head, query), into `delta`;
// O of element type O_T (T, or float32: AttentionParams::out_float32), dO of T.
template <typename O_T, typename T>
void compute_delta_row_as(const AttentionBackwardParams& bp, int64_t bh, float* delta) {
  const AttentionParams& p = bp.fwd;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const O_T* o = static_cast<const O_T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1];
  const T* g =
      static_cast<const T*>(bp.grad_out) + b * bp.grad_out_stride[0] + h * bp.grad_out_stride[1];
  for (int64_t i = 0; i < p.len_q; ++i) {
    const O_T* oi = o + i * p.out_stride[2];
    const T* gi = g + i * bp.grad_out_stride[2];
    float sum = 0.0f;
    int64_t c = 0;
    if (p.out_stride[3] == 1 && bp.grad_out_stride[3] == 1) {  // whole vectors, then the lanes
      Vec acc = splat(0.0f);
      for (; c + kLanes <= p.head_dim_v; c += kLanes)
        acc += load_as_float(oi + c) * load_as_float(gi + c);
      sum = sum_lanes(acc);
    }
    for (; c < p.head_dim_v; ++c)
      sum += to_float(oi[c * p.out_stride[3]]) * to_float(gi[c * bp.grad_out_stride[3]]);
    if (bp.grad_lse != nullptr) {
      sum -= bp.grad_lse[b * bp.grad_lse_stride[0] + h * bp.grad_lse_stride[1] +
                         i * bp.grad_lse_stride[2]];
    }
    delta[bh * p.len_q + i] = sum;
  }
}

template <typename T>
void compute_delta_row(const AttentionBackwardParams& bp, int64_t bh, float* delta) {
  if constexpr (!std::is_same_v<T, float>) {
    if (bp.fwd.out_float32) return compute_delta_row_as<float, T>(bp, bh, delta);
  }
  compute_delta_row_as<T, T>(bp, bh, delta);
}

// Adds the user's mask (and causal masking) to the scores of one tile: row i = query q0 + i,
// rows `ld` floats apart.
void mask_scores(const AttentionParams& p, const TileCoords& t, int64_t ld, float* s) {
  const int64_t* ms = p.mask_stride;
  for (int64_t i = 0; i < t.rows; ++i) {
    float* row = s + i * ld;
    if (p.mask_kind != MaskKind::kNone) {
      const int64_t off = t.batch * ms[0] + t.head * ms[1] + (t.q0 + i) * ms[2] + t.k0 * ms[3];
      if (p.mask_kind == MaskKind::kAdditive) {
        const float* m = static_cast<const float*>(p.mask) + off;
        for (int64_t j = 0; j < t.keys; ++j) row[j] += m[j * ms[3]];
      } else {
        const uint8_t* m = static_cast<const uint8_t*>(p.mask) + off;
        for (int64_t j = 0; j < t.keys; ++j) row[j] = m[j * ms[3]] ? row[j] : kNegInf;
      }
    }
    if (p.is_causal) {  // query q0+i sees keys <= q0+i
      for (int64_t j = max_i64(0, t.q0 + i + 1 - t.k0); j < t.keys; ++j) row[j] = kNegInf;
    }
  }
}

// Scores -> probabilities in place: P = exp(S - lse); zero for padding keys and for queries
// whose keys are all masked (lse = -inf, output 0 in the forward, so no gradient).
void scores_to_probs(const AttentionParams& p, const TileCoords& t, int64_t ld, float* s) {
  const float* lse = p.lse + t.batch * p.lse_stride[0] + t.head * p.lse_stride[1];
  for (int64_t i = 0; i < t.rows; ++i) {
    float* row = s + i * ld;
    const float row_lse = lse[(t.q0 + i) * p.lse_stride[2]];
    if (row_lse == kNegInf) {
      fill_zero(row, t.key_vecs * kLanes);
      continue;
    }
    const Vec shift = splat(row_lse);
    for (int64_t j = 0; j < t.key_vecs * kLanes; j += kLanes)
      store(row + j, exp_nonpositive(load(row + j) - shift));
    for (int64_t j = t.keys; j < t.key_vecs * kLanes; ++j) row[j] = 0.0f;
  }
}

// dS = P o (dP - Delta), in place over dP.
void probs_to_dscores(const TileCoords& t, int64_t ld, const float* delta_rows, const float* probs,
                      float* ds) {
  for (int64_t i = 0; i < t.rows; ++i) {
    const Vec d = splat(delta_rows[i]);
    const float* pr = probs + i * ld;
    float* row = ds + i * ld;
    for (int64_t j = 0; j < t.key_vecs * kLanes; j += kLanes)
      store(row + j, load(pr + j) * (load(row + j) - d));
  }
}

// dV += P^T dO;  dK += dS^T (scale Q);  dQ += dS K of one tile, in `Order` (vec_impl.h):
// outputs bit-identical either way.
template <BlockOrder Order>
void accumulate_products_in(const BackwardPlan& plan, const TileCoords& t, BackwardScratch& s,
                            float* dq_rows) {
  broadcast_fma<ALayout::kColMajor, true, Order>(s.probs, plan.block_k, s.do_rows, plan.dim_v_pad,
                                                 t.rows, t.keys, plan.dim_v_pad / kLanes, s.dv,
                                                 plan.dim_v_pad);
  broadcast_fma<ALayout::kColMajor, true, Order>(s.dscores, plan.block_k, s.q_rows, plan.dim_pad,
                                                 t.rows, t.keys, plan.dim_pad / kLanes, s.dk,
                                                 plan.dim_pad);
  broadcast_fma<ALayout::kRowMajor, true, Order>(s.dscores, plan.block_k, s.k_rows, plan.dim_pad,
                                                 t.keys, t.rows, plan.dim_pad / kLanes, dq_rows,
                                                 plan.dim_pad);
}

// All the work of one (query tile, key tile): accumulates into s.dk, s.dv and dq_rows.
template <typename T>
void backward_tile(const AttentionBackwardParams& bp, const BackwardPlan& plan, const TileCoords& t,
                   const float* delta, BackwardScratch& s, float* dq_rows) {
  const AttentionParams& p = bp.fwd;
  const T* q = static_cast<const T*>(p.q) + t.batch * p.q_stride[0] + t.head * p.q_stride[1];
  const T* g = static_cast<const T*>(bp.grad_out) + t.batch * bp.grad_out_stride[0] +
               t.head * bp.grad_out_stride[1];
  pack_padded_rows(q, p.q_stride[2], p.q_stride[3], p.head_dim, t.q0, t.rows, p.scale, plan.dim_pad,
                   s.q_rows);
  pack_padded_rows(g, bp.grad_out_stride[2], bp.grad_out_stride[3], p.head_dim_v, t.q0, t.rows,
                   1.0f, plan.dim_v_pad, s.do_rows);
  // S = (scale Q) K^T  and  dP = dO V^T   (rows: queries, columns: keys)
  const int64_t ld = plan.block_k;
  broadcast_fma<ALayout::kRowMajor, false>(s.q_rows, plan.dim_pad, s.kt, ld, p.head_dim, t.rows,
                                           t.key_vecs, s.probs, ld);
  broadcast_fma<ALayout::kRowMajor, false>(s.do_rows, plan.dim_v_pad, s.vt, ld, p.head_dim_v,
                                           t.rows, t.key_vecs, s.dscores, ld);
  if (p.mask_kind != MaskKind::kNone || p.is_causal) mask_scores(p, t, ld, s.probs);
  scores_to_probs(p, t, ld, s.probs);
  probs_to_dscores(t, ld, delta + (t.batch * p.heads_q + t.head) * p.len_q + t.q0, s.probs,
                   s.dscores);
  // dV += P^T dO;  dK += dS^T (scale Q);  dQ += dS K   (scale applied when dQ is written)
  if (accumulate_rows_outer(p)) {
    accumulate_products_in<BlockOrder::kRowBlocksOuter>(plan, t, s, dq_rows);
  } else {
    accumulate_products_in<BlockOrder::kColumnGroupsOuter>(plan, t, s, dq_rows);
  }
}

// Rows of an accumulator (rows x padded) into a strided (len, dim) gradient at row `first`.
template <typename T>
void write_rows(const float* acc, int64_t padded, int64_t rows, int64_t dim, float factor, T* dst,
                int64_t row_stride, int64_t col_stride, int64_t first) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = acc + r * padded;
    T* d = dst + (first + r) * row_stride;
    for (int64_t c = 0; c < dim; ++c) d[c * col_stride] = from_float<T>(a[c] * factor);
  }
}

// The float32 tile kernel: every product on broadcast_fma (bfloat16 and float16 inputs are
// widened when packed). attention_backward_bf16_impl.h has a second one on vdpbf16ps; both run
// in run_backward's items through this interface.
struct FloatTileBackward {
  typedef BackwardScratch Scratch;
  static int64_t block_q(const AttentionParams& p) { return float_backward_block_q(p); }
  static int64_t block_k(const AttentionParams& p) { return float_backward_block_k(p); }
  static int64_t scratch_floats(const AttentionBackwardParams& bp, const BackwardPlan& plan) {
    return backward_scratch_floats(bp, plan);
  }
  static Scratch carve(const AttentionBackwardParams& bp, const BackwardPlan& plan, float* base) {
    return carve_backward_scratch(bp, plan, base);
  }
  // Per-thread set-up and tear-down around the parallel region (the AMX kernel's tile
  // configuration); nothing here.
  static void enter_thread(Scratch&) {}
  static void leave_thread(Scratch&) {}
  // Packs key tile t.k0 of K and V (pointing at the pair's (batch, kv-head)).
  template <typename T>
  static void pack_keys(const AttentionBackwardParams& bp, const BackwardPlan& plan,
                        const TileCoords& t, const T* k, const T* v, Scratch& s) {
    const AttentionParams& p = bp.fwd;
    pack_transposed(k, p.k_stride[2], p.k_stride[3], p.head_dim, t.k0, t.keys, plan.block_k, s.kt);
    pack_transposed(v, p.v_stride[2], p.v_stride[3], p.head_dim_v, t.k0, t.keys, plan.block_k,
                    s.vt);
    pack_padded_rows(k, p.k_stride[2], p.k_stride[3], p.head_dim, t.k0, t.keys, 1.0f, plan.dim_pad,
                     s.k_rows);
  }
  template <typename T>
  static void tile(const AttentionBackwardParams& bp, const BackwardPlan& plan, const TileCoords& t,
                   const float* delta, Scratch& s, float* dq_rows) {
    backward_tile<T>(bp, plan, t, delta, s, dq_rows);
  }
  // The factor dK is written with: 1, as the packed queries already carry the scale.
  static float dk_factor(const AttentionParams&) { return 1.0f; }
};

// One work item: key tiles [tile_begin, tile_end) of one (batch, kv-head) pair.
template <typename T, typename Kernel>
void backward_item(const AttentionBackwardParams& bp, const BackwardPlan& plan, int64_t pair,
                   int64_t tile_begin, int64_t tile_end, const float* delta,
                   typename Kernel::Scratch& s, float* dq_private) {
  const AttentionParams& p = bp.fwd;
  TileCoords t{};
  t.batch = pair / p.heads_kv;
  t.hkv = pair % p.heads_kv;
  const T* k = static_cast<const T*>(p.k) + t.batch * p.k_stride[0] + t.hkv * p.k_stride[1];
  const T* v = static_cast<const T*>(p.v) + t.batch * p.v_stride[0] + t.hkv * p.v_stride[1];
  fill_zero(dq_private, plan.dq_floats);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    t.k0 = tile * plan.block_k;
    t.keys = min_i64(plan.block_k, p.len_k - t.k0);
    t.key_vecs = ceil_div(t.keys, kLanes);
    Kernel::template pack_keys<T>(bp, plan, t, k, v, s);
    fill_zero(s.dk, plan.block_k * plan.dim_pad);
    fill_zero(s.dv, plan.block_k * plan.dim_v_pad);
    // Causal: queries before k0 see none of these keys.
    const int64_t first_q = p.is_causal ? min_i64(p.len_q, t.k0) / plan.block_q * plan.block_q : 0;
    for (int64_t g = 0; g < plan.group; ++g) {
      t.head = t.hkv * plan.group + g;
      for (t.q0 = first_q; t.q0 < p.len_q; t.q0 += plan.block_q) {
        t.rows = min_i64(plan.block_q, p.len_q - t.q0);
        float* dq_rows = dq_private + (g * p.len_q + t.q0) * plan.dim_pad;
        Kernel::template tile<T>(bp, plan, t, delta, s, dq_rows);
      }
    }
    write_rows(
        s.dk, plan.dim_pad, t.keys, p.head_dim, Kernel::dk_factor(p),
        static_cast<T*>(bp.grad_k) + t.batch * bp.grad_k_stride[0] + t.hkv * bp.grad_k_stride[1],
        bp.grad_k_stride[2], bp.grad_k_stride[3], t.k0);
    write_rows(
        s.dv, plan.dim_v_pad, t.keys, p.head_dim_v, 1.0f,
        static_cast<T*>(bp.grad_v) + t.batch * bp.grad_v_stride[0] + t.hkv * bp.grad_v_stride[1],
        bp.grad_v_stride[2], bp.grad_v_stride[3], t.k0);
  }
}

template <typename T>
T* grad_q_head(const AttentionBackwardParams& bp, int64_t batch, int64_t head) {
  return static_cast<T*>(bp.grad_q) + batch * bp.grad_q_stride[0] + head * bp.grad_q_stride[1];
}

// Rows of the private dQ folded and written per item of the final pass when a pair's key tiles
// are split: the pass runs over (pair, block of rows), so a single pair (the VAE's one head)
// is spread over every thread; one item per pair would fold all its splits (2 per thread) on
// one thread while the others wait, which grows with the thread count.
constexpr int64_t kDqFoldRows = 256;

// dQ rows [row0, row0 + rows) of one pair from its private accumulator(s), row g * len_q + i
// being query i of the group's head g: scale * the sum over the pair's splits, folded into the
// first split in a fixed order (deterministic, whichever thread does it).
template <typename T>
void write_grad_q_rows(const AttentionBackwardParams& bp, const BackwardPlan& plan, int64_t pair,
                       float* dq_first_split, int64_t row0, int64_t rows) {
  const AttentionParams& p = bp.fwd;
  const int64_t batch = pair / p.heads_kv, hkv = pair % p.heads_kv;
  float* acc = dq_first_split + row0 * plan.dim_pad;
  for (int64_t s = 1; s < plan.splits; ++s) {
    const float* other = acc + s * plan.dq_floats;
    for (int64_t i = 0; i < rows * plan.dim_pad; i += kLanes)
      store(acc + i, load(acc + i) + load(other + i));
  }
  for (int64_t r = row0; r < row0 + rows;) {  // the rows of each head in the range
    const int64_t g = r / p.len_q, i = r % p.len_q;
    const int64_t count = min_i64(row0 + rows - r, p.len_q - i);
    write_rows(dq_first_split + r * plan.dim_pad, plan.dim_pad, count, p.head_dim, p.scale,
               grad_q_head<T>(bp, batch, hkv * plan.group + g), bp.grad_q_stride[2],
               bp.grad_q_stride[3], i);
    r += count;
  }
}

// The backward of T tensors with the tile kernel `Kernel` (FloatTileBackward or a kernel with
// its interface): plan, Delta, the parallel items, and dQ.
template <typename T, typename Kernel>
void run_backward(const AttentionBackwardParams& bp) {
  const AttentionParams& p = bp.fwd;
  if (p.batch == 0 || p.heads_q == 0) return;
  const BackwardPlan plan = plan_backward(bp, Kernel::block_q(p), Kernel::block_k(p));
  const int64_t per_thread = round_up(Kernel::scratch_floats(bp, plan), 16);
  // Private dQ: one per thread when each pair is one item, else one per item (summed later).
  const int64_t dq_buffers = plan.splits == 1 ? plan.threads : plan.items;
  // (rounded up so the dQ buffers after it start on a cache line)
  const int64_t delta_floats = round_up(p.batch * p.heads_q * p.len_q, 16);
  const int64_t total = per_thread * plan.threads + dq_buffers * plan.dq_floats + delta_floats;
  // Allocated before the parallel region: a failure is std::bad_alloc for the caller.
  const WorkspaceBuffer buffer(total);
  float* base = buffer.data();
  float* delta = base + per_thread * plan.threads;
  float* dq_all = delta + delta_floats;

#pragma omp parallel num_threads(plan.threads)
  {
    const int thread = omp_get_thread_num();
    typename Kernel::Scratch s = Kernel::carve(bp, plan, base + per_thread * thread);
    Kernel::enter_thread(s);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < p.batch * p.heads_q; ++bh) compute_delta_row<T>(bp, bh, delta);

#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < plan.items; ++item) {
      const int64_t pair = item / plan.splits, split = item % plan.splits;
      const int64_t begin = plan.key_tiles * split / plan.splits;
      const int64_t end = plan.key_tiles * (split + 1) / plan.splits;
      float* dq = dq_all + (plan.splits == 1 ? thread : item) * plan.dq_floats;
      backward_item<T, Kernel>(bp, plan, pair, begin, end, delta, s, dq);
      if (plan.splits == 1) write_grad_q_rows<T>(bp, plan, pair, dq, 0, plan.group * p.len_q);
    }

    if (plan.splits > 1) {
      const int64_t rows = plan.group * p.len_q, blocks = ceil_div(rows, kDqFoldRows);
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < plan.pairs * blocks; ++item) {
        const int64_t pair = item / blocks, row0 = item % blocks * kDqFoldRows;
        write_grad_q_rows<T>(bp, plan, pair, dq_all + pair * plan.splits * plan.dq_floats, row0,
                             min_i64(kDqFoldRows, rows - row0));
      }
    }
    Kernel::leave_thread(s);
  }
}

inline void attention_backward_tiled(const AttentionBackwardParams& bp) {
  switch (bp.fwd.element) {
    case ElementType::kFloat32:
      return run_backward<float, FloatTileBackward>(bp);
    case ElementType::kBFloat16:
      return run_backward<BFloat16, FloatTileBackward>(bp);
    case ElementType::kFloat16:
      return run_backward<Half, FloatTileBackward>(bp);
  }
}

}  // namespace
}  // namespace npu_attn
