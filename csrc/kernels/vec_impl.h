// SIMD building blocks shared by the kernel families (forward, backward), compiled per ISA.
//
// Included by the ISA-neutral kernel headers after NPU_ATTN_VEC_BYTES is defined. Everything is
// in an anonymous namespace, built from GCC vector extensions (no intrinsics, no std::
// templates), so each ISA translation unit gets its own private copy and the linker can never
// merge an AVX-512 instance into the scalar variant.
#pragma once

#ifndef NPU_ATTN_VEC_BYTES
#error "define NPU_ATTN_VEC_BYTES before including vec_impl.h"
#endif

#include <cstdint>

#include "../bfloat16.h"  // bfloat16_bits: the scalar rounding rule
#include "../half.h"      // Half: IEEE binary16

#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>  // F16C conversions, maxps; the intrinsics are always-inline, no symbols
#endif
#if defined(__aarch64__) && NPU_ATTN_VEC_BYTES == 16
#include <arm_neon.h>  // fcvtl/fcvtn: a whole vector of float16 per instruction
#endif

namespace npu_attn {
namespace {

// ---------------------------------------------------------------- vector primitives
constexpr int kVecBytes = NPU_ATTN_VEC_BYTES;
constexpr int kLanes = kVecBytes / static_cast<int>(sizeof(float));
typedef float Vec __attribute__((vector_size(kVecBytes)));
typedef int32_t IVec __attribute__((vector_size(kVecBytes)));
typedef uint32_t UVec __attribute__((vector_size(kVecBytes)));

constexpr float kNegInf = -__builtin_inff();

// Vector helpers must always inline: a call per vector costs more than the work inside.
#define NPU_ATTN_VEC_INLINE inline __attribute__((always_inline))

// Unaligned, aliasing view of float memory as a vector: plain loads and stores that the
// compiler keeps in registers (memcpy-based loads into arrays of vectors got spilled).
typedef float UnalignedVec __attribute__((vector_size(kVecBytes), aligned(4), may_alias));
NPU_ATTN_VEC_INLINE Vec load(const float* p) {
  return *reinterpret_cast<const UnalignedVec*>(p);
}
NPU_ATTN_VEC_INLINE void store(float* p, Vec v) {
  *reinterpret_cast<UnalignedVec*>(p) = v;
}
// Lane 0 shuffled to every lane: compiles to one broadcast (often folded into the FMA as a
// {1toN} memory operand). "Vec{} + x" would be a real add the compiler must keep
// (0 + -0 = +0), turning each broadcast into an add plus a shuffle on the FMA port.
NPU_ATTN_VEC_INLINE Vec splat(float x) {
  const Vec lane0 = {x};
  return __builtin_shuffle(lane0, IVec{});
}
// max(x, acc) that ignores a NaN x: one vmaxps (which returns its second operand when either
// is NaN). Row maxima therefore skip NaN scores; NaN still reaches the output through exp().
NPU_ATTN_VEC_INLINE Vec max_ignoring_nan(Vec x, Vec acc) {
  return x > acc ? x : acc;
}

// p * 2^n, where `rounded` is n + 1.5 * 2^23 (n rounded by the magic constant, |n| <= 126): the
// low mantissa bits of `rounded` hold n, so shifting them left by 23 adds n to p's exponent.
NPU_ATTN_VEC_INLINE Vec times_pow2_rounded(Vec p, Vec rounded) {
  UVec n_bits, p_bits;  // unsigned: the shift wraps by definition
  __builtin_memcpy(&n_bits, &rounded, sizeof(rounded));
  __builtin_memcpy(&p_bits, &p, sizeof(p));
  p_bits += n_bits << 23;
  Vec y;
  __builtin_memcpy(&y, &p_bits, sizeof(y));
  return y;
}

// exp(x) for x <= 0 (all softmax arguments are <= 0 after subtracting the row max).
// Cephes-style: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial (max relative
// error ~2 ulp), then 2^n added straight into the exponent bits. n comes from the
// round-to-nearest magic constant 1.5*2^23, whose low mantissa bits hold n: shifting those bits
// left by 23 gives n << 23 exactly, so no float->int conversion is needed.
// Results below exp(-86) ~ 4e-38 are returned as exactly 0 (this keeps 2^n normal and makes
// masked keys, -inf, contribute exactly nothing); NaN stays NaN through r and the polynomial,
// so NaN inputs propagate like torch.
NPU_ATTN_VEC_INLINE Vec exp_nonpositive(Vec x) {
  const Vec lowest = splat(-86.0f);
  const Vec xc = lowest > x ? lowest : x;  // one maxps; keeps NaN
  const Vec round_magic = splat(12582912.0f);
  const Vec t = xc * splat(1.44269504088896341f) + round_magic;
  const Vec n = t - round_magic;
  Vec r = xc - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  Vec p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  return x < lowest ? splat(0.0f) : times_pow2_rounded(p, t);
}

// max(lowest, t), keeping a NaN t: one maxps, which returns its second operand when either is
// NaN. GCC compiles the same ternary against a constant vector as a compare and a blend with
// AVX2 and as a compare and a masked move with AVX-512 (two operations, one more on the
// exponentials' dependency chain).
#pragma GCC diagnostic push  // GCC PR105593: _mm512_undefined_ps inside _mm512_max_ps
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
NPU_ATTN_VEC_INLINE Vec clamp_below(Vec t, Vec lowest) {
#if defined(__AVX512F__) && NPU_ATTN_VEC_BYTES == 64
  return _mm512_max_ps(lowest, t);
#elif defined(__AVX__) && NPU_ATTN_VEC_BYTES == 32
  return _mm256_max_ps(lowest, t);
#else
  return lowest > t ? lowest : t;
#endif
}
#pragma GCC diagnostic pop

// 2^t for t <= 0, the softmax's exponentials in base 2: exp(s - m) = 2^(s log2(e) - m log2(e)),
// whose argument is one FMA per score, so the range reduction costs no multiplies: t = n + f
// with n = round(t) (the magic constant, as above) and |f| <= 1/2, 2^f by a degree-5 fit, then
// times 2^n. Max relative error 2.0e-7 (~1.7 ulp, measured over 2M points of [-126, 0]).
// 2^n is built from the rounded value's bits with the exponent bias folded into the magic
// constant: its low bits hold n + 127, an integer max clamps them at 0 (where 2^n would not be
// normal) and a shift puts them in the exponent field, so 2^n is exactly 0.0f there. Results
// below ~2^-126 are therefore exactly 0 (masked keys: t = -inf) without a compare and a blend,
// and NaN stays NaN (NaN * 0). 7 operations on the FMA ports (the polynomial and the scaling)
// plus the argument's FMA; the degree-6 fit with a compare and blend for the zeros took ~3%
// longer per attention call on Zen 3 (float32, 17 model shapes, A/B in both orders).
// The polynomial is evaluated by Estrin's scheme (three independent FMAs, then two on f^2):
// 3 FMA latencies after f instead of Horner's 5, for one more multiply, so more exponentials
// overlap in the out-of-order window. With the single maxps above and two-vector passes
// (softmax_update's exp_pass), whole calls with avx2 (Zen 4 with AVX-512 hidden, 2 threads,
// 17 model shapes, A/B of the builds) took 0.97-1.00x the time, geomean 0.988 in float32, 0.99
// in the int8 kernel; avx512 1.00x.
NPU_ATTN_VEC_INLINE Vec exp2_nonpositive(Vec t) {
  const Vec tc = clamp_below(t, splat(-150.0f));
  const Vec round_magic = splat(12582912.0f + 127.0f);
  const Vec r = tc + round_magic;
  const Vec n = r - round_magic;
  const Vec f = tc - n;
  const Vec f2 = f * f;
  const Vec c45 = splat(1.3218672247603536e-3f) * f + splat(9.671698324382305e-3f);
  const Vec c23 = splat(5.550893023610115e-2f) * f + splat(2.4022237956523895e-1f);
  const Vec c01 = splat(6.931468844413757e-1f) * f + splat(1.0f);
  const Vec p = (c45 * f2 + c23) * f2 + c01;
  // bits of 1.5 * 2^23 + n + 127; of 1.5 * 2^23 itself (0x4B400000) where n + 127 <= 0
  IVec biased;
  __builtin_memcpy(&biased, &r, sizeof(r));
  const IVec zero_exponent = IVec{} + 0x4B400000;
  biased = biased > zero_exponent ? biased : zero_exponent;
  UVec exponent_bits;  // unsigned: the shift drops the high bits by definition
  __builtin_memcpy(&exponent_bits, &biased, sizeof(biased));
  exponent_bits <<= 23;
  Vec pow2_n;
  __builtin_memcpy(&pow2_n, &exponent_bits, sizeof(pow2_n));
  return p * pow2_n;
}

constexpr float kLog2e = 1.44269504088896341f;

// Whether any lane of a comparison's result is true (all ones).
NPU_ATTN_VEC_INLINE bool any_lane(IVec compared) {
  int32_t any = 0;
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) any |= compared[i];
  return any != 0;
}

// Whether any lane of a differs from the same lane of b (NaN lanes count as different).
NPU_ATTN_VEC_INLINE bool any_lane_differs(Vec a, Vec b) {
  return any_lane(a != b);
}

NPU_ATTN_VEC_INLINE int64_t min_i64(int64_t a, int64_t b) {
  return a < b ? a : b;
}
NPU_ATTN_VEC_INLINE int64_t max_i64(int64_t a, int64_t b) {
  return a > b ? a : b;
}
NPU_ATTN_VEC_INLINE int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}
NPU_ATTN_VEC_INLINE int64_t ceil_div(int64_t x, int64_t m) {
  return (x + m - 1) / m;
}

