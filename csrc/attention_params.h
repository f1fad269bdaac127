// The plain parameter struct every attention kernel sees.
//
// It is deliberately a POD with no member functions: it is included by the per-ISA translation
// units, and any inline function here would become a weak symbol that the linker may merge
// across ISA flags (see csrc/kernels/attention_forward_impl.h). Validation happens once, in
// make_attention_params() (attention.h); kernels trust what they get.
#pragma once

#include <cstdint>

namespace npu_attn {

enum class MaskKind : int32_t {
  kNone = 0,
  kBool = 1,      // uint8/bool, nonzero = attend (torch convention)
  kAdditive = 2,  // float32, added to the scaled scores
};

// The element type of q, k, v and out (and of the backward's gradients): all the same, except
// that a 16-bit call may write out in float32 (out_float32). The kernels compute in float32
// whatever it is. lse is always float32.
enum class ElementType : int32_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
};

// Element strides are signed: NumPy views may have negative strides, broadcast dims have 0.
struct AttentionParams {
  const void* q = nullptr;  // (batch, heads_q, len_q, head_dim)
  const void* k = nullptr;  // (batch, heads_kv, len_k, head_dim)
  const void* v = nullptr;  // (batch, heads_kv, len_k, head_dim_v)
  void* out = nullptr;      // (batch, heads_q, len_q, head_dim_v)
  ElementType element = ElementType::kFloat32;
  // out is float32 whatever `element` is: a 16-bit forward whose backward will follow keeps
  // the unrounded output, from which the backward's Delta = rowsum(dO * O) is exact (from the
  // 16-bit output its rounding dominates dS where softmaxes are sharp).
  bool out_float32 = false;
  float* lse = nullptr;  // optional (batch, heads_q, len_q): log-sum-exp of scaled scores
  const void* mask = nullptr;
  MaskKind mask_kind = MaskKind::kNone;  // an additive mask is float32 whatever `element` is

  int64_t batch = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;  // heads_q % heads_kv == 0 (grouped-query attention)
  int64_t len_q = 0;
  int64_t len_k = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;

  int64_t q_stride[4] = {0, 0, 0, 0};
  int64_t k_stride[4] = {0, 0, 0, 0};
  int64_t v_stride[4] = {0, 0, 0, 0};
  int64_t out_stride[4] = {0, 0, 0, 0};
  int64_t mask_stride[4] = {0, 0, 0, 0};  // broadcast dims have stride 0
  int64_t lse_stride[3] = {0, 0, 0};

  float scale = 1.0f;
  bool is_causal = false;  // top-left aligned: query i attends keys j <= i
  int num_threads = 1;
};

// Everything the backward kernel sees. `fwd` describes the forward call being differentiated:
// its q, k, v, mask, scale, causal flag, threads, and its results `out` and `lse` (both read
// here; lse is required). The gradients are written, every element.
struct AttentionBackwardParams {
  AttentionParams fwd;

  // grad_out and the three gradients have fwd.element's type; grad_lse is float32.
  const void* grad_out = nullptr;   // (batch, heads_q, len_q, head_dim_v)
  const float* grad_lse = nullptr;  // optional (batch, heads_q, len_q): gradient of lse
  void* grad_q = nullptr;           // (batch, heads_q, len_q, head_dim)
  void* grad_k = nullptr;           // (batch, heads_kv, len_k, head_dim), summed over a GQA group
  void* grad_v = nullptr;           // (batch, heads_kv, len_k, head_dim_v)

  int64_t grad_out_stride[4] = {0, 0, 0, 0};
  int64_t grad_lse_stride[3] = {0, 0, 0};
  int64_t grad_q_stride[4] = {0, 0, 0, 0};
  int64_t grad_k_stride[4] = {0, 0, 0, 0};
  int64_t grad_v_stride[4] = {0, 0, 0, 0};
};

}  // namespace npu_attn
