// The register-block walk every product kernel shares (vec_impl.h): both block orders cover
// every (row, column vector) cell of a product exactly once with the same block shapes, and
// broadcast_fma gives bit-identical results in either order (the forward switched its order on
// that promise), and with A packed in panels (broadcast_fma_panels). Built with 16-byte vectors,
// which every build target has (SSE2 / NEON); the walk's logic is the same for every width.
#define NPU_ATTN_VEC_BYTES 16
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/vec_impl.h"

namespace npu_attn {
namespace {

struct Visit {
  int count = 0;
  int block_rows = 0;  // the Count<Rows> of the block that covered this cell
  int block_vecs = 0;
};

template <BlockOrder Order>
std::vector<Visit> walk(int64_t rows, int64_t vecs) {
  std::vector<Visit> cells(static_cast<size_t>(rows * vecs));
  for_each_register_block<Order>(
      rows, vecs, [&](auto block_rows, auto block_vecs, int64_t r, int64_t v0) {
        constexpr int kRows = decltype(block_rows)::value, kVecs = decltype(block_vecs)::value;
        for (int64_t i = r; i < r + kRows; ++i) {
          for (int64_t v = v0; v < v0 + kVecs; ++v) {
            ASSERT_TRUE(i < rows && v < vecs) << "block outside the product at " << i << ", " << v;
            Visit& cell = cells[static_cast<size_t>(i * vecs + v)];
            ++cell.count;
            cell.block_rows = kRows;
            cell.block_vecs = kVecs;
          }
        }
      });
  return cells;
}

TEST(RegisterBlocks, BothOrdersCoverEveryCellOnceWithTheSameBlocks) {
  for (int64_t rows = 0; rows <= 3 * kBlockRows + 1; ++rows) {
    for (int64_t vecs = 0; vecs <= 4 * kMaxBlockVecs + 1; ++vecs) {
      const auto groups_outer = walk<BlockOrder::kColumnGroupsOuter>(rows, vecs);
      const auto rows_outer = walk<BlockOrder::kRowBlocksOuter>(rows, vecs);
      for (size_t c = 0; c < groups_outer.size(); ++c) {
        SCOPED_TRACE(::testing::Message() << "rows " << rows << " vecs " << vecs << " cell " << c);
        EXPECT_EQ(groups_outer[c].count, 1);
        EXPECT_EQ(rows_outer[c].count, 1);
        EXPECT_EQ(rows_outer[c].block_rows, groups_outer[c].block_rows);
        EXPECT_EQ(rows_outer[c].block_vecs, groups_outer[c].block_vecs);
      }
    }
  }
}

template <ALayout Layout, bool Accumulate, BlockOrder Order>
std::vector<float> product(const std::vector<float>& a, int64_t lda, const std::vector<float>& b,
                           int64_t depth, int64_t rows, int64_t vecs, std::vector<float> c) {
  const int64_t ld = vecs * kLanes;
  broadcast_fma<Layout, Accumulate, Order>(a.data(), lda, b.data(), ld, depth, rows, vecs, c.data(),
                                           ld);
  return c;
}

TEST(RegisterBlocks, BroadcastFmaIsBitIdenticalInBothOrders) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (const int64_t rows : {1, 5, 6, 13, 20}) {
    for (const int64_t vecs : {1, 2, 3, 5, 8}) {
      const int64_t depth = 37;
      std::vector<float> a(static_cast<size_t>(rows * depth)), b(depth * vecs * kLanes),
          c(rows * vecs * kLanes);
      for (auto* v : {&a, &b, &c})
        for (float& x : *v) x = normal(rng);
      SCOPED_TRACE(::testing::Message() << "rows " << rows << " vecs " << vecs);
      // A row-major (rows x depth, lda = depth) and column-major (lda = rows), set and add.
      EXPECT_EQ((product<ALayout::kRowMajor, false, BlockOrder::kColumnGroupsOuter>(
                    a, depth, b, depth, rows, vecs, c)),
                (product<ALayout::kRowMajor, false, BlockOrder::kRowBlocksOuter>(a, depth, b, depth,
                                                                                 rows, vecs, c)));
      EXPECT_EQ((product<ALayout::kColMajor, true, BlockOrder::kColumnGroupsOuter>(
                    a, rows, b, depth, rows, vecs, c)),
                (product<ALayout::kColMajor, true, BlockOrder::kRowBlocksOuter>(a, rows, b, depth,
                                                                                rows, vecs, c)));
      // and both against a plain loop, so neither order is wrong in the same way
      const auto got = product<ALayout::kRowMajor, true, BlockOrder::kRowBlocksOuter>(
          a, depth, b, depth, rows, vecs, c);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < vecs * kLanes; ++j) {
          double want = c[r * vecs * kLanes + j];
          for (int64_t i = 0; i < depth; ++i)
            want += static_cast<double>(a[r * depth + i]) * b[i * vecs * kLanes + j];
          EXPECT_NEAR(got[r * vecs * kLanes + j], want, 1e-4) << "r " << r << " j " << j;
        }
      }
    }
  }
}

TEST(RegisterBlocks, PanelsGiveTheRowMajorProductBitForBit) {
  // A packed in panels of kBlockRows rows (A(r, i) at [(r / 6) * panel_stride + i * 6 + r % 6],
  // as the AVX2 forward packs K and V) through broadcast_fma_panels: the same sums in the same
  // order as broadcast_fma on row-major A. The rows past `rows` in a ragged last panel hold NaN:
  // they must never reach the result.
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (const int64_t rows : {1, 5, 6, 13, 20}) {
    for (const int64_t vecs : {1, 2, 3, 5, 8}) {
      const int64_t depth = 37, panel_stride = kBlockRows * depth + 3;  // panels need not touch
      const int64_t panels = (rows + kBlockRows - 1) / kBlockRows;
      std::vector<float> a(static_cast<size_t>(rows * depth)), b(depth * vecs * kLanes),
          c(rows * vecs * kLanes);
      for (auto* v : {&a, &b, &c})
        for (float& x : *v) x = normal(rng);
      std::vector<float> packed(static_cast<size_t>(panels * panel_stride), __builtin_nanf(""));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < depth; ++i)
          packed[(r / kBlockRows) * panel_stride + i * kBlockRows + r % kBlockRows] =
              a[r * depth + i];
      SCOPED_TRACE(::testing::Message() << "rows " << rows << " vecs " << vecs);
      const int64_t ld = vecs * kLanes;
      for (const bool accumulate : {false, true}) {
        std::vector<float> got = c;
        if (accumulate) {
          broadcast_fma_panels<true>(packed.data(), panel_stride, b.data(), ld, depth, rows, vecs,
                                     got.data(), ld);
        } else {
          broadcast_fma_panels<false>(packed.data(), panel_stride, b.data(), ld, depth, rows, vecs,
                                      got.data(), ld);
        }
        const auto want = accumulate
                              ? product<ALayout::kRowMajor, true, BlockOrder::kRowBlocksOuter>(
                                    a, depth, b, depth, rows, vecs, c)
                              : product<ALayout::kRowMajor, false, BlockOrder::kRowBlocksOuter>(
                                    a, depth, b, depth, rows, vecs, c);
        EXPECT_EQ(got, want) << (accumulate ? "accumulating" : "setting");
      }
    }
  }
}

}  // namespace
}  // namespace npu_attn
