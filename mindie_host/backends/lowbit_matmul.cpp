// x @ W.T on CPU for a weight stored as low-bit codes in groups, for any row count: 4-bit codes (GGUF Q4_0 /
// Q4_1) or 8-bit ones with a scale per output channel (one group of the whole row).
//
// W[n, k] = code[n, k] * scale[n, k / gs] + offset[n, k / gs], kept in tiles of 32 output columns with the codes in
// pairs along k (4-bit: both codes of a pair in one byte, low nibble first; 8-bit: a pair of int8 per column).
// Every output element is reduced in the same order whatever the row count and however the columns are split
// across threads, so a row's result does not depend on the other rows of the product (the batch-invariant decode
// path of mindie_host/backends/linear.py relies on it). Two arithmetics, by variant:
//
// avx512 (AVX512-BF16): bfloat16 activations. Per group, the inner sums are AVX512-BF16 dot products of the
// activations with the file's exact codes (4-bit ones as 128 + code, exact in bfloat16 and unpacked by bit
// operations; the 128 * sum(x) this adds is taken back through the offset), accumulated in float32, then
//   out[m, n] = sum over groups g of  scale[n, g] * (sum over k in g of x[m, k] * code[n, k])
//                                    + offset[n, g] * (sum over k in g of x[m, k])
// Each tile's codes are unpacked once into a bfloat16 buffer (pairs of consecutive k per column, the layout
// VDPBF16PS takes), then every block of up to 6 rows streams over it; one or two rows unpack in registers.
//
// avx2 and portable: float32 activations, for CPUs without native bfloat16. Each weight is dequantized to float32
// exactly as the file means it (code * scale + offset, one fused rounding with FMA), and each output is one chain
// of multiply-adds over k in order. Products of one or two rows dequantize in registers as the codes stream by (the
// weights are read once, in their low-bit form); more rows dequantize a tile's block of k once into a small
// buffer that every block of up to six rows then streams over (an FMA-bound micro-kernel), tile after tile so that
// the codes stream in order: the same values in the same order, so the same bits. The neon variant (opt-in) is the
// avx2 arithmetic with 4-lane NEON fused multiply-adds, the same bits as avx2. The portable variant is the same
// arithmetic in plain C++ (multiply, then add).
//
// Generated rows of 4-bit codes with derived offsets (GGUF Q4_0) are the one exception on these variants: they apply
// each group's scale once to the group's sum instead (llama.cpp's factoring; see q4_generated_rows), 1.3-1.6x faster
// for one or two rows at a 1B model's shapes on AVX2. Prompt rows keep the arithmetic above (lowbit_matmul_prompt:
// the factoring costs a term a row and group, which hundreds of rows pay where dequantizing a weight is shared by all
// of them), and the engine sends each kind of row to its own entry by token, never by batch
// (mindie_host/backends/linear.py, PromptRows), so each row's bits still do not depend on the other rows.
//
// Derived offsets: a null ``offset`` (the binding passes one for an empty offset tensor) means every group's offset
// is -8 * scale for 4-bit codes (GGUF Q4_0's) and 0 for 8-bit ones; inside, the offset pointer is then the scale
// pointer itself (``offset == scale`` marks it), and each offset vector is computed from the scale vector just
// loaded: the same float32 values the offset tensor held (-8 * s is exact), so the same bits, with a quarter fewer
// bytes to stream for Q4_0 (0.75 -> 0.625 a weight) and a sixth fewer for int8 groups of 16 (1.5 -> 1.25).
//
// Float16 scales: where a matrix's group scales (and stored offsets) are all float16 values, as a GGUF file's Q4_0,
// Q4_1 and Q8_0 ``d`` (and ``m``) are, LowBitTiles keeps them as float16 (checked bit for bit at load) and the binding
// calls lowbit_matmul_f16: each vector of scales is widened to float32 as it is loaded (avx512 ``vcvtph2ps``, avx2
// F16C, neon ``vcvt_f32_f16``, portable an exact conversion in software), the float32 values the float32 tensor would
// hold, so the same bits, with fewer bytes to stream: Q4_0 0.625 -> 0.5625 a weight, Q8_0 1.125 -> 1.0625 (the
// file's own sizes). Every function below takes its scales as ``const Sc*``, Sc float or uint16_t (float16 bits).
//
// silu_mul: the gated MLP's activation between the prompt rows' two bfloat16 products (linear.bf16_gated_mlp).
#define MINDIE_HOST_KERNEL_SOURCE 1
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vector_math.h"

