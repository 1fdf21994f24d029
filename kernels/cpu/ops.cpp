// The hot ops' CPU kernels in C++ (archzoo::dense_gemv, archzoo::quantized_gemv, archzoo::decode_attention; their
// schemas and fakes are kernels/cpu_decode.py's custom ops; archzoo::rms_norm, archzoo::rotary and
// archzoo::swiglu_gemv are kernels/cpu_fused.py's; archzoo::ffn_block, archzoo::attention_block,
// archzoo::mla_block, archzoo::linear_attention_block, archzoo::mamba2_block and archzoo::mamba_block, whole halves
// of a decode block, kernels/cpu_blocks.py's), so the dispatcher calls the C kernels beside this file
// without entering Python: ~1.5 µs a call against ~11 µs for the same glue in Python (a `base` decode step makes 85
// GEMV calls and 12 attention ones; its compiled bf16 step measured 12.0-12.5 against 13.7-13.9 ms with the GEMVs'
// glue alone). Built with torch's C++ extension loader at a hot op's first CPU use (kernels/cpu_decode.py's
// _glue_registered); the C kernels come from the library kernels/cpu_decode.py built, by pointer
// (archzoo_point_kernels), so both use one build of them. Each function mirrors its Python glue there.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ATen.h>
#include <ATen/ops/elu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>

