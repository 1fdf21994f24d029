// The GEMV ops' CPU kernels in C++ (archzoo::dense_gemv, archzoo::quantized_gemv; their schemas and fakes are
// kernels/cpu_decode.py's custom ops), so the dispatcher calls the C kernels beside this file without entering
// Python: ~1.5 µs a call against ~11 µs for the same glue in Python (a `base` decode step makes 85 GEMV calls; its
// compiled bf16 step measured 12.0-12.5 against 13.7-13.9 ms). Built with torch's C++ extension loader at the first
// CPU GEMV (kernels/cpu_decode.py's _glue_registered); the C kernels come from the library kernels/cpu_decode.py
// built, by pointer (archzoo_point_gemvs), so both use one build of them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>

namespace {

using DenseFn = int (*)(const void *, int64_t, int64_t, int64_t, int, const void *, int64_t, const void *, void *,
                        int64_t, int);
using Int8Fn = int (*)(const void *, int64_t, int64_t, int64_t, int, const void *, int64_t, const void *, int, void *,
                       int64_t, int);
using Int4Fn = int (*)(const void *, int64_t, int64_t, int64_t, int, const void *, int64_t, int64_t, const void *,
                       const void *, int, void *, int64_t, int);

struct Kernels {
    DenseFn dense = nullptr;
    Int8Fn int8 = nullptr;
    Int4Fn int4 = nullptr;
};

Kernels &kernels() {  // set once by archzoo_point_gemvs, before the first call
    static Kernels k;
    return k;
}

// a dtype as Python names it, as the Python glue's errors do
std::string dtype_name(at::ScalarType type) {
    switch (type) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kDouble: return "torch.float64";
    default: return c10::toString(type);
    }
}

// kernels/cpu/floats.h's codes
int dtype_code(const at::Tensor &t, const char *what) {
    switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK_VALUE(false, what, " dtype ", dtype_name(t.scalar_type()), " is beyond the CPU kernels "
                               "(torch.float32, torch.bfloat16, torch.float16)");
    }
    return -1;
}

// x [..., K] as rows [M, K] with unit column stride
at::Tensor as_rows(const at::Tensor &x) {
    at::Tensor rows = x.reshape({-1, x.size(-1)});
    return rows.stride(-1) == 1 ? rows : rows.contiguous();
}

at::Tensor shaped(const at::Tensor &out, const at::Tensor &x) {
    auto shape = x.sizes().vec();
    shape.back() = out.size(1);
    return out.view(shape);
}

at::Tensor dense_gemv(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(kernels().dense, "dense_gemv: the C kernels are not pointed to");
    at::Tensor rows = as_rows(x), w = weight.contiguous();
    std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
    int code = dtype_code(x, "x");
    TORCH_CHECK_VALUE(code != 2, "dense_gemv: dtype ", dtype_name(x.scalar_type()), " is beyond the CPU kernel (fp32, "
                      "bf16)");
    at::Tensor out = at::empty({rows.size(0), w.size(0)}, x.options());
    int status = kernels().dense(rows.data_ptr(), rows.size(0), rows.size(1), rows.stride(0), code, w.data_ptr(),
                                 w.size(0), b ? b->data_ptr() : nullptr, out.data_ptr(), out.stride(0),
                                 at::get_num_threads());
    TORCH_CHECK_WITH(OutOfMemoryError, status != -2, "dense_gemv: out of memory for the fp32 copy of x");
    TORCH_CHECK_VALUE(status == 0, "dense_gemv: dtype ", dtype_name(x.scalar_type()), " is beyond the CPU kernel "
                      "(fp32, bf16)");
    return shaped(out, x);
}

at::Tensor quantized_gemv(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scales,
                          const std::optional<at::Tensor> &zeros, int64_t group_size) {
    TORCH_CHECK(kernels().int8 && kernels().int4, "quantized_gemv: the C kernels are not pointed to");
    at::Tensor rows = as_rows(x), w = weight.contiguous(), s = scales.contiguous();
    int x_code = dtype_code(x, "x"), s_code = dtype_code(s, "scales");
    at::Tensor out = at::empty({rows.size(0), w.size(0)}, x.options());
    int status;
    if (group_size == 0) {
        status = kernels().int8(rows.data_ptr(), rows.size(0), rows.size(1), rows.stride(0), x_code, w.data_ptr(),
                                w.size(0), s.data_ptr(), s_code, out.data_ptr(), out.stride(0), at::get_num_threads());
    } else {
        TORCH_CHECK_VALUE(zeros.has_value(), "quantized_gemv: int4 (group_size ", group_size, ") needs zeros");
        at::Tensor z = zeros->to(s.scalar_type()).contiguous();
        status = kernels().int4(rows.data_ptr(), rows.size(0), rows.size(1), rows.stride(0), x_code, w.data_ptr(),
                                w.size(0), group_size, s.data_ptr(), z.data_ptr(), s_code, out.data_ptr(),
                                out.stride(0), at::get_num_threads());
    }
    TORCH_CHECK_WITH(OutOfMemoryError, status != -2, "quantized_gemv: out of memory for the fp32 copy of x");
    TORCH_CHECK_VALUE(status == 0, "quantized_gemv: width ", rows.size(1), " (int4: a multiple of 16) and group ",
                      group_size, " (0 for int8, or a multiple of 32 dividing the width) are beyond the CPU kernels");
    return shaped(out, x);
}

}  // namespace

extern "C" void archzoo_point_gemvs(void *dense, void *int8, void *int4) {
    kernels() = Kernels{reinterpret_cast<DenseFn>(dense), reinterpret_cast<Int8Fn>(int8),
                        reinterpret_cast<Int4Fn>(int4)};
}

TORCH_LIBRARY_IMPL(archzoo, CPU, m) {
    m.impl("dense_gemv", &dense_gemv);
    m.impl("quantized_gemv", &quantized_gemv);
}