namespace {

constexpr int64_t kTile = 32;  // output columns per tile

// A group's offsets when they are derived (``offset == scale``, see the header): -8 * scale for 4-bit codes, 0 for
// 8-bit ones, exactly the values the offset tensor held.
inline float derived_offset(bool int4, float scale) { return int4 ? -8.f * scale : 0.f; }

// Group scales (and stored offsets) are float32, or float16 bits where the file's are float16 (GGUF Q4_0, Q4_1,
// Q8_0's ``d``): converted to float32 as they are loaded, exactly (every float16 is a float32), so the kernel works
// with the same float32 values either way. ``Sc`` is float or uint16_t (float16 bits) throughout.
using mh::half_to_float;
inline float scale_at(const float* p) { return *p; }
inline float scale_at(const uint16_t* p) { return half_to_float(*p); }

#if defined(MH_AVX512)
// -- avx512: bfloat16 pair dot products ---------------------------------------------------------------------------

// Unpack one tile's 4-bit codes ([P][32] bytes: low nibble k = 2p, high nibble k = 2p + 1) into bf16 pairs
// of 128 + code: 0x4300 | code is exactly that number in bfloat16, so the unpacking is integer bit
// operations only.
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

using mh::scales16;

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
// core more independent chains to overlap. ``bias`` is what the unpacking adds to each code (128 or 0).
template <int MR, int TN, Source S = Source::kBuffer, typename Sc = float>
inline void rows_block(const uint32_t* x32, int64_t P, const float* xsum, int64_t G, const void* src,
                       const Sc* scale, const Sc* offset, int64_t PG, float* out, int64_t N, int64_t n0,
                       float bias, int64_t tile_bytes = 0) {
  constexpr int V = 2 * TN;  // 16-column vectors per row
  __m512 res[MR][V];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < V; ++j) res[r][j] = _mm512_setzero_ps();
  const __m512 bv = _mm512_set1_ps(bias);
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
      const Sc* st = scale + (j / 2) * G * kTile + g * kTile + (j % 2) * 16;
      const Sc* ot = offset + (j / 2) * G * kTile + g * kTile + (j % 2) * 16;
      const __m512 sv = scales16(st);
      const __m512 of = ot != st ? scales16(ot)
                                 : (bias != 0.f ? _mm512_mul_ps(sv, _mm512_set1_ps(-8.f)) : _mm512_setzero_ps());
      const __m512 ov = _mm512_fnmadd_ps(bv, sv, of);
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

// One chunk of tn tiles (at ``src``, ``tile_bytes`` apart) for all M rows: one row four tiles at a time (more
// independent chains), two rows together two tiles at a time (each tile's codes unpacked once for both: one row
// after the other unpacked every tile twice and made a two-row product slower than a three-row one), more rows a
// tile at a time, six rows at a time. Each output is computed the same way
// whatever the grouping (see rows_block).
template <Source S, typename Sc>
void chunk_rows(const uint32_t* x32, int64_t M, int64_t P, const float* xsum, int64_t G, const void* src,
                int64_t tile_bytes, int64_t tn, const Sc* st, const Sc* ot, int64_t PG, float* out, int64_t N,
                int64_t n0, float bias) {
  const uint8_t* tiles = static_cast<const uint8_t*>(src);
  if (M == 2) {  // both rows over each tile's codes as they are unpacked (once for the two), two tiles at a time
    int64_t j = 0;
    for (; j + 2 <= tn; j += 2)
      rows_block<2, 2, S>(x32, P, xsum, G, tiles + j * tile_bytes, st + j * G * kTile, ot + j * G * kTile, PG, out, N,
                          n0 + j * kTile, bias, tile_bytes);
    for (; j < tn; ++j)
      rows_block<2, 1, S>(x32, P, xsum, G, tiles + j * tile_bytes, st + j * G * kTile, ot + j * G * kTile, PG, out, N,
                          n0 + j * kTile, bias, tile_bytes);
    return;
  }
  if (M == 1) {
    for (int64_t m = 0; m < M; ++m) {
      if (tn == 4) {
        rows_block<1, 4, S>(x32 + m * P, P, xsum + m * G, G, tiles, st, ot, PG, out + m * N, N, n0, bias, tile_bytes);
        continue;
      }
      for (int64_t j = 0; j < tn; ++j)
        rows_block<1, 1, S>(x32 + m * P, P, xsum + m * G, G, tiles + j * tile_bytes, st + j * G * kTile,
                            ot + j * G * kTile, PG, out + m * N, N, n0 + j * kTile, bias, tile_bytes);
    }
    return;
  }
  for (int64_t j = 0; j < tn; ++j) {
    const uint8_t* w = tiles + j * tile_bytes;
    const Sc* s = st + j * G * kTile;
    const Sc* o = ot + j * G * kTile;
    const int64_t nj = n0 + j * kTile;
    int64_t m = 0;
    for (; m + 6 <= M; m += 6)
      rows_block<6, 1, S>(x32 + m * P, P, xsum + m * G, G, w, s, o, PG, out + m * N, N, nj, bias, tile_bytes);
    const uint32_t* xr = x32 + m * P;
    const float* xs = xsum + m * G;
    float* om = out + m * N;
    switch (M - m) {
      case 5: rows_block<5, 1, S>(xr, P, xs, G, w, s, o, PG, om, N, nj, bias, tile_bytes); break;
      case 4: rows_block<4, 1, S>(xr, P, xs, G, w, s, o, PG, om, N, nj, bias, tile_bytes); break;
      case 3: rows_block<3, 1, S>(xr, P, xs, G, w, s, o, PG, om, N, nj, bias, tile_bytes); break;
      case 2: rows_block<2, 1, S>(xr, P, xs, G, w, s, o, PG, om, N, nj, bias, tile_bytes); break;
      case 1: rows_block<1, 1, S>(xr, P, xs, G, w, s, o, PG, om, N, nj, bias, tile_bytes); break;
      default: break;
    }
  }
}

// 16 bfloat16 values as float32
inline __m512 bf16x16(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
}

// The sum of n bfloat16 values: 16 lanes at a time, then the lanes, then the tail (a fixed order for a given n).
inline float group_sum(const uint16_t* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) acc = _mm512_add_ps(acc, bf16x16(x + k));
  float s = _mm512_reduce_add_ps(acc);
  for (; k < n; ++k) s += mh::bf16_to_float(x[k]);
  return s;
}

template <typename Sc>
void lowbit_bf16(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* cp, int int4, int64_t NT, const Sc* sp,
                 const Sc* op, int64_t N, int64_t group_size, float* outp) {
  const int64_t P = K / 2, G = K / group_size, PG = group_size / 2;
  const float bias = int4 ? 128.f : 0.f;
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(xb);
  // each row's sum over each group (the offsets' term): per row, in an order fixed by the group size (rows
  // split over threads once there are enough of them)
  std::vector<float> xsum(M * G);
  mh::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < G; ++g) xsum[m * G + g] = group_sum(xb + m * K + g * group_size, group_size);
  });
  const int64_t tile_bytes = P * (int4 ? kTile : 2 * kTile);
  // One or two rows: four tiles at a time (more independent chains); more rows: a tile at a time,
  // six rows at a time. Either way each output is computed the same (see rows_block).
  const int64_t TN = M <= 2 ? 4 : 1;
  mh::parallel_for(0, (NT + TN - 1) / TN, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> buf(M <= 6 ? 0 : TN * P * kTile);  // only the buffered path (more than six rows) uses it
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t t0 = chunk * TN, tn = std::min<int64_t>(TN, NT - t0);
      // No software prefetch of the next chunk (here and in the avx2 kernel): issued all at once ahead of a chunk
      // (128-512 KB of codes at the 1B shapes), it held the core until its lines arrived instead of overlapping them
      // with this chunk's arithmetic, and the hardware's stream prefetchers follow these sequential tiles by
      // themselves (gate/up 2048 -> 16384, one row, one thread: 1,589 -> 1,229 us; a prefetch a fixed distance
      // ahead inside the loop gained nothing).
      const Sc* st = sp + t0 * G * kTile;
      const Sc* ot = op + t0 * G * kTile;
      const int64_t n0 = t0 * kTile;
      if (M <= 6) {  // one block of rows: unpack in registers as the codes are used (no buffer to write and read)
        if (int4)
          chunk_rows<Source::kInt4>(x32, M, P, xsum.data(), G, cp + t0 * tile_bytes, tile_bytes, tn, st, ot, PG,
                                    outp, N, n0, bias);
        else
          chunk_rows<Source::kInt8>(x32, M, P, xsum.data(), G, cp + t0 * tile_bytes, tile_bytes, tn, st, ot, PG,
                                    outp, N, n0, bias);
        continue;
      }
      for (int64_t j = 0; j < tn; ++j) {
        if (int4)
          unpack_int4(cp + (t0 + j) * tile_bytes, P, buf.data() + j * P * kTile);
        else
          unpack_int8(reinterpret_cast<const int8_t*>(cp + (t0 + j) * tile_bytes), P, buf.data() + j * P * kTile);
      }
      chunk_rows<Source::kBuffer>(x32, M, P, xsum.data(), G, buf.data(), P * kTile * sizeof(uint32_t), tn, st, ot,
                                  PG, outp, N, n0, bias);
    }
  });
}

#else  // avx2 and portable: float32 activations, weights dequantized exactly

// k per block of the buffered path: a tile's block is 16 KB of float32 (in L1 with x) a tile at a time, 32 KB in the
// prompt rows' order (see tiles_buffered; 128 there was 5-8% slower at 96-256 rows)
constexpr int64_t kBlockK = 128, kPromptBlockK = 256;
// How far ahead of the pair it dequantizes the buffered path asks for a tile's codes (two blocks: 8 KB of 8-bit
// codes, 4 KB of 4-bit ones), so that they arrive while a block's rows are multiplied instead of stalling its
// dequantizing (with the hardware's stream prefetchers alone, 3 rows of a head took 1.16-1.19x as long)
constexpr int64_t kPrefetchPairs = 128;
// Up to how many bytes of x the buffered path takes a tile at a time (see tiles_buffered): 16 rows of 8192, 64 of 2048
constexpr int64_t kByTileBytes = 512 * 1024;

