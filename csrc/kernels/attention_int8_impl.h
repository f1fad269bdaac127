// ISA-neutral int8 attention forward (SageAttention-style, lossy, opt-in): the float32-compute
// kernel of attention_forward_impl.h with S = Q K^T computed on 8-bit integers. Compiled once
// per variant that has its own int8 kernel (attention_int8_<variant>.cpp).
//
// The method (after Zhang et al., SageAttention, ICLR 2025), as done here:
// - K is smoothed: each key tile's per-channel mean mu over its keys is subtracted before
//   quantizing. Diffusion keys carry per-channel offsets about ten times their per-token spread;
//   without smoothing the offsets would take most of the 8-bit range. The subtracted part is
//   added back exactly, in float32: S = q.(k - mu) + q.mu, one dot product per query and key
//   tile. (SageAttention subtracts the mean over the whole sequence, which softmax ignores; the
//   per-tile mean keeps quantization inside the one packing pass over K.)
// - Query outlier channels (a few channels several times the others) are moved into K before
//   quantizing, as SmoothQuant does between activations and weights: channel d of Q is divided
//   and channel d of K multiplied by c_d = sqrt(max|q_d| / mean over channels of max|q_d|), the
//   maxima over every query of the (batch, kv-head) pair. The product is unchanged; Q's codes
//   no longer spend their range on a few channels. On test activations with 8x outlier
//   channels this halves the error of the attention output (relative L1 0.034 -> 0.021 at
//   D=128, 4096 keys; in a float64 model of the scheme).
// - Q (scaled by `scale`) and K are quantized per token to codes in [-127, 127]: one float32
//   scale per query and per key. The dequantization multiplies every score once anyway, so
//   per-token scales cost nothing over per-block ones and follow each token's own range.
// - The integer product, four channels per 32-bit word: AVX2's vpmaddubsw multiplies unsigned
//   by signed bytes and adds adjacent pairs into *saturating* int16. It gets |k| and q * sign(k)
//   (vpabsb, vpsignb): each product is then at most 127 * 127 and a pair 32258 < 32767, so it
//   never saturates, with 8-bit codes on both sides (offsetting Q to unsigned bytes would
//   saturate unless K had 7 bits, which measured 1.5x the error). vpmaddwd widens the pairs to
//   int32 sums of four channels. With VNNI (kVnniProducts: the avx_vnni and avx512_vnni
//   variants) one vpdpbusd adds four unsigned x signed byte products straight into int32, with
//   no 16-bit step to saturate: Q's codes are stored offset by 128 (q + 128 in [1, 255]), which
//   adds 128 * (sum of the key's codes) to every score's sum; packing K stores that per key and
//   the epilogue subtracts it, so the sums are exactly the AVX2 ones. With AMX-INT8
//   (kTileScores: the amx_int8 variant) tdpbssd multiplies signed bytes on both sides, 16 keys x
//   16 queries x 64 channels per instruction, on K rows padded to whole tiles.
// - Scores are dequantized to float32 (acc * q_scale * k_scale + q.mu); masks, the online
//   softmax and the output are the float32 kernel's (key_tile_probabilities, write_output).
// - P*V: with AVX2 on 16-bit integers (kIntegerValues; with AVX512-BF16 on bfloat16 pairs
//   instead, kBf16Values), elsewhere in float32 (exact).
//   8-bit codes do not suit P: vpmaddubsw needs one unsigned and one signed operand with pairs
//   below 32768, so P would get 7 bits, an absolute step of 1/127 that rounds the many small
//   probabilities of a long, diffuse row to zero. vpmaddwd multiplies 16-bit pairs into exact
//   int32 sums and ran at 1.6x the FMA loop's multiply-adds on Zen 3 (one core, operands in
//   L1, 6 x 2 register blocks: 77 against 50 GMAC/s), so P gets 14 bits (P in [0, 1] times
//   16383: an absolute step of 6e-5, rounding errors carried from key to key) and V 11 bits
//   (per channel and key tile, scale max|v| / 1023), and 128-key passes keep the int32 sums
//   below 2^31 (kIntegerPvKeyChunk). That adds about 1e-3 (relative L1) to the output's error,
//   a tenth or less of what the 8-bit Q K^T costs. With VNNI, vpdpwssd fuses vpmaddwd and the
//   int32 add.
// Results are deterministic on one machine (for any thread count). Between variants they differ
// slightly: the float32 arithmetic that makes the codes rounds differently (FMA contraction,
// vector widths), so a value at a rounding boundary can get the neighbouring code.
//
// Packing (one item per (batch, kv-head) pair and key tile, fused: no separate pass over
// memory): the item reads the pair's queries for the channel factors (every item of a pair
// computes the same factors; each stores its own copy, so no two threads write one place), then
// the tile's K rows twice (the mean, then the codes; the second read comes from cache), and
// writes codes and per-key scales; V likewise (its per-channel maxima, then 16-bit codes in key
// pairs) with integer P*V, else V rows are packed like the float32 kernel's (16-bit types
// converted, non-contiguous rows copied) or read in place.
#pragma once
#ifndef NPU_ATTN_VEC_BYTES
#error "define NPU_ATTN_VEC_BYTES before including attention_int8_impl.h"
#endif

#include <cstdint>

#include "attention_forward_impl.h"

#if defined(__AMX_INT8__) || defined(NPU_ATTN_AMX_EMULATED)
#include "amx_tiles_impl.h"
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(NPU_ATTN_INT8_BF16_VALUES)
#include "bf16_pairs_impl.h"
#endif

