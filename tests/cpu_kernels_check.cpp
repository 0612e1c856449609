// A check of the CPU kernels without torch or Python, for a machine the test suite does not run on: built with the
// kernel sources into one program (tests/test_cpu_extensions.py cross-compiles it for aarch64 and runs it under
// qemu-aarch64 where both are installed). Each kernel of the table runs on random inputs beside a plain loop
// computed in double precision; the program prints one line per kernel and exits 1 on the first disagreement.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../mindie_host/backends/kernels.h"

namespace {

void serial_for(int64_t begin, int64_t end, int64_t, mh_body body, void* ctx) { body(ctx, begin, end); }
int64_t one_thread() { return 1; }
const mh_runtime kRuntime = {serial_for, one_thread};

std::mt19937 rng(7);

std::vector<float> randn(size_t n, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

int failures = 0;

void report(const char* what, double err, double allowed) {
  const bool ok = err <= allowed;
  std::printf("%s %s: relative error %.3g (allowed %.3g)\n", ok ? "ok  " : "FAIL", what, err, allowed);
  if (!ok) ++failures;
}

double relative(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, scale = 1e-6;
  for (size_t i = 0; i < got.size(); ++i) {  // (plain comparisons: aarch64 gcc 12 -O3 fails on an fmax reduction)
    const double e = std::fabs(got[i] - want[i]), w = std::fabs(want[i]);
    if (e > err) err = e;
    if (w > scale) scale = w;
  }
  return err / scale;
}

void check_layer_ops(const mh_kernels* k) {
  const int64_t T = 5, n = 100;
  auto x = randn(T * n), r = randn(T * n), w = randn(n);
  std::vector<float> out(T * n), x0 = x;
  k->add_rms_norm(x.data(), r.data(), w.data(), out.data(), T, n, 1e-5f);
  std::vector<double> want(T * n);
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x0[t * n + i] + r[t * n + i]) * (x0[t * n + i] + r[t * n + i]);
    const double inv = 1 / std::sqrt(ss / n + 1e-5);
    for (int64_t i = 0; i < n; ++i) want[t * n + i] = double(x0[t * n + i] + r[t * n + i]) * inv * w[i];
  }
  report("add_rms_norm", relative(out, want), 1e-5);
  const int64_t H = 3, KV = 1, D = 40;
  auto q = randn(T * H * D), kk = randn(T * KV * D), c = randn(T * D), s = randn(T * D);
  std::vector<float> qo(T * H * D), ko(T * KV * D);
  k->rope(q.data(), H * D, kk.data(), KV * D, c.data(), s.data(), qo.data(), ko.data(), T, H, KV, D);
  std::vector<double> qwant(T * H * D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const float* row = q.data() + (t * H + h) * D;
        const float rot = d < D / 2 ? -row[d + D / 2] : row[d - D / 2];
        qwant[(t * H + h) * D + d] = double(row[d]) * c[t * D + d] + double(rot) * s[t * D + d];
      }
  report("rope", relative(qo, qwant), 1e-6);
}

// softmax(q . k * scale) @ v for one query over ctx rows of a [S, KV, D] cache (head h), in double
void attend(const float* q, const std::vector<float>& kc, const std::vector<float>& vc, const int64_t* slots,
            int64_t ctx, int64_t KV, int64_t h, int64_t D, double scale, double* out) {
  std::vector<double> s(ctx);
  double m = -1e300, total = 0;
  for (int64_t t = 0; t < ctx; ++t) {
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) dot += double(q[d]) * kc[(slots[t] * KV + h) * D + d];
    s[t] = dot * scale;
    m = std::fmax(m, s[t]);
  }
  for (auto& x : s) total += (x = std::exp(x - m));
  for (int64_t d = 0; d < D; ++d) {
    double acc = 0;
    for (int64_t t = 0; t < ctx; ++t) acc += s[t] * vc[(slots[t] * KV + h) * D + d];
    out[d] = acc / total;
  }
}