#if defined(MH_AVX2)
// Columns c8 * 8 .. c8 * 8 + 7 of pair p of a tile, dequantized: k = 2p into lo, k = 2p + 1 into hi.
template <bool INT4>
inline void dequant8(const uint8_t* tile, int64_t p, int c8, __m256 scale, __m256 offset, __m256& lo, __m256& hi) {
  __m256i a, b;
  if constexpr (INT4) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + p * kTile + c8 * 8)));
    a = _mm256_and_si256(v, _mm256_set1_epi32(15));
    b = _mm256_srli_epi32(v, 4);
  } else {  // 8 columns' pairs: 16-bit words (k1 << 8 | k0), sign-extended
    const __m256i w = _mm256_cvtepi16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + p * 2 * kTile + c8 * 16)));
    a = _mm256_srai_epi32(_mm256_slli_epi32(w, 24), 24);
    b = _mm256_srai_epi32(w, 8);
  }
  lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), scale, offset);
  hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), scale, offset);
}

using mh::scales8;

// The offsets at ``offset + at``, or derived from the scales ``sv`` loaded from ``scale + at`` (offset == scale).
template <bool INT4, typename Sc>
inline __m256 offset8(const Sc* scale, const Sc* offset, int64_t at, __m256 sv) {
  if (offset != scale) return scales8(offset + at);
  return INT4 ? _mm256_mul_ps(sv, _mm256_set1_ps(-8.f)) : _mm256_setzero_ps();
}

// MR (1 or 2) rows times TN tiles, dequantizing in registers: acc = fma(x[k], w[k], acc) over k in order.
template <bool INT4, int MR, int TN, typename Sc>
inline void rows_in_registers(const float* x, int64_t K, const uint8_t* tiles, int64_t tile_bytes, const Sc* scale,
                              const Sc* offset, int64_t G, int64_t PG, float* out, int64_t N, int64_t n0) {
  __m256 acc[MR][TN * 4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < TN * 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t p = g * PG; p < (g + 1) * PG; ++p) {
      __m256 x0[MR], x1[MR];
      for (int r = 0; r < MR; ++r) {
        x0[r] = _mm256_broadcast_ss(x + r * K + 2 * p);
        x1[r] = _mm256_broadcast_ss(x + r * K + 2 * p + 1);
      }
      for (int t = 0; t < TN; ++t)
        for (int c8 = 0; c8 < 4; ++c8) {
          const int64_t at = t * G * kTile + g * kTile + c8 * 8;
          __m256 lo, hi;
          const __m256 sv = scales8(scale + at);
          dequant8<INT4>(tiles + t * tile_bytes, p, c8, sv, offset8<INT4>(scale, offset, at, sv), lo, hi);
          for (int r = 0; r < MR; ++r) {
            acc[r][t * 4 + c8] = _mm256_fmadd_ps(x0[r], lo, acc[r][t * 4 + c8]);
            acc[r][t * 4 + c8] = _mm256_fmadd_ps(x1[r], hi, acc[r][t * 4 + c8]);
          }
        }
    }
  }
  for (int t = 0; t < TN; ++t)
    for (int c8 = 0; c8 < 4; ++c8) {
      const int64_t c0 = n0 + t * kTile + c8 * 8;
      if (c0 >= N) break;
      for (int r = 0; r < MR; ++r) {
        if (c0 + 8 <= N) {
          _mm256_storeu_ps(out + r * N + c0, acc[r][t * 4 + c8]);
        } else {
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, acc[r][t * 4 + c8]);
          for (int64_t c = c0; c < N; ++c) out[r * N + c] = tmp[c - c0];
        }
      }
    }
}
#endif  // MH_AVX2

#if defined(MH_NEON)
// 4 group scales (or offsets) as float32: loaded, or widened from float16 (exact).
inline float32x4_t scales4(const float* p) { return vld1q_f32(p); }
inline float32x4_t scales4(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

// Columns c8 * 8 .. c8 * 8 + 7 of pair p of a tile, dequantized as avx2's dequant8 does (one fused multiply-add
// each): k = 2p into lo[0..1], k = 2p + 1 into hi[0..1], four columns a register.
template <bool INT4, typename Sc>
inline void dequant8(const uint8_t* tile, int64_t p, int c8, const Sc* scale, const Sc* offset, float32x4_t lo[2],
                     float32x4_t hi[2]) {
  int32x4_t a[2], b[2];
  if constexpr (INT4) {
    const uint16x8_t v = vmovl_u8(vld1_u8(tile + p * kTile + c8 * 8));
    const uint16x8_t low = vandq_u16(v, vdupq_n_u16(15)), high = vshrq_n_u16(v, 4);
    a[0] = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(low)));
    a[1] = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(low)));
    b[0] = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(high)));
    b[1] = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(high)));
  } else {  // 8 columns' pairs (k0, k1), split by the de-interleaving load
    const int8x8x2_t v = vld2_s8(reinterpret_cast<const int8_t*>(tile + p * 2 * kTile + c8 * 16));
    const int16x8_t low = vmovl_s8(v.val[0]), high = vmovl_s8(v.val[1]);
    a[0] = vmovl_s16(vget_low_s16(low));
    a[1] = vmovl_s16(vget_high_s16(low));
    b[0] = vmovl_s16(vget_low_s16(high));
    b[1] = vmovl_s16(vget_high_s16(high));
  }
  for (int h = 0; h < 2; ++h) {
    const float32x4_t sc = scales4(scale + h * 4);
    const float32x4_t of = offset != scale ? scales4(offset + h * 4)
                                           : (INT4 ? vmulq_n_f32(sc, -8.f) : vdupq_n_f32(0.f));
    lo[h] = vfmaq_f32(of, vcvtq_f32_s32(a[h]), sc);
    hi[h] = vfmaq_f32(of, vcvtq_f32_s32(b[h]), sc);
  }
}