namespace {

using DenseFn = int (*)(const void *, int64_t, int64_t, int64_t, int, const void *, int64_t, const void *, void *,
                        int64_t, int64_t, int);
using RowAheadFn = int64_t (*)(int64_t);
using Int8Fn = int (*)(const void *, int64_t, int64_t, int64_t, int, const void *, int64_t, const void *, int, void *,
                       int64_t, int);
using Int4Fn = int (*)(const void *, int64_t, int64_t, int64_t, int, const void *, int64_t, int64_t, const void *,
                       const void *, int, void *, int64_t, int);
using AttentionFn = int (*)(const void *, int64_t, int64_t, const void *, int64_t, int64_t, int64_t, const void *,
                            int64_t, int64_t, int64_t, const void *, int64_t, int64_t, int64_t, const void *, int64_t,
                            int64_t, int64_t, const int32_t *, int64_t, int64_t, const int32_t *, const int32_t *,
                            int64_t, int64_t, int64_t, int, int, int, int, int, int, float, int, void *, int64_t,
                            int64_t, int, int, int, int64_t, int);
using RmsNormFn = int (*)(const void *, int64_t, int64_t, int64_t, int, const void *, float, void *);
using RotaryFn = int (*)(const void *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t *,
                         int64_t, int64_t, const float *, int, void *);

using AttentionHalfFn = int (*)(const void *, int64_t, int64_t, int, const void *, float, const void *const *,
                                const void *const *, const int *, int64_t, int64_t, int64_t, const int64_t *,
                                const float *, void *, void *, const int64_t *, int64_t, const int64_t *,
                                const int64_t *, const int32_t *, float, int, void *, int64_t, int);

using MlaHalfFn = int (*)(const void *, int64_t, int64_t, int, const void *, float, const void *, const void *,
                          const void *, float, const void *, const void *, const int64_t *, const float *, void *,
                          int64_t, int64_t, int64_t, const int64_t *, const int64_t *, const int32_t *, float, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int, void *, int64_t, int);
using FfnGateUpFn = int (*)(const void *, int64_t, int64_t, int, const void *, float, const void *, const void *,
                            const void *, const void *, const int *, int64_t, void *, void *, const void *, int64_t,
                            int64_t, int);
using GemvResidualFn = int (*)(const void *, int64_t, int64_t, int, const void *, const void *, int, int64_t,
                               const void *, void *, int64_t, int);
using MambaHalfFn = int (*)(const void *, int64_t, int64_t, int, const void *, float, const void *, const void *,
                            const void *, const void *, const void *, const void *, const void *, const void *,
                            const void *, void *, int64_t, int64_t, void *, int64_t, const int64_t *, int64_t,
                            int64_t, int64_t, void *, int64_t, int);
using Mamba2HalfFn = int (*)(const void *, int64_t, int64_t, int, const void *, float, const void *, const void *,
                             const void *, const void *, const void *, const void *, const void *, float, const void *,
                             void *, int64_t, int64_t, void *, int64_t, const int64_t *, int64_t, int64_t, int64_t,
                             int64_t, void *, int64_t, int);

using LinearStepFn = int (*)(const float *, const float *, const float *, float *, int64_t, int64_t, float *, int64_t,
                             int64_t, const int64_t *, int, int, int, int, float, float *, int);


struct Kernels {
    DenseFn dense = nullptr;
    Int8Fn int8 = nullptr;
    Int4Fn int4 = nullptr;
    AttentionFn attention = nullptr;
    RmsNormFn rms_norm = nullptr;
    RotaryFn rotary = nullptr;
    LinearStepFn linear_step = nullptr;
    AttentionHalfFn attention_half = nullptr;
    MlaHalfFn mla_half = nullptr;
    FfnGateUpFn ffn_gate_up = nullptr;
    GemvResidualFn gemv_residual = nullptr;
    MambaHalfFn mamba_half = nullptr;
    Mamba2HalfFn mamba2_half = nullptr;
    RowAheadFn row_ahead = nullptr;
};

Kernels &kernels() {  // set once by archzoo_point_kernels, before the first call
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

// t in `dtype` and contiguous: t itself where it already is, without a call through the dispatcher (a step's halves
// ask ~40 times for the step's own slots, rows, positions and lengths, each already so)
at::Tensor as_dtype(const at::Tensor &t, at::ScalarType dtype) {
    return t.scalar_type() == dtype && t.is_contiguous() ? t : t.to(dtype).contiguous();
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

at::Tensor dense_gemv(int64_t row_ahead, const at::Tensor &x, const at::Tensor &weight,
                      const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(kernels().dense, "dense_gemv: the C kernels are not pointed to");
    at::Tensor rows = as_rows(x), w = weight.contiguous();
    std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
    int code = dtype_code(x, "x");
    TORCH_CHECK_VALUE(code != 2, "dense_gemv: dtype ", dtype_name(x.scalar_type()), " is beyond the CPU kernel (fp32, "
                      "bf16)");
    at::Tensor out = at::empty({rows.size(0), w.size(0)}, x.options());
    int status = kernels().dense(rows.data_ptr(), rows.size(0), rows.size(1), rows.stride(0), code, w.data_ptr(),
                                 w.size(0), b ? b->data_ptr() : nullptr, out.data_ptr(), out.stride(0), row_ahead,
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

// x [..., D] normalised per row (kernels/cpu/norm_rope.c's rms_norm), fp32 or bf16 with weight in x's dtype
at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    TORCH_CHECK(kernels().rms_norm, "rms_norm: the C kernels are not pointed to");
    TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1), "rms_norm: weight ",
                      dtype_name(weight.scalar_type()), " of ", weight.numel(), " must match x's dtype ",
                      dtype_name(x.scalar_type()), " and width ", x.size(-1));
    at::Tensor rows = as_rows(x), w = weight.contiguous();
    at::Tensor out = at::empty(rows.sizes(), x.options());
    int status = kernels().rms_norm(rows.data_ptr(), rows.size(0), rows.size(1), rows.stride(0), dtype_code(x, "x"),
                                    w.data_ptr(), static_cast<float>(eps), out.data_ptr());
    TORCH_CHECK_VALUE(status == 0, "rms_norm: dtype ", dtype_name(x.scalar_type()), " is beyond the CPU kernel (fp32, "
                      "bf16)");
    return out.view(x.sizes());
}

// x [B, H, T, D] rotated at positions [B, T] (kernels/cpu/norm_rope.c's rotary); a contiguous result
at::Tensor rotary(const at::Tensor &x_in, const at::Tensor &positions_in, const at::Tensor &inv_freq_in) {
    TORCH_CHECK(kernels().rotary, "rotary: the C kernels are not pointed to");
    TORCH_CHECK_VALUE(x_in.dim() == 4 && positions_in.dim() == 2 && positions_in.size(0) == x_in.size(0) &&
                      positions_in.size(1) == x_in.size(2) && inv_freq_in.numel() * 2 == x_in.size(3),
                      "rotary: x ", x_in.sizes(), " must be [B, H, T, D] with positions [B, T] and D / 2 frequencies, "
                      "got positions ", positions_in.sizes(), " and ", inv_freq_in.numel(), " frequencies");
    at::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
    at::Tensor positions = positions_in.to(at::kLong), inv_freq = as_dtype(inv_freq_in, at::kFloat);
    at::Tensor out = at::empty(x.sizes(), x.options());
    int status = kernels().rotary(x.data_ptr(), x.size(0), x.size(1), x.size(2), x.size(3), x.stride(0), x.stride(1),
                                  x.stride(2), positions.data_ptr<int64_t>(), positions.stride(0),
                                  positions.stride(1), inv_freq.data_ptr<float>(), dtype_code(x, "x"),
                                  out.data_ptr());
    TORCH_CHECK_VALUE(status == 0, "rotary: dtype ", dtype_name(x.scalar_type()), " (fp32, bf16) or head_dim ",
                      x.size(3), " (even, <= 1024) is beyond the CPU kernel");
    return out;
}

// SwiGLU's down(silu(gate x) * up x) on three dense GEMVs, silu and the product in x's dtype as F.silu and * do
at::Tensor swiglu_gemv(int64_t row_ahead, const at::Tensor &x, const at::Tensor &gate, const at::Tensor &up,
                       const at::Tensor &down) {
    at::Tensor hidden = dense_gemv(row_ahead, x, gate, std::nullopt);
    at::silu_(hidden);
    hidden.mul_(dense_gemv(row_ahead, x, up, std::nullopt));
    return dense_gemv(row_ahead, hidden, down, std::nullopt);
}

// (block or slot, position, head) element strides of a cache tensor in its layout
struct Strides {
    int64_t block, pos, head;
};

Strides strides_of(const at::Tensor &x, bool blocks) {
    return blocks ? Strides{x.stride(0), x.stride(1), x.stride(2)} : Strides{x.stride(0), x.stride(2), x.stride(1)};
}

constexpr int64_t MIN_KEYS_PER_SPLIT = 128;  // kernels/cpu_decode.py's _MIN_KEYS_PER_SPLIT

// decode attention's key splits: enough to keep every thread busy over `tasks` (sequence, KV heads) tasks, none
// shorter than MIN_KEYS_PER_SPLIT of max_keys
int64_t key_splits(int64_t tasks, int64_t max_keys, int threads) {
    int64_t wanted = (4 * threads + tasks - 1) / tasks;
    return std::max<int64_t>(1, std::min(wanted, (max_keys + MIN_KEYS_PER_SPLIT - 1) / MIN_KEYS_PER_SPLIT));
}

// each sequence's slot, its new row (where the step writes one) and its length within a contiguous cache of
// `slots` slots and `rows` rows, checked before anything is written or read
void check_cache_rows(const char *what, const int64_t *slot, const int64_t *row, const int32_t *length, int64_t batch,
                      int64_t slots, int64_t rows, bool writes) {
    for (int64_t i = 0; i < batch; i++)
        TORCH_CHECK_INDEX(slot[i] >= 0 && slot[i] < slots && length[i] >= 1 && length[i] <= rows &&
                          (!writes || (row[i] >= 0 && row[i] < rows)),
                          what, ": slot ", slot[i], ", row ", row[i], " and length ", length[i],
                          " must lie in the cache's ", slots, " slots and ", rows, " rows");
}

at::Tensor int32_rows(const at::Tensor &t) { return as_dtype(t, at::kInt); }

at::Tensor decode_attention(const at::Tensor &q_in, const at::Tensor &k, const std::optional<at::Tensor> &v,
                            const at::Tensor &table_in, const at::Tensor &seq_lens_in, c10::string_view layout,
                            double scale, int64_t value_dim, const std::optional<at::Tensor> &starts_in, int64_t sinks,
                            int64_t max_keys, int64_t splits, const std::optional<at::Tensor> &k_scales,
                            const std::optional<at::Tensor> &v_scales, int64_t stride, int64_t ring) {
    TORCH_CHECK(kernels().attention, "decode_attention: the C kernel is not pointed to");
    bool blocks = layout == "blocks";
    TORCH_CHECK_VALUE(blocks || layout == "rows", "unknown cache layout '", std::string(layout),
                      "'; allowed: blocks, rows");
    at::Tensor q = q_in.contiguous(), table = int32_rows(table_in), seq_lens = int32_rows(seq_lens_in);
    std::optional<at::Tensor> starts = starts_in ? std::optional<at::Tensor>(int32_rows(*starts_in)) : std::nullopt;
    int64_t batch = q.size(0), heads = q.size(1), dim_k = q.size(2);
    int64_t kv_heads = blocks ? k.size(2) : k.size(1), block_size = blocks ? k.size(1) : k.size(2);
    const at::Tensor &values = v ? *v : k;
    const std::optional<at::Tensor> &value_scales = v ? v_scales : k_scales;
    at::Tensor out = at::empty({batch, heads, value_dim}, q.options());
    Strides ks = strides_of(k, blocks), vs = strides_of(values, blocks), none{0, 0, 0};
    Strides kss = k_scales ? strides_of(*k_scales, blocks) : none, vss = value_scales ? strides_of(*value_scales, blocks)
                                                                                     : none;
    // a latent row's two scales: the first over its value_dim latent columns, the second over the rest
    bool two_scales = k_scales && k_scales->size(-1) == 2;
    int threads = at::get_num_threads();
    // a paged task reads all KV heads of its blocks; a contiguous cache streams one KV head per task
    int64_t kv_per_task = blocks ? kv_heads : 1, span = table.size(1) * block_size;
    max_keys = max_keys <= 0 ? span : std::min(max_keys, span);
    if (splits == 0) splits = key_splits(batch * kv_heads / kv_per_task, max_keys, threads);
    int status = kernels().attention(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), ks.block, ks.pos, ks.head, values.data_ptr(), vs.block,
        vs.pos, vs.head, k_scales ? k_scales->data_ptr() : nullptr, kss.block, kss.pos, kss.head,
        value_scales ? value_scales->data_ptr() : nullptr, vss.block, vss.pos, vss.head,
        table.data_ptr<int32_t>(), table.stride(0), block_size, seq_lens.data_ptr<int32_t>(),
        starts ? starts->data_ptr<int32_t>() : nullptr, sinks, stride, ring, batch, heads, kv_heads, kv_per_task,
        dim_k, value_dim, static_cast<float>(scale), splits, out.data_ptr(), out.stride(0), out.stride(1),
        dtype_code(q, "q"), threads, k.scalar_type() == at::kFloat8_e4m3fn, two_scales ? k_scales->stride(-1) : 0,
        two_scales ? value_dim : dim_k);
    TORCH_CHECK_VALUE(status == 0, "decode_attention: sizes beyond the CPU kernel (query heads per KV head ",
                      heads / kv_heads, " <= 128, dims ", dim_k, ", ", value_dim, " <= 1024; stride ", stride,
                      " >= 1 and 1 with sinks ", sinks, ", ring ", ring, " >= 0)");
    return out;
}

// What decode_blocks tells each half of its step: how far ahead its GEMVs prefetch (kernels/cpu/dense_gemv.c's
// row_prefetch_bytes) and where it may write what it would otherwise allocate: a plan's buffers, the same every step
// (zoo/decode_plan.py). A fresh at::empty for each half's output and hidden rows, 34 a `small` gqa step, took 6-7%
// of a `small` step (batch 1: gqa 3.23 against 3.00 ms, mamba2 4.38 against 4.14; twelve alternating rounds in one
// process, 2-core Xeon): allocations between weight streams that have evicted the allocator's and the dispatcher's
// data. Undefined: a fresh tensor, as an op called on its own gets.
struct Step {
    int64_t row_ahead;
    at::Tensor out;           // x after the half [B, 1, D]; never the last half's, which the step returns
    at::Tensor gated, upped;  // the feed-forward's hidden rows [B, hidden]
};

// whether two tensors' bytes (from the first element's to the last's) share an address
bool overlap(const at::Tensor &a, const at::Tensor &b) {
    if (!a.numel() || !b.numel()) return false;
    auto start = [](const at::Tensor &t) { return static_cast<const char *>(t.data_ptr()); };
    auto end = [&](const at::Tensor &t) {
        int64_t last = 0;
        for (int64_t d = 0; d < t.dim(); d++) last += (t.size(d) - 1) * t.stride(d);
        return start(t) + (last + 1) * t.element_size();
    };
    return start(a) < end(b) && start(b) < end(a);
}

// `buffer` where it has the sizes and dtype asked for, else a fresh tensor
at::Tensor buffer_or_empty(const at::Tensor &buffer, at::IntArrayRef sizes, const at::TensorOptions &options) {
    if (buffer.defined() && buffer.sizes() == sizes && buffer.dtype() == options.dtype() && buffer.is_contiguous())
        return buffer;
    return at::empty(sizes, options);
}

// x + SwiGLU(RMSNorm(x)): a block's feed-forward half of a decode step in one call (kernels/cpu_blocks.py), on
// kernels/cpu/ffn_half.c's two parallel regions around torch's silu and product. A projection with scales is int8
// (zoo/quantize.py's), read as the int8 GEMV reads it in its own forward
at::Tensor ffn_block(const Step &step, const at::Tensor &x, const at::Tensor &norm, double eps,
                     const at::Tensor &gate, const at::Tensor &up, const at::Tensor &down,
                     const std::optional<at::Tensor> &gate_scales, const std::optional<at::Tensor> &up_scales,
                     const std::optional<at::Tensor> &down_scales) {
    TORCH_CHECK(kernels().ffn_gate_up && kernels().gemv_residual, "ffn_block: the C kernels are not pointed to");
    int64_t width = x.size(-1), hidden = gate.size(0), rows = x.numel() / std::max<int64_t>(width, 1);
    const std::optional<at::Tensor> *scales[] = {&gate_scales, &up_scales, &down_scales};
    const at::Tensor *weights[] = {&gate, &up, &down};
    for (int i = 0; i < 3; i++)  // an int8 weight comes with its scales; a float one is in x's dtype
        TORCH_CHECK_VALUE(weights[i]->scalar_type() == (*scales[i] ? at::kChar : x.scalar_type()), "a block's "
                          "projection: a weight in x's dtype ", dtype_name(x.scalar_type()), " or int8 with scales, "
                          "got ", dtype_name(weights[i]->scalar_type()),
                          *scales[i] ? " with scales" : " without scales");
    TORCH_CHECK_VALUE(norm.scalar_type() == x.scalar_type() && norm.numel() == width && gate.dim() == 2 &&
                      gate.size(1) == width && up.sizes() == gate.sizes() && down.dim() == 2 &&
                      down.size(0) == width && down.size(1) == hidden,
                      "ffn_block: norm ", norm.sizes(), " in x's dtype and gate ", gate.sizes(), ", up ", up.sizes(),
                      ", down ", down.sizes(), " must match x's width ", width);
    at::Tensor xs = x.contiguous(), h_norm = norm.contiguous(), ws[3], ss[3];
    int s_codes[3];
    for (int i = 0; i < 3; i++) {
        ws[i] = weights[i]->contiguous();
        ss[i] = *scales[i] ? (*scales[i])->contiguous() : at::Tensor();
        s_codes[i] = ss[i].defined() ? dtype_code(ss[i], "scales") : 0;
    }
    auto scale_ptr = [&](int i) { return ss[i].defined() ? ss[i].data_ptr() : nullptr; };
    int code = dtype_code(x, "x"), threads = at::get_num_threads();
    at::Tensor gated = buffer_or_empty(step.gated, {rows, hidden}, x.options());
    at::Tensor upped = buffer_or_empty(step.upped, {rows, hidden}, x.options());
    int status = kernels().ffn_gate_up(xs.data_ptr(), rows, width, code, h_norm.data_ptr(), static_cast<float>(eps),
                                       ws[0].data_ptr(), scale_ptr(0), ws[1].data_ptr(), scale_ptr(1), s_codes,
                                       hidden, gated.data_ptr(), upped.data_ptr(), ws[2].data_ptr(),
                                       hidden * ws[2].element_size(), step.row_ahead, threads);
    at::silu_(gated);  // torch's silu, so the rounding is the module's
    gated.mul_(upped);
    at::Tensor out = buffer_or_empty(step.out, xs.sizes(), xs.options());
    if (status == 0)
        status = kernels().gemv_residual(gated.data_ptr(), rows, hidden, code, ws[2].data_ptr(), scale_ptr(2),
                                         s_codes[2], width, xs.data_ptr(), out.data_ptr(), step.row_ahead, threads);
    TORCH_CHECK_WITH(OutOfMemoryError, status != -2, "ffn_block: out of memory for its workspace");
    TORCH_CHECK_VALUE(status == 0, "ffn_block: dtype ", dtype_name(x.scalar_type()), " is beyond the CPU kernels "
                      "(fp32, bf16)");
    return out;
}

// x [B, 1, D] + o(attention) after RMSNorm: q, k, v GEMVs, rotary q and k, this step's keys and values written at
// (slots, rows) of a contiguous cache [slots, kv_heads, rows, head_dim] (no wk, wv: a layer that reads another's
// cache), and decode attention over each sequence's first `lengths` rows: an attention layer's half of a decode
// block in one call (kernels/cpu_blocks.py), in one parallel region (kernels/cpu/attention_half.c)
at::Tensor attention_block(const Step &step, const at::Tensor &x, const at::Tensor &norm, double eps,
                           const at::Tensor &wq,
                           const std::optional<at::Tensor> &wk, const std::optional<at::Tensor> &wv,
                           const at::Tensor &wo, const at::Tensor &positions, const at::Tensor &inv_freq,
                           at::Tensor k_cache, at::Tensor v_cache, const at::Tensor &slots_in,
                           const at::Tensor &rows_in, const at::Tensor &lengths, double scale,
                           const std::optional<at::Tensor> &wq_scales, const std::optional<at::Tensor> &wk_scales,
                           const std::optional<at::Tensor> &wv_scales, const std::optional<at::Tensor> &wo_scales) {
    int64_t batch = x.size(0), kv_heads = k_cache.size(1), head_dim = k_cache.size(3);
    int64_t heads = wq.size(0) / head_dim;
    TORCH_CHECK_VALUE(x.dim() == 3 && x.size(1) == 1 && wq.size(0) == heads * head_dim &&
                      wk.has_value() == wv.has_value() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                      k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && slots_in.numel() == batch &&
                      rows_in.numel() == batch,
                      "attention_block: x ", x.sizes(), " must be [B, 1, D] with caches [slots, kv_heads, rows, dim] ",
                      k_cache.sizes(), ", ", v_cache.sizes(), " (last dim contiguous), q rows ", wq.size(0),
                      " a multiple of the head dim, and B slots and rows");
    for (const at::Tensor *t : std::initializer_list<const at::Tensor *>{&k_cache, &v_cache})
        TORCH_CHECK_VALUE(t->scalar_type() == x.scalar_type(), "attention_block: caches in x's dtype ",
                          dtype_name(x.scalar_type()), ", got ", dtype_name(t->scalar_type()));
    const std::optional<at::Tensor> *scales[] = {&wq_scales, &wk_scales, &wv_scales, &wo_scales};
    const at::Tensor *weights[] = {&wq, wk ? &*wk : nullptr, wv ? &*wv : nullptr, &wo};
    for (int i = 0; i < 4; i++)  // an int8 weight comes with its scales; a float one is in x's dtype
        TORCH_CHECK_VALUE(!weights[i] || weights[i]->scalar_type() == (*scales[i] ? at::kChar : x.scalar_type()),
                          "attention_block: weights in x's dtype ", dtype_name(x.scalar_type()),
                          " or int8 with scales, got ", dtype_name(weights[i]->scalar_type()));
    TORCH_CHECK(kernels().attention_half, "attention_block: the C kernels are not pointed to");
    at::Tensor slots = as_dtype(slots_in, at::kLong), rows = as_dtype(rows_in, at::kLong);
    const int64_t *slot = slots.data_ptr<int64_t>(), *row = rows.data_ptr<int64_t>();
    at::Tensor xs = x.contiguous(), h_norm = norm.contiguous(), positions_rows = as_dtype(positions, at::kLong);
    at::Tensor freqs = as_dtype(inv_freq, at::kFloat), seq_lens = int32_rows(lengths);
    int64_t width = x.size(2), q_width = heads * head_dim, kv_width = kv_heads * head_dim;
    TORCH_CHECK_VALUE(h_norm.scalar_type() == x.scalar_type() && h_norm.numel() == width && wq.size(1) == width &&
                      (!wk || (wk->sizes() == wv->sizes() && wk->size(0) == kv_width && wk->size(1) == width)) &&
                      wo.size(0) == width && wo.size(1) == q_width && positions_rows.numel() == batch &&
                      freqs.numel() * 2 == head_dim && seq_lens.numel() == batch,
                      "attention_block: norm ", h_norm.sizes(), " and projections q ", wq.sizes(), ", k ",
                      wk ? wk->sizes() : at::IntArrayRef{}, ", v ", wv ? wv->sizes() : at::IntArrayRef{}, ", o ",
                      wo.sizes(), " must match width ", width, ", ", heads, " and ", kv_heads, " heads of ", head_dim,
                      ", with positions ", positions.sizes(), " and lengths ", lengths.sizes(), " one a sequence and ",
                      freqs.numel(), " frequencies half the head dim");
    const int32_t *length = seq_lens.data_ptr<int32_t>();
    check_cache_rows("attention_block", slot, row, length, batch, k_cache.size(0), k_cache.size(2), wk.has_value());
    at::Tensor ws[4], ss[4];
    const void *weight_ptrs[4], *scale_ptrs[4];
    int s_codes[4];
    for (int i = 0; i < 4; i++) {
        ws[i] = weights[i] ? weights[i]->contiguous() : at::Tensor();
        ss[i] = *scales[i] ? (*scales[i])->contiguous() : at::Tensor();
        weight_ptrs[i] = ws[i].defined() ? ws[i].data_ptr() : nullptr;
        scale_ptrs[i] = ss[i].defined() ? ss[i].data_ptr() : nullptr;
        s_codes[i] = ss[i].defined() ? dtype_code(ss[i], "scales") : 0;
    }
    int threads = at::get_num_threads();
    int64_t rows_held = k_cache.size(2), splits = key_splits(batch * kv_heads, rows_held, threads);
    int64_t strides[6] = {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                          v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
    at::Tensor out = buffer_or_empty(step.out, xs.sizes(), xs.options());
    int status = kernels().attention_half(
        xs.data_ptr(), batch, width, dtype_code(x, "x"), h_norm.data_ptr(), static_cast<float>(eps),
        weight_ptrs, scale_ptrs, s_codes, heads, kv_heads, head_dim, positions_rows.data_ptr<int64_t>(),
        freqs.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), strides, rows_held, slot, row,
        length, static_cast<float>(scale), static_cast<int>(splits), out.data_ptr(), step.row_ahead, threads);
    TORCH_CHECK_WITH(OutOfMemoryError, status != -2, "attention_block: out of memory for its workspace");
    TORCH_CHECK_VALUE(status == 0, "attention_block: sizes beyond the CPU kernels (dtype ",
                      dtype_name(x.scalar_type()), ": fp32 or bf16; head dim ", head_dim, " even and <= 1024; query "
                      "heads per KV head ", heads / kv_heads, " <= 128)");
    return out;
}

// x [B, 1, D] + o(linear attention) after RMSNorm: q, k, v GEMVs, the elu + 1 feature map on q and k (torch's own
// ops, so its roundings are the module's), and one recurrent step on the fp32 state cache rows of `slots` in place
// (kv [slots, H, dk, dv], normalizer [slots, H, dk]; kernels/cpu/linear_attention_step.c): a linear attention
// layer's half of a decode block in one call (kernels/cpu_blocks.py)
at::Tensor linear_attention_block(const Step &step, const at::Tensor &x, const at::Tensor &norm, double eps,
                                  const at::Tensor &wq,
                                  const at::Tensor &wk, const at::Tensor &wv, const at::Tensor &wo, at::Tensor kv,
                                  at::Tensor normalizer, const at::Tensor &slots_in, double attention_eps) {
    TORCH_CHECK(kernels().linear_step, "linear_attention_block: the C kernels are not pointed to");
    int64_t batch = x.size(0), heads = kv.size(1), dk = kv.size(2), dv = kv.size(3);
    TORCH_CHECK_VALUE(x.dim() == 3 && x.size(1) == 1 && kv.scalar_type() == at::kFloat &&
                      normalizer.scalar_type() == at::kFloat && kv.dim() == 4 && normalizer.dim() == 3 &&
                      normalizer.size(1) == heads && normalizer.size(2) == dk && kv.stride(3) == 1 &&
                      kv.stride(2) == dv && normalizer.stride(2) == 1 && wq.size(0) == heads * dk &&
                      wk.size(0) == heads * dk && wv.size(0) == heads * dv && slots_in.numel() == batch,
                      "linear_attention_block: x ", x.sizes(), " must be [B, 1, D], the fp32 states ",
                      "[slots, H, dk, dv] ", kv.sizes(), " (rows contiguous) and [slots, H, dk] ", normalizer.sizes(),
                      ", q and k ", heads, " x ", dk, " rows, v ", heads, " x ", dv, ", and B slots");
    at::Tensor slots = as_dtype(slots_in, at::kLong);
    auto slot = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < batch; i++)
        TORCH_CHECK_INDEX(slot[i] >= 0 && slot[i] < kv.size(0) && slot[i] < normalizer.size(0),
                          "linear_attention_block: slot ", slot[i], " must lie in the cache's ", kv.size(0), " slots");
    at::Tensor h = rms_norm(x, norm, eps);
    auto features = [&](const at::Tensor &w) {  // elu + 1 in x's dtype, as the module's feature map, then fp32
        return at::elu(dense_gemv(step.row_ahead, h, w, std::nullopt)).add_(1).to(at::kFloat).contiguous();
    };
    at::Tensor q = features(wq), k = features(wk);
    at::Tensor v = dense_gemv(step.row_ahead, h, wv, std::nullopt).to(at::kFloat).contiguous();
    at::Tensor out = at::empty({batch, heads * dv}, x.options().dtype(at::kFloat));
    int status = kernels().linear_step(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                                       kv.data_ptr<float>(), kv.stride(0), kv.stride(1), normalizer.data_ptr<float>(),
                                       normalizer.stride(0), normalizer.stride(1), slot, static_cast<int>(batch),
                                       static_cast<int>(heads), static_cast<int>(dk), static_cast<int>(dv),
                                       static_cast<float>(attention_eps), out.data_ptr<float>(), at::get_num_threads());
    TORCH_CHECK_VALUE(status == 0, "linear_attention_block: value width ", dv, " is beyond the CPU kernel (<= 4096)");
    return dense_gemv(step.row_ahead, out.to(x.scalar_type()).view({batch, 1, heads * dv}), wo, std::nullopt).add_(x);
}

