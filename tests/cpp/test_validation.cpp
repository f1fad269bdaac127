// make_attention_params(): every bad argument is refused with an error that names it.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "attention.h"
#include "test_support.h"

namespace npu_attn::testing {
namespace {

struct Valid {
  FloatTensor q{{2, 4, 8, 16}}, k{{2, 4, 10, 16}}, v{{2, 4, 10, 12}}, out{{2, 4, 8, 12}};
  FloatTensor lse{{2, 4, 8}};
  SdpaArguments args;
  Valid() {
    args.query = q.view(DType::kFloat32);
    args.key = k.view(DType::kFloat32);
    args.value = v.view(DType::kFloat32);
    args.out = out.view(DType::kFloat32);
    args.lse = lse.view(DType::kFloat32);
  }
};

void expect_error(const std::function<void(SdpaArguments&)>& mutate, ArgumentError::Kind kind,
                  const std::string& needle) {
  Valid valid;
  mutate(valid.args);
  try {
    make_attention_params(valid.args);
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

using K = ArgumentError::Kind;

TEST(Validation, AcceptsValidArguments) {
  Valid valid;
  const AttentionParams p = make_attention_params(valid.args);
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.len_k, 10);
  EXPECT_EQ(p.head_dim_v, 12);
  EXPECT_FLOAT_EQ(p.scale, 0.25f);
}

TEST(Validation, RejectsWrongDtypes) {
  expect_error([](auto& a) { a.query.dtype = DType::kFloat64; }, K::kType,
               "query must be float32, bfloat16 or float16, got float64");
  expect_error([](auto& a) { a.value.dtype = DType::kOther; }, K::kType,
               "value must be float32 (the same dtype as query), got an unsupported dtype");
  expect_error([](auto& a) { a.out.dtype = DType::kFloat16; }, K::kType,
               "out must be float32 (the same dtype as query), got float16");
  expect_error([](auto& a) { a.lse->dtype = DType::kBFloat16; }, K::kType,
               "lse must be float32, got bfloat16");
}

TEST(Validation, AcceptsSixteenBitTypesWhenEveryTensorAgrees) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    Valid valid;
    for (TensorView* t : {&valid.args.query, &valid.args.key, &valid.args.value, &valid.args.out})
      t->dtype = dtype;
    const AttentionParams p = make_attention_params(valid.args);
    EXPECT_EQ(p.element,
              dtype == DType::kBFloat16 ? ElementType::kBFloat16 : ElementType::kFloat16);
    EXPECT_FALSE(p.out_float32);
    valid.args.out.dtype = DType::kFloat32;  // a 16-bit call's float32 output, for a backward
    EXPECT_TRUE(make_attention_params(valid.args).out_float32);
    valid.args.out.dtype = dtype == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
    try {
      make_attention_params(valid.args);
      ADD_FAILURE() << "an out of the other 16-bit type was accepted";
    } catch (const ArgumentError& e) {
      EXPECT_EQ(std::string(e.what()), std::string("out must be ") + dtype_name(dtype) +
                                           " (the same dtype as query, or float32), got " +
                                           dtype_name(valid.args.out.dtype));
    }
    valid.args.out.dtype = dtype;
    valid.args.key.dtype = DType::kFloat32;
    EXPECT_THROW(make_attention_params(valid.args), ArgumentError);
  }
}

TEST(Validation, RejectsNonCpuTensors) {
  expect_error(
      [](auto& a) {
        a.key.on_cpu = false;
        a.key.device = "cuda:0";
      },
      K::kType, "key must be a CPU tensor");
}

TEST(Validation, RejectsWrongRanksAndShapes) {
  expect_error(
      [](auto& a) {
        a.query.shape = {4, 8, 16};
        a.query.strides = {128, 16, 1};
      },
      K::kValue, "query must have 4 dimensions");
  expect_error([](auto& a) { a.key.shape[0] = 3; }, K::kValue, "same batch size");
  expect_error([](auto& a) { a.key.shape[3] = 8; }, K::kValue, "head_dim");
  expect_error([](auto& a) { a.value.shape[2] = 9; }, K::kValue, "value must have the same");
  expect_error([](auto& a) { a.out.shape[3] = 16; }, K::kValue, "out must have shape");
  expect_error([](auto& a) { a.lse->shape[2] = 9; }, K::kValue, "lse must have shape");
}

TEST(Validation, GroupedQueryAttentionNeedsOptInAndDivisibility) {
  FloatTensor k2({2, 2, 10, 16}), v2({2, 2, 10, 12}), k3({2, 3, 10, 16}), v3({2, 3, 10, 12});
  expect_error(
      [&](auto& a) {
        a.key = k2.view(DType::kFloat32);
        a.value = v2.view(DType::kFloat32);
      },
      K::kValue, "enable_gqa=True");
  expect_error(
      [&](auto& a) {
        a.key = k3.view(DType::kFloat32);
        a.value = v3.view(DType::kFloat32);
        a.enable_gqa = true;
      },
      K::kValue, "multiple of key/value heads");
  Valid valid;
  valid.args.key = k2.view(DType::kFloat32);
  valid.args.value = v2.view(DType::kFloat32);
  valid.args.enable_gqa = true;
  EXPECT_EQ(make_attention_params(valid.args).heads_kv, 2);
}

TEST(Validation, MaskDtypeAndBroadcasting) {
  FloatTensor good({8, 10}), bad_shape({8, 9}), five_d({1, 1, 1, 8, 10});
  BoolTensor keypad({2, 1, 1, 10});
  expect_error([&](auto& a) { a.attn_mask = bad_shape.view(DType::kFloat32); }, K::kValue,
               "cannot be broadcast");
  expect_error([&](auto& a) { a.attn_mask = good.view(DType::kFloat64); }, K::kType,
               "attn_mask must be bool");
  expect_error([&](auto& a) { a.attn_mask = five_d.view(DType::kFloat32); }, K::kValue,
               "at most 4 dimensions");
  Valid valid;
  valid.args.attn_mask = keypad.view(DType::kBool);
  const AttentionParams p = make_attention_params(valid.args);
  EXPECT_EQ(p.mask_kind, MaskKind::kBool);
  EXPECT_EQ(p.mask_stride[1], 0);  // broadcast over heads
  EXPECT_EQ(p.mask_stride[2], 0);  // and queries
  EXPECT_EQ(p.mask_stride[3], 1);
}

TEST(Validation, ScaleMustBeFiniteAndNonNegative) {
  expect_error([](auto& a) { a.scale = -1.0; }, K::kValue, "scale must be");
  expect_error([](auto& a) { a.scale = NAN; }, K::kValue, "scale must be");
  expect_error([](auto& a) { a.scale = INFINITY; }, K::kValue, "scale must be");
}

TEST(Validation, OutputMustNotOverlap) {
  expect_error([](auto& a) { a.out.strides[2] = 0; }, K::kValue, "overlapping memory");
}

TEST(Validation, ThreadCount) {
  expect_error([](auto& a) { a.num_threads = 0; }, K::kValue, "num_threads");
  EXPECT_THROW(set_num_threads(0), ArgumentError);
  const int before = get_num_threads();
  set_num_threads(3);
  EXPECT_EQ(get_num_threads(), 3);
  set_num_threads(before);
}

}  // namespace
}  // namespace npu_attn::testing
