// Attention on CPU over a slot-major paged KV cache ([slots, KV heads, D], bfloat16 or float32), read in place.
//
// decode_attention: one query token per sequence. Each (sequence, KV head) is one task (each query head, for one
// or two sequences), computed start to end by one thread in a fixed order (scores over the context, softmax,
// weighted sum of values), so a sequence's output does not depend on what else is in the batch: the
// batch-invariant decode path of mindie_host/backends/platform.py calls it for every generated token.
//
// prompt_attention: the n prompt tokens of one sequence (a whole prompt or a chunk of one) over its context,
// causally. Flash-style: a task is (KV head, block of 16 query rows) and walks the visible keys in blocks of 16
// with a running maximum and sum, so only the keys a row can see are scored. Its query vectors sit one per float32
// lane, so scores, softmax and the weighted sum of values are all lane-wise fused multiply-adds (no horizontal
// sums, no transposed keys); the order of every reduction is fixed by the shapes alone, so the result is the same
// whichever thread runs a task.
//
// Decode attention computes in float32. Prompt attention does too over a float32 cache; over a bfloat16 cache (on
// CPUs with AVX512-BF16) its two products take bf16 operands with float32 sums, as flash attention does on bf16
// inputs (bench/PERF.md: no measurable change in perplexity or agreement with the float32 model).
// Built on first use by mindie_host/backends/cpu_attention.py (torch.utils.cpp_extension).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "vector_math.h"

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
// 16 K/V values (dims c*16 .. c*16+15 of a row) as float32
inline __m512 load16(const float* row, int c) { return _mm512_loadu_ps(row + c * 16); }
inline __m512 load16(const at::BFloat16* row, int c) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 16));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Ask for the cache lines of heads h0 .. h1 of the slots of tokens t0 .. t1 (the next chunk's rows: a paged
// cache's blocks sit anywhere, which the hardware prefetcher cannot follow).
template <typename T, int HINT = _MM_HINT_T0>
inline void prefetch_rows(const T* cache, const int64_t* idx, int64_t t0, int64_t t1, int64_t KV, int64_t h0,
                          int64_t h1, int64_t head_bytes) {
  for (int64_t t = t0; t < t1; ++t) {
    const char* row = reinterpret_cast<const char*>(cache + idx[t] * KV * (head_bytes / sizeof(T)));
    for (int64_t off = h0 * head_bytes; off < h1 * head_bytes; off += 64) _mm_prefetch(row + off, (_mm_hint)HINT);
  }
}

// A K or V row of head dim 16 * ND as ND float32 vectors, in the kernel's dim order: float32 rows as stored;
// bfloat16 rows as each 32-dim chunk's even dims then its odd dims (one 64-byte load, one shift and one mask
// for 32 values). Queries are put in the same order (row_dim), so dot products pair the same dims, and the
// values' accumulators are put back through row_dim when stored.
template <int ND>
inline void load_row(const float* row, __m512* out) {
  for (int c = 0; c < ND; ++c) out[c] = _mm512_loadu_ps(row + c * 16);
}
template <int ND>
inline void load_row(const at::BFloat16* row, __m512* out) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int c = 0; c < ND; c += 2) {
    const __m512i raw = _mm512_loadu_si512(row + c * 16);
    out[c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    out[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
  }
}

// Dim i of a row in the order load_row gives for T (identity for float32).
template <typename T>
inline int64_t row_dim(int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return i;
  } else {
    const int64_t chunk = i / 32, j = i % 32;
    return chunk * 32 + (j < 16 ? 2 * j : 2 * (j - 16) + 1);
  }
}

// The sums of four vectors' lanes: lanes 0, 4, 8 and 12 of the result hold a's, b's, c's and d's totals. The
// same fixed tree of additions for every row, whichever tokens share the group.
inline __m512 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
  return _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
}

