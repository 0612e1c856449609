// x @ W.T on CPU for a weight stored as low-bit codes in groups, for any row count: 4-bit codes (GGUF Q4_0 /
// Q4_1) or 8-bit ones with a scale per output channel (one group of the whole row).
//
// W[n, k] = code[n, k] * scale[n, k / gs] + offset[n, k / gs]. The output is computed per group:
//   out[m, n] = sum over groups g of  scale[n, g] * (sum over k in g of x[m, k] * code[n, k])
//                                    + offset[n, g] * (sum over k in g of x[m, k])
// The codes (4-bit ones as 128 + code, see unpack_int4; 8-bit ones as they are) are exact in bfloat16, so the inner sums are AVX512-BF16 dot products of
// the bfloat16 activations with the file's exact codes, accumulated in float32: no weight is
// rounded. Every output element is reduced in the same order whatever the row count and however
// the columns are split across threads, so a row's result does not depend on the other rows of
// the product (the batch-invariant decode path of mindie_host/backends/linear.py relies on it).
//
// Work is split by tiles of 32 output columns. Each tile's codes are unpacked once into a
// bfloat16 buffer (pairs of consecutive k per column, the layout VDPBF16PS takes), then every
// block of up to 6 rows streams over it: one product of many rows reads the weights once.
// silu_mul: the gated MLP's activation between the prompt rows' two bfloat16 products (linear.bf16_gated_mlp).
// Built on first use by mindie_host/backends/cpu_matmul.py (torch.utils.cpp_extension).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MINDIE_LOWBIT_KERNEL 1
#endif
#include "vector_math.h"

namespace {

constexpr int64_t kTile = 32;  // output columns per tile: two 16-lane vectors

#if defined(MINDIE_LOWBIT_KERNEL)

// Ask for the cache lines of ``bytes`` bytes at p.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// Unpack one tile's 4-bit codes ([P][32] bytes: low nibble k = 2p, high nibble k = 2p + 1) into bf16 pairs
// of 128 + code: 0x4300 | code is exactly that number in bfloat16, so the unpacking is integer bit
// operations only. The 128 * sum(x) this adds to each group's dot product is taken back through the
// offset (lowbit_matmul subtracts 128 * scale from it).
inline __m512i int4_pairs16(const uint8_t* codes) {  // 16 columns' bytes -> their 16 bf16 pairs
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  v = _mm512_or_si512(v, _mm512_slli_epi32(v, 12));  // low code at bits 0-3, high code at bits 16-19
  return _mm512_ternarylogic_epi32(v, _mm512_set1_epi32(0x000F000F), _mm512_set1_epi32(0x43004300), 0xEA);  // (v & keep) | bias
}

inline void unpack_int4(const uint8_t* codes, int64_t P, uint32_t* buf) {
  for (int64_t p = 0; p < P; ++p)
    for (int h = 0; h < 2; ++h) _mm512_storeu_si512(buf + p * kTile + h * 16, int4_pairs16(codes + p * kTile + h * 16));
}

// Unpack one tile's 8-bit codes ([P][32][2] int8: column-major pairs) into bf16 pairs (exact: |code| <= 127).
inline __m512i int8_pairs16(const int8_t* c) {  // 16 columns' pairs (32 bytes) -> their 16 bf16 pairs
  __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
  __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(b, a);
}

inline void unpack_int8(const int8_t* codes, int64_t P, uint32_t* buf) {
  for (int64_t p = 0; p < P; ++p)
    for (int h = 0; h < 2; ++h) _mm512_storeu_si512(buf + p * kTile + h * 16, int8_pairs16(codes + p * 2 * kTile + h * 32));
}

// Where rows_block reads the weights' bf16 pairs: a buffer unpacked ahead (uint32, P * kTile of them a tile), or
// the codes themselves, unpacked in registers as they are used; either way ``src`` is the first tile and tiles are
// ``tile_bytes`` apart. The pairs are the same bits either way.
enum class Source { kBuffer, kInt4, kInt8 };

template <Source S>
inline __m512bh pairs16(const void* src, int64_t tile, int64_t half, int64_t p, int64_t P, int64_t tile_bytes) {
  if constexpr (S == Source::kBuffer) {
    return (__m512bh)_mm512_loadu_si512(
        reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(src) + tile * tile_bytes) + p * kTile + half * 16);
  } else if constexpr (S == Source::kInt4) {
    return (__m512bh)int4_pairs16(static_cast<const uint8_t*>(src) + tile * tile_bytes + p * kTile + half * 16);
  } else {
    return (__m512bh)int8_pairs16(static_cast<const int8_t*>(src) + tile * tile_bytes + p * 2 * kTile + half * 32);
  }
}

