// The double-precision reference the kernels are tested against (see reference.h). Test-only:
// it is linked into the GoogleTest suite and the C++ benchmarks, not into the Python module.
#include "reference.h"

#include <Eigen/Dense>
#include <cmath>
#include <cstring>
#include <limits>

#include "bfloat16.h"
#include "half.h"

namespace npu_attn {

namespace {

// Row-major: the softmax and the loads walk rows (one query's scores, one token's channels).
using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
constexpr double kNegInfD = -std::numeric_limits<double>::infinity();

double element_at(const void* base, ElementType type, int64_t offset) {
  switch (type) {
    case ElementType::kFloat32:
      return static_cast<const float*>(base)[offset];
    case ElementType::kFloat16:
      return static_cast<double>(static_cast<const Half*>(base)[offset]);
    case ElementType::kBFloat16: {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[offset]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      return f;
    }
  }
  return 0;
}

void set_element(void* base, ElementType type, int64_t offset, double value) {
  const float f = static_cast<float>(value);
  switch (type) {
    case ElementType::kFloat32:
      static_cast<float*>(base)[offset] = f;
      return;
    case ElementType::kFloat16:
      static_cast<Half*>(base)[offset] = static_cast<Half>(f);
      return;
    case ElementType::kBFloat16:
      static_cast<uint16_t*>(base)[offset] = bfloat16_bits(f);
      return;
  }
}

// A (rows x cols) matrix at element `offset` of a tensor of `type`, widened to double.
Matrix load_matrix(const void* base, ElementType type, int64_t offset, int64_t rows, int64_t cols,
                   int64_t row_stride, int64_t col_stride) {
  Matrix m(rows, cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c)
      m(i, c) = element_at(base, type, offset + i * row_stride + c * col_stride);
  return m;
}

void store_matrix(const Matrix& m, void* base, ElementType type, int64_t offset, int64_t row_stride,
                  int64_t col_stride) {
  for (int64_t i = 0; i < m.rows(); ++i)
    for (int64_t c = 0; c < m.cols(); ++c)
      set_element(base, type, offset + i * row_stride + c * col_stride, m(i, c));
}

// One head's Q, K, V and its probabilities P = softmax(scale Q K^T + mask) (rows with every key
// masked are 0) with the per-row log-sum-exp.
struct ReferenceHead {
  Matrix Q, K, V, P;
  std::vector<double> lse;
};

ReferenceHead reference_head(const AttentionParams& p, int64_t b, int64_t h) {
  const int64_t hkv = h / (p.heads_q / p.heads_kv);
  ReferenceHead r;
  r.Q = load_matrix(p.q, p.element, b * p.q_stride[0] + h * p.q_stride[1], p.len_q, p.head_dim,
                    p.q_stride[2], p.q_stride[3]);
  r.K = load_matrix(p.k, p.element, b * p.k_stride[0] + hkv * p.k_stride[1], p.len_k, p.head_dim,
                    p.k_stride[2], p.k_stride[3]);
  r.V = load_matrix(p.v, p.element, b * p.v_stride[0] + hkv * p.v_stride[1], p.len_k, p.head_dim_v,
                    p.v_stride[2], p.v_stride[3]);
  Matrix S = (r.Q * r.K.transpose()) * static_cast<double>(p.scale);
  for (int64_t i = 0; i < p.len_q; ++i) {
    for (int64_t j = 0; j < p.len_k; ++j) {
      const int64_t moff =
          b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2] + j * p.mask_stride[3];
      if (p.mask_kind == MaskKind::kAdditive) {
        S(i, j) += static_cast<const float*>(p.mask)[moff];
      } else if (p.mask_kind == MaskKind::kBool && !static_cast<const uint8_t*>(p.mask)[moff]) {
        S(i, j) = kNegInfD;
      }
      if (p.is_causal && j > i) S(i, j) = kNegInfD;
    }
  }
  r.P = Matrix::Zero(p.len_q, p.len_k);
  r.lse.assign(p.len_q, kNegInfD);
  for (int64_t i = 0; i < p.len_q; ++i) {
    const double m = p.len_k > 0 ? S.row(i).maxCoeff() : kNegInfD;
    if (m == kNegInfD) continue;  // every key masked: output row 0, lse -inf
    double sum = 0;
    for (int64_t j = 0; j < p.len_k; ++j) sum += (r.P(i, j) = std::exp(S(i, j) - m));
    r.P.row(i) /= sum;
    r.lse[i] = m + std::log(sum);
  }
  return r;
}

}  // namespace

void attention_reference(const AttentionParams& p) {
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const ReferenceHead r = reference_head(p, b, h);
      const ElementType out_type = p.out_float32 ? ElementType::kFloat32 : p.element;
      store_matrix(r.P * r.V, p.out, out_type, b * p.out_stride[0] + h * p.out_stride[1],
                   p.out_stride[2], p.out_stride[3]);
      if (p.lse) {
        for (int64_t i = 0; i < p.len_q; ++i) {
          p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] =
              static_cast<float>(r.lse[i]);
        }
      }
    }
  }
}

void attention_backward_reference(const AttentionBackwardParams& bp) {
  const AttentionParams& p = bp.fwd;
  const int64_t group = p.heads_q / p.heads_kv;
  const double scale = p.scale;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t hkv = 0; hkv < p.heads_kv; ++hkv) {
      Matrix dK = Matrix::Zero(p.len_k, p.head_dim), dV = Matrix::Zero(p.len_k, p.head_dim_v);
      for (int64_t h = hkv * group; h < (hkv + 1) * group; ++h) {
        const ReferenceHead r = reference_head(p, b, h);
        const Matrix dO = load_matrix(
            bp.grad_out, p.element, b * bp.grad_out_stride[0] + h * bp.grad_out_stride[1], p.len_q,
            p.head_dim_v, bp.grad_out_stride[2], bp.grad_out_stride[3]);
        const Matrix O = r.P * r.V;
        Eigen::VectorXd delta = (dO.array() * O.array()).rowwise().sum();
        if (bp.grad_lse) {
          for (int64_t i = 0; i < p.len_q; ++i) {
            delta(i) -= bp.grad_lse[b * bp.grad_lse_stride[0] + h * bp.grad_lse_stride[1] +
                                    i * bp.grad_lse_stride[2]];
          }
        }
        const Matrix dP = dO * r.V.transpose();
        const Matrix dS = (r.P.array() * (dP.colwise() - delta).array()).matrix();
        dV += r.P.transpose() * dO;
        dK += dS.transpose() * r.Q * scale;
        store_matrix(dS * r.K * scale, bp.grad_q, p.element,
                     b * bp.grad_q_stride[0] + h * bp.grad_q_stride[1], bp.grad_q_stride[2],
                     bp.grad_q_stride[3]);
      }
      store_matrix(dK, bp.grad_k, p.element, b * bp.grad_k_stride[0] + hkv * bp.grad_k_stride[1],
                   bp.grad_k_stride[2], bp.grad_k_stride[3]);
      store_matrix(dV, bp.grad_v, p.element, b * bp.grad_v_stride[0] + hkv * bp.grad_v_stride[1],
                   bp.grad_v_stride[2], bp.grad_v_stride[3]);
    }
  }
}

}  // namespace npu_attn