// MR (1 or 2) rows times TN tiles, dequantizing in registers: acc = fma(x[k], w[k], acc) over k in order.
template <bool INT4, int MR, int TN, typename Sc>
inline void rows_in_registers(const float* x, int64_t K, const uint8_t* tiles, int64_t tile_bytes, const Sc* scale,
                              const Sc* offset, int64_t G, int64_t PG, float* out, int64_t N, int64_t n0) {
  float32x4_t acc[MR][TN * 8];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < TN * 8; ++j) acc[r][j] = vdupq_n_f32(0.f);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t p = g * PG; p < (g + 1) * PG; ++p) {
      float32x4_t x0[MR], x1[MR];
      for (int r = 0; r < MR; ++r) {
        x0[r] = vdupq_n_f32(x[r * K + 2 * p]);
        x1[r] = vdupq_n_f32(x[r * K + 2 * p + 1]);
      }
      for (int t = 0; t < TN; ++t)
        for (int c8 = 0; c8 < 4; ++c8) {
          const int64_t at = t * G * kTile + g * kTile + c8 * 8;
          float32x4_t lo[2], hi[2];
          dequant8<INT4>(tiles + t * tile_bytes, p, c8, scale + at, offset + at, lo, hi);
          for (int r = 0; r < MR; ++r)
            for (int h = 0; h < 2; ++h) {
              float32x4_t& a = acc[r][t * 8 + c8 * 2 + h];
              a = vfmaq_f32(a, x0[r], lo[h]);
              a = vfmaq_f32(a, x1[r], hi[h]);
            }
        }
    }
  }
  for (int t = 0; t < TN; ++t)
    for (int c4 = 0; c4 < 8; ++c4) {
      const int64_t c0 = n0 + t * kTile + c4 * 4;
      if (c0 >= N) break;
      for (int r = 0; r < MR; ++r) {
        if (c0 + 4 <= N) {
          vst1q_f32(out + r * N + c0, acc[r][t * 8 + c4]);
        } else {
          float tmp[4];
          vst1q_f32(tmp, acc[r][t * 8 + c4]);
          for (int64_t c = c0; c < N; ++c) out[r * N + c] = tmp[c - c0];
        }
      }
    }
}
#endif  // MH_NEON

// The buffered path's inlining is fixed rather than left to the compiler's heuristics, which changed with unrelated
// edits: builds that kept micro out of line ran 1.45-1.8x as long at 3-6 rows, and one that inlined tile_block into
// both loop orders 1.07-1.17x as long at 3 rows of a small matrix held in cache (qkv 2048 -> 3072 Q4_0).
#define MH_ALWAYS_INLINE inline __attribute__((always_inline))
#define MH_NOINLINE __attribute__((noinline))

// Pairs p0 .. p1 of one tile dequantized into buf ([2 * (p1 - p0)][32] float32, k-major), with the tile's codes
// kPrefetchPairs ahead asked for when ``prefetch`` (the tile's next blocks are the next codes read).
template <bool INT4, typename Sc>
MH_ALWAYS_INLINE void dequant_block(const uint8_t* tile, int64_t p0, int64_t p1, const Sc* scale, const Sc* offset,
                          int64_t PG, float* buf, bool prefetch) {
  int64_t g = p0 / PG, g_end = (g + 1) * PG;  // the group of pair p, stepped (no division a pair)
  for (int64_t p = p0; p < p1; ++p) {
    if (p == g_end) {
      ++g;
      g_end += PG;
    }
    const Sc* s = scale + g * kTile;
    const Sc* o = offset + g * kTile;
    float* lo = buf + (2 * (p - p0)) * kTile;
    float* hi = lo + kTile;
    // a cache line of codes (a pair of 8-bit ones, two pairs of 4-bit ones) kPrefetchPairs ahead
    if (prefetch && (!INT4 || p % 2 == 0))
      __builtin_prefetch(tile + (p + kPrefetchPairs) * (INT4 ? kTile : 2 * kTile));
#if defined(MH_AVX2)
    for (int c8 = 0; c8 < 4; ++c8) {
      __m256 a, b;
      const __m256 sv = scales8(s + c8 * 8);
      dequant8<INT4>(tile, p, c8, sv, offset8<INT4>(s, o, c8 * 8, sv), a, b);
      _mm256_storeu_ps(lo + c8 * 8, a);
      _mm256_storeu_ps(hi + c8 * 8, b);
    }
#elif defined(MH_NEON)
    for (int c8 = 0; c8 < 4; ++c8) {
      float32x4_t a[2], b[2];
      dequant8<INT4>(tile, p, c8, s + c8 * 8, o + c8 * 8, a, b);
      for (int h = 0; h < 2; ++h) {
        vst1q_f32(lo + c8 * 8 + h * 4, a[h]);
        vst1q_f32(hi + c8 * 8 + h * 4, b[h]);
      }
    }
#else
    for (int c = 0; c < kTile; ++c) {
      float a, b;
      if constexpr (INT4) {
        const uint8_t byte = tile[p * kTile + c];
        a = static_cast<float>(byte & 15);
        b = static_cast<float>(byte >> 4);
      } else {
        const int8_t* pair = reinterpret_cast<const int8_t*>(tile) + p * 2 * kTile + 2 * c;
        a = static_cast<float>(pair[0]);
        b = static_cast<float>(pair[1]);
      }
      const float sc = scale_at(s + c);
      const float oc = o != s ? scale_at(o + c) : derived_offset(INT4, sc);
      lo[c] = a * sc + oc;
      hi[c] = b * sc + oc;
    }
#endif
  }
}

// acc[r][0 .. COLS) (ldc apart, at c) += x[r][k] * w[k][0 .. COLS) over the block's k in order, for MR rows (ldx
// apart), w's rows kTile apart (COLS 32: a tile's block; 16: half of it); the accumulators start at zero on the first
// block. With a GroupTerm (a Q4_0 group that lies in the block, generated rows: see q4_generated_rows) they start at
// zero and end as c = fma(acc - xs8[r], scale, c), from zero for the row's first group, instead of being stored.
template <typename Sc>
struct GroupTerm {
  const float* xs8;  // eight times each row's sum of x over the group, ldxs apart
  int64_t ldxs;
  const Sc* scale;  // the group's scales at the block's columns
  bool first;       // the row's first group: c starts at zero
};

