// The torch side of the CPU kernels: one extension, the same for every instruction-set variant.
//
// A variant is a library without torch (kernels.h); Python loads the one this CPU runs and hands its table to a
// Kernels object here, which checks tensors, allocates outputs and calls the table, running the kernels' parallel
// loops on torch's thread pool. activate() makes a Kernels object the one the registered operators
// (mindie_host_cpu::decode_attention, mindie_host_cpu::lowbit_matmul, what compiled graphs call) use.
// Built on first use by mindie_host/backends/cpu_extensions.py (torch.utils.cpp_extension). It includes only the
// headers it uses (not torch/extension.h): half the compile time, which a first start waits for.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>
#include <optional>
#include <string>
#include <thread>

#include "kernels.h"

namespace {

// The kernels' parallel loops: chunks of about a sixteenth of a thread's share, handed out as the threads ask for
// them (one atomic counter), instead of one equal share each cut up front. The server's other processes share the
// cores with the engine's threads: a thread the OS took away for a moment left the other spinning at the loop's end
// (a quarter of the engine's time in libgomp at c=16 on two cores). Small chunks keep the wait at the end short
// (a quarter of a share still left a sixth of an 18-tile product to one thread; bench/PERF.md). Every kernel
// computes each element of its output the same way whatever range it is given, so the results do not depend on the
// chunks.
void parallel_for(int64_t begin, int64_t end, int64_t grain, mh_body body, void* ctx) {
  const int64_t n = end - begin, threads = at::get_num_threads();
  if (threads <= 1 || n <= grain || at::in_parallel_region()) {
    body(ctx, begin, end);
    return;
  }
  const int64_t chunk = std::max<int64_t>(grain, (n + 16 * threads - 1) / (16 * threads));
  std::atomic<int64_t> next{begin};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(chunk); b < end; b = next.fetch_add(chunk)) body(ctx, b, std::min(end, b + chunk));
  });
}

int64_t num_threads() { return at::get_num_threads(); }

const mh_runtime kRuntime = {parallel_for, num_threads};

// One variant's table, loaded from its library by Python (the address of what mindie_host_kernels() returned).
class Kernels {
 public:
  explicit Kernels(uintptr_t address) : k_(reinterpret_cast<const mh_kernels*>(address)) {
    // versions 1 and 2 (builds before lowbit_matmul_f16 / lowbit_q8_rows, for benchmarks that alternate builds)
    // are prefixes of the table
    TORCH_CHECK(k_ != nullptr && k_->abi >= 1 && k_->abi <= MINDIE_HOST_KERNELS_ABI,
                "a kernel library of another interface version");
    k_->set_runtime(&kRuntime);
  }

  std::string variant() const { return k_->variant; }

  // The dtype lowbit_matmul's activations must have.
  bool lowbit_takes_bfloat16() const { return k_->lowbit_activation == 1; }

  // Whether the library has lowbit_q8_rows and quantize_rows (interface version 3 and later).
  bool has_q8_rows() const { return k_->abi >= 3; }

  // Whether the library has lowbit_matmul_prompt (interface version 4 and later).
  bool has_prompt_rows() const { return k_->abi >= 4; }

