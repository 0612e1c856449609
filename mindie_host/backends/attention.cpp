// Attention on CPU over a slot-major paged KV cache ([slots, KV heads, D], bfloat16 or float32), read in place.
//
// decode_attention: one query token per sequence. Each (sequence, KV head) is one task (each query head, for one
// or two sequences), computed start to end by one thread in a fixed order (scores over the context, softmax,
// weighted sum of values), so a sequence's output does not depend on what else is in the batch: the
// batch-invariant decode path of mindie_host/backends/platform.py calls it for every generated token. Head dims
// 64 and 128 take the vector paths (AVX-512, AVX2); every other head dim, and the portable variant, a plain loop.
// On the vector paths, consecutive rows whose contexts are prefixes of one another's slots (a sequence's
// speculative verification rows: positions p, p + 1, ... over the same blocks) share one walk over the cache, each
// K and V row read once for all of them, every row's arithmetic unchanged (bench/PERF.md, "Verification rows share
// the cache walk").
//
// prompt_attention: the n prompt tokens of one sequence (a whole prompt or a chunk of one) over its context,
// causally. Flash-style: a task is (KV head, block of 16 query rows) and walks the visible keys in blocks with a
// running maximum and sum, so only the keys a row can see are scored. Its query vectors sit one per float32 lane,
// so scores, softmax and the weighted sum of values are all lane-wise multiply-adds (no horizontal sums, no
// transposed keys); the order of every reduction is fixed by the shapes alone, so the result is the same whichever
// thread runs a task. One template serves every variant through its lane type (16 AVX-512 lanes, 8 AVX2 lanes, 8
// plain lanes); any head dim that is a multiple of 8.
//
// Both compute in float32. Over a bfloat16 cache with AVX512-BF16 (the avx512 variant), prompt attention's two
// products take bf16 operands with float32 sums, as flash attention does on bf16 inputs (bench/PERF.md: no
// measurable change in perplexity or agreement with the float32 model).
#define MINDIE_HOST_KERNEL_SOURCE 1
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vector_math.h"

namespace {

using bf16 = uint16_t;  // a bfloat16 cache's elements, as bits

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return mh::bf16_to_float(x); }

// -- decode attention, portable: any head dim, one KV head a task ------------------------------------------------

// a . b for n floats: 8 lanes, then the lanes in a fixed order, then the tail
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += a[i + j] * b[i + j];
  float s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

inline void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Query heads g0 .. g0 + GN of KV head h of one sequence (q and out at its first head).
template <typename T>
void task_portable(const float* q, const T* k, const T* v, const int64_t* idx, int64_t ctx, int64_t KV, int64_t G,
                   int64_t D, int64_t h, int64_t g0, int64_t GN, float scale, std::vector<float>& scores,
                   std::vector<float>& row, std::vector<float>& acc, float* out) {
  const float* qb = q + (h * G + g0) * D;
  scores.assign(GN * ctx, 0.f);
  row.resize(D);
  for (int64_t t = 0; t < ctx; ++t) {
    load_row(k + (idx[t] * KV + h) * D, row.data(), D);
    for (int64_t g = 0; g < GN; ++g) scores[g * ctx + t] = dot(qb + g * D, row.data(), D) * scale;
  }
  std::vector<float> total(GN);
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
  acc.assign(GN * D, 0.f);
  for (int64_t t = 0; t < ctx; ++t) {
    load_row(v + (idx[t] * KV + h) * D, row.data(), D);
    for (int64_t g = 0; g < GN; ++g) axpy(scores[g * ctx + t], row.data(), acc.data() + g * D, D);
  }
  for (int64_t g = 0; g < GN; ++g) {
    float* o = out + (h * G + g0 + g) * D;
    const float inv = 1.f / total[g];
    for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
  }
}

#if defined(MH_AVX512) || defined(MH_AVX2)
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
#endif

#if defined(MH_AVX512) || defined(MH_AVX2)
// The query rows one vector task serves: R consecutive rows of the batch (queries and outputs H * D floats apart
// from q and out) whose contexts are prefixes of one slot list, ``idx``: row r sees its first ctx[r] slots. One row is
// a sequence's decode token; several are a run (decode_run), such as a sequence's verification rows, whose contexts
// grow by one along the rows over the same blocks, so that each K and V row is read once for all of them. Every head
// of every row is computed exactly as it would be alone: the rows share the reads, nothing else.
struct TaskRows {
  const float* q;
  float* out;
  const int64_t* ctx;  // R context lengths, none longer than the last
  int64_t R, HD;       // rows; H * D
  const int64_t* idx;  // the last (longest) row's slots
  int64_t max_ctx() const { return ctx[R - 1]; }
};
#endif

#if defined(MH_AVX512)
// -- decode attention, AVX-512: head dims 64 and 128 -------------------------------------------------------------

