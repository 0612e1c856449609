// The elementwise steps of a decoder layer between its products, on CPU: the residual add with the RMSNorm that
// follows it, and the rotary embedding of q and k. torch runs each as several operators over the step's rows (the
// RMSNorm as a square, a mean, a reciprocal square root and two products; the rotation as a negation, a
// concatenation, two products and a sum), each a pass over memory with a tensor of its own; a prompt chunk of 512
// rows spent ~20 ms of a mixed step in them (bench/PERF.md). Here each is one pass, split over threads by rows.
//
// Every row is computed on its own, in an order fixed by the row's length, so a row's result does not depend on
// the other rows of the step. The rotation computes x * cos + rotate_half(x) * sin as torch's operators do (two
// products, then the sum, each rounded; built with -ffp-contract=off so no product is fused into the sum): the same
// bits as torch's. The RMSNorm's sum of squares runs in 16 lanes, then the lanes in a fixed order.
// Built on first use by mindie_host/backends/cpu_layer_ops.py (torch.utils.cpp_extension).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <optional>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// rows per thread's share at least (a decode step's few rows stay on one thread)
constexpr int64_t kGrainElements = 32768;

inline int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, width)); }

// x[i] += r[i] for n floats, and the sum of the new x[i]^2: 16 lanes at a time, then the lanes, then the tail.
inline float add_and_sum_squares(float* x, const float* r, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    if (r != nullptr) {
      v = _mm512_add_ps(v, _mm512_loadu_ps(r + i));
      _mm512_storeu_ps(x + i, v);
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) {
    if (r != nullptr) x[i] += r[i];
    s += x[i] * x[i];
  }
  return s;
}

// out[i] = x[i] * inv * w[i]
inline void scale_row(const float* x, float inv, const float* w, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 iv = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), iv), _mm512_loadu_ps(w + i)));
#endif
  for (; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// One head's rotation: out[d] = x[d] * c[d] - x[d + h] * s[d] for d < h, x[d] * c[d] + x[d - h] * s[d] after (h = D/2).
inline void rotate_head(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t h = D / 2;
  int64_t d = 0;
#if defined(__AVX512F__)
  if (h % 16 == 0) {
    for (; d < h; d += 16) {
      const __m512 lo = _mm512_loadu_ps(x + d), hi = _mm512_loadu_ps(x + h + d);
      _mm512_storeu_ps(out + d, _mm512_sub_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(c + d)),
                                              _mm512_mul_ps(hi, _mm512_loadu_ps(s + d))));
      _mm512_storeu_ps(out + h + d, _mm512_add_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(c + h + d)),
                                                  _mm512_mul_ps(lo, _mm512_loadu_ps(s + h + d))));
    }
    return;
  }
#endif
  for (; d < h; ++d) {
    out[d] = x[d] * c[d] - x[h + d] * s[d];
    out[h + d] = x[h + d] * c[h + d] + x[d] * s[h + d];
  }
}

void check_heads(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kFloat32 && t.stride(2) == 1 && t.stride(1) == t.size(2),
              name, ": [T, heads, D] float32, each row's heads contiguous");
}

}  // namespace

// x + residual (written into x, which must be contiguous) and the RMSNorm of the sum: [T, n] float32 each.
torch::Tensor add_rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: [T, n] float32");
  const int64_t T = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == n, "weight: [n]");
  const float* rp = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == torch::kFloat32 && residual->is_contiguous() && residual->sizes() == x.sizes(),
                "residual: like x");
    rp = residual->data_ptr<float>();
  }
  auto out = torch::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, grain_rows(n), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = xp + t * n;
      const float mean = add_and_sum_squares(row, rp == nullptr ? nullptr : rp + t * n, n) / static_cast<float>(n);
      scale_row(row, 1.f / std::sqrt(mean + feps), wp, op + t * n, n);
    }
  });
  return out;
}

// The rotary embedding (rotate-half convention) of q [T, H, D] and k [T, KV, D] (rows may be views of a wider
// product) with cos, sin [T, D]: new contiguous [T, H, D] and [T, KV, D] float32.
std::vector<torch::Tensor> rope(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  check_heads(q, "q");
  check_heads(k, "k");
  const int64_t T = q.size(0), H = q.size(1), KV = k.size(1), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && D % 2 == 0, "q, k: the same rows and an even head dim");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D, "cos, sin: [T, D] float32");
  auto qo = torch::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  auto ko = torch::empty({T, KV, D}, k.options().memory_format(at::MemoryFormat::Contiguous));
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qop = qo.data_ptr<float>(), *kop = ko.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0);
  at::parallel_for(0, T, grain_rows((H + KV) * D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < H; ++h) rotate_head(qp + t * qs + h * D, c, s, qop + (t * H + h) * D, D);
      for (int64_t h = 0; h < KV; ++h) rotate_head(kp + t * ks + h * D, c, s, kop + (t * KV + h) * D, D);
    }
  });
  return {qo, ko};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope", &rope);
}
