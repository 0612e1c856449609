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
    __m256i acc[kChains], u[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_setzero_si256(), u[i] = _mm256_set1_epi8(static_cast<char>(i + 1));
    __m256i s = _mm256_set1_epi8(1);
    const __m256i ones = _mm256_set1_epi16(1);
    const double t = seconds([&] {
      for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 12
        for (int i = 0; i < kChains; ++i)  // each chain its own operands: nothing to share between chains
          acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u[i], s), ones));
        __asm__ volatile("" : "+x"(s));
#pragma GCC unroll 12
        for (int i = 0; i < kChains; ++i) __asm__ volatile("" : "+x"(u[i]));
      }
    });
    alignas(32) int lanes[8];
    long sink = 0;
    for (auto& a : acc) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
      sink += lanes[0];
    }
    report("avx2 vpmaddubsw+vpmaddwd+vpaddd (32 a ymm)", t, 32, static_cast<double>(sink));
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
