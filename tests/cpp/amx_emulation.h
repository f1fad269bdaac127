// A software tile unit, so the AMX kernels' code (tiling, packing, operand layouts, tile
// configuration) is tested on CPUs without AMX (the bfloat16 kernels wherever AVX512-BF16 runs,
// the int8 kernel on any AVX2 CPU), not only on the AMX machines a session happens to get.
// Included before an AMX kernel header, it replaces GCC's AMX intrinsics (_tile_loadconfig,
// _tile_release, _tile_loadd, _tile_stored, _tile_zero, _tile_dpbf16ps, _tile_dpbssd) by
// functions on per-thread tile registers in memory.
//
// It checks what the hardware would fault on: a tile used before a configuration was loaded
// or after it was released, a palette other than 1, non-zero reserved configuration bytes, a
// tile with zero rows or more than 16 rows or 64 bytes, tdpbf16ps operands that are not three
// distinct tiles, and tdpbf16ps/tdpbssd operands whose configured shapes do not chain (A rows =
// C rows, A bytes per row = 4 x B rows, B bytes per row = C bytes per row). Such a misuse prints
// what was wrong and aborts (test_amx_emulation.cpp checks each). Arithmetic follows tdpbf16ps:
// each bfloat16 pair product is exact in float32 and added to the float32 accumulator (the
// hardware's summation order and denormal flushing may differ in the last bit; the tests'
// tolerances are far wider); and tdpbssd: four signed byte products per int32 lane, added
// exactly (the int32 sum wraps).
//
// Test-only: slow (one scalar multiply-add per bfloat16 pair) and never part of the library.
#pragma once

