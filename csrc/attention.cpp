#include "attention.h"

#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace npu_attn {
namespace {

std::atomic<int> g_num_threads{0};  // 0: not set, use OpenMP's default

[[noreturn]] void fail_type(const std::string& message) {
  throw ArgumentError(ArgumentError::Kind::kType, message);
}
[[noreturn]] void fail_value(const std::string& message) {
  throw ArgumentError(ArgumentError::Kind::kValue, message);
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << (shape.size() == 1 ? ",)" : ")");
  return os.str();
}

void check_view_consistent(const TensorView& t, const char* name) {
  if (t.shape.size() != t.strides.size())
    fail_value(std::string(name) + ": shape/stride rank mismatch");
  for (int64_t s : t.shape)
    if (s < 0) fail_value(std::string(name) + " has a negative size " + shape_string(t.shape));
  if (!t.on_cpu) {
    fail_type(std::string(name) + " must be a CPU tensor for the tiled kernel, got device '" +
              t.device + "'");
  }
}

// `dtype` is the one the tensor must have (query's for key/value/out/gradients, float32 for
// lse); `why` says where that requirement comes from.
void check_tensor(const TensorView& t, const char* name, size_t rank, const char* dims, DType dtype,
                  const char* why = "") {
  check_view_consistent(t, name);
  if (t.dtype != dtype) {
    fail_type(std::string(name) + " must be " + dtype_name(dtype) + why + ", got " +
              dtype_name(t.dtype));
  }
  if (t.shape.size() != rank) {
    std::ostringstream os;
    os << name << " must have " << rank << " dimensions " << dims << ", got shape "
       << shape_string(t.shape);
    fail_value(os.str());
  }
}

void check_shape(const TensorView& t, const char* name, const std::vector<int64_t>& expected) {
  if (t.shape != expected) {
    fail_value(std::string(name) + " must have shape " + shape_string(expected) + ", got " +
               shape_string(t.shape));
  }
}

// A written tensor must not have two elements at one address (zero stride on a real dim).
void check_writable(const TensorView& t, const char* name) {
  for (int64_t size : t.shape)
    if (size == 0) return;  // no elements, nothing can overlap
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (t.shape[i] > 1 && t.strides[i] == 0) {
      fail_value(std::string(name) + " has overlapping memory (stride 0 in dim " +
                 std::to_string(i) + "); it must be a writable, non-broadcast tensor");
    }
  }
}

// Element offsets must fit in int64 so pointer arithmetic in the kernels cannot overflow.
void check_addressable(const TensorView& t, const char* name) {
  const double limit = static_cast<double>(std::numeric_limits<int64_t>::max()) / 16;
  double extent = 0;
  for (size_t i = 0; i < t.shape.size(); ++i) {
    extent += static_cast<double>(t.shape[i]) * std::fabs(static_cast<double>(t.strides[i]));
  }
  if (extent > limit) fail_value(std::string(name) + " is too large to address");
}

void copy4(int64_t* dst, const std::vector<int64_t>& src) {
  for (size_t i = 0; i < src.size(); ++i) dst[i] = src[i];
}

void set_mask(const TensorView& mask, const AttentionParams& p, AttentionParams& out) {
  check_view_consistent(mask, "attn_mask");
  if (mask.dtype == DType::kBool) {
    out.mask_kind = MaskKind::kBool;
  } else if (mask.dtype == DType::kFloat32) {
    out.mask_kind = MaskKind::kAdditive;
  } else {
    fail_type(std::string("attn_mask must be bool (True = attend) or float32 (added to the "
                          "scores, same dtype as query), got ") +
              dtype_name(mask.dtype));
  }
  const std::vector<int64_t> target = {p.batch, p.heads_q, p.len_q, p.len_k};
  if (mask.shape.size() > 4) {
    fail_value("attn_mask must have at most 4 dimensions, got shape " + shape_string(mask.shape));
  }
  const size_t offset = 4 - mask.shape.size();
  for (size_t i = 0; i < 4; ++i) {
    if (i < offset) {
      out.mask_stride[i] = 0;
      continue;
    }
    const int64_t size = mask.shape[i - offset];
    if (size == target[i]) {
      out.mask_stride[i] = size == 1 ? 0 : mask.strides[i - offset];
    } else if (size == 1) {
      out.mask_stride[i] = 0;
    } else {
      fail_value("attn_mask of shape " + shape_string(mask.shape) +
                 " cannot be broadcast to (batch, heads, L_q, L_k) = " + shape_string(target));
    }
  }
  check_addressable(mask, "attn_mask");
  out.mask = mask.data;
}

}  // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kBool:
      return "bool";
    case DType::kUInt8:
      return "uint8";
    case DType::kOther:
      return "an unsupported dtype";
  }
  return "unknown";
}