// Scores of NG query heads of KV head h (their queries, scaled and in row order, ND vectors apart at qv) over
// tokens t0 .. t1 (a multiple of 4 of them, but the last group), ``padded`` apart at sg: each K row is read and
// converted once for all of them, and four tokens' sums are finished together.
template <typename T, int ND, int NG>
inline void score_heads(const __m512* qv, const T* k, const int64_t* idx, int64_t t0, int64_t t1, int64_t KV,
                        int64_t h, float* sg, int64_t padded) {
  constexpr int64_t D = 16 * ND;
  const __m512i pick = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  for (int64_t t = t0; t < t1; t += 4) {
    const int64_t n = std::min<int64_t>(4, t1 - t);
    __m512 s[NG][4];
    for (int j = 0; j < 4; ++j) {
      const T* kr = k + (idx[t + std::min<int64_t>(j, n - 1)] * KV + h) * D;  // a short group repeats its last row
      __m512 kv[ND];
      load_row<ND>(kr, kv);
      for (int g = 0; g < NG; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g * ND], kv[0]);
        for (int c = 1; c < ND; ++c) acc = _mm512_fmadd_ps(qv[g * ND + c], kv[c], acc);
        s[g][j] = acc;
      }
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < NG; ++g)
      _mm512_mask_storeu_ps(sg + g * padded + t, keep,
                            _mm512_permutexvar_ps(pick, sum4(s[g][0], s[g][1], s[g][2], s[g][3])));
  }
}

// Adds tokens t0 .. t1's V rows of KV head h, weighted by each of NG heads' softmax numerators (``padded``
// apart at sg), to their accumulators (D apart at acc, in row order): each V row is read and converted once for
// all of them.
template <typename T, int ND, int NG>
inline void value_heads(const float* sg, int64_t padded, const T* v, const int64_t* idx, int64_t t0, int64_t t1,
                        int64_t KV, int64_t h, float* acc) {
  constexpr int64_t D = 16 * ND;
  __m512 o[NG][ND];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < ND; ++c) o[g][c] = _mm512_loadu_ps(acc + g * D + c * 16);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 vv[ND];
    load_row<ND>(v + (idx[t] * KV + h) * D, vv);
    for (int g = 0; g < NG; ++g) {
      const __m512 w = _mm512_set1_ps(sg[g * padded + t]);
      for (int c = 0; c < ND; ++c) o[g][c] = _mm512_fmadd_ps(w, vv[c], o[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(acc + g * D + c * 16, o[g][c]);
}

// One task with head dim 16 * ND: query heads g0 .. g0 + GN of KV heads h0 .. h1 of one sequence (q and out point
// at the sequence's first head). Tokens are walked in chunks of 32, every head of the task over a chunk before the
// next, so a cache slot's heads are read together; each head's query and accumulators stay in registers within a
// chunk, and its arithmetic (the order of every sum) is the same whatever heads share the task.
template <typename T, int ND>
void task_vec(const float* q, const T* k, const T* v, const int64_t* idx, int64_t ctx, int64_t KV, int64_t G,
              int64_t h0, int64_t h1, int64_t g0, int64_t GN, float scale, float* scores, float* acc, float* out) {
  constexpr int64_t D = 16 * ND, CH = 32;
  const int64_t padded = (ctx + 15) / 16 * 16, heads = (h1 - h0) * GN;
  std::vector<__m512> qv(heads * ND);  // each head's query, scaled, in row order
  {
    std::vector<float> qs(D);
    for (int64_t j = 0; j < heads; ++j) {
      const float* qh = q + ((h0 + j / GN) * G + g0 + j % GN) * D;
      for (int64_t i = 0; i < D; ++i) qs[i] = qh[row_dim<T>(i)] * scale;
      for (int c = 0; c < ND; ++c) qv[j * ND + c] = _mm512_loadu_ps(qs.data() + c * 16);
    }
  }
  for (int64_t t0 = 0; t0 < ctx; t0 += CH) {
    const int64_t t1 = std::min(ctx, t0 + CH);
    prefetch_rows(k, idx, t1, std::min(ctx, t1 + CH), KV, h0, h1, D * sizeof(T));
    prefetch_rows<T, _MM_HINT_T1>(v, idx, t0, t1, KV, h0, h1, D * sizeof(T));
    prefetch_rows<T, _MM_HINT_T1>(k, idx, std::min(ctx, t1 + CH), std::min(ctx, t1 + 2 * CH), KV, h0, h1, D * sizeof(T));
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t gs = 0; gs < GN; gs += 4) {
        const __m512* qh = qv.data() + ((h - h0) * GN + gs) * ND;
        float* sg = scores + ((h - h0) * GN + gs) * padded;
        switch (std::min<int64_t>(4, GN - gs)) {
          case 4: score_heads<T, ND, 4>(qh, k, idx, t0, t1, KV, h, sg, padded); break;
          case 3: score_heads<T, ND, 3>(qh, k, idx, t0, t1, KV, h, sg, padded); break;
          case 2: score_heads<T, ND, 2>(qh, k, idx, t0, t1, KV, h, sg, padded); break;
          default: score_heads<T, ND, 1>(qh, k, idx, t0, t1, KV, h, sg, padded); break;
        }
      }
  }
  std::vector<float> inv(heads);
  for (int64_t j = 0; j < heads; ++j) {
    float* sg = scores + j * padded;
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
    inv[j] = 1.f / _mm512_reduce_add_ps(total);
  }
  std::memset(acc, 0, heads * D * sizeof(float));
  prefetch_rows(v, idx, 0, std::min(ctx, CH), KV, h0, h1, D * sizeof(T));
  for (int64_t t0 = 0; t0 < ctx; t0 += CH) {
    const int64_t t1 = std::min(ctx, t0 + CH);
    prefetch_rows(v, idx, t1, std::min(ctx, t1 + CH), KV, h0, h1, D * sizeof(T));
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t gs = 0; gs < GN; gs += 4) {
        const int64_t j = (h - h0) * GN + gs;
        switch (std::min<int64_t>(4, GN - gs)) {
          case 4: value_heads<T, ND, 4>(scores + j * padded, padded, v, idx, t0, t1, KV, h, acc + j * D); break;
          case 3: value_heads<T, ND, 3>(scores + j * padded, padded, v, idx, t0, t1, KV, h, acc + j * D); break;
          case 2: value_heads<T, ND, 2>(scores + j * padded, padded, v, idx, t0, t1, KV, h, acc + j * D); break;
          default: value_heads<T, ND, 1>(scores + j * padded, padded, v, idx, t0, t1, KV, h, acc + j * D); break;
        }
      }
  }
  for (int64_t j = 0; j < heads; ++j) {
    const int64_t h = h0 + j / GN, g = g0 + j % GN;
    float* o = out + (h * G + g) * D;
    for (int64_t i = 0; i < D; ++i) o[row_dim<T>(i)] = acc[j * D + i] * inv[j];
  }
}
#endif

