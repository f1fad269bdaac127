// bfloat16 attention forward on AMX (Intel Advanced Matrix Extensions, Sapphire Rapids and
// later): both products run on the tile unit (tdpbf16ps: a 16x32 bfloat16 tile times a 32x16
// one, accumulated into 16x16 float32), the online softmax on AVX-512.
//
// Same transposed layout as the float32 and vdpbf16ps kernels (one float32 lane per query), so
// the softmax is vertical vector code with no horizontal reductions, shared with the vdpbf16ps
// kernel (exp_pair_row writes P^T as bfloat16 pairs, exactly AMX's "VNNI" B layout):
//   per sub-tile = (batch, q-head, 32 queries), for each key block of 128-256 keys:
//     S^T (keys x 32)  = K Q^T        A: K rows (16 keys x 32 dims), B: Q^T pairs (16 x 16 q)
//     * scale, mask, causal; online softmax -> P^T pairs, O^T *= alpha         (AVX-512)
//     O^T (Dv x 32)   += V^T P^T      A: V^T rows (16 channels x 32 keys), B: P^T pairs
//   out = O / l (bfloat16), lse = m + log(l)
// software-pipelined across (sub-tile, key block) units so the exponentials of one unit run
// between the tile steps of its neighbours' products (see AmxSubTile).
// A task is 1-4 such sub-tiles that take each key block in turn (query groups, see
// kAmxMaxGroups): when K and V^T outgrow L2, a block is then fetched once for all of them.
// Each product step is a 2x2 block of 16x16 accumulators (4 tiles) from 2 A and 2 B tiles, so
// every tile load feeds two tdpbf16ps. Operands are padded with zeros to whole tiles (head dims
// to 32, keys to 32), so padding contributes nothing; K is read in place when its rows already
// are whole tiles. Accumulation, softmax and output normalisation are float32; P is rounded to
// bfloat16 for the second product (as torch's CPU kernel and FlashAttention do).
//
// Run by the shared forward driver (run_forward, forward_driver_impl.h) as AmxFamily. The tile
// configuration is per thread (loaded when a thread enters the parallel region, released when it
// leaves); the OS permission to use AMX state is requested once per process by dispatch.cpp
// before this variant can be selected.
// (tests/cpp/amx_emulation.h, included first, stands in for the tile unit in tests.)
#pragma once
#if !(defined(__AMX_TILE__) && defined(__AMX_BF16__) || defined(NPU_ATTN_AMX_EMULATED)) || \
    !defined(__AVX512BF16__)
#error "attention_forward_amx_impl.h needs -mamx-tile -mamx-bf16 -mavx512bf16"
#endif

#include <immintrin.h>

#include <cstring>

#include "amx_tiles_impl.h"
#include "attention_forward_bf16_impl.h"

