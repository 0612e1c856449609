// Int8 prompt rows times low-bit weights (lowbit_q8_rows): integer dot products per group of 32 inputs.
//
// Prompt rows (hundreds of rows a product) make lowbit_matmul arithmetic-bound; here the activations come quantized
// per row and group of 32 inputs to int8 (mindie_host/backends/cpu_matmul.py quantize_rows: codes q in -127..127,
// a float32 scale and the codes' sum per group), and they multiply the tiles lowbit_matmul reads (its header), taken
// as exact integers c: a 4-bit code minus 8 where the offsets are derived (GGUF Q4_0), the 4-bit code itself where
// they are stored (Q4_1, whose offsets then come in through the codes' sums), the int8 code. For every row m and
// column n, over the row's groups g in order (w = g * 32 / group_size the weights' group):
//   isum = sum over k in g of c[n, k] * q[m, k]                      exact int32 (|isum| <= 32 * 128 * 127)
//   acc  = acc + (scale[n, w] * xscale[m, g]) * float(isum)          two products and a sum, each rounded on its own
//   acc  = acc + (offset[n, w] * xscale[m, g]) * float(qsum[m, g])   where the offsets are stored
// from acc = 0: the bits of cpu_matmul.q8_rows_reference in every variant (the file is built with -ffp-contract=off
// and the vector code multiplies then adds, never fused), whatever M and however the rows are blocked, so a row's
// result depends on that row alone.
//
// The integer sums use each variant's dot product of unsigned bytes with signed ones, four products in a 32-bit lane:
// each tile's codes are unpacked once into a buffer of bytes [K/4][32 columns][4] (a column's four consecutive k in
// one lane), which every block of rows then streams over with each row's four codes broadcast to every lane:
// * avx512: VPDPBUSD (AVX512-VNNI) of u = c + bias (bias 8 for Q4_0's codes: the nibble itself; 0 for Q4_1's; 128
//   for int8 codes: their sign bit flipped) with the rows' codes, the accumulator started at -bias * qsum[m, g] so
//   that it ends at isum exactly; six rows by 32 columns at a time (24 of the 32 registers accumulate).
// * avx2: VPMADDUBSW (u8 x s8 pairs summed to int16, saturating) then VPMADDWD by ones (int16 pairs to int32).
//   4-bit: the nibbles (<= 15) times |q| <= 127, a group's eight steps summed in int16 (<= 8 * 2 * 15 * 127 = 30480:
//   no saturation) before one VPMADDWD, then -bias * qsum as above; int8: |c| (<= 128) times q with c's sign
//   (VPSIGNB), each step's pairs (<= 2 * 128 * 127 = 32512) widened to int32 at once.
// * portable (and neon): plain int32 loops over a buffer of the integers [K][32].
#define MINDIE_HOST_KERNEL_SOURCE 1
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vector_math.h"

#if defined(MH_AVX512) && !defined(__AVX512VNNI__)
#error "the avx512 variant is built with -mavx512vnni (cpu_extensions.VARIANT_FLAGS): every AVX512-BF16 CPU has VNNI"
#endif

