// bfloat16 attention forward on AMX (Intel Advanced Matrix Extensions, Sapphire Rapids and
// later): both products run on the tile unit (tdpbf16ps: a 16x32 bfloat16 tile times a 32x16
// one, accumulated into 16x16 float32), the online softmax on AVX-512.
//
// Unlike the float32 kernel this one is row-major (a row per query), because AMX tiles are:
//   per task = (batch, q-head, 32 queries), for each key block of BK keys (BK <= 128, 32 | BK):
//     S (32 x BK, f32)   = Q K^T           tiles: 4 accumulators, 2 Q tiles, 2 K tiles
//     S = S * scale + mask, causal, keys past len_k -> -inf                       (AVX-512)
//     online softmax per row: m, l, O *= alpha, P (32 x BK, bf16) = exp(S - m)    (AVX-512)
//     O (32 x Dv, f32)  += P V             tiles: 4 accumulators, 2 P tiles, 2 V tiles
//   out = O / l (bfloat16), lse = m + log(l)
// Operands in tile layout, packed once per (batch, kv-head) pair:
//   K as "VNNI" words: Kw[p][j]  = (K[j][2p], K[j][2p+1])     (head_dim/2 rows x keys)
//   V as "VNNI" words: Vw[i][c]  = (V[2i][c], V[2i+1][c])     (keys/2 rows x head_dim_v)
// zero-padded to whole tiles (head dims to 32 / 16, keys to BK), so padding contributes 0.
// Accumulation, softmax and the output normalisation are float32; P is rounded to bfloat16
// for the second product (as torch's CPU kernel and FlashAttention do for 16-bit inputs).
//
// The tile configuration is per thread (loaded at the start of each parallel region, released
// at its end); the OS permission to use AMX state is requested once per process by dispatch.cpp
// before this kernel is ever selected.
#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__)
#error "attention_forward_amx_impl.h needs -mamx-tile -mamx-bf16 -mavx512bf16"
#endif

#include <immintrin.h>

#include "attention_forward_impl.h"