// each slot within the cache's rows, checked before anything is written
const int64_t *checked_slots(const at::Tensor &slots, int64_t rows, const char *what) {
    auto slot = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < slots.numel(); i++)
        TORCH_CHECK_INDEX(slot[i] >= 0 && slot[i] < rows, what, ": slot ", slot[i], " must lie in the cache's ", rows,
                          " slots");
    return slot;
}

// x [B, 1, D] + o(MLA's absorbed decode attention) after RMSNorm (attention/mla.py's decode step): q and
// the latent's GEMVs, the latent's RMSNorm, rotary on the rotary parts, this step's latent row written at (slots,
// rows) of a contiguous latent cache [slots, 1, rows, rank + rope], the query folded through W_UK, decode attention
// over each sequence's first `lengths` rows with the latent as values, W_UV, o. An MLA layer's half of a decode
// block in one call (kernels/cpu_blocks.py), in one parallel region (kernels/cpu/mla_half.c)
at::Tensor mla_block(const Step &step, const at::Tensor &x, const at::Tensor &norm, double eps,
                     const at::Tensor &wq,
                     const at::Tensor &wkv_a, const at::Tensor &kv_norm, double kv_eps, const at::Tensor &wkv_b,
                     const at::Tensor &wo, const at::Tensor &positions, const at::Tensor &inv_freq, at::Tensor cache,
                     const at::Tensor &slots_in, const at::Tensor &rows_in, const at::Tensor &lengths, double scale,
                     int64_t heads, int64_t nope, int64_t v_dim) {
    int64_t batch = x.size(0), width = cache.size(3), rank = kv_norm.size(0), rope = width - rank;
    TORCH_CHECK_VALUE(x.dim() == 3 && x.size(1) == 1 && cache.dim() == 4 && cache.size(1) == 1 &&
                      cache.stride(3) == 1 && rope > 0 && wq.size(0) == heads * (nope + rope) &&
                      wkv_a.size(0) == width && wkv_b.size(0) == heads * (nope + v_dim) && wkv_b.size(1) == rank &&
                      slots_in.numel() == batch && rows_in.numel() == batch && cache.scalar_type() == x.scalar_type(),
                      "mla_block: x ", x.sizes(), " must be [B, 1, D] with a latent cache ",
                      "[slots, 1, rows, rank + rope] ", cache.sizes(), " in x's dtype, q rows ", wq.size(0),
                      ", kv_a rows ", wkv_a.size(0), ", kv_b ", wkv_b.sizes(), " and B slots and rows");
    TORCH_CHECK(kernels().mla_half, "mla_block: the C kernels are not pointed to");
    int64_t d_model = x.size(2);
    for (const at::Tensor *t : {&norm, &wq, &wkv_a, &kv_norm, &wkv_b, &wo})
        TORCH_CHECK_VALUE(t->scalar_type() == x.scalar_type(), "mla_block: weights in x's dtype ",
                          dtype_name(x.scalar_type()), ", got ", dtype_name(t->scalar_type()));
    TORCH_CHECK_VALUE(norm.numel() == d_model && wq.size(1) == d_model && wkv_a.size(1) == d_model &&
                      wo.size(0) == d_model && wo.size(1) == heads * v_dim && positions.numel() == batch &&
                      inv_freq.numel() * 2 == rope && lengths.numel() == batch,
                      "mla_block: norm ", norm.sizes(), ", q ", wq.sizes(), ", kv_a ", wkv_a.sizes(), " and o ",
                      wo.sizes(), " must match width ", d_model, " and ", heads, " heads of ", v_dim,
                      ", with positions ", positions.sizes(), " and lengths ", lengths.sizes(), " one a sequence and ",
                      inv_freq.numel(), " frequencies half the rotary width ", rope);
    at::Tensor slots = as_dtype(slots_in, at::kLong), rows = as_dtype(rows_in, at::kLong);
    at::Tensor seq_lens = int32_rows(lengths);
    const int64_t *slot = slots.data_ptr<int64_t>(), *row = rows.data_ptr<int64_t>();
    const int32_t *length = seq_lens.data_ptr<int32_t>();
    check_cache_rows("mla_block", slot, row, length, batch, cache.size(0), cache.size(2), true);
    at::Tensor xs = x.contiguous(), positions_rows = as_dtype(positions, at::kLong);
    at::Tensor freqs = as_dtype(inv_freq, at::kFloat);
    at::Tensor ws[] = {norm.contiguous(), wq.contiguous(), wkv_a.contiguous(), kv_norm.contiguous(),
                       wkv_b.contiguous(), wo.contiguous()};
    int threads = at::get_num_threads();
    int64_t rows_held = cache.size(2), splits = key_splits(batch, rows_held, threads);  // one KV head
    at::Tensor out = buffer_or_empty(step.out, xs.sizes(), xs.options());
    int status = kernels().mla_half(
        xs.data_ptr(), batch, d_model, dtype_code(x, "x"), ws[0].data_ptr(), static_cast<float>(eps), ws[1].data_ptr(),
        ws[2].data_ptr(), ws[3].data_ptr(), static_cast<float>(kv_eps), ws[4].data_ptr(), ws[5].data_ptr(),
        positions_rows.data_ptr<int64_t>(), freqs.data_ptr<float>(), cache.data_ptr(), cache.stride(0),
        cache.stride(2), rows_held, slot, row, length, static_cast<float>(scale), heads, nope, rope, rank, v_dim,
        static_cast<int>(splits), out.data_ptr(), step.row_ahead, threads);
    TORCH_CHECK_WITH(OutOfMemoryError, status != -2, "mla_block: out of memory for its workspace");
    TORCH_CHECK_VALUE(status == 0, "mla_block: sizes beyond the CPU kernels (dtype ", dtype_name(x.scalar_type()),
                      ": fp32 or bf16; rotary width ", rope, " even; rank + rotary ", width, " <= 1024; heads ", heads,
                      " <= 128)");
    return out;
}