namespace npu_attn {
namespace {

// ---------------------------------------------------------------- blocking rules
// The tile plan of the AMX kernel; only plan_amx (and the fixed tile shapes below) read these.
// What one tile holds: 16 rows of 64 bytes, i.e. 32 bfloat16 along a reduced dimension.
constexpr int64_t kAmxTileRows = 16;  // rows of a tile: O^T channels per row block
constexpr int64_t kAmxTileK = 32;     // bfloat16 per tile row: head dims / keys per product step
// Queries per sub-tile: two 16-column B tiles, so each A tile load feeds two tdpbf16ps.
constexpr int64_t kAmxBlockQ = 32;
// Keys per block of the key loop (a multiple of kAmxTileK): at least kAmxMinBlockK, so the
// block's S^T (128 x 32 floats, 16 KiB) and P^T pairs (8 KiB) stay in L1 between the softmax and
// the two products; and at least the (padded) head dim of V, up to kAmxMaxBlockK, because the
// value product loads and stores the O^T accumulators (dim_v_pad x 32 floats) once per block:
// with 128-key blocks at head dim 512 (the VAE's attention) that traffic, 128 KiB per block,
// took longer than the tile products it feeds. Since the pipelining keeps two S^T and two P^T
// buffers live, 512-key blocks (64 KiB of S^T each) were 6-12% slower there than 256.
constexpr int64_t kAmxMinBlockK = 128;
constexpr int64_t kAmxMaxBlockK = 256;
// Query groups: a task runs up to kAmxMaxGroups sub-tiles of kAmxBlockQ queries over each key
// block in turn, so the block's K and V^T (read from L2 by every sub-tile) come from L3 or
// memory once per group instead of once per 32 queries. Used when one pair's K and V^T exceed
// kAmxGroupAboveBytes (about half of a core's L2 on Sapphire Rapids): at the VAE's head dim
// 512 and 4096 keys they are 8 MiB, streamed at more bytes per cycle than L3 delivers.
constexpr int64_t kAmxMaxGroups = 4;
constexpr int64_t kAmxGroupAboveBytes = int64_t{1} << 20;
// Fewer groups when grouping would leave fewer than this many tasks per thread.
constexpr int64_t kAmxTasksPerThread = 4;
// Query groups for short key ranges too: the pipeline (run_amx_task) hides a unit's
// exponentials behind the tile products of its neighbours, so a task of one sub-tile and one
// key block (SD-1.5's 8x8 level: 64 keys; cross-attention: 77) has nothing to overlap. Tasks get
// at least this many (sub-tile, key block) units where the sub-tiles allow.
constexpr int64_t kAmxMinUnitsPerTask = 4;
// Packed K/V of one chunk of (batch, kv-head) pairs: as many pairs as fit in 64 MiB (fewer
// barriers for short sequences, bounded memory for long ones). Twice the vector kernels'
// kPackBudgetBytes, as the kernel was written; not tuned separately.
constexpr int64_t kAmxPackBudgetBytes = int64_t{64} << 20;
static_assert(kAmxMinBlockK % kAmxTileK == 0 && kAmxMaxBlockK % kAmxTileK == 0 &&
                  kAmxBlockQ == 2 * kAmxTileRows,
              "key blocks are whole tiles; a task is two B tiles of queries");

// ---------------------------------------------------------------- plan and packing
struct AmxPlan {
  ForwardSchedule schedule;
  PairLayout pairs;   // block_q = 32, block_k, k_words: reused by the shared softmax/loaders
  int64_t dim_pad;    // head_dim rounded up to 32 (one A tile of bfloat16 columns)
  int64_t dim_v_pad;  // head_dim_v rounded up to 16 (one row block of O^T)
  int64_t len_k_pad;  // len_k rounded up to 32
  bool k_in_place;    // K rows already hold whole tiles (head_dim and len_k multiples of 32)
  int64_t k_row;      // elements between packed K rows (dim_pad) when packing
  int64_t groups;     // sub-tiles of kAmxBlockQ queries per task (1..kAmxMaxGroups)
};

// Floats of one sub-tile's scratch, and of a thread's (sub-tiles, then the double-buffered S^T
// and P^T, see AmxScratch).
int64_t amx_sub_tile_floats(const AmxPlan& a) {
  return round_up(kAmxBlockQ * (a.dim_v_pad + 3 + a.dim_pad / 2), kScratchAlignFloats);
}
int64_t amx_scratch_floats(const AmxPlan& a) {
  return a.groups * amx_sub_tile_floats(a) + 2 * kAmxBlockQ * (a.pairs.block_k * 3 / 2);
}

// Sub-tiles per task: kAmxMaxGroups when a pair's K and V^T outgrow L2 (each sub-tile would
// reread them from L3), enough for kAmxMinUnitsPerTask units when there are few key blocks,
// else 1; then halved while fewer than kAmxTasksPerThread tasks per thread would be left.
int64_t amx_groups(const AttentionParams& p, const AmxPlan& a, int threads) {
  const int64_t kv_bytes = 2 * a.len_k_pad * (a.dim_pad + a.dim_v_pad);
  const int64_t key_blocks = ceil_div(max_i64(p.len_k, 1), a.pairs.block_k);
  int64_t groups = 1;
  if (kv_bytes > kAmxGroupAboveBytes) {
    groups = kAmxMaxGroups;
  } else {
    while (groups < kAmxMaxGroups && groups * key_blocks < kAmxMinUnitsPerTask) groups *= 2;
  }
  groups = min_i64(groups, ceil_div(max_i64(p.len_q, 1), kAmxBlockQ));  // no empty sub-tiles
  const int64_t heads_rows = p.batch * p.heads_q;
  while (groups > 1 &&
         heads_rows * ceil_div(p.len_q, groups * kAmxBlockQ) < kAmxTasksPerThread * threads)
    groups /= 2;
  return groups;
}

// The plan of the AMX kernel (the thread count only decides the query groups).
AmxPlan plan_amx(const AttentionParams& p, int threads) {
  AmxPlan a{};
  ForwardSchedule& s = a.schedule;
  a.dim_pad = round_up(max_i64(p.head_dim, 1), kAmxTileK);
  a.dim_v_pad = round_up(max_i64(p.head_dim_v, 1), kAmxTileRows);
  a.len_k_pad = round_up(max_i64(p.len_k, 1), kAmxTileK);
  a.pairs.block_q = kAmxBlockQ;
  const int64_t block_k =
      min_i64(kAmxMaxBlockK, max_i64(kAmxMinBlockK, round_up(a.dim_v_pad, kAmxTileK)));
  a.pairs.block_k = min_i64(block_k, a.len_k_pad);
  a.pairs.k_words = a.dim_pad / 2;
  // In place only when every tile load stays inside K: whole tiles of head dims and of keys.
  a.k_in_place = p.k_stride[3] == 1 && p.head_dim % kAmxTileK == 0 && p.len_k % kAmxTileK == 0;
  a.k_row = a.dim_pad;
  // Packed bfloat16 elements per pair: V^T, then K rows unless read in place. Both terms are
  // multiples of kAmxTileK (even), so they are whole floats.
  const int64_t pair_elems =
      a.dim_v_pad * a.len_k_pad + (a.k_in_place ? 0 : a.len_k_pad * a.dim_pad);
  a.groups = amx_groups(p, a, threads);
  s.block_q = kAmxBlockQ * a.groups;
  s.pack_tiles = a.len_k_pad / kAmxTileK;  // one item per 32 keys
  s.pair_floats = pair_elems / 2;
  s.pairs_per_chunk = pairs_per_pack_budget(p, s.pair_floats, kAmxPackBudgetBytes);
  s.scratch_floats = amx_scratch_floats(a);
  return a;
}

// ---------------------------------------------------------------- packing
// GCC 12's AVX-512 unpack and shuffle intrinsics start from _mm512_undefined_epi32(), which it
// then reports as maybe uninitialized where they are inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// Transposes a 16 x 16 matrix of 32-bit words held one row per register (row i of the result
// is column i of the input): unpacks of words and word pairs within 128-bit lanes, then two
// rounds of 128-bit lane shuffles.
NPU_ATTN_VEC_INLINE void transpose_words_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// V^T rows for keys [k0, k0 + count) (count <= 32) when V's channels are contiguous: `vt` gets
// dim_v_pad rows of 32 keys (zeros past count and head_dim_v). Per 32 channels, each pair of
// key rows is interleaved into words (key 2i, key 2i+1) of one channel, and a 16 x 16 word
// transpose turns 16 such rows into 16 channel rows of 32 keys. Short sequences spent about a
// quarter of the kernel's time in the element-by-element copy this replaces (SD-1.5's 16x16
// level: 256 keys at head dim 160).
void pack_vt_contiguous(const AttentionParams& p, const AmxPlan& a, const uint16_t* v, int64_t k0,
                        int64_t count, uint16_t* vt) {
  alignas(64) static const uint16_t kInterleave[2][32] = {
      {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  const __m512i interleave_low = _mm512_load_si512(kInterleave[0]);
  const __m512i interleave_high = _mm512_load_si512(kInterleave[1]);
  for (int64_t c0 = 0; c0 < a.dim_v_pad; c0 += 32) {
    const int64_t channels = min_i64(max_i64(p.head_dim_v - c0, 0), 32);
    const __mmask32 valid = channels == 32 ? ~__mmask32{0} : (__mmask32{1} << channels) - 1;
    __m512i low[16], high[16];  // words (key 2i, key 2i + 1) of channels c0.. / c0 + 16..
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t j = k0 + 2 * i;
      const __m512i even = 2 * i < count
                               ? _mm512_maskz_loadu_epi16(valid, v + j * p.v_stride[2] + c0)
                               : _mm512_setzero_si512();
      const __m512i odd = 2 * i + 1 < count
                              ? _mm512_maskz_loadu_epi16(valid, v + (j + 1) * p.v_stride[2] + c0)
                              : _mm512_setzero_si512();
      low[i] = _mm512_permutex2var_epi16(even, interleave_low, odd);
      high[i] = _mm512_permutex2var_epi16(even, interleave_high, odd);
    }
    transpose_words_16x16(low);
    for (int64_t c = 0; c < 16; ++c) _mm512_storeu_si512(vt + (c0 + c) * kAmxTileK, low[c]);
    if (c0 + 16 >= a.dim_v_pad) break;  // dim_v_pad is a multiple of 16, not always of 32
    transpose_words_16x16(high);
    for (int64_t c = 0; c < 16; ++c) _mm512_storeu_si512(vt + (c0 + 16 + c) * kAmxTileK, high[c]);
  }
}

#pragma GCC diagnostic pop

// Keys [k0, k0 + 32) of one pair: V^T chunk k0/32 (dim_v_pad rows of 32 keys, contiguous, so
// a tile load reads one sequential kilobyte instead of 16 rows a whole sequence apart) and,
// unless read in place, K rows (len_k_pad rows of dim_pad); zeros past len_k, head_dim and
// head_dim_v.
void pack_amx_block(const AttentionParams& p, const AmxPlan& a, int64_t pair, int64_t k0,
                    uint16_t* dst) {
  const int64_t b = pair / p.heads_kv, hkv = pair % p.heads_kv;
  const uint16_t* k = static_cast<const uint16_t*>(p.k) + b * p.k_stride[0] + hkv * p.k_stride[1];
  const uint16_t* v = static_cast<const uint16_t*>(p.v) + b * p.v_stride[0] + hkv * p.v_stride[1];
  const int64_t count = min_i64(kAmxTileK, p.len_k - k0);
  uint16_t* vt = dst + k0 / kAmxTileK * a.dim_v_pad * kAmxTileK;
  if (p.v_stride[3] == 1) {
    pack_vt_contiguous(p, a, v, k0, count, vt);
  } else {
    for (int64_t c = 0; c < a.dim_v_pad; ++c) {
      uint16_t* row = vt + c * kAmxTileK;
      const int64_t valid = c < p.head_dim_v ? count : 0;
      for (int64_t j = 0; j < valid; ++j) row[j] = v[(k0 + j) * p.v_stride[2] + c * p.v_stride[3]];
      for (int64_t j = valid; j < kAmxTileK; ++j) row[j] = 0;
    }
  }
  if (a.k_in_place) return;
  uint16_t* kr = dst + a.dim_v_pad * a.len_k_pad;
  for (int64_t j = 0; j < kAmxTileK; ++j) {
    uint16_t* row = kr + (k0 + j) * a.k_row;
    const int64_t valid = j < count ? p.head_dim : 0;
    const uint16_t* src = k + (k0 + j) * p.k_stride[2];
    if (p.k_stride[3] == 1) {
      std::memcpy(row, src, valid * sizeof(uint16_t));
    } else {
      for (int64_t d = 0; d < valid; ++d) row[d] = src[d * p.k_stride[3]];
    }
    std::memset(row + valid, 0, (a.dim_pad - valid) * sizeof(uint16_t));
  }
}

// ---------------------------------------------------------------- products
// The products take `between`, called after every step of four tdpbf16ps: vector work placed
// there runs while the tile unit computes (see run_amx_task).
struct NothingBetween {
  NPU_ATTN_VEC_INLINE void operator()() const {}
};

// S^T (keys x 32 queries, ld 32) = K Q^T for `keys32` keys starting at `k` (rows k_row apart).
template <typename Between>
NPU_ATTN_VEC_INLINE void amx_scores(const AmxPlan& a, const uint16_t* k, int64_t k_row,
                                    int64_t keys32, const uint32_t* qp, float* st,
                                    Between& between) {
  const int64_t k_stride = k_row * 2, q_stride = kAmxBlockQ * 4, s_stride = kAmxBlockQ * 4;
  for (int64_t j = 0; j < keys32; j += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t d = 0; d < a.dim_pad; d += 32) {
      _tile_loadd(4, k + j * k_row + d, k_stride);
      _tile_loadd(5, k + (j + 16) * k_row + d, k_stride);
      _tile_loadd(6, qp + (d / 2) * kAmxBlockQ, q_stride);
      _tile_loadd(7, qp + (d / 2) * kAmxBlockQ + 16, q_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
      between();
    }
    _tile_stored(0, st + j * kAmxBlockQ, s_stride);
    _tile_stored(1, st + j * kAmxBlockQ + 16, s_stride);
    _tile_stored(2, st + (j + 16) * kAmxBlockQ, s_stride);
    _tile_stored(3, st + (j + 16) * kAmxBlockQ + 16, s_stride);
  }
}

// O^T rows [c, c + 32) (or [c, c + 16) for a last row block of 16 channels) += V^T P^T over
// `keys32` keys; vt points at the unit's first 32-key chunk of V^T (chunks of dim_v_pad x 32),
// pp at its first key-pair row. The row block of O^T (ld 32) is loaded into the accumulators
// once per call; `first` (the sub-tile's first value product) starts them at zero instead, so
// O^T is neither cleared nor read before it holds anything (a sixth of a short task's time
// went to that memset and those loads at L=64, D=160).
template <typename Between>
NPU_ATTN_VEC_INLINE void amx_values_rows(const AmxPlan& a, const uint16_t* vt, const uint32_t* pp,
                                         int64_t keys32, int64_t c, float* ot, bool first,
                                         Between& between) {
  const int64_t v_stride = 64, chunk = a.dim_v_pad * 32, p_stride = kAmxBlockQ * 4,
                o_stride = kAmxBlockQ * 4;
  if (c + 32 <= a.dim_v_pad) {  // two channel row blocks at once
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, ot + c * kAmxBlockQ, o_stride);
      _tile_loadd(1, ot + c * kAmxBlockQ + 16, o_stride);
      _tile_loadd(2, ot + (c + 16) * kAmxBlockQ, o_stride);
      _tile_loadd(3, ot + (c + 16) * kAmxBlockQ + 16, o_stride);
    }
    for (int64_t j = 0; j < keys32; j += 32) {
      _tile_loadd(4, vt + (j / 32) * chunk + c * 32, v_stride);
      _tile_loadd(5, vt + (j / 32) * chunk + (c + 16) * 32, v_stride);
      _tile_loadd(6, pp + (j / 2) * kAmxBlockQ, p_stride);
      _tile_loadd(7, pp + (j / 2) * kAmxBlockQ + 16, p_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
      between();
    }
    _tile_stored(0, ot + c * kAmxBlockQ, o_stride);
    _tile_stored(1, ot + c * kAmxBlockQ + 16, o_stride);
    _tile_stored(2, ot + (c + 16) * kAmxBlockQ, o_stride);
    _tile_stored(3, ot + (c + 16) * kAmxBlockQ + 16, o_stride);
    return;
  }
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
  } else {
    _tile_loadd(0, ot + c * kAmxBlockQ, o_stride);
    _tile_loadd(1, ot + c * kAmxBlockQ + 16, o_stride);
  }
  for (int64_t j = 0; j < keys32; j += 32) {
    _tile_loadd(4, vt + (j / 32) * chunk + c * 32, v_stride);
    _tile_loadd(6, pp + (j / 2) * kAmxBlockQ, p_stride);
    _tile_loadd(7, pp + (j / 2) * kAmxBlockQ + 16, p_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    between();
  }
  _tile_stored(0, ot + c * kAmxBlockQ, o_stride);
  _tile_stored(1, ot + c * kAmxBlockQ + 16, o_stride);
}

// ---------------------------------------------------------------- one task
// A unit of work is one sub-tile (32 queries) against one key block. Its stages alternate
// between the two engines: S^T = K Q^T (AMX), the softmax (AVX-512), O^T += V^T P^T (AMX).
// Run one after another, each engine idles while the other works (the softmax is about half of
// a unit at head dims up to 128). So the task is software-pipelined: the exponentials of unit u
// are handed out in portions between the tile steps of the scores of unit u + 1 and of the
// value product of unit u - 1, so the core runs them while the tile unit computes. That needs
// two S^T and two P^T buffers, and the O^T rescale of unit u (the online softmax's alpha)
// deferred until unit u - 1's value product has been issued: it is applied at the start of the
// next step, before unit u's own value product. On Sapphire Rapids the core hides only about
// 10 ns of vector work behind a 21 ns step of four tdpbf16ps (bench/cpp/bench_amx_overlap.cpp),
// so at head dims up to 128 the kernel's time is close to its tile and vector work added up.
struct AmxSubTile {
  QueryTile tile;
  int64_t key_limit;     // causal: keys past the sub-tile's last query are not visited
  ThreadScratch f32;     // ot, m, l (what write_output reads); st and qt unused
  float* alpha;          // kAmxBlockQ: the pending O^T rescale
  bool rescale_pending;  // alpha differs from 1 in some lane and is not applied yet
  bool ot_written;       // O^T holds a value product (until then it is implicitly zero)
  uint32_t* qp;          // dim_pad / 2 x kAmxBlockQ: Q^T pairs (the B operand of the scores)
};

// One thread's scratch: the sub-tiles of its task, and the double-buffered S^T and P^T.
struct AmxScratch {
  AmxSubTile sub[kAmxMaxGroups];
  float* st[2];     // block_k x kAmxBlockQ
  uint32_t* pp[2];  // block_k / 2 x kAmxBlockQ
};

AmxScratch carve_amx_scratch(const AmxPlan& a, float* base) {
  AmxScratch ws{};
  for (int64_t g = 0; g < a.groups; ++g) {
    AmxSubTile& s = ws.sub[g];
    s.f32.ot = base + g * amx_sub_tile_floats(a);
    s.f32.m = s.f32.ot + a.dim_v_pad * kAmxBlockQ;
    s.f32.l = s.f32.m + kAmxBlockQ;
    s.alpha = s.f32.l + kAmxBlockQ;
    s.qp = reinterpret_cast<uint32_t*>(s.alpha + kAmxBlockQ);
  }
  float* shared = base + a.groups * amx_sub_tile_floats(a);
  for (int b = 0; b < 2; ++b) {
    ws.st[b] = shared + b * kAmxBlockQ * a.pairs.block_k;
    ws.pp[b] = reinterpret_cast<uint32_t*>(shared + 2 * kAmxBlockQ * a.pairs.block_k) +
               b * kAmxBlockQ * (a.pairs.block_k / 2);
  }
  return ws;
}

// Q^T pairs of one sub-tile (zero rows up to dim_pad), and its running max, sum and O^T reset.
void start_sub_tile(const AttentionParams& p, const AmxPlan& a, AmxSubTile& s) {
  constexpr int64_t ld = kAmxBlockQ;
  PairLayout q_layout = a.pairs;  // load_query_pairs pads lanes, not head dims
  q_layout.k_words = (p.head_dim + 1) / 2;
  load_query_pairs(p, q_layout, s.tile, s.qp);
  for (int64_t w = q_layout.k_words; w < a.dim_pad / 2; ++w)
    for (int64_t i = 0; i < ld; ++i) s.qp[w * ld + i] = 0;
  for (int64_t i = 0; i < ld; ++i) {
    s.f32.m[i] = kNegInf;
    s.f32.l[i] = 0.0f;
  }
  s.rescale_pending = false;
  s.ot_written = false;  // O^T is not cleared: the first value product starts from zero tiles
}

// (sub-tile, key block) units in the order they run: key blocks outer, so a block's K and V^T
// serve every sub-tile of the task while in cache. g < 0: none left.
struct AmxUnit {
  int64_t g, k0, keys;
};

AmxUnit next_unit(const AmxPlan& a, const AmxScratch& ws, int64_t subs, int64_t key_limit,
                  AmxUnit u) {
  int64_t g = u.g + 1, k0 = u.k0;
  for (;;) {
    if (g == subs) {
      g = 0;
      k0 += a.pairs.block_k;
      if (k0 >= key_limit) return AmxUnit{-1, 0, 0};
    }
    const int64_t limit = ws.sub[g].key_limit;
    if (k0 < limit) return AmxUnit{g, k0, min_i64(a.pairs.block_k, limit - k0)};
    ++g;
  }
}

// The softmax's first half for one unit: the block's row maxima, the new running max, l scaled
// by alpha = exp(m_old - m_new), and alpha kept for O^T (applied later, see AmxSubTile). Where
// no lane's maximum moved alpha is exactly 1 and O^T is left alone (bit-identical).
// Returns the shift per query vector, for the exponentials.
// This is softmax_rescale's running-max update without its O^T pass. Calling softmax_rescale
// with a "deferred" switch instead was tried: bit-identical results, the other kernels' object
// code unchanged, but the AMX kernel 5-6% slower on self-attention (two A/B runs, both orders),
// so the few lines are kept here.
NPU_ATTN_VEC_INLINE void softmax_max_deferred(int64_t keys, const float* st, float score_scale,
                                              AmxSubTile& s, Vec (&shift)[2]) {
  constexpr int64_t ld = kAmxBlockQ;
  Vec m_tile[2] = {splat(kNegInf), splat(kNegInf)};
  for (int64_t j = 0; j < keys; ++j)
    for (int v = 0; v < 2; ++v)
      m_tile[v] = max_ignoring_nan(load(st + j * ld + v * kLanes), m_tile[v]);
  bool moved = false;
  for (int v = 0; v < 2; ++v) {
    m_tile[v] *= splat(score_scale);  // -inf stays -inf: score_scale > 0
    const Vec m_old = load(s.f32.m + v * kLanes);
    const Vec m_new = m_tile[v] > m_old ? m_tile[v] : m_old;
    // Queries whose keys are all masked so far keep m = -inf; shifting by 0 keeps their
    // probabilities exactly 0 (exp(-inf)) instead of NaN (exp(-inf - -inf)).
    shift[v] = m_new == kNegInf ? splat(0.0f) : m_new;
    const Vec alpha = exp_nonpositive(m_old - shift[v]);
    store(s.f32.m + v * kLanes, m_new);
    store(s.f32.l + v * kLanes, load(s.f32.l + v * kLanes) * alpha);
    store(s.alpha + v * kLanes, alpha);
    moved |= any_lane_differs(m_new, m_old);
  }
  s.rescale_pending = moved;
}

// The pending O^T *= alpha of a sub-tile (nothing to scale before its first value product).
void apply_pending_rescale(const AttentionParams& p, AmxSubTile& s) {
  if (!s.rescale_pending || !s.ot_written) {
    s.rescale_pending = false;
    return;
  }
  const Vec alpha[2] = {load(s.alpha), load(s.alpha + kLanes)};
  for (int64_t c = 0; c < p.head_dim_v; ++c)
    for (int v = 0; v < 2; ++v) {
      float* o = s.f32.ot + c * kAmxBlockQ + v * kLanes;
      store(o, load(o) * alpha[v]);
    }
  s.rescale_pending = false;
}

// The softmax's second half for one unit, in portions: P^T pairs and row sums, two keys (one
// pair row) at a time. run_amx_task hands a portion to every step of the tile products.
struct ExpWork {
  const float* st;
  uint32_t* pp;
  int64_t keys;
  int64_t next_pair = 0;  // pair rows done
  int64_t quota = 0;      // pair rows per portion
  Vec factor;
  Vec shift2[2];
  Vec sum[2] = {splat(0.0f), splat(0.0f)};