// Rows x[0 .. MR) times TN consecutive tiles (their unpacked codes one after another in buf, P pairs each).
// Every output element is reduced the same way whatever MR and TN are: per group, a chain of dot
// products over its pairs, then scale and offset applied in float32. Larger MR * TN only gives the
// core more independent chains to overlap.
template <int MR, int TN, Source S = Source::kBuffer>
inline void rows_block(const uint32_t* x32, int64_t P, const float* xsum, int64_t G, const void* src,
                       const float* scale, const float* offset, int64_t PG, float* out, int64_t N, int64_t n0,
                       int64_t tile_bytes = 0) {
  constexpr int V = 2 * TN;  // 16-column vectors per row
  __m512 res[MR][V];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < V; ++j) res[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[MR][V];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < V; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t p = g * PG; p < (g + 1) * PG; ++p) {
      __m512bh w[V];
      for (int j = 0; j < V; ++j) w[j] = pairs16<S>(src, j / 2, j % 2, p, P, tile_bytes);
      for (int r = 0; r < MR; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x32[r * P + p]));
        for (int j = 0; j < V; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, w[j]);
      }
    }
    for (int j = 0; j < V; ++j) {
      const float* st = scale + (j / 2) * G * kTile + g * kTile + (j % 2) * 16;
      const float* ot = offset + (j / 2) * G * kTile + g * kTile + (j % 2) * 16;
      const __m512 sv = _mm512_loadu_ps(st), ov = _mm512_loadu_ps(ot);
      for (int r = 0; r < MR; ++r)
        res[r][j] = _mm512_fmadd_ps(ov, _mm512_set1_ps(xsum[r * G + g]), _mm512_fmadd_ps(acc[r][j], sv, res[r][j]));
    }
  }
  for (int j = 0; j < V; ++j) {
    const int64_t c0 = n0 + j * 16, cols = std::min<int64_t>(16, N - c0);
    if (cols <= 0) break;
    const __mmask16 mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * N + c0, mask, res[r][j]);
  }
}