// x [B, 1, D] + out_proj(Mamba-2's decode step) after RMSNorm (ssm/mamba2.py's Mamba2.step): in_proj; the depthwise
// conv's window shifted in the conv state cache rows of `slots` and summed; the selective state update on the SSM
// state cache rows in place; the gated RMSNorm; out_proj. A Mamba-2 layer's half of a decode block in one call
// (kernels/cpu_blocks.py), in one parallel region (kernels/cpu/mamba2_half.c): equal to the module's path to rounding
at::Tensor mamba2_block(const Step &step, const at::Tensor &x, const at::Tensor &norm, double eps,
                        const at::Tensor &in_w,
                        const at::Tensor &conv_w, const std::optional<at::Tensor> &conv_b, const at::Tensor &dt_bias,
                        const at::Tensor &A_log, const at::Tensor &D, const at::Tensor &gate_norm, double gate_eps,
                        const at::Tensor &out_w, at::Tensor conv, at::Tensor ssm, const at::Tensor &slots_in,
                        int64_t groups) {
    TORCH_CHECK(kernels().mamba2_half, "mamba2_block: the C kernels are not pointed to");
    int64_t batch = x.size(0), heads = ssm.size(1), head_dim = ssm.size(2), dstate = ssm.size(3);
    int64_t d_inner = heads * head_dim, conv_dim = conv.size(1), d_conv = conv.size(2);
    TORCH_CHECK_VALUE(x.dim() == 3 && x.size(1) == 1 && ssm.dim() == 4 && conv.dim() == 3 && groups >= 1 &&
                      heads % groups == 0 && conv_dim == d_inner + 2 * groups * dstate &&
                      in_w.size(0) == d_inner + conv_dim + heads && conv_w.size(0) == conv_dim &&
                      conv_w.size(-1) == d_conv && slots_in.numel() == batch && dstate <= 1024 &&
                      conv.scalar_type() == x.scalar_type() && ssm.scalar_type() == x.scalar_type() &&
                      conv.stride(2) == 1 && conv.stride(1) == d_conv && gate_norm.numel() == d_inner &&
                      ssm.stride(3) == 1 && ssm.stride(2) == dstate && ssm.stride(1) == head_dim * dstate &&
                      (!conv_b || conv_b->numel() == conv_dim),
                      "mamba2_block: x ", x.sizes(), " must be [B, 1, D] with conv state [slots, conv_dim, d_conv] ",
                      conv.sizes(), " and SSM state [slots, H, P, N <= 1024] ", ssm.sizes(),
                      " (each slot's contiguous) in x's dtype, ", groups, " groups, in_proj ", in_w.sizes(),
                      " and B slots");
    TORCH_CHECK_VALUE(conv_w.scalar_type() == x.scalar_type() && gate_norm.scalar_type() == x.scalar_type() &&
                      (!conv_b || conv_b->scalar_type() == x.scalar_type()),
                      "mamba2_block: the conv's taps and bias and the gated norm's weight must be in x's dtype ",
                      dtype_name(x.scalar_type()));
    for (const at::Tensor *t : {&norm, &in_w, &dt_bias, &A_log, &D, &out_w})
        TORCH_CHECK_VALUE(t->scalar_type() == x.scalar_type(), "mamba2_block: weights in x's dtype ",
                          dtype_name(x.scalar_type()), ", got ", dtype_name(t->scalar_type()));
    TORCH_CHECK_VALUE(norm.numel() == x.size(2) && in_w.size(1) == x.size(2) && out_w.size(0) == x.size(2) &&
                      out_w.size(1) == d_inner && dt_bias.numel() == heads && A_log.numel() == heads &&
                      D.numel() == heads, "mamba2_block: norm ", norm.sizes(), ", in_proj ", in_w.sizes(),
                      " and out_proj ", out_w.sizes(), " must match width ", x.size(2), " and ", d_inner,
                      " channels, with dt_bias ", dt_bias.sizes(), ", A_log ", A_log.sizes(), " and D ", D.sizes(),
                      " one a head");
    at::Tensor slots = as_dtype(slots_in, at::kLong);
    const int64_t *slot = checked_slots(slots, std::min(conv.size(0), ssm.size(0)), "mamba2_block");
    at::Tensor xs = x.contiguous();
    at::Tensor ws[] = {norm.contiguous(), in_w.contiguous(), conv_w.contiguous(), dt_bias.contiguous(),
                       A_log.contiguous(), D.contiguous(), gate_norm.contiguous(), out_w.contiguous()};
    at::Tensor bias = conv_b ? conv_b->contiguous() : at::Tensor();
    at::Tensor out = buffer_or_empty(step.out, xs.sizes(), xs.options());
    int status = kernels().mamba2_half(
        xs.data_ptr(), batch, x.size(2), dtype_code(x, "x"), ws[0].data_ptr(), static_cast<float>(eps),
        ws[1].data_ptr(), ws[2].data_ptr(), bias.defined() ? bias.data_ptr() : nullptr, ws[3].data_ptr(),
        ws[4].data_ptr(), ws[5].data_ptr(), ws[6].data_ptr(), static_cast<float>(gate_eps), ws[7].data_ptr(),
        conv.data_ptr(), conv.stride(0), d_conv, ssm.data_ptr(), ssm.stride(0), slot, heads, head_dim, dstate,
        groups, out.data_ptr(), step.row_ahead, at::get_num_threads());
    TORCH_CHECK_WITH(OutOfMemoryError, status != -2, "mamba2_block: out of memory for its workspace");
    TORCH_CHECK_VALUE(status == 0, "mamba2_block: dtype ", dtype_name(x.scalar_type()), " is beyond the CPU kernels "
                      "(torch.float32, torch.bfloat16)");
    return out;
}