namespace {

constexpr int64_t kTile = 32;   // output columns per tile (lowbit_matmul.cpp's)
constexpr int64_t kGroup = 32;  // inputs per group of the rows (cpu_matmul.Q8_GROUP)

// Group scales are float32, or float16 bits (``Sc`` uint16_t) converted exactly as they are loaded.
inline float scale_at(const float* p) { return *p; }
inline float scale_at(const uint16_t* p) { return mh::half_to_float(*p); }

// What every block of rows reads: the rows' codes, scales and code sums, and the weights' grouping.
struct Rows {
  const int8_t* xq;       // [M, K]
  const float* xscale;    // [M, G]
  const int32_t* xqsum;   // [M, G]
  int64_t K, G;           // G = K / 32
  int64_t per;            // row groups per weight group (group_size / 32)
  int32_t bias;           // what the unpacking added to each weight integer (SIMD variants)
};

#if defined(MH_AVX512) || defined(MH_AVX2)
#define MH_ALWAYS_INLINE inline __attribute__((always_inline))

// One tile's codes ([K/2][32] bytes of 4-bit pairs, or [K/2][32][2] int8) as bytes [K/4][32][4]: lane c of quad q
// holds column c's k = 4q .. 4q + 3. 4-bit: the nibbles (u = c + 8 for derived offsets, u = c for stored ones);
// int8: the codes, their sign bit flipped (u = c + 128) where ``flip``.
void unpack_quads(const uint8_t* tile, bool int4, bool flip, int64_t K, uint8_t* buf) {
  const int64_t Q = K / 4;
#if defined(MH_AVX512)
  const __m512i low_nibbles = _mm512_set1_epi32(0x0F0F0F0F), sign = _mm512_set1_epi32(flip ? 0x80808080u : 0);
  for (int64_t q = 0; q < Q; ++q)
    for (int h = 0; h < 2; ++h) {
      __m512i v;
      if (int4) {  // bytes p = 2q and 2q + 1 of 16 columns: their low and high nibbles, in k order
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
            tile + 2 * q * kTile + h * 16)));
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
            tile + (2 * q + 1) * kTile + h * 16)));
        v = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
        v = _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi32(v, 4)), low_nibbles);
      } else {  // the pairs p = 2q and 2q + 1 of 16 columns, side by side
        const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            tile + 2 * q * 2 * kTile + h * 32)));
        const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            tile + (2 * q + 1) * 2 * kTile + h * 32)));
        v = _mm512_xor_si512(_mm512_or_si512(a, _mm512_slli_epi32(b, 16)), sign);
      }
      _mm512_storeu_si512(buf + q * 4 * kTile + h * 64, v);
    }
#else
  const __m256i low_nibbles = _mm256_set1_epi32(0x0F0F0F0F), sign = _mm256_set1_epi32(flip ? 0x80808080u : 0);
  for (int64_t q = 0; q < Q; ++q)
    for (int h = 0; h < 4; ++h) {
      __m256i v;
      if (int4) {
        const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
            tile + 2 * q * kTile + h * 8)));
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
            tile + (2 * q + 1) * kTile + h * 8)));
        v = _mm256_or_si256(a, _mm256_slli_epi32(b, 16));
        v = _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 4)), low_nibbles);
      } else {
        const __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
            tile + 2 * q * 2 * kTile + h * 16)));
        const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
            tile + (2 * q + 1) * 2 * kTile + h * 16)));
        v = _mm256_xor_si256(_mm256_or_si256(a, _mm256_slli_epi32(b, 16)), sign);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf + q * 4 * kTile + h * 32), v);
    }
#endif
}

