// Decode attention on CPU over a slot-major paged KV cache: one query token per sequence.
//
// Each (sequence, KV head) is one task (each query head, for one or two sequences), computed start to
// end by one thread in a fixed order (scores over the context, softmax, weighted sum of values), so a
// sequence's output does not
// depend on what else is in the batch: the batch-invariant decode path of
// mindie_host/backends/platform.py calls it for every generated token. It reads bfloat16 or
// float32 K/V straight from the cache slots (no gather, no copy), and computes in float32.
// Built on first use by mindie_host/backends/cpu_attention.py (torch.utils.cpp_extension).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

inline void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 va = _mm512_set1_ps(a);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

#if defined(__AVX512F__)
// e^x for x <= 0 (scores minus their maximum): 2^n * p(r) with a degree-6 polynomial, ~1e-7 relative error
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 K/V values (dims c*16 .. c*16+15 of a row) as float32
inline __m512 load16(const float* row, int c) { return _mm512_loadu_ps(row + c * 16); }
inline __m512 load16(const at::BFloat16* row, int c) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 16));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One task with head dim 16 * ND: the query heads g0 .. g0 + GN of KV head h of sequence b. Queries and
// accumulators stay in registers; softmax runs 16 scores at a time.
template <typename T, int ND>
void task_vec(const float* qb, const T* k, const T* v, const int64_t* idx, int64_t ctx, int64_t KV, int64_t h,
              int64_t GN, float scale, float* scores, float* out) {
  constexpr int64_t D = 16 * ND;
  const int64_t padded = (ctx + 15) / 16 * 16;
  for (int64_t g = 0; g < GN; ++g) {
    __m512 qv[ND];
    for (int c = 0; c < ND; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(qb + g * D + c * 16), _mm512_set1_ps(scale));
    float* sg = scores + g * padded;
    for (int64_t t = 0; t < ctx; ++t) {
      const T* kr = k + (idx[t] * KV + h) * D;
      __m512 acc = _mm512_mul_ps(qv[0], load16(kr, 0));
      for (int c = 1; c < ND; ++c) acc = _mm512_fmadd_ps(qv[c], load16(kr, c), acc);
      sg[t] = _mm512_reduce_add_ps(acc);
    }
    for (int64_t t = ctx; t < padded; ++t) sg[t] = -FLT_MAX;
    __m512 mx = _mm512_set1_ps(-FLT_MAX);
    for (int64_t t = 0; t < padded; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sg + t), m));
      _mm512_storeu_ps(sg + t, e);
      total = _mm512_add_ps(total, e);
    }
    const float inv = 1.f / _mm512_reduce_add_ps(total);
    __m512 o[ND];
    for (int c = 0; c < ND; ++c) o[c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < ctx; ++t) {
      const T* vr = v + (idx[t] * KV + h) * D;
      const __m512 w = _mm512_set1_ps(sg[t]);
      for (int c = 0; c < ND; ++c) o[c] = _mm512_fmadd_ps(w, load16(vr, c), o[c]);
    }
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(out + g * D + c * 16, _mm512_mul_ps(o[c], _mm512_set1_ps(inv)));
  }
}
#endif

template <typename T>
void run(const float* q, const T* k, const T* v, const int64_t* slots, const int64_t* ctx_lens, float* out,
         int64_t B, int64_t H, int64_t KV, int64_t D, int64_t max_ctx, float scale) {
  const int64_t G = H / KV;
  // A task is a (sequence, KV head) with its G query heads, which share each K and V row read. When
  // that gives fewer than two tasks a thread (one or two sequences), each query head is a task of its
  // own: every head's arithmetic is the same code in the same order either way, so the output bits
  // do not depend on the split.
  const int64_t GN = B * KV < 2 * at::get_num_threads() ? 1 : G;
  const int64_t per_head = G / GN;
  at::parallel_for(0, B * KV * per_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D), scores, acc(GN * D), total(GN);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (KV * per_head), h = (task / per_head) % KV, g0 = (task % per_head) * GN;
      const int64_t ctx = ctx_lens[b];
      const int64_t* idx = slots + b * max_ctx;
      const float* qb = q + (b * H + h * G + g0) * D;
#if defined(__AVX512F__)
      if (D == 64 || D == 128) {
        scores.resize(GN * ((ctx + 15) / 16 * 16));
        float* o = out + (b * H + h * G + g0) * D;
        if (D == 64)
          task_vec<T, 4>(qb, k, v, idx, ctx, KV, h, GN, scale, scores.data(), o);
        else
          task_vec<T, 8>(qb, k, v, idx, ctx, KV, h, GN, scale, scores.data(), o);
        continue;
      }
#endif
      scores.assign(GN * ctx, 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const T* kr = k + (idx[t] * KV + h) * D;
        load_row(kr, row.data(), D);
        for (int64_t g = 0; g < GN; ++g) scores[g * ctx + t] = dot(qb + g * D, row.data(), D) * scale;
      }
      for (int64_t g = 0; g < GN; ++g) {
        float* sg = scores.data() + g * ctx;
        float m = -FLT_MAX;
        for (int64_t t = 0; t < ctx; ++t) m = sg[t] > m ? sg[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        total[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const T* vr = v + (idx[t] * KV + h) * D;
        load_row(vr, row.data(), D);
        for (int64_t g = 0; g < GN; ++g) {
          axpy(scores[g * ctx + t], row.data(), acc.data() + g * D, D);
        }
      }
      for (int64_t g = 0; g < GN; ++g) {
        float* o = out + (b * H + h * G + g0 + g) * D;
        const float inv = 1.f / total[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor slots, torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: [B, H, D] float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches: [S, KV, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.size(0) == q.size(0), "slots");
  TORCH_CHECK(ctx_lens.scalar_type() == torch::kInt64 && ctx_lens.is_contiguous(), "ctx_lens");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && H % KV == 0, "head shapes");
  auto out = torch::empty_like(q);
  if (k_cache.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                      slots.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KV, D,
                      slots.size(1), static_cast<float>(scale));
  } else {
    TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32, "caches: float32 or bfloat16");
    run<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots.data_ptr<int64_t>(),
               ctx_lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KV, D, slots.size(1),
               static_cast<float>(scale));
  }
  return out;
}

// As a torch operator too, for compiled graphs to call without going through Python.
TORCH_LIBRARY_FRAGMENT(mindie_host_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor ctx_lens, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(mindie_host_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode_attention", &decode_attention); }
