// The elementwise steps of a decoder layer between its products, on CPU: the residual add with the RMSNorm that
// follows it, and the rotary embedding of q and k. torch runs each as several operators over the step's rows (the
// RMSNorm as a square, a mean, a reciprocal square root and two products; the rotation as a negation, a
// concatenation, two products and a sum), each a pass over memory with a tensor of its own; a prompt chunk of 512
// rows spent ~20 ms of a mixed step in them (bench/PERF.md). Here each is one pass, split over threads by rows.
//
// Every row is computed on its own, in an order fixed by the row's length, so a row's result does not depend on
// the other rows of the step. The rotation computes x * cos + rotate_half(x) * sin as torch's operators do (two
// products, then the sum, each rounded; built with -ffp-contract=off so no product is fused into the sum): the same
// bits as torch's in every variant. The RMSNorm's sum of squares runs in vector lanes (16 with AVX-512, 2 x 8 with
// AVX2, 8 plain lanes otherwise), then the lanes in a fixed order, then the tail.
#define MINDIE_HOST_KERNEL_SOURCE 1
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "vector_math.h"

namespace {

// rows per thread's share at least (a decode step's few rows stay on one thread)
constexpr int64_t kGrainElements = 32768;

inline int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, width)); }

// x[i] += r[i] for n floats (r may be null), and the sum of the new x[i]^2.
inline float add_and_sum_squares(float* x, const float* r, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(MH_AVX512)
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
#elif defined(MH_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    if (r != nullptr) {
      v0 = _mm256_add_ps(v0, _mm256_loadu_ps(r + i));
      v1 = _mm256_add_ps(v1, _mm256_loadu_ps(r + i + 8));
      _mm256_storeu_ps(x + i, v0);
      _mm256_storeu_ps(x + i + 8, v1);
    }
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  s = mh::reduce_add(_mm256_add_ps(a0, a1));
#else
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      if (r != nullptr) x[i + j] += r[i + j];
      lanes[j] += x[i + j] * x[i + j];
    }
  }
  s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
#endif
  for (; i < n; ++i) {
    if (r != nullptr) x[i] += r[i];
    s += x[i] * x[i];
  }
  return s;
}

// out[i] = x[i] * inv * w[i] (elementwise: the compiler vectorizes it for each variant)
inline void scale_row(const float* x, float inv, const float* w, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// One head's rotation: out[d] = x[d] * c[d] - x[d + h] * s[d] for d < h, x[d] * c[d] + x[d - h] * s[d] after (h = D/2).
inline void rotate_head(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < h; ++d) out[d] = x[d] * c[d] - x[h + d] * s[d];
  for (int64_t d = 0; d < h; ++d) out[h + d] = x[h + d] * c[h + d] + x[d] * s[h + d];
}

}  // namespace

namespace mh {

void add_rms_norm(float* x, const float* residual, const float* weight, float* out, int64_t T, int64_t n, float eps) {
  parallel_for(0, T, grain_rows(n), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = x + t * n;
      const float mean = add_and_sum_squares(row, residual == nullptr ? nullptr : residual + t * n, n) /
                         static_cast<float>(n);
      scale_row(row, 1.f / std::sqrt(mean + eps), weight, out + t * n, n);
    }
  });
}

void rope(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* cos, const float* sin,
          float* qo, float* ko, int64_t T, int64_t H, int64_t KV, int64_t D) {
  parallel_for(0, T, grain_rows((H + KV) * D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos + t * D;
      const float* s = sin + t * D;
      for (int64_t h = 0; h < H; ++h) rotate_head(q + t * q_stride + h * D, c, s, qo + (t * H + h) * D, D);
      for (int64_t h = 0; h < KV; ++h) rotate_head(k + t * k_stride + h * D, c, s, ko + (t * KV + h) * D, D);
    }
  });
}

}  // namespace mh