// Row r's four codes k .. k + 3 in every lane
MH_ALWAYS_INLINE int32_t quad(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

// The variant's registers of float32 columns (16 on avx512, 8 on avx2) and what scale_group does with them: the
// same intrinsics but for their prefix (MH_PS); scales load through vector_math.h (float16 ones widened).
#if defined(MH_AVX512)
#define MH_PS(op) _mm512_##op
using vfloat = __m512;
using vint = __m512i;
#else
#define MH_PS(op) _mm256_##op
using vfloat = __m256;
using vint = __m256i;
#endif
constexpr int kLanes = sizeof(vfloat) / sizeof(float);
template <typename Sc>
MH_ALWAYS_INLINE vfloat vscales(const Sc* p) {
#if defined(MH_AVX512)
  return mh::scales16(p);
#else
  return mh::scales8(p);
#endif
}
MH_ALWAYS_INLINE vfloat vzero() { return MH_PS(setzero_ps)(); }
MH_ALWAYS_INLINE vfloat vset1(float v) { return MH_PS(set1_ps)(v); }
MH_ALWAYS_INLINE vfloat vadd(vfloat a, vfloat b) { return MH_PS(add_ps)(a, b); }
MH_ALWAYS_INLINE vfloat vmul(vfloat a, vfloat b) { return MH_PS(mul_ps)(a, b); }
MH_ALWAYS_INLINE vfloat vfloat_of(vint v) { return MH_PS(cvtepi32_ps)(v); }
#undef MH_PS

// Row group g's exact integer sums acc of a block of MR rows (xs, qs: its first row's scales and code sums) into their
// float32 results res, two registers of columns a row from column ``col`` of the tile (scales s, stored offsets o),
// in the file header's order: res + (scale * xscale) * float(isum), then res + (offset * xscale) * float(qsum) where
// STORED, each product and sum rounded on its own. Both SIMD variants' blocks of rows end each group with it.
template <int MR, bool STORED, typename Sc>
MH_ALWAYS_INLINE void scale_group(vfloat (&res)[MR][2], const vint (&acc)[MR][2], const Rows& R, const float* xs,
                                  const int32_t* qs, int64_t g, const Sc* s, const Sc* o, int64_t col) {
  const int64_t w = g / R.per;  // the weights' group
  const vfloat s0 = vscales(s + w * kTile + col), s1 = vscales(s + w * kTile + col + kLanes);
  vfloat o0 = vzero(), o1 = vzero();
  if constexpr (STORED) o0 = vscales(o + w * kTile + col), o1 = vscales(o + w * kTile + col + kLanes);
  for (int r = 0; r < MR; ++r) {
    const vfloat xv = vset1(xs[r * R.G + g]);
    res[r][0] = vadd(res[r][0], vmul(vmul(s0, xv), vfloat_of(acc[r][0])));
    res[r][1] = vadd(res[r][1], vmul(vmul(s1, xv), vfloat_of(acc[r][1])));
    if constexpr (STORED) {
      const vfloat qv = vset1(static_cast<float>(qs[r * R.G + g]));
      res[r][0] = vadd(res[r][0], vmul(vmul(o0, xv), qv));
      res[r][1] = vadd(res[r][1], vmul(vmul(o1, xv), qv));
    }
  }
}
#endif

#if defined(MH_AVX512)
// -- avx512: VPDPBUSD, 16 columns a register ------------------------------------------------------------------------

// Rows x[0 .. MR) of the tile whose quads are in buf (scales s, stored offsets o), columns n0 .. n0 + 32 of out.
template <int MR, bool STORED, typename Sc>
void rows_block(const Rows& R, int64_t m, const uint8_t* buf, const Sc* s, const Sc* o, float* out, int64_t N,
                int64_t n0) {
  __m512 res[MR][2];
  for (int r = 0; r < MR; ++r) res[r][0] = res[r][1] = _mm512_setzero_ps();
  const int8_t* x = R.xq + m * R.K;
  const float* xs = R.xscale + m * R.G;
  const int32_t* qs = R.xqsum + m * R.G;
  for (int64_t g = 0; g < R.G; ++g) {
    __m512i acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_set1_epi32(-R.bias * qs[r * R.G + g]);
    const uint8_t* bg = buf + g * kGroup * kTile;
    for (int q = 0; q < kGroup / 4; ++q) {
      const __m512i w0 = _mm512_loadu_si512(bg + q * 4 * kTile), w1 = _mm512_loadu_si512(bg + q * 4 * kTile + 64);
      for (int r = 0; r < MR; ++r) {
        const __m512i xb = _mm512_set1_epi32(quad(x + r * R.K + g * kGroup + q * 4));
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, xb);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, xb);
      }
    }
    scale_group<MR, STORED>(res, acc, R, xs, qs, g, s, o, 0);
  }
  for (int j = 0; j < 2; ++j) {
    const int64_t c0 = n0 + j * 16, cols = std::min<int64_t>(16, N - c0);
    if (cols <= 0) break;
    const __mmask16 mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + (m + r) * N + c0, mask, res[r][j]);
  }
}

// Every row over one tile's quads, six at a time, then the rest in one block.
template <bool STORED, typename Sc>
void tile_rows(const Rows& R, int64_t M, const uint8_t* buf, const Sc* s, const Sc* o, float* out, int64_t N,
               int64_t n0) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) rows_block<6, STORED>(R, m, buf, s, o, out, N, n0);
  switch (M - m) {
    case 5: rows_block<5, STORED>(R, m, buf, s, o, out, N, n0); break;
    case 4: rows_block<4, STORED>(R, m, buf, s, o, out, N, n0); break;
    case 3: rows_block<3, STORED>(R, m, buf, s, o, out, N, n0); break;
    case 2: rows_block<2, STORED>(R, m, buf, s, o, out, N, n0); break;
    case 1: rows_block<1, STORED>(R, m, buf, s, o, out, N, n0); break;
    default: break;
  }
}