namespace npu_attn {
namespace {

constexpr int64_t kAmxRows = 16;        // rows of every tile
constexpr int64_t kAmxBlockQ = 32;      // queries per task: two row blocks
constexpr int64_t kAmxMaxBlockK = 128;  // keys per block (a multiple of 32)

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile used here is 16 rows x 64 bytes (16 floats, 32 bfloat16 or 16 words).
void configure_tiles() {
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kAmxRows;
  }
  _tile_loadconfig(&config);
}

// ---------------------------------------------------------------- plan and packing
struct AmxPlan {
  int64_t dim_pad;    // head_dim rounded up to 32 (one tile of bfloat16 columns)
  int64_t dim_v_pad;  // head_dim_v rounded up to 16 (one tile of float32 columns)
  int64_t block_k;    // keys per block, a multiple of 32
  int64_t len_k_pad;  // len_k rounded up to block_k
  int64_t pair_words;
  int64_t pairs_per_chunk;
};

AmxPlan plan_amx(const AttentionParams& p) {
  AmxPlan a{};
  a.dim_pad = round_up(max_i64(p.head_dim, 1), 32);
  a.dim_v_pad = round_up(max_i64(p.head_dim_v, 1), 16);
  a.block_k = min_i64(kAmxMaxBlockK, round_up(max_i64(p.len_k, 1), 32));
  a.len_k_pad = round_up(max_i64(p.len_k, 1), a.block_k);
  a.pair_words = a.dim_pad / 2 * a.len_k_pad + a.len_k_pad / 2 * a.dim_v_pad;
  const int64_t budget_words = (int64_t{64} << 20) / 4;
  a.pairs_per_chunk =
      max_i64(1, min_i64(p.batch * p.heads_kv, budget_words / max_i64(a.pair_words, 1)));
  return a;
}

// Keys [k0, k0 + count) of one pair into the VNNI layouts (zeros beyond head_dim / len_k are
// written by the caller's zero fill of the whole pair block).
void pack_vnni(const AttentionParams& p, const AmxPlan& a, int64_t pair, int64_t k0, int64_t count,
               uint32_t* dst) {
  const int64_t b = pair / p.heads_kv, hkv = pair % p.heads_kv;
  const uint16_t* k = static_cast<const uint16_t*>(p.k) + b * p.k_stride[0] + hkv * p.k_stride[1];
  const uint16_t* v = static_cast<const uint16_t*>(p.v) + b * p.v_stride[0] + hkv * p.v_stride[1];
  uint32_t* kw = dst;
  uint32_t* vw = dst + a.dim_pad / 2 * a.len_k_pad;
  for (int64_t w = 0; w < a.dim_pad / 2; ++w) {
    uint32_t* row = kw + w * a.len_k_pad;
    const int64_t d = 2 * w;
    for (int64_t j = k0; j < k0 + count; ++j) {
      const uint16_t* src = k + j * p.k_stride[2];
      const uint32_t lo = d < p.head_dim ? src[d * p.k_stride[3]] : 0;
      const uint32_t hi = d + 1 < p.head_dim ? src[(d + 1) * p.k_stride[3]] : 0;
      row[j] = lo | hi << 16;
    }
  }
  for (int64_t j = k0; j < k0 + count; j += 2) {
    uint32_t* row = vw + (j / 2) * a.dim_v_pad;
    const uint16_t* lo = v + j * p.v_stride[2];
    const uint16_t* hi = j + 1 < p.len_k ? lo + p.v_stride[2] : nullptr;
    for (int64_t c = 0; c < p.head_dim_v; ++c) {
      const uint32_t high = hi ? hi[c * p.v_stride[3]] : 0;
      row[c] = lo[c * p.v_stride[3]] | high << 16;
    }
  }
}

// ---------------------------------------------------------------- one task
struct AmxScratch {
  uint16_t* q;  // 32 x dim_pad bfloat16 query rows, zero-padded
  float* s;     // 32 x block_k scores
  uint16_t* p;  // 32 x block_k probabilities (bfloat16)
  float* o;     // 32 x dim_v_pad running output
  float* m;     // 32 running max
  float* l;     // 32 running sum
};

int64_t amx_scratch_floats(const AmxPlan& a) {
  return kAmxBlockQ * (a.dim_pad / 2 + a.block_k + a.block_k / 2 + a.dim_v_pad + 2);
}

AmxScratch carve_amx_scratch(const AmxPlan& a, float* base) {
  AmxScratch s{};
  s.q = reinterpret_cast<uint16_t*>(base);
  s.s = base + kAmxBlockQ * a.dim_pad / 2;
  s.p = reinterpret_cast<uint16_t*>(s.s + kAmxBlockQ * a.block_k);
  s.o = s.s + kAmxBlockQ * a.block_k + kAmxBlockQ * a.block_k / 2;
  s.m = s.o + kAmxBlockQ * a.dim_v_pad;
  s.l = s.m + kAmxBlockQ;
  return s;
}

void load_query_rows(const AttentionParams& p, const AmxPlan& a, const QueryTile& t, uint16_t* q) {
  const uint16_t* src = static_cast<const uint16_t*>(p.q) + t.batch * p.q_stride[0] +
                        t.head * p.q_stride[1] + t.q0 * p.q_stride[2];
  for (int64_t i = 0; i < kAmxBlockQ; ++i) {
    uint16_t* row = q + i * a.dim_pad;
    const uint16_t* s = src + i * p.q_stride[2];
    const int64_t valid = i < t.rows ? p.head_dim : 0;
    for (int64_t d = 0; d < valid; ++d) row[d] = s[d * p.q_stride[3]];
    for (int64_t d = valid; d < a.dim_pad; ++d) row[d] = 0;
  }
}

// S (32 x keys of the block, rounded up to 32) = Q K^T for keys [k0, k0 + block).
void scores_tile(const AmxPlan& a, const AmxScratch& ws, const uint32_t* kw, int64_t k0,
                 int64_t keys) {
  const int64_t q_stride = a.dim_pad * 2, k_stride = a.len_k_pad * 4, s_stride = a.block_k * 4;
  for (int64_t j = 0; j < keys; j += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t d = 0; d < a.dim_pad; d += 32) {
      _tile_loadd(4, ws.q + d, q_stride);
      _tile_loadd(5, ws.q + kAmxRows * a.dim_pad + d, q_stride);
      const uint32_t* kt = kw + (d / 2) * a.len_k_pad + k0 + j;
      _tile_loadd(6, kt, k_stride);
      _tile_loadd(7, kt + 16, k_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, ws.s + j, s_stride);
    _tile_stored(1, ws.s + j + 16, s_stride);
    _tile_stored(2, ws.s + kAmxRows * a.block_k + j, s_stride);
    _tile_stored(3, ws.s + kAmxRows * a.block_k + j + 16, s_stride);
  }
}

// O (32 x dim_v_pad) += P V over keys [k0, k0 + keys32) of the block.
void values_tile(const AmxPlan& a, const AmxScratch& ws, const uint32_t* vw, int64_t k0,
                 int64_t keys32) {
  const int64_t o_stride = a.dim_v_pad * 4, p_stride = a.block_k * 2, v_stride = a.dim_v_pad * 4;
  float* o_hi = ws.o + kAmxRows * a.dim_v_pad;
  const uint16_t* p_hi = ws.p + kAmxRows * a.block_k;
  int64_t c = 0;
  for (; c + 32 <= a.dim_v_pad; c += 32) {  // two column tiles at once: P tiles load once
    _tile_loadd(0, ws.o + c, o_stride);
    _tile_loadd(1, ws.o + c + 16, o_stride);
    _tile_loadd(2, o_hi + c, o_stride);
    _tile_loadd(3, o_hi + c + 16, o_stride);
    for (int64_t j = 0; j < keys32; j += 32) {
      _tile_loadd(4, ws.p + j, p_stride);
      _tile_loadd(5, p_hi + j, p_stride);
      const uint32_t* vt = vw + ((k0 + j) / 2) * a.dim_v_pad + c;
      _tile_loadd(6, vt, v_stride);
      _tile_loadd(7, vt + 16, v_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, ws.o + c, o_stride);
    _tile_stored(1, ws.o + c + 16, o_stride);
    _tile_stored(2, o_hi + c, o_stride);
    _tile_stored(3, o_hi + c + 16, o_stride);
  }
  if (c < a.dim_v_pad) {  // one last column tile of 16
    _tile_loadd(0, ws.o + c, o_stride);
    _tile_loadd(2, o_hi + c, o_stride);
    for (int64_t j = 0; j < keys32; j += 32) {
      _tile_loadd(4, ws.p + j, p_stride);
      _tile_loadd(5, p_hi + j, p_stride);
      _tile_loadd(6, vw + ((k0 + j) / 2) * a.dim_v_pad + c, v_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
    }
    _tile_stored(0, ws.o + c, o_stride);
    _tile_stored(2, o_hi + c, o_stride);
  }
}

// scale, user mask, causal and the keys past len_k, on row-major scores (row = query).
void mask_rows(const AttentionParams& p, const QueryTile& t, int64_t k0, int64_t keys,
               int64_t keys32, float* s, int64_t ld) {
  const int64_t* ms = p.mask_stride;
  const Vec scale = splat(p.scale);
  for (int64_t i = 0; i < t.rows; ++i) {
    float* row = s + i * ld;
    for (int64_t j = 0; j < keys32; j += kLanes) store(row + j, load(row + j) * scale);
    if (p.mask_kind == MaskKind::kAdditive) {
      const float* m = static_cast<const float*>(p.mask) + t.batch * ms[0] + t.head * ms[1] +
                       (t.q0 + i) * ms[2] + k0 * ms[3];
      for (int64_t j = 0; j < keys; ++j) row[j] += m[j * ms[3]];
    } else if (p.mask_kind == MaskKind::kBool) {
      const uint8_t* m = static_cast<const uint8_t*>(p.mask) + t.batch * ms[0] + t.head * ms[1] +
                         (t.q0 + i) * ms[2] + k0 * ms[3];
      for (int64_t j = 0; j < keys; ++j) row[j] = m[j * ms[3]] ? row[j] : kNegInf;
    }
    const int64_t visible = p.is_causal ? min_i64(keys, t.q0 + i + 1 - k0) : keys;
    for (int64_t j = max_i64(visible, 0); j < keys32; ++j) row[j] = kNegInf;
  }
}

NPU_ATTN_VEC_INLINE float horizontal_max(Vec v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
NPU_ATTN_VEC_INLINE float horizontal_sum(Vec v) {
  float sum = 0.0f;
  for (int i = 0; i < kLanes; ++i) sum += v[i];
  return sum;
}

// Online softmax per query row over one key block: P in bfloat16, O rescaled by alpha.
void softmax_rows(const AmxPlan& a, const QueryTile& t, int64_t keys32, AmxScratch& ws) {
  for (int64_t i = 0; i < t.rows; ++i) {
    float* row = ws.s + i * a.block_k;
    Vec vmax = splat(kNegInf);
    for (int64_t j = 0; j < keys32; j += kLanes) vmax = max_ignoring_nan(load(row + j), vmax);
    const float m_old = ws.m[i];
    const float m_tile = horizontal_max(vmax);
    const float m_new = m_tile > m_old ? m_tile : m_old;
    const float shift = m_new == kNegInf ? 0.0f : m_new;
    const float alpha = m_old == kNegInf ? 0.0f : __builtin_expf(m_old - shift);
    const Vec shift_v = splat(shift);
    Vec sum = splat(0.0f);
    uint16_t* prow = ws.p + i * a.block_k;
    for (int64_t j = 0; j < keys32; j += kLanes) {
      const Vec e = exp_nonpositive(load(row + j) - shift_v);
      sum += e;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    ws.m[i] = m_new;
    ws.l[i] = ws.l[i] * alpha + horizontal_sum(sum);
    if (alpha != 1.0f) {
      float* o = ws.o + i * a.dim_v_pad;
      const Vec av = splat(alpha);
      for (int64_t c = 0; c < a.dim_v_pad; c += kLanes) store(o + c, load(o + c) * av);
    }
  }
  // Padding rows of the tile: P = 0 so they add nothing (their output is never written).
  for (int64_t i = t.rows; i < kAmxBlockQ; ++i)
    for (int64_t j = 0; j < keys32; ++j) ws.p[i * a.block_k + j] = 0;
}

void write_rows_out(const AttentionParams& p, const AmxPlan& a, const QueryTile& t,
                    const AmxScratch& ws) {
  BFloat16* out = static_cast<BFloat16*>(p.out) + t.batch * p.out_stride[0] +
                  t.head * p.out_stride[1] + t.q0 * p.out_stride[2];
  for (int64_t i = 0; i < t.rows; ++i) {
    const float inv = ws.l[i] == 0.0f ? 0.0f : 1.0f / ws.l[i];
    const float* o = ws.o + i * a.dim_v_pad;
    BFloat16* dst = out + i * p.out_stride[2];
    int64_t c = 0;
    if (p.out_stride[3] == 1) {
      for (; c + kLanes <= p.head_dim_v; c += kLanes)
        store_from_float(dst + c, load(o + c) * splat(inv));
    }
    for (; c < p.head_dim_v; ++c) dst[c * p.out_stride[3]] = from_float<BFloat16>(o[c] * inv);
    if (p.lse != nullptr) {
      p.lse[t.batch * p.lse_stride[0] + t.head * p.lse_stride[1] + (t.q0 + i) * p.lse_stride[2]] =
          inv == 0.0f ? kNegInf : ws.m[i] + __builtin_logf(ws.l[i]);
    }
  }
}

void run_amx_tile(const AttentionParams& p, const AmxPlan& a, const uint32_t* pair_block,
                  const QueryTile& t, AmxScratch& ws) {
  const uint32_t* kw = pair_block;
  const uint32_t* vw = pair_block + a.dim_pad / 2 * a.len_k_pad;
  load_query_rows(p, a, t, ws.q);
  for (int64_t i = 0; i < kAmxBlockQ; ++i) {
    ws.m[i] = kNegInf;
    ws.l[i] = 0.0f;
  }
  for (int64_t i = 0; i < kAmxBlockQ * a.dim_v_pad; ++i) ws.o[i] = 0.0f;
  const int64_t key_limit = p.is_causal ? min_i64(p.len_k, t.q0 + t.rows) : p.len_k;
  for (int64_t k0 = 0; k0 < key_limit; k0 += a.block_k) {
    const int64_t keys = min_i64(a.block_k, key_limit - k0);
    const int64_t keys32 = round_up(keys, 32);
    scores_tile(a, ws, kw, k0, keys32);
    mask_rows(p, t, k0, keys, keys32, ws.s, a.block_k);
    softmax_rows(a, t, keys32, ws);
    values_tile(a, ws, vw, k0, keys32);
  }
  write_rows_out(p, a, t, ws);
}

void attention_forward_bf16_amx(const AttentionParams& p) {
  if (p.batch == 0 || p.heads_q == 0 || p.len_q == 0) return;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t pairs = p.batch * p.heads_kv;
  const int64_t q_tiles = ceil_div(p.len_q, kAmxBlockQ);
  const int64_t max_tasks = p.batch * p.heads_q * q_tiles;
  const int threads = static_cast<int>(min_i64(max_i64(p.num_threads, 1), max_tasks));
  const AmxPlan a = plan_amx(p);
  const int64_t k_blocks = a.len_k_pad / a.block_k;

  const int64_t chunk_words = a.pairs_per_chunk * a.pair_words;
  const int64_t per_thread = round_up(amx_scratch_floats(a), 16);
  float* packed_f = workspace_alloc_floats(chunk_words);
  float* scratch = nullptr;
  try {
    scratch = workspace_alloc_floats(per_thread * threads);
  } catch (...) {
    workspace_free_floats(packed_f, chunk_words);
    throw;
  }
  uint32_t* packed = reinterpret_cast<uint32_t*>(packed_f);

#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
    AmxScratch ws = carve_amx_scratch(a, scratch + per_thread * omp_get_thread_num());
    for (int64_t first = 0; first < pairs; first += a.pairs_per_chunk) {
      const int64_t chunk_pairs = min_i64(a.pairs_per_chunk, pairs - first);
#pragma omp for schedule(static)
      for (int64_t item = 0; item < chunk_pairs * k_blocks; ++item) {
        const int64_t local = item / k_blocks, block = item % k_blocks;
        uint32_t* dst = packed + local * a.pair_words;
        const int64_t k0 = block * a.block_k;
        // Zero this block's padding: columns past len_k in K, rows past len_k in V.
        const int64_t count = max_i64(0, min_i64(a.block_k, p.len_k - k0));
        for (int64_t w = 0; w < a.dim_pad / 2; ++w)
          for (int64_t j = k0; j < k0 + a.block_k; ++j) dst[w * a.len_k_pad + j] = 0;
        uint32_t* vw = dst + a.dim_pad / 2 * a.len_k_pad;
        for (int64_t i = k0 / 2; i < (k0 + a.block_k) / 2; ++i)
          for (int64_t c = 0; c < a.dim_v_pad; ++c) vw[i * a.dim_v_pad + c] = 0;
        pack_vnni(p, a, first + local, k0, count, dst);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < chunk_pairs * group * q_tiles; ++task) {
        const int64_t local = task / (group * q_tiles);
        const int64_t rest = task % (group * q_tiles);
        const int64_t pair = first + local;
        QueryTile t{};
        t.batch = pair / p.heads_kv;
        t.head = (pair % p.heads_kv) * group + rest / q_tiles;
        t.q0 = (rest % q_tiles) * kAmxBlockQ;
        t.rows = min_i64(kAmxBlockQ, p.len_q - t.q0);
        run_amx_tile(p, a, packed + local * a.pair_words, t, ws);
      }
    }
    _tile_release();
  }
  workspace_free_floats(scratch, per_thread * threads);
  workspace_free_floats(packed_f, chunk_words);
}

}  // namespace
}  // namespace npu_attn