template <int N>
struct Count {
  static constexpr int value = N;
};

// Calls fn(Count<n>{}) for a runtime n in [1, Max]: turns a remainder into a template argument.
template <int Max, typename Fn>
NPU_ATTN_VEC_INLINE void with_count(int64_t n, Fn&& fn) {
  if constexpr (Max >= 1) {
    if (n == Max) {
      fn(Count<Max>{});
      return;
    }
    with_count<Max - 1>(n, fn);
  }
}

// ---------------------------------------------------------------- element types
// Tensors may hold float32, bfloat16 or float16; the kernels always compute in float32 and
// convert when they pack inputs and write results. bfloat16 is the top half of a float32;
// float16 uses the compiler's Half (F16C's vcvtph2ps/vcvtps2ph when built with -mf16c,
// libgcc's software conversion on the portable variant).
struct BFloat16 {
  uint16_t bits;
};

NPU_ATTN_VEC_INLINE float to_float(float x) {
  return x;
}
NPU_ATTN_VEC_INLINE float to_float(Half x) {
  return static_cast<float>(x);
}
NPU_ATTN_VEC_INLINE float to_float(BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
NPU_ATTN_VEC_INLINE T from_float(float x) {
  if constexpr (__is_same(T, BFloat16)) {
    return BFloat16{bfloat16_bits(x)};
  } else {
    return static_cast<T>(x);
  }
}

typedef Half UnalignedHalfVec __attribute__((vector_size(kVecBytes / 2), aligned(2), may_alias));
typedef uint16_t UnalignedU16Vec __attribute__((vector_size(kVecBytes / 2), aligned(2), may_alias));
typedef uint16_t U16Vec __attribute__((vector_size(kVecBytes / 2)));

// kLanes consecutive elements of type T as a float vector.
template <typename T>
NPU_ATTN_VEC_INLINE Vec load_as_float(const T* p) {
  if constexpr (__is_same(T, float)) {
    return load(p);
  } else if constexpr (__is_same(T, Half)) {
    // GCC 12 lowers __builtin_convertvector from Half element by element; F16C converts a
    // whole vector in one vcvtph2ps.
#if NPU_ATTN_VEC_BYTES == 64 && defined(__AVX512F__)
    // (maskz: GCC 12's unmasked form trips -Wmaybe-uninitialized inside its own header)
    return _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif NPU_ATTN_VEC_BYTES == 32 && defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif NPU_ATTN_VEC_BYTES == 16 && defined(__aarch64__)
    return vcvt_f32_f16(vld1_f16(p));
#else
    return __builtin_convertvector(*reinterpret_cast<const UnalignedHalfVec*>(p), Vec);
#endif
  } else {
    const UVec bits = __builtin_convertvector(*reinterpret_cast<const UnalignedU16Vec*>(p), UVec)
                      << 16;
    Vec v;
    __builtin_memcpy(&v, &bits, sizeof(v));
    return v;
  }
}

template <typename T>
NPU_ATTN_VEC_INLINE void store_from_float(T* p, Vec v) {
  if constexpr (__is_same(T, float)) {
    store(p, v);
  } else if constexpr (__is_same(T, Half)) {
#if NPU_ATTN_VEC_BYTES == 64 && defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_maskz_cvtps_ph(0xffff, v, _MM_FROUND_TO_NEAREST_INT));
#elif NPU_ATTN_VEC_BYTES == 32 && defined(__F16C__)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#elif NPU_ATTN_VEC_BYTES == 16 && defined(__aarch64__)
    vst1_f16(p, vcvt_f16_f32(v));
#else
    *reinterpret_cast<UnalignedHalfVec*>(p) = __builtin_convertvector(v, UnalignedHalfVec);
#endif
  } else {
    UVec bits;
    __builtin_memcpy(&bits, &v, sizeof(bits));
    UVec rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;  // bfloat16_bits, per lane
    rounded = v != v ? UVec{} + 0x7fc0u : rounded;
    *reinterpret_cast<UnalignedU16Vec*>(p) = __builtin_convertvector(rounded, U16Vec);
  }
}

// The lanes' sum, lane 0 first (a fixed order: deterministic on one ISA).
NPU_ATTN_VEC_INLINE float sum_lanes(Vec x) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += x[i];
  return s;
}