namespace npu_attn {
namespace {

constexpr int kInt8ChannelsPerWord = 4;
constexpr float kCodeMax = 127.0f;  // codes in [-127, 127]: vpsignb/vpmaddubsw never saturate

// Integer registers of the variant's vector width: 32 bytes (AVX2, AVX-VNNI, and the tests'
// emulations) or 64 bytes (AVX512-BW: the avx512_vnni and amx_int8 variants, whose products,
// softmax and conversions then do twice the work per instruction).
#if defined(__AVX2__) && NPU_ATTN_VEC_BYTES == 32
#define NPU_ATTN_INT8_REGISTERS 1
typedef __m256i IReg;
NPU_ATTN_VEC_INLINE IReg load_ireg(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}
NPU_ATTN_VEC_INLINE IReg broadcast_word(uint32_t word) {
  return _mm256_set1_epi32(static_cast<int32_t>(word));
}
NPU_ATTN_VEC_INLINE IReg madd_words(IReg a, IReg b) {
  return _mm256_madd_epi16(a, b);
}
#elif defined(__AVX512BW__) && NPU_ATTN_VEC_BYTES == 64
#define NPU_ATTN_INT8_REGISTERS 1
typedef __m512i IReg;
NPU_ATTN_VEC_INLINE IReg load_ireg(const void* p) {
  return _mm512_loadu_si512(p);
}
NPU_ATTN_VEC_INLINE IReg broadcast_word(uint32_t word) {
  return _mm512_set1_epi32(static_cast<int32_t>(word));
}
NPU_ATTN_VEC_INLINE IReg madd_words(IReg a, IReg b) {
  return _mm512_madd_epi16(a, b);
}
#else
#define NPU_ATTN_INT8_REGISTERS 0
#endif
#if NPU_ATTN_INT8_REGISTERS
static_assert(sizeof(IReg) == sizeof(IVec), "one vector per register");
#endif

// P*V on 16-bit integers (vpmaddwd) where the variant has integer registers; float32 elsewhere.
constexpr bool kIntegerValues = NPU_ATTN_INT8_REGISTERS;
// P*V on bfloat16 pairs (vdpbf16ps) instead of 16-bit integer codes: the avx512_bf16 variant
// (NPU_ATTN_INT8_BF16_VALUES), whose exact bfloat16 kernel runs P*V on the same instruction.
// vpdpwssd does as many multiply-adds per instruction, so the codes bought nothing there; the
// bfloat16 pairs need no per-channel value scales, no carried rounding of P (bfloat16 keeps
// each probability's relative precision) and no int32 -> float32 step after 128-key passes.
// V and P are rounded to bfloat16 (to nearest even; bfloat16 inputs' V exactly): about 1e-3
// relative L1 on the output, like the 16-bit codes (ValueProductErrorAlone). Zen 4: 0.96x the
// avx512_vnni int8 kernel's time in float32, 0.95x in bfloat16. Not in amx_int8: on Sapphire
// Rapids vdpbf16ps runs at half the FMA rate.
#if defined(NPU_ATTN_INT8_BF16_VALUES)
#if !defined(__AVX512BF16__) || NPU_ATTN_VEC_BYTES != 64
#error "bfloat16 P*V is the 512-bit AVX512-BF16 variant's"
#endif
constexpr bool kBf16Values = true;
#else
constexpr bool kBf16Values = false;
#endif
// The integer products on VNNI units (vpdpbusd for Q K^T, vpdpwssd for P*V): the avx_vnni
// variant (VEX), the avx512_vnni and amx_int8 variants (EVEX, on zmm registers) and the tests'
// emulation of those instructions on AVX2 (tests/cpp/vnni_emulation.h).
#if defined(__AVX2__) && NPU_ATTN_VEC_BYTES == 32 && \
    (defined(__AVXVNNI__) || defined(NPU_ATTN_VNNI_EMULATED))
constexpr bool kVnniProducts = true;
NPU_ATTN_VEC_INLINE IReg dot_bytes(IReg acc, IReg unsigned_bytes, IReg signed_bytes) {
  return _mm256_dpbusd_avx_epi32(acc, unsigned_bytes, signed_bytes);
}
NPU_ATTN_VEC_INLINE IReg dot_words(IReg acc, IReg a, IReg b) {
  return _mm256_dpwssd_avx_epi32(acc, a, b);
}
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__) && NPU_ATTN_VEC_BYTES == 32
constexpr bool kVnniProducts = true;
NPU_ATTN_VEC_INLINE IReg dot_bytes(IReg acc, IReg unsigned_bytes, IReg signed_bytes) {
  return _mm256_dpbusd_epi32(acc, unsigned_bytes, signed_bytes);
}
NPU_ATTN_VEC_INLINE IReg dot_words(IReg acc, IReg a, IReg b) {
  return _mm256_dpwssd_epi32(acc, a, b);
}
#elif defined(__AVX512VNNI__) && NPU_ATTN_VEC_BYTES == 64
constexpr bool kVnniProducts = true;
NPU_ATTN_VEC_INLINE IReg dot_bytes(IReg acc, IReg unsigned_bytes, IReg signed_bytes) {
  return _mm512_dpbusd_epi32(acc, unsigned_bytes, signed_bytes);
}
NPU_ATTN_VEC_INLINE IReg dot_words(IReg acc, IReg a, IReg b) {
  return _mm512_dpwssd_epi32(acc, a, b);
}
#else
constexpr bool kVnniProducts = false;
#endif
// Q K^T on AMX tiles: tdpbssd multiplies signed by signed bytes, 16 keys x 16 queries x 64
// channels per instruction (the amx_int8 variant; in the tests, the software tile unit of
// tests/cpp/amx_emulation.h). K code rows are padded to whole tiles: 64 channels, 16 keys.
#if NPU_ATTN_INT8_REGISTERS && (defined(__AMX_INT8__) || defined(NPU_ATTN_AMX_EMULATED))
#define NPU_ATTN_INT8_TILES 1
constexpr bool kTileScores = true;
#else
#define NPU_ATTN_INT8_TILES 0
constexpr bool kTileScores = false;
#endif
constexpr int64_t kTileScoreRows = 16;   // keys per C tile; queries per C tile
constexpr int64_t kTileScoreWords = 16;  // code words (64 channels) per A row and B column

// vpdpbusd multiplies unsigned by signed bytes: Q's codes are stored with 128 added (each byte's
// top bit flipped), and 128 * sum(k codes) is subtracted from each key's sums. (Not with AMX
// tiles, whose tdpbssd takes signed bytes on both sides.)
constexpr bool kOffsetQueryCodes = kVnniProducts && !kTileScores;
constexpr uint32_t kQueryCodeOffset = kOffsetQueryCodes ? 0x80808080u : 0u;
constexpr int32_t kQueryCodeOffsetByte = 128;

constexpr int32_t kProbabilityCodeMax = 16383;  // P in [0, 1] -> [0, 16383]
constexpr int32_t kValueCodeLimit = 1023;       // V / scale in [-1023, 1023]
constexpr float kValueCodeMax = kValueCodeLimit;
// Keys per integer P*V pass: its int32 sums stay below 2^31 (each pair of keys adds at most
// 2 * 16384 * 1023), then go to the float32 O^T. 128-key passes ran at 77 GMAC/s, 64-key passes
// (which would allow 15-bit P) at 70 (Zen 3, one core, micro-benchmark): the int32 -> float32
// step after each pass is what the longer pass saves. Of the splits of the 31 bits, V's bits
// matter more: 14-bit P and 11-bit V differed from float32 P*V by 1.0e-3 (relative L1, Gaussian
// values), 15-bit P and 10-bit V by 1.9e-3.
constexpr int kIntegerPvKeyChunk = 128;
// (probability_code can give kProbabilityCodeMax + 1 where p = 1 meets a carry of 1/2.)
static_assert(int64_t{kIntegerPvKeyChunk} * (kProbabilityCodeMax + 1) * kValueCodeLimit <=
                  INT32_MAX,
              "integer P*V sums of one pass fit in int32");
constexpr int kKeysPerValueWord = 2;  // two 16-bit codes of consecutive keys per 32-bit word

// Aliasing views: codes and integer scores live in the float workspace.
typedef uint32_t AliasWord __attribute__((may_alias));
typedef int32_t AliasInt __attribute__((may_alias));

// ---------------------------------------------------------------- plan
struct Int8Plan {
  ForwardSchedule schedule;  // the driver's view (block_q: queries per task)
  Tiling fp;                 // the float32 side: block_k, P*V chunks, V packing, block_q
  int64_t words;             // 32-bit code words per K row and Q^T column: ceil(D / 4) (tiles: x16)
  int64_t key_rows;          // K code rows: len_k (tiles: rounded up to whole tiles of 16)
  bool integer_values;       // P*V on 16-bit integers (kIntegerValues): V packed as codes
  int64_t key_pairs;         // ceil(len_k / 2): 32-bit words per value channel
  // Offsets (in 4-byte units) of a pair's packed parts: K codes (len_k x words), K scales
  // (len_k), with VNNI the int32 offsets 128 * sum(codes) of each key (len_k), per key tile its
  // K means and the channel factors (2 x head_dim); then either V rows (float32 P*V) or V codes
  // (panels of kBlockRows channels x key_pairs words) and per key tile the value scales and
  // their inverses (2 x head_dim_v).
  int64_t key_scales, key_offsets, tile_stats, v_rows, v_codes, v_stats;
};

struct Int8Scratch {
  ThreadScratch fp;        // Q^T (float), S^T, O^T, m, l of the float32 kernel
  uint32_t* q_codes;       // words x block_q: 4 channels of one query per word
  float* q_scales;         // block_q
  float* q_dot_mean;       // block_q: q . mu of the current key tile
  float* inverse_factors;  // head_dim: 1 / c_d (quantize_queries)
};

template <typename T>
Int8Plan plan_int8(const AttentionParams& p, int threads) {
  Int8Plan plan{};
  plan.fp = plan_tiled<T>(p, threads);
  plan.fp.pack_k = false;  // K is always packed, as codes (below), never as float rows
  plan.fp.k_panels = false;
  plan.fp.schedule.block_q = query_tile_for(p, threads, false);  // Q^T and K as codes
  plan.integer_values = kIntegerValues;
  // Key tiles of whole C tiles (AMX: S^T holds the 16 rows of each) in every variant, so that
  // every variant smooths K over the same key tiles and their codes agree wherever their
  // arithmetic does (this also starts every tile on a key pair of the 16-bit V codes).
  static_assert(kMinQueryTile % kTileScoreRows == 0, "query tiles are whole C tiles");
  static_assert(kTileScoreRows % kKeysPerValueWord == 0, "key tiles start on a key pair");
  plan.fp.block_k = round_up(plan.fp.block_k, kTileScoreRows);
  if (plan.integer_values) {  // V as codes
    plan.fp.pack_v = false;
    plan.fp.v_panels = false;
    // bfloat16 pairs accumulate in float32: one pass over the whole key tile.
    plan.fp.pv_key_chunk = kBf16Values ? plan.fp.block_k : kIntegerPvKeyChunk;
  }
  ForwardSchedule& s = plan.schedule;
  s = plan.fp.schedule;
  plan.words =
      round_up(ceil_div(p.head_dim, kInt8ChannelsPerWord), kTileScores ? kTileScoreWords : 1);
  plan.key_rows = round_up(p.len_k, kTileScores ? kTileScoreRows : 1);
  plan.key_pairs = ceil_div(p.len_k, kKeysPerValueWord);
  const int64_t tiles = ceil_div(p.len_k, plan.fp.block_k);
  plan.key_scales = plan.key_rows * plan.words;
  plan.key_offsets = plan.key_scales + p.len_k;
  plan.tile_stats = plan.key_offsets + (kOffsetQueryCodes ? p.len_k : 0);
  plan.v_rows = plan.tile_stats + tiles * 2 * p.head_dim;
  plan.v_codes = plan.v_rows;
  plan.v_stats = plan.v_codes + ceil_div(p.head_dim_v, kBlockRows) * kBlockRows * plan.key_pairs;
  s.pack_tiles = tiles;
  // Value scales per key tile (tiles x 2 x head_dim_v) only for integer codes: bfloat16 pairs
  // carry their own exponents.
  const int64_t value_scale_floats = kBf16Values ? 0 : tiles * 2 * p.head_dim_v;
  s.pair_floats = plan.integer_values ? plan.v_stats + value_scale_floats
                                      : plan.v_rows + packed_v_floats(p, plan.fp);
  s.pairs_per_chunk = pairs_per_pack_budget(p, s.pair_floats, kPackBudgetBytes);
  s.scratch_floats =
      scratch_floats(p, s.block_q, plan.fp.block_k) + s.block_q * (plan.words + 2) + p.head_dim;
  return plan;
}

// The means of key tile `tile` and the channel factors (head_dim each) in a pair's pack.
float* tile_means(const AttentionParams& p, const Int8Plan& plan, float* pack, int64_t tile) {
  return pack + plan.tile_stats + tile * 2 * p.head_dim;
}
const float* channel_factors(const AttentionParams& p, const Int8Plan& plan, const float* pack) {
  return pack + plan.tile_stats + p.head_dim;  // key tile 0's copy (all copies are equal)
}

Int8Scratch carve_int8_scratch(const AttentionParams& p, const Int8Plan& plan, float* base) {
  Int8Scratch ws{};
  ws.fp = carve_scratch(p, plan.fp, base);
  const int64_t block_q = plan.schedule.block_q;
  float* rest = base + scratch_floats(p, block_q, plan.fp.block_k);
  ws.q_codes = reinterpret_cast<uint32_t*>(rest);
  ws.q_scales = rest + plan.words * block_q;
  ws.q_dot_mean = ws.q_scales + block_q;
  ws.inverse_factors = ws.q_dot_mean + block_q;
  return ws;
}

// ---------------------------------------------------------------- rounding
// Round to nearest (even) for |x| < 2^22 without a float->int conversion instruction: adding
// 1.5 * 2^23 leaves round(x) in the low mantissa bits.
constexpr float kRoundMagic = 12582912.0f;
constexpr int32_t kRoundMagicBits = 0x4B400000;

inline int32_t round_to_int(float x) {
  const float y = x + kRoundMagic;
  int32_t bits;
  __builtin_memcpy(&bits, &y, sizeof(bits));
  return bits - kRoundMagicBits;
}

NPU_ATTN_VEC_INLINE IVec round_to_int(Vec x) {
  const Vec y = x + splat(kRoundMagic);
  IVec bits;
  __builtin_memcpy(&bits, &y, sizeof(bits));
  return bits - kRoundMagicBits;
}

#if defined(NPU_ATTN_INT8_BF16_VALUES)
// P's and V's bfloat16 pairs (pack_pairs, shared with the exact bfloat16 kernels).
NPU_ATTN_VEC_INLINE UVec bf16_pairs(Vec lo, Vec hi) {
  return (UVec)pack_pairs((__m512)lo, (__m512)hi);
}
#endif

// ---------------------------------------------------------------- packing K
// The packing loops run along the head dim, kLanes channels at a time (a scalar tail), reading
// any channel stride: with the scalar loops they were a third of a short call's time (SD-1.5
// 8x8: 64 keys, head dim 160).

// Channels [d, d + kLanes) of a row whose channels are `sd` elements apart, as floats.
template <typename T>
NPU_ATTN_VEC_INLINE Vec load_channels(const T* row, int64_t sd, int64_t d) {
  if (sd == 1) return load_as_float(row + d);
  Vec x;
  for (int i = 0; i < kLanes; ++i) x[i] = to_float(row[(d + i) * sd]);
  return x;
}

NPU_ATTN_VEC_INLINE Vec abs_value(Vec x) {
  return x < 0.0f ? -x : x;
}
NPU_ATTN_VEC_INLINE float abs_value(float x) {
  return x < 0.0f ? -x : x;
}

// The largest lane, skipping NaN (NaN is carried separately as `non_finite`).
NPU_ATTN_VEC_INLINE float max_lane(Vec x) {
  float m = 0.0f;
  for (int i = 0; i < kLanes; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// The channel factors c_d of one (batch, kv-head) pair from its queries (every q-head of its
// GQA group), into `factors`: sqrt(max|q_d| / mean_d max|q_d|); 1 where Q is all zero.
template <typename T>
void compute_channel_factors(const AttentionParams& p, int64_t pair, float* factors) {
  const int64_t b = pair / p.heads_kv, hkv = pair % p.heads_kv, group = p.heads_q / p.heads_kv;
  const int64_t dim = p.head_dim, full = dim / kLanes * kLanes, sd = p.q_stride[3];
  for (int64_t d = 0; d < dim; ++d) factors[d] = 0.0f;
  for (int64_t h = hkv * group; h < (hkv + 1) * group; ++h) {
    const T* q_head = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
    for (int64_t i = 0; i < p.len_q; ++i) {
      const T* row = q_head + i * p.q_stride[2];
      int64_t d = 0;
      for (; d < full; d += kLanes) {  // skips NaN: it reaches S through q.mu
        const Vec ax = abs_value(load_channels(row, sd, d)), f = load(factors + d);
        store(factors + d, ax > f ? ax : f);
      }
      for (; d < dim; ++d) {
        const float ax = abs_value(to_float(row[d * sd]));
        factors[d] = ax > factors[d] ? ax : factors[d];
      }
    }
  }
  float mean = 0.0f;
  for (int64_t d = 0; d < dim; ++d) mean += factors[d];
  mean /= static_cast<float>(dim);
  for (int64_t d = 0; d < dim; ++d) {
    const float ratio = factors[d] / mean;
    factors[d] = ratio > 0.0f && ratio < __builtin_inff() ? __builtin_sqrtf(ratio) : 1.0f;
  }
}

// The per-channel mean of rows [first, end) into `mean` (dim floats).
template <typename T>
void channel_means(const T* rows, int64_t sj, int64_t sd, int64_t dim, int64_t first, int64_t end,
                   float* mean) {
  const int64_t full = dim / kLanes * kLanes;
  for (int64_t d = 0; d < dim; ++d) mean[d] = 0.0f;
  for (int64_t j = first; j < end; ++j) {
    const T* row = rows + j * sj;
    int64_t d = 0;
    for (; d < full; d += kLanes) store(mean + d, load(mean + d) + load_channels(row, sd, d));
    for (; d < dim; ++d) mean[d] += to_float(row[d * sd]);
  }
  const float inv_count = 1.0f / static_cast<float>(end - first);
  for (int64_t d = 0; d < dim; ++d) mean[d] *= inv_count;
}

// One K row's codes of (k - mu) * c (channel order, a byte each; zero past the head dim up to
// `bytes`), returning its scale max |(k - mu) * c| / 127, NaN if the row holds NaN or inf: a
// non-finite key makes its scores NaN, as in exact attention (the codes cannot carry it).
template <typename T>
float quantize_key_row(const T* row, int64_t sd, int64_t dim, const float* mean,
                       const float* factor, int64_t bytes, int8_t* codes) {
  const int64_t full = dim / kLanes * kLanes;
  Vec vmax = splat(0.0f), v_non_finite = splat(0.0f);
  int64_t d = 0;
  for (; d < full; d += kLanes) {
    const Vec x = (load_channels(row, sd, d) - load(mean + d)) * load(factor + d);
    const Vec ax = abs_value(x);
    vmax = ax > vmax ? ax : vmax;
    v_non_finite += x * splat(0.0f);
  }
  float amax = max_lane(vmax), non_finite = sum_lanes(v_non_finite);
  for (; d < dim; ++d) {
    const float x = (to_float(row[d * sd]) - mean[d]) * factor[d];
    amax = abs_value(x) > amax ? abs_value(x) : amax;
    non_finite += x * 0.0f;
  }
  const float inv = amax > 0.0f ? kCodeMax / amax : 0.0f;
  typedef int8_t ByteVec __attribute__((vector_size(kLanes)));
  for (d = 0; d < full; d += kLanes) {
    const Vec x = (load_channels(row, sd, d) - load(mean + d)) * load(factor + d);
    const ByteVec code = __builtin_convertvector(round_to_int(x * splat(inv)), ByteVec);
    __builtin_memcpy(codes + d, &code, sizeof(code));
  }
  for (; d < dim; ++d)
    codes[d] =
        static_cast<int8_t>(round_to_int((to_float(row[d * sd]) - mean[d]) * factor[d] * inv));
  for (; d < bytes; ++d) codes[d] = 0;
  return amax / kCodeMax + non_finite;
}

// Keys [tile * block_k, + block_k) of one pair: the tile's channel means and the pair's channel
// factors, then each key's codes of (k - mu) * c (4 per word) and its scale.
template <typename T>
void pack_int8_key_tile(const AttentionParams& p, const Int8Plan& plan, int64_t pair, int64_t tile,
                        float* packed) {
  const int64_t b = pair / p.heads_kv, hkv = pair % p.heads_kv;
  const int64_t k0 = tile * plan.fp.block_k, end = min_i64(k0 + plan.fp.block_k, p.len_k);
  const T* k_rows = static_cast<const T*>(p.k) + b * p.k_stride[0] + hkv * p.k_stride[1];
  const int64_t sj = p.k_stride[2], sd = p.k_stride[3], dim = p.head_dim;
  float* mean = tile_means(p, plan, packed, tile);
  float* factor = mean + dim;
  compute_channel_factors<T>(p, pair, factor);
  channel_means(k_rows, sj, sd, dim, k0, end, mean);
  float* scales = packed + plan.key_scales;
  const int64_t row_bytes = plan.words * kInt8ChannelsPerWord;
  AliasInt* offsets = reinterpret_cast<AliasInt*>(packed + plan.key_offsets);
  for (int64_t j = k0; j < end; ++j) {
    int8_t* codes = reinterpret_cast<int8_t*>(packed + j * plan.words);  // little-endian words
    scales[j] = quantize_key_row(k_rows + j * sj, sd, dim, mean, factor, row_bytes, codes);
    if (kOffsetQueryCodes) {  // what Q's +128 adds to this key's sums
      int32_t sum = 0;
      for (int64_t i = 0; i < row_bytes; ++i) sum += codes[i];
      offsets[j] = kQueryCodeOffsetByte * sum;
    }
  }
  if (end == p.len_k) {  // the rows that pad the last C tile: zero codes (tiles only)
    for (int64_t i = p.len_k * plan.words; i < plan.key_rows * plan.words; ++i) packed[i] = 0.0f;
  }
}

// ---------------------------------------------------------------- packing V (integer P*V)
// With kBf16Values: keys [k0, end) of V as bfloat16 pairs in the code layout (word (g, key
// pair, r) holds channel 6g + r of both keys, the later key in the high half; 0 past the last
// key and in the padding channels of the last panel). No scales: bfloat16 carries each value's
// own exponent (NaN and inf too).
template <typename T>
void pack_value_pairs(const AttentionParams& p, const Int8Plan& plan, const T* v_rows, int64_t sj,
                      int64_t sd, int64_t k0, int64_t end, float* packed) {
#if defined(NPU_ATTN_INT8_BF16_VALUES)
  const int64_t dim = p.head_dim_v, full = dim / kLanes * kLanes;
  const int64_t panels = ceil_div(dim, kBlockRows), panel_stride = plan.key_pairs * kBlockRows;
  AliasWord* codes = reinterpret_cast<AliasWord*>(packed + plan.v_codes);
  for (int64_t j = k0; j < end; j += kKeysPerValueWord) {
    const T* first = v_rows + j * sj;
    const T* second = j + 1 < end ? first + sj : nullptr;
    AliasWord* pair_words = codes + j / kKeysPerValueWord * kBlockRows;
    auto put = [&](int64_t d, uint32_t word) {
      pair_words[d / kBlockRows * panel_stride + d % kBlockRows] = word;
    };
    int64_t d = 0;
    for (; d < full; d += kLanes) {
      const Vec lo = load_channels(first, sd, d);
      const UVec word = bf16_pairs(lo, second ? load_channels(second, sd, d) : splat(0.0f));
      for (int i = 0; i < kLanes; ++i) put(d + i, word[i]);
    }
    if (d < dim) {  // the ragged channels through one vector, zero-padded
      Vec lo = splat(0.0f), hi = splat(0.0f);
      for (int64_t c = d; c < dim; ++c) {
        lo[c - d] = to_float(first[c * sd]);
        hi[c - d] = second ? to_float(second[c * sd]) : 0.0f;
      }
      const UVec word = bf16_pairs(lo, hi);
      for (int64_t c = d; c < dim; ++c) put(c, word[c - d]);
      d = dim;
    }
    for (; d < panels * kBlockRows; ++d) put(d, 0);
  }
#else
  (void)p, (void)plan, (void)v_rows, (void)sj, (void)sd, (void)k0, (void)end, (void)packed;
  __builtin_unreachable();  // only with kBf16Values
#endif
}

// Keys [tile * block_k, + block_k) of one pair's V: per channel d its scale max|v_d| / 1023
// over the tile's keys (NaN if a value is NaN or inf: the codes cannot carry it, and the scale
// makes that channel NaN for every query, as exact attention does) and the scale's inverse,
// then 16-bit codes: word (g, key pair, r) holds channel 6g + r of both keys of the pair (the
// later key in the high half; 0 past the last key and in the padding channels of the last
// panel), so the product broadcasts six consecutive words per key pair.
template <typename T>
void pack_value_codes(const AttentionParams& p, const Int8Plan& plan, int64_t pair, int64_t tile,
                      float* packed) {
  const int64_t b = pair / p.heads_kv, hkv = pair % p.heads_kv, dim = p.head_dim_v;
  const int64_t full = dim / kLanes * kLanes;
  const int64_t k0 = tile * plan.fp.block_k, end = min_i64(k0 + plan.fp.block_k, p.len_k);
  const T* v_rows = static_cast<const T*>(p.v) + b * p.v_stride[0] + hkv * p.v_stride[1];
  const int64_t sj = p.v_stride[2], sd = p.v_stride[3];
  if constexpr (kBf16Values) {
    pack_value_pairs(p, plan, v_rows, sj, sd, k0, end, packed);
    return;
  }
  float* scale = packed + plan.v_stats + tile * 2 * dim;
  float* inverse = scale + dim;
  for (int64_t d = 0; d < dim; ++d) scale[d] = inverse[d] = 0.0f;  // max |v|, NaN if non-finite
  for (int64_t j = k0; j < end; ++j) {
    const T* row = v_rows + j * sj;
    int64_t d = 0;
    for (; d < full; d += kLanes) {
      const Vec x = load_channels(row, sd, d), ax = abs_value(x), m = load(scale + d);
      store(scale + d, ax > m ? ax : m);
      store(inverse + d, load(inverse + d) + x * splat(0.0f));
    }
    for (; d < dim; ++d) {
      const float x = to_float(row[d * sd]);
      scale[d] = abs_value(x) > scale[d] ? abs_value(x) : scale[d];
      inverse[d] += x * 0.0f;
    }
  }
  for (int64_t d = 0; d < dim; ++d) {
    const float amax = scale[d], non_finite = inverse[d];
    inverse[d] = amax > 0.0f ? kValueCodeMax / amax : 0.0f;
    scale[d] = amax / kValueCodeMax + non_finite;
  }
  AliasWord* codes = reinterpret_cast<AliasWord*>(packed + plan.v_codes);
  const int64_t panels = ceil_div(dim, kBlockRows);
  for (int64_t j = k0; j < end; j += kKeysPerValueWord) {
    const T* first = v_rows + j * sj;
    const T* second = j + 1 < end ? first + sj : nullptr;
    AliasWord* pair_words = codes + j / kKeysPerValueWord * kBlockRows;  // + panel * panel stride
    const int64_t panel_stride = plan.key_pairs * kBlockRows;
    auto put = [&](int64_t d, uint32_t word) {
      pair_words[d / kBlockRows * panel_stride + d % kBlockRows] = word;
    };
    int64_t d = 0;
    for (; d < full; d += kLanes) {
      const Vec inv = load(inverse + d);
      const UVec lo = (UVec)round_to_int(load_channels(first, sd, d) * inv);
      const UVec hi = second ? (UVec)round_to_int(load_channels(second, sd, d) * inv) : UVec{};
      const UVec word = (lo & 0xFFFFu) | (hi << 16);
      for (int i = 0; i < kLanes; ++i) put(d + i, word[i]);
    }
    for (; d < dim; ++d) {
      const uint32_t lo = round_to_int(to_float(first[d * sd]) * inverse[d]);
      const uint32_t hi = second ? round_to_int(to_float(second[d * sd]) * inverse[d]) : 0;
      put(d, (lo & 0xFFFFu) | (hi << 16));
    }
    for (; d < panels * kBlockRows; ++d) put(d, 0);
  }
}

// ---------------------------------------------------------------- quantizing Q
// Q^T (float, scaled, zero in padding lanes) divided by the channel factors, to codes: per query
// (lane), scale = max |q / c| / 127; word w of a query holds its channels 4w..4w+3 (padding
// channels: code 0), each plus 128 with VNNI (kQueryCodeOffset).
void quantize_queries(const AttentionParams& p, const Int8Plan& plan, const float* factors,
                      const QueryTile& tile, Int8Scratch& ws) {
  const int64_t ld = plan.schedule.block_q;
  float* inverse = ws.inverse_factors;  // one division per channel, not per element
  for (int64_t d = 0; d < p.head_dim; ++d) inverse[d] = 1.0f / factors[d];
  for (int64_t v = 0; v < tile.vecs; ++v) {
    Vec amax = splat(0.0f), non_finite = splat(0.0f);  // NaN in lanes holding NaN or inf
    for (int64_t d = 0; d < p.head_dim; ++d) {
      const Vec x = load(ws.fp.qt + d * ld + v * kLanes) * splat(inverse[d]);
      const Vec ax = abs_value(x);
      amax = ax > amax ? ax : amax;
      non_finite += x * splat(0.0f);
    }
    const Vec inv = amax > 0.0f ? splat(kCodeMax) / amax : splat(0.0f);
    store(ws.q_scales + v * kLanes, amax / splat(kCodeMax) + non_finite);
    for (int64_t w = 0; w < plan.words; ++w) {
      UVec word = UVec{};
      for (int i = 0; i < kInt8ChannelsPerWord; ++i) {
        const int64_t d = w * kInt8ChannelsPerWord + i;
        if (d >= p.head_dim) break;
        const Vec x = load(ws.fp.qt + d * ld + v * kLanes) * splat(inverse[d]);
        const UVec code = (UVec)round_to_int(x * inv);
        word |= (code & 0xFFu) << (8 * i);
      }
      word ^= kQueryCodeOffset;  // top bit of each byte: + 128 (mod 256) for codes in [-127, 127]
      __builtin_memcpy(ws.q_codes + w * ld + v * kLanes, &word, sizeof(word));
    }
  }
}

// ---------------------------------------------------------------- the integer product
// acc[j][q] = sum_w dot4(k_codes[j][w] (signed), q_codes[w][q] (unsigned)) for `keys` keys and
// `vecs` vectors of queries, dequantized as it leaves the registers into S^T (ld apart):
// s = acc * k_scale[j] * q_scale[q] + q.mu[q]. (Against a separate pass over S^T after the
// product: A/B 0.988 geomean over 11 named shapes, 0.969 at SD-1.5 64x64, bit-identical.)
struct ScoreScales {
  const float* k_scale;     // per key, from the first key of the product
  const int32_t* k_offset;  // per key, with VNNI: 128 * sum of its codes (kQueryCodeOffset)
  const float* q_scale;     // per query
  const float* q_dot_mean;  // per query: q . mu of the key tile
  ScoreScales at(int64_t key, int64_t query) const {
    return {k_scale + key, k_offset + key, q_scale + query, q_dot_mean + query};
  }
};

NPU_ATTN_VEC_INLINE Vec dequantized(IVec acc, float k_scale, const float* q_scale,
                                    const float* q_dot_mean) {
  return __builtin_convertvector(acc, Vec) * (splat(k_scale) * load(q_scale)) + load(q_dot_mean);
}

// Key r's sums (from the first key of `sc`) as the AVX2 scheme would make them: without Q's
// offset.
NPU_ATTN_VEC_INLINE IVec without_query_offset(IVec acc, const ScoreScales& sc, int r) {
  if (kOffsetQueryCodes) return acc - sc.k_offset[r];
  return acc;
}

#if NPU_ATTN_INT8_TILES
// On AMX tiles: per 16 keys, C tiles of 16 keys x 16 queries (int32) from A = the keys' code rows
// (16 words = 64 channels per load; K rows are padded to whole tiles, plan_int8) and B = 16 word
// rows of Q codes (ld apart, 16 queries each). The int32 sums are stored into S^T (ld is 16, 32
// or 64: whole C tiles) and dequantized in place while they are in L1. Columns past the tile's
// queries get sums of stale codes that nothing reads.
void int8_scores(const AliasWord* k_codes, int64_t words, const uint32_t* q_codes, int64_t ld,
                 int64_t keys, int64_t vecs, const ScoreScales& sc, float* st) {
  const int64_t queries = round_up(vecs * kLanes, kTileScoreRows);
  const int64_t a_stride = words * 4, b_stride = ld * 4;  // bytes
  for (int64_t j = 0; j < keys; j += kTileScoreRows) {
    for (int64_t i = 0; i < queries; i += kTileScoreRows) {
      _tile_zero(0);
      for (int64_t w = 0; w < words; w += kTileScoreWords) {
        _tile_loadd(4, k_codes + j * words + w, a_stride);
        _tile_loadd(6, q_codes + w * ld + i, b_stride);
        _tile_dpbssd(0, 4, 6);
      }
      _tile_stored(0, st + j * ld + i, b_stride);
    }
    for (int64_t r = j; r < min_i64(j + kTileScoreRows, keys); ++r) {
      for (int64_t v = 0; v < vecs; ++v) {
        IVec acc;
        __builtin_memcpy(&acc, st + r * ld + v * kLanes, sizeof(acc));
        store(st + r * ld + v * kLanes,
              dequantized(acc, sc.k_scale[r], sc.q_scale + v * kLanes, sc.q_dot_mean + v * kLanes));
      }
    }
  }
}
#elif NPU_ATTN_INT8_REGISTERS
// Register blocks of 4 keys x 2 query vectors: 8 accumulators, 2 Q words, the K broadcast and
// its absolute value, the vpmaddwd ones and two temporaries fit AVX2's 16 ymm registers. (With
// VNNI the block keeps this shape; zmm registers take 4 x 4: kScoreBlockVecs.)
static_assert(kVecBytes == 32 || kVnniProducts,
              "int8 scores on zmm registers need VNNI: AVX-512 has no vpsignb");
template <int Rows, int Cols>
NPU_ATTN_VEC_INLINE void int8_block(const AliasWord* k, int64_t words, const uint32_t* q,
                                    int64_t ld, const ScoreScales& sc, float* out) {
  IVec acc[Rows][Cols];
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) acc[r][c] = IVec{};
  for (int64_t w = 0; w < words; ++w) {
    IReg qv[Cols];
    for (int c = 0; c < Cols; ++c) qv[c] = load_ireg(q + w * ld + c * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const IReg kb = broadcast_word(k[r * words + w]);
      if constexpr (kVnniProducts) {
        // (q + 128) (unsigned) x k (signed), four products per int32 lane
        for (int c = 0; c < Cols; ++c) acc[r][c] = (IVec)dot_bytes((IReg)acc[r][c], qv[c], kb);
      } else {
#if NPU_ATTN_VEC_BYTES == 32
        const __m256i ones = _mm256_set1_epi16(1);
        const __m256i k_abs = _mm256_abs_epi8(kb);
        for (int c = 0; c < Cols; ++c) {
          // |k| (unsigned) x q * sign(k) (signed): pairs <= 2 * 127 * 127, no saturation
          const __m256i pairs = _mm256_maddubs_epi16(k_abs, _mm256_sign_epi8(qv[c], kb));
          acc[r][c] += (IVec)_mm256_madd_epi16(pairs, ones);
        }
#endif
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c)
      store(out + r * ld + c * kLanes,
            dequantized(without_query_offset(acc[r][c], sc, r), sc.k_scale[r],
                        sc.q_scale + c * kLanes, sc.q_dot_mean + c * kLanes));
}

// Register blocks of 4 keys x 4 query vectors on zmm registers (32 of them), x 2 on ymm (16).
// On Sapphire Rapids (avx512_vnni, float32, 17 named shapes) 4 x 4 took 0.967x the time of
// 4 x 2 and 6 x 4 0.996x.
constexpr int kScoreBlockKeys = 4;
constexpr int kScoreBlockVecs = kVecBytes == 64 ? 4 : 2;

template <int Rows>
NPU_ATTN_VEC_INLINE void int8_row_block(const AliasWord* k, int64_t words, const uint32_t* q,
                                        int64_t ld, int64_t vecs, const ScoreScales& sc,
                                        float* out) {
  int64_t v = 0;
  for (; v + kScoreBlockVecs <= vecs; v += kScoreBlockVecs)
    int8_block<Rows, kScoreBlockVecs>(k, words, q + v * kLanes, ld, sc.at(0, v * kLanes),
                                      out + v * kLanes);
  for (; v < vecs; ++v)
    int8_block<Rows, 1>(k, words, q + v * kLanes, ld, sc.at(0, v * kLanes), out + v * kLanes);
}

void int8_scores(const AliasWord* k_codes, int64_t words, const uint32_t* q_codes, int64_t ld,
                 int64_t keys, int64_t vecs, const ScoreScales& sc, float* st) {
  int64_t j = 0;
  for (; j + kScoreBlockKeys <= keys; j += kScoreBlockKeys)
    int8_row_block<kScoreBlockKeys>(k_codes + j * words, words, q_codes, ld, vecs, sc.at(j, 0),
                                    st + j * ld);
  for (; j < keys; ++j)
    int8_row_block<1>(k_codes + j * words, words, q_codes, ld, vecs, sc.at(j, 0), st + j * ld);
}
#else
// Portable: the same integer sums in plain C++ (vectorised by the compiler along queries).
void int8_scores(const AliasWord* k_codes, int64_t words, const uint32_t* q_codes, int64_t ld,
                 int64_t keys, int64_t vecs, const ScoreScales& sc, float* st) {
  const int64_t lanes = vecs * kLanes;
  for (int64_t j = 0; j < keys; ++j) {
    AliasInt* row = reinterpret_cast<AliasInt*>(st + j * ld);
    for (int64_t i = 0; i < lanes; ++i) row[i] = 0;
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t kw = k_codes[j * words + w];
      const int32_t k0 = static_cast<int8_t>(kw), k1 = static_cast<int8_t>(kw >> 8);
      const int32_t k2 = static_cast<int8_t>(kw >> 16), k3 = static_cast<int8_t>(kw >> 24);
      const uint32_t* qw = q_codes + w * ld;
      for (int64_t i = 0; i < lanes; ++i) {
        const uint32_t x = qw[i];
        row[i] += static_cast<int8_t>(x) * k0 + static_cast<int8_t>(x >> 8) * k1 +
                  static_cast<int8_t>(x >> 16) * k2 + static_cast<int8_t>(x >> 24) * k3;
      }
    }
    for (int64_t v = 0; v < vecs; ++v) {
      IVec acc;
      __builtin_memcpy(&acc, row + v * kLanes, sizeof(acc));
      store(st + j * ld + v * kLanes,
            dequantized(acc, sc.k_scale[j], sc.q_scale + v * kLanes, sc.q_dot_mean + v * kLanes));
    }
  }
}
#endif

// ---------------------------------------------------------------- integer P*V
#if NPU_ATTN_INT8_REGISTERS
// P^T (float32, keys x queries, in S^T) to 16-bit codes in place: word row jp holds keys 2jp
// (low half) and 2jp + 1 (high half; 0 past the last key) of every query. Row jp overwrites
// row jp <= 2jp after rows 2jp and 2jp + 1 were read. A NaN probability gives some code: its
// query's sum l is NaN then, and so is its output.
// Each query's rounding error is carried to its next key (error diffusion), so the codes of any
// run of keys sum to their probabilities' sum within one code. Plain rounding can bias a long
// tail of similar small probabilities (0.74 -> 1 for every key of the tail), and values sharing
// an offset turn that into an output error (5% in ALongTailOfSmallProbabilitiesKeepsItsWeight).
// The code is round(x) in the low bits of x + kRoundMagic (round_to_int without its integer
// subtraction): the word packing below keeps only the low 16 bits, which hold the code itself.
// No clamps: p in [0, 1] and a carry in [-1/2, 1/2] keep x in [-1/2, kProbabilityCodeMax + 1/2],
// so codes are 0 to kProbabilityCodeMax + 1 (a tie at p = 1), within the int32 sums' bound.
// The carry's chain per key is then one FMA and three adds (with the clamps and a conversion
// back it was six operations longer).
NPU_ATTN_VEC_INLINE UVec probability_code(Vec p, Vec& carry) {
  const Vec x = p * splat(static_cast<float>(kProbabilityCodeMax)) + carry;
  const Vec shifted = x + splat(kRoundMagic);
  carry = x - (shifted - splat(kRoundMagic));
  UVec bits;
  __builtin_memcpy(&bits, &shifted, sizeof(bits));
  return bits;
}

// With kBf16Values: P^T to bfloat16 pairs in place, in the codes' word rows (rounded to
// nearest even, no carried error).
void probability_pairs(float* st, int64_t ld, int64_t keys, int64_t vecs) {
#if defined(NPU_ATTN_INT8_BF16_VALUES)
  for (int64_t jp = 0; jp * kKeysPerValueWord < keys; ++jp) {
    const float* first = st + kKeysPerValueWord * jp * ld;
    const bool has_second = kKeysPerValueWord * jp + 1 < keys;
    for (int64_t v = 0; v < vecs; ++v) {
      const UVec word = bf16_pairs(load(first + v * kLanes),
                                   has_second ? load(first + ld + v * kLanes) : splat(0.0f));
      __builtin_memcpy(st + jp * ld + v * kLanes, &word, sizeof(word));
    }
  }
#else
  (void)st, (void)ld, (void)keys, (void)vecs;
  __builtin_unreachable();  // only with kBf16Values
#endif
}

void quantize_probabilities(float* st, int64_t ld, int64_t keys, int64_t vecs) {
  Vec carry[kTileQueryVecs];
  for (int64_t v = 0; v < vecs; ++v) carry[v] = splat(0.0f);
  for (int64_t jp = 0; jp * kKeysPerValueWord < keys; ++jp) {
    const float* first = st + kKeysPerValueWord * jp * ld;
    const bool has_second = kKeysPerValueWord * jp + 1 < keys;
    for (int64_t v = 0; v < vecs; ++v) {
      const UVec lo = probability_code(load(first + v * kLanes), carry[v]);
      const UVec hi =
          has_second ? probability_code(load(first + ld + v * kLanes), carry[v]) : UVec{};
      const UVec word = (lo & 0xFFFFu) | (hi << 16);
      __builtin_memcpy(st + jp * ld + v * kLanes, &word, sizeof(word));
    }
  }
}

// O^T rows [6g, 6g + rows) (ld apart) += scale[r] * sum over `pairs` key pairs of the value
// codes (one panel, six words per key pair) times the probability codes of Cols vectors of
// queries (pw, one word row per key pair): 6 x Cols int32 accumulators, like the float32 6 x 2
// register blocks. The accumulators are GCC vector types, not IReg: with __m256i arrays
// GCC 12 kept half of them on the stack (46 instead of 77 GMAC/s in a micro-benchmark). With
// `prefetch_panel`, the next panel's words for the same key pairs are prefetched into L2 on the
// way (as broadcast_fma_panels does for the float32 kernel).
template <int Cols>
NPU_ATTN_VEC_INLINE void int16_value_block(const AliasWord* panel, const uint32_t* pw, int64_t ld,
                                           int64_t pairs, const float* scale, int64_t rows,
                                           float* ot, const AliasWord* prefetch_panel) {
#if defined(NPU_ATTN_INT8_BF16_VALUES)
  if constexpr (kBf16Values) {  // the same block on bfloat16 pairs, float32 sums (no scales)
    (void)scale;
    __m512 acc[kBlockRows][Cols];
#pragma GCC unroll 8
    for (int r = 0; r < kBlockRows; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < Cols; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t jp = 0; jp < pairs; ++jp) {
      prefetch_next_panel(prefetch_panel, jp, kBlockRows);
      __m512bh pv[Cols];
#pragma GCC unroll 4
      for (int c = 0; c < Cols; ++c) pv[c] = (__m512bh)load_ireg(pw + jp * ld + c * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < kBlockRows; ++r) {
        const __m512bh v = (__m512bh)broadcast_word(panel[jp * kBlockRows + r]);
#pragma GCC unroll 4
        for (int c = 0; c < Cols; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v, pv[c]);
      }
    }
    for (int64_t r = 0; r < rows; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < Cols; ++c) {
        float* o = ot + r * ld + c * kLanes;
        store(o, load(o) + (Vec)acc[r][c]);
      }
    return;
  }
#endif
  IVec acc[kBlockRows][Cols];
#pragma GCC unroll 8
  for (int r = 0; r < kBlockRows; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < Cols; ++c) acc[r][c] = IVec{};
  for (int64_t jp = 0; jp < pairs; ++jp) {
    prefetch_next_panel(prefetch_panel, jp, kBlockRows);
    IReg pv[Cols];
#pragma GCC unroll 4
    for (int c = 0; c < Cols; ++c) pv[c] = load_ireg(pw + jp * ld + c * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < kBlockRows; ++r) {
      const IReg v = broadcast_word(panel[jp * kBlockRows + r]);
#pragma GCC unroll 4
      for (int c = 0; c < Cols; ++c) {
        if constexpr (kVnniProducts) {
          acc[r][c] = (IVec)dot_words((IReg)acc[r][c], v, pv[c]);
        } else {
          acc[r][c] += (IVec)madd_words(v, pv[c]);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < Cols; ++c) {
      float* o = ot + r * ld + c * kLanes;
      store(o, load(o) + __builtin_convertvector(acc[r][c], Vec) * splat(scale[r]));
    }
}

// Query vectors per P*V register block: 6 x 4 accumulators on zmm registers (32 of them): on
// Sapphire Rapids (amx_int8, float32, 17 named shapes) 0.95x the time of 6 x 2.
constexpr int kValueBlockVecs = kVecBytes == 64 ? 4 : 2;

// O^T += V_tile^T P^T for keys [k0, k0 + keys) of key tile `key_tile` on 16-bit codes.
void accumulate_integer_values(const AttentionParams& p, const Int8Plan& plan,
                               const float* pair_pack, const QueryTile& tile, int64_t k0,
                               int64_t keys, int64_t key_tile, Int8Scratch& ws) {
  const int64_t ld = plan.schedule.block_q, dim = p.head_dim_v;
  if constexpr (kBf16Values) {
    probability_pairs(ws.fp.st, ld, keys, tile.vecs);
  } else {
    quantize_probabilities(ws.fp.st, ld, keys, tile.vecs);
  }
  const AliasWord* codes = reinterpret_cast<const AliasWord*>(pair_pack + plan.v_codes);
  const float* value_scale = pair_pack + plan.v_stats + key_tile * 2 * dim;
  const uint32_t* p_words = reinterpret_cast<const uint32_t*>(ws.fp.st);
  const int64_t chunk = plan.fp.pv_key_chunk;  // kIntegerPvKeyChunk (plan_int8): sums fit int32
  for (int64_t j0 = 0; j0 < keys; j0 += chunk) {
    const int64_t pairs = ceil_div(min_i64(chunk, keys - j0), kKeysPerValueWord);
    const uint32_t* pw = p_words + j0 / kKeysPerValueWord * ld;
    for (int64_t g = 0; g * kBlockRows < dim; ++g) {
      const AliasWord* panel =
          codes + (g * plan.key_pairs + (k0 + j0) / kKeysPerValueWord) * kBlockRows;
      const AliasWord* next_panel =
          (g + 1) * kBlockRows < dim ? panel + plan.key_pairs * kBlockRows : nullptr;
      const int64_t rows = min_i64(kBlockRows, dim - g * kBlockRows);
      float scale[kBlockRows];
      for (int64_t r = 0; r < rows && !kBf16Values; ++r)
        scale[r] = value_scale[g * kBlockRows + r] * (1.0f / kProbabilityCodeMax);
      float* ot = ws.fp.ot + g * kBlockRows * ld;
      int64_t v = 0;
      for (; v + kValueBlockVecs <= tile.vecs; v += kValueBlockVecs)
        int16_value_block<kValueBlockVecs>(panel, pw + v * kLanes, ld, pairs, scale, rows,
                                           ot + v * kLanes, v == 0 ? next_panel : nullptr);
      for (; v < tile.vecs; ++v)
        int16_value_block<1>(panel, pw + v * kLanes, ld, pairs, scale, rows, ot + v * kLanes,
                             v == 0 ? next_panel : nullptr);
    }
  }
}
#else
void accumulate_integer_values(const AttentionParams&, const Int8Plan&, const float*,
                               const QueryTile&, int64_t, int64_t, int64_t, Int8Scratch&) {
  __builtin_unreachable();  // plan_int8 chooses integer P*V only where kIntegerValues
}
#endif

// ---------------------------------------------------------------- dequantizing
// q . mu per query (float32) for key tile `key_tile`: the part of each score the smoothing
// subtracted from K.
void query_dot_means(const AttentionParams& p, const Int8Plan& plan, const float* pair_pack,
                     const QueryTile& tile, int64_t key_tile, Int8Scratch& ws) {
  const int64_t ld = plan.schedule.block_q;
  const float* mean = pair_pack + plan.tile_stats + key_tile * 2 * p.head_dim;
  for (int64_t v = 0; v < tile.vecs; ++v) {
    Vec dot = splat(0.0f);
    for (int64_t d = 0; d < p.head_dim; ++d)
      dot += load(ws.fp.qt + d * ld + v * kLanes) * splat(mean[d]);
    store(ws.q_dot_mean + v * kLanes, dot);
  }
}

// ---------------------------------------------------------------- one task
// The float32 V rows of float32 P*V (no kIntegerValues): packed, or the caller's.
struct FloatValues {
  const float* rows;
  int64_t row_stride;
};
FloatValues float_values(const AttentionParams& p, const Int8Plan& plan, const float* pair_pack,
                         const QueryTask& task) {
  if (plan.fp.pack_v) return {pair_pack + plan.v_rows, plan.fp.v_row_floats};
  const int64_t b = task.tile.batch;
  return {static_cast<const float*>(p.v) + b * p.v_stride[0] + task.hkv * p.v_stride[1],
          p.v_stride[2]};
}

template <typename T>
void run_int8_query_tile(const AttentionParams& p, const Int8Plan& plan, const QueryTask& task,
                         const float* pair_pack, Int8Scratch& ws) {
  const QueryTile& tile = task.tile;
  const Tiling& t = plan.fp;
  const int64_t ld = plan.schedule.block_q;
  start_query_tile(p, t, tile, ws.fp);
  const int64_t key_limit = key_limit_for(p, tile);
  if (key_limit > 0) {  // without keys nothing is packed (no channel factors): output zeros
    load_scaled_queries_transposed<T>(p, tile, t, ws.fp.qt);
    quantize_queries(p, plan, channel_factors(p, plan, pair_pack), tile, ws);
  }
  const AliasWord* k_codes = reinterpret_cast<const AliasWord*>(pair_pack);
  for (int64_t k0 = 0; k0 < key_limit; k0 += t.block_k) {
    const int64_t keys = min_i64(t.block_k, key_limit - k0);
    query_dot_means(p, plan, pair_pack, tile, k0 / t.block_k, ws);
    const int32_t* key_offsets = reinterpret_cast<const AliasInt*>(pair_pack + plan.key_offsets);
    const ScoreScales scales{pair_pack + plan.key_scales + k0, key_offsets + k0, ws.q_scales,
                             ws.q_dot_mean};
    int8_scores(k_codes + k0 * plan.words, plan.words, ws.q_codes, ld, keys, tile.vecs, scales,
                ws.fp.st);
    key_tile_probabilities(p, t, tile, k0, keys, ws.fp);
    if (plan.integer_values) {
      accumulate_integer_values(p, plan, pair_pack, tile, k0, keys, k0 / t.block_k, ws);
    } else {
      const FloatValues v = float_values(p, plan, pair_pack, task);
      accumulate_values(p, t, v.rows, v.row_stride, tile, k0, keys, ws.fp);
    }
  }
  write_output<T>(p, tile, t, ws.fp);
}

// ---------------------------------------------------------------- family traits
template <typename T>
struct Int8Family {
  static constexpr int64_t kThreadClampQueries = kLanes;
  typedef Int8Plan Plan;
  typedef Int8Scratch Scratch;

  static Plan make_plan(const AttentionParams& p, int threads) { return plan_int8<T>(p, threads); }
  static Scratch enter_thread(const AttentionParams& p, const Plan& plan, float* scratch) {
#if NPU_ATTN_INT8_TILES
    configure_tiles();
#endif
    return carve_int8_scratch(p, plan, scratch);
  }
  static void leave_thread(Scratch&) {
#if NPU_ATTN_INT8_TILES
    _tile_release();
#endif
  }
  static void pack(const AttentionParams& p, const Plan& plan, int64_t pair, int64_t key_tile,
                   float* pair_pack) {
    pack_int8_key_tile<T>(p, plan, pair, key_tile, pair_pack);
    if (plan.integer_values) {
      pack_value_codes<T>(p, plan, pair, key_tile, pair_pack);
    } else if (plan.fp.pack_v) {  // V like the float32 kernel's packed copy (rows or panels)
      const int64_t k0 = key_tile * plan.fp.block_k;
      pack_value_rows<T>(p, plan.fp, pair, k0, min_i64(plan.fp.block_k, p.len_k - k0),
                         pair_pack + plan.v_rows);
    }
  }
  static void run(const AttentionParams& p, const Plan& plan, const QueryTask& task,
                  const float* pair_pack, Scratch& ws) {
    run_int8_query_tile<T>(p, plan, task, pair_pack, ws);
  }
};

inline void attention_int8_tiled(const AttentionParams& p) {
  switch (p.element) {
    case ElementType::kFloat32:
      return run_forward<Int8Family<float>>(p);
    case ElementType::kBFloat16:
      return run_forward<Int8Family<BFloat16>>(p);
    case ElementType::kFloat16:
      return run_forward<Int8Family<Half>>(p);
  }
}

}  // namespace
}  // namespace npu_attn