template <int MR, int COLS = kTile, typename Sc = float>
MH_ALWAYS_INLINE void micro(const float* x, int64_t ldx, const float* w, int64_t kc, float* c, int64_t ldc,
                            bool first, const GroupTerm<Sc>* term = nullptr) {
#if defined(MH_AVX2)
  constexpr int Q = COLS / 8;
  __m256 acc[MR][Q];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < Q; ++q)
      acc[r][q] = first || term ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + q * 8);
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (Q == 4) {  // the rows' broadcasts, then each weight vector in turn (16 registers at three rows)
      __m256 xb[MR];
      for (int r = 0; r < MR; ++r) xb[r] = _mm256_broadcast_ss(x + r * ldx + k);
      for (int q = 0; q < Q; ++q) {
        const __m256 wq = _mm256_loadu_ps(w + k * kTile + q * 8);
        for (int r = 0; r < MR; ++r) acc[r][q] = _mm256_fmadd_ps(xb[r], wq, acc[r][q]);
      }
    } else {  // the weight vectors, then each row's broadcast in turn (15 registers at six rows)
      __m256 wq[Q];
      for (int q = 0; q < Q; ++q) wq[q] = _mm256_loadu_ps(w + k * kTile + q * 8);
      for (int r = 0; r < MR; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
        for (int q = 0; q < Q; ++q) acc[r][q] = _mm256_fmadd_ps(xb, wq[q], acc[r][q]);
      }
    }
  }
  if (term) {
    for (int q = 0; q < Q; ++q) {
      const __m256 sv = scales8(term->scale + q * 8);
      for (int r = 0; r < MR; ++r) {
        float* cq = c + r * ldc + q * 8;
        const __m256 d = _mm256_sub_ps(acc[r][q], _mm256_set1_ps(term->xs8[r * term->ldxs]));
        _mm256_storeu_ps(cq, _mm256_fmadd_ps(d, sv, term->first ? _mm256_setzero_ps() : _mm256_loadu_ps(cq)));
      }
    }
    return;
  }
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < Q; ++q) _mm256_storeu_ps(c + r * ldc + q * 8, acc[r][q]);
#elif defined(MH_NEON)
  constexpr int Q = COLS / 4;
  float32x4_t acc[MR][Q];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < Q; ++q) acc[r][q] = first || term ? vdupq_n_f32(0.f) : vld1q_f32(c + r * ldc + q * 4);
  for (int64_t k = 0; k < kc; ++k) {
    float32x4_t xb[MR];
    for (int r = 0; r < MR; ++r) xb[r] = vdupq_n_f32(x[r * ldx + k]);
    for (int q = 0; q < Q; ++q) {
      const float32x4_t wq = vld1q_f32(w + k * kTile + q * 4);
      for (int r = 0; r < MR; ++r) acc[r][q] = vfmaq_f32(acc[r][q], xb[r], wq);
    }
  }
  if (term) {
    for (int q = 0; q < Q; ++q) {
      const float32x4_t sv = scales4(term->scale + q * 4);
      for (int r = 0; r < MR; ++r) {
        float* cq = c + r * ldc + q * 4;
        const float32x4_t d = vsubq_f32(acc[r][q], vdupq_n_f32(term->xs8[r * term->ldxs]));
        vst1q_f32(cq, vfmaq_f32(term->first ? vdupq_n_f32(0.f) : vld1q_f32(cq), d, sv));
      }
    }
    return;
  }
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < Q; ++q) vst1q_f32(c + r * ldc + q * 4, acc[r][q]);
#else
  for (int r = 0; r < MR; ++r) {
    float acc[COLS];
    for (int j = 0; j < COLS; ++j) acc[j] = first || term ? 0.f : c[r * ldc + j];
    for (int64_t k = 0; k < kc; ++k) {
      const float xv = x[r * ldx + k];
      for (int j = 0; j < COLS; ++j) acc[j] += xv * w[k * kTile + j];
    }
    if (term) {  // scale_group's arithmetic
      for (int j = 0; j < COLS; ++j) {
        const float t = (acc[j] - term->xs8[r * term->ldxs]) * scale_at(term->scale + j);
        c[r * ldc + j] = term->first ? t : c[r * ldc + j] + t;
      }
      continue;
    }
    for (int j = 0; j < COLS; ++j) c[r * ldc + j] = acc[j];
  }
#endif
}

// MR rows over a tile's block: up to three rows over all 32 columns (4 * MR accumulators), four to six over each half
// of them in turn (2 * MR): either way at most 12 accumulators in the 16 registers, and enough independent chains
// for the multiply-add latency from four rows on.
template <int MR, typename Sc = float>
MH_ALWAYS_INLINE void micro_rows(const float* x, int64_t ldx, const float* w, int64_t kc, float* c, int64_t ldc,
                                 bool first, const GroupTerm<Sc>* term = nullptr) {
  if constexpr (MR <= 3) {
    micro<MR>(x, ldx, w, kc, c, ldc, first, term);
  } else {
    micro<MR, 16>(x, ldx, w, kc, c, ldc, first, term);
    GroupTerm<Sc> half;  // the second half's columns' scales
    if (term) half = {term->xs8, term->ldxs, term->scale + 16, term->first};
    micro<MR, 16>(x, ldx, w + 16, kc, c + 16, ldc, first, term ? &half : nullptr);
  }
}

// The block of k from kb (``block`` long) of tile t for all M rows: dequantized into wbuf once, then the rows over it
// in blocks of up to six.
template <bool INT4, typename Sc>
MH_NOINLINE void tile_block(const float* x, int64_t M, int64_t K, const uint8_t* cp, int64_t tile_bytes, const Sc* sp,
                       const Sc* op, int64_t G, int64_t PG, int64_t t, int64_t kb, float* out, int64_t N, float* wbuf,
                       float* ragged, bool prefetch, int64_t block) {
  const int64_t kc = std::min<int64_t>(block, K - kb);
  dequant_block<INT4>(cp + t * tile_bytes, kb / 2, (kb + kc) / 2, sp + t * G * kTile, op + t * G * kTile, PG, wbuf,
                      prefetch);
  const bool whole = (t + 1) * kTile <= N;
  float* c = whole ? out + t * kTile : ragged;
  const int64_t ldc = whole ? N : kTile;
  // the rows in blocks of six, the last ones in one or two blocks of at least three (7 = 4 + 3, 8 = 4 + 4): a lone
  // row's chains wait on the multiply-add latency, so rows left over one at a time made five rows slower than nine
  for (int64_t m = 0; m < M;) {
    const int64_t left = M - m, rows = left <= 6 ? left : left <= 8 ? 4 : 6;
    const float* xm = x + m * K + kb;
    float* cm = c + m * ldc;
    switch (rows) {
      case 1: micro_rows<1>(xm, K, wbuf, kc, cm, ldc, kb == 0); break;
      case 2: micro_rows<2>(xm, K, wbuf, kc, cm, ldc, kb == 0); break;
      case 3: micro_rows<3>(xm, K, wbuf, kc, cm, ldc, kb == 0); break;
      case 4: micro_rows<4>(xm, K, wbuf, kc, cm, ldc, kb == 0); break;
      case 5: micro_rows<5>(xm, K, wbuf, kc, cm, ldc, kb == 0); break;
      default: micro_rows<6>(xm, K, wbuf, kc, cm, ldc, kb == 0); break;
    }
    m += rows;
  }
}

// Tiles t0 .. t1 for all M rows through the buffer: each block of k of a tile dequantized once, then the rows over it
// in blocks of up to six (micro_rows), their accumulators kept in the output between blocks (tile_block).
// Decode-sized products (the rows' x within kByTileBytes) take a tile at a time, so that its codes stream in order
// as in the in-register paths, prefetched ahead (a block of k over every tile, the codes read 4-8 KB from one tile
// then from the next, stalled on them: 3 rows of a head took 1.6x as long); larger ones (prompt rows) take a block of
// k over all the tiles, so the rows' block of x stays in cache across them. A tile that runs past N keeps its
// accumulators in ``ragged`` ([M][32]) instead of the output.
template <bool INT4, typename Sc>
void tiles_buffered(const float* x, int64_t M, int64_t K, const uint8_t* cp, int64_t tile_bytes, const Sc* sp,
                    const Sc* op, int64_t G, int64_t PG, int64_t t0, int64_t t1, float* out, int64_t N,
                    std::vector<float>& wbuf, std::vector<float>& ragged) {
  wbuf.resize(kPromptBlockK * kTile);
  if (t1 * kTile > N) ragged.resize(M * kTile);
  if (M * K * static_cast<int64_t>(sizeof(float)) <= kByTileBytes) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t kb = 0; kb < K; kb += kBlockK)
        tile_block<INT4>(x, M, K, cp, tile_bytes, sp, op, G, PG, t, kb, out, N, wbuf.data(), ragged.data(), true,
                         kBlockK);
  } else {
    for (int64_t kb = 0; kb < K; kb += kPromptBlockK)
      for (int64_t t = t0; t < t1; ++t)
        tile_block<INT4>(x, M, K, cp, tile_bytes, sp, op, G, PG, t, kb, out, N, wbuf.data(), ragged.data(), false,
                         kPromptBlockK);
  }
  if (t1 * kTile > N) {  // the last tile's columns that exist
    const int64_t c0 = (t1 - 1) * kTile;
    for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * N + c0, ragged.data() + m * kTile, (N - c0) * sizeof(float));
  }
}