// ---------------------------------------------------------------- block transpose
// Shuffle masks for one stage of an in-register kLanes x kLanes transpose: with distance d,
// rows i and i+d (i & d == 0) exchange their off-diagonal d-wide blocks. Stages d = kLanes/2,
// ..., 1 together transpose the matrix (the classic recursive block transpose).
template <int... I>
struct LaneSeq {};
template <int N, int... I>
struct MakeLaneSeq : MakeLaneSeq<N - 1, N - 1, I...> {};
template <int... I>
struct MakeLaneSeq<0, I...> {
  using type = LaneSeq<I...>;
};

template <int D, int... L>
constexpr IVec low_mask(LaneSeq<L...>) {
  return IVec{((L & D) ? kLanes + L - D : L)...};
}
template <int D, int... L>
constexpr IVec high_mask(LaneSeq<L...>) {
  return IVec{((L & D) ? kLanes + L : L + D)...};
}

template <int D>
NPU_ATTN_VEC_INLINE void transpose_stage(Vec (&r)[kLanes]) {
  if constexpr (D >= 1) {
    constexpr IVec lo = low_mask<D>(typename MakeLaneSeq<kLanes>::type{});
    constexpr IVec hi = high_mask<D>(typename MakeLaneSeq<kLanes>::type{});
    for (int i = 0; i < kLanes; ++i) {
      if (i & D) continue;
      const Vec a = r[i], b = r[i + D];
      r[i] = __builtin_shuffle(a, b, lo);
      r[i + D] = __builtin_shuffle(a, b, hi);
    }
    transpose_stage<D / 2>(r);
  }
}