#elif defined(MH_AVX2)
// -- avx2: VPMADDUBSW + VPMADDWD, 8 columns a register, a tile in two halves of 16 columns --------------------------

// Rows x[0 .. MR) over half h (16 columns) of the tile whose quads are in buf.
template <int MR, bool INT4, bool STORED, typename Sc>
void rows_block(const Rows& R, int64_t m, const uint8_t* buf, int h, const Sc* s, const Sc* o, float* out, int64_t N,
                int64_t n0) {
  __m256 res[MR][2];
  for (int r = 0; r < MR; ++r) res[r][0] = res[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* x = R.xq + m * R.K;
  const float* xs = R.xscale + m * R.G;
  const int32_t* qs = R.xqsum + m * R.G;
  for (int64_t g = 0; g < R.G; ++g) {
    __m256i acc[MR][2];
    const uint8_t* bg = buf + g * kGroup * kTile + h * 64;
    if constexpr (INT4) {  // int16 sums over the group (no saturation: see the header), then to int32 once
      __m256i sum[MR][2];
      for (int r = 0; r < MR; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
      for (int q = 0; q < kGroup / 4; ++q) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + q * 4 * kTile));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + q * 4 * kTile + 32));
        for (int r = 0; r < MR; ++r) {
          const __m256i xb = _mm256_set1_epi32(quad(x + r * R.K + g * kGroup + q * 4));
          sum[r][0] = _mm256_add_epi16(sum[r][0], _mm256_maddubs_epi16(w0, xb));
          sum[r][1] = _mm256_add_epi16(sum[r][1], _mm256_maddubs_epi16(w1, xb));
        }
      }
      for (int r = 0; r < MR; ++r) {
        const __m256i init = _mm256_set1_epi32(-R.bias * qs[r * R.G + g]);
        acc[r][0] = _mm256_add_epi32(init, _mm256_madd_epi16(sum[r][0], ones));
        acc[r][1] = _mm256_add_epi32(init, _mm256_madd_epi16(sum[r][1], ones));
      }
    } else {  // |c| times q with c's sign, to int32 at every step
      for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (int q = 0; q < kGroup / 4; ++q) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + q * 4 * kTile));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + q * 4 * kTile + 32));
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        for (int r = 0; r < MR; ++r) {
          const __m256i xb = _mm256_set1_epi32(quad(x + r * R.K + g * kGroup + q * 4));
          acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)),
                                                                    ones));
          acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)),
                                                                    ones));
        }
      }
    }
    scale_group<MR, STORED>(res, acc, R, xs, qs, g, s, o, h * 16);
  }
  const int64_t c0 = n0 + h * 16, cols = std::min<int64_t>(16, N - c0);
  for (int r = 0; r < MR; ++r) {
    float* row = out + (m + r) * N + c0;
    if (cols >= 16) {
      _mm256_storeu_ps(row, res[r][0]);
      _mm256_storeu_ps(row + 8, res[r][1]);
    } else {
      float tmp[16];
      _mm256_storeu_ps(tmp, res[r][0]);
      _mm256_storeu_ps(tmp + 8, res[r][1]);
      for (int64_t c = 0; c < cols; ++c) row[c] = tmp[c];
    }
  }
}

// Every row over one tile's quads, a half at a time, three rows at a time (12 accumulators and the two weight
// vectors in the 16 registers; four rows spilled the float ones: 1B o 2048 x 2048 Q4_0, one thread, 154-162 -> 165
// GOP/s), then the rest in one block.
template <bool INT4, bool STORED, typename Sc>
void tile_rows(const Rows& R, int64_t M, const uint8_t* buf, const Sc* s, const Sc* o, float* out, int64_t N,
               int64_t n0) {
  constexpr int kRows = 3;
  for (int h = 0; h < 2; ++h) {
    if (n0 + h * 16 >= N) break;
    int64_t m = 0;
    for (; m + kRows <= M; m += kRows) rows_block<kRows, INT4, STORED>(R, m, buf, h, s, o, out, N, n0);
    switch (M - m) {
      case 2: rows_block<2, INT4, STORED>(R, m, buf, h, s, o, out, N, n0); break;
      case 1: rows_block<1, INT4, STORED>(R, m, buf, h, s, o, out, N, n0); break;
      default: break;
    }
  }
}