// -- generated rows of 4-bit codes with derived offsets (GGUF Q4_0): the scale applied once to a group's sum --------
//
//   out[m, n] = sum over groups g, in order, of  scale[n, g] * (sum over k in g of x[m, k] * code[n, k] - 8 * xs[m, g])
//
// with xs[m, g] the sum of the group's x (float32, in k order; 8 * xs exact). Each group's inner sum is one chain of
// fused multiply-adds over its k in order, from zero, then out = fma(inner - 8 * xs, scale, out) a group (from zero for
// the first). That is llama.cpp's factoring in float32: the codes stream by with a conversion each where dequantizing
// them cost a multiply-add and a load of their group's scale, and one sequence's 4-bit decode on AVX2 is bound by
// those instructions. At one or two rows the codes are unpacked in registers as they stream by; from three rows a
// tile's block of codes is unpacked once into a buffer that blocks of up to six rows stream over (micro_rows), their
// sums kept in ``part`` ([rows][32]) until the group ends. Every row is reduced the same way at any row count.

#if defined(MH_AVX2)
// Columns c8 * 8 .. c8 * 8 + 7 of pair p of a 4-bit tile, the codes as float32: k = 2p into lo, k = 2p + 1 into hi.
inline void codes8(const uint8_t* tile, int64_t p, int c8, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + p * kTile + c8 * 8)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
#elif defined(MH_NEON)
// avx2's codes8, four columns a register.
inline void codes8(const uint8_t* tile, int64_t p, int c8, float32x4_t lo[2], float32x4_t hi[2]) {
  const uint16x8_t v = vmovl_u8(vld1_u8(tile + p * kTile + c8 * 8));
  const uint16x8_t low = vandq_u16(v, vdupq_n_u16(15)), high = vshrq_n_u16(v, 4);
  lo[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(low)));
  lo[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(low)));
  hi[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(high)));
  hi[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(high)));
}
#endif

#if defined(MH_AVX2) || defined(MH_NEON)
// The inner sums of MR (1 or 2) rows over TN tiles for pairs p0 .. p1 (one group), the codes unpacked in registers,
// into part ([MR][TN * 32]). Out of line, so that the compiler keeps the accumulators in registers over the loop
// (with the group's scaling in the same function, GCC stored them to the stack every pair).
template <int MR, int TN>
MH_NOINLINE void q4_group_sums(const float* x, int64_t K, const uint8_t* tiles, int64_t tile_bytes, int64_t p0,
                               int64_t p1, float* part) {
#if defined(MH_AVX2)
  __m256 acc[MR][TN * 4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < TN * 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    __m256 x0[MR], x1[MR];
    for (int r = 0; r < MR; ++r) {
      x0[r] = _mm256_broadcast_ss(x + r * K + 2 * p);
      x1[r] = _mm256_broadcast_ss(x + r * K + 2 * p + 1);
    }
    for (int t = 0; t < TN; ++t)
      for (int c8 = 0; c8 < 4; ++c8) {
        __m256 lo, hi;
        codes8(tiles + t * tile_bytes, p, c8, lo, hi);
        for (int r = 0; r < MR; ++r) {
          acc[r][t * 4 + c8] = _mm256_fmadd_ps(x0[r], lo, acc[r][t * 4 + c8]);
          acc[r][t * 4 + c8] = _mm256_fmadd_ps(x1[r], hi, acc[r][t * 4 + c8]);
        }
      }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < TN * 4; ++j) _mm256_storeu_ps(part + r * TN * kTile + j * 8, acc[r][j]);
#else
  float32x4_t acc[MR][TN * 8];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < TN * 8; ++j) acc[r][j] = vdupq_n_f32(0.f);
  for (int64_t p = p0; p < p1; ++p) {
    float32x4_t x0[MR], x1[MR];
    for (int r = 0; r < MR; ++r) {
      x0[r] = vdupq_n_f32(x[r * K + 2 * p]);
      x1[r] = vdupq_n_f32(x[r * K + 2 * p + 1]);
    }
    for (int t = 0; t < TN; ++t)
      for (int c8 = 0; c8 < 4; ++c8) {
        float32x4_t lo[2], hi[2];
        codes8(tiles + t * tile_bytes, p, c8, lo, hi);
        for (int r = 0; r < MR; ++r)
          for (int h = 0; h < 2; ++h) {
            float32x4_t& a = acc[r][t * 8 + c8 * 2 + h];
            a = vfmaq_f32(a, x0[r], lo[h]);
            a = vfmaq_f32(a, x1[r], hi[h]);
          }
      }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < TN * 8; ++j) vst1q_f32(part + r * TN * kTile + j * 4, acc[r][j]);
#endif
}
#endif  // MH_AVX2 || MH_NEON

// c[r][0 .. 32) (ldc apart) = fma(part[r][0 .. 32) - xs8[r], scale[0 .. 32), c[r]) for ``rows`` rows (part's rows
// ``ldp`` apart, xs8's ``ldxs``), from zero for a row's first group: the group's term (avx2 and neon fused, portable
// multiply then add).
template <typename Sc>
MH_ALWAYS_INLINE void scale_group(const float* part, int64_t ldp, int64_t rows, const float* xs8, int64_t ldxs,
                                  const Sc* scale, bool first, float* c, int64_t ldc) {
#if defined(MH_AVX2)
  __m256 sv[4];
  for (int q = 0; q < 4; ++q) sv[q] = scales8(scale + q * 8);
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 xr = _mm256_set1_ps(xs8[r * ldxs]);
    for (int q = 0; q < 4; ++q) {
      float* cq = c + r * ldc + q * 8;
      _mm256_storeu_ps(cq, _mm256_fmadd_ps(_mm256_sub_ps(_mm256_loadu_ps(part + r * ldp + q * 8), xr), sv[q],
                                           first ? _mm256_setzero_ps() : _mm256_loadu_ps(cq)));
    }
  }
#elif defined(MH_NEON)
  float32x4_t sv[8];
  for (int q = 0; q < 8; ++q) sv[q] = scales4(scale + q * 4);
  for (int64_t r = 0; r < rows; ++r) {
    const float32x4_t xr = vdupq_n_f32(xs8[r * ldxs]);
    for (int q = 0; q < 8; ++q) {
      float* cq = c + r * ldc + q * 4;
      const float32x4_t d = vsubq_f32(vld1q_f32(part + r * ldp + q * 4), xr);
      vst1q_f32(cq, vfmaq_f32(first ? vdupq_n_f32(0.f) : vld1q_f32(cq), d, sv[q]));
    }
  }