// One chunk of tn tiles (at ``src``, ``tile_bytes`` apart) for all M rows: one or two rows four tiles at a time
// (more independent chains), more rows a tile at a time, six rows at a time. Each output is computed the same way
// whatever the grouping (see rows_block).
template <Source S>
void chunk_rows(const uint32_t* x32, int64_t M, int64_t P, const float* xsum, int64_t G, const void* src,
                int64_t tile_bytes, int64_t tn, const float* st, const float* ot, int64_t PG, float* out, int64_t N,
                int64_t n0) {
  const uint8_t* tiles = static_cast<const uint8_t*>(src);
  if (M <= 2) {
    for (int64_t m = 0; m < M; ++m) {
      if (tn == 4) {
        rows_block<1, 4, S>(x32 + m * P, P, xsum + m * G, G, tiles, st, ot, PG, out + m * N, N, n0, tile_bytes);
        continue;
      }
      for (int64_t j = 0; j < tn; ++j)
        rows_block<1, 1, S>(x32 + m * P, P, xsum + m * G, G, tiles + j * tile_bytes, st + j * G * kTile,
                            ot + j * G * kTile, PG, out + m * N, N, n0 + j * kTile, tile_bytes);
    }
    return;
  }
  for (int64_t j = 0; j < tn; ++j) {
    const uint8_t* w = tiles + j * tile_bytes;
    const float* s = st + j * G * kTile;
    const float* o = ot + j * G * kTile;
    const int64_t nj = n0 + j * kTile;
    int64_t m = 0;
    for (; m + 6 <= M; m += 6)
      rows_block<6, 1, S>(x32 + m * P, P, xsum + m * G, G, w, s, o, PG, out + m * N, N, nj, tile_bytes);
    const uint32_t* xr = x32 + m * P;
    const float* xs = xsum + m * G;
    float* om = out + m * N;
    switch (M - m) {
      case 5: rows_block<5, 1, S>(xr, P, xs, G, w, s, o, PG, om, N, nj, tile_bytes); break;
      case 4: rows_block<4, 1, S>(xr, P, xs, G, w, s, o, PG, om, N, nj, tile_bytes); break;
      case 3: rows_block<3, 1, S>(xr, P, xs, G, w, s, o, PG, om, N, nj, tile_bytes); break;
      case 2: rows_block<2, 1, S>(xr, P, xs, G, w, s, o, PG, om, N, nj, tile_bytes); break;
      case 1: rows_block<1, 1, S>(xr, P, xs, G, w, s, o, PG, om, N, nj, tile_bytes); break;
      default: break;
    }
  }
}

#endif

}  // namespace

bool available() {
#if defined(MINDIE_LOWBIT_KERNEL)
  return true;
#else
  return false;
#endif
}

#if defined(MINDIE_LOWBIT_KERNEL)
// 16 bfloat16 values as float32
inline __m512 bf16x16(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
}

// The sum of n bfloat16 values: 16 lanes at a time, then the lanes, then the tail (a fixed order for a given n).
inline float group_sum(const uint16_t* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    acc = _mm512_add_ps(acc, bf16x16(x + k));
  }
  float s = _mm512_reduce_add_ps(acc);
  for (; k < n; ++k) {
    const uint32_t bits = static_cast<uint32_t>(x[k]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    s += f;
  }
  return s;
}
#endif