#else
// -- portable (and neon): int32 loops over the tile's integers [K][32] --------------------------------------------

// One tile's weight integers c, k-major: 4-bit codes minus ``sub`` (8 for derived offsets, 0 for stored ones), int8
// codes as they are.
void unpack_ints(const uint8_t* tile, bool int4, int sub, int64_t K, int8_t* buf) {
  for (int64_t p = 0; p < K / 2; ++p)
    for (int64_t c = 0; c < kTile; ++c) {
      if (int4) {
        const uint8_t byte = tile[p * kTile + c];
        buf[2 * p * kTile + c] = static_cast<int8_t>((byte & 15) - sub);
        buf[(2 * p + 1) * kTile + c] = static_cast<int8_t>((byte >> 4) - sub);
      } else {
        const int8_t* pair = reinterpret_cast<const int8_t*>(tile) + p * 2 * kTile + 2 * c;
        buf[2 * p * kTile + c] = pair[0];
        buf[(2 * p + 1) * kTile + c] = pair[1];
      }
    }
}

template <typename Sc>
void tile_rows(const Rows& R, int64_t M, const int8_t* buf, const Sc* s, const Sc* o, float* out, int64_t N,
               int64_t n0) {
  const int64_t cols = std::min<int64_t>(kTile, N - n0);
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* x = R.xq + m * R.K;
    float acc[kTile] = {};
    for (int64_t g = 0; g < R.G; ++g) {
      int32_t isum[kTile] = {};
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
        const int32_t xk = x[k];
        const int8_t* wk = buf + k * kTile;
        for (int64_t c = 0; c < kTile; ++c) isum[c] += static_cast<int32_t>(wk[c]) * xk;
      }
      const float xs = R.xscale[m * R.G + g];
      const Sc* sg = s + (g / R.per) * kTile;
      for (int64_t c = 0; c < kTile; ++c) acc[c] = acc[c] + (scale_at(sg + c) * xs) * static_cast<float>(isum[c]);
      if (o != nullptr) {
        const Sc* og = o + (g / R.per) * kTile;
        const float qs = static_cast<float>(R.xqsum[m * R.G + g]);
        for (int64_t c = 0; c < kTile; ++c) acc[c] = acc[c] + (scale_at(og + c) * xs) * qs;
      }
    }
    std::memcpy(out + m * N + n0, acc, cols * sizeof(float));
  }
}
#endif

template <typename Sc>
void q8_rows(const int8_t* xq, const float* xscale, const int32_t* xqsum, int64_t M, int64_t K, const uint8_t* codes,
             int int4, int64_t NT, const Sc* scale, const Sc* offset, int64_t N, int64_t group_size, float* out) {
  const bool stored = offset != nullptr;
  const Rows R{xq, xscale, xqsum, K, K / kGroup, group_size / kGroup, int4 ? (stored ? 0 : 8) : 128};
  const int64_t GW = K / group_size, tile_bytes = (K / 2) * (int4 ? kTile : 2 * kTile);
  mh::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
#if defined(MH_AVX512) || defined(MH_AVX2)
    std::vector<uint8_t> buf(K * kTile);
#else
    std::vector<int8_t> buf(K * kTile);
#endif
    for (int64_t t = t0; t < t1; ++t) {
      const Sc* s = scale + t * GW * kTile;
      const Sc* o = stored ? offset + t * GW * kTile : nullptr;
      const int64_t n0 = t * kTile;
#if defined(MH_AVX512)
      unpack_quads(codes + t * tile_bytes, int4, !int4, K, buf.data());
      if (stored)
        tile_rows<true>(R, M, buf.data(), s, o, out, N, n0);
      else
        tile_rows<false>(R, M, buf.data(), s, o, out, N, n0);
#elif defined(MH_AVX2)
      unpack_quads(codes + t * tile_bytes, int4, false, K, buf.data());
      if (int4 && stored)
        tile_rows<true, true>(R, M, buf.data(), s, o, out, N, n0);
      else if (int4)
        tile_rows<true, false>(R, M, buf.data(), s, o, out, N, n0);
      else if (stored)
        tile_rows<false, true>(R, M, buf.data(), s, o, out, N, n0);
      else
        tile_rows<false, false>(R, M, buf.data(), s, o, out, N, n0);
#else
      unpack_ints(codes + t * tile_bytes, int4, stored ? 0 : 8, K, buf.data());
      tile_rows(R, M, buf.data(), s, o, out, N, n0);
#endif
    }
  });
}

}  // namespace

