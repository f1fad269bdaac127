// ISA-neutral tiled (flash-style) attention forward kernel: the float32-compute family
// (float32, and bfloat16/float16 widened to float32), TiledFamily<T>, run by the shared driver
// of forward_driver_impl.h.
//
// This header is compiled once per ISA: each csrc/kernels/attention_forward_<isa>.cpp defines
// NPU_ATTN_VEC_BYTES (16, 32 or 64), is built with its own -m flags, and includes this file.
// Everything here lives in an anonymous namespace and uses no std:: templates, so no symbol can
// be shared (and silently merged by the linker) between the ISA variants; a ctest
// (isa_objects_are_self_contained) checks the object files for that.
//
// Algorithm: FlashAttention-2's forward, vectorised along *queries*. A task owns a tile of up
// to 64 queries of one head and keeps everything transposed, one SIMD lane per query:
//     Q^T  (head_dim x queries)     scaled by `scale`
//     S^T  (keys x queries)         = K Q^T for one key tile, then masked, then P^T
//     O^T  (head_dim_v x queries)   running output
//     m, l (queries)                running max and sum of the online softmax
// so the softmax reductions over keys are plain vertical vector ops, the key/value head dims
// need no padding to the vector width (40, 59, 72, 80 waste no FMA lanes), and K and V are
// read as ordinary rows (broadcast operands), never transposed.
//
//   for a chunk of (batch, kv-head) pairs:                              (run_forward)
//     pack K and V rows of each pair contiguously (any input strides)   (TiledFamily::pack)
//     parallel over (pair, q-head of its GQA group, query tile):        (TiledFamily::run)
//       for each key tile:  S^T = K Q^T;  mask/causal;  online softmax;  O^T = a*O^T + V^T P^T
//       out = O / l,  lse = m + log(l)
// Workspace: O(block_k * block_q + len_k * head_dim) per chunk; nothing grows with
// len_q * len_k.
#pragma once
#ifndef NPU_ATTN_VEC_BYTES
#error "define NPU_ATTN_VEC_BYTES before including attention_forward_impl.h"
#endif

#include <cstdint>
#include <type_traits>

#include "../attention_params.h"
#include "../system_info.h"
#include "forward_driver_impl.h"
#include "vec_impl.h"