  at::Tensor add_rms_norm(at::Tensor x, std::optional<at::Tensor> residual, at::Tensor weight,
                             double eps) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [T, n] float32");
    const int64_t T = x.size(0), n = x.size(1);
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == n,
                "weight: [n] float32");
    const float* rp = nullptr;
    if (residual.has_value()) {
      TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->is_contiguous() &&
                      residual->sizes() == x.sizes(), "residual: like x");
      rp = residual->data_ptr<float>();
    }
    auto out = at::empty_like(x);
    k_->add_rms_norm(x.data_ptr<float>(), rp, weight.data_ptr<float>(), out.data_ptr<float>(), T, n,
                     static_cast<float>(eps));
    return out;
  }

  std::vector<at::Tensor> rope(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) const {
    check_heads(q, "q");
    check_heads(k, "k");
    const int64_t T = q.size(0), H = q.size(1), KV = k.size(1), D = q.size(2);
    TORCH_CHECK(k.size(0) == T && k.size(2) == D && D % 2 == 0, "q, k: the same rows and an even head dim");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D, "cos, sin: [T, D] float32");
    auto qo = at::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
    auto ko = at::empty({T, KV, D}, k.options().memory_format(at::MemoryFormat::Contiguous));
    k_->rope(q.data_ptr<float>(), q.stride(0), k.data_ptr<float>(), k.stride(0), cos.data_ptr<float>(),
             sin.data_ptr<float>(), qo.data_ptr<float>(), ko.data_ptr<float>(), T, H, KV, D);
    return {qo, ko};
  }

  at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                                 at::Tensor ctx_lens, double scale) const {
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [B, H, D] float32");
    const bool bf16 = check_caches(k_cache, v_cache);
    TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                    slots.size(0) == q.size(0), "slots: [B, max_ctx] int64");
    TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous() &&
                    ctx_lens.size(0) == q.size(0), "ctx_lens: [B] int64");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(1);
    TORCH_CHECK(k_cache.size(2) == D && KV > 0 && H % KV == 0, "head shapes");
    const int64_t* lens = ctx_lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(lens[b] >= 1 && lens[b] <= slots.size(1), "ctx_lens: from 1 to the slots' width");
    auto out = at::empty_like(q);
    k_->decode_attention(q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), bf16 ? 1 : 0,
                         slots.data_ptr<int64_t>(), lens, out.data_ptr<float>(), B, H, KV, D, slots.size(1),
                         static_cast<float>(scale));
    return out;
  }

  at::Tensor prompt_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                                 double scale) const {
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [n, H, D] float32");
    const bool bf16 = check_caches(k_cache, v_cache);
    TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
                "slots: [ctx] int64");
    const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(1), ctx = slots.size(0);
    TORCH_CHECK(k_cache.size(2) == D && KV > 0 && H % KV == 0 && n >= 1 && n <= ctx, "head shapes");
    TORCH_CHECK(D % 8 == 0, "prompt_attention: a head dim that is a multiple of 8");
    auto out = at::empty_like(q);
    k_->prompt_attention(q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), bf16 ? 1 : 0,
                         slots.data_ptr<int64_t>(), n, ctx, out.data_ptr<float>(), H, KV, D, static_cast<float>(scale));
    return out;
  }

  at::Tensor lowbit_matmul(at::Tensor x, at::Tensor codes, at::Tensor scale, at::Tensor offset,
                              int64_t N, int64_t group_size) const {
    return lowbit_rows(x, codes, scale, offset, N, group_size, false);
  }

  // lowbit_matmul for rows that are prompt tokens (the kernels' own arithmetic for them; a library before interface
  // version 4 has one arithmetic for both kinds of row)
  at::Tensor lowbit_matmul_prompt(at::Tensor x, at::Tensor codes, at::Tensor scale, at::Tensor offset,
                                  int64_t N, int64_t group_size) const {
    return lowbit_rows(x, codes, scale, offset, N, group_size, has_prompt_rows());
  }

  // int8 rows (xq [M, K] int8, xscale [M, K/32] float32, xqsum [M, K/32] int32: cpu_matmul.quantize_rows) times
  // the tiles lowbit_matmul takes, whose group size must be a multiple of 32 -> [M, N] float32
  at::Tensor lowbit_q8_rows(at::Tensor xq, at::Tensor xscale, at::Tensor xqsum, at::Tensor codes, at::Tensor scale,
                            at::Tensor offset, int64_t N, int64_t group_size) const {
    TORCH_CHECK(has_q8_rows(), "lowbit_q8_rows: the ", k_->variant, " kernel library is of interface version ",
                k_->abi, ", before it (3)");
    TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.is_contiguous(), "xq: [M, K] int8");
    const int64_t M = xq.size(0), K = xq.size(1), G = K / 32;
    TORCH_CHECK(K % 32 == 0 && K > 0, "xq: K a multiple of 32");
    TORCH_CHECK(xscale.dim() == 2 && xscale.scalar_type() == at::kFloat && xscale.is_contiguous() &&
                    xscale.size(0) == M && xscale.size(1) == G, "xscale: [M, K/32] float32");
    TORCH_CHECK(xqsum.dim() == 2 && xqsum.scalar_type() == at::kInt && xqsum.is_contiguous() &&
                    xqsum.size(0) == M && xqsum.size(1) == G, "xqsum: [M, K/32] int32");
    // (the group size a multiple of 32: each of the rows' groups lies in one group of the weights)
    const Tiles t = check_tiles(codes, scale, offset, K, N, group_size, 32,
                                "shapes (the weights' group size a multiple of 32)",
                                "scale, offset: [NT, K / group_size, 32] (offset may be empty)");
    auto out = at::empty({M, N}, xscale.options());
    if (M > 0)
      k_->lowbit_q8_rows(xq.data_ptr<int8_t>(), xscale.data_ptr<float>(), xqsum.data_ptr<int32_t>(), M, K,
                         static_cast<const uint8_t*>(codes.data_ptr()), t.int4 ? 1 : 0, t.NT, scale.data_ptr(),
                         t.derived ? nullptr : offset.data_ptr(), t.half ? 1 : 0, N, group_size,
                         out.data_ptr<float>());
    return out;
  }

  // x [M, K] float32 (K a multiple of 32) -> [q [M, K] int8, scale [M, K/32] float32, qsum [M, K/32] int32]: the
  // bits of cpu_matmul.quantize_rows
  std::vector<at::Tensor> quantize_rows(at::Tensor x) const {
    TORCH_CHECK(has_q8_rows(), "quantize_rows: the ", k_->variant, " kernel library is of interface version ",
                k_->abi, ", before it (3)");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % 32 == 0,
                "x: [M, K] float32, K a multiple of 32");
    const int64_t M = x.size(0), K = x.size(1);
    auto q = at::empty({M, K}, x.options().dtype(at::kChar));
    auto scale = at::empty({M, K / 32}, x.options());
    auto qsum = at::empty({M, K / 32}, x.options().dtype(at::kInt));
    if (M > 0 && K > 0)
      k_->quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                        qsum.data_ptr<int32_t>());
    return {q, scale, qsum};
  }

  at::Tensor silu_mul(at::Tensor gate_up) const {
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous() &&
                    gate_up.size(1) % 2 == 0, "gate_up: [M, 2I] bfloat16");
    const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
    auto out = at::empty({M, I}, gate_up.options());
    k_->silu_mul(reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>()),
                 reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), M, I);
    return out;
  }

 private:
  // What check_tiles found out about a product's low-bit tiles.
  struct Tiles {
    bool int4;     // 4-bit codes (uint8 pairs), else int8
    bool half;     // float16 scales (and offsets), else float32
    bool derived;  // no offsets stored: every group's is -8 * scale (4-bit codes) or 0 (8-bit), derived in the kernel
    int64_t NT;    // tiles of 32 output columns
  };

  // The checks lowbit_matmul and lowbit_q8_rows make of the tiles both read (codes [NT, K/2, 32] uint8 or
  // [NT, K/2, 64] int8; scale and offset [NT, K / group_size, 32]) against the activations' K and the outputs' N,
  // in one order; the weights' group size must be a multiple of ``group_multiple``. ``shapes_what`` and
  // ``scales_what`` are the messages of the shape and scale-size checks, which each product words its own way.
  Tiles check_tiles(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset, int64_t K, int64_t N,
                    int64_t group_size, int64_t group_multiple, const char* shapes_what,
                    const char* scales_what) const {
    const bool int4 = codes.scalar_type() == at::kByte;
    TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && (int4 || codes.scalar_type() == at::kChar), "codes");
    TORCH_CHECK(codes.size(2) == (int4 ? 32 : 64), "codes: 32 columns a tile");
    // float32 scales, or the file's float16 ones (the kernel converts them exactly); offsets of the same dtype
    const bool half = scale.scalar_type() == at::kHalf;
    TORCH_CHECK((half || scale.scalar_type() == at::kFloat) &&
                    (offset.numel() == 0 || offset.scalar_type() == scale.scalar_type()) &&
                    scale.is_contiguous() && offset.is_contiguous(), "scale, offset: float32 or float16, alike");
    // (always true for lowbit_q8_rows, which takes interface version 3)
    TORCH_CHECK(!half || k_->abi >= 2, "float16 scales: a kernel library of interface version 2 or later");
    const int64_t NT = codes.size(0), P = codes.size(1);
    TORCH_CHECK(group_size > 0 && group_size % group_multiple == 0 && K == 2 * P && K % group_size == 0 &&
                    NT * 32 >= N && N > 0, shapes_what);
    const int64_t G = K / group_size;
    const bool derived = offset.numel() == 0;
    TORCH_CHECK(scale.numel() == NT * G * 32 && (derived || offset.numel() == NT * G * 32), scales_what);
    return {int4, half, derived, NT};
  }

  static void check_heads(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kFloat && t.stride(2) == 1 && t.stride(1) == t.size(2),
                name, ": [T, heads, D] float32, each row's heads contiguous");
  }

  static bool check_caches(const at::Tensor& k, const at::Tensor& v) {
    TORCH_CHECK(k.dim() == 3 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
                    k.scalar_type() == v.scalar_type(), "caches: [S, KV, D], contiguous, alike");
    TORCH_CHECK(k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat,
                "caches: float32 or bfloat16");
    return k.scalar_type() == at::kBFloat16;
  }

  // lowbit_matmul's checks and call, through lowbit_matmul_prompt for prompt rows
  at::Tensor lowbit_rows(at::Tensor x, at::Tensor codes, at::Tensor scale, at::Tensor offset, int64_t N,
                         int64_t group_size, bool prompt) const {
    const auto act = lowbit_takes_bfloat16() ? at::kBFloat16 : at::kFloat;
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == act && x.is_contiguous(), "x: [M, K] ", act, " for the ",
                k_->variant, " kernels");
    const int64_t M = x.size(0), K = x.size(1);
    const Tiles t = check_tiles(codes, scale, offset, K, N, group_size, 2, "shapes",
                                "scale, offset: [NT, G, 32] (offset may be empty)");
    auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
    if (M > 0 && prompt)
      k_->lowbit_matmul_prompt(x.data_ptr(), M, K, static_cast<const uint8_t*>(codes.data_ptr()), t.int4 ? 1 : 0, t.NT,
                               scale.data_ptr(), t.derived ? nullptr : offset.data_ptr(), t.half ? 1 : 0, N,
                               group_size, out.data_ptr<float>());
    else if (M > 0 && t.half)
      k_->lowbit_matmul_f16(x.data_ptr(), M, K, static_cast<const uint8_t*>(codes.data_ptr()), t.int4 ? 1 : 0, t.NT,
                            static_cast<const uint16_t*>(scale.data_ptr()),
                            t.derived ? nullptr : static_cast<const uint16_t*>(offset.data_ptr()), N, group_size,
                            out.data_ptr<float>());
    else if (M > 0)
      k_->lowbit_matmul(x.data_ptr(), M, K, static_cast<const uint8_t*>(codes.data_ptr()), t.int4 ? 1 : 0, t.NT,
                        scale.data_ptr<float>(), t.derived ? nullptr : offset.data_ptr<float>(), N, group_size,
                        out.data_ptr<float>());
    return out;
  }

  const mh_kernels* k_;
};