template <typename T>
void run(const float* q, const T* k, const T* v, const int64_t* slots, const int64_t* ctx_lens, float* out,
         int64_t B, int64_t H, int64_t KV, int64_t D, int64_t max_ctx, float scale) {
  const int64_t G = H / KV, threads = at::get_num_threads();
  // A task is a whole sequence (all its heads: each cache slot read once, in order) when there are at least two
  // sequences a thread; else a (sequence, KV head), whose G query heads share each K and V row; else (one or two
  // sequences) each query head on its own. Every head's arithmetic is the same code in the same order in all
  // three, so the output bits do not depend on the split.
#if defined(__AVX512F__)
  const bool vector = D == 64 || D == 128;
#else
  const bool vector = false;
#endif
  const int64_t HN = vector && B >= 2 * threads ? KV : 1;        // KV heads a task (the portable path takes one)
  const int64_t GN = HN > 1 || B * KV >= 2 * threads ? G : 1;    // query heads of each
  const int64_t per_seq = (KV / HN) * (G / GN);
  // Contexts differ: threads take tasks as they get free, the longest contexts first (an even split of the
  // task range left one thread with most of the keys when contexts rose along the batch).
  std::vector<int64_t> order(B);
  for (int64_t b = 0; b < B; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ctx_lens[a] > ctx_lens[b]; });
  const int64_t tasks = B * per_seq;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, tasks), 1, [&](int64_t, int64_t) {
    std::vector<float> row(D), scores, acc(HN * GN * D), total(GN);
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t b = order[task / per_seq], part = task % per_seq;
      const int64_t h0 = (part / (G / GN)) * HN, g0 = (part % (G / GN)) * GN;
      const int64_t ctx = ctx_lens[b];
      const int64_t* idx = slots + b * max_ctx;
#if defined(__AVX512F__)
      if (D == 64 || D == 128) {
        scores.resize(HN * GN * ((ctx + 15) / 16 * 16));
        if (D == 64)
          task_vec<T, 4>(q + b * H * D, k, v, idx, ctx, KV, G, h0, h0 + HN, g0, GN, scale, scores.data(), acc.data(),
                         out + b * H * D);
        else
          task_vec<T, 8>(q + b * H * D, k, v, idx, ctx, KV, G, h0, h0 + HN, g0, GN, scale, scores.data(), acc.data(),
                         out + b * H * D);
        continue;
      }
#endif
      const int64_t h = h0;  // the portable path: one KV head a task
      const float* qb = q + (b * H + h * G + g0) * D;
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


#if defined(__AVX512F__)
constexpr int64_t KB = 16;  // keys per block of prompt attention
constexpr int64_t L = 16;   // query vectors a lane group (one per float32 lane)

// The scores of a lane group's 16 query vectors (qt: [D][16], scaled) against KB keys (kf: [KB][D] float32):
// s[j] holds key j's score in every lane. Each lane's sum runs over d in order.
template <int ND>
inline void group_scores(const float* qt, const float* kf, __m512* s) {
  constexpr int64_t D = 16 * ND;
  for (int j = 0; j < KB; ++j) s[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 qd = _mm512_loadu_ps(qt + d * L);
    for (int j = 0; j < KB; ++j) s[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kf[j * D + d]), s[j]);
  }
}

