// The C++ API of the attention core: argument validation (the single boundary check that turns
// caller tensors into a trusted AttentionParams) and threads. The test-only double-precision
// reference is in reference.h.
// No Python here: the pybind11 binding (bindings.cpp) converts Python objects to TensorView.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_params.h"

namespace npu_attn {

enum class DType { kFloat32, kFloat64, kFloat16, kBFloat16, kBool, kUInt8, kOther };
const char* dtype_name(DType dtype);

// A non-owning view of a caller's tensor: strides in elements, may be negative or zero.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kOther;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  bool on_cpu = true;
  std::string device = "cpu";  // for error messages
};

// Bad arguments. `kind` tells the binding which Python exception to raise.
class ArgumentError : public std::invalid_argument {
 public:
  enum class Kind { kType, kValue };
  ArgumentError(Kind kind, const std::string& message)
      : std::invalid_argument(message), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

struct SdpaArguments {
  TensorView query;                     // (B, Hq, Lq, D)
  TensorView key;                       // (B, Hkv, Lk, D)
  TensorView value;                     // (B, Hkv, Lk, Dv)
  std::optional<TensorView> attn_mask;  // bool or float32, broadcastable to (B, Hq, Lq, Lk)
  TensorView out;                       // (B, Hq, Lq, Dv) query's dtype or float32, written
  std::optional<TensorView> lse;        // (B, Hq, Lq) float32, written
  std::optional<double> scale;          // default 1/sqrt(D)
  bool is_causal = false;
  bool enable_gqa = false;
  int num_threads = 1;
};

// Checks every argument and builds the kernel parameters. Throws ArgumentError naming the
// argument and what was expected.
AttentionParams make_attention_params(const SdpaArguments& args);

// The backward of one SdpaArguments call. `forward.out` and `forward.lse` are that call's
// results (read, lse required); the three gradients are written in full.
struct SdpaBackwardArguments {
  SdpaArguments forward;
  TensorView grad_out;                 // (B, Hq, Lq, Dv) query's dtype
  std::optional<TensorView> grad_lse;  // (B, Hq, Lq) float32, gradient of the lse output
  TensorView grad_query;               // like query, written
  TensorView grad_key;                 // like key, written
  TensorView grad_value;               // like value, written
};

// Checks every argument of the backward (the forward's too) and builds the kernel parameters.
AttentionBackwardParams make_attention_backward_params(const SdpaBackwardArguments& args);

// Threads used by the kernels (defaults to omp_get_max_threads() at first use).
int get_num_threads();
void set_num_threads(int threads);  // throws ArgumentError if threads < 1

}  // namespace npu_attn