// A K or V row of head dim 16 * ND as ND float32 vectors, in the kernel's dim order: float32 rows as stored;
// bfloat16 rows as each 32-dim chunk's even dims then its odd dims (one 64-byte load, one shift and one mask
// for 32 values). Queries are put in the same order (row_dim), so dot products pair the same dims, and the
// values' accumulators are put back through row_dim when stored.
template <int ND>
inline void load_row(const float* row, __m512* out) {
  for (int c = 0; c < ND; ++c) out[c] = _mm512_loadu_ps(row + c * 16);
}
template <int ND>
inline void load_row(const bf16* row, __m512* out) {
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

// One task with head dim 16 * ND: query heads g0 .. g0 + GN of KV heads h0 .. h1 of the task's rows. Tokens are
// walked in chunks of 32, every head of the task over a chunk before the next, so a cache slot's heads are read
// together (and, for a run, once for all its rows); each head's query and accumulators stay in registers within a
// chunk, and its arithmetic (the order of every sum) is the same whatever heads and rows share the task. Heads are
// numbered j = ((h - h0) * R + r) * GN + g: a KV head's heads of every row side by side.
template <typename T, int ND>
void task_vec(const TaskRows& rows, const T* k, const T* v, int64_t KV, int64_t G, int64_t h0, int64_t h1, int64_t g0,
              int64_t GN, float scale, float* scores, float* acc) {
  constexpr int64_t D = 16 * ND, CH = 32;
  const int64_t ctx = rows.max_ctx(), per_h = rows.R * GN, heads = (h1 - h0) * per_h;
  const int64_t padded = (ctx + 15) / 16 * 16;  // the scores' stride
  const int64_t* idx = rows.idx;
  const auto row_of = [&](int64_t j) { return (j % per_h) / GN; };
  const auto head_at = [&](int64_t j) { return row_of(j) * rows.HD + ((h0 + j / per_h) * G + g0 + j % GN) * D; };
  std::vector<__m512> qv(heads * ND);  // each head's query, scaled, in row order
  {
    std::vector<float> qs(D);
    for (int64_t j = 0; j < heads; ++j) {
      const float* qh = rows.q + head_at(j);
      for (int64_t i = 0; i < D; ++i) qs[i] = qh[row_dim<T>(i)] * scale;
      for (int c = 0; c < ND; ++c) qv[j * ND + c] = _mm512_loadu_ps(qs.data() + c * 16);
    }
  }
  // A run's shorter rows get scores for the longer rows' last tokens too: never read (their softmax stops at their
  // own context), so it costs a few dot products and no branch.
  for (int64_t t0 = 0; t0 < ctx; t0 += CH) {
    const int64_t t1 = std::min(ctx, t0 + CH);
    prefetch_rows(k, idx, t1, std::min(ctx, t1 + CH), KV, h0, h1, D * sizeof(T));
    prefetch_rows<T, _MM_HINT_T1>(v, idx, t0, t1, KV, h0, h1, D * sizeof(T));
    prefetch_rows<T, _MM_HINT_T1>(k, idx, std::min(ctx, t1 + CH), std::min(ctx, t1 + 2 * CH), KV, h0, h1, D * sizeof(T));
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t js = 0; js < per_h; js += 4) {
        const int64_t j = (h - h0) * per_h + js;
        const __m512* qh = qv.data() + j * ND;
        float* sg = scores + j * padded;
        switch (std::min<int64_t>(4, per_h - js)) {
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
    const int64_t n = rows.ctx[row_of(j)], end = (n + 15) / 16 * 16;
    for (int64_t t = n; t < end; ++t) sg[t] = -FLT_MAX;
    __m512 mx = _mm512_set1_ps(-FLT_MAX);
    for (int64_t t = 0; t < end; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < end; t += 16) {
      const __m512 e = mh::exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sg + t), m));
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
      for (int64_t js = 0; js < per_h; js += 4) {
        const int64_t j = (h - h0) * per_h + js, ng = std::min<int64_t>(4, per_h - js);
        int64_t shortest = ctx;
        for (int64_t i = 0; i < ng; ++i) shortest = std::min(shortest, rows.ctx[row_of(j + i)]);
        if (shortest < t1) {  // a row of the group ends in this chunk: each head on its own, up to its context
          for (int64_t i = 0; i < ng; ++i) {
            const int64_t end = std::min(t1, rows.ctx[row_of(j + i)]);
            if (end > t0)
              value_heads<T, ND, 1>(scores + (j + i) * padded, padded, v, idx, t0, end, KV, h, acc + (j + i) * D);
          }
          continue;
        }
        switch (ng) {
          case 4: value_heads<T, ND, 4>(scores + j * padded, padded, v, idx, t0, t1, KV, h, acc + j * D); break;
          case 3: value_heads<T, ND, 3>(scores + j * padded, padded, v, idx, t0, t1, KV, h, acc + j * D); break;
          case 2: value_heads<T, ND, 2>(scores + j * padded, padded, v, idx, t0, t1, KV, h, acc + j * D); break;
          default: value_heads<T, ND, 1>(scores + j * padded, padded, v, idx, t0, t1, KV, h, acc + j * D); break;
        }
      }
  }
  for (int64_t j = 0; j < heads; ++j) {
    float* o = rows.out + head_at(j);
    for (int64_t i = 0; i < D; ++i) o[row_dim<T>(i)] = acc[j * D + i] * inv[j];
  }
}
#endif  // MH_AVX512