// x [B, 1, D] + out_proj(Mamba's decode step) after RMSNorm (ssm/mamba.py's Mamba.step): in_proj into x and z; the
// depthwise conv's window shifted in the conv state cache rows of `slots` and summed; x_proj and dt_proj into dt, B
// and C; the selective state update on the SSM state cache rows [slots, d_inner, N] in place, gated by z; out_proj.
// A Mamba layer's half of a decode block in one call (kernels/cpu_blocks.py), in one parallel region
// (kernels/cpu/mamba_half.c): equal to the module's path to rounding
at::Tensor mamba_block(const Step &step, const at::Tensor &x, const at::Tensor &norm, double eps,
                       const at::Tensor &in_w,
                       const at::Tensor &conv_w, const std::optional<at::Tensor> &conv_b, const at::Tensor &x_w,
                       const at::Tensor &dt_w, const at::Tensor &dt_b, const at::Tensor &A_log, const at::Tensor &D,
                       const at::Tensor &out_w, at::Tensor conv, at::Tensor ssm, const at::Tensor &slots_in) {
    TORCH_CHECK(kernels().mamba_half, "mamba_block: the C kernels are not pointed to");
    int64_t batch = x.size(0), d_inner = ssm.size(1), dstate = ssm.size(2), rank = dt_w.size(1);
    TORCH_CHECK_VALUE(x.dim() == 3 && x.size(1) == 1 && ssm.dim() == 3 && conv.dim() == 3 && conv.size(1) == d_inner &&
                      in_w.size(0) == 2 * d_inner && x_w.size(0) == rank + 2 * dstate && dt_w.size(0) == d_inner &&
                      conv_w.size(0) == d_inner && conv_w.size(-1) == conv.size(2) && A_log.size(0) == d_inner &&
                      A_log.size(1) == dstate && slots_in.numel() == batch && dstate <= 1024 &&
                      conv.scalar_type() == x.scalar_type() && ssm.scalar_type() == x.scalar_type() &&
                      conv.stride(2) == 1 && conv.stride(1) == conv.size(2) && ssm.stride(2) == 1 &&
                      ssm.stride(1) == dstate && (!conv_b || conv_b->numel() == d_inner),
                      "mamba_block: x ", x.sizes(), " must be [B, 1, D] with conv state [slots, d_inner, d_conv] ",
                      conv.sizes(), " (each slot's contiguous) and SSM state [slots, d_inner, N <= 1024] ", ssm.sizes(),
                      " (each slot's contiguous) in x's dtype, ",
                      "in_proj ", in_w.sizes(), ", x_proj ", x_w.sizes(), ", dt_proj ", dt_w.sizes(), " and B slots");
    TORCH_CHECK_VALUE(conv_w.scalar_type() == x.scalar_type() && (!conv_b || conv_b->scalar_type() == x.scalar_type()),
                      "mamba_block: the conv's taps and bias must be in x's dtype ", dtype_name(x.scalar_type()));
    for (const at::Tensor *t : {&norm, &in_w, &x_w, &dt_w, &dt_b, &A_log, &D, &out_w})
        TORCH_CHECK_VALUE(t->scalar_type() == x.scalar_type(), "mamba_block: weights in x's dtype ",
                          dtype_name(x.scalar_type()), ", got ", dtype_name(t->scalar_type()));
    int64_t d_model = x.size(2);
    TORCH_CHECK_VALUE(norm.numel() == d_model && in_w.size(1) == d_model && x_w.size(1) == d_inner &&
                      out_w.size(0) == d_model && out_w.size(1) == d_inner && dt_b.numel() == d_inner &&
                      D.numel() == d_inner, "mamba_block: norm ", norm.sizes(), ", in_proj ", in_w.sizes(),
                      ", x_proj ", x_w.sizes(), " and out_proj ", out_w.sizes(), " must match width ", d_model,
                      " and ", d_inner, " channels, with dt_proj's bias ", dt_b.sizes(), " and D ", D.sizes());
    at::Tensor slots = as_dtype(slots_in, at::kLong);
    const int64_t *slot = checked_slots(slots, std::min(conv.size(0), ssm.size(0)), "mamba_block");
    at::Tensor xs = x.contiguous();
    at::Tensor ws[] = {norm.contiguous(), in_w.contiguous(), conv_w.contiguous(), x_w.contiguous(),
                       dt_w.contiguous(), dt_b.contiguous(), A_log.contiguous(), D.contiguous(), out_w.contiguous()};
    at::Tensor bias = conv_b ? conv_b->contiguous() : at::Tensor();
    at::Tensor out = buffer_or_empty(step.out, xs.sizes(), xs.options());
    int status = kernels().mamba_half(
        xs.data_ptr(), batch, d_model, dtype_code(x, "x"), ws[0].data_ptr(), static_cast<float>(eps), ws[1].data_ptr(),
        ws[2].data_ptr(), bias.defined() ? bias.data_ptr() : nullptr, ws[3].data_ptr(), ws[4].data_ptr(),
        ws[5].data_ptr(), ws[6].data_ptr(), ws[7].data_ptr(), ws[8].data_ptr(), conv.data_ptr(), conv.stride(0),
        conv.size(2), ssm.data_ptr(), ssm.stride(0), slot, d_inner, dstate, rank, out.data_ptr(), step.row_ahead,
        at::get_num_threads());
    TORCH_CHECK_WITH(OutOfMemoryError, status != -2, "mamba_block: out of memory for its workspace");
    TORCH_CHECK_VALUE(status == 0, "mamba_block: dtype ", dtype_name(x.scalar_type()), " is beyond the CPU kernels "
                      "(torch.float32, torch.bfloat16)");
    return out;
}

