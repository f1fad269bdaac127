// What the AMX kernels share: the tile configuration (every tile 16 rows x 64 bytes) and a
// plain tile product for operands already laid out in whole tiles.
//
// tdpbf16ps C += A B: A is 16 rows of 32 bfloat16 (16 pair words along the reduced dimension),
// B 16 rows of pair words (one row per pair of the reduced dimension) x 16 columns, C 16 x 16
// float32. So a row-major matrix of pair words is an A operand as it is, and a matrix of pairs
// along its rows (vdpbf16ps's B layout, pack_row_pairs) is a B operand as it is.
// (tests/cpp/amx_emulation.h, included first, stands in for the tile unit in tests.)
#pragma once
#if !(defined(__AMX_TILE__) && defined(__AMX_BF16__) || defined(NPU_ATTN_AMX_EMULATED))
#error "amx_tiles_impl.h needs -mamx-tile -mamx-bf16"
#endif

#include <immintrin.h>

#include <cassert>
#include <cstdint>

namespace npu_attn {
namespace {

constexpr int64_t kTileRows = 16;   // rows of every tile
constexpr int64_t kTileWords = 16;  // 32-bit words per tile row (16 floats or 16 bf16 pairs)

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile used here is 16 rows x 64 bytes (16 floats, 32 bfloat16 or 16 pair words). The
// configuration is a constant in memory: GCC 12's _tile_loadconfig tells the compiler it reads
// only 8 bytes, so a configuration built on the stack could be (and was) partly optimised away.
constexpr TileConfig kTileConfig = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

inline void configure_tiles() {
  _tile_loadconfig(&kTileConfig);
}

// One block of C: two 16-row tiles of rows (a0, a1 / c0, c1) by ColTiles (1 or 2) 16-column
// tiles, accumulators in tiles 0-3, A in 4-5, B in 6-7; strides in bytes.
template <bool Accumulate, int ColTiles>
inline void tile_block(const uint32_t* a0, const uint32_t* a1, int64_t sa, const uint32_t* b,
                       int64_t ldb, int64_t sb, int64_t depth, float* c0, float* c1, int64_t sc) {
  static_assert(ColTiles == 1 || ColTiles == 2, "blocks are 2x1 or 2x2 tiles");
  constexpr bool two = ColTiles == 2;
  if (Accumulate) {
    _tile_loadd(0, c0, sc);
    _tile_loadd(2, c1, sc);
    if (two) _tile_loadd(1, c0 + kTileWords, sc);
    if (two) _tile_loadd(3, c1 + kTileWords, sc);
  } else {
    _tile_zero(0);
    _tile_zero(2);
    if (two) _tile_zero(1);
    if (two) _tile_zero(3);
  }
  for (int64_t d = 0; d < depth; d += kTileWords) {
    _tile_loadd(4, a0 + d, sa);
    _tile_loadd(5, a1 + d, sa);
    _tile_loadd(6, b + d * ldb, sb);
    if (two) _tile_loadd(7, b + d * ldb + kTileWords, sb);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (two) _tile_dpbf16ps(1, 4, 7);
    if (two) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c0, sc);
  _tile_stored(2, c1, sc);
  if (two) _tile_stored(1, c0 + kTileWords, sc);
  if (two) _tile_stored(3, c1 + kTileWords, sc);
}

// C (rows x cols float32, ldc) (+)= A (rows x depth pair words, lda) B (depth x cols pair words,
// ldb): rows a multiple of 32, cols and depth multiples of 16 (operands padded with zeros).
// Blocks of 2x2 accumulator tiles, so every tile load feeds two tdpbf16ps; a last 16-column
// block uses 2x1.
template <bool Accumulate>
void tile_product(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t rows,
                  int64_t depth, int64_t cols, float* c, int64_t ldc) {
  // Anything else would silently drop a tail (checked in the sanitizer build, -UNDEBUG).
  assert(rows % (2 * kTileRows) == 0 && depth % kTileWords == 0 && cols % kTileWords == 0);
  const int64_t sa = lda * 4, sb = ldb * 4, sc = ldc * 4;  // strides in bytes
  for (int64_t i = 0; i < rows; i += 2 * kTileRows) {
    const uint32_t* a0 = a + i * lda;
    float* c0 = c + i * ldc;
    int64_t j = 0;
    for (; j + 2 * kTileWords <= cols; j += 2 * kTileWords) {
      tile_block<Accumulate, 2>(a0, a0 + kTileRows * lda, sa, b + j, ldb, sb, depth, c0 + j,
                                c0 + kTileRows * ldc + j, sc);
    }
    if (j < cols) {
      tile_block<Accumulate, 1>(a0, a0 + kTileRows * lda, sa, b + j, ldb, sb, depth, c0 + j,
                                c0 + kTileRows * ldc + j, sc);
    }
  }
}

}  // namespace
}  // namespace npu_attn