#if defined(MH_AVX2)
// -- decode attention, AVX2: head dims 64 and 128 ----------------------------------------------------------------

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) { return mh::load_bf16x8(p); }

// The sums of four vectors' lanes as the four lanes of one 128-bit vector: one fixed tree of additions.
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Scores of NG (1 to 3) query heads of KV head h, their scaled queries D floats apart at qs, over tokens t0 .. t1
// in groups of four (a short last group repeats its last row), ``padded`` apart at sg.
template <typename T, int ND, int NG>
inline void score_heads8(const float* qs, const T* k, const int64_t* idx, int64_t t0, int64_t t1, int64_t KV,
                         int64_t h, float* sg, int64_t padded) {
  constexpr int64_t D = 8 * ND;
  for (int64_t t = t0; t < t1; t += 4) {
    const int64_t n = std::min<int64_t>(4, t1 - t);
    const T* kr[4];
    for (int j = 0; j < 4; ++j) kr[j] = k + (idx[t + std::min<int64_t>(j, n - 1)] * KV + h) * D;
    __m256 s[NG][4];
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < 4; ++j) s[g][j] = _mm256_setzero_ps();
    for (int c = 0; c < ND; ++c)
      for (int j = 0; j < 4; ++j) {
        const __m256 kc = load8(kr[j] + c * 8);
        for (int g = 0; g < NG; ++g) s[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * D + c * 8), kc, s[g][j]);
      }
    for (int g = 0; g < NG; ++g) {
      alignas(16) float four[4];
      _mm_store_ps(four, sum4(s[g][0], s[g][1], s[g][2], s[g][3]));
      for (int64_t j = 0; j < n; ++j) sg[g * padded + t + j] = four[j];
    }
  }
}