// The kernels the registered operators call (set by activate; null until then).
std::atomic<const Kernels*> active{nullptr};

const Kernels& active_kernels() {
  const Kernels* k = active.load();
  TORCH_CHECK(k != nullptr, "no CPU kernels are active");
  return *k;
}

at::Tensor decode_attention_op(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor slots,
                                  at::Tensor ctx_lens, double scale) {
  return active_kernels().decode_attention(q, k, v, slots, ctx_lens, scale);
}

at::Tensor lowbit_matmul_op(at::Tensor x, at::Tensor codes, at::Tensor scale, at::Tensor offset,
                               int64_t n, int64_t group_size) {
  return active_kernels().lowbit_matmul(x, codes, scale, offset, n, group_size);
}

}  // namespace

// As torch operators too, for compiled graphs to call without going through Python.
TORCH_LIBRARY(mindie_host_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor ctx_lens, float scale) -> Tensor");
  m.def("lowbit_matmul(Tensor x, Tensor codes, Tensor scale, Tensor offset, int n, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(mindie_host_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention_op);
  m.impl("lowbit_matmul", &lowbit_matmul_op);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Kernels>(m, "Kernels")
      .def(pybind11::init<uintptr_t>())
      .def_property_readonly("variant", &Kernels::variant)
      .def_property_readonly("lowbit_takes_bfloat16", &Kernels::lowbit_takes_bfloat16)
      .def("add_rms_norm", &Kernels::add_rms_norm)
      .def("rope", &Kernels::rope)
      .def("decode_attention", &Kernels::decode_attention)
      .def("prompt_attention", &Kernels::prompt_attention)
      .def("lowbit_matmul", &Kernels::lowbit_matmul)
      .def_property_readonly("has_prompt_rows", &Kernels::has_prompt_rows)
      .def("lowbit_matmul_prompt", &Kernels::lowbit_matmul_prompt)
      .def("silu_mul", &Kernels::silu_mul)
      .def_property_readonly("has_q8_rows", &Kernels::has_q8_rows)
      .def("lowbit_q8_rows", &Kernels::lowbit_q8_rows)
      .def("quantize_rows", &Kernels::quantize_rows);
  m.def("threads_used", [](int64_t n) {
        // chunks are handed out on demand, so a chunk waits (up to 5 s) until every thread has taken one: a loop
        // this short would otherwise be done by the first thread before the others woke up
        std::pair<std::mutex, std::set<int>> seen;
        parallel_for(0, n, 1, [](void* ctx, int64_t, int64_t) {
          auto* s = static_cast<std::pair<std::mutex, std::set<int>>*>(ctx);
          {
            std::lock_guard<std::mutex> hold(s->first);
            s->second.insert(at::get_thread_num());
          }
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
          while (std::chrono::steady_clock::now() < until) {
            {
              std::lock_guard<std::mutex> hold(s->first);
              if (static_cast<int64_t>(s->second.size()) >= at::get_num_threads()) return;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(100));
          }
        }, &seen);
        return static_cast<int64_t>(seen.second.size());
      }, "How many of torch's threads the kernels' parallel loops run ``n`` one-item chunks on (a check that the "
         "binding was built with the thread pool's OpenMP).");
  m.def("activate", [](const Kernels* k) { active.store(k); }, pybind11::arg("kernels").none(true),
        "Make ``kernels`` (or None) what the registered operators call; the caller keeps it alive.");
}