  // Pair rows up to `end` (capped at the unit's); an odd last key pairs with zero.
  NPU_ATTN_VEC_INLINE void run_to(int64_t end) {
    end = min_i64(end, (keys + 1) / 2);
    for (; next_pair < min_i64(end, keys / 2); ++next_pair)
      exp_pair_row<2, true>(st, kAmxBlockQ, 2 * next_pair, factor, shift2, sum, pp);
    if (next_pair < end) {
      exp_pair_row<2, false>(st, kAmxBlockQ, 2 * next_pair, factor, shift2, sum, pp);
      ++next_pair;
    }
  }
  NPU_ATTN_VEC_INLINE void operator()() { run_to(next_pair + quota); }
};

// Scores, scale and masks of a unit's S^T are ready: its scale still to apply (see
// scale_scores_if_needed) after masks and the causal cut-off are added.
float prepare_scores(const AttentionParams& p, const AmxSubTile& s, const AmxUnit& u, float* st) {
  const float rest_scale = scale_scores_if_needed(p, u.keys, kAmxBlockQ, st, kAmxBlockQ);
  if (p.mask_kind != MaskKind::kNone) apply_user_mask(p, s.tile, u.k0, u.keys, st, kAmxBlockQ);
  if (p.is_causal && u.k0 + u.keys > s.tile.q0) apply_causal(s.tile, u.k0, u.keys, st, kAmxBlockQ);
  return rest_scale;
}

// The operands of one task, as run_amx_task passes them to the stages.
struct AmxOperands {
  const uint16_t* k;  // K rows, k_row elements apart
  int64_t k_row;
  const uint16_t* vt;  // packed V^T chunks
};

// A unit's products, with `between` after every step of four tdpbf16ps.
template <typename Between>
NPU_ATTN_VEC_INLINE void issue_scores(const AmxPlan& a, const AmxOperands& op, const AmxScratch& ws,
                                      const AmxUnit& u, float* st, Between& between) {
  amx_scores(a, op.k + u.k0 * op.k_row, op.k_row, round_up(u.keys, kAmxTileK), ws.sub[u.g].qp, st,
             between);
}
template <typename Between>
NPU_ATTN_VEC_INLINE void issue_values(const AmxPlan& a, const AmxOperands& op, AmxScratch& ws,
                                      const AmxUnit& u, const uint32_t* pp, Between& between) {
  const uint16_t* vt = op.vt + u.k0 / kAmxTileK * a.dim_v_pad * kAmxTileK;
  AmxSubTile& s = ws.sub[u.g];
  for (int64_t c = 0; c < a.dim_v_pad; c += 32)
    amx_values_rows(a, vt, pp, round_up(u.keys, kAmxTileK), c, s.f32.ot, !s.ot_written, between);
  s.ot_written = true;
}

// Steps of four tdpbf16ps in a unit's scores and in its value product.
int64_t score_steps(const AmxPlan& a, const AmxUnit& u) {
  return u.g < 0 ? 0 : ceil_div(u.keys, kAmxTileK) * (a.dim_pad / kAmxTileK);
}
int64_t value_steps(const AmxPlan& a, const AmxUnit& u) {
  return u.g < 0 ? 0 : ceil_div(u.keys, kAmxTileK) * ceil_div(a.dim_v_pad, 32);
}

// A task of up to `groups` sub-tiles of 32 queries, pipelined over its units (see AmxSubTile).
void run_amx_task(const AttentionParams& p, const AmxPlan& a, const AmxOperands& op,
                  const QueryTile& task, AmxScratch& ws) {
  const int64_t subs = ceil_div(task.rows, kAmxBlockQ);
  int64_t key_limit = 0;
  for (int64_t g = 0; g < subs; ++g) {
    AmxSubTile& s = ws.sub[g];
    s.tile = task;
    s.tile.q0 = task.q0 + g * kAmxBlockQ;
    s.tile.rows = min_i64(kAmxBlockQ, task.q0 + task.rows - s.tile.q0);
    s.tile.vecs = kAmxBlockQ / kLanes;  // the softmax runs on whole tiles
    s.key_limit = p.is_causal ? min_i64(p.len_k, s.tile.q0 + s.tile.rows) : p.len_k;
    key_limit = max_i64(key_limit, s.key_limit);
    start_sub_tile(p, a, s);
  }
  NothingBetween nothing;
  AmxUnit prev{-1, 0, 0};
  AmxUnit cur = next_unit(a, ws, subs, key_limit, AmxUnit{-1, 0, 0});
  if (cur.g >= 0) issue_scores(a, op, ws, cur, ws.st[0], nothing);
  int buf = 0;  // cur's S^T and P^T buffers; prev's P^T and next's S^T use the other pair
  while (cur.g >= 0) {
    const AmxUnit next = next_unit(a, ws, subs, key_limit, cur);
    AmxSubTile& s = ws.sub[cur.g];
    if (prev.g >= 0) apply_pending_rescale(p, ws.sub[prev.g]);
    ExpWork exp{};
    exp.st = ws.st[buf];
    exp.pp = ws.pp[buf];
    exp.keys = cur.keys;
    const float rest_scale = prepare_scores(p, s, cur, ws.st[buf]);
    Vec shift[2];
    softmax_max_deferred(cur.keys, exp.st, rest_scale, s, shift);
    const float exp_scale = shift_huge_scores(ws.st[buf], kAmxBlockQ, cur.keys, rest_scale, shift);
    for (int v = 0; v < 2; ++v) exp.shift2[v] = shift[v] * splat(kLog2e);
    exp.factor = splat(exp_scale * kLog2e);
    // The exponentials in even portions between the steps of the next unit's scores and the
    // previous unit's value product; what is left (no products to hide behind) after them.
    const int64_t steps = score_steps(a, next) + value_steps(a, prev);
    exp.quota = steps == 0 ? 0 : ceil_div((cur.keys + 1) / 2, steps);
    if (next.g >= 0) issue_scores(a, op, ws, next, ws.st[buf ^ 1], exp);
    if (prev.g >= 0) issue_values(a, op, ws, prev, ws.pp[buf ^ 1], exp);
    exp.run_to(cur.keys);
    for (int v = 0; v < 2; ++v)
      store(s.f32.l + v * kLanes, load(s.f32.l + v * kLanes) + exp.sum[v]);
    // Key pairs past `keys` (up to the tile's 32) must add nothing: zero their P^T rows.
    for (int64_t w = (cur.keys + 1) / 2; w < round_up(cur.keys, kAmxTileK) / 2; ++w)
      for (int64_t i = 0; i < kAmxBlockQ; ++i) exp.pp[w * kAmxBlockQ + i] = 0;
    prev = cur;
    cur = next;
    buf ^= 1;
  }
  if (prev.g >= 0) {  // no unit at all only without keys (len_k == 0)
    apply_pending_rescale(p, ws.sub[prev.g]);
    issue_values(a, op, ws, prev, ws.pp[buf ^ 1], nothing);
  }
  Tiling t{};  // write_output reads only schedule.block_q
  t.schedule.block_q = kAmxBlockQ;
  for (int64_t g = 0; g < subs; ++g) {
    AmxSubTile& s = ws.sub[g];
    if (!s.ot_written)  // no keys: the output is 0 (l == 0), computed from a zero O^T
      for (int64_t i = 0; i < a.dim_v_pad * kAmxBlockQ; ++i) s.f32.ot[i] = 0.0f;
    write_output<BFloat16>(p, s.tile, t, s.f32);
  }
}

// ---------------------------------------------------------------- family traits
// The AMX family for run_forward (forward_driver_impl.h); bfloat16 tensors only.
struct AmxFamily {
  // The thread clamp counts tasks at the finest split (one sub-tile of kAmxBlockQ queries).
  static constexpr int64_t kThreadClampQueries = kAmxBlockQ;
  typedef AmxPlan Plan;
  typedef AmxScratch Scratch;