// Adds tokens t0 .. t1's V rows of KV head h, weighted by NG (1 to 3) heads' softmax numerators, to their
// accumulators (D apart at acc): each V chunk is read and converted once for all of them, CW vectors of dims a pass
// (4 for one or two heads; 2 for three, so that 3 x 2 accumulators, 2 values and the weight fit the 16 registers):
// a KV head's V rows are read once for its three query heads.
template <typename T, int ND, int NG>
inline void value_heads8(const float* sg, int64_t padded, const T* v, const int64_t* idx, int64_t t0, int64_t t1,
                         int64_t KV, int64_t h, float* acc) {
  constexpr int64_t D = 8 * ND;
  constexpr int CW = NG == 3 ? 2 : 4;
  for (int c0 = 0; c0 < ND; c0 += CW) {
    __m256 o[NG][CW];
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < CW; ++c) o[g][c] = _mm256_loadu_ps(acc + g * D + (c0 + c) * 8);
    for (int64_t t = t0; t < t1; ++t) {
      const T* vr = v + (idx[t] * KV + h) * D + c0 * 8;
      __m256 vv[CW];
      for (int c = 0; c < CW; ++c) vv[c] = load8(vr + c * 8);
      for (int g = 0; g < NG; ++g) {
        const __m256 w = _mm256_set1_ps(sg[g * padded + t]);
        for (int c = 0; c < CW; ++c) o[g][c] = _mm256_fmadd_ps(w, vv[c], o[g][c]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < CW; ++c) _mm256_storeu_ps(acc + g * D + (c0 + c) * 8, o[g][c]);
  }
}

// One task with head dim 8 * ND, as task_vec of the AVX-512 path: query heads g0 .. g0 + GN of KV heads h0 .. h1 of
// the task's rows (heads numbered the same way), tokens in chunks of 32; each head's arithmetic is the same whatever
// heads and rows share the task.
template <typename T, int ND>
void task_vec(const TaskRows& rows, const T* k, const T* v, int64_t KV, int64_t G, int64_t h0, int64_t h1, int64_t g0,
              int64_t GN, float scale, float* scores, float* acc) {
  constexpr int64_t D = 8 * ND, CH = 32;
  const int64_t ctx = rows.max_ctx(), per_h = rows.R * GN, heads = (h1 - h0) * per_h;
  const int64_t padded = (ctx + 7) / 8 * 8;  // the scores' stride
  const int64_t* idx = rows.idx;
  const auto row_of = [&](int64_t j) { return (j % per_h) / GN; };
  const auto head_at = [&](int64_t j) { return row_of(j) * rows.HD + ((h0 + j / per_h) * G + g0 + j % GN) * D; };
  std::vector<float> qs(heads * D);  // each head's query, scaled
  for (int64_t j = 0; j < heads; ++j) {
    const float* qh = rows.q + head_at(j);
    for (int64_t i = 0; i < D; ++i) qs[j * D + i] = qh[i] * scale;
  }
  for (int64_t t0 = 0; t0 < ctx; t0 += CH) {  // past a shorter row's context: scored, never read
    const int64_t t1 = std::min(ctx, t0 + CH);
    prefetch_rows(k, idx, t1, std::min(ctx, t1 + CH), KV, h0, h1, D * sizeof(T));
    prefetch_rows<T, _MM_HINT_T1>(v, idx, t0, t1, KV, h0, h1, D * sizeof(T));
    prefetch_rows<T, _MM_HINT_T1>(k, idx, std::min(ctx, t1 + CH), std::min(ctx, t1 + 2 * CH), KV, h0, h1, D * sizeof(T));
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t js = 0; js < per_h; js += 3) {
        const int64_t j = (h - h0) * per_h + js;
        switch (std::min<int64_t>(3, per_h - js)) {
          case 3: score_heads8<T, ND, 3>(qs.data() + j * D, k, idx, t0, t1, KV, h, scores + j * padded, padded); break;
          case 2: score_heads8<T, ND, 2>(qs.data() + j * D, k, idx, t0, t1, KV, h, scores + j * padded, padded); break;
          default: score_heads8<T, ND, 1>(qs.data() + j * D, k, idx, t0, t1, KV, h, scores + j * padded, padded); break;
        }
      }
  }
  std::vector<float> inv(heads);
  for (int64_t j = 0; j < heads; ++j) {
    float* sg = scores + j * padded;
    const int64_t n = rows.ctx[row_of(j)], end = (n + 7) / 8 * 8;
    for (int64_t t = n; t < end; ++t) sg[t] = -FLT_MAX;
    __m256 mx = _mm256_set1_ps(-FLT_MAX);
    for (int64_t t = 0; t < end; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + t));
    const __m256 m = _mm256_set1_ps(mh::reduce_max(mx));
    __m256 total = _mm256_setzero_ps();
    for (int64_t t = 0; t < end; t += 8) {
      const __m256 e = mh::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sg + t), m));
      _mm256_storeu_ps(sg + t, e);
      total = _mm256_add_ps(total, e);
    }
    inv[j] = 1.f / mh::reduce_add(total);
  }
  std::memset(acc, 0, heads * D * sizeof(float));
  prefetch_rows(v, idx, 0, std::min(ctx, CH), KV, h0, h1, D * sizeof(T));
  for (int64_t t0 = 0; t0 < ctx; t0 += CH) {
    const int64_t t1 = std::min(ctx, t0 + CH);
    prefetch_rows(v, idx, t1, std::min(ctx, t1 + CH), KV, h0, h1, D * sizeof(T));
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t js = 0; js < per_h; js += 3) {
        const int64_t j = (h - h0) * per_h + js, ng = std::min<int64_t>(3, per_h - js);
        int64_t shortest = ctx;
        for (int64_t i = 0; i < ng; ++i) shortest = std::min(shortest, rows.ctx[row_of(j + i)]);
        if (shortest < t1) {  // a row of the group ends in this chunk: each head on its own, up to its context
          for (int64_t i = 0; i < ng; ++i) {
            const int64_t end = std::min(t1, rows.ctx[row_of(j + i)]);
            if (end > t0)
              value_heads8<T, ND, 1>(scores + (j + i) * padded, padded, v, idx, t0, end, KV, h, acc + (j + i) * D);
          }
          continue;
        }
        switch (ng) {
          case 3: value_heads8<T, ND, 3>(scores + j * padded, padded, v, idx, t0, t1, KV, h, acc + j * D); break;
          case 2: value_heads8<T, ND, 2>(scores + j * padded, padded, v, idx, t0, t1, KV, h, acc + j * D); break;
          default: value_heads8<T, ND, 1>(scores + j * padded, padded, v, idx, t0, t1, KV, h, acc + j * D); break;
        }
      }
  }
  for (int64_t j = 0; j < heads; ++j) {
    float* o = rows.out + head_at(j);
    for (int64_t i = 0; i < D; ++i) o[i] = acc[j * D + i] * inv[j];
  }
}
#endif  // MH_AVX2

#if defined(MH_AVX512)
constexpr int64_t kVecLanes = 16;
#elif defined(MH_AVX2)
constexpr int64_t kVecLanes = 8;
#endif

#if defined(MH_AVX512) || defined(MH_AVX2)
// One vector task over the rows: head dims 64 and 128.
template <typename T>
void run_task(const TaskRows& rows, const T* k, const T* v, int64_t KV, int64_t G, int64_t D, int64_t h0, int64_t h1,
              int64_t g0, int64_t GN, float scale, std::vector<float>& scores, std::vector<float>& acc) {
  scores.resize((h1 - h0) * rows.R * GN * ((rows.max_ctx() + kVecLanes - 1) / kVecLanes * kVecLanes));
  acc.resize((h1 - h0) * rows.R * GN * D);
  if (D == 64)
    task_vec<T, 64 / kVecLanes>(rows, k, v, KV, G, h0, h1, g0, GN, scale, scores.data(), acc.data());
  else
    task_vec<T, 128 / kVecLanes>(rows, k, v, KV, G, h0, h1, g0, GN, scale, scores.data(), acc.data());
}