// The online softmax of a lane group over one block of KB keys (scores s): key k0 + j is seen by the lanes at
// or after it (lane positions pv). Updates the group's running maximum and sum (at mx, sum), writes each key's
// numerator to e (zero where unseen) and returns the factor the earlier numerators are rescaled by.
inline __m512 block_softmax(__m512 pv, int64_t k0, int64_t count, const __m512* s, float* mx, float* sum,
                            __m512* e) {
  __mmask16 seen[KB];
  __m512 bmax = _mm512_set1_ps(-FLT_MAX);
  for (int j = 0; j < KB; ++j) {
    seen[j] = j < count ? _mm512_cmp_ps_mask(pv, _mm512_set1_ps(static_cast<float>(k0 + j)), _CMP_GE_OQ) : 0;
    bmax = _mm512_mask_max_ps(bmax, seen[j], bmax, s[j]);
  }
  const __m512 m_old = _mm512_loadu_ps(mx), m_new = _mm512_max_ps(m_old, bmax);
  const __m512 alpha = exp_nonpositive(_mm512_sub_ps(m_old, m_new));
  __m512 total = _mm512_mul_ps(_mm512_loadu_ps(sum), alpha);
  for (int j = 0; j < KB; ++j) {
    e[j] = _mm512_maskz_mov_ps(seen[j], exp_nonpositive(_mm512_sub_ps(s[j], m_new)));
    total = _mm512_add_ps(total, e[j]);
  }
  _mm512_storeu_ps(mx, m_new);
  _mm512_storeu_ps(sum, total);
  return alpha;
}

// A prompt task's outputs: each of its nv query vectors (rows from r0, G query heads of KV head h each) is its
// lane's weighted sum of values (ot: [groups][D][16]) over its lane's running sum.
inline void write_rows(const float* ot, const float* sum, int64_t nv, int64_t r0, int64_t G, int64_t H, int64_t h,
                       int64_t D, float* out) {
  for (int64_t iv = 0; iv < nv; ++iv) {
    const int64_t r = r0 + iv / G, g = iv % G, gr = iv / L, lane = iv % L;
    const float inv = 1.f / sum[gr * L + lane];
    float* o = out + (r * H + h * G + g) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = ot[gr * D * L + d * L + lane] * inv;
  }
}

// ot[d] = ot[d] * alpha + sum_j pt[j] * vf[j][d] for every dim d, each lane its own query vector (ot: [D][16]).
template <int ND>
inline void group_values(const float* pt, const float* vf, int64_t count, __m512 alpha, float* ot) {
  constexpr int64_t D = 16 * ND;
  for (int c = 0; c < ND; ++c) {
    __m512 o[16];
    for (int e = 0; e < 16; ++e) o[e] = _mm512_mul_ps(_mm512_loadu_ps(ot + (c * 16 + e) * L), alpha);
    for (int64_t j = 0; j < count; ++j) {
      const __m512 pj = _mm512_loadu_ps(pt + j * L);
      const float* vr = vf + j * D + c * 16;
      for (int e = 0; e < 16; ++e) o[e] = _mm512_fmadd_ps(pj, _mm512_set1_ps(vr[e]), o[e]);
    }
    for (int e = 0; e < 16; ++e) _mm512_storeu_ps(ot + (c * 16 + e) * L, o[e]);
  }
}