namespace npu_attn {
namespace {

// ---------------------------------------------------------------- blocking rules
// The tile plan of the float32-compute kernel, also used by the vdpbf16ps kernel
// (attention_forward_bf16_impl.h), whose S^T tile and task shape are the same. Only the plan
// functions (plan_tiled, plan_pairs) read these; change a tile plan there.

// Keys per tile: the S^T tile (kKeyTile x kMaxQueryTile floats, 128 KiB; 256 KiB with the
// streamed tiles below) stays in L2 next to the K and V rows it is computed from. Over K panels
// the tile is rounded down to whole panels (510 keys), which leaves a short last tile at the
// common lengths (4096 keys: 8 x 510 + 16); tiles balanced over the keys instead (8 x 516)
// took 0.997-1.014x the time with avx2 (Zen 4 with AVX-512 hidden, float32, 2 threads: SDXL
// 64x64, SD3, Flux, VAE 512px), so the plain rule stays. The softmax pass reads the tile from
// L2 (perf: its time goes to waiting on those loads), but 256- and 128-key tiles, whose S^T
// stays in L1 over panels, measured 0.98-1.02x and 1.00-1.04x the time there (head dims 40,
// 64, 80, 512; bench_kernels, 2 threads), so 512 stays.
constexpr int64_t kKeyTile = 512;
// Queries per task: 64 amortise streaming K and V through the key loop...
constexpr int64_t kMaxQueryTile = 64;
// ...and 128 where one (batch, kv-head) pair's K and V, counted as float32, exceed
// kStreamedKvBytes: then they no longer stay in cache between tasks and every task streams them
// from memory, so fewer, taller tasks move half the bytes. On Sapphire Rapids (float32,
// 2 threads) the VAE mid-block at 1024px (one head, 16384 keys of head dim 512: 64 MiB) took
// 0.76x the time with 128-query tiles and 512-bit vectors; at 512px (16 MiB) and on the other
// named shapes (up to 4.5 MiB) they gave nothing (0.97-1.06x), hence the threshold. With
// 256-bit vectors (AVX2) only on cores with at least kStreamedTileMinL2 of L2: the taller S^T
// and O^T tiles take 512 KiB at head dim 512, all of a Zen 3 core's L2 (never measured there),
// while on Sapphire Rapids with AVX-512 hidden (2 MiB L2, like recent Intel client P-cores)
// the VAE mid-block at 1024px took 0.92x the time (bfloat16 inputs 0.91x, the int8 kernel
// 0.95x; outputs bit-identical); a threshold of 8 MiB there made 512px 4% slower. 256-query
// tiles at 1024px: 0.98x with avx2, 1.01x with avx512, not kept. On Zen 4 with AVX-512 hidden
// (1 MiB L2, float32), a threshold of 8 MiB gave the VAE at 512px 0.99x the time (bfloat16
// inputs 0.97x), and 0.99-1.01x with 252- or 126-key tiles under the taller ones: within that
// VM's run-to-run spread, so not kept. Not with 128-bit vectors (never measured).
constexpr int64_t kStreamedQueryTile = 128;
constexpr int64_t kStreamedKvBytes = int64_t{32} << 20;
constexpr int64_t kStreamedTileMinL2 = int64_t{1} << 20;
constexpr bool kStreamedTilesMeasured = kVecBytes >= 32;
// ...halved while there would be fewer than kTasksPerThread tasks per thread (small
// batch * heads, short sequences), so every thread stays busy and the dynamic schedule has
// spare tasks to balance uneven ones (causal), but never below kMinQueryTile: one AVX-512
// vector of queries; every task streams all of K and V, so smaller tiles stream them more often.
constexpr int64_t kMinQueryTile = 16;
constexpr int64_t kTasksPerThread = 4;
// Packed K/V of one chunk of (batch, kv-head) pairs: as many pairs as fit in 32 MiB (fewer
// barriers for short sequences, bounded memory for long ones).
constexpr int64_t kPackBudgetBytes = int64_t{32} << 20;
// Keys per P*V pass inside a key tile: keeps the S^T and V chunks near L1. With 256-bit
// vectors 64 keys (a P^T chunk of 16 KiB, which stays in L1 across the row blocks) measured no
// different on Zen 3 (float32, 2 threads, V rows at head dims 40, 64, 80 and 160: 0.98-1.03x
// the time, geomean 1.00), so one value for every variant...
constexpr int kPvKeyChunk = 128;
// ...but fewer for very large value head dims (the VAE's 512): each pass streams the P^T chunk
// once per 6 output channels, and at 512 channels a 32-key chunk (8 KiB of P^T) measured ~20%
// faster than 128 keys (32 KiB, all of L1) on Zen 4, ~6% at 384, and no better below. The
// bfloat16 pair kernel (16 key pairs per pass): 23% faster at the VAE's 512 (512px). With
// 256-bit vectors (AVX2) the pass walks its row blocks over up to four query groups (rows-outer,
// run_query_tile; four at 64-query tiles), and 16 keys measured best there (micro-benchmark,
// Zen 4 with AVX-512 off).
constexpr int kPvKeyChunkLargeDim = kVecBytes == 32 ? 16 : 32;
constexpr int64_t kLargeDimV = 384;

static_assert(kMinQueryTile % kLanes == 0 && kMaxQueryTile % kMinQueryTile == 0 &&
                  kStreamedQueryTile % kMinQueryTile == 0,
              "query tiles are whole vectors, and halving a query tile reaches kMinQueryTile");
// Vectors spanning the tallest tile a variant runs.
constexpr int kTileQueryVecs =
    (kStreamedTilesMeasured ? kStreamedQueryTile : kMaxQueryTile) / kLanes;

// V rows whose stride is a multiple of 512 bytes all fall into a few of L1's 64 sets (of 64-byte
// lines, on current x86 cores). For large value head dims the P*V pass reads one line from each
// of pv_key_chunk V rows per group of 6 output channels, and those lines then evict each other
// before the next group reuses them. With V rows one line longer (a padded packed copy; float32
// V is then copied, 2 KiB per key at Dv = 512), the VAE mid-block shape (Dv = 512) measured
// 5-8% faster in float32 and 6% (1024px) in the bfloat16 pair kernel on Zen 4. Below
// kLargeDimV (e.g. Flux's 128) padded rows measured no gain there, so those are left as they
// are, except with 256-bit vectors (AVX2) for the row strides of diffusers' (B, L, H, D)
// layout with many keys and queries: V rows 640 or 1280 floats apart (heads x head dim: 8 x 80,
// 20 x 64, 8 x 160) fall into 8 or 4 sets, 64 or 32 lines for a 128-key pass, and the packed
// copy (rows head_dim_v apart) measured on Zen 3 (float32, 2 threads, A/B of the builds on
// (B, L, H, D) inputs, outputs bit-identical): SD-1.5 32x32 (1024 tokens, head dim 80) 0.86x
// the time, SDXL 32x32 (1024, 64) 0.93x; at 256 keys (SD-1.5 16x16) 1.00x and at 64 (8x8)
// 1.10x, where the copy's extra pass costs more than it saves, hence kRowCopyMinLength.
constexpr int64_t kAliasingStrideFloats = 128;
constexpr int64_t kLineFloats = 16;
constexpr bool kRowCopiesMeasured = kVecBytes == 32;
constexpr int64_t kRowCopyMinLength = 1024;  // queries and keys, below kLargeDimV

// Whether copying rows read in place pays for its extra pass over K or V (below kLargeDimV):
// with 256-bit vectors, from kRowCopyMinLength queries and keys.
bool row_copies_pay(const AttentionParams& p) {
  return kRowCopiesMeasured && p.len_q >= kRowCopyMinLength && p.len_k >= kRowCopyMinLength;
}

bool aliasing_v_rows(const AttentionParams& p, int64_t row_floats) {
  if (row_floats % kAliasingStrideFloats != 0) return false;
  return p.head_dim_v >= kLargeDimV || row_copies_pay(p);
}

// The row stride of a packed copy of V rows (packed K rows are head_dim floats).
int64_t packed_v_row_floats(const AttentionParams& p) {
  return aliasing_v_rows(p, p.head_dim_v) ? p.head_dim_v + kLineFloats : p.head_dim_v;
}

// K or V rows read in place from a layout where rows of one (batch, head) are not adjacent:
// diffusers' (B, L, H, D) storage puts them heads x head_dim floats apart, so one head's K and
// V spread over H times the memory (5 MiB each at SD-1.5 64x64, 4096 tokens of 8 x 40: over
// 2500 pages of 4 KiB, more than the core's second-level TLB maps) and share L1 sets. With
// 256-bit vectors those rows are copied (pack_rows, rows head_dim apart) where row_copies_pay.
// On Zen 3 (float32, 2 threads, A/B of the builds on (B, L, H, D) inputs, outputs
// bit-identical), over the aliasing copy above: SD-1.5 64x64 0.84x the time, SDXL 32x32 0.96x,
// SD-1.5 32x32 0.98x; 8x8 (64 tokens) keeps reading in place. Not measured with other vector
// widths.
bool strided_rows_copied(const AttentionParams& p, int64_t row_stride, int64_t dim) {
  return row_stride != dim && row_copies_pay(p);
}

// Keys per P*V pass for the call's value head dim (shared by plan_tiled and plan_pairs).
int64_t pv_key_chunk_for(const AttentionParams& p) {
  return p.head_dim_v >= kLargeDimV ? kPvKeyChunkLargeDim : kPvKeyChunk;
}

// Panels (BLIS's packed A): K and V copied so that the broadcast operand of each product is
// read from contiguous memory, kBlockRows rows at a time (pack_panels, broadcast_fma_panels).
// Row-major K rows put the six broadcasts of a depth step on six cache lines (each 2 KiB apart
// at head dim 512), V columns on six V rows; a panel holds them in 24 contiguous bytes. With
// 16 vector registers (AVX2) the products stream their other operand (Q^T, P^T slices) from
// L2, and the scattered broadcasts were what kept them near 80% of the FMA peak: on Zen 3 at
// the VAE's head dim 512 (one core, micro-benchmark of the two products) S^T = K Q^T went from
// 85 to 91 GFLOP/s and O^T += V^T P^T from 80 to 91 with 64-key passes (P^T chunk 16 KiB; 16
// and 32 keys: 81 and 88). Whole calls on Zen 3, float32, 2 threads, against rows: VAE
// mid-block 0.91x / 0.92x the time, Flux and HiDream (head dim 128) 0.93x, SD2.1 96x96 and
// SDXL 64x64 (64) 0.98x; but the copy is a pass over K and V per call, which short sequences do
// not win back (SD-1.5 16x16, L 256: 1.17x; 8x8: 1.46x; 32x32, L 1024: 1.02x) and head dim 40
// gains nothing (SD-1.5 64x64: 0.99x); nor do short key sequences (cross-attention to 77 text
// tokens at 96x96: 1.06x, its P*V then takes two passes instead of one). Hence: head dims from
// 64 with at least 2048 queries (to share the copy) and 2048 keys, and from kLargeDimV always
// (V is copied there anyway: aliasing_v_rows). With 512-bit vectors too (each broadcast of
// AVX-512's 6 x 4 blocks feeds four vectors, not two, but the scattered rows still cost): on
// Sapphire Rapids, float32, 2 threads, against rows: SD2.1 96x96 0.86x the time, SDXL 64x64
// 0.89x, SD3 0.90x, Flux 0.92x, HiDream 0.94x, VAE mid-block 1024px 0.94x (float16 inputs
// 0.89-0.90x at D=64/128). Not with the portable and NEON variants (never measured).
constexpr bool kPanelsMeasured = kVecBytes >= 32;
constexpr int64_t kPanelMinDim = 64;
constexpr int64_t kPanelMinLength = 2048;  // queries and keys
// Keys per P*V pass over V panels: 64 (see above) below kLargeDimV. From kLargeDimV (the VAE's
// 512) a pass covers the whole key tile: a panel holds kBlockRows channels of every key
// (v_panel_stride), so a 64-key pass reads 86 separate 1.5 KiB pieces of V, 384 KiB apart at
// 16384 keys, more streams than the hardware prefetchers follow once V no longer fits in L3;
// a whole-tile pass reads each panel's 12 KiB in order (outputs bit-identical: every output
// still sums its keys in the same order). On Sapphire Rapids, float32, 2 threads, the VAE
// mid-block took 0.92x (512px) and 0.87x (1024px) the time with avx512, 0.98x and 0.94x with
// avx2 (256-key passes within 1-3% of whole tiles); with avx2 at head dim 128 (Flux) whole-tile
// passes were 2% slower, hence only from kLargeDimV.
constexpr int kPvKeyChunkPanels = 64;
int64_t panel_pv_key_chunk(const AttentionParams& p, int64_t block_k) {
  return p.head_dim_v >= kLargeDimV ? block_k : kPvKeyChunkPanels;
}

// Whether the operand of head dim `dim` (K's head_dim or V's head_dim_v) is packed in panels.
bool panel_operand(const AttentionParams& p, int64_t dim) {
  if (!kPanelsMeasured || dim < kPanelMinDim) return false;
  return (p.len_q >= kPanelMinLength && p.len_k >= kPanelMinLength) || dim >= kLargeDimV;
}

// Whether this variant runs kStreamedQueryTile-query tiles on this core (see above).
bool streamed_tiles_fit() {
  if (!kStreamedTilesMeasured) return false;
  return kVecBytes == 64 || planning_l2_bytes() >= kStreamedTileMinL2;
}

// Queries per task over K panels (long sequences, head dims from kPanelMinDim) with 256-bit
// vectors: 32. Their Q^T (16 KiB at head dim 128, where 64 queries fill a 32 KiB L1 by
// themselves), S^T and O^T tiles take half the cache, for twice the streaming of K and V (those
// tasks read them from L3 either way). On Zen 3 (float32, 2 threads, outputs bit-identical;
// A/B of the builds in one process, rounds in alternating order, noise about +-4%): SD-2.1
// 96x96 0.87x the time, 48x48 0.94x, SDXL 64x64 0.90x, SD3 0.95x, Flux 0.90-0.97x, HiDream
// 0.90-1.01x; bfloat16 inputs (SD-2.1 48x48, SDXL 64x64, Flux) 0.93-0.94x. Not kept: 256-key
// tiles with 64 queries instead (1.02-1.05x the time of this); 32 queries at the VAE's head dim
// 512 (1.18x), at head dim 160 on SD-1.5's short sequences (no panels: 1.02-1.06x), at head dim
// 40 (SD-1.5 64x64, no panels: 1.03x), and in the int8 kernel, whose Q^T is 8-bit codes
// (1.01-1.02x; plan_int8). Not measured with other vector widths. Taller tiles for K and V
// streamed from memory (kStreamedQueryTile, e.g. video lengths on cores with 1 MiB of L2) keep
// their height; halving for parallelism works from 32 as from 64.
constexpr int64_t kPanelQueryTile = 32;
constexpr bool kPanelQueryTileMeasured = kVecBytes == 32;

// The tallest query tile for the call: streamed, over float32 K panels, or the default.
int64_t tallest_query_tile(const AttentionParams& p, bool float_k_panels) {
  const int64_t kv_bytes = p.len_k * (p.head_dim + p.head_dim_v) * int64_t{sizeof(float)};
  if (kv_bytes > kStreamedKvBytes && streamed_tiles_fit()) return kStreamedQueryTile;
  const bool panel_tile = kPanelQueryTileMeasured && float_k_panels && p.head_dim < kLargeDimV;
  return panel_tile ? kPanelQueryTile : kMaxQueryTile;
}

// Queries per task for `threads` threads (shared by plan_tiled, plan_pairs and plan_int8), the
// tallest tile halved while there would be too few tasks. `float_k_panels`: S^T = K Q^T runs
// over float32 K panels (plan_tiled's k_panels).
int64_t query_tile_for(const AttentionParams& p, int threads, bool float_k_panels) {
  const int64_t heads_rows = p.batch * p.heads_q;
  int64_t block_q = tallest_query_tile(p, float_k_panels);
  while (block_q > kMinQueryTile &&
         heads_rows * ceil_div(p.len_q, block_q) < kTasksPerThread * threads) {
    block_q /= 2;
  }
  return block_q;
}

// ---------------------------------------------------------------- plan
struct Tiling {
  ForwardSchedule schedule;  // block_q: queries per task, a multiple of kLanes
  int64_t block_k;           // keys per tile
  int64_t pv_key_chunk;      // keys per O^T += V^T P^T pass
  // Packed copies of K and V rows made first (16-bit types are converted once; float32 is
  // read in place unless its head dim is not contiguous, or its V rows alias in L1).
  bool pack_k;
  bool pack_v;
  // Packed as panels of kBlockRows keys (K) or value channels (V) instead of rows
  // (panel_operand); with K panels block_k is a multiple of kBlockRows, so key tiles start on a
  // panel.
  bool k_panels;
  bool v_panels;
  int64_t v_row_floats;  // row stride of the packed V copy (packed_v_row_floats)
};

// Where the packed V rows start in a pair's packed copy: after the packed K rows, if any (K
// panels round the keys up to whole panels).
int64_t packed_v_offset(const AttentionParams& p, const Tiling& t) {
  if (!t.pack_k) return 0;
  return (t.k_panels ? round_up(p.len_k, kBlockRows) : p.len_k) * p.head_dim;
}

// Floats between V panels: one panel holds kBlockRows channels of every key.
int64_t v_panel_stride(const AttentionParams& p) {
  return kBlockRows * p.len_k;
}

// Floats of the packed V copy (0 if V is read in place).
int64_t packed_v_floats(const AttentionParams& p, const Tiling& t) {
  if (!t.pack_v) return 0;
  if (t.v_panels) return ceil_div(p.head_dim_v, kBlockRows) * v_panel_stride(p);
  return p.len_k * t.v_row_floats;
}

// One thread's scratch, carved from schedule.scratch_floats floats.
struct ThreadScratch {
  float* qt;  // head_dim x block_q: scaled Q^T, zero in padding lanes
  float* st;  // block_k x block_q: S^T, then P^T
  float* ot;  // head_dim_v x block_q: running O^T
  float* m;   // block_q: running max
  float* l;   // block_q: running sum
};

int64_t scratch_floats(const AttentionParams& p, int64_t block_q, int64_t block_k) {
  return block_q * (p.head_dim + block_k + p.head_dim_v + 2);
}

ThreadScratch carve_scratch(const AttentionParams& p, const Tiling& t, float* base) {
  const int64_t block_q = t.schedule.block_q;
  ThreadScratch ws{};
  ws.qt = base;
  ws.st = ws.qt + p.head_dim * block_q;
  ws.ot = ws.st + t.block_k * block_q;
  ws.m = ws.ot + p.head_dim_v * block_q;
  ws.l = ws.m + block_q;
  return ws;
}

// The plan of the float32-compute kernel: every blocking decision for one call.
template <typename T>
Tiling plan_tiled(const AttentionParams& p, int threads) {
  Tiling t{};
  ForwardSchedule& s = t.schedule;
  t.k_panels = panel_operand(p, p.head_dim);
  t.v_panels = panel_operand(p, p.head_dim_v);
  const int64_t key_tile = t.k_panels ? kKeyTile / kBlockRows * kBlockRows : kKeyTile;
  t.block_k = min_i64(key_tile, max_i64(p.len_k, 1));
  t.pv_key_chunk = t.v_panels ? panel_pv_key_chunk(p, t.block_k) : pv_key_chunk_for(p);
  // The kernels read float32 K and V as rows with unit stride along the head dim; only other
  // layouts (e.g. a transposed view), 16-bit types (converted once here), V rows that alias in
  // L1 (aliasing_v_rows), long (B, L, H, D) rows (strided_rows_copied) and panels need a
  // packed copy.
  const bool convert = !__is_same(T, float);
  t.pack_k = convert || p.k_stride[3] != 1 || t.k_panels ||
             strided_rows_copied(p, p.k_stride[2], p.head_dim);
  t.pack_v = convert || p.v_stride[3] != 1 || aliasing_v_rows(p, p.v_stride[2]) || t.v_panels ||
             strided_rows_copied(p, p.v_stride[2], p.head_dim_v);
  t.v_row_floats = packed_v_row_floats(p);
  s.block_q = query_tile_for(p, threads, t.k_panels);
  const bool packs = t.pack_k || t.pack_v;
  s.pack_tiles = packs ? ceil_div(p.len_k, t.block_k) : 0;  // one item per key tile
  s.pair_floats = packed_v_offset(p, t) + packed_v_floats(p, t);
  s.pairs_per_chunk = pairs_per_pack_budget(p, s.pair_floats, kPackBudgetBytes);
  s.scratch_floats = scratch_floats(p, s.block_q, t.block_k);
  return t;
}

// ---------------------------------------------------------------- packing
// Rows [first, first + count) of a (len, dim) matrix with strides (row, col) into dst, whose
// rows start `dst_stride` floats apart (the padding past `dim` is left unwritten: never read).
template <typename T>
void pack_rows(const T* src, int64_t row_stride, int64_t col_stride, int64_t dim, int64_t first,
               int64_t count, int64_t dst_stride, float* dst) {
  for (int64_t j = first; j < first + count; ++j) {
    const T* s = src + j * row_stride;
    float* d = dst + j * dst_stride;
    int64_t c = 0;
    if (col_stride == 1) {
      for (; c + kLanes <= dim; c += kLanes) store(d + c, load_as_float(s + c));
    }
    for (; c < dim; ++c) d[c] = to_float(s[c * col_stride]);
  }
}

// Rows [r0, r0 + rows) of the broadcast operand A(r, i) = src[r * r_stride + i * i_stride],
// i in [0, depth), into panels of kBlockRows rows: A(r, i) goes to
// dst[(r / kBlockRows) * panel_stride + i * kBlockRows + r % kBlockRows] (broadcast_fma_panels
// reads them). K is A with rows = keys (panel_stride = kBlockRows * head_dim); V is A with
// rows = value channels and depth = keys (r0 = 0, the key tile's keys as [i0, i0 + depth),
// panel_stride = v_panel_stride). The loop walks the source along its unit stride.
template <typename T>
void pack_panels(const T* src, int64_t r_stride, int64_t i_stride, int64_t r0, int64_t rows,
                 int64_t i0, int64_t depth, int64_t panel_stride, float* dst) {
  if (r_stride >= i_stride) {  // rows of A are contiguous (K): panel by panel
    for (int64_t r = r0; r < r0 + rows; ++r) {
      float* d = dst + (r / kBlockRows) * panel_stride + r % kBlockRows;
      for (int64_t i = i0; i < i0 + depth; ++i)
        d[i * kBlockRows] = to_float(src[r * r_stride + i * i_stride]);
    }
  } else {  // columns of A are contiguous (V rows): one V row into every panel
    for (int64_t i = i0; i < i0 + depth; ++i) {
      float* d = dst + i * kBlockRows;
      for (int64_t r = r0; r < r0 + rows; ++r)
        d[(r / kBlockRows) * panel_stride + r % kBlockRows] =
            to_float(src[r * r_stride + i * i_stride]);
    }
  }
}

// V rows of keys [k0, k0 + count) of one (batch, kv-head) pair into its packed copy: panels
// if t.v_panels, else rows t.v_row_floats apart. Shared with the int8 kernel.
template <typename T>
void pack_value_rows(const AttentionParams& p, const Tiling& t, int64_t pair, int64_t k0,
                     int64_t count, float* v_pack) {
  const int64_t b = pair / p.heads_kv, hkv = pair % p.heads_kv;
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + hkv * p.v_stride[1];
  if (t.v_panels) {
    pack_panels(v, p.v_stride[3], p.v_stride[2], 0, p.head_dim_v, k0, count, v_panel_stride(p),
                v_pack);
  } else {
    pack_rows(v, p.v_stride[2], p.v_stride[3], p.head_dim_v, k0, count, t.v_row_floats, v_pack);
  }
}

// Keys [tile * block_k, + block_k) of one (batch, kv-head) pair into its packed copy: K (len_k
// rows of head_dim floats, or panels of kBlockRows keys) if t.pack_k, then V (pack_value_rows)
// if t.pack_v.
template <typename T>
void pack_key_tile(const AttentionParams& p, const Tiling& t, int64_t pair, int64_t tile,
                   float* packed) {
  const int64_t b = pair / p.heads_kv, hkv = pair % p.heads_kv;
  const int64_t k0 = tile * t.block_k, count = min_i64(t.block_k, p.len_k - k0);
  if (t.pack_k) {
    const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hkv * p.k_stride[1];
    if (t.k_panels) {
      pack_panels(k, p.k_stride[2], p.k_stride[3], k0, count, 0, p.head_dim,
                  kBlockRows * p.head_dim, packed);
    } else {
      pack_rows(k, p.k_stride[2], p.k_stride[3], p.head_dim, k0, count, p.head_dim, packed);
    }
  }
  if (t.pack_v) pack_value_rows<T>(p, t, pair, k0, count, packed + packed_v_offset(p, t));
}

// ---------------------------------------------------------------- micro-kernels
// The two products of a key tile use the shared register-blocked kernel (vec_impl.h):
//   S^T[j][q] = sum_d K[j][d] * Q^T[d][q]       broadcast_fma<kRowMajor, false> (A = K rows)
//   O^T[c][q] += sum_j V[j][c] * P^T[j][q]      broadcast_fma<kColMajor, true>  (A = V columns)
// both visiting row blocks outside query groups (BlockOrder::kRowBlocksOuter): with AVX-512 a
// 64-query tile is one group and the order changes nothing; with AVX2's four groups it keeps
// the 6 K rows (or V columns) of a block in L1 for all four, where the groups-outer order
// streamed each group's Q^T slice through a quarter of L1's sets (vec_impl.h). Measured on the
// VAE mid-block shape (Dv 512, `avx2` variant, Zen 4 with AVX-512 off), with 16-key P*V passes:
// 8-15% faster, results bit-identical (same summation order per element).

template <typename T>
void load_scaled_queries_transposed(const AttentionParams& p, const QueryTile& qt_tile,
                                    const Tiling& t, float* qt) {
  const T* q_head =
      static_cast<const T*>(p.q) + qt_tile.batch * p.q_stride[0] + qt_tile.head * p.q_stride[1];
  const T* q_rows = q_head + qt_tile.q0 * p.q_stride[2];
  const int64_t si = p.q_stride[2], sd = p.q_stride[3];
  const int64_t lanes = qt_tile.vecs * kLanes;
  int64_t d_done = 0;
  if (sd == 1 && qt_tile.rows == lanes) {
    // Whole kLanes x kLanes blocks: load query rows, transpose in registers, store columns.
    const Vec scale = splat(p.scale);
    for (; d_done + kLanes <= p.head_dim; d_done += kLanes) {
      for (int64_t i0 = 0; i0 < lanes; i0 += kLanes) {
        Vec r[kLanes];
        for (int i = 0; i < kLanes; ++i) r[i] = load_as_float(q_rows + (i0 + i) * si + d_done);
        transpose_block(r);
        for (int d = 0; d < kLanes; ++d)
          store(qt + (d_done + d) * t.schedule.block_q + i0, r[d] * scale);
      }
    }
  }
  for (int64_t d = d_done; d < p.head_dim; ++d) {
    float* row = qt + d * t.schedule.block_q;
    const T* src = q_rows + d * sd;
    for (int64_t i = 0; i < qt_tile.rows; ++i) row[i] = to_float(src[i * si]) * p.scale;
    for (int64_t i = qt_tile.rows; i < lanes; ++i) row[i] = 0.0f;
  }
}

// Adds the user's mask to S^T (keys x queries) for keys [k0, k0 + keys).
void apply_user_mask(const AttentionParams& p, const QueryTile& tile, int64_t k0, int64_t keys,
                     float* st, int64_t ldst) {
  const int64_t* ms = p.mask_stride;
  const int64_t base = tile.batch * ms[0] + tile.head * ms[1] + tile.q0 * ms[2];
  for (int64_t j = 0; j < keys; ++j) {
    float* row = st + j * ldst;
    const int64_t off = base + (k0 + j) * ms[3];
    if (p.mask_kind == MaskKind::kAdditive) {
      const float* m = static_cast<const float*>(p.mask) + off;
      if (ms[2] == 0) {  // broadcast over queries (key padding masks): one value per key
        const Vec mv = splat(m[0]);
        for (int64_t i = 0; i < tile.vecs * kLanes; i += kLanes) store(row + i, load(row + i) + mv);
      } else {
        for (int64_t i = 0; i < tile.rows; ++i) row[i] += m[i * ms[2]];
      }
    } else {
      const uint8_t* m = static_cast<const uint8_t*>(p.mask) + off;
      if (ms[2] == 0) {
        if (!m[0]) {
          for (int64_t i = 0; i < tile.vecs * kLanes; ++i) row[i] = kNegInf;
        }
      } else {
        for (int64_t i = 0; i < tile.rows; ++i) row[i] = m[i * ms[2]] ? row[i] : kNegInf;
      }
    }
  }
}

// Causal (top-left): query q0+i sees key k iff k <= q0+i, so key row k hides queries < k-q0.
void apply_causal(const QueryTile& tile, int64_t k0, int64_t keys, float* st, int64_t ldst) {
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t hidden = min_i64(tile.vecs * kLanes, k0 + j - tile.q0);
    float* row = st + j * ldst;
    for (int64_t i = 0; i < hidden; ++i) row[i] = kNegInf;
  }
}

// Online softmax, first half, shared by the float32 kernel (softmax_update) and the bfloat16
// pair kernels (softmax_update_pairs): each query's max over the tile's keys of S^T (times
// `score_scale` when Scaled), the new running max m, and the running O^T and sum l rescaled by
// alpha = exp(m_old - m_new); `shift` gets what the exponentials subtract and `sum` is zeroed
// for them. Always inlined into both, so each compiles to the instructions it had when it held
// these loops itself (checked on the objects: the same instruction mix, up to register
// allocation).
// The second half (exponentials and their sum) is not shared: the float32 kernel writes P^T in
// place over S^T as float32 (one row per key), the pair kernels write it to a separate buffer as
// bfloat16 key pairs (one row per two keys, the vdpbf16ps/AMX operand layout), so the loops over
// keys, the stores and the odd-key tail all differ.
template <int Vecs, bool Scaled>
NPU_ATTN_VEC_INLINE void softmax_rescale(const AttentionParams& p, int64_t ld, int64_t keys,
                                         const float* st, float score_scale, ThreadScratch& ws,
                                         Vec (&shift)[Vecs], Vec (&sum)[Vecs]) {
  Vec m_tile[Vecs];
#pragma GCC unroll 16
  for (int v = 0; v < Vecs; ++v) m_tile[v] = splat(kNegInf);
  // Max over keys, skipping NaN (a NaN score still reaches the output through exp). Folding the
  // maxima into S^T = K Q^T's register blocks instead, as they store S^T (no pass over the tile,
  // which is read from L2), measured 1.00x the time (avx2 with AVX-512 hidden on Zen 4, float32,
  // 2 threads, 17 model shapes, A/B of the builds: 0.98-1.05x), so the pass stays.
  for (int64_t j = 0; j < keys; ++j) {
#pragma GCC unroll 16
    for (int v = 0; v < Vecs; ++v)
      m_tile[v] = max_ignoring_nan(load(st + j * ld + v * kLanes), m_tile[v]);
  }
  const Vec factor = splat(score_scale);
#pragma GCC unroll 16
  for (int v = 0; v < Vecs; ++v) {
    if constexpr (Scaled) m_tile[v] *= factor;  // -inf stays -inf: factor > 0
    const Vec m_old = load(ws.m + v * kLanes);
    const Vec m_new = m_tile[v] > m_old ? m_tile[v] : m_old;
    // Queries whose keys are all masked so far have m = -inf; shifting by 0 keeps their
    // probabilities exactly 0 (exp(-inf)) instead of NaN (exp(-inf - -inf)).
    shift[v] = m_new == kNegInf ? splat(0.0f) : m_new;
    const Vec alpha = exp_nonpositive(m_old - shift[v]);
    store(ws.m + v * kLanes, m_new);
    store(ws.l + v * kLanes, load(ws.l + v * kLanes) * alpha);
    // Where no lane's maximum moved, alpha is exactly 1 in every lane (exp_nonpositive(0) ==
    // 1.0f; a row still fully masked has O^T == 0, which alpha == 0 would leave unchanged),
    // so rescaling O^T would change nothing: skipped, the results are bit-identical. Past the
    // first key tiles the running maxima rarely move, and for large head dims this pass over
    // O^T (head_dim_v x block_q floats per key tile) costs as much as the tile products.
    // Skipped too while every lane's maximum is still -inf (the query tile's first key tile):
    // O^T then holds only zeros (P was 0) or NaN, which alpha == 0 leaves as they are. Calls of
    // one key tile (SD-1.5's 8x8 level, cross-attention to 77 tokens) took 0.96-0.98x the time
    // without that pass (Zen 3, float32, 2 threads, 30 interleaved rounds in both orders).
    if (any_lane_differs(m_new, m_old) && any_lane_differs(m_old, splat(kNegInf))) {
      for (int64_t c = 0; c < p.head_dim_v; ++c) {
        float* o = ws.ot + c * ld + v * kLanes;
        store(o, load(o) * alpha);
      }
    }
    sum[v] = splat(0.0f);
  }
}

// ---------------------------------------------------------------- huge scores
// The exponentials' argument is one FMA, s log2(e) - shift log2(e), with shift log2(e) rounded
// once per query (and m * scale before it in the pair kernels): that rounding moves every
// probability of the query computed with one shift by the same factor, which cancels in P / l;
// tiles computed before the running maximum moved carry another factor. Both stay within
// |shift| 2^-23 or so in the exponent, the size of the scores' own float32 rounding, so they add
// no error the scores do not carry already. Up to |shift| = 2^20 that is 2^(+-0.2) at most;
// beyond, it grows with the shift (scores of 1e10: 2^(+-860), so P overflows or vanishes), and
// a maximum of -FLT_MAX (a row that a float mask of torch.finfo(float32).min, as transformers
// builds padding masks, hides entirely) makes shift log2(e) -inf and every argument NaN.
// Tiles with such a shift are therefore scaled and shifted first (shift_huge_scores), as
// torch's softmax computes them: s * scale rounded, then s - max, exact near the max.
constexpr float kFusedShiftLimit = 1048576.0f;

template <int Vecs>
NPU_ATTN_VEC_INLINE bool any_shift_beyond_limit(const Vec (&shift)[Vecs]) {
  IVec beyond = IVec{};
#pragma GCC unroll 16
  for (int v = 0; v < Vecs; ++v)
    beyond |= (shift[v] > splat(kFusedShiftLimit)) | (shift[v] < splat(-kFusedShiftLimit));
  return any_lane(beyond);
}

// S^T rows (`keys` rows of `vecs` vectors) times score_scale, each product rounded: not
// inlined, so no FMA can fuse it with the subtraction that follows (subtract_score_shifts).
__attribute__((noinline)) void scale_score_rows(float* st, int64_t ld, int64_t keys, int64_t vecs,
                                                float score_scale) {
  const Vec factor = splat(score_scale);
  for (int64_t j = 0; j < keys; ++j)
    for (int64_t v = 0; v < vecs; ++v)
      store(st + j * ld + v * kLanes, load(st + j * ld + v * kLanes) * factor);
}

// S^T rows minus each query's shift (`vecs` vectors of shifts).
__attribute__((noinline)) void subtract_score_shifts(float* st, int64_t ld, int64_t keys,
                                                     int64_t vecs, const Vec* shift) {
  for (int64_t j = 0; j < keys; ++j)
    for (int64_t v = 0; v < vecs; ++v)
      store(st + j * ld + v * kLanes, load(st + j * ld + v * kLanes) - shift[v]);
}

// Where any query's shift is beyond kFusedShiftLimit: S^T scaled by score_scale and shifted in
// place, the shifts set to 0; returns the scale left for the exponentials (1 then, else
// score_scale). Masked scores stay -inf and NaN stays NaN.
template <int Vecs>
NPU_ATTN_VEC_INLINE float shift_huge_scores(float* st, int64_t ld, int64_t keys, float score_scale,
                                            Vec (&shift)[Vecs]) {
  if (!any_shift_beyond_limit(shift)) return score_scale;
  if (score_scale != 1.0f) scale_score_rows(st, ld, keys, Vecs, score_scale);
  subtract_score_shifts(st, ld, keys, Vecs, shift);
#pragma GCC unroll 16
  for (int v = 0; v < Vecs; ++v) shift[v] = splat(0.0f);
  return 1.0f;
}

// Query vectors per pass of the exponentials over a key tile: the pass keeps two values per
// vector (its shift and its running sum) in registers next to the exponentials' ten constants
// and temporaries. With 16 registers (AVX2) and 4 or 8 vectors (32- and 64-query tiles) GCC
// spilled sums and shifts to the stack, and their loop-carried add then went through a store
// and a reload; two vectors (one 64-byte line of each S^T row) per pass fit. With 32 registers
// one pass covers the tile.
constexpr int kExpPassVecs = NPU_ATTN_VEC_REGISTERS >= 32 ? kTileQueryVecs : 2;

// The exponentials of `Vecs` query vectors (lanes from `st`) over `keys` rows of S^T, in place:
// P^T = exp(S^T - shift) = 2^(S^T log2(e) - shift log2(e)), and their sums over the keys into
// sum_out.
template <int Vecs>
NPU_ATTN_VEC_INLINE void exp_pass(float* st, int64_t ld, int64_t keys, const Vec* shift,
                                  Vec* sum_out) {
  const Vec log2e = splat(kLog2e);
  Vec shift2[Vecs], sum[Vecs];
#pragma GCC unroll 16
  for (int v = 0; v < Vecs; ++v) {
    shift2[v] = shift[v] * log2e;
    sum[v] = splat(0.0f);
  }
  for (int64_t j = 0; j < keys; ++j) {
#pragma GCC unroll 16
    for (int v = 0; v < Vecs; ++v) {
      float* s = st + j * ld + v * kLanes;
      const Vec e = exp2_nonpositive(load(s) * log2e - shift2[v]);
      store(s, e);
      sum[v] += e;
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < Vecs; ++v) sum_out[v] = sum[v];
}

// Online softmax over one key tile of S^T, one lane per query, turning S^T into P^T in place
// and rescaling the running O^T and sum by alpha = exp(m_old - m_new). Templated on the number
// of query vectors so the per-vector state lives in registers.
// The exponentials are taken in base 2 (exp2_nonpositive): exp(s - shift) = 2^(s log2(e) -
// shift log2(e)), one FMA per score. The rounding of shift log2(e) is the same for every key
// of a query, so it cancels in P / l.
template <int Vecs>
void softmax_update(const AttentionParams& p, int64_t ld, int64_t keys, ThreadScratch& ws) {
  Vec shift[Vecs], sum[Vecs];
  softmax_rescale<Vecs, false>(p, ld, keys, ws.st, 1.0f, ws, shift, sum);
  shift_huge_scores(ws.st, ld, keys, 1.0f, shift);
  constexpr int kPass = kExpPassVecs < Vecs ? kExpPassVecs : Vecs;
  constexpr int kWhole = Vecs / kPass * kPass;
#pragma GCC unroll 16
  for (int v0 = 0; v0 < kWhole; v0 += kPass)
    exp_pass<kPass>(ws.st + v0 * kLanes, ld, keys, shift + v0, sum + v0);
  if constexpr (kWhole < Vecs)
    exp_pass<Vecs - kWhole>(ws.st + kWhole * kLanes, ld, keys, shift + kWhole, sum + kWhole);
#pragma GCC unroll 16
  for (int v = 0; v < Vecs; ++v) store(ws.l + v * kLanes, load(ws.l + v * kLanes) + sum[v]);
}

// Takes the Tiling (of which it reads only schedule.block_q, the leading dimension of O^T) and
// reads it at every use, like load_scaled_queries_transposed: GCC then compiles both as before
// the driver refactor. With the leading dimension passed by value it kept it in a register and
// spilled more in the unrolled transposes (bfloat16 write_output: 1140 instead of 985
// instructions).
template <typename T>
void write_output_as(const AttentionParams& p, const QueryTile& tile, const Tiling& t,
                     const ThreadScratch& ws) {
  T* out_head = static_cast<T*>(p.out) + tile.batch * p.out_stride[0] + tile.head * p.out_stride[1];
  T* out_rows = out_head + tile.q0 * p.out_stride[2];
  const int64_t sc = p.out_stride[3], si = p.out_stride[2];
  // 1 / l per query; queries with every key masked have l == 0: output 0 like torch's SDPA.
  for (int64_t i = 0; i < tile.vecs * kLanes; ++i)
    ws.l[i] = ws.l[i] == 0.0f ? 0.0f : 1.0f / ws.l[i];
  int64_t c_done = 0;
  if (sc == 1 && tile.rows == tile.vecs * kLanes) {
    // Whole blocks: load O^T rows (one channel, kLanes queries), transpose, store query rows.
    for (; c_done + kLanes <= p.head_dim_v; c_done += kLanes) {
      for (int64_t i0 = 0; i0 < tile.rows; i0 += kLanes) {
        Vec r[kLanes];
        for (int c = 0; c < kLanes; ++c)
          r[c] = load(ws.ot + (c_done + c) * t.schedule.block_q + i0);
        transpose_block(r);
        for (int i = 0; i < kLanes; ++i) {
          store_from_float(out_rows + (i0 + i) * si + c_done, r[i] * splat(ws.l[i0 + i]));
        }
      }
    }
  }
  for (int64_t i = 0; i < tile.rows; ++i) {
    T* dst = out_rows + i * si;
    for (int64_t c = c_done; c < p.head_dim_v; ++c) {
      dst[c * sc] = from_float<T>(ws.ot[c * t.schedule.block_q + i] * ws.l[i]);
    }
  }
  if (p.lse != nullptr) {
    float* lse = p.lse + tile.batch * p.lse_stride[0] + tile.head * p.lse_stride[1];
    for (int64_t i = 0; i < tile.rows; ++i) {
      const float inv = ws.l[i];
      lse[(tile.q0 + i) * p.lse_stride[2]] = inv == 0.0f ? kNegInf : ws.m[i] - __builtin_logf(inv);
    }
  }
}

// The tile's output in the call's element type, or in float32 where a 16-bit call keeps its
// unrounded output for the backward (AttentionParams::out_float32).
template <typename T>
void write_output(const AttentionParams& p, const QueryTile& tile, const Tiling& t,
                  const ThreadScratch& ws) {
  if constexpr (!std::is_same_v<T, float>) {
    if (p.out_float32) return write_output_as<float>(p, tile, t, ws);
  }
  write_output_as<T>(p, tile, t, ws);
}

// K and V rows of one (batch, kv-head) pair: in the caller's tensors or in the packed copy.
struct KeyValueRows {
  const float* k;
  int64_t k_row_stride;
  const float* v;
  int64_t v_row_stride;
};

// The running softmax state of a query tile before its first key: m = -inf, l = 0, O^T = 0.
void start_query_tile(const AttentionParams& p, const Tiling& t, const QueryTile& tile,
                      ThreadScratch& ws) {
  const int64_t ld = t.schedule.block_q;
  for (int64_t i = 0; i < tile.vecs * kLanes; ++i) {
    ws.m[i] = kNegInf;
    ws.l[i] = 0.0f;
  }
  for (int64_t c = 0; c < p.head_dim_v; ++c)
    for (int64_t i = 0; i < tile.vecs * kLanes; ++i) ws.ot[c * ld + i] = 0.0f;
}

// Keys past the tile's last query are hidden from every query in it when causal.
int64_t key_limit_for(const AttentionParams& p, const QueryTile& tile) {
  return p.is_causal ? min_i64(p.len_k, tile.q0 + tile.rows) : p.len_k;
}

// Masks and the online softmax of keys [k0, k0 + keys), whose scaled scores are in ws.st (keys x
// queries): leaves P^T there (float32, in place) and updates m, l and the running O^T.
void key_tile_probabilities(const AttentionParams& p, const Tiling& t, const QueryTile& tile,
                            int64_t k0, int64_t keys, ThreadScratch& ws) {
  const int64_t ld = t.schedule.block_q;
  if (p.mask_kind != MaskKind::kNone) apply_user_mask(p, tile, k0, keys, ws.st, ld);
  if (p.is_causal && k0 + keys > tile.q0) apply_causal(tile, k0, keys, ws.st, ld);
  with_count<kTileQueryVecs>(
      tile.vecs, [&](auto vecs) { softmax_update<decltype(vecs)::value>(p, ld, keys, ws); });
}

// O^T (Dv x queries) += V_tile^T P^T for keys [k0, k0 + keys), in L1-sized key chunks.
// `v_rows` are the pair's V rows (row 0 = key 0, `v_row_stride` apart), or with t.v_panels its
// V panels (pack_value_rows; the stride is then unused).
void accumulate_values(const AttentionParams& p, const Tiling& t, const float* v_rows,
                       int64_t v_row_stride, const QueryTile& tile, int64_t k0, int64_t keys,
                       ThreadScratch& ws) {
  const int64_t ld = t.schedule.block_q;
  for (int64_t j0 = 0; j0 < keys; j0 += t.pv_key_chunk) {
    const int64_t chunk = min_i64(t.pv_key_chunk, keys - j0);
    if (t.v_panels) {
      broadcast_fma_panels<true>(v_rows + (k0 + j0) * kBlockRows, v_panel_stride(p),
                                 ws.st + j0 * ld, ld, chunk, p.head_dim_v, tile.vecs, ws.ot, ld);
    } else {
      broadcast_fma<ALayout::kColMajor, true, BlockOrder::kRowBlocksOuter>(
          v_rows + (k0 + j0) * v_row_stride, v_row_stride, ws.st + j0 * ld, ld, chunk, p.head_dim_v,
          tile.vecs, ws.ot, ld);
    }
  }
}

// Everything after S^T of keys [k0, k0 + keys) is in ws.st: masks, the online softmax and
// O^T += V_tile^T P^T. The int8 kernel (attention_int8_impl.h) computes S^T differently and
// calls the two halves itself.
void finish_key_tile(const AttentionParams& p, const Tiling& t, const float* v_rows,
                     int64_t v_row_stride, const QueryTile& tile, int64_t k0, int64_t keys,
                     ThreadScratch& ws) {
  key_tile_probabilities(p, t, tile, k0, keys, ws);
  accumulate_values(p, t, v_rows, v_row_stride, tile, k0, keys, ws);
}

template <typename T>
void run_query_tile(const AttentionParams& p, const Tiling& t, const KeyValueRows& kv,
                    const QueryTile& tile, ThreadScratch& ws) {
  const int64_t ld = t.schedule.block_q;
  load_scaled_queries_transposed<T>(p, tile, t, ws.qt);
  start_query_tile(p, t, tile, ws);
  const int64_t key_limit = key_limit_for(p, tile);
  for (int64_t k0 = 0; k0 < key_limit; k0 += t.block_k) {
    const int64_t keys = min_i64(t.block_k, key_limit - k0);
    // S^T (keys x queries) = K_tile (keys x D) * Q^T (D x queries)
    // Over K panels rows-outer too: walking column groups outside (each group's Q^T slice,
    // 8 KiB at head dim 128, then stays in L1) measured 0.99-1.07x the time on Zen 3 (float32,
    // 2 threads; SD2.1 96x96, SDXL 64x64, SD3, Flux (1.07x), HiDream), so it was not kept.
    if (t.k_panels) {  // k0 is a whole number of panels (plan_tiled)
      broadcast_fma_panels<false>(kv.k + k0 * p.head_dim, kBlockRows * p.head_dim, ws.qt, ld,
                                  p.head_dim, keys, tile.vecs, ws.st, ld);
    } else {
      broadcast_fma<ALayout::kRowMajor, false, BlockOrder::kRowBlocksOuter>(
          kv.k + k0 * kv.k_row_stride, kv.k_row_stride, ws.qt, ld, p.head_dim, keys, tile.vecs,
          ws.st, ld);
    }
    finish_key_tile(p, t, kv.v, kv.v_row_stride, tile, k0, keys, ws);
  }
  write_output<T>(p, tile, t, ws);
}

// ---------------------------------------------------------------- family traits
// K and V rows of one (batch, kv-head) pair: each from the packed copy, or float32 read in place
// (plan_tiled packs every other type).
KeyValueRows pair_rows(const AttentionParams& p, const Tiling& t, const float* packed,
                       const QueryTask& task) {
  const int64_t b = task.tile.batch, hkv = task.hkv;
  KeyValueRows rows{};
  if (t.pack_k) {
    rows.k = packed;  // rows, or panels of kBlockRows keys (t.k_panels)
    rows.k_row_stride = p.head_dim;
  } else {
    rows.k = static_cast<const float*>(p.k) + b * p.k_stride[0] + hkv * p.k_stride[1];
    rows.k_row_stride = p.k_stride[2];
  }
  if (t.pack_v) {
    rows.v = packed + packed_v_offset(p, t);
    rows.v_row_stride = t.v_row_floats;
  } else {
    rows.v = static_cast<const float*>(p.v) + b * p.v_stride[0] + hkv * p.v_stride[1];
    rows.v_row_stride = p.v_stride[2];
  }
  return rows;
}

// The float32-compute family for run_forward (forward_driver_impl.h): T is the element type of
// the tensors (float, BFloat16 or Half); everything is computed in float32.
template <typename T>
struct TiledFamily {
  // The thread clamp counts tasks of one vector of queries each (plan_tiled's tiles are
  // larger; the count only caps the thread count).
  static constexpr int64_t kThreadClampQueries = kLanes;
  typedef Tiling Plan;
  typedef ThreadScratch Scratch;

  static Plan make_plan(const AttentionParams& p, int threads) { return plan_tiled<T>(p, threads); }
  static Scratch enter_thread(const AttentionParams& p, const Plan& t, float* scratch) {
    return carve_scratch(p, t, scratch);
  }
  static void leave_thread(Scratch&) {}
  static void pack(const AttentionParams& p, const Plan& t, int64_t pair, int64_t key_tile,
                   float* pair_pack) {
    pack_key_tile<T>(p, t, pair, key_tile, pair_pack);
  }
  static void run(const AttentionParams& p, const Plan& t, const QueryTask& task,
                  const float* pair_pack, Scratch& ws) {
    run_query_tile<T>(p, t, pair_rows(p, t, pair_pack, task), task.tile, ws);
  }
};

inline void attention_forward_tiled(const AttentionParams& p) {
  switch (p.element) {
    case ElementType::kFloat32:
      return run_forward<TiledFamily<float>>(p);
    case ElementType::kBFloat16:
      return run_forward<TiledFamily<BFloat16>>(p);
    case ElementType::kFloat16:
      return run_forward<TiledFamily<Half>>(p);
  }
}

}  // namespace
}  // namespace npu_attn