// r[i][j] <- r[j][i]
NPU_ATTN_VEC_INLINE void transpose_block(Vec (&r)[kLanes]) {
  transpose_stage<kLanes / 2>(r);
}

// Depth step i of a walk over one panel (kBlockRows elements of `step_elements` per step) of
// which `next_panel` is the next one: prefetches the next panel's elements of that step into L2,
// on every other step (a step is 24 bytes in every panel kind, so no cache line is skipped).
// Does nothing without a next panel. The products walking packed panels call it (see
// broadcast_fma_panels for why and what it measured).
template <typename T>
NPU_ATTN_VEC_INLINE void prefetch_next_panel(const T* next_panel, int64_t i,
                                             int64_t step_elements) {
  if (next_panel != nullptr && i % 2 == 0) __builtin_prefetch(next_panel + i * step_elements, 0, 2);
}

// ---------------------------------------------------------------- register-blocked products
// Register blocks: kBlockRows broadcast operands times up to kMaxBlockVecs vectors of columns.
// 6 x 4 = 24 accumulators with 32 vector registers (AVX-512, AArch64), 6 x 2 = 12 with 16
// (AVX2, SSE). A variant with 32 registers and narrower vectors says so with
// NPU_ATTN_VEC_REGISTERS.
#ifndef NPU_ATTN_VEC_REGISTERS
#define NPU_ATTN_VEC_REGISTERS (NPU_ATTN_VEC_BYTES == 64 ? 32 : 16)
#endif
constexpr int kBlockRows = 6;
constexpr int kMaxBlockVecs = NPU_ATTN_VEC_REGISTERS >= 32 ? 4 : 2;

