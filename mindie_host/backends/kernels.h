// The C interface between the CPU kernels and torch.
//
// The kernels (layer_ops.cpp, attention.cpp, lowbit_matmul.cpp) include no torch header: each instruction-set
// variant (portable, avx2, avx512) is one small shared library built from them with its own compiler flags
// (mindie_host/backends/cpu_extensions.py), in seconds. binding.cpp is the one torch extension: it checks tensors,
// allocates outputs and calls a variant through the table below; it runs the kernels' parallel loops on torch's
// thread pool (the runtime functions handed over by mh_set_runtime).
#pragma once
#include <cstdint>

// 2: lowbit_matmul_f16 appended at the end of the table; a library of version 1 (a build before it, which benchmarks
// such as bench/lowbit_shapes.py --compare alternate with this one) still loads, for float32 scales only
// 3: lowbit_q8_rows and quantize_rows appended at the end (int8 prompt rows); a library of version 2 or 1 still
// loads, without them
// 4: lowbit_matmul_prompt appended at the end (prompt rows' arithmetic where it differs from generated rows'); a
// library of version 3, 2 or 1 still loads, and its lowbit_matmul serves prompt rows too
#define MINDIE_HOST_KERNELS_ABI 4

extern "C" {

typedef void (*mh_body)(void* ctx, int64_t begin, int64_t end);

// What the host gives the kernels: a parallel loop over [begin, end) in chunks of at least grain, on torch's pool,
// and the number of threads it has.
struct mh_runtime {
  void (*parallel_for)(int64_t begin, int64_t end, int64_t grain, mh_body body, void* ctx);
  int64_t (*num_threads)();
};

// One variant's kernels. Pointers are to contiguous arrays; the binding has checked every shape.
struct mh_kernels {
  int abi;              // MINDIE_HOST_KERNELS_ABI
  const char* variant;  // "portable", "avx2" or "avx512"
  void (*set_runtime)(const mh_runtime* runtime);

  // x[T, n] += residual (when not null), out[T, n] = RMSNorm(x) * weight
  void (*add_rms_norm)(float* x, const float* residual, const float* weight, float* out, int64_t T, int64_t n,
                       float eps);
  // rotate-half rotary embedding of q rows (q_stride floats apart, H heads of D) and k rows into contiguous qo, ko
  void (*rope)(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* cos, const float* sin,
               float* qo, float* ko, int64_t T, int64_t H, int64_t KV, int64_t D);

  // one query token per sequence over a slot-major cache [S, KV, D] (kv_bf16: bfloat16 bits, else float32)
  void (*decode_attention)(const float* q, const void* k, const void* v, int kv_bf16, const int64_t* slots,
                           const int64_t* ctx_lens, float* out, int64_t B, int64_t H, int64_t KV, int64_t D,
                           int64_t max_ctx, float scale);
  // the n newest tokens of one sequence over its ctx cached tokens, causally
  void (*prompt_attention)(const float* q, const void* k, const void* v, int kv_bf16, const int64_t* slots, int64_t n,
                           int64_t ctx, float* out, int64_t H, int64_t KV, int64_t D, float scale);

  // the activations lowbit_matmul takes: 0 float32, 1 bfloat16 (bits)
  int lowbit_activation;
  // out[M, N] = x[M, K] @ W.T, W in tiles of 32 output columns (see lowbit_matmul.cpp)
  void (*lowbit_matmul)(const void* x, int64_t M, int64_t K, const uint8_t* codes, int int4, int64_t NT,
                        const float* scale, const float* offset, int64_t N, int64_t group_size, float* out);
  // silu(gate) * up from bfloat16 [M, 2I] to bfloat16 [M, I] (bits), float32 arithmetic and one rounding
  void (*silu_mul)(const uint16_t* gate_up, uint16_t* out, int64_t M, int64_t I);

  // (version 2) lowbit_matmul with the group scales and offsets as float16 bits, converted exactly in the kernel
  void (*lowbit_matmul_f16)(const void* x, int64_t M, int64_t K, const uint8_t* codes, int int4, int64_t NT,
                            const uint16_t* scale, const uint16_t* offset, int64_t N, int64_t group_size, float* out);

  // (version 3) out[M, N] = int8 rows (xq [M, K], per row and group of 32 inputs a float32 scale xscale [M, K/32]
  // and the codes' sum xqsum [M, K/32]) times the same tiles, with integer dot products per group (see
  // lowbit_q8_rows.cpp); scale and offset float32 or, with half_scales, float16 bits; offset null when derived
  void (*lowbit_q8_rows)(const int8_t* xq, const float* xscale, const int32_t* xqsum, int64_t M, int64_t K,
                         const uint8_t* codes, int int4, int64_t NT, const void* scale, const void* offset,
                         int half_scales, int64_t N, int64_t group_size, float* out);
  // (version 3) x [M, K] float32 as the int8 rows lowbit_q8_rows takes, per row and group of 32: scale = max|x| / 127,
  // q = round-half-even(x * (1 / scale)) (0 where the scale is 0) and the codes' sum, as cpu_matmul.quantize_rows
  void (*quantize_rows)(const float* x, int64_t M, int64_t K, int8_t* q, float* scale, int32_t* qsum);

  // (version 4) lowbit_matmul for rows that are prompt tokens (scale and offset float32 or, with half_scales,
  // float16 bits; offset null when derived): the same product, by the arithmetic the variant gives prompt rows (see
  // lowbit_matmul.cpp; on avx2, neon and portable a 4-bit matrix with derived offsets differs by kind of row)
  void (*lowbit_matmul_prompt)(const void* x, int64_t M, int64_t K, const uint8_t* codes, int int4, int64_t NT,
                               const void* scale, const void* offset, int half_scales, int64_t N, int64_t group_size,
                               float* out);
};

// The table of the variant this library was built as.
const mh_kernels* mindie_host_kernels();
}

