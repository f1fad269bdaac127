// ISA-neutral tiled (flash-style) attention forward kernel.
//
// This header is compiled once per ISA: each csrc/kernels/attention_forward_<isa>.cpp defines
// NPU_ATTN_VEC_BYTES (16, 32 or 64), is built with its own -m flags, and includes this file.
// Everything here lives in an anonymous namespace and uses no std:: templates, so no symbol can
// be shared (and silently merged by the linker) between the ISA variants; a ctest
// (isa_objects_are_self_contained) checks the object files for that.
//
// Algorithm (FlashAttention-2 forward, adapted to CPU caches):
//   for a chunk of (batch, kv-head) pairs:
//     pack K^T into panels [k_tile][d][block_k] and V into rows [key][head_dim_v padded]
//     parallel over (pair, q-head in GQA group, q tile):
//       Qs = scale * Q_tile
//       for each key tile:  S = Qs K^T;  mask/causal;  online softmax (m, l);  O = a*O + P V
//       out = O / l,  lse = m + log(l)
// Workspace is O(block_q * block_k + (len_k) * head_dim) per chunk: nothing grows with
// len_q * len_k.
#ifndef NPU_ATTN_VEC_BYTES
#error "define NPU_ATTN_VEC_BYTES before including attention_forward_impl.h"
#endif

#include <omp.h>

#include <cstdint>

#include "../attention_params.h"
#include "../workspace.h"