// x after every half of a decode step's blocks, in order (kernels/cpu_blocks.py's decode_blocks: flatten_halves lays
// the halves out, SIZES counts each kind's weights, states, floats and ints as the table below does), each by the
// function its own op calls: one call from Python a step where a block's two ops were two, each with ~15 arguments
// to parse and a module's decisions before it
at::Tensor decode_blocks(const at::Tensor &x_in, const c10::List<std::optional<at::Tensor>> &weights,
                         at::TensorList states, at::ArrayRef<double> floats, at::IntArrayRef ints,
                         const at::Tensor &positions, const at::Tensor &slots, at::TensorList rows,
                         at::TensorList lengths, at::TensorList buffers) {
    static const int64_t sizes[8][4] = {{7, 0, 1, 0}, {10, 2, 2, 0}, {7, 1, 3, 3}, {5, 2, 2, 0}, {9, 2, 2, 1},
                                        {10, 2, 1, 0}, {1, 0, 1, 0}, {2, 0, 0, 0}};
    // ffn, attention, mla, linear_attention, mamba2, mamba; the model's final norm and its head
    TORCH_CHECK_VALUE(rows.size() == lengths.size(), "decode_blocks: ", rows.size(), " row tensors but ",
                      lengths.size(), " lengths");
    TORCH_CHECK_VALUE(buffers.empty() || buffers.size() == 4, "decode_blocks: buffers are none or four (x twice, the "
                      "feed-forward's gated and up rows), got ", buffers.size());
    for (size_t a = 0; a < buffers.size(); a++)  // a half's output written over its input would be wrong
        for (size_t b = a + 1; b < buffers.size(); b++)
            TORCH_CHECK_VALUE(!overlap(buffers[a], buffers[b]), "decode_blocks: buffers ", a, " and ", b, " overlap");
    at::Tensor x = x_in;
    int64_t bytes = 0;  // the weights the step streams: how far ahead its GEMVs prefetch (kernels/cpu/dense_gemv.c)
    for (const std::optional<at::Tensor> &t : weights.vec())
        if (t) bytes += t->nbytes();
    Step step{kernels().row_ahead(bytes)};
    if (!buffers.empty())
        step.gated = buffers[2], step.upped = buffers[3];
    size_t w = 0, s = 0, f = 0, i = 0;
    while (i < ints.size()) {
        TORCH_CHECK_VALUE(i + 2 <= ints.size() && ints[i] >= 0 && ints[i] < 8, "decode_blocks: a half's kind code ",
                          ints[i], " at ints[", i, "] is none of 0-7");
        int64_t kind = ints[i], group = ints[i + 1];
        const int64_t *n = sizes[kind];
        TORCH_CHECK_VALUE(w + n[0] <= weights.size() && s + n[1] <= states.size() && f + n[2] <= floats.size() &&
                          i + 2 + n[3] <= ints.size() && group < static_cast<int64_t>(rows.size()) &&
                          (group >= 0 || kind == 0 || kind >= 3),  // the attending kinds find rows
                          "decode_blocks: the lists end inside half ", i, " (kind ", kind, ", row group ", group, ")");
        auto opt = [&](size_t k) { return weights.get(w + k); };
        auto need = [&](size_t k) {
            std::optional<at::Tensor> t = weights.get(w + k);
            TORCH_CHECK_VALUE(t.has_value(), "decode_blocks: weight ", w + k, " (kind ", kind, ") is None");
            return *t;
        };
        const double *fl = floats.data() + f;
        const int64_t *in = ints.data() + i + 2;
        // x alternates between the two x buffers; the last half's output is fresh: the step returns it
        bool last = i + 2 + static_cast<size_t>(n[3]) == ints.size();
        step.out = buffers.empty() || last ? at::Tensor() : buffers[x.is_same(buffers[0]) ? 1 : 0];
        switch (kind) {
        case 0:
            x = ffn_block(step, x, need(0), fl[0], need(1), need(2), need(3), opt(4), opt(5), opt(6));
            break;
        case 1:
            x = attention_block(step, x, need(0), fl[0], need(1), opt(2), opt(3), need(4), positions, need(5),
                                states[s], states[s + 1], slots, rows[group], lengths[group], fl[1], opt(6), opt(7),
                                opt(8), opt(9));
            break;
        case 2:
            x = mla_block(step, x, need(0), fl[0], need(1), need(2), need(3), fl[1], need(4), need(5), positions,
                          need(6), states[s], slots, rows[group], lengths[group], fl[2], in[0], in[1], in[2]);
            break;
        case 3:
            x = linear_attention_block(step, x, need(0), fl[0], need(1), need(2), need(3), need(4), states[s],
                                       states[s + 1], slots, fl[1]);
            break;
        case 4:
            x = mamba2_block(step, x, need(0), fl[0], need(1), need(2), opt(3), need(4), need(5), need(6), need(7),
                             fl[1], need(8), states[s], states[s + 1], slots, in[0]);
            break;
        case 5:
            x = mamba_block(step, x, need(0), fl[0], need(1), need(2), opt(3), need(4), need(5), need(6), need(7),
                            need(8), need(9), states[s], states[s + 1], slots);
            break;
        case 6:
            x = rms_norm(x, need(0), fl[0]);
            break;
        default:
            x = dense_gemv(step.row_ahead, x, need(0), opt(1));
        }
        w += n[0], s += n[1], f += n[2], i += 2 + n[3];
    }
    TORCH_CHECK_VALUE(w == weights.size() && s == states.size() && f == floats.size(), "decode_blocks: ",
                      weights.size() - w, " weights, ", states.size() - s, " states and ", floats.size() - f,
                      " floats left after the last half");
    return x;
}

}  // namespace