#else
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < kTile; ++j) {
      const float term = (part[r * ldp + j] - xs8[r * ldxs]) * scale_at(scale + j);
      c[r * ldc + j] = first ? term : c[r * ldc + j] + term;
    }
#endif
}

#if defined(MH_AVX2) || defined(MH_NEON)
// MR (1 or 2) rows times TN tiles of 4-bit codes, a group at a time: its inner sums (q4_group_sums), then its term
// (xs8: [MR][G] eight times each row's group sums) into ``total`` ([MR][TN * 32]), stored to the output's columns
// that exist at the end.
template <int MR, int TN, typename Sc>
void q4_rows_in_registers(const float* x, int64_t K, const uint8_t* tiles, int64_t tile_bytes, const Sc* scale,
                          const float* xs8, int64_t G, int64_t PG, float* out, int64_t N, int64_t n0) {
  alignas(32) float part[MR * TN * kTile];
  alignas(32) float total[MR * TN * kTile];
  for (int64_t g = 0; g < G; ++g) {
    q4_group_sums<MR, TN>(x, K, tiles, tile_bytes, g * PG, (g + 1) * PG, part);
    for (int t = 0; t < TN; ++t)
      scale_group(part + t * kTile, TN * kTile, MR, xs8 + g, G, scale + t * G * kTile + g * kTile, g == 0,
                  total + t * kTile, TN * kTile);
  }
  for (int t = 0; t < TN; ++t) {
    const int64_t c0 = n0 + t * kTile;
    if (c0 >= N) break;
    const int64_t n = std::min<int64_t>(kTile, N - c0);
    for (int r = 0; r < MR; ++r) std::memcpy(out + r * N + c0, total + r * TN * kTile + t * kTile, n * sizeof(float));
  }
}
#endif  // MH_AVX2 || MH_NEON

// Pairs p0 .. p1 of one 4-bit tile's codes as float32 into buf ([2 * (p1 - p0)][32], k-major), the tile's codes
// kPrefetchPairs ahead asked for (the tile's next blocks are the next codes read).
MH_ALWAYS_INLINE void q4_block(const uint8_t* tile, int64_t p0, int64_t p1, float* buf) {
  for (int64_t p = p0; p < p1; ++p) {
    float* lo = buf + (2 * (p - p0)) * kTile;
    float* hi = lo + kTile;
    if (p % 2 == 0) __builtin_prefetch(tile + (p + kPrefetchPairs) * kTile);  // a cache line: two pairs
#if defined(MH_AVX2)
    for (int c8 = 0; c8 < 4; ++c8) {
      __m256 a, b;
      codes8(tile, p, c8, a, b);
      _mm256_storeu_ps(lo + c8 * 8, a);
      _mm256_storeu_ps(hi + c8 * 8, b);
    }
#elif defined(MH_NEON)
    for (int c8 = 0; c8 < 4; ++c8) {
      float32x4_t a[2], b[2];
      codes8(tile, p, c8, a, b);
      for (int h = 0; h < 2; ++h) {
        vst1q_f32(lo + c8 * 8 + h * 4, a[h]);
        vst1q_f32(hi + c8 * 8 + h * 4, b[h]);
      }
    }
#else
    for (int c = 0; c < kTile; ++c) {
      const uint8_t byte = tile[p * kTile + c];
      lo[c] = static_cast<float>(byte & 15);
      hi[c] = static_cast<float>(byte >> 4);
    }
#endif
  }
}

// The block of k from kb of 4-bit tile t for all M rows: its codes unpacked into wbuf once, then, group by group, the
// rows' inner sums over it in blocks of up to six and, where a group ends, its term into the output (c, ldc apart):
// from the micro-kernel's accumulators for a group that lies in the block, else through part ([M][32], kept into the
// tile's next blocks until the group ends).
template <typename Sc>
MH_NOINLINE void q4_tile_block(const float* x, int64_t M, int64_t K, const uint8_t* tile, const Sc* scale,
                               const float* xs8, int64_t group_size, int64_t kb, float* c, int64_t ldc, float* wbuf,
                               float* part) {
  const int64_t kc = std::min<int64_t>(kBlockK, K - kb);
  q4_block(tile, kb / 2, (kb + kc) / 2, wbuf);
  for (int64_t k0 = kb; k0 < kb + kc;) {
    const int64_t g = k0 / group_size, k1 = std::min<int64_t>(kb + kc, (g + 1) * group_size), len = k1 - k0;
    const bool start = k0 == g * group_size, ends = k1 == (g + 1) * group_size;
    const float* w = wbuf + (k0 - kb) * kTile;
    const int64_t G = K / group_size;
    for (int64_t m = 0; m < M;) {  // as tile_block's blocks of rows
      const int64_t left = M - m, rows = left <= 6 ? left : left <= 8 ? 4 : 6;
      const float* xm = x + m * K + k0;
      // a group in the block ends in the micro-kernel (its term straight from the accumulators); a longer one keeps
      // its sums in part until its last block, then scale_group: the same arithmetic
      const GroupTerm<Sc> term{xs8 + m * G + g, G, scale + g * kTile, g == 0};
      const GroupTerm<Sc>* tp = start && ends ? &term : nullptr;
      float* cm = tp ? c + m * ldc : part + m * kTile;
      const int64_t ld = tp ? ldc : kTile;
      switch (rows) {
        case 1: micro_rows<1>(xm, K, w, len, cm, ld, start, tp); break;
        case 2: micro_rows<2>(xm, K, w, len, cm, ld, start, tp); break;
        case 3: micro_rows<3>(xm, K, w, len, cm, ld, start, tp); break;
        case 4: micro_rows<4>(xm, K, w, len, cm, ld, start, tp); break;
        case 5: micro_rows<5>(xm, K, w, len, cm, ld, start, tp); break;
        default: micro_rows<6>(xm, K, w, len, cm, ld, start, tp); break;
      }
      m += rows;
    }
    if (ends && !start) scale_group(part, kTile, M, xs8 + g, G, scale + g * kTile, g == 0, c, ldc);
    k0 = k1;
  }
}

// Generated rows of a 4-bit matrix with derived offsets (see above): one or two rows in registers, more a tile at a
// time through the buffer.
template <typename Sc>
void q4_generated_rows(const float* x, int64_t M, int64_t K, const uint8_t* cp, int64_t NT, const Sc* sp, int64_t N,
                       int64_t group_size, float* out) {
  const int64_t P = K / 2, G = K / group_size, PG = group_size / 2, tile_bytes = P * kTile;
  // eight times each row's sum over each group: float32, in k order, whatever the row count
  std::vector<float> xs8(M * G);
  mh::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const float* xg = x + m * K + g * group_size;
        float sum = 0.f;
        for (int64_t k = 0; k < group_size; ++k) sum += xg[k];
        xs8[m * G + g] = 8.f * sum;
      }
  });