void check_attention(const mh_kernels* k, int64_t H, int64_t KV, int64_t D) {
  const int64_t S = 512, B = 3, max_ctx = 100, G = H / KV;
  const float scale = 1.f / std::sqrt(float(D));
  auto kc = randn(S * KV * D), vc = randn(S * KV * D), q = randn(B * H * D);
  std::vector<int64_t> slots(B * max_ctx), lens = {1, 37, 100};
  for (auto& x : slots) x = rng() % S;
  std::vector<float> out(B * H * D);
  k->decode_attention(q.data(), kc.data(), vc.data(), 0, slots.data(), lens.data(), out.data(), B, H, KV, D, max_ctx,
                      scale);
  std::vector<double> want(B * H * D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hq = 0; hq < H; ++hq)
      attend(q.data() + (b * H + hq) * D, kc, vc, slots.data() + b * max_ctx, lens[b], KV, hq / G, D, scale,
             want.data() + (b * H + hq) * D);
  char what[96];
  std::snprintf(what, sizeof what, "decode_attention (H %lld, KV %lld, D %lld)", (long long)H, (long long)KV,
                (long long)D);
  report(what, relative(out, want), 1e-5);
  if (D % 8) return;
  const int64_t n = 21, ctx = 60;
  auto qp = randn(n * H * D);
  std::vector<float> pout(n * H * D);
  k->prompt_attention(qp.data(), kc.data(), vc.data(), 0, slots.data(), n, ctx, pout.data(), H, KV, D, scale);
  std::vector<double> pwant(n * H * D);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t hq = 0; hq < H; ++hq)
      attend(qp.data() + (r * H + hq) * D, kc, vc, slots.data(), ctx - n + r + 1, KV, hq / G, D, scale,
             pwant.data() + (r * H + hq) * D);
  std::snprintf(what, sizeof what, "prompt_attention (H %lld, KV %lld, D %lld)", (long long)H, (long long)KV,
                (long long)D);
  report(what, relative(pout, pwant), 1e-5);
}