// x: [M, K] bfloat16; codes: [NT, K/2, 32] uint8 (4-bit: two codes a byte) or [NT, K/2, 64] int8 (8-bit);
// scale, offset: [NT, K/gs, 32] float32 -> [M, N] float32.
torch::Tensor lowbit_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, torch::Tensor offset,
                            int64_t N, int64_t group_size) {
  TORCH_CHECK(available(), "built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: [M, K] bfloat16");
  const bool int4 = codes.scalar_type() == torch::kUInt8;
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && (int4 || codes.scalar_type() == torch::kInt8), "codes");
  TORCH_CHECK(codes.size(2) == (int4 ? kTile : 2 * kTile), "codes: 32 columns a tile");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && offset.scalar_type() == torch::kFloat32 &&
                  scale.is_contiguous() && offset.is_contiguous(), "scale, offset: float32");
  const int64_t M = x.size(0), K = x.size(1), NT = codes.size(0), P = codes.size(1);
  TORCH_CHECK(K == 2 * P && K % group_size == 0 && group_size % 2 == 0 && NT * kTile >= N, "shapes");
  const int64_t G = K / group_size, PG = group_size / 2;
  TORCH_CHECK(scale.numel() == NT * G * kTile && offset.numel() == NT * G * kTile, "scale, offset: [NT, G, 32]");
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
#if defined(MINDIE_LOWBIT_KERNEL)
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  // each row's sum over each group (the offsets' term): per row, in an order fixed by the group size (rows
  // split over threads once there are enough of them)
  std::vector<float> xsum(M * G);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < G; ++g) xsum[m * G + g] = group_sum(xb + m * K + g * group_size, group_size);
  });
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const int64_t tile_bytes = P * codes.size(2);
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  // One or two rows: four tiles at a time (more independent chains); more rows: a tile at a time,
  // six rows at a time. Either way each output is computed the same (see rows_block).
  const int64_t TN = M <= 2 ? 4 : 1;
  at::parallel_for(0, (NT + TN - 1) / TN, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> buf(M <= 6 ? 0 : TN * P * kTile);  // only the buffered path (more than six rows) uses it
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t t0 = chunk * TN, tn = std::min<int64_t>(TN, NT - t0);
      if (chunk + 1 < end) {  // the next chunk's codes, scales and offsets: from memory while this one computes
        const int64_t t1 = t0 + TN, tn1 = std::min<int64_t>(TN, NT - t1);
        prefetch(cp + t1 * tile_bytes, tn1 * tile_bytes);
        prefetch(sp + t1 * G * kTile, tn1 * G * kTile * sizeof(float));
        prefetch(op + t1 * G * kTile, tn1 * G * kTile * sizeof(float));
      }
      const float* st = sp + t0 * G * kTile;
      const float* ot = op + t0 * G * kTile;
      const int64_t n0 = t0 * kTile;
      if (M <= 6) {  // one block of rows: unpack in registers as the codes are used (no buffer to write and read)
        if (int4)
          chunk_rows<Source::kInt4>(x32, M, P, xsum.data(), G, cp + t0 * tile_bytes, tile_bytes, tn, st, ot, PG,
                                    outp, N, n0);
        else
          chunk_rows<Source::kInt8>(x32, M, P, xsum.data(), G, cp + t0 * tile_bytes, tile_bytes, tn, st, ot, PG,
                                    outp, N, n0);
        continue;
      }
      for (int64_t j = 0; j < tn; ++j) {
        if (int4)
          unpack_int4(cp + (t0 + j) * tile_bytes, P, buf.data() + j * P * kTile);
        else
          unpack_int8(reinterpret_cast<const int8_t*>(cp + (t0 + j) * tile_bytes), P, buf.data() + j * P * kTile);
      }
      chunk_rows<Source::kBuffer>(x32, M, P, xsum.data(), G, buf.data(), P * kTile * sizeof(uint32_t), tn, st, ot,
                                  PG, outp, N, n0);
    }
  });
#endif
  return out;
}

// silu(gate) * up for the rows of a gated MLP, from its gate/up product's bfloat16 output [M, 2I] ([gate | up])
// to the bfloat16 input of its down product [M, I]: float32 arithmetic, one rounding, each element on its own
// (so a row's result does not depend on the others).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kBFloat16 && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0, "gate_up: [M, 2I] bfloat16");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({M, I}, gate_up.options());
  const at::BFloat16* src = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* dst = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / I), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const at::BFloat16* g = src + m * 2 * I;
      const at::BFloat16* u = g + I;
      at::BFloat16* o = dst + m * I;
      int64_t i = 0;
#if defined(MINDIE_LOWBIT_KERNEL)
      for (; i + 16 <= I; i += 16) {  // x * sigmoid(x) * u, sigmoid from e^-|x| (never overflows)
        const __m512 x = bf16x16(g + i), up = bf16x16(u + i);
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
        const __m512 sig = _mm512_mask_mul_ps(inv, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), inv, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_mul_ps(x, sig), up)));
      }
#endif
      for (; i < I; ++i) {
        const float x = static_cast<float>(g[i]);
        o[i] = static_cast<at::BFloat16>(x / (1.f + std::exp(-x)) * static_cast<float>(u[i]));
      }
    }
  });
  return out;
}

// As a torch operator too, for compiled graphs to call without going through Python.
TORCH_LIBRARY_FRAGMENT(mindie_host_cpu, m) {
  m.def("lowbit_matmul(Tensor x, Tensor codes, Tensor scale, Tensor offset, int n, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(mindie_host_cpu, CPU, m) { m.impl("lowbit_matmul", &lowbit_matmul); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available);
  m.def("lowbit_matmul", &lowbit_matmul);
  m.def("silu_mul", &silu_mul);
}