// Runs of rows: consecutive rows whose contexts are each a prefix of the next row's slots, none shorter than the
// one before (a sequence's verification rows: one more position each, over the same blocks). Returns (first row,
// rows) for each run, a single row being a run of one.
std::vector<std::pair<int64_t, int64_t>> find_runs(const int64_t* slots, const int64_t* ctx_lens, int64_t B,
                                                   int64_t max_ctx) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t b = 0; b < B;) {
    int64_t e = b + 1;
    // the last slot first: another sequence's newest token sits in a block of its own, so rows of different
    // sequences part there at once, even where a prefix cache gives them the same first blocks (this runs for
    // every layer of every decode step)
    while (e < B && ctx_lens[e] >= ctx_lens[e - 1] && ctx_lens[e - 1] > 0 &&
           slots[e * max_ctx + ctx_lens[e - 1] - 1] == slots[(e - 1) * max_ctx + ctx_lens[e - 1] - 1] &&
           std::memcmp(slots + e * max_ctx, slots + (e - 1) * max_ctx, ctx_lens[e - 1] * sizeof(int64_t)) == 0)
      ++e;
    runs.emplace_back(b, e - b);
    b = e;
  }
  return runs;
}

// A batch with runs: a task is (part of a run, KV head), all of the KV head's query heads of the part's rows, so a
// K or V row is read once for the part. A run is cut into parts only where there are too few runs to give every
// thread two tasks. The heads' arithmetic is task_vec's, so every row gets the bits it gets alone.
template <typename T>
void decode_runs(const float* q, const T* k, const T* v, const int64_t* slots, const int64_t* ctx_lens, float* out,
                 int64_t B, int64_t H, int64_t KV, int64_t D, int64_t max_ctx, float scale,
                 std::vector<std::pair<int64_t, int64_t>> runs) {
  const int64_t G = H / KV, threads = mh::num_threads();
  const int64_t want = (2 * threads + KV - 1) / KV;  // parts for two tasks a thread
  if (static_cast<int64_t>(runs.size()) < want) {
    const int64_t span = (B + want - 1) / want;
    std::vector<std::pair<int64_t, int64_t>> parts;
    for (const auto& [b, n] : runs) {
      const int64_t pieces = (n + span - 1) / span;
      for (int64_t i = 0, at = b; i < pieces; ++i) {  // near-equal pieces
        const int64_t len = n / pieces + (i < n % pieces ? 1 : 0);
        parts.emplace_back(at, len);
        at += len;
      }
    }
    runs = std::move(parts);
  }
  std::stable_sort(runs.begin(), runs.end(), [&](const auto& a, const auto& b) {  // the longest contexts first
    return ctx_lens[a.first + a.second - 1] * a.second > ctx_lens[b.first + b.second - 1] * b.second;
  });
  const int64_t tasks = static_cast<int64_t>(runs.size()) * KV;
  std::atomic<int64_t> next{0};
  mh::parallel_for(0, std::min<int64_t>(threads, tasks), 1, [&](int64_t, int64_t) {
    std::vector<float> scores, acc;
    for (int64_t task = next++; task < tasks; task = next++) {
      const auto [b, n] = runs[task / KV];
      const int64_t h = task % KV;
      const TaskRows rows{q + b * H * D, out + b * H * D, ctx_lens + b, n, H * D, slots + (b + n - 1) * max_ctx};
      run_task(rows, k, v, KV, G, D, h, h + 1, 0, G, scale, scores, acc);
    }
  });
}
#endif

template <typename T>
void decode_run(const float* q, const T* k, const T* v, const int64_t* slots, const int64_t* ctx_lens, float* out,
                int64_t B, int64_t H, int64_t KV, int64_t D, int64_t max_ctx, float scale) {
  const int64_t G = H / KV, threads = mh::num_threads();
#if defined(MH_AVX512) || defined(MH_AVX2)
  const bool vector = D == 64 || D == 128;
  if (vector) {
    auto runs = find_runs(slots, ctx_lens, B, max_ctx);
    if (static_cast<int64_t>(runs.size()) < B) return decode_runs(q, k, v, slots, ctx_lens, out, B, H, KV, D, max_ctx, scale,
                                                                  std::move(runs));
  }
#else
  const bool vector = false;
#endif
  // A task is a whole sequence (all its heads: each cache slot read once, in order) when there are at least two
  // sequences a thread; else a (sequence, KV head), whose G query heads share each K and V row; else (one or two
  // sequences) each query head on its own. Every head's arithmetic is the same code in the same order in all
  // three, so the output bits do not depend on the split.
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
  mh::parallel_for(0, std::min<int64_t>(threads, tasks), 1, [&](int64_t, int64_t) {
    std::vector<float> row, scores, acc;
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t b = order[task / per_seq], part = task % per_seq;
      const int64_t h0 = (part / (G / GN)) * HN, g0 = (part % (G / GN)) * GN;
      const int64_t ctx = ctx_lens[b];
      const int64_t* idx = slots + b * max_ctx;
#if defined(MH_AVX512) || defined(MH_AVX2)
      if (vector) {
        const TaskRows one{q + b * H * D, out + b * H * D, ctx_lens + b, 1, H * D, idx};
        run_task(one, k, v, KV, G, D, h0, h0 + HN, g0, GN, scale, scores, acc);
        continue;
      }
#endif
      task_portable(q + b * H * D, k, v, idx, ctx, KV, G, D, h0, g0, GN, scale, scores, row, acc, out + b * H * D);
    }
  });
}

// -- prompt attention: one template, a lane type per variant ---------------------------------------------------------
//
// A lane type gives: L float32 lanes (one query vector each), KB keys per block (what fits the registers), and the
// operations the walk needs, each lane on its own.