// FNV-1a of n floats' bits
uint64_t digest(const float* v, size_t n, uint64_t h = 1469598103934665603ull) {
  const unsigned char* b = reinterpret_cast<const unsigned char*>(v);
  for (size_t i = 0; i < n * sizeof(float); ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

// A float32 that is a normal float16 value (or zero) as float16 bits.
uint16_t to_half(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  if ((b & 0x7FFFFFFFu) == 0) return uint16_t(b >> 16);
  return uint16_t(((b >> 16) & 0x8000u) | ((((b >> 23) & 0xFFu) - 112) << 10) | ((b >> 13) & 0x3FFu));
}

// Weight row n's code at input i into the tiles of 32 rows lowbit_matmul and lowbit_q8_rows read (P = K / 2 pairs
// of inputs a tile): a 4-bit code (0..15) as a nibble of bytes [P][32], an int8 one into bytes [P][32][2].
void put_code(std::vector<uint8_t>& codes, bool int4, int64_t P, int64_t n, int64_t i, int code) {
  uint8_t* tile = codes.data() + (n / 32) * P * (int4 ? 32 : 64);
  if (int4)
    tile[(i / 2) * 32 + n % 32] |= uint8_t(code << (4 * (i % 2)));
  else
    tile[(i / 2) * 64 + (n % 32) * 2 + i % 2] = uint8_t(int8_t(code));
}

// x [M, K] @ w [N, K].T in double precision: the low-bit product's reference
std::vector<double> products(const std::vector<float>& x, const std::vector<float>& w, int64_t M, int64_t N,
                             int64_t K) {
  std::vector<double> want(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t c = 0; c < K; ++c) acc += double(x[m * K + c]) * w[n * K + c];
      want[m * N + n] = acc;
    }
  return want;
}

// The low-bit product's inputs come from integers alone (their own generator, exact float arithmetic), so they are
// the same bits on every architecture, and the "bits" line can be compared between variants built for different
// CPUs (the neon variant's with the avx2 variant's: the same fused multiply-adds in the same order).
void check_lowbit(const mh_kernels* k, bool int4) {
  if (k->lowbit_activation != 0) return;  // bfloat16 activations: the avx512 variant, not built here
  std::mt19937 rng(int4 ? 11 : 13);
  const int64_t N = 40, K = 288, gs = 32, NT = 2, G = K / gs, P = K / 2, M = 7;  // K: three of the buffer's blocks
  std::vector<uint8_t> codes(NT * P * (int4 ? 32 : 64), 0);
  std::vector<float> scale(NT * G * 32, 0.f), offset(NT * G * 32, 0.f), w(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < G; ++g) {
      const float sc = float(64 + rng() % 100) / 4096.f, off = int4 ? -8 * sc : 0.f;  // float16 values
      scale[(n / 32) * G * 32 + g * 32 + n % 32] = sc;
      offset[(n / 32) * G * 32 + g * 32 + n % 32] = off;
      for (int64_t c = g * gs; c < (g + 1) * gs; ++c) {
        const int code = int4 ? int(rng() % 16) : int(rng() % 255) - 127;
        w[n * K + c] = code * sc + off;
        put_code(codes, int4, P, n, c, code);
      }
    }
  std::vector<float> x(M * K);
  for (auto& v : x) v = (int(rng() % 2001) - 1000) / 512.f;
  std::vector<float> out(M * N), one(N), two(2 * N);
  k->lowbit_matmul(x.data(), M, K, codes.data(), int4, NT, scale.data(), offset.data(), N, gs, out.data());
  const std::vector<double> want = products(x, w, M, N, K);
  report(int4 ? "lowbit_matmul 4-bit" : "lowbit_matmul 8-bit", relative(out, want), 1e-5);
  k->lowbit_matmul(x.data() + 3 * K, 1, K, codes.data(), int4, NT, scale.data(), offset.data(), N, gs, one.data());
  report("lowbit_matmul: a row alone has its bits among seven",
         std::memcmp(one.data(), out.data() + 3 * N, N * sizeof(float)) == 0 ? 0.0 : 1.0, 0.0);
  k->lowbit_matmul(x.data() + 3 * K, 2, K, codes.data(), int4, NT, scale.data(), offset.data(), N, gs, two.data());
  report("lowbit_matmul: two rows have their bits among seven",
         std::memcmp(two.data(), out.data() + 3 * N, 2 * N * sizeof(float)) == 0 ? 0.0 : 1.0, 0.0);
  // the same scales (and offsets) as float16 bits, stored or derived: the same bits at one, two and seven rows
  std::vector<uint16_t> scale16(scale.size()), offset16(offset.size());
  for (size_t i = 0; i < scale.size(); ++i) {
    scale16[i] = to_half(scale[i]);
    offset16[i] = to_half(offset[i]);
  }
  for (const uint16_t* off16 : {static_cast<const uint16_t*>(offset16.data()), static_cast<const uint16_t*>(nullptr)})
    for (int64_t rows : {int64_t(1), int64_t(2), M}) {
      std::vector<float> half(rows * N);
      k->lowbit_matmul_f16(x.data() + (rows == M ? 0 : 3 * K), rows, K, codes.data(), int4, NT, scale16.data(), off16,
                           N, gs, half.data());
      report(off16 ? "lowbit_matmul_f16: float16 scales and offsets give the float32 ones' bits"
                   : "lowbit_matmul_f16: float16 scales, offsets derived, give the float32 ones' bits",
             std::memcmp(half.data(), out.data() + (rows == M ? 0 : 3 * N), rows * N * sizeof(float)) == 0 ? 0.0
                                                                                                            : 1.0,
             0.0);
    }
  std::printf("bits lowbit_matmul %s %016llx\n", int4 ? "4-bit" : "8-bit",
              (unsigned long long)digest(two.data(), 2 * N, digest(one.data(), N, digest(out.data(), M * N))));
  if (!int4) return;
  // Q4_0 (offsets derived): generated rows (lowbit_matmul, each group's scale applied once to its sum) and prompt rows
  // (lowbit_matmul_prompt, each weight dequantized), on activations in thousandths, whose products round: there the
  // order of the arithmetic shows in the bits, which the neon variant must share with avx2 (the inputs above are
  // exact in float32, so any order gives their bits)
  std::vector<float> xi(M * K);
  for (auto& v : xi) v = (int(rng() % 2001) - 1000) / 1000.f;
  const std::vector<double> wanti = products(xi, w, M, N, K);
  unsigned long long bits = 0;
  for (int prompt = 0; prompt < 2; ++prompt) {
    std::vector<float> all(M * N), alone(N), pair(2 * N);
    for (auto [rows, dst] : {std::pair<int64_t, float*>{M, all.data()}, {1, alone.data()}, {2, pair.data()}}) {
      const float* xr = xi.data() + (rows == M ? 0 : 3 * K);
      if (prompt)
        k->lowbit_matmul_prompt(xr, rows, K, codes.data(), 1, NT, scale16.data(), nullptr, 1, N, gs, dst);
      else
        k->lowbit_matmul_f16(xr, rows, K, codes.data(), 1, NT, scale16.data(), nullptr, N, gs, dst);
    }
    report(prompt ? "lowbit_matmul_prompt Q4_0" : "lowbit_matmul Q4_0 (generated rows)", relative(all, wanti), 1e-5);
    report(prompt ? "lowbit_matmul_prompt Q4_0: one and two rows have their bits among seven"
                  : "lowbit_matmul Q4_0: one and two rows have their bits among seven",
           std::memcmp(alone.data(), all.data() + 3 * N, N * sizeof(float)) == 0 &&
                   std::memcmp(pair.data(), all.data() + 3 * N, 2 * N * sizeof(float)) == 0
               ? 0.0
               : 1.0,
           0.0);
    bits = digest(all.data(), M * N, digest(alone.data(), N, bits));
  }
  std::printf("bits lowbit_matmul Q4_0 generated and prompt rows %016llx\n", bits);
}

// int8 rows times 4-bit (derived or stored offsets) or int8 codes: the bits of a plain loop of the same float32
// arithmetic (cpu_matmul.q8_rows_reference's), at seven rows and a row alone; groups of 32 or one of the whole row.
void check_q8_rows(const mh_kernels* k, bool int4, bool stored, int64_t gs) {
  std::mt19937 rng(int4 ? (stored ? 17 : 19) : 23);
  const int64_t N = 40, K = 320, NT = 2, GW = K / gs, G = K / 32, P = K / 2, M = 7;
  std::vector<uint8_t> codes(NT * P * (int4 ? 32 : 64), 0);
  std::vector<float> scale(NT * GW * 32, 0.f), offset(NT * GW * 32, 0.f);
  std::vector<int> c(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t w = 0; w < GW; ++w) {
      scale[(n / 32) * GW * 32 + w * 32 + n % 32] = float(64 + rng() % 100) / 4096.f;
      offset[(n / 32) * GW * 32 + w * 32 + n % 32] = stored ? float(int(rng() % 200) - 100) / 1024.f : 0.f;
    }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < K; ++i) {
      const int code = int4 ? int(rng() % 16) : int(rng() % 256) - 128;
      c[n * K + i] = int4 && !stored ? code - 8 : code;  // the weight's integer value
      put_code(codes, int4, P, n, i, code);
    }
  std::vector<int8_t> xq(M * K);
  std::vector<float> xscale(M * G);
  std::vector<int32_t> xqsum(M * G, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      xscale[m * G + g] = float(1 + rng() % 1000) / 8192.f;
      for (int64_t i = g * 32; i < (g + 1) * 32; ++i) {
        xq[m * K + i] = int8_t(int(rng() % 255) - 127);
        xqsum[m * G + g] += xq[m * K + i];
      }
    }
  std::vector<float> out(M * N), one(N), want(M * N);
  k->lowbit_q8_rows(xq.data(), xscale.data(), xqsum.data(), M, K, codes.data(), int4, NT, scale.data(),
                    stored ? offset.data() : nullptr, 0, N, gs, out.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t isum = 0;
        for (int64_t i = g * 32; i < (g + 1) * 32; ++i) isum += c[n * K + i] * xq[m * K + i];
        const int64_t at = (n / 32) * GW * 32 + (g * 32 / gs) * 32 + n % 32;
        const float xs = xscale[m * G + g];
        acc = acc + (scale[at] * xs) * float(isum);
        if (stored) acc = acc + (offset[at] * xs) * float(xqsum[m * G + g]);
      }
      want[m * N + n] = acc;
    }
  const char* what = int4 ? (stored ? "lowbit_q8_rows 4-bit, stored offsets" : "lowbit_q8_rows 4-bit")
                          : (gs == K ? "lowbit_q8_rows 8-bit, one group a row" : "lowbit_q8_rows 8-bit");
  report(what, std::memcmp(out.data(), want.data(), M * N * sizeof(float)) == 0 ? 0.0 : 1.0, 0.0);
  k->lowbit_q8_rows(xq.data() + 6 * K, xscale.data() + 6 * G, xqsum.data() + 6 * G, 1, K, codes.data(), int4, NT,
                    scale.data(), stored ? offset.data() : nullptr, 0, N, gs, one.data());
  report("lowbit_q8_rows: a row alone has its bits among seven",
         std::memcmp(one.data(), out.data() + 6 * N, N * sizeof(float)) == 0 ? 0.0 : 1.0, 0.0);
}

