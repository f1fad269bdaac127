// Straightforward attention in double precision: the oracle for the kernels' tests. It
// materialises the (Lq x Lk) scores of one head at a time, so it is for tests only and is not
// part of the shipped library (CMake builds it as npu_attn_reference).
#pragma once

#include "attention_params.h"

namespace npu_attn {

// Same semantics as the kernels (masks, causal, GQA, scale, strides, fully masked rows -> 0 and
// lse -inf), accumulated in double.
void attention_reference(const AttentionParams& params);

// The gradients of attention_reference, computed in double from the inputs alone (P from a full
// softmax, not from the saved lse).
void attention_backward_reference(const AttentionBackwardParams& params);

}  // namespace npu_attn