// One task: query rows r0 .. r1 - 1 (positions ctx - n + r) of KV head h, with its G query heads each: nv query
// vectors in lane groups of 16, each lane one vector (the layout makes the softmax's maximum and sum lane-wise).
// Keys are walked in blocks of KB, converted to float32 once for all groups; a group skips the blocks none of its
// rows can see. A lane's arithmetic depends only on its own query and keys, in an order fixed by the shapes.
template <typename T, int ND>
void prompt_task(const float* q, const T* k, const T* v, const int64_t* slots, int64_t n, int64_t ctx, int64_t H,
                 int64_t KV, int64_t h, int64_t r0, int64_t r1, float scale, float* out, std::vector<float>& buf) {
  constexpr int64_t D = 16 * ND;
  const int64_t G = H / KV, nv = (r1 - r0) * G, groups = (nv + L - 1) / L;
  buf.resize(groups * D * L * 2 + groups * L * 3 + 2 * KB * D + KB * L);
  float* qt = buf.data();                 // [groups][D][16] scaled queries
  float* ot = qt + groups * D * L;        // [groups][D][16] running weighted sums of values
  float* mx = ot + groups * D * L;        // [groups][16] running maximum
  float* sum = mx + groups * L;           // [groups][16] running sum of exponentials
  float* pos = sum + groups * L;          // [groups][16] each lane's position (as float: exact below 2^24)
  float* kf = pos + groups * L;           // [KB][D] this block's keys
  float* vf = kf + KB * D;                // [KB][D] and values
  float* pt = vf + KB * D;                // [KB][16] this block's exponentials for one group
  const int64_t first = ctx - n;          // position of query row 0
  for (int64_t i = 0; i < groups * L; ++i) {
    const int64_t iv = std::min(i, nv - 1);  // lanes past the last vector repeat it (finite, never written out)
    const int64_t r = r0 + iv / G, g = iv % G;
    const float* qr = q + (r * H + h * G + g) * D;
    for (int64_t d = 0; d < D; ++d) qt[(i / L) * D * L + d * L + i % L] = qr[d] * scale;
    pos[i] = static_cast<float>(first + r);
    mx[i] = -FLT_MAX;
    sum[i] = 0.f;
  }
  std::memset(ot, 0, groups * D * L * sizeof(float));
  const int64_t last_key = first + r1 - 1;  // the last row's position: no row of the task sees past it
  for (int64_t k0 = 0; k0 <= last_key; k0 += KB) {
    const int64_t count = std::min(KB, last_key + 1 - k0);
    for (int64_t j = 0; j < KB; ++j) {
      if (j < count) {
        const T* kr = k + (slots[k0 + j] * KV + h) * D;
        const T* vr = v + (slots[k0 + j] * KV + h) * D;
        for (int c = 0; c < ND; ++c) {
          _mm512_storeu_ps(kf + j * D + c * 16, load16(kr, c));
          _mm512_storeu_ps(vf + j * D + c * 16, load16(vr, c));
        }
      } else {
        std::memset(kf + j * D, 0, D * sizeof(float));
        std::memset(vf + j * D, 0, D * sizeof(float));
      }
    }
    for (int64_t gr = 0; gr < groups; ++gr) {
      const __m512 pv = _mm512_loadu_ps(pos + gr * L);
      if (_mm512_reduce_max_ps(pv) < static_cast<float>(k0)) continue;  // no row of the group sees this block
      __m512 s[KB];
      group_scores<ND>(qt + gr * D * L, kf, s);
      __m512 e[KB];
      const __m512 alpha = block_softmax(pv, k0, count, s, mx + gr * L, sum + gr * L, e);
      for (int j = 0; j < KB; ++j) _mm512_storeu_ps(pt + j * L, e[j]);
      group_values<ND>(pt, vf, count, alpha, ot + gr * D * L);
    }
  }
  write_rows(ot, sum, nv, r0, G, H, h, D, out);
}