// quantize_rows: a plain loop of cpu_matmul.quantize_rows's steps (max|x| / 127, 1 / scale, round half to even of
// x * inv, clamp), bit for bit, with a group of zeros and exact halves
void check_quantize_rows(const mh_kernels* k) {
  const int64_t M = 5, K = 96, G = K / 32;
  std::vector<float> x = randn(M * K, 3.f);
  for (int64_t i = 0; i < 32; ++i) x[i] = 0.f;                          // row 0, group 0: scale 0
  for (int64_t i = 0; i < 32; ++i) x[K + i] = i == 0 ? 127.f : (i - 16) + 0.5f;  // row 1, group 0: scale 1, halves
  std::vector<int8_t> q(M * K), wq(M * K);
  std::vector<float> scale(M * G), ws(M * G);
  std::vector<int32_t> qsum(M * G), wsum(M * G, 0);
  k->quantize_rows(x.data(), M, K, q.data(), scale.data(), qsum.data());
  for (int64_t i = 0; i < M * G; ++i) {
    float amax = 0.f;
    for (int64_t j = 0; j < 32; ++j) amax = std::fabs(x[i * 32 + j]) > amax ? std::fabs(x[i * 32 + j]) : amax;
    ws[i] = amax / 127.f;
    const float inv = ws[i] > 0.f ? 1.f / ws[i] : 0.f;
    for (int64_t j = 0; j < 32; ++j) {
      float v = std::nearbyint(x[i * 32 + j] * inv);
      v = v < -127.f ? -127.f : (v > 127.f ? 127.f : v);
      wq[i * 32 + j] = int8_t(v);
      wsum[i] += int32_t(v);
    }
  }
  const bool same = std::memcmp(q.data(), wq.data(), q.size()) == 0 &&
                    std::memcmp(scale.data(), ws.data(), ws.size() * sizeof(float)) == 0 &&
                    std::memcmp(qsum.data(), wsum.data(), wsum.size() * sizeof(int32_t)) == 0;
  report("quantize_rows: codes, scales and sums of a plain loop", same ? 0.0 : 1.0, 0.0);
}

}  // namespace

int main() {
  const mh_kernels* k = mindie_host_kernels();
  if (k->abi != MINDIE_HOST_KERNELS_ABI) return 2;
  k->set_runtime(&kRuntime);
  std::printf("variant %s\n", k->variant);
  check_layer_ops(k);
  check_attention(k, 9, 3, 64);
  check_attention(k, 8, 2, 128);
  check_attention(k, 6, 2, 80);
  check_attention(k, 4, 4, 36);
  check_lowbit(k, true);
  check_lowbit(k, false);
  check_q8_rows(k, true, false, 32);
  check_q8_rows(k, true, true, 32);
  check_q8_rows(k, false, false, 32);
  check_q8_rows(k, false, false, 320);
  check_quantize_rows(k);
  return failures ? 1 : 0;
}