#if defined(MH_AVX512)
struct Lanes {
  static constexpr int L = 16, KB = 16, E = 16;  // lanes, keys per block, value dims per pass
  using V = __m512;
  using M = __mmask16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V exp(V x) { return mh::exp_nonpositive(x); }
  static M ge(V a, float x) { return _mm512_cmp_ps_mask(a, _mm512_set1_ps(x), _CMP_GE_OQ); }
  static M none() { return 0; }
  static V masked_max(V acc, M m, V s) { return _mm512_mask_max_ps(acc, m, acc, s); }
  static V maskz(M m, V v) { return _mm512_maskz_mov_ps(m, v); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
};
#elif defined(MH_AVX2)
struct Lanes {
  static constexpr int L = 8, KB = 8, E = 8;
  using V = __m256;
  using M = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V exp(V x) { return mh::exp_nonpositive(x); }
  static M ge(V a, float x) { return _mm256_cmp_ps(a, _mm256_set1_ps(x), _CMP_GE_OQ); }
  static M none() { return _mm256_setzero_ps(); }
  static V masked_max(V acc, M m, V s) { return _mm256_blendv_ps(acc, _mm256_max_ps(acc, s), m); }
  static V maskz(M m, V v) { return _mm256_and_ps(m, v); }
  static float reduce_max(V v) { return mh::reduce_max(v); }
};
#else
// Plain lanes: fixed-size loops the compiler turns into whatever vectors the target has (SSE2, NEON, ...), or not.
struct Lanes {
  static constexpr int L = 8, KB = 8, E = 8;
  struct V {
    float x[8];
  };
  struct M {
    bool x[8];
  };
  template <typename F>
  static V each(F f) {
    V r;
    for (int i = 0; i < L; ++i) r.x[i] = f(i);
    return r;
  }
  static V zero() { return set1(0.f); }
  static V set1(float x) { return each([&](int) { return x; }); }
  static V load(const float* p) { return each([&](int i) { return p[i]; }); }
  static void store(float* p, V v) {
    for (int i = 0; i < L; ++i) p[i] = v.x[i];
  }
  static V fmadd(V a, V b, V c) { return each([&](int i) { return a.x[i] * b.x[i] + c.x[i]; }); }
  static V mul(V a, V b) { return each([&](int i) { return a.x[i] * b.x[i]; }); }
  static V add(V a, V b) { return each([&](int i) { return a.x[i] + b.x[i]; }); }
  static V sub(V a, V b) { return each([&](int i) { return a.x[i] - b.x[i]; }); }
  static V max(V a, V b) { return each([&](int i) { return a.x[i] > b.x[i] ? a.x[i] : b.x[i]; }); }
  static V exp(V x) { return each([&](int i) { return std::exp(x.x[i]); }); }
  static M ge(V a, float x) {
    M m;
    for (int i = 0; i < L; ++i) m.x[i] = a.x[i] >= x;
    return m;
  }
  static M none() {
    M m;
    for (int i = 0; i < L; ++i) m.x[i] = false;
    return m;
  }
  static V masked_max(V acc, M m, V s) {
    return each([&](int i) { return m.x[i] && s.x[i] > acc.x[i] ? s.x[i] : acc.x[i]; });
  }
  static V maskz(M m, V v) { return each([&](int i) { return m.x[i] ? v.x[i] : 0.f; }); }
  static float reduce_max(V v) {
    float m = v.x[0];
    for (int i = 1; i < L; ++i) m = v.x[i] > m ? v.x[i] : m;
    return m;
  }
};
#endif

constexpr int64_t L = Lanes::L;
constexpr int64_t KB = Lanes::KB;
using V = Lanes::V;

// The scores of a lane group's L query vectors (qt: [D][L], scaled) against KB keys (kf: [KB][D] float32): s[j]
// holds key j's score in every lane. Each lane's sum runs over d in order.
template <int DC>
inline void group_scores(const float* qt, const float* kf, int64_t dim, V* s) {
  const int64_t D = DC > 0 ? DC : dim;
  for (int j = 0; j < KB; ++j) s[j] = Lanes::zero();
  for (int64_t d = 0; d < D; ++d) {
    const V qd = Lanes::load(qt + d * L);
    for (int j = 0; j < KB; ++j) s[j] = Lanes::fmadd(qd, Lanes::set1(kf[j * D + d]), s[j]);
  }
}

// The online softmax of a lane group over one block of KB keys (scores s): key k0 + j is seen by the lanes at
// or after it (lane positions pv). Updates the group's running maximum and sum (at mx, sum), writes each key's
// numerator to e (zero where unseen) and returns the factor the earlier numerators are rescaled by.
inline V block_softmax(V pv, int64_t k0, int64_t count, const V* s, float* mx, float* sum, V* e) {
  Lanes::M seen[KB];
  V bmax = Lanes::set1(-FLT_MAX);
  for (int j = 0; j < KB; ++j) {
    seen[j] = j < count ? Lanes::ge(pv, static_cast<float>(k0 + j)) : Lanes::none();
    bmax = Lanes::masked_max(bmax, seen[j], s[j]);
  }
  const V m_old = Lanes::load(mx), m_new = Lanes::max(m_old, bmax);
  const V alpha = Lanes::exp(Lanes::sub(m_old, m_new));
  V total = Lanes::mul(Lanes::load(sum), alpha);
  for (int j = 0; j < KB; ++j) {
    e[j] = Lanes::maskz(seen[j], Lanes::exp(Lanes::sub(s[j], m_new)));
    total = Lanes::add(total, e[j]);
  }
  Lanes::store(mx, m_new);
  Lanes::store(sum, total);
  return alpha;
}

// A prompt task's outputs: each of its nv query vectors (rows from r0, G query heads of KV head h each) is its
// lane's weighted sum of values (ot: [groups][D][L]) over its lane's running sum.
inline void write_rows(const float* ot, const float* sum, int64_t nv, int64_t r0, int64_t G, int64_t H, int64_t h,
                       int64_t D, float* out) {
  for (int64_t iv = 0; iv < nv; ++iv) {
    const int64_t r = r0 + iv / G, g = iv % G, gr = iv / L, lane = iv % L;
    const float inv = 1.f / sum[gr * L + lane];
    float* o = out + (r * H + h * G + g) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = ot[gr * D * L + d * L + lane] * inv;
  }
}

// ot[d] = ot[d] * alpha + sum_j pt[j] * vf[j][d] for every dim d, each lane its own query vector (ot: [D][L]),
// Lanes::E dims at a time (D is a multiple of 8; with 16 dims a pass, a last pass of 8).
template <int E>
inline void value_dims(const float* pt, const float* vf, int64_t D, int64_t d0, int64_t count, V alpha, float* ot) {
  V o[E];
  for (int e = 0; e < E; ++e) o[e] = Lanes::mul(Lanes::load(ot + (d0 + e) * L), alpha);
  for (int64_t j = 0; j < count; ++j) {
    const V pj = Lanes::load(pt + j * L);
    const float* vr = vf + j * D + d0;
    for (int e = 0; e < E; ++e) o[e] = Lanes::fmadd(pj, Lanes::set1(vr[e]), o[e]);
  }
  for (int e = 0; e < E; ++e) Lanes::store(ot + (d0 + e) * L, o[e]);
}

template <int DC>
inline void group_values(const float* pt, const float* vf, int64_t dim, int64_t count, V alpha, float* ot) {
  const int64_t D = DC > 0 ? DC : dim;
  int64_t d0 = 0;
  for (; d0 + Lanes::E <= D; d0 += Lanes::E) value_dims<Lanes::E>(pt, vf, D, d0, count, alpha, ot);
  if constexpr (Lanes::E > 8) {
    if (d0 < D) value_dims<8>(pt, vf, D, d0, count, alpha, ot);
  }
}

// One task: query rows r0 .. r1 - 1 (positions ctx - n + r) of KV head h, with its G query heads each: nv query
// vectors in lane groups of L, each lane one vector (the layout makes the softmax's maximum and sum lane-wise).
// Keys are walked in blocks of KB, converted to float32 once for all groups; a group skips the blocks none of its
// rows can see. A lane's arithmetic depends only on its own query and keys, in an order fixed by the shapes.
// DC: the head dim when it is a compile-time constant (64, 128), else 0 (then ``dim``).
template <typename T, int DC>
void prompt_task(const float* q, const T* k, const T* v, const int64_t* slots, int64_t n, int64_t ctx, int64_t H,
                 int64_t KV, int64_t dim, int64_t h, int64_t r0, int64_t r1, float scale, float* out,
                 std::vector<float>& buf) {
  const int64_t D = DC > 0 ? DC : dim;
  const int64_t G = H / KV, nv = (r1 - r0) * G, groups = (nv + L - 1) / L;
  buf.resize(groups * D * L * 2 + groups * L * 3 + 2 * KB * D + KB * L);
  float* qt = buf.data();                 // [groups][D][L] scaled queries
  float* ot = qt + groups * D * L;        // [groups][D][L] running weighted sums of values
  float* mx = ot + groups * D * L;        // [groups][L] running maximum
  float* sum = mx + groups * L;           // [groups][L] running sum of exponentials
  float* pos = sum + groups * L;          // [groups][L] each lane's position (as float: exact below 2^24)
  float* kf = pos + groups * L;           // [KB][D] this block's keys
  float* vf = kf + KB * D;                // [KB][D] and values
  float* pt = vf + KB * D;                // [KB][L] this block's exponentials for one group
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
    const int64_t count = std::min<int64_t>(KB, last_key + 1 - k0);
    for (int64_t j = 0; j < KB; ++j) {
      if (j < count) {
        load_row(k + (slots[k0 + j] * KV + h) * D, kf + j * D, D);
        load_row(v + (slots[k0 + j] * KV + h) * D, vf + j * D, D);
      } else {
        std::memset(kf + j * D, 0, D * sizeof(float));
        std::memset(vf + j * D, 0, D * sizeof(float));
      }
    }
    for (int64_t gr = 0; gr < groups; ++gr) {
      const V pv = Lanes::load(pos + gr * L);
      if (Lanes::reduce_max(pv) < static_cast<float>(k0)) continue;  // no row of the group sees this block
      V s[KB];
      group_scores<DC>(qt + gr * D * L, kf, D, s);
      V e[KB];
      const V alpha = block_softmax(pv, k0, count, s, mx + gr * L, sum + gr * L, e);
      for (int j = 0; j < KB; ++j) Lanes::store(pt + j * L, e[j]);
      group_values<DC>(pt, vf, D, count, alpha, ot + gr * D * L);
    }
  }
  write_rows(ot, sum, nv, r0, G, H, h, D, out);
}