// How the broadcast operand A(r, i) is laid out: a[r * lda + i] or a[r + i * lda]. A
// compile-time choice keeps the compiler from versioning the inner loop on the strides.
enum class ALayout { kRowMajor, kColMajor };

// c[r][v-th vector] (+)= sum_i A(r, i) * b[i][v-th vector]: A broadcast one scalar at a time,
// B read as rows of vectors. Every product of the attention kernels has this form. With
// `prefetch_a`, the A operand laid out like `a` there (the next panel) is prefetched into L2 as
// this block walks its own: see broadcast_fma_panels.
template <ALayout Layout, bool Accumulate, int Rows, int Vecs>
void broadcast_fma_block(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth,
                         float* c, int64_t ldc, const float* prefetch_a = nullptr) {
  const int64_t row_step = Layout == ALayout::kRowMajor ? lda : 1;
  const int64_t depth_step = Layout == ALayout::kRowMajor ? 1 : lda;
  Vec acc[Rows][Vecs];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < Vecs; ++v)
      acc[r][v] = Accumulate ? load(c + r * ldc + v * kLanes) : splat(0.0f);
  for (int64_t i = 0; i < depth; ++i) {
    prefetch_next_panel(prefetch_a, i, depth_step);
    Vec bi[Vecs];
#pragma GCC unroll 4
    for (int v = 0; v < Vecs; ++v) bi[v] = load(b + i * ldb + v * kLanes);
    const float* ai = a + i * depth_step;
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const Vec ar = splat(ai[r * row_step]);
#pragma GCC unroll 4
      for (int v = 0; v < Vecs; ++v) acc[r][v] += ar * bi[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < Vecs; ++v) store(c + r * ldc + v * kLanes, acc[r][v]);
}

// The order in which a product visits its register blocks. Either way every output element is
// summed over the same depth in the same order, so the results are bit-identical; only which
// operand stays in L1 differs.
// - kColumnGroupsOuter: one group of kMaxBlockVecs column vectors at a time, all row blocks
//   inside it: the group's slice of B stays in L1 while A streams past once per group.
// - kRowBlocksOuter: one block of kBlockRows rows at a time, every column group inside it: the
//   block's rows of A stay in L1 while B streams past once per row block. With 16 registers
//   (kMaxBlockVecs = 2) a 64-query tile has four column groups, and each group's B slice is one
//   64-byte line per 256-byte row of B: those lines fall into a quarter of L1's sets, so at
//   large depths they evict each other before the next row block reuses them. S^T = K Q^T on
//   AVX2 at head dim 512 measured ~40% faster rows-outer (single thread, Zen 4); where the
//   tile is a single column group (AVX-512's 64 queries) the two orders are the same loop. The
//   portable 16-byte variant (eight groups per 64 queries) walks rows-outer too, unmeasured.
enum class BlockOrder { kColumnGroupsOuter, kRowBlocksOuter };

// Calls block(Count<Rows>, Count<Vecs>, r, first_vec) for every column group of the row block
// [r, r + Rows) of a product `vecs` vectors wide.
template <int Rows, typename Block>
NPU_ATTN_VEC_INLINE void for_each_column_group(int64_t r, int64_t vecs, Block&& block) {
  for (int64_t v0 = 0; v0 < vecs; v0 += kMaxBlockVecs) {
    with_count<kMaxBlockVecs>(min_i64(kMaxBlockVecs, vecs - v0),
                              [&](auto block_vecs) { block(Count<Rows>{}, block_vecs, r, v0); });
  }
}