#if defined(MH_AVX2) || defined(MH_NEON)
  if (M <= 2) {  // two tiles at a time for one row (more independent chains)
    const int64_t TN = M == 1 ? 2 : 1;
    mh::parallel_for(0, (NT + TN - 1) / TN, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        const int64_t t0 = chunk * TN, tn = std::min<int64_t>(TN, NT - t0);
        const uint8_t* tiles = cp + t0 * tile_bytes;
        const Sc* s = sp + t0 * G * kTile;
        if (M == 2)
          q4_rows_in_registers<2, 1>(x, K, tiles, tile_bytes, s, xs8.data(), G, PG, out, N, t0 * kTile);
        else if (tn == 2)
          q4_rows_in_registers<1, 2>(x, K, tiles, tile_bytes, s, xs8.data(), G, PG, out, N, t0 * kTile);
        else
          q4_rows_in_registers<1, 1>(x, K, tiles, tile_bytes, s, xs8.data(), G, PG, out, N, t0 * kTile);
      }
    });
    return;
  }
#endif
  mh::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> wbuf(kBlockK * kTile), part(M * kTile), ragged;
    for (int64_t t = t0; t < t1; ++t) {
      const bool whole = (t + 1) * kTile <= N;  // else the tile's sums go to ragged, its columns that exist copied out
      if (!whole) ragged.resize(M * kTile);
      float* c = whole ? out + t * kTile : ragged.data();
      const int64_t ldc = whole ? N : kTile;
      for (int64_t kb = 0; kb < K; kb += kBlockK)
        q4_tile_block(x, M, K, cp + t * tile_bytes, sp + t * G * kTile, xs8.data(), group_size, kb, c, ldc,
                      wbuf.data(), part.data());
      if (!whole)
        for (int64_t m = 0; m < M; ++m)
          std::memcpy(out + m * N + t * kTile, ragged.data() + m * kTile, (N - t * kTile) * sizeof(float));
    }
  });
}

// Prompt rows (``prompt``), and every row of 8-bit codes or of 4-bit codes with stored offsets: each weight
// dequantized (above); generated rows of 4-bit codes with derived offsets: q4_generated_rows.
template <bool INT4, typename Sc>
void lowbit_f32(const float* x, int64_t M, int64_t K, const uint8_t* cp, int64_t NT, const Sc* sp, const Sc* op,
                int64_t N, int64_t group_size, float* out, bool prompt) {
  const int64_t P = K / 2, G = K / group_size, PG = group_size / 2;
  const int64_t tile_bytes = P * (INT4 ? kTile : 2 * kTile);
  if (INT4 && op == sp && !prompt) return q4_generated_rows(x, M, K, cp, NT, sp, N, group_size, out);
#if defined(MH_AVX2) || defined(MH_NEON)
  if (M <= 2) {  // dequantize in registers, two tiles at a time for one row (more independent chains)
    const int64_t TN = M == 1 ? 2 : 1;
    mh::parallel_for(0, (NT + TN - 1) / TN, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        const int64_t t0 = chunk * TN, tn = std::min<int64_t>(TN, NT - t0);
        const uint8_t* tiles = cp + t0 * tile_bytes;
        const Sc* s = sp + t0 * G * kTile;
        const Sc* o = op + t0 * G * kTile;
        if (M == 2)
          rows_in_registers<INT4, 2, 1>(x, K, tiles, tile_bytes, s, o, G, PG, out, N, t0 * kTile);
        else if (tn == 2)
          rows_in_registers<INT4, 1, 2>(x, K, tiles, tile_bytes, s, o, G, PG, out, N, t0 * kTile);
        else
          rows_in_registers<INT4, 1, 1>(x, K, tiles, tile_bytes, s, o, G, PG, out, N, t0 * kTile);
      }
    });
    return;
  }
#endif
  mh::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> wbuf, ragged;
    tiles_buffered<INT4>(x, M, K, cp, tile_bytes, sp, op, G, PG, t0, t1, out, N, wbuf, ragged);
  });
}

#endif  // MH_AVX512

}  // namespace

namespace mh {

#if defined(MH_AVX512)
const int lowbit_activation = 1;
#else
const int lowbit_activation = 0;
#endif

// x: [M, K] (bfloat16 bits with AVX512-BF16, else float32); codes: [NT, K/2, 32] uint8 (4-bit: two codes a byte) or
// [NT, K/2, 64] int8 (8-bit); scale, offset: [NT, K/gs, 32] float32 (lowbit_matmul) or float16 bits
// (lowbit_matmul_f16) -> out [M, N] float32. ``prompt``: the rows are prompt tokens (see the header).
template <typename Sc>
void lowbit_any(const void* x, int64_t M, int64_t K, const uint8_t* codes, int int4, int64_t NT, const Sc* scale,
                const Sc* offset, int64_t N, int64_t group_size, float* out, bool prompt) {
  if (offset == nullptr) offset = scale;  // derived offsets (see the header)
#if defined(MH_AVX512)
  (void)prompt;  // one arithmetic for every row
  lowbit_bf16(static_cast<const uint16_t*>(x), M, K, codes, int4, NT, scale, offset, N, group_size, out);
#else
  if (int4)
    lowbit_f32<true>(static_cast<const float*>(x), M, K, codes, NT, scale, offset, N, group_size, out, prompt);
  else
    lowbit_f32<false>(static_cast<const float*>(x), M, K, codes, NT, scale, offset, N, group_size, out, prompt);
#endif
}

void lowbit_matmul(const void* x, int64_t M, int64_t K, const uint8_t* codes, int int4, int64_t NT, const float* scale,
                   const float* offset, int64_t N, int64_t group_size, float* out) {
  lowbit_any(x, M, K, codes, int4, NT, scale, offset, N, group_size, out, false);
}

void lowbit_matmul_f16(const void* x, int64_t M, int64_t K, const uint8_t* codes, int int4, int64_t NT,
                       const uint16_t* scale, const uint16_t* offset, int64_t N, int64_t group_size, float* out) {
  lowbit_any(x, M, K, codes, int4, NT, scale, offset, N, group_size, out, false);
}

void lowbit_matmul_prompt(const void* x, int64_t M, int64_t K, const uint8_t* codes, int int4, int64_t NT,
                          const void* scale, const void* offset, int half_scales, int64_t N, int64_t group_size,
                          float* out) {
  if (half_scales)
    lowbit_any(x, M, K, codes, int4, NT, static_cast<const uint16_t*>(scale), static_cast<const uint16_t*>(offset), N,
               group_size, out, true);
  else
    lowbit_any(x, M, K, codes, int4, NT, static_cast<const float*>(scale), static_cast<const float*>(offset), N,
               group_size, out, true);
}

// silu(gate) * up for the rows of a gated MLP, from its gate/up product's bfloat16 output [M, 2I] ([gate | up])
// to the bfloat16 input of its down product [M, I]: float32 arithmetic, one rounding, each element on its own
// (so a row's result does not depend on the others).
void silu_mul(const uint16_t* gate_up, uint16_t* out, int64_t M, int64_t I) {
  parallel_for(0, M, std::max<int64_t>(1, 8192 / I), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const uint16_t* g = gate_up + m * 2 * I;
      const uint16_t* u = g + I;
      uint16_t* o = out + m * I;
      int64_t i = 0;
#if defined(MH_AVX512)
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
        const float x = bf16_to_float(g[i]);
        o[i] = float_to_bf16(x / (1.f + std::exp(-x)) * bf16_to_float(u[i]));
      }
    }
  });
}

}  // namespace mh