#if defined(MH_AVX512)
// The bfloat16-cache variant of prompt_task: the same walk, masks and float32 softmax, but both products are
// AVX512-BF16 pair dot products accumulated in float32, as flash attention runs on bf16 inputs. Scores take the
// scaled queries rounded to bfloat16 (pairs of dims per lane) against K rows read in place (a pair of dims is
// one 32-bit word, broadcast); the weighted sum takes the softmax numerators rounded to bfloat16 (pairs of keys
// per lane) against each block's V rows interleaved by key pairs. Half the instructions of the float32 path,
// and no conversion of keys. The running sums stay those of the float32 numerators.
template <int ND>
void prompt_task_bf16(const float* q, const bf16* k, const bf16* v, const int64_t* slots, int64_t n, int64_t ctx,
                      int64_t H, int64_t KV, int64_t h, int64_t r0, int64_t r1, float scale, float* out,
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
    const bf16* krow[KB];
    for (int64_t j = 0; j < KB; ++j) krow[j] = k + (slots[k0 + std::min(j, count - 1)] * KV + h) * D;
    for (int64_t jp = 0; jp < KP; ++jp) {  // V rows 2jp and 2jp + 1 interleaved: (v[2jp][d], v[2jp+1][d]) per d
      const int64_t j0 = 2 * jp, j1 = 2 * jp + 1;
      for (int c = 0; c < ND; ++c) {
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        if (j0 < count)
          lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(v + (slots[k0 + j0] * KV + h) * D + c * 16)));
        if (j1 < count)
          hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(v + (slots[k0 + j1] * KV + h) * D + c * 16)));
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
#endif  // MH_AVX512

