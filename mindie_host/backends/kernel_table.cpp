// The table of one variant's kernels (kernels.h), built into each variant library with the kernel sources.
#define MINDIE_HOST_KERNEL_SOURCE 1
#include "kernels.h"
#include "vector_math.h"

namespace mh {
const mh_runtime* runtime = nullptr;
}  // namespace mh

namespace {

void set_runtime(const mh_runtime* runtime) { mh::runtime = runtime; }

const mh_kernels kTable = {
    MINDIE_HOST_KERNELS_ABI, MH_VARIANT,           set_runtime,
    mh::add_rms_norm,        mh::rope,             mh::decode_attention,
    mh::prompt_attention,    mh::lowbit_activation, mh::lowbit_matmul,
    mh::silu_mul,            mh::lowbit_matmul_f16, mh::lowbit_q8_rows,
    mh::quantize_rows,       mh::lowbit_matmul_prompt,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const mh_kernels* mindie_host_kernels() { return &kTable; }