namespace mh {

// xq [M, K] int8, xscale [M, K/32] float32, xqsum [M, K/32] int32; codes, scale, offset as lowbit_matmul's (the
// scales float16 bits where half_scales; offset null when derived) -> out [M, N] float32.
void lowbit_q8_rows(const int8_t* xq, const float* xscale, const int32_t* xqsum, int64_t M, int64_t K,
                    const uint8_t* codes, int int4, int64_t NT, const void* scale, const void* offset, int half_scales,
                    int64_t N, int64_t group_size, float* out) {
  if (half_scales)
    q8_rows(xq, xscale, xqsum, M, K, codes, int4, NT, static_cast<const uint16_t*>(scale),
            static_cast<const uint16_t*>(offset), N, group_size, out);
  else
    q8_rows(xq, xscale, xqsum, M, K, codes, int4, NT, static_cast<const float*>(scale),
            static_cast<const float*>(offset), N, group_size, out);
}

// x [M, K] float32 -> q [M, K] int8, scale [M, K/32] float32, qsum [M, K/32] int32: cpu_matmul.quantize_rows's
// bits (its torch steps are each one IEEE operation: max|x| / 127, 1 / scale, x * inv, round half to even, clamp),
// one pass over x instead of torch's dozen (512 x 8192 rows: 12-17 ms in torch, 50-70% of the int8 product).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* scale, int32_t* qsum) {
  parallel_for(0, M * (K / kGroup), std::max<int64_t>(1, 4096 / kGroup), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {  // group i of all rows' groups, at x + 32 i
      const float* xg = x + i * kGroup;
#if defined(MH_AVX512)
      const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
      const float s = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))) / 127.f;
      const __m512 inv = _mm512_set1_ps(s > 0.f ? 1.f / s : 0.f), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
      constexpr int kEven = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // half to even, as torch.round
      const __m512i ca = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(
          _mm512_roundscale_ps(_mm512_mul_ps(a, inv), kEven), lo), hi));
      const __m512i cb = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(
          _mm512_roundscale_ps(_mm512_mul_ps(b, inv), kEven), lo), hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup), _mm512_cvtepi32_epi8(ca));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup + 16), _mm512_cvtepi32_epi8(cb));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ca, cb));
#elif defined(MH_AVX2)
      __m256 v[4], m = _mm256_setzero_ps();
      const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xg + 8 * j);
        m = _mm256_max_ps(m, _mm256_and_ps(v[j], magnitude));
      }
      const float s = mh::reduce_max(m) / 127.f;
      const __m256 inv = _mm256_set1_ps(s > 0.f ? 1.f / s : 0.f), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
      __m256i c[4];
      for (int j = 0; j < 4; ++j)
        c[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(
            _mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi));
      // int32 -> int8 (in range: no saturation), the packs' lane interleaving undone by one permutation
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * kGroup),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      const __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      const int32_t sum = _mm_cvtsi128_si32(t);
#else
      // the largest magnitude as the largest of the non-negative floats' bits (an integer maximum: the same value)
      uint32_t top = 0;
      for (int64_t j = 0; j < kGroup; ++j) {
        uint32_t bits;
        std::memcpy(&bits, xg + j, sizeof(bits));
        top = std::max(top, bits & 0x7FFFFFFFu);
      }
      float amax;
      std::memcpy(&amax, &top, sizeof(amax));
      const float s = amax / 127.f;
      const float inv = s > 0.f ? 1.f / s : 0.f;
      int32_t sum = 0;
      for (int64_t j = 0; j < kGroup; ++j) {
        // nearbyint rounds half to even (the default rounding mode), as torch.round
        const float v = std::min(std::max(std::nearbyint(xg[j] * inv), -127.f), 127.f);
        const int32_t c = static_cast<int32_t>(v);
        q[i * kGroup + j] = static_cast<int8_t>(c);
        sum += c;
      }
#endif
      scale[i] = s;
      qsum[i] = sum;
    }
  });
}

}  // namespace mh
