// The emulated VNNI instructions the EmulatedInt8Units tests run the kernel's VNNI code on
// (vnni_emulation.h): checked against the instructions' definitions, including the extremes
// (all bytes 255 x -128, 16-bit pairs of -32768 x -32768, int32 wrap-around), since a test tool
// that computed something else would make the kernel tests pass wrong code.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "dispatch.h"
#include "vnni_emulated.h"

namespace npu_attn::testing {
namespace {

int32_t wrapped(int64_t x) {  // the instructions' int32 arithmetic wraps
  return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(x)));
}

void expect_dpbusd(const int32_t acc[8], const uint8_t u[32], const int8_t s[32]) {
  int32_t out[8];
  dpbusd_emulated(acc, u, s, out);
  for (int lane = 0; lane < 8; ++lane) {
    int64_t want = acc[lane];
    for (int i = 0; i < 4; ++i) want += int64_t{u[4 * lane + i]} * s[4 * lane + i];
    EXPECT_EQ(out[lane], wrapped(want)) << "lane " << lane;
  }
}

void expect_dpwssd(const int32_t acc[8], const int16_t a[16], const int16_t b[16]) {
  int32_t out[8];
  dpwssd_emulated(acc, a, b, out);
  for (int lane = 0; lane < 8; ++lane) {
    const int64_t want =
        acc[lane] + int64_t{a[2 * lane]} * b[2 * lane] + int64_t{a[2 * lane + 1]} * b[2 * lane + 1];
    EXPECT_EQ(out[lane], wrapped(want)) << "lane " << lane;
  }
}

class VnniEmulation : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!isa_supported_by_cpu(Isa::avx2)) GTEST_SKIP() << "the emulation is built for AVX2";
  }
};

TEST_F(VnniEmulation, DpbusdIsFourUnsignedBySignedByteProducts) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> byte(0, 255), word(-2000000000, 2000000000);
  for (int trial = 0; trial < 200; ++trial) {
    int32_t acc[8];
    uint8_t u[32];
    int8_t s[32];
    for (int32_t& x : acc) x = word(rng);
    for (uint8_t& x : u) x = static_cast<uint8_t>(byte(rng));
    for (int8_t& x : s) x = static_cast<int8_t>(byte(rng) - 128);
    expect_dpbusd(acc, u, s);
  }
}

TEST_F(VnniEmulation, DpbusdExtremesNeitherSaturateNorLoseTheCarry) {
  uint8_t u[32];
  int8_t s[32];
  for (uint8_t& x : u) x = 255;
  for (int8_t& x : s) x = -128;  // 16-bit pair sums would saturate at -32768
  const int32_t acc[8] = {0, 1, -1, INT32_MIN, INT32_MAX, 130560, -130560, 42};
  expect_dpbusd(acc, u, s);  // INT32_MIN - 130560 wraps, as the instruction's sum does
  for (int8_t& x : s) x = 127;
  expect_dpbusd(acc, u, s);
}

TEST_F(VnniEmulation, DpwssdIsTwoSigned16BitProducts) {
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> half(-32768, 32767), word(-2000000000, 2000000000);
  for (int trial = 0; trial < 200; ++trial) {
    int32_t acc[8];
    int16_t a[16], b[16];
    for (int32_t& x : acc) x = word(rng);
    for (int16_t& x : a) x = static_cast<int16_t>(half(rng));
    for (int16_t& x : b) x = static_cast<int16_t>(half(rng));
    expect_dpwssd(acc, a, b);
  }
  int16_t a[16], b[16];
  for (int16_t& x : a) x = -32768;
  for (int16_t& x : b) x = -32768;  // 2 x 2^30 = 2^31: wraps to INT32_MIN
  const int32_t acc[8] = {0, 1, -1, INT32_MIN, INT32_MAX, 5, -5, 0};
  expect_dpwssd(acc, a, b);
}

}  // namespace
}  // namespace npu_attn::testing
