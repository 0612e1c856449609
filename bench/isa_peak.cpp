// The multiply-add rate one core gets from each instruction a prompt product could be built on (issue 35: what an
// int8 prompt path would gain over the bfloat16 and float32 ones). Twelve independent accumulator chains, so the
// rate is the instruction's throughput, not its latency. Build and run (AVX-512 lines need a CPU with AVX512-BF16
// and AVX512-VNNI):
//
//     g++ -O2 -march=native bench/isa_peak.cpp -o /tmp/isa_peak && /tmp/isa_peak
//
// Each line: instructions a second, and multiply-adds a second counted as two operations each.
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <initializer_list>
#include <utility>

namespace {
constexpr long kIters = 100000000;
constexpr int kChains = 12;

template <class Body>
double seconds(Body body) {
  const auto t0 = std::chrono::steady_clock::now();
  body();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void report(const char* name, double s, int macs_per_instruction, double sink) {
  const double per_second = kIters * kChains / s;
  std::printf("%-44s %6.2f G instr/s  %6.0f G op/s  (%g)\n", name, per_second / 1e9,
              per_second * macs_per_instruction * 2 / 1e9, sink);
}

#if defined(__AVX2__) && defined(__FMA__)
// An integer multiply-add step as a kernel uses it: two rows' broadcast operands (y0, y1) against two weight vectors
// (v0, v1), four accumulators, every product distinct. All in named locals, so that they stay in AVX2's 16
// registers (twelve chains in arrays captured by reference went to memory, and the loop measured the stores: the
// 110 G op/s of bench/PERF.md's first study). Returns the seconds of kIters * kChains steps and a sum of the
// accumulators' first lanes (so nothing is dead).
template <class Step>
std::pair<double, long> two_by_two(__m256i y0, __m256i y1, __m256i v0, __m256i v1, Step step) {
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00;
  const double t = seconds([&] {
    __m256i b00 = a00, b01 = a01, b10 = a10, b11 = a11;
    for (long n = 0; n < kIters * kChains / 4; ++n) {
      b00 = step(b00, y0, v0);
      b01 = step(b01, y0, v1);
      b10 = step(b10, y1, v0);
      b11 = step(b11, y1, v1);
      __asm__ volatile("" : "+x"(y0), "+x"(y1), "+x"(v0), "+x"(v1));
    }
    a00 = b00, a01 = b01, a10 = b10, a11 = b11;
  });
  alignas(32) int lanes[8];
  long sink = 0;
  for (const __m256i& acc : {a00, a01, a10, a11}) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
    sink += lanes[0];
  }
  return {t, sink};
}
#endif
}  // namespace

int main() {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  {
    __m512i acc[kChains];
    for (auto& a : acc) a = _mm512_setzero_si512();
    __m512i u = _mm512_set1_epi8(1), s = _mm512_set1_epi8(1);
    const double t = seconds([&] {
      for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 12
        for (auto& a : acc) a = _mm512_dpbusd_epi32(a, u, s);
        __asm__ volatile("" : "+v"(u), "+v"(s));
      }
    });
    long sink = 0;
    for (auto& a : acc) sink += _mm512_reduce_add_epi32(a);
    report("avx512 vpdpbusd (u8 x s8 -> i32, 64 a zmm)", t, 64, static_cast<double>(sink));
  }
  {
    __m512 acc[kChains];
    for (auto& a : acc) a = _mm512_setzero_ps();
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    const double t = seconds([&] {
      for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 12
        for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, x);
        __asm__ volatile("" : "+v"(x));
      }
    });
    float sink = 0;
    for (auto& a : acc) sink += _mm512_reduce_add_ps(a);
    report("avx512 vdpbf16ps (bf16 pairs -> f32, 32 a zmm)", t, 32, sink);
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  {
    const __m256i ones = _mm256_set1_epi16(1);
    const auto [t, sink] = two_by_two(_mm256_set1_epi8(1), _mm256_set1_epi8(2), _mm256_set1_epi8(3),
                                      _mm256_set1_epi8(4), [ones](__m256i acc, __m256i u, __m256i s) {
      return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
    });
    report("avx2 vpmaddubsw+vpmaddwd+vpaddd (32 a ymm)", t, 32, static_cast<double>(sink));
  }
  {
    const auto [t, sink] = two_by_two(_mm256_set1_epi16(1), _mm256_set1_epi16(2), _mm256_set1_epi16(3),
                                      _mm256_set1_epi16(4), [](__m256i acc, __m256i x, __m256i w) {
      return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
    });
    report("avx2 vpmaddwd+vpaddd (i16 pairs, 16 a ymm)", t, 16, static_cast<double>(sink));
  }
  {
    __m256 acc[kChains];
    for (auto& a : acc) a = _mm256_setzero_ps();
    __m256 x = _mm256_set1_ps(1e-6f);
    const double t = seconds([&] {
      for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 12
        for (auto& a : acc) a = _mm256_fmadd_ps(x, x, a);
        __asm__ volatile("" : "+x"(x));
      }
    });
    alignas(32) float lanes[8];
    float sink = 0;
    for (auto& a : acc) {
      _mm256_store_ps(lanes, a);
      sink += lanes[0];
    }
    report("avx2 vfmadd231ps (f32, 8 a ymm)", t, 8, sink);
  }
#endif
  return 0;
}
