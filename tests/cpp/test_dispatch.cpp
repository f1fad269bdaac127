// The variant table and the choice of variant, checked for every CPU this code may meet: the
// real one (whatever it is) and emulated ones (features masked in the detector's output).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "dispatch.h"
#include "system_info.h"

namespace npu_attn {
namespace {

constexpr ElementType kAllElements[] = {ElementType::kFloat32, ElementType::kBFloat16,
                                        ElementType::kFloat16};

CpuFeatures every_feature() {
  CpuFeatures f;
  f.sse42 = f.avx2 = f.fma = f.f16c = true;
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = f.avx512_bf16 = true;
  f.avx_vnni = f.avx512_vnni = true;
  f.amx_tile = f.amx_bf16 = f.amx_int8 = true;
  f.asimd = true;
  return f;
}

bool contains(const std::vector<Isa>& isas, Isa isa) {
  return std::find(isas.begin(), isas.end(), isa) != isas.end();
}

TEST(VariantTable, NamesAreUniqueAndRoundTrip) {
  std::set<std::string> names;
  for (const KernelVariant& v : kernel_variants()) {
    EXPECT_TRUE(names.insert(v.name).second) << v.name;
    EXPECT_STREQ(isa_name(v.isa), v.name);
    EXPECT_EQ(parse_isa(v.name), v.isa);
    EXPECT_NE(v.forward, nullptr);
    EXPECT_NE(v.backward, nullptr);
    EXPECT_NE(v.peak_gflops, nullptr);
    for (const char* kernel : v.forward_kernel) EXPECT_NE(std::string(kernel), "");
    // backward_from names a compiled row that runs the same backward code.
    ASSERT_TRUE(parse_isa(v.backward_from).has_value()) << v.name;
    EXPECT_EQ(kernel_variant(*parse_isa(v.backward_from)).backward, v.backward) << v.name;
  }
  EXPECT_FALSE(parse_isa("sse9").has_value());
  EXPECT_EQ(kernel_variants().front().isa, Isa::scalar);
}

TEST(VariantTable, EveryRequiredFeatureIsNeeded) {
  // Turning off any one required feature makes the variant unrunnable.
  for (const KernelVariant& v : kernel_variants()) {
    for (bool CpuFeatures::*feature : v.required) {
      CpuFeatures cpu = every_feature();
      EXPECT_TRUE(v.runs_on(cpu)) << v.name;
      cpu.*feature = false;
      EXPECT_FALSE(v.runs_on(cpu)) << v.name;
    }
  }
}

#if defined(NPU_ATTN_X86)
TEST(VariantTable, ARowInheritsTheFeaturesOfTheRowItBuildsOn) {
  const auto& amx = kernel_variant(Isa::amx_bf16).required;
  for (bool CpuFeatures::*feature : kernel_variant(Isa::avx512_bf16).required)
    EXPECT_NE(std::find(amx.begin(), amx.end(), feature), amx.end());
  EXPECT_NE(std::find(amx.begin(), amx.end(), &CpuFeatures::avx2), amx.end());
  EXPECT_NE(std::find(amx.begin(), amx.end(), &CpuFeatures::amx_tile), amx.end());
  EXPECT_TRUE(kernel_variant(Isa::scalar).required.empty());
}
#endif

TEST(VariantTable, EveryFeatureNameResolves) {
  for (const std::string& name : every_feature().names())
    EXPECT_TRUE(every_feature().*cpu_feature_member(name)) << name;
  EXPECT_THROW(cpu_feature_member("avx1024"), std::invalid_argument);
}

TEST(VariantTable, EveryCompiledVariantRunsOnACpuWithEveryFeature) {
  EXPECT_EQ(runnable_isas(every_feature()), compiled_isas());
}

TEST(VariantTable, ScalarRunsOnACpuWithNoFeatures) {
  EXPECT_EQ(runnable_isas(CpuFeatures{}), std::vector<Isa>{Isa::scalar});
  for (ElementType e : kAllElements) EXPECT_EQ(default_isa(e, CpuFeatures{}), Isa::scalar);
}

#if defined(NPU_ATTN_X86)
// The CPUs this project has met or aims at: Sapphire Rapids (AMX-BF16 and AMX-INT8, both VNNI), Zen
// 4 (AVX512-BF16 and AVX512-VNNI, no AMX, no AVX-VNNI), Cascade Lake (AVX512-VNNI, no BF16),
// Skylake-SP (AVX-512 only), Alder Lake (AVX2 + AVX-VNNI), Zen 3 / Haswell-class (AVX2 only).
// Masking emulates each one.
TEST(EmulatedCpu, SapphireRapidsRunsEveryVariant) {
  const CpuFeatures spr = every_feature();
  EXPECT_EQ(default_isa(ElementType::kFloat32, spr), Isa::avx512);
  EXPECT_EQ(default_isa(ElementType::kFloat16, spr), Isa::avx512);
  EXPECT_EQ(default_isa(ElementType::kBFloat16, spr), Isa::amx_bf16);
  EXPECT_EQ(default_int8_isa(spr), Isa::amx_int8);
  // amx_int8 runs amx_bf16's exact kernels: their defaults stay on the first row that runs them.
  EXPECT_EQ(runnable_isas(spr).back(), Isa::amx_int8);
}

TEST(EmulatedCpu, Zen4HasNoAmx) {
  const CpuFeatures zen4 = mask_cpu_features(every_feature(), "amx_tile,amx_bf16,avx_vnni");
  const auto runnable = runnable_isas(zen4);
  EXPECT_FALSE(contains(runnable, Isa::amx_bf16));
  EXPECT_FALSE(contains(runnable, Isa::avx_vnni));
  EXPECT_TRUE(contains(runnable, Isa::avx512_bf16));
  EXPECT_EQ(default_isa(ElementType::kFloat32, zen4), Isa::avx512);
  EXPECT_EQ(default_isa(ElementType::kBFloat16, zen4), Isa::avx512_bf16);
  // Without a measurement the int8 kernel with bfloat16 P*V (the most specialised one).
  EXPECT_EQ(default_int8_isa(zen4), Isa::avx512_bf16);
}

TEST(EmulatedCpu, CascadeLakeHasVnniWithoutBf16) {
  const CpuFeatures clx =
      mask_cpu_features(every_feature(), "avx_vnni,avx512_bf16,amx_tile,amx_bf16");
  EXPECT_EQ(runnable_isas(clx).back(), Isa::avx512_vnni);
  for (ElementType e : kAllElements) EXPECT_EQ(default_isa(e, clx), Isa::avx512);
  EXPECT_EQ(default_int8_isa(clx), Isa::avx512_vnni);
}

TEST(EmulatedCpu, AlderLakeHasAvxVnniWithoutAvx512) {
  const CpuFeatures adl = mask_cpu_features(every_feature(), "avx512f");
  EXPECT_EQ(runnable_isas(adl), (std::vector<Isa>{Isa::scalar, Isa::avx2, Isa::avx_vnni}));
  for (ElementType e : kAllElements) EXPECT_EQ(default_isa(e, adl), Isa::avx2);
  EXPECT_EQ(default_int8_isa(adl), Isa::avx_vnni);
}

TEST(EmulatedCpu, AmxWithoutOsPermissionIsNotOffered) {
  // The detector reports amx_* only when the OS granted the permission; one bit missing is enough.
  const auto runnable = runnable_isas(mask_cpu_features(every_feature(), "amx_tile"));
  EXPECT_FALSE(contains(runnable, Isa::amx_bf16));
  EXPECT_FALSE(contains(runnable, Isa::amx_int8));
  EXPECT_EQ(default_int8_isa(mask_cpu_features(every_feature(), "amx_tile")), Isa::avx512_bf16);
}

TEST(EmulatedCpu, SkylakeHasNoBf16Variants) {
  const CpuFeatures skx =
      mask_cpu_features(every_feature(), "avx_vnni,avx512_vnni,avx512_bf16,amx_tile,amx_bf16");
  const auto runnable = runnable_isas(skx);
  EXPECT_EQ(runnable.back(), Isa::avx512);
  for (ElementType e : kAllElements) EXPECT_EQ(default_isa(e, skx), Isa::avx512);
  EXPECT_EQ(default_int8_isa(skx), Isa::avx2);
}

TEST(EmulatedCpu, Avx2OnlyCpu) {
  const CpuFeatures hsw = mask_cpu_features(every_feature(), "avx512f,avx_vnni");
  EXPECT_EQ(runnable_isas(hsw), (std::vector<Isa>{Isa::scalar, Isa::avx2}));
  for (ElementType e : kAllElements) EXPECT_EQ(default_isa(e, hsw), Isa::avx2);
  EXPECT_EQ(default_int8_isa(hsw), Isa::avx2);
}
#endif

#if defined(NPU_ATTN_ARM64)
// AArch64 hosts (Kunpeng next to Ascend NPUs): every ARMv8-A core has Advanced SIMD.
TEST(EmulatedCpu, AArch64RunsNeonForEveryType) {
  CpuFeatures kunpeng;
  kunpeng.asimd = true;
  EXPECT_EQ(runnable_isas(kunpeng), (std::vector<Isa>{Isa::scalar, Isa::neon}));
  for (ElementType e : kAllElements) EXPECT_EQ(default_isa(e, kunpeng), Isa::neon);
  EXPECT_EQ(runnable_isas(mask_cpu_features(kunpeng, "asimd")), std::vector<Isa>{Isa::scalar});
}
#endif

TEST(EmulatedCpu, HidingABaseFeatureHidesItsExtensions) {
  for (const char* base : {"avx512f", "avx2"}) {
    const CpuFeatures f = mask_cpu_features(every_feature(), base);
    EXPECT_FALSE(f.avx512f || f.avx512bw || f.avx512_vnni || f.avx512_bf16 || f.amx_tile ||
                 f.amx_bf16)
        << base;
  }
  EXPECT_FALSE(mask_cpu_features(every_feature(), "avx2").avx_vnni);
  EXPECT_FALSE(mask_cpu_features(every_feature(), "amx_tile").amx_int8);
  EXPECT_TRUE(mask_cpu_features(every_feature(), "avx512f").avx_vnni);
  EXPECT_TRUE(mask_cpu_features(every_feature(), "amx_tile").avx512_bf16);
}

TEST(EmulatedCpu, UnknownFeatureNameIsAnErrorNamingIt) {
  try {
    mask_cpu_features(every_feature(), "avx2, avx9000");
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("avx9000"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("amx_bf16"), std::string::npos) << e.what();
  }
}

TEST(ThisCpu, DefaultAndActiveVariantsRunHere) {
  const auto runnable = runnable_isas();
  ASSERT_FALSE(runnable.empty());
  EXPECT_EQ(runnable.front(), Isa::scalar);
  for (ElementType e : kAllElements) {
    EXPECT_TRUE(isa_supported_by_cpu(default_isa(e))) << element_type_name(e);
    EXPECT_TRUE(isa_supported_by_cpu(active_isa(e))) << element_type_name(e);
    EXPECT_TRUE(contains(runnable, default_isa(e)));
  }
}

TEST(ThisCpu, VariantIsChosenPerElementType) {
  const Isa fp32 = active_isa(ElementType::kFloat32), bf16 = active_isa(ElementType::kBFloat16);
  set_active_isa(Isa::scalar, ElementType::kBFloat16);
  EXPECT_EQ(active_isa(ElementType::kBFloat16), Isa::scalar);
  EXPECT_EQ(active_isa(ElementType::kFloat32), fp32);
  set_active_isa(bf16, ElementType::kBFloat16);
  EXPECT_EQ(active_isa(ElementType::kBFloat16), bf16);
}

TEST(ThisCpu, VariantIsChosenPerShapeClass) {
  const Isa before = active_isa(ElementType::kFloat32, ShapeClass::kLargeHeadDim);
  set_active_isa(Isa::scalar, ElementType::kFloat32, ShapeClass::kLargeHeadDim);
  EXPECT_EQ(active_isa(ElementType::kFloat32, ShapeClass::kLargeHeadDim), Isa::scalar);
  EXPECT_EQ(active_isa(ElementType::kFloat32, ShapeClass::kSelfAttention),
            active_isa(ElementType::kFloat32));
  set_active_isa(before, ElementType::kFloat32, ShapeClass::kLargeHeadDim);
}

TEST(ThisCpu, BackwardFollowsTheForwardUntilChosenSeparately) {
  constexpr ElementType kBf16 = ElementType::kBFloat16;
  Isa before[kElementTypeCount][kShapeClassCount];
  for (int e = 0; e < kElementTypeCount; ++e)
    for (int c = 0; c < kShapeClassCount; ++c)
      before[e][c] = active_isa(static_cast<ElementType>(e), static_cast<ShapeClass>(c));
  const Isa bf16 = before[static_cast<int>(kBf16)][0];
  set_active_isa(Isa::scalar, kBf16);
  EXPECT_EQ(active_backward_isa(kBf16), Isa::scalar);  // follows the forward's choice
  set_active_backward_isa(bf16, kBf16);
  for (int c = 0; c < kShapeClassCount; ++c)
    EXPECT_EQ(active_backward_isa(kBf16, static_cast<ShapeClass>(c)), bf16);
  EXPECT_EQ(active_isa(kBf16), Isa::scalar);
  EXPECT_EQ(active_backward_isa(ElementType::kFloat32), active_isa(ElementType::kFloat32));
  clear_active_backward_isa(kBf16);
  EXPECT_EQ(active_backward_isa(kBf16), Isa::scalar);
  set_active_backward_isa(bf16, kBf16);
  set_active_isa(Isa::scalar);  // one variant for everything: the backward follows again
  EXPECT_EQ(active_backward_isa(kBf16), Isa::scalar);
  for (int e = 0; e < kElementTypeCount; ++e)
    for (int c = 0; c < kShapeClassCount; ++c)
      set_active_isa(before[e][c], static_cast<ElementType>(e), static_cast<ShapeClass>(c));
  EXPECT_EQ(active_backward_isa(kBf16), bf16);
}

TEST(ShapeClasses, ClassifyByKeysAndHeadDim) {
  AttentionParams p;
  p.len_k = 4096;
  p.head_dim = p.head_dim_v = 64;
  EXPECT_EQ(shape_class(p), ShapeClass::kSelfAttention);
  p.len_k = 77;
  EXPECT_EQ(shape_class(p), ShapeClass::kCrossAttention);
  p.len_k = 4096;
  p.head_dim_v = 512;
  EXPECT_EQ(shape_class(p), ShapeClass::kLargeHeadDim);
  for (int i = 0; i < kShapeClassCount; ++i) {
    const auto shape = static_cast<ShapeClass>(i);
    EXPECT_EQ(parse_shape_class(shape_class_name(shape)), shape);
  }
}

TEST(ThisCpu, EveryRunnableVariantMeasuresAPeakPerDtype) {
  // Only that the probes run and give a throughput: comparing them would be a timing assertion.
  for (Isa isa : runnable_isas()) {
    for (ElementType e : kAllElements) {
      const double gflops = measure_peak_gflops(isa, e, 1, 0.01);
      EXPECT_TRUE(std::isfinite(gflops) && gflops > 0) << isa_name(isa) << " " << gflops;
    }
  }
  EXPECT_THROW(measure_peak_gflops(Isa::scalar, ElementType::kFloat32, 0, 0.01),
               std::invalid_argument);
}

TEST(ThisCpu, AVariantTheCpuCannotRunIsRefused) {
  for (const KernelVariant& v : kernel_variants()) {
    if (isa_supported_by_cpu(v.isa)) continue;
    EXPECT_THROW(set_active_isa(v.isa), std::runtime_error) << v.name;
    EXPECT_THROW(set_active_backward_isa(v.isa, ElementType::kBFloat16), std::runtime_error)
        << v.name;
  }
}

}  // namespace
}  // namespace npu_attn