#if defined(__AVX512BF16__)
// The bfloat16-cache variant of prompt_task: the same walk, masks and float32 softmax, but both products are
// AVX512-BF16 pair dot products accumulated in float32, as flash attention runs on bf16 inputs. Scores take the
// scaled queries rounded to bfloat16 (pairs of dims per lane) against K rows read in place (a pair of dims is
// one 32-bit word, broadcast); the weighted sum takes the softmax numerators rounded to bfloat16 (pairs of keys
// per lane) against each block's V rows interleaved by key pairs. Half the instructions of the float32 path,
// and no conversion of keys. The running sums stay those of the float32 numerators.
template <int ND>
void prompt_task_bf16(const float* q, const at::BFloat16* k, const at::BFloat16* v, const int64_t* slots, int64_t n,
                      int64_t ctx, int64_t H, int64_t KV, int64_t h, int64_t r0, int64_t r1, float scale, float* out,
                      std::vector<float>& buf) {
  constexpr int64_t D = 16 * ND, DP = D / 2, KP = KB / 2;
  const int64_t G = H / KV, nv = (r1 - r0) * G, groups = (nv + L - 1) / L;
  buf.resize(groups * DP * L + groups * D * L + groups * L * 3 + KP * D + KP * L);
  uint32_t* qp = reinterpret_cast<uint32_t*>(buf.data());                  // [groups][DP][16] query dim pairs
  float* ot = buf.data() + groups * DP * L;                                 // [groups][D][16] running sums of values
  float* mx = ot + groups * D * L;                                          // [groups][16] running maximum
  float* sum = mx + groups * L;                                             // [groups][16] running sum
  float* pos = sum + groups * L;                                            // [groups][16] each lane's position
  uint32_t* vp = reinterpret_cast<uint32_t*>(pos + groups * L);             // [KP][D] V rows paired by key
  uint32_t* pp = vp + KP * D;                                               // [KP][16] numerators paired by key
  const int64_t first = ctx - n;
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k);
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v);
  for (int64_t i = 0; i < groups * L; ++i) {
    const int64_t iv = std::min(i, nv - 1);
    const int64_t r = r0 + iv / G, g = iv % G;
    const float* qr = q + (r * H + h * G + g) * D;
    for (int64_t d = 0; d < DP; ++d) {
      const __m128bh two = _mm_cvtneps_pbh(_mm_set_ps(0.f, 0.f, qr[2 * d + 1] * scale, qr[2 * d] * scale));
      uint32_t word;
      std::memcpy(&word, &two, sizeof(word));
      qp[(i / L) * DP * L + d * L + i % L] = word;
    }
    pos[i] = static_cast<float>(first + r);
    mx[i] = -FLT_MAX;
    sum[i] = 0.f;
  }
  std::memset(ot, 0, groups * D * L * sizeof(float));
  const int64_t last_key = first + r1 - 1;
  for (int64_t k0 = 0; k0 <= last_key; k0 += KB) {
    const int64_t count = std::min(KB, last_key + 1 - k0);
    const uint16_t* krow[KB];
    for (int64_t j = 0; j < KB; ++j) krow[j] = kb + (slots[k0 + std::min(j, count - 1)] * KV + h) * D;
    for (int64_t jp = 0; jp < KP; ++jp) {  // V rows 2jp and 2jp + 1 interleaved: (v[2jp][d], v[2jp+1][d]) per d
      const int64_t j0 = 2 * jp, j1 = 2 * jp + 1;
      for (int c = 0; c < ND; ++c) {
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        if (j0 < count)
          lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(vb + (slots[k0 + j0] * KV + h) * D + c * 16)));
        if (j1 < count)
          hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(vb + (slots[k0 + j1] * KV + h) * D + c * 16)));
        _mm512_storeu_si512(vp + jp * D + c * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
    for (int64_t gr = 0; gr < groups; ++gr) {
      const __m512 pv = _mm512_loadu_ps(pos + gr * L);
      if (_mm512_reduce_max_ps(pv) < static_cast<float>(k0)) continue;
      __m512 s[KB];
      for (int j = 0; j < KB; ++j) s[j] = _mm512_setzero_ps();
      const uint32_t* qg = qp + gr * DP * L;
      for (int64_t d = 0; d < DP; ++d) {
        const __m512bh qd = (__m512bh)_mm512_loadu_si512(qg + d * L);
        for (int j = 0; j < KB; ++j) {
          uint32_t word;
          std::memcpy(&word, krow[j] + 2 * d, sizeof(word));
          s[j] = _mm512_dpbf16_ps(s[j], qd, (__m512bh)_mm512_set1_epi32(static_cast<int>(word)));
        }
      }
      __m512 e[KB];
      const __m512 alpha = block_softmax(pv, k0, count, s, mx + gr * L, sum + gr * L, e);
      for (int jp = 0; jp < KP; ++jp) {  // numerators of keys 2jp and 2jp + 1 as a bf16 pair per lane
        const __m512i b0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e[2 * jp]));
        const __m512i b1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e[2 * jp + 1]));
        _mm512_storeu_si512(pp + jp * L, _mm512_or_si512(b0, _mm512_slli_epi32(b1, 16)));
      }
      float* og = ot + gr * D * L;
      __m512bh pj[KP];
      for (int jp = 0; jp < KP; ++jp) pj[jp] = (__m512bh)_mm512_loadu_si512(pp + jp * L);
      for (int c = 0; c < ND; ++c) {
        __m512 o[16];
        for (int e = 0; e < 16; ++e) o[e] = _mm512_mul_ps(_mm512_loadu_ps(og + (c * 16 + e) * L), alpha);
        for (int jp = 0; jp < KP; ++jp) {
          const uint32_t* vr = vp + jp * D + c * 16;
          for (int e = 0; e < 16; ++e)
            o[e] = _mm512_dpbf16_ps(o[e], pj[jp], (__m512bh)_mm512_set1_epi32(static_cast<int>(vr[e])));
        }
        for (int e = 0; e < 16; ++e) _mm512_storeu_ps(og + (c * 16 + e) * L, o[e]);
      }
    }
  }
  write_rows(ot, sum, nv, r0, G, H, h, D, out);
}
#endif