extern "C" void archzoo_point_kernels(void *dense, void *int8, void *int4, void *attention, void *rms_norm,
                                      void *rotary, void *linear_step, void *attention_half,
                                      void *mla_half, void *ffn_gate_up, void *gemv_residual, void *mamba_half,
                                      void *mamba2_half, void *row_ahead) {
    kernels() = Kernels{reinterpret_cast<DenseFn>(dense), reinterpret_cast<Int8Fn>(int8),
                        reinterpret_cast<Int4Fn>(int4), reinterpret_cast<AttentionFn>(attention),
                        reinterpret_cast<RmsNormFn>(rms_norm), reinterpret_cast<RotaryFn>(rotary),
                        reinterpret_cast<LinearStepFn>(linear_step),
                        reinterpret_cast<AttentionHalfFn>(attention_half),
                        reinterpret_cast<MlaHalfFn>(mla_half), reinterpret_cast<FfnGateUpFn>(ffn_gate_up),
                        reinterpret_cast<GemvResidualFn>(gemv_residual), reinterpret_cast<MambaHalfFn>(mamba_half),
                        reinterpret_cast<Mamba2HalfFn>(mamba2_half), reinterpret_cast<RowAheadFn>(row_ahead)};
}

// An op called on its own, outside decode_blocks: the bytes its step streams are not known here, so its GEMVs
// prefetch as from memory (row_prefetch_bytes(-1)).
template <auto F> struct Alone;
template <typename... A, at::Tensor (*F)(int64_t, A...)> struct Alone<F> {
    static at::Tensor call(A... a) { return F(kernels().row_ahead(-1), a...); }
};
template <typename... A, at::Tensor (*F)(const Step &, A...)> struct Alone<F> {  // and allocates what it writes
    static at::Tensor call(A... a) { return F(Step{kernels().row_ahead(-1)}, a...); }
};

TORCH_LIBRARY_IMPL(archzoo, CPU, m) {
    m.impl("dense_gemv", &Alone<&dense_gemv>::call);
    m.impl("quantized_gemv", &quantized_gemv);
    m.impl("decode_attention", &decode_attention);
    m.impl("rms_norm", &rms_norm);
    m.impl("rotary", &rotary);
    m.impl("swiglu_gemv", &Alone<&swiglu_gemv>::call);
    m.impl("ffn_block", &Alone<&ffn_block>::call);
    m.impl("attention_block", &Alone<&attention_block>::call);
    m.impl("linear_attention_block", &Alone<&linear_attention_block>::call);
    m.impl("mamba2_block", &Alone<&mamba2_block>::call);
    m.impl("mamba_block", &Alone<&mamba_block>::call);
    m.impl("mla_block", &Alone<&mla_block>::call);
    m.impl("decode_blocks", &decode_blocks);
}