constexpr int64_t QB = 16;  // query rows per prompt-attention task

template <typename T>
void prompt_run(const float* q, const T* k, const T* v, const int64_t* slots, int64_t n, int64_t ctx, float* out,
                int64_t H, int64_t KV, int64_t D, float scale) {
  const int64_t blocks = (n + QB - 1) / QB, tasks = blocks * KV;
  // Later row blocks see more keys: hand tasks out costliest first, to whichever thread is free. Which thread
  // runs a task does not change its arithmetic.
  std::atomic<int64_t> next{0};
  mh::parallel_for(0, std::min<int64_t>(mh::num_threads(), tasks), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t t = next++; t < tasks; t = next++) {
      const int64_t b = blocks - 1 - t / KV, h = t % KV;
      const int64_t r0 = b * QB, r1 = std::min(n, r0 + QB);
#if defined(MH_AVX512)
      if constexpr (std::is_same_v<T, bf16>) {
        if (D == 64) {
          prompt_task_bf16<4>(q, k, v, slots, n, ctx, H, KV, h, r0, r1, scale, out, buf);
          continue;
        }
        if (D == 128) {
          prompt_task_bf16<8>(q, k, v, slots, n, ctx, H, KV, h, r0, r1, scale, out, buf);
          continue;
        }
      }
#endif
      if (D == 64)
        prompt_task<T, 64>(q, k, v, slots, n, ctx, H, KV, D, h, r0, r1, scale, out, buf);
      else if (D == 128)
        prompt_task<T, 128>(q, k, v, slots, n, ctx, H, KV, D, h, r0, r1, scale, out, buf);
      else
        prompt_task<T, 0>(q, k, v, slots, n, ctx, H, KV, D, h, r0, r1, scale, out, buf);
    }
  });
}

}  // namespace

namespace mh {

void decode_attention(const float* q, const void* k, const void* v, int kv_bf16, const int64_t* slots,
                      const int64_t* ctx_lens, float* out, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t max_ctx,
                      float scale) {
  if (kv_bf16)
    decode_run(q, static_cast<const bf16*>(k), static_cast<const bf16*>(v), slots, ctx_lens, out, B, H, KV, D, max_ctx,
               scale);
  else
    decode_run(q, static_cast<const float*>(k), static_cast<const float*>(v), slots, ctx_lens, out, B, H, KV, D,
               max_ctx, scale);
}

void prompt_attention(const float* q, const void* k, const void* v, int kv_bf16, const int64_t* slots, int64_t n,
                      int64_t ctx, float* out, int64_t H, int64_t KV, int64_t D, float scale) {
  if (kv_bf16)
    prompt_run(q, static_cast<const bf16*>(k), static_cast<const bf16*>(v), slots, n, ctx, out, H, KV, D, scale);
  else
    prompt_run(q, static_cast<const float*>(k), static_cast<const float*>(v), slots, n, ctx, out, H, KV, D, scale);
}

}  // namespace mh
