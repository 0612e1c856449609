// Which instruction set a kernel source is built for, and the vector math the kernels share.
//
// Each variant library is built with its own flags (mindie_host/backends/cpu_extensions.py): portable (the
// architecture's baseline: SSE2 on x86-64, plain C++ that the compiler vectorizes as it can, also the path of Arm
// and every other CPU), avx2 (x86-64-v3: AVX2, FMA, F16C), avx512 (x86-64-v4 with AVX512-BF16) and neon (aarch64,
// opt-in: built with -DMINDIE_HOST_NEON, hand-written NEON in the low-bit product only). MH_AVX512, MH_AVX2 and
// MH_NEON say which vector paths a source compiles; every intrinsic sits inside their #if.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__)
#define MH_AVX512 1
#define MH_VARIANT "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MH_AVX2 1
#define MH_VARIANT "avx2"
#elif defined(MINDIE_HOST_NEON) && defined(__aarch64__) && defined(__ARM_NEON)
#define MH_NEON 1
#define MH_VARIANT "neon"
#else
#define MH_VARIANT "portable"
#endif

#if defined(MH_AVX512) || defined(MH_AVX2)
#include <immintrin.h>
#endif
#if defined(MH_NEON)
#include <arm_neon.h>
#endif

namespace mh {

// float16 bits to float32, exactly, in software (every float16 is a float32; the portable variants' conversion of
// the file's scales: vector variants convert 8-16 at a time with F16C)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float32
    const float v = static_cast<float>(man) * 0x1p-24f;
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (exp == 0x1F ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

// Group scales (or offsets) as float32, 16 (avx512) or 8 (avx2, and avx512's half registers) at a time: loaded, or
// widened from float16 bits (vcvtph2ps / F16C: exact, every float16 is a float32), the values a float32 tensor of
// them would hold. The low-bit products (lowbit_matmul.cpp, lowbit_q8_rows.cpp) load every scale through them.
#if defined(MH_AVX512)
inline __m512 scales16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 scales16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
#if defined(MH_AVX512) || defined(MH_AVX2)
inline __m256 scales8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 scales8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

#if defined(MH_AVX512)
// e^x for x <= 0 (scores minus their maximum, or -|x|): 2^n * p(r) with a degree-6 polynomial, ~1e-7 relative error
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
#endif

#if defined(MH_AVX2)
// The same e^x for x <= 0 in 8 lanes: the same polynomial, 2^n put in the exponent bits (n >= -126: a normal number)
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// The sum of a vector's 8 lanes, in a fixed order
inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float reduce_max(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 bfloat16 values (bits) as float32
inline __m256 load_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif

}  // namespace mh