#include <immintrin.h>  // first, so the definitions below replace GCC's

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace npu_attn {
namespace {  // every emulated kernel's translation unit has its own copy: no shared symbols
namespace amx_emulation {

constexpr int kTiles = 8;
constexpr int kMaxRows = 16;
constexpr int kMaxBytesPerRow = 64;

struct TileUnit {
  bool configured = false;
  uint8_t rows[kTiles] = {};
  uint16_t bytes_per_row[kTiles] = {};
  alignas(64) uint8_t data[kTiles][kMaxRows][kMaxBytesPerRow] = {};
};

inline TileUnit& unit() {
  static thread_local TileUnit tiles;
  return tiles;
}

[[noreturn]] inline void fail(const char* what, int tile) {
  std::fprintf(stderr, "emulated AMX: %s (tmm%d)\n", what, tile);
  std::abort();
}

inline void check_tile(int t) {
  if (t < 0 || t >= kTiles) fail("no such tile register", t);
  if (!unit().configured) fail("tile used without a loaded configuration", t);
  if (unit().rows[t] == 0 || unit().bytes_per_row[t] == 0) fail("tile not configured", t);
}

// The 64-byte configuration: palette, start row, 14 reserved bytes, 16 x uint16 bytes per row,
// 16 x uint8 rows (tiles 8-15 do not exist in palette 1 and must be zero).
inline void load_config(const void* config) {
  const auto* bytes = static_cast<const uint8_t*>(config);
  if (bytes[0] != 1) fail("palette must be 1", -1);
  for (int i = 2; i < 16; ++i) {
    if (bytes[i] != 0) fail("reserved configuration bytes must be zero", -1);
  }
  TileUnit& u = unit();
  for (int t = 0; t < 16; ++t) {
    uint16_t width;
    std::memcpy(&width, bytes + 16 + 2 * t, sizeof(width));
    const uint8_t rows = bytes[48 + t];
    if (t >= kTiles) {
      if (width != 0 || rows != 0) fail("palette 1 has 8 tiles", t);
      continue;
    }
    if (rows > kMaxRows || width > kMaxBytesPerRow || width % 4 != 0) fail("bad tile shape", t);
    u.rows[t] = rows;
    u.bytes_per_row[t] = width;
  }
  std::memset(u.data, 0, sizeof(u.data));
  u.configured = true;
}

inline void release() {
  unit() = TileUnit{};
}

inline void zero(int t) {
  check_tile(t);
  std::memset(unit().data[t], 0, sizeof(unit().data[t]));
}

inline void load(int t, const void* base, long stride) {
  zero(t);
  const TileUnit& u = unit();
  for (int r = 0; r < u.rows[t]; ++r)
    std::memcpy(unit().data[t][r], static_cast<const uint8_t*>(base) + r * stride,
                u.bytes_per_row[t]);
}

inline void store(int t, void* base, long stride) {
  check_tile(t);
  const TileUnit& u = unit();
  for (int r = 0; r < u.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, u.data[t][r], u.bytes_per_row[t]);
}

inline float bf16_at(const uint8_t* row, int index) {
  uint16_t half;
  std::memcpy(&half, row + 2 * index, sizeof(half));
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// What tdpbf16ps and tdpbssd fault on: operands that are not three distinct configured tiles, or
// whose shapes do not chain (A rows = C rows, A's 4-byte words per row = B rows, B row bytes =
// C row bytes).
inline void check_product(int c, int a, int b) {
  check_tile(c);
  check_tile(a);
  check_tile(b);
  if (c == a || c == b || a == b) fail("tile products need three distinct tiles", c);
  const TileUnit& u = unit();
  if (u.rows[a] != u.rows[c]) fail("A rows differ from C rows", a);
  if (u.rows[b] != u.bytes_per_row[a] / 4) fail("B rows differ from A's pairs per row", b);
  if (u.bytes_per_row[b] != u.bytes_per_row[c]) fail("B row bytes differ from C's", b);
}

// C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1], A and B bfloat16, C float32.
inline void dpbf16ps(int c, int a, int b) {
  check_product(c, a, b);
  TileUnit& u = unit();
  const int m_rows = u.rows[c], n_cols = u.bytes_per_row[c] / 4, k_pairs = u.bytes_per_row[a] / 4;
  for (int m = 0; m < m_rows; ++m) {
    for (int n = 0; n < n_cols; ++n) {
      float acc;
      std::memcpy(&acc, u.data[c][m] + 4 * n, sizeof(acc));
      for (int k = 0; k < k_pairs; ++k) {
        acc += bf16_at(u.data[a][m], 2 * k) * bf16_at(u.data[b][k], 2 * n);
        acc += bf16_at(u.data[a][m], 2 * k + 1) * bf16_at(u.data[b][k], 2 * n + 1);
      }
      std::memcpy(u.data[c][m] + 4 * n, &acc, sizeof(acc));
    }
  }
}

// C[m][n] += sum_k sum_i A[m][4k+i] B[k][4n+i], A and B signed bytes, C int32 (wrapping).
inline void dpbssd(int c, int a, int b) {
  check_product(c, a, b);
  TileUnit& u = unit();
  const int m_rows = u.rows[c], n_cols = u.bytes_per_row[c] / 4, k_words = u.bytes_per_row[a] / 4;
  for (int m = 0; m < m_rows; ++m) {
    for (int n = 0; n < n_cols; ++n) {
      int32_t acc;
      std::memcpy(&acc, u.data[c][m] + 4 * n, sizeof(acc));
      uint32_t sum = static_cast<uint32_t>(acc);
      for (int k = 0; k < k_words; ++k)
        for (int i = 0; i < 4; ++i)
          sum += static_cast<uint32_t>(static_cast<int8_t>(u.data[a][m][4 * k + i]) *
                                       static_cast<int8_t>(u.data[b][k][4 * n + i]));
      acc = static_cast<int32_t>(sum);
      std::memcpy(u.data[c][m] + 4 * n, &acc, sizeof(acc));
    }
  }
}

}  // namespace amx_emulation
}  // namespace
}  // namespace npu_attn

// GCC defines the tile intrinsics as macros (and loadconfig/release as inline functions, which
// a function-like macro of the same name hides from here on).
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_dpbssd
#define _tile_loadconfig(config) ::npu_attn::amx_emulation::load_config(config)
#define _tile_release() ::npu_attn::amx_emulation::release()
#define _tile_loadd(tile, base, stride) ::npu_attn::amx_emulation::load(tile, base, stride)
#define _tile_stored(tile, base, stride) ::npu_attn::amx_emulation::store(tile, base, stride)
#define _tile_zero(tile) ::npu_attn::amx_emulation::zero(tile)
#define _tile_dpbf16ps(c, a, b) ::npu_attn::amx_emulation::dpbf16ps(c, a, b)
#define _tile_dpbssd(c, a, b) ::npu_attn::amx_emulation::dpbssd(c, a, b)
#define NPU_ATTN_AMX_EMULATED 1