#ifdef MINDIE_HOST_KERNEL_SOURCE
// For the kernel sources: the host's runtime, and a parallel loop over a lambda.
#include <algorithm>

namespace mh {

extern const mh_runtime* runtime;

inline int64_t num_threads() { return runtime->num_threads(); }

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  runtime->parallel_for(
      begin, end, std::max<int64_t>(1, grain),
      [](void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); },
      const_cast<void*>(static_cast<const void*>(&f)));
}

// bfloat16 bits to float32, and float32 to bfloat16 bits rounded to nearest even (finite values)
inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7F800000u) == 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | ((bits & 0xFFFF) ? 0x40 : 0));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace mh

// Functions each kernel source defines for the table (kernel_table.cpp).
namespace mh {
void add_rms_norm(float* x, const float* residual, const float* weight, float* out, int64_t T, int64_t n, float eps);
void rope(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* cos, const float* sin,
          float* qo, float* ko, int64_t T, int64_t H, int64_t KV, int64_t D);
void decode_attention(const float* q, const void* k, const void* v, int kv_bf16, const int64_t* slots,
                      const int64_t* ctx_lens, float* out, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t max_ctx,
                      float scale);
void prompt_attention(const float* q, const void* k, const void* v, int kv_bf16, const int64_t* slots, int64_t n,
                      int64_t ctx, float* out, int64_t H, int64_t KV, int64_t D, float scale);
extern const int lowbit_activation;
void lowbit_matmul(const void* x, int64_t M, int64_t K, const uint8_t* codes, int int4, int64_t NT, const float* scale,
                   const float* offset, int64_t N, int64_t group_size, float* out);
void lowbit_matmul_f16(const void* x, int64_t M, int64_t K, const uint8_t* codes, int int4, int64_t NT,
                       const uint16_t* scale, const uint16_t* offset, int64_t N, int64_t group_size, float* out);
void lowbit_matmul_prompt(const void* x, int64_t M, int64_t K, const uint8_t* codes, int int4, int64_t NT,
                          const void* scale, const void* offset, int half_scales, int64_t N, int64_t group_size,
                          float* out);
void silu_mul(const uint16_t* gate_up, uint16_t* out, int64_t M, int64_t I);
void lowbit_q8_rows(const int8_t* xq, const float* xscale, const int32_t* xqsum, int64_t M, int64_t K,
                    const uint8_t* codes, int int4, int64_t NT, const void* scale, const void* offset, int half_scales,
                    int64_t N, int64_t group_size, float* out);
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* scale, int32_t* qsum);
}  // namespace mh
#endif
