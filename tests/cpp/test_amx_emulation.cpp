// The software tile unit the EmulatedAmx tests run the AMX kernels on (amx_emulation.h): its
// tdpbf16ps arithmetic, and that every misuse the hardware would fault on aborts instead of
// passing silently (a test tool that accepts wrong code would make EmulatedAmx pass it).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "amx_emulation.h"

namespace npu_attn {
namespace {

namespace emu = amx_emulation;

// A palette-1 configuration with tiles 0-2 of `rows` rows and `bytes` bytes per row.
struct TileConfig {
  alignas(64) uint8_t bytes[64] = {};
  TileConfig(int rows, int row_bytes) {
    bytes[0] = 1;
    for (int t = 0; t < 3; ++t) set_tile(t, rows, row_bytes);
  }
  void set_tile(int t, int rows, int row_bytes) {
    const uint16_t width = static_cast<uint16_t>(row_bytes);
    std::memcpy(bytes + 16 + 2 * t, &width, sizeof(width));
    bytes[48 + t] = static_cast<uint8_t>(rows);
  }
};

uint16_t bf16(float x) {  // exact for the small integers used here
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}

class AmxEmulation : public ::testing::Test {
 protected:
  void TearDown() override { emu::release(); }
};
// Death tests fork; GoogleTest runs *DeathTest suites first, before other tests start threads.
using AmxEmulationDeathTest = AmxEmulation;

TEST_F(AmxEmulation, DotProductOfBfloat16PairsAccumulatesInFloat32) {
  // C (2 x 2 float32) += A (2 rows x 2 pairs) . B (2 pair-rows x 2 columns)
  const TileConfig config(2, 8);
  emu::load_config(config.bytes);
  uint16_t a[2][4], b[2][4];
  for (int m = 0; m < 2; ++m)
    for (int i = 0; i < 4; ++i) a[m][i] = bf16(static_cast<float>(1 + m * 4 + i));
  for (int k = 0; k < 2; ++k)
    for (int i = 0; i < 4; ++i) b[k][i] = bf16(static_cast<float>(k * 4 - i));
  float c[2][2] = {{0.5f, 1.5f}, {2.5f, 3.5f}};
  emu::load(0, c, sizeof(c[0]));
  emu::load(1, a, sizeof(a[0]));
  emu::load(2, b, sizeof(b[0]));
  emu::dpbf16ps(0, 1, 2);
  float out[2][2];
  emu::store(0, out, sizeof(out[0]));
  for (int m = 0; m < 2; ++m) {
    for (int n = 0; n < 2; ++n) {
      // A[m] holds pairs (a0, a1), (a2, a3); B[k] holds column n's pair at elements 2n, 2n+1.
      float want = c[m][n];
      for (int k = 0; k < 2; ++k) {
        want += static_cast<float>(1 + m * 4 + 2 * k) * static_cast<float>(k * 4 - 2 * n);
        want += static_cast<float>(1 + m * 4 + 2 * k + 1) * static_cast<float>(k * 4 - 2 * n - 1);
      }
      EXPECT_EQ(out[m][n], want) << "m " << m << " n " << n;
    }
  }
}

TEST_F(AmxEmulation, DotProductOfSignedBytesAccumulatesInInt32) {
  // C (2 x 2 int32) += A (2 rows x 2 words of 4 bytes) . B (2 word-rows x 2 columns), with the
  // extremes: -128 x -128 products (which a 16-bit pair sum would saturate) and an int32 wrap.
  const TileConfig config(2, 8);
  emu::load_config(config.bytes);
  int8_t a[2][8], b[2][8];
  for (int m = 0; m < 2; ++m)
    for (int i = 0; i < 8; ++i) a[m][i] = static_cast<int8_t>(m == 0 ? -128 : 37 * i - 120);
  for (int k = 0; k < 2; ++k)
    for (int i = 0; i < 8; ++i) b[k][i] = static_cast<int8_t>(k == 0 ? -128 : 127 - 29 * i);
  int32_t c[2][2] = {{INT32_MAX, -5}, {7, INT32_MIN}};
  emu::load(0, c, sizeof(c[0]));
  emu::load(1, a, sizeof(a[0]));
  emu::load(2, b, sizeof(b[0]));
  emu::dpbssd(0, 1, 2);
  int32_t out[2][2];
  emu::store(0, out, sizeof(out[0]));
  for (int m = 0; m < 2; ++m) {
    for (int n = 0; n < 2; ++n) {
      int64_t want = c[m][n];
      for (int k = 0; k < 2; ++k)
        for (int i = 0; i < 4; ++i) want += int64_t{a[m][4 * k + i]} * b[k][4 * n + i];
      EXPECT_EQ(out[m][n], static_cast<int32_t>(static_cast<uint32_t>(want))) << m << " " << n;
    }
  }
}

// The configuration `good` with one change.
template <typename Change>
TileConfig changed(const TileConfig& good, Change change) {
  TileConfig config = good;
  change(config);
  return config;
}

// Loads `config`, then runs tdpbf16ps(c, a, b).
void multiply(const TileConfig& config, int c, int a, int b) {
  emu::load_config(config.bytes);
  emu::dpbf16ps(c, a, b);
}

TEST_F(AmxEmulationDeathTest, BadConfigurationsAbort) {
  const TileConfig good(2, 8);
  auto load = [](const TileConfig& config) { emu::load_config(config.bytes); };
  EXPECT_DEATH(load(changed(good, [](TileConfig& c) { c.bytes[0] = 0; })), "palette must be 1");
  EXPECT_DEATH(load(changed(good, [](TileConfig& c) { c.bytes[7] = 1; })),
               "reserved configuration bytes");
  EXPECT_DEATH(load(changed(good, [](TileConfig& c) { c.set_tile(9, 2, 8); })),
               "palette 1 has 8 tiles");
  EXPECT_DEATH(load(changed(good, [](TileConfig& c) { c.bytes[16 + 2 * 12] = 4; })),
               "palette 1 has 8 tiles");  // a width for tile 12, its rows left zero
  EXPECT_DEATH(load(changed(good, [](TileConfig& c) { c.set_tile(1, 17, 8); })),
               "bad tile shape");  // 17 rows
  EXPECT_DEATH(load(changed(good, [](TileConfig& c) { c.set_tile(1, 2, 68); })),
               "bad tile shape");  // 68 bytes a row
  EXPECT_DEATH(load(changed(good, [](TileConfig& c) { c.set_tile(1, 2, 6); })),
               "bad tile shape");  // not whole 32-bit words
}

TEST_F(AmxEmulationDeathTest, TilesUsedWithoutTheirConfigurationAbort) {
  const TileConfig good(2, 8);
  uint8_t buffer[16][64] = {};
  EXPECT_DEATH(emu::zero(0), "without a loaded configuration");
  EXPECT_DEATH(
      {
        emu::load_config(good.bytes);
        emu::load(5, buffer, 64);
      },
      "tile not configured");
  EXPECT_DEATH(
      {
        emu::load_config(good.bytes);
        emu::release();
        emu::zero(0);
      },
      "without a loaded configuration");
}

TEST_F(AmxEmulationDeathTest, ProductsOnTilesThatDoNotChainAbort) {
  const TileConfig good(2, 8);
  EXPECT_DEATH(multiply(good, 0, 0, 2), "three distinct tiles");
  EXPECT_DEATH(multiply(good, 0, 1, 1), "three distinct tiles");
  EXPECT_DEATH(multiply(good, 2, 1, 2), "three distinct tiles");
  EXPECT_DEATH(multiply(changed(good, [](TileConfig& c) { c.set_tile(1, 3, 8); }), 0, 1, 2),
               "A rows differ from C rows");  // A has 3 rows, C 2
  EXPECT_DEATH(multiply(changed(good, [](TileConfig& c) { c.set_tile(2, 3, 8); }), 0, 1, 2),
               "B rows differ");  // B has 3 rows, A 2 pairs a row
  EXPECT_DEATH(multiply(changed(good, [](TileConfig& c) { c.set_tile(2, 2, 16); }), 0, 1, 2),
               "B row bytes differ");  // B rows 16 bytes, C rows 8
  EXPECT_DEATH(
      {
        emu::load_config(changed(good, [](TileConfig& c) { c.set_tile(2, 3, 8); }).bytes);
        emu::dpbssd(0, 1, 2);
      },
      "B rows differ");  // tdpbssd checks the same chain
  EXPECT_DEATH(
      {
        emu::load_config(good.bytes);
        emu::dpbssd(1, 1, 2);
      },
      "three distinct tiles");
}

}  // namespace
}  // namespace npu_attn