namespace npu_attn {
namespace {

// ---------------------------------------------------------------- vector primitives
constexpr int kVecBytes = NPU_ATTN_VEC_BYTES;
constexpr int kLanes = kVecBytes / static_cast<int>(sizeof(float));
typedef float Vec __attribute__((vector_size(kVecBytes)));
typedef int32_t IVec __attribute__((vector_size(kVecBytes)));
typedef uint32_t UVec __attribute__((vector_size(kVecBytes)));

// Register blocking, chosen so accumulators + operands fit the register file (32 vector
// registers with AVX-512, 16 otherwise).
// Scores: kScoreRows query rows x kScoreVecs vectors of keys.
constexpr int kScoreRows = kVecBytes == 64 ? 8 : 6;
constexpr int kScoreVecs = kVecBytes == 64 ? 3 : 2;
constexpr int kKeyColumnsAlign = kScoreVecs * kLanes;
// P*V: up to kPvMaxVecs vectors of the value dim, with as many rows as registers allow.
constexpr int kPvMaxVecs = kVecBytes == 64 ? 4 : 3;
template <int Vecs>
constexpr int pv_rows_for() {
  if (kVecBytes == 64) return Vecs <= 2 ? 12 : (Vecs == 3 ? 8 : 6);
  return Vecs == 1 ? 8 : (Vecs == 2 ? 6 : 4);
}
constexpr int kPvKeyChunk = 128;  // keys per P*V pass: keeps the V chunk in L1/L2

constexpr float kNegInf = -__builtin_inff();

// Vector helpers must always inline: a call per vector costs more than the work inside.
#define NPU_ATTN_VEC_INLINE inline __attribute__((always_inline))

NPU_ATTN_VEC_INLINE Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
NPU_ATTN_VEC_INLINE void store(float* p, Vec v) {
  __builtin_memcpy(p, &v, sizeof(v));
}
// Lane 0 shuffled to every lane: compiles to one broadcast (often folded into the FMA as a
// {1toN} memory operand). "Vec{} + x" would be a real add the compiler must keep
// (0 + -0 = +0), turning each broadcast into an add plus a shuffle on the FMA port.
NPU_ATTN_VEC_INLINE Vec splat(float x) {
  const Vec lane0 = {x};
  return __builtin_shuffle(lane0, IVec{});
}
// max(x, acc) that ignores a NaN x: one vmaxps (which returns its second operand when either
// is NaN). Row maxima therefore skip NaN scores; NaN still reaches the output through exp().
NPU_ATTN_VEC_INLINE Vec max_ignoring_nan(Vec x, Vec acc) {
  return x > acc ? x : acc;
}

NPU_ATTN_VEC_INLINE float reduce_max(Vec v) {  // lanes are never NaN here
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
NPU_ATTN_VEC_INLINE float reduce_sum(Vec v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
inline int64_t min_i64(int64_t a, int64_t b) {
  return a < b ? a : b;
}
inline int64_t max_i64(int64_t a, int64_t b) {
  return a > b ? a : b;
}
inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}
inline int64_t ceil_div(int64_t x, int64_t m) {
  return (x + m - 1) / m;
}

// exp(x) for x <= 0 (all softmax arguments are <= 0 after subtracting the row max).
// Cephes-style: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial (max relative
// error ~2 ulp), then 2^n added straight into the exponent bits. n comes from the
// round-to-nearest magic constant 1.5*2^23, whose low mantissa bits hold n: shifting those bits
// left by 23 gives n << 23 exactly, so no float->int conversion is needed.
// Results below exp(-86) ~ 4e-38 are returned as exactly 0 (this keeps 2^n normal and makes
// masked keys, -inf, contribute exactly nothing); NaN stays NaN through r and the polynomial,
// so NaN inputs propagate like torch.
NPU_ATTN_VEC_INLINE Vec exp_nonpositive(Vec x) {
  const Vec lowest = splat(-86.0f);
  const Vec xc = lowest > x ? lowest : x;  // one maxps; keeps NaN
  const Vec round_magic = splat(12582912.0f);
  const Vec t = xc * splat(1.44269504088896341f) + round_magic;
  const Vec n = t - round_magic;
  Vec r = xc - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  Vec p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  UVec t_bits, p_bits;  // unsigned: the shift wraps by definition
  __builtin_memcpy(&t_bits, &t, sizeof(t));
  __builtin_memcpy(&p_bits, &p, sizeof(p));
  p_bits += t_bits << 23;  // multiply by 2^n
  Vec y;
  __builtin_memcpy(&y, &p_bits, sizeof(y));
  return x < lowest ? splat(0.0f) : y;
}

inline float exp_scalar(float x) {
  return __builtin_expf(x);
}

// ---------------------------------------------------------------- tiling
struct Tiling {
  int64_t block_q;      // query rows per task
  int64_t block_k;      // keys per tile (multiple of kKeyColumnsAlign)
  int64_t num_k_tiles;  // ceil(len_k / block_k)
  int64_t dv_padded;    // head_dim_v rounded up to whole vectors
  int64_t pair_floats;  // packed K^T + V floats for one (batch, kv-head) pair
  int64_t pairs_per_chunk;
};

Tiling choose_tiling(const AttentionParams& p, int threads) {
  Tiling t{};
  // Key tile: K^T panel (head_dim x block_k) ~ 64 KiB keeps it in L2 next to the V rows.
  const int64_t by_cache = 16384 / max_i64(p.head_dim, 1);
  t.block_k = round_up(min_i64(max_i64(by_cache, 64), 512), kKeyColumnsAlign);
  t.block_k = min_i64(t.block_k, round_up(max_i64(p.len_k, 1), kKeyColumnsAlign));
  t.num_k_tiles = ceil_div(p.len_k, t.block_k);
  t.dv_padded = round_up(max_i64(p.head_dim_v, 1), kLanes);
  t.pair_floats = t.num_k_tiles * t.block_k * (p.head_dim + t.dv_padded);

  // Query tile: 64 rows amortise packing; shrink it when there would be too few tasks to keep
  // every thread busy (small batch*heads, short sequences).
  const int64_t heads_rows = p.batch * p.heads_q;
  t.block_q = 64;
  while (t.block_q > 16 && heads_rows * ceil_div(p.len_q, t.block_q) < 4 * threads) t.block_q /= 2;

  // Pack as many pairs at once as fit in a 32 MiB budget: fewer barriers for short sequences,
  // bounded memory for long ones.
  const int64_t budget_floats = (int64_t{32} << 20) / 4;
  const int64_t pairs = p.batch * p.heads_kv;
  t.pairs_per_chunk = max_i64(1, min_i64(pairs, budget_floats / max_i64(t.pair_floats, 1)));
  return t;
}

// ---------------------------------------------------------------- packing
// K^T panel for key tile `tile`: element (d, j) at panel[d * block_k + j]; zero padded.
void pack_key_panel(const AttentionParams& p, const Tiling& t, const float* k_head, int64_t tile,
                    float* panel) {
  const int64_t k0 = tile * t.block_k;
  const int64_t keys = min_i64(t.block_k, p.len_k - k0);
  const int64_t sj = p.k_stride[2], sd = p.k_stride[3];
  for (int64_t d = 0; d < p.head_dim; ++d) {
    float* dst = panel + d * t.block_k;
    const float* src = k_head + k0 * sj + d * sd;
    for (int64_t j = 0; j < keys; ++j) dst[j] = src[j * sj];
    for (int64_t j = keys; j < t.block_k; ++j) dst[j] = 0.0f;
  }
}

// V rows for key tile `tile`: element (j, c) at rows[j * dv_padded + c]; padding columns zero.
void pack_value_rows(const AttentionParams& p, const Tiling& t, const float* v_head, int64_t tile,
                     float* rows) {
  const int64_t k0 = tile * t.block_k;
  const int64_t keys = min_i64(t.block_k, p.len_k - k0);
  const int64_t sj = p.v_stride[2], sc = p.v_stride[3];
  for (int64_t j = 0; j < keys; ++j) {
    float* dst = rows + j * t.dv_padded;
    const float* src = v_head + (k0 + j) * sj;
    if (sc == 1) {
      for (int64_t c = 0; c < p.head_dim_v; ++c) dst[c] = src[c];
    } else {
      for (int64_t c = 0; c < p.head_dim_v; ++c) dst[c] = src[c * sc];
    }
    for (int64_t c = p.head_dim_v; c < t.dv_padded; ++c) dst[c] = 0.0f;
  }
}

// ---------------------------------------------------------------- micro-kernels
template <int N>
struct Count {
  static constexpr int value = N;
};

// Calls fn(Count<n>{}) for a runtime n in [1, Max]: turns a remainder into a template argument.
template <int Max, typename Fn>
inline void with_count(int64_t n, Fn&& fn) {
  if constexpr (Max >= 1) {
    if (n == Max) {
      fn(Count<Max>{});
      return;
    }
    with_count<Max - 1>(n, fn);
  }
}

// s[r][0 : kScoreVecs*kLanes] = sum_d q[r][d] * kt[d][0 : kScoreVecs*kLanes]
template <int Rows>
void score_micro(const float* q, int64_t ldq, const float* kt, int64_t ldk, int64_t depth, float* s,
                 int64_t lds) {
  Vec acc[Rows][kScoreVecs];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kScoreVecs; ++c) acc[r][c] = splat(0.0f);
  for (int64_t d = 0; d < depth; ++d) {
    Vec kd[kScoreVecs];
#pragma GCC unroll 4
    for (int c = 0; c < kScoreVecs; ++c) kd[c] = load(kt + d * ldk + c * kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const Vec qr = splat(q[r * ldq + d]);
#pragma GCC unroll 4
      for (int c = 0; c < kScoreVecs; ++c) acc[r][c] += qr * kd[c];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kScoreVecs; ++c) store(s + r * lds + c * kLanes, acc[r][c]);
}

template <int Rows>
void score_rows(const float* q, int64_t ldq, const float* kt, int64_t ldk, int64_t depth,
                int64_t columns, float* s, int64_t lds) {
  for (int64_t j = 0; j < columns; j += kKeyColumnsAlign)
    score_micro<Rows>(q, ldq, kt + j, ldk, depth, s + j, lds);
}

// S (rows x columns) = Q (rows x depth) * Kt (depth x columns); columns % kKeyColumnsAlign == 0
void compute_scores(const float* q, int64_t depth, const float* kt, int64_t ldk, int64_t rows,
                    int64_t columns, float* s, int64_t lds) {
  int64_t r = 0;
  for (; r + kScoreRows <= rows; r += kScoreRows)
    score_rows<kScoreRows>(q + r * depth, depth, kt, ldk, depth, columns, s + r * lds, lds);
  with_count<kScoreRows - 1>(rows - r, [&](auto n) {
    score_rows<decltype(n)::value>(q + r * depth, depth, kt, ldk, depth, columns, s + r * lds, lds);
  });
}

// o[r][0 : Vecs*kLanes] += sum_j p[r][j] * v[j][0 : Vecs*kLanes]
template <int Rows, int Vecs>
void pv_micro(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t keys, float* o,
              int64_t ldo) {
  Vec acc[Rows][Vecs];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < Vecs; ++c) acc[r][c] = load(o + r * ldo + c * kLanes);
  for (int64_t j = 0; j < keys; ++j) {
    Vec vj[Vecs];
#pragma GCC unroll 4
    for (int c = 0; c < Vecs; ++c) vj[c] = load(v + j * ldv + c * kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const Vec pr = splat(p[r * ldp + j]);
#pragma GCC unroll 4
      for (int c = 0; c < Vecs; ++c) acc[r][c] += pr * vj[c];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < Vecs; ++c) store(o + r * ldo + c * kLanes, acc[r][c]);
}

// O[:, 0 : Vecs*kLanes] (rows x ...) += P (rows x keys) * V[:, 0 : Vecs*kLanes]
template <int Vecs>
void pv_columns(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t rows,
                int64_t keys, float* o, int64_t ldo) {
  constexpr int kRows = pv_rows_for<Vecs>();
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    pv_micro<kRows, Vecs>(p + r * ldp, ldp, v, ldv, keys, o + r * ldo, ldo);
  with_count<kRows - 1>(rows - r, [&](auto n) {
    pv_micro<decltype(n)::value, Vecs>(p + r * ldp, ldp, v, ldv, keys, o + r * ldo, ldo);
  });
}

// O (rows x vecs*kLanes) += P (rows x keys) * V (keys x vecs*kLanes)
void accumulate_pv(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t rows,
                   int64_t keys, int64_t vecs, float* o, int64_t ldo) {
  for (int64_t j0 = 0; j0 < keys; j0 += kPvKeyChunk) {
    const int64_t kc = min_i64(kPvKeyChunk, keys - j0);
    for (int64_t c = 0; c < vecs; c += kPvMaxVecs) {
      with_count<kPvMaxVecs>(min_i64(kPvMaxVecs, vecs - c), [&](auto nv) {
        pv_columns<decltype(nv)::value>(p + j0, ldp, v + j0 * ldv + c * kLanes, ldv, rows, kc,
                                        o + c * kLanes, ldo);
      });
    }
  }
}

// ---------------------------------------------------------------- masking and softmax
struct TileCoords {
  int64_t batch, head, q0, rows, k0, keys, columns;  // columns = keys rounded up to alignment
};

void apply_user_mask(const AttentionParams& p, const TileCoords& tc, float* s, int64_t lds) {
  const int64_t* ms = p.mask_stride;
  const int64_t base = tc.batch * ms[0] + tc.head * ms[1] + tc.k0 * ms[3];
  for (int64_t r = 0; r < tc.rows; ++r) {
    float* srow = s + r * lds;
    const int64_t row_off = base + (tc.q0 + r) * ms[2];
    if (p.mask_kind == MaskKind::kAdditive) {
      const float* m = static_cast<const float*>(p.mask) + row_off;
      if (ms[3] == 1) {
        for (int64_t j = 0; j < tc.keys; ++j) srow[j] += m[j];
      } else {
        for (int64_t j = 0; j < tc.keys; ++j) srow[j] += m[j * ms[3]];
      }
    } else {
      const uint8_t* m = static_cast<const uint8_t*>(p.mask) + row_off;
      for (int64_t j = 0; j < tc.keys; ++j) srow[j] = m[j * ms[3]] ? srow[j] : kNegInf;
    }
  }
}

// Keys past len_k (padding) and, if causal, keys after the query's own position get -inf.
void apply_bounds(const AttentionParams& p, const TileCoords& tc, float* s, int64_t lds) {
  for (int64_t r = 0; r < tc.rows; ++r) {
    float* srow = s + r * lds;
    int64_t first_masked = tc.keys;
    if (p.is_causal) first_masked = min_i64(first_masked, max_i64(0, tc.q0 + r + 1 - tc.k0));
    for (int64_t j = first_masked; j < tc.columns; ++j) srow[j] = kNegInf;
  }
}

// Max over a row of scores, skipping NaN. Four independent chains: a single running max would
// be bound by the max instruction's latency, not by throughput.
float row_max_ignoring_nan(const float* row, int64_t columns) {
  Vec m0 = splat(kNegInf), m1 = m0, m2 = m0, m3 = m0;
  int64_t j = 0;
  for (; j + 4 * kLanes <= columns; j += 4 * kLanes) {
    m0 = max_ignoring_nan(load(row + j), m0);
    m1 = max_ignoring_nan(load(row + j + kLanes), m1);
    m2 = max_ignoring_nan(load(row + j + 2 * kLanes), m2);
    m3 = max_ignoring_nan(load(row + j + 3 * kLanes), m3);
  }
  for (; j < columns; j += kLanes) m0 = max_ignoring_nan(load(row + j), m0);
  return reduce_max(max_ignoring_nan(max_ignoring_nan(m0, m1), max_ignoring_nan(m2, m3)));
}

bool row_has_nan(const float* row, int64_t columns) {
  for (int64_t j = 0; j < columns; ++j)
    if (row[j] != row[j]) return true;
  return false;
}

// row[j] = exp(row[j] - shift) in place; returns the sum (two chains, as for the max).
float exp_shifted_in_place(float* row, int64_t columns, float shift_value) {
  const Vec shift = splat(shift_value);
  Vec s0 = splat(0.0f), s1 = s0;
  int64_t j = 0;
  for (; j + 2 * kLanes <= columns; j += 2 * kLanes) {
    const Vec e0 = exp_nonpositive(load(row + j) - shift);
    const Vec e1 = exp_nonpositive(load(row + j + kLanes) - shift);
    store(row + j, e0);
    store(row + j + kLanes, e1);
    s0 += e0;
    s1 += e1;
  }
  for (; j < columns; j += kLanes) {
    const Vec e = exp_nonpositive(load(row + j) - shift);
    store(row + j, e);
    s0 += e;
  }
  return reduce_sum(s0 + s1);
}

// Online softmax update for one tile. Turns scores into probabilities in place, rescales the
// running output rows by alpha = exp(m_old - m_new) and updates the running max and sum.
void softmax_update(int64_t rows, int64_t columns, float* s, int64_t lds, float* row_max,
                    float* row_sum, float* o, int64_t ldo, int64_t dv_padded) {
  for (int64_t r = 0; r < rows; ++r) {
    float* srow = s + r * lds;
    const float tile_max = row_max_ignoring_nan(srow, columns);
    const float m_old = row_max[r];
    const float m_new = tile_max > m_old ? tile_max : m_old;
    if (m_new == kNegInf) {
      // Every key so far is masked (contributes nothing yet) or every score is NaN (NaN in q
      // or k), which must poison the row as in torch rather than read as "masked".
      if (row_has_nan(srow, columns)) row_sum[r] = __builtin_nanf("");
      for (int64_t j = 0; j < columns; ++j) srow[j] = 0.0f;
      continue;
    }
    const float tile_sum = exp_shifted_in_place(srow, columns, m_new);
    const float alpha = m_old == kNegInf ? 0.0f : exp_scalar(m_old - m_new);
    row_sum[r] = row_sum[r] * alpha + tile_sum;
    row_max[r] = m_new;
    if (alpha != 1.0f) {
      float* orow = o + r * ldo;
      const Vec va = splat(alpha);
      for (int64_t c = 0; c < dv_padded; c += kLanes) store(orow + c, load(orow + c) * va);
    }
  }
}

// ---------------------------------------------------------------- one task
struct ThreadScratch {
  float* q;  // block_q x head_dim, scaled
  float* s;  // block_q x block_k
  float* o;  // block_q x dv_padded
  float* m;  // block_q
  float* l;  // block_q
};

int64_t scratch_floats(const AttentionParams& p, const Tiling& t) {
  return round_up(t.block_q * max_i64(p.head_dim, 1), 16) + t.block_q * t.block_k +
         t.block_q * t.dv_padded + 2 * round_up(t.block_q, 16);
}

// Carves one thread's scratch out of `base` (scratch_floats(p, t) floats, 64-byte aligned).
ThreadScratch carve_scratch(const AttentionParams& p, const Tiling& t, float* base) {
  ThreadScratch ws{};
  ws.q = base;
  ws.s = ws.q + round_up(t.block_q * max_i64(p.head_dim, 1), 16);
  ws.o = ws.s + t.block_q * t.block_k;
  ws.m = ws.o + t.block_q * t.dv_padded;
  ws.l = ws.m + round_up(t.block_q, 16);
  return ws;
}

void load_scaled_queries(const AttentionParams& p, const float* q_head, int64_t q0, int64_t rows,
                         float* dst) {
  const int64_t si = p.q_stride[2], sd = p.q_stride[3];
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q_head + (q0 + r) * si;
    float* d = dst + r * p.head_dim;
    for (int64_t c = 0; c < p.head_dim; ++c) d[c] = src[c * sd] * p.scale;
  }
}

void write_output(const AttentionParams& p, const TileCoords& tc, const ThreadScratch& ws,
                  int64_t dv_padded) {
  float* out_head = p.out + tc.batch * p.out_stride[0] + tc.head * p.out_stride[1];
  for (int64_t r = 0; r < tc.rows; ++r) {
    const float l = ws.l[r];
    // Rows with every key masked have l == 0: output 0 like torch's SDPA, lse = -inf.
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;
    const float* orow = ws.o + r * dv_padded;
    float* dst = out_head + (tc.q0 + r) * p.out_stride[2];
    const int64_t sc = p.out_stride[3];
    for (int64_t c = 0; c < p.head_dim_v; ++c) dst[c * sc] = orow[c] * inv;
    if (p.lse != nullptr) {
      float* lse = p.lse + tc.batch * p.lse_stride[0] + tc.head * p.lse_stride[1];
      lse[(tc.q0 + r) * p.lse_stride[2]] = l == 0.0f ? kNegInf : ws.m[r] + __builtin_logf(l);
    }
  }
}

void run_query_tile(const AttentionParams& p, const Tiling& t, const float* packed_pair,
                    int64_t batch, int64_t head, int64_t q0, ThreadScratch& ws) {
  TileCoords tc{};
  tc.batch = batch;
  tc.head = head;
  tc.q0 = q0;
  tc.rows = min_i64(t.block_q, p.len_q - q0);
  const float* q_head = p.q + batch * p.q_stride[0] + head * p.q_stride[1];
  load_scaled_queries(p, q_head, q0, tc.rows, ws.q);
  for (int64_t r = 0; r < tc.rows; ++r) {
    ws.m[r] = kNegInf;
    ws.l[r] = 0.0f;
  }
  for (int64_t i = 0; i < tc.rows * t.dv_padded; ++i) ws.o[i] = 0.0f;

  // Causal: keys after the tile's last query are masked for every row; skip those tiles.
  int64_t key_limit = p.len_k;
  if (p.is_causal) key_limit = min_i64(key_limit, q0 + tc.rows);
  const float* key_panels = packed_pair;
  const float* value_rows = packed_pair + t.num_k_tiles * t.block_k * p.head_dim;
  for (int64_t tile = 0; tile * t.block_k < key_limit; ++tile) {
    tc.k0 = tile * t.block_k;
    tc.keys = min_i64(t.block_k, p.len_k - tc.k0);
    tc.columns = round_up(tc.keys, kKeyColumnsAlign);
    const float* kt = key_panels + tile * t.block_k * p.head_dim;
    compute_scores(ws.q, p.head_dim, kt, t.block_k, tc.rows, tc.columns, ws.s, t.block_k);
    if (p.mask_kind != MaskKind::kNone) apply_user_mask(p, tc, ws.s, t.block_k);
    apply_bounds(p, tc, ws.s, t.block_k);
    softmax_update(tc.rows, tc.columns, ws.s, t.block_k, ws.m, ws.l, ws.o, t.dv_padded,
                   t.dv_padded);
    const float* vt = value_rows + tc.k0 * t.dv_padded;
    accumulate_pv(ws.s, t.block_k, vt, t.dv_padded, tc.rows, tc.keys, t.dv_padded / kLanes, ws.o,
                  t.dv_padded);
  }
  write_output(p, tc, ws, t.dv_padded);
}

// ---------------------------------------------------------------- driver
void attention_forward_tiled(const AttentionParams& p) {
  if (p.batch == 0 || p.heads_q == 0 || p.len_q == 0) return;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t pairs = p.batch * p.heads_kv;
  const int64_t q_tiles_probe = ceil_div(p.len_q, 16);
  const int64_t max_tasks = p.batch * p.heads_q * q_tiles_probe;
  const int threads = static_cast<int>(min_i64(max_i64(p.num_threads, 1), max_tasks));
  const Tiling t = choose_tiling(p, threads);
  const int64_t q_tiles = ceil_div(p.len_q, t.block_q);
  // All workspace is allocated here, outside the parallel region, so an allocation failure
  // surfaces as std::bad_alloc to the caller instead of terminating inside OpenMP.
  const int64_t chunk_floats = t.pairs_per_chunk * t.pair_floats;
  const int64_t per_thread = round_up(scratch_floats(p, t), 16);
  float* packed = workspace_alloc_floats(chunk_floats);
  float* scratch = nullptr;
  try {
    scratch = workspace_alloc_floats(per_thread * threads);
  } catch (...) {
    workspace_free_floats(packed, chunk_floats);
    throw;
  }

#pragma omp parallel num_threads(threads)
  {
    ThreadScratch ws = carve_scratch(p, t, scratch + per_thread * omp_get_thread_num());
    for (int64_t first = 0; first < pairs; first += t.pairs_per_chunk) {
      const int64_t chunk_pairs = min_i64(t.pairs_per_chunk, pairs - first);
      // Phase 1: pack K^T panels and V rows of every pair in the chunk, tile by tile.
#pragma omp for schedule(static)
      for (int64_t item = 0; item < chunk_pairs * t.num_k_tiles; ++item) {
        const int64_t local = item / t.num_k_tiles, tile = item % t.num_k_tiles;
        const int64_t pair = first + local;
        const int64_t b = pair / p.heads_kv, hkv = pair % p.heads_kv;
        float* dst = packed + local * t.pair_floats;
        const float* k_head = p.k + b * p.k_stride[0] + hkv * p.k_stride[1];
        const float* v_head = p.v + b * p.v_stride[0] + hkv * p.v_stride[1];
        pack_key_panel(p, t, k_head, tile, dst + tile * t.block_k * p.head_dim);
        float* v_rows = dst + t.num_k_tiles * t.block_k * p.head_dim;
        pack_value_rows(p, t, v_head, tile, v_rows + tile * t.block_k * t.dv_padded);
      }
      // Phase 2: every (pair, q-head of its group, q tile) is an independent task.
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < chunk_pairs * group * q_tiles; ++task) {
        const int64_t local = task / (group * q_tiles);
        const int64_t rest = task % (group * q_tiles);
        const int64_t pair = first + local;
        const int64_t b = pair / p.heads_kv, hkv = pair % p.heads_kv;
        const int64_t head = hkv * group + rest / q_tiles;
        const int64_t q0 = (rest % q_tiles) * t.block_q;
        run_query_tile(p, t, packed + local * t.pair_floats, b, head, q0, ws);
      }
    }
  }
  workspace_free_floats(scratch, per_thread * threads);
  workspace_free_floats(packed, chunk_floats);
}

}  // namespace
}  // namespace npu_attn