constexpr int64_t QB = 16;  // query rows per prompt-attention task

template <typename T>
void prompt_run(const float* q, const T* k, const T* v, const int64_t* slots, int64_t n, int64_t ctx, float* out,
                int64_t H, int64_t KV, int64_t D, float scale) {
  const int64_t blocks = (n + QB - 1) / QB, tasks = blocks * KV;
  // Later row blocks see more keys: hand tasks out costliest first, to whichever thread is free. Which thread
  // runs a task does not change its arithmetic.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t t = next++; t < tasks; t = next++) {
      const int64_t b = blocks - 1 - t / KV, h = t % KV;
      const int64_t r0 = b * QB, r1 = std::min(n, r0 + QB);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (D == 64)
          prompt_task_bf16<4>(q, k, v, slots, n, ctx, H, KV, h, r0, r1, scale, out, buf);
        else
          prompt_task_bf16<8>(q, k, v, slots, n, ctx, H, KV, h, r0, r1, scale, out, buf);
        continue;
      }
#endif
      if (D == 64)
        prompt_task<T, 4>(q, k, v, slots, n, ctx, H, KV, h, r0, r1, scale, out, buf);
      else
        prompt_task<T, 8>(q, k, v, slots, n, ctx, H, KV, h, r0, r1, scale, out, buf);
    }
  });
}
#endif

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

bool prompt_attention_supported(int64_t head_dim) {
#if defined(__AVX512F__)
  return head_dim == 64 || head_dim == 128;
#else
  return false;
#endif
}

torch::Tensor prompt_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                               double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: [n, H, D] float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches: [S, KV, D]");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kInt64 && slots.is_contiguous(), "slots: [ctx] int64");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(1), ctx = slots.size(0);
  TORCH_CHECK(k_cache.size(2) == D && H % KV == 0 && n <= ctx, "head shapes");
  TORCH_CHECK(prompt_attention_supported(D), "prompt_attention: head dim 64 or 128 on AVX-512");
  auto out = torch::empty_like(q);
#if defined(__AVX512F__)
  if (k_cache.scalar_type() == torch::kBFloat16) {
    prompt_run<at::BFloat16>(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                             slots.data_ptr<int64_t>(), n, ctx, out.data_ptr<float>(), H, KV, D,
                             static_cast<float>(scale));
  } else {
    TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32, "caches: float32 or bfloat16");
    prompt_run<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                      slots.data_ptr<int64_t>(), n, ctx, out.data_ptr<float>(), H, KV, D, static_cast<float>(scale));
  }
#endif
  return out;
}

// As a torch operator too, for compiled graphs to call without going through Python.
TORCH_LIBRARY_FRAGMENT(mindie_host_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor ctx_lens, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(mindie_host_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention);
  m.def("prompt_attention", &prompt_attention);
  m.def("prompt_attention_supported", &prompt_attention_supported);
}