AttentionParams make_attention_params(const SdpaArguments& args) {
  const DType dtype = args.query.dtype;
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    check_view_consistent(args.query, "query");
    fail_type(std::string("query must be float32, bfloat16 or float16, got ") + dtype_name(dtype));
  }
  const char* like_query = " (the same dtype as query)";
  check_tensor(args.query, "query", 4, "(batch, heads, L_q, head_dim)", dtype);
  check_tensor(args.key, "key", 4, "(batch, kv_heads, L_k, head_dim)", dtype, like_query);
  check_tensor(args.value, "value", 4, "(batch, kv_heads, L_k, head_dim_v)", dtype, like_query);
  const auto& qs = args.query.shape;
  const auto& ks = args.key.shape;
  const auto& vs = args.value.shape;

  AttentionParams p;
  p.batch = qs[0];
  p.heads_q = qs[1];
  p.len_q = qs[2];
  p.head_dim = qs[3];
  p.heads_kv = ks[1];
  p.len_k = ks[2];
  p.head_dim_v = vs[3];

  if (ks[0] != p.batch || vs[0] != p.batch) {
    fail_value("query, key and value must have the same batch size, got " + shape_string(qs) +
               ", " + shape_string(ks) + ", " + shape_string(vs));
  }
  if (ks[3] != p.head_dim) {
    fail_value("key's head_dim (" + std::to_string(ks[3]) + ") must equal query's (" +
               std::to_string(p.head_dim) + ")");
  }
  if (vs[1] != p.heads_kv || vs[2] != p.len_k) {
    fail_value("value must have the same heads and L_k as key: key " + shape_string(ks) +
               ", value " + shape_string(vs));
  }
  if (p.heads_kv != p.heads_q) {
    if (!args.enable_gqa) {
      fail_value("query has " + std::to_string(p.heads_q) + " heads but key/value have " +
                 std::to_string(p.heads_kv) + "; pass enable_gqa=True for grouped-query attention");
    }
    if (p.heads_kv == 0 || p.heads_q % p.heads_kv != 0) {
      fail_value("with enable_gqa=True, query heads (" + std::to_string(p.heads_q) +
                 ") must be a multiple of key/value heads (" + std::to_string(p.heads_kv) + ")");
    }
  }

  // A 16-bit call may keep its output in float32 (AttentionParams::out_float32).
  const bool out_float32 = dtype != DType::kFloat32 && args.out.dtype == DType::kFloat32;
  check_tensor(args.out, "out", 4, "(batch, heads, L_q, head_dim_v)",
               out_float32 ? DType::kFloat32 : dtype,
               dtype == DType::kFloat32 ? like_query : " (the same dtype as query, or float32)");
  check_shape(args.out, "out", {p.batch, p.heads_q, p.len_q, p.head_dim_v});
  check_writable(args.out, "out");
  if (args.lse) {
    check_tensor(*args.lse, "lse", 3, "(batch, heads, L_q)", DType::kFloat32);
    check_shape(*args.lse, "lse", {p.batch, p.heads_q, p.len_q});
    check_writable(*args.lse, "lse");
    check_addressable(*args.lse, "lse");
    p.lse = static_cast<float*>(args.lse->data);
    for (int i = 0; i < 3; ++i) p.lse_stride[i] = args.lse->strides[i];
  }
  for (const auto* t : {&args.query, &args.key, &args.value, &args.out}) {
    check_addressable(*t, "query/key/value/out");
  }

  if (args.scale) {
    const double s = *args.scale;
    if (!std::isfinite(s) || s < 0) {
      std::ostringstream os;
      os << "scale must be a finite, non-negative number, got " << s;
      fail_value(os.str());
    }
    p.scale = static_cast<float>(s);
  } else {
    p.scale = p.head_dim > 0 ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.head_dim)))
                             : 1.0f;
  }
  if (args.num_threads < 1) fail_value("num_threads must be >= 1");

  p.q = args.query.data;
  p.k = args.key.data;
  p.v = args.value.data;
  p.out = args.out.data;
  p.element = dtype == DType::kFloat32    ? ElementType::kFloat32
              : dtype == DType::kBFloat16 ? ElementType::kBFloat16
                                          : ElementType::kFloat16;
  copy4(p.q_stride, args.query.strides);
  copy4(p.k_stride, args.key.strides);
  copy4(p.v_stride, args.value.strides);
  p.out_float32 = out_float32;
  copy4(p.out_stride, args.out.strides);
  if (args.attn_mask) set_mask(*args.attn_mask, p, p);
  p.is_causal = args.is_causal;
  p.num_threads = args.num_threads;
  return p;
}