  static Plan make_plan(const AttentionParams& p, int threads) { return plan_amx(p, threads); }
  // Loads this thread's tile configuration, and carves its scratch (one part per sub-tile).
  static Scratch enter_thread(const AttentionParams& p, const Plan& a, float* scratch) {
    configure_tiles();
    return carve_amx_scratch(a, scratch);
  }
  static void leave_thread(Scratch&) { _tile_release(); }
  static void pack(const AttentionParams& p, const Plan& a, int64_t pair, int64_t key_tile,
                   float* pair_pack) {
    pack_amx_block(p, a, pair, key_tile * kAmxTileK, reinterpret_cast<uint16_t*>(pair_pack));
  }
  static void run(const AttentionParams& p, const Plan& a, const QueryTask& task,
                  const float* pair_pack, Scratch& ws) {
    const QueryTile& tile = task.tile;
    AmxOperands op{};
    op.vt = reinterpret_cast<const uint16_t*>(pair_pack);
    op.k = op.vt + a.dim_v_pad * a.len_k_pad;
    op.k_row = a.k_row;
    if (a.k_in_place) {
      op.k =
          static_cast<const uint16_t*>(p.k) + tile.batch * p.k_stride[0] + task.hkv * p.k_stride[1];
      op.k_row = p.k_stride[2];
    }
    run_amx_task(p, a, op, tile, ws);
  }
};

void attention_forward_bf16_amx(const AttentionParams& p) {
  run_forward<AmxFamily>(p);
}

}  // namespace
}  // namespace npu_attn
