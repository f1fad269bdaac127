// Helpers for the C++ tests: owning tensors with arbitrary layouts and a comparison helper.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention.h"
#include "dispatch.h"
#include "reference.h"

namespace npu_attn::testing {

// Base of the tests that run once per compiled kernel variant: a variant this CPU cannot run is
// skipped with the reason (never silently dropped from the list).
class PerVariant : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported_by_cpu(GetParam())) {
      GTEST_SKIP() << "this CPU cannot run kernel variant '" << isa_name(GetParam()) << "' (needs "
                   << kernel_variant(GetParam()).needs << ")";
    }
  }
};

inline std::string variant_test_name(const ::testing::TestParamInfo<Isa>& info) {
  return isa_name(info.param);
}

// A 4-D (or any-rank) float/bool tensor stored in a permuted memory order so tests can build
// (B,H,S,D) and (B,S,H,D) layouts alike. `order` lists logical dims from outermost to innermost
// in memory.
template <typename T>
struct OwnedTensor {
  std::vector<T> storage;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;

  OwnedTensor() = default;
  OwnedTensor(std::vector<int64_t> shape_, std::vector<int> order = {}) : shape(std::move(shape_)) {
    if (order.empty()) {
      order.resize(shape.size());
      std::iota(order.begin(), order.end(), 0);
    }
    strides.assign(shape.size(), 0);
    int64_t stride = 1;
    for (int i = static_cast<int>(order.size()) - 1; i >= 0; --i) {
      strides[order[i]] = stride;
      stride *= shape[order[i]];
    }
    storage.assign(std::max<int64_t>(stride, 1), T{});
  }
  int64_t offset(std::initializer_list<int64_t> idx) const {
    int64_t off = 0, i = 0;
    for (int64_t v : idx) off += v * strides[i++];
    return off;
  }
  T& at(std::initializer_list<int64_t> idx) { return storage[offset(idx)]; }
  TensorView view(DType dtype) {
    TensorView v;
    v.data = storage.data();
    v.dtype = dtype;
    v.shape = shape;
    v.strides = strides;
    return v;
  }
};

using FloatTensor = OwnedTensor<float>;
using BoolTensor = OwnedTensor<uint8_t>;

// Normal samples in logical order (row-major over `shape`), whatever the storage order: tensors
// of one shape and seed hold the same values in every layout, so one double-precision reference
// serves a case in all its layouts (the reference dominates the grid tests, under qemu-user most).
inline void fill_normal(FloatTensor& t, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  const int rank = static_cast<int>(t.shape.size());
  int64_t count = 1;
  for (int64_t extent : t.shape) count *= extent;
  std::vector<int64_t> index(rank, 0);
  for (int64_t n = 0; n < count; ++n) {
    int64_t offset = 0;
    for (int d = 0; d < rank; ++d) offset += index[d] * t.strides[d];
    t.storage[offset] = dist(rng);
    for (int d = rank - 1; d >= 0 && ++index[d] == t.shape[d]; --d) index[d] = 0;
  }
}

// Max |a - b| over elements, with NaN in both at the same place counting as equal and NaN in
// only one counting as +inf. Both tensors must have the same logical shape (4-D).
inline double max_abs_diff(const FloatTensor& a, const FloatTensor& b) {
  double worst = 0;
  const auto& s = a.shape;
  for (int64_t i0 = 0; i0 < s[0]; ++i0)
    for (int64_t i1 = 0; i1 < s[1]; ++i1)
      for (int64_t i2 = 0; i2 < s[2]; ++i2)
        for (int64_t i3 = 0; i3 < s[3]; ++i3) {
          const float x = a.storage[a.offset({i0, i1, i2, i3})];
          const float y = b.storage[b.offset({i0, i1, i2, i3})];
          if (std::isnan(x) || std::isnan(y)) {
            if (std::isnan(x) != std::isnan(y)) return INFINITY;
            continue;
          }
          if (std::isinf(x) || std::isinf(y)) {
            if (x != y) return INFINITY;
            continue;
          }
          worst = std::max(worst, static_cast<double>(std::fabs(x - y)));
        }
  return worst;
}

inline double max_abs(const FloatTensor& a) {
  double m = 0;
  for (float x : a.storage)
    if (std::isfinite(x)) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

}  // namespace npu_attn::testing