AttentionBackwardParams make_attention_backward_params(const SdpaBackwardArguments& args) {
  if (!args.forward.lse) fail_value("lse (the forward's log-sum-exp) is required for the backward");
  AttentionBackwardParams bp;
  bp.fwd = make_attention_params(args.forward);
  const AttentionParams& p = bp.fwd;
  const std::vector<int64_t> q_shape = {p.batch, p.heads_q, p.len_q, p.head_dim};
  const std::vector<int64_t> k_shape = {p.batch, p.heads_kv, p.len_k, p.head_dim};
  const std::vector<int64_t> v_shape = {p.batch, p.heads_kv, p.len_k, p.head_dim_v};
  const std::vector<int64_t> o_shape = {p.batch, p.heads_q, p.len_q, p.head_dim_v};

  const DType dtype = args.forward.query.dtype;
  const char* like_query = " (the same dtype as query)";
  check_tensor(args.grad_out, "grad_out", 4, "(batch, heads, L_q, head_dim_v)", dtype, like_query);
  check_shape(args.grad_out, "grad_out", o_shape);
  check_addressable(args.grad_out, "grad_out");
  bp.grad_out = args.grad_out.data;
  copy4(bp.grad_out_stride, args.grad_out.strides);
  if (args.grad_lse) {
    check_tensor(*args.grad_lse, "grad_lse", 3, "(batch, heads, L_q)", DType::kFloat32);
    check_shape(*args.grad_lse, "grad_lse", {p.batch, p.heads_q, p.len_q});
    check_addressable(*args.grad_lse, "grad_lse");
    bp.grad_lse = static_cast<const float*>(args.grad_lse->data);
    for (int i = 0; i < 3; ++i) bp.grad_lse_stride[i] = args.grad_lse->strides[i];
  }

  struct Output {
    const TensorView& view;
    const char* name;
    const std::vector<int64_t>& shape;
    void** data;
    int64_t* strides;
  };
  for (const Output& o :
       {Output{args.grad_query, "grad_query", q_shape, &bp.grad_q, bp.grad_q_stride},
        Output{args.grad_key, "grad_key", k_shape, &bp.grad_k, bp.grad_k_stride},
        Output{args.grad_value, "grad_value", v_shape, &bp.grad_v, bp.grad_v_stride}}) {
    check_tensor(o.view, o.name, 4, "(batch, heads, L, head_dim)", dtype, like_query);
    check_shape(o.view, o.name, o.shape);
    check_writable(o.view, o.name);
    check_addressable(o.view, o.name);
    *o.data = o.view.data;
    copy4(o.strides, o.view.strides);
  }
  return bp;
}

int get_num_threads() {
  const int n = g_num_threads.load();
  return n > 0 ? n : omp_get_max_threads();
}

void set_num_threads(int threads) {
  if (threads < 1) fail_value("num_threads must be >= 1, got " + std::to_string(threads));
  g_num_threads.store(threads);
}

}  // namespace npu_attn