// Covers `rows` x `vecs` with register blocks of at most kBlockRows x kMaxBlockVecs (smaller at
// the edges), calling block(Count<Rows>, Count<Vecs>, first_row, first_vec) for each in `Order`,
// so every product kernel gets compile-time block shapes.
template <BlockOrder Order = BlockOrder::kColumnGroupsOuter, typename Block>
NPU_ATTN_VEC_INLINE void for_each_register_block(int64_t rows, int64_t vecs, Block&& block) {
  if constexpr (Order == BlockOrder::kColumnGroupsOuter) {
    for (int64_t v0 = 0; v0 < vecs; v0 += kMaxBlockVecs) {
      with_count<kMaxBlockVecs>(min_i64(kMaxBlockVecs, vecs - v0), [&](auto block_vecs) {
        int64_t r = 0;
        for (; r + kBlockRows <= rows; r += kBlockRows)
          block(Count<kBlockRows>{}, block_vecs, r, v0);
        with_count<kBlockRows - 1>(rows - r,
                                   [&](auto block_rows) { block(block_rows, block_vecs, r, v0); });
      });
    }
  } else {
    int64_t r = 0;
    for (; r + kBlockRows <= rows; r += kBlockRows)
      for_each_column_group<kBlockRows>(r, vecs, block);
    with_count<kBlockRows - 1>(rows - r, [&](auto block_rows) {
      for_each_column_group<decltype(block_rows)::value>(r, vecs, block);
    });
  }
}

// Runs broadcast_fma_block over `rows` x `vecs`, in `Order`.
template <ALayout Layout, bool Accumulate, BlockOrder Order = BlockOrder::kColumnGroupsOuter>
void broadcast_fma(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth,
                   int64_t rows, int64_t vecs, float* c, int64_t ldc) {
  const int64_t row_step = Layout == ALayout::kRowMajor ? lda : 1;
  for_each_register_block<Order>(
      rows, vecs, [&](auto block_rows, auto block_vecs, int64_t r, int64_t v0) {
        broadcast_fma_block<Layout, Accumulate, decltype(block_rows)::value,
                            decltype(block_vecs)::value>(
            a + r * row_step, lda, b + v0 * kLanes, ldb, depth, c + r * ldc + v0 * kLanes, ldc);
      });
}

// The same product with A packed in panels of kBlockRows rows (BLIS's packed A): panel p starts
// at a + p * panel_stride and holds A(p * kBlockRows + r, i) at [i * kBlockRows + r], so the
// broadcasts of one depth step are contiguous. Row blocks outside column groups
// (kRowBlocksOuter), each block a panel. The first column group of each panel prefetches the
// next panel into L2: the kernels stream K and V panels through the caches once per query
// tile, and where a pair's K and V outgrow the last-level cache the hardware prefetchers lose
// them at every jump between panels. Both products of one VAE task (head dim 512, 64 queries;
// bench/cpp/bench_panel_products, one thread, 256-bit vectors, Zen 4): 16 MiB of K and V went
// from 95-99 to 111-112 GFLOP/s, 32 MiB from 94 to 108 (4 MiB: 114 either way; prefetcht1 held
// up better than t0 at 32 MiB). Whole calls (A/B of the builds, 2 threads, outputs
// bit-identical): with avx2 the VAE mid-block took 0.85-0.89x the time at 512px and 0.94x at
// 1024px, Flux and HiDream 0.98-0.99x, head dim 64 0.99-1.00x; with avx512 0.98-0.99x.
template <bool Accumulate>
void broadcast_fma_panels(const float* a, int64_t panel_stride, const float* b, int64_t ldb,
                          int64_t depth, int64_t rows, int64_t vecs, float* c, int64_t ldc) {
  for_each_register_block<BlockOrder::kRowBlocksOuter>(
      rows, vecs, [&](auto block_rows, auto block_vecs, int64_t r, int64_t v0) {
        const float* panel = a + r / kBlockRows * panel_stride;
        const bool next_panel = v0 == 0 && r + kBlockRows < rows;
        broadcast_fma_block<ALayout::kColMajor, Accumulate, decltype(block_rows)::value,
                            decltype(block_vecs)::value>(
            panel, kBlockRows, b + v0 * kLanes, ldb, depth, c + r * ldc + v0 * kLanes, ldc,
            next_panel ? panel + panel_stride : nullptr);
      });
}

}  // namespace
}  // namespace npu_attn
