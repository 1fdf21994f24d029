"""CPU kernels, compiled at first use with the machine's C compiler (like inductor and Triton, so -march=native fits
the CPU it runs on) and registered as torch custom ops, so `torch.compile` calls them without a graph break:
- decode attention that reads every cache layout in place (kernels/cpu/decode_attention.c);
- Mamba's one-token state update (kernels/cpu/selective_state_update.c) and its prompt scan
  (kernels/cpu/selective_scan.c);
- the dense fp32 / bf16 GEMV for decode-sized batches (kernels/cpu/dense_gemv.c, kernels/linear.py's dispatch), and
  the weight-only int8 GEMV on the same tiles (int8_gemv there);
- the weight-only int4 GEMV for fp32 and fp16 activations (kernels/cpu/quantized_gemv.c);
- RMSNorm and rotary position embedding for decode-sized rows (kernels/cpu/norm_rope.c; kernels/cpu_fused.py);
- the C++ glue of decode attention, the GEMVs and kernels/cpu_fused.py's ops (kernels/cpu/ops.cpp, built by torch's
  extension loader): the dispatcher calls the kernels above without entering Python; their Python glue serves where
  it does not build;
- the streaming read that measures the machine's memory read rate, over one buffer or a list of tensors (a model's
  weights where they lie) (kernels/cpu/read_bandwidth.c; plain calls);
- greedy tokens and the non-finite check of a step's logits in one read (kernels/cpu/greedy_rows.c; a plain call).

Layouts (k and v 4-D, last dim contiguous):
  "blocks": [num_blocks, block_size, kv_heads, dim], any strides (the engine's pools are head-major views), a
            sequence's keys found through its block-table row (paged);
  "rows":   [slots, kv_heads, rows, dim], sequence b in row table[b, 0] (contiguous; a ring buffer is `rows` wide).
v None: the keys are MLA latent rows and the value is their first `value_dim` columns.
One-byte k and v (the engine's kv_dtype "int8" or "fp8", int8 or float8_e4m3fn rows) come with k_scales and v_scales,
[..., 1] in the same layout and q's dtype: a row is its stored values times its scale. A latent cache's k_scales may
be [..., 2]: the first for the row's value_dim latent columns, the second for the rest (cache/quantized_rows.py).
"""
import ctypes
import functools
import hashlib
import os
import subprocess
import sysconfig
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).with_name("cpu")  # the C kernels and their headers
DISABLE_ENV = "ARCHZOO_CPU_KERNELS"  # "0": the engine's CPU decode runs the PyTorch references instead
# -ffast-math's parts, not the flag itself: with -ffast-math, GCC before 13 links crtfastmath.o even into a shared
# library, and loading it switches the whole process to flush subnormals to zero (5e-324 becomes 0.0 in Python).
FAST_MATH = ["-fno-math-errno", "-fno-signed-zeros", "-fno-trapping-math", "-fassociative-math", "-freciprocal-math",
             "-ffinite-math-only", "-fno-rounding-math", "-fno-signaling-nans", "-fcx-limited-range"]
FLAGS = ["-O3", "-march=native", *FAST_MATH, "-fopenmp", "-fno-strict-aliasing", "-shared", "-fPIC", "-std=c11"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
LAYOUTS = ("blocks", "rows")
ONE_BYTE_ROWS = (torch.int8, torch.float8_e4m3fn)  # a quantized cache's rows (cache/quantized_rows.py)
_MIN_KEYS_PER_SPLIT = 128  # a split's fixed cost (its query load, the merge) is small against 128 keys: MQA (8 heads on
# one KV head), 256 fp32 keys, batch 1, 2 threads: one split 38 µs, two 30 (2-core EPYC)
GLUE = Path(__file__).with_name("cpu") / "ops.cpp"  # the hot ops' CPU kernels in C++
# Where the C++ glue does not build, the hot ops' Python glue is registered with the dispatcher directly, beneath
# custom_op's own Python wrapper: a call costs ~2.5 µs less eagerly and ~5 µs less in a compiled graph than through
# that wrapper. custom_op gives each op its schema and fake either way.
_DIRECT_CPU = torch.library.Library("archzoo", "IMPL")


def op_or_function(op, function):
    """A hot op (decode attention, a GEMV) as its op where the op's CPU kernel is the C++ glue (~1.5 µs a call,
    against ~8 µs for the plain function) or a graph is being compiled (the op keeps it whole); otherwise the plain
    function."""
    return op if torch.compiler.is_compiling() or glue_available() else function


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "archzoo" / "kernels"


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built once per source + flags + compiler; None where no C compiler works."""
    if os.environ.get(DISABLE_ENV) == "0":
        return None
    compiler = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    compiler = compiler.split()[0]
    files = sorted(SOURCE_DIR.glob("*.[ch]"))  # listed at build time, so the key names what is compiled
    source = b"".join(path.read_bytes() for path in files)  # headers too
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        warnings.warn(f"archzoo's CPU kernels need a C compiler and {compiler!r} does not run; CPU decode runs the "
                      "PyTorch references instead, far slower", RuntimeWarning, stacklevel=2)
        return None
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + version).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            sources = [str(path) for path in files if path.suffix == ".c"]
            result = subprocess.run([compiler, *FLAGS, *sources, "-o", str(built), "-lm"], capture_output=True)
            if result.returncode:  # said aloud: every CPU step would silently run the references, many times slower
                errors = [line for line in result.stderr.decode(errors="replace").splitlines() if "error" in line]
                warnings.warn(f"archzoo's CPU kernels did not build with {compiler} ({'; '.join(errors[:3]) or 'no message'}); "
                              "CPU decode runs the PyTorch references instead, far slower", RuntimeWarning, stacklevel=2)
                return None
            os.replace(built, target)  # atomic: a concurrent build never loads a half-written file
    # torch has loaded its libgomp.so.1 already: the kernel's OpenMP needs resolve to it (one thread pool)
    lib = ctypes.CDLL(str(target))
    lib.decode_attention.restype = ctypes.c_int
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.decode_attention.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64,
                                     ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64,
                                     i32, i32, i32, i32, i32, i32,
                                     ctypes.c_float, i32, ptr, i64, i64, i32, i32, i32, i64, i32]
    lib.selective_state_update.restype = ctypes.c_int
    lib.selective_state_update.argtypes = ([ptr, i64, i64, i64, i64, i32] + [ptr, i64, i64, i64] * 2 + [ptr, i64, i64]
                                           + [ptr, i64, i64, i64] * 3 + [ptr, i64, i64] + [ptr, i64, i64, i64]
                                           + [ptr, i32, i32, i32, i32, i32, i32, i32])
    lib.quantized_gemv.restype = ctypes.c_int
    lib.quantized_gemv.argtypes = [ptr, i64, i64, i64, i32, ptr, i64, i64, ptr, ptr, i32, ptr, i64, i32]
    lib.selective_scan.restype = ctypes.c_int
    lib.selective_scan.argtypes = [ptr] * 7 + [i32] * 5
    lib.selective_scan_backward.restype = ctypes.c_int
    lib.selective_scan_backward.argtypes = [ptr] * 14 + [i32] * 5
    lib.read_bandwidth.restype = ctypes.c_uint64
    lib.read_bandwidth.argtypes = [ptr, i64, i32]
    lib.read_buffers.restype = ctypes.c_uint64
    lib.read_buffers.argtypes = [ptr, ptr, i64, i32]
    lib.greedy_rows.restype = ctypes.c_int
    lib.greedy_rows.argtypes = [ptr, i64, i64, i64, i32, ptr, ptr]
    lib.dense_gemv.restype = ctypes.c_int
    lib.dense_gemv.argtypes = [ptr, i64, i64, i64, i32, ptr, i64, ptr, ptr, i64, i64, i32]
    lib.row_prefetch_bytes.restype = i64
    lib.row_prefetch_bytes.argtypes = [i64]
    lib.dense_gemv_layers.restype = ctypes.c_int
    lib.dense_gemv_layers.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32]
    lib.int8_gemv.restype = ctypes.c_int
    lib.int8_gemv.argtypes = [ptr, i64, i64, i64, i32, ptr, i64, ptr, i32, ptr, i64, i32]
    lib.rms_norm.restype = ctypes.c_int
    lib.rms_norm.argtypes = [ptr, i64, i64, i64, i32, ptr, ctypes.c_float, ptr]
    lib.rotary.restype = ctypes.c_int
    lib.rotary.argtypes = [ptr, i64, i64, i64, i64, i64, i64, i64, ptr, i64, i64, ptr, i32, ptr]
    return lib


@torch.compiler.assume_constant_result  # a compiled step asks once, at trace time, not through the cache wrapper
def cpu_kernels_available() -> bool:
    return _library() is not None


def _num_splits(tasks: int, max_keys: int, threads: int) -> int:
    """Key splits per task: enough to keep every thread busy, none shorter than _MIN_KEYS_PER_SPLIT."""
    wanted = -(-4 * threads // tasks)
    return max(1, min(wanted, -(-max_keys // _MIN_KEYS_PER_SPLIT)))


def _strides(x: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(block or slot, position, head) element strides of a cache tensor in `layout`."""
    if layout == "blocks":
        return x.stride(0), x.stride(1), x.stride(2)
    return x.stride(0), x.stride(2), x.stride(1)


def decode_attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, table: torch.Tensor,
                           seq_lens: torch.Tensor, layout: str, scale: float, value_dim: int,
                           starts: torch.Tensor | None = None, sinks: int = 0, max_keys: int = 0, splits: int = 0,
                           k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None, stride: int = 1,
                           ring: int = 0) -> torch.Tensor:
    """q [B, H, Dk] -> [B, H, value_dim]: each sequence's query over keys 0..seq_lens[b]-1, or with starts over
    [0, min(sinks, starts[b])) and [starts[b], seq_lens[b]) (kernels/paged_attention.py); max_keys > 0 bounds how
    many keys a query sees. stride > 1: every stride-th position of the span (a dilated window); ring > 0: position
    p lives in row p % ring. table: int32 [B, blocks] ("blocks") or [B, 1] ("rows"). See the module doc for layouts.
    splits: key slices per (sequence, KV head), merged by log-sum-exp; 0 = enough to keep every thread busy."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown cache layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    lib = _library()
    q = q.contiguous()
    # the kernel reads int32 rows with unit stride: callers may hand int64 lengths or a sliced table
    table, seq_lens = table.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous()
    starts = None if starts is None else starts.to(torch.int32).contiguous()
    batch, heads, dim_k = q.shape
    kv_heads = k.shape[2] if layout == "blocks" else k.shape[1]
    block_size = k.shape[1] if layout == "blocks" else k.shape[2]
    values = k if v is None else v
    value_scales = k_scales if v is None else v_scales
    out = torch.empty(batch, heads, value_dim, dtype=q.dtype)

    def scales_at(scales):  # (pointer, strides) of an int8 cache's scales; NULL for a float cache
        return (None, 0, 0, 0) if scales is None else (scales.data_ptr(), *_strides(scales, layout))

    # a latent row's two scales: the first over its value_dim latent columns, the second over the rest
    two_scales = k_scales is not None and k_scales.shape[-1] == 2
    key_scale_parts = (k_scales.stride(-1), value_dim) if two_scales else (0, dim_k)
    threads = torch.get_num_threads()
    # a paged task reads all KV heads of its blocks, tile by tile: a block's heads lie together (one stream per block,
    # 1.1-1.3x faster than a task per head at 16 x 4096 keys); a contiguous cache streams one KV head per task
    kv_per_task = kv_heads if layout == "blocks" else 1
    max_keys = table.shape[1] * block_size if max_keys <= 0 else min(max_keys, table.shape[1] * block_size)
    status = lib.decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1),
        k.data_ptr(), *_strides(k, layout),
        values.data_ptr(), *_strides(values, layout),
        *scales_at(k_scales), *scales_at(value_scales),
        table.data_ptr(), table.stride(0), block_size,
        seq_lens.data_ptr(), None if starts is None else starts.data_ptr(), sinks, stride, ring,
        batch, heads, kv_heads, kv_per_task, dim_k, value_dim, scale,
        splits or _num_splits(batch * kv_heads // kv_per_task, max_keys, threads),
        out.data_ptr(), out.stride(0), out.stride(1), DTYPE_CODES[q.dtype], threads,
        int(k.dtype == torch.float8_e4m3fn), *key_scale_parts,
    )
    if status:
        raise ValueError(f"decode_attention: sizes beyond the CPU kernel (query heads per KV head {heads // kv_heads} <= 128, "
                         f"dims {dim_k}, {value_dim} <= 1024; stride {stride} >= 1 and 1 with sinks {sinks}, "
                         f"ring {ring} >= 0)")
    return out


decode_attention = torch.library.custom_op("archzoo::decode_attention", mutates_args=())(decode_attention_eager)


@decode_attention.register_fake
def _(q, k, v, table, seq_lens, layout, scale, value_dim, starts=None, sinks=0, max_keys=0, splits=0, k_scales=None,
      v_scales=None, stride=1, ring=0):
    return q.new_empty(q.shape[0], q.shape[1], value_dim)


def fits(q: torch.Tensor, cache: torch.Tensor, kv_heads: int, value_dim: int, scales: torch.Tensor | None = None) -> bool:
    """Whether decode_attention takes these tensors: a supported dtype (an int8 or fp8 cache with scales in q's), the
    cache's last dim contiguous, sizes in range."""
    stored = (q.dtype,) if scales is None else ONE_BYTE_ROWS
    return (q.dtype in DTYPE_CODES and cache.dtype in stored and (scales is None or scales.dtype == q.dtype)
            and attention_fits(q.shape[1], kv_heads, q.shape[2], value_dim, cache))


def attention_fits(heads: int, kv_heads: int, key_dim: int, value_dim: int, cache: torch.Tensor) -> bool:
    """decode_attention's sizes: query heads a multiple of the KV heads, at most 128 a KV head, dims at most 1024, the
    cache's last dim contiguous."""
    return (cache.stride(-1) == 1 and heads % kv_heads == 0 and heads // kv_heads <= 128
            and max(key_dim, value_dim) <= 1024)


def _attend():
    """decode_attention as op_or_function picks it."""
    return op_or_function(decode_attention, decode_attention_eager)


def paged_decode_attention_cpu(q, k_pool, v_pool, block_table, seq_lens, scale: float, starts=None, sinks: int = 0,
                               max_keys: int | None = None, k_scales=None, v_scales=None, stride: int = 1):
    """The paged kernel's contract (kernels/paged_attention.py) on the CPU kernel."""
    return _attend()(q, k_pool, v_pool, block_table, seq_lens, "blocks", scale, v_pool.shape[-1], starts, sinks,
                     max_keys or 0, k_scales=k_scales, v_scales=v_scales, stride=stride)


def mla_decode_attention_cpu(q, latent_pool, block_table, seq_lens, scale: float, value_dim: int, latent_scales=None):
    """The MLA kernel's contract (kernels/mla_attention.py): latent_pool [num_blocks, block_size, W]; a one-byte
    pool's scales [num_blocks, block_size, 1, 1 or 2]."""
    return _attend()(q, latent_pool.unsqueeze(2), None, block_table, seq_lens, "blocks", scale, value_dim,
                     k_scales=latent_scales)


def contiguous_decode_attention_cpu(q, k, v, slots, seq_lens, scale: float, value_dim: int, k_scales=None,
                                    v_scales=None, starts=None, stride: int = 1):
    """kernels/contiguous_attention.py's contract: k, v [slots, kv_heads, rows, dim], v None for a latent cache; with
    starts, a strided span whose position p lives in row p % rows."""
    return _attend()(q, k, v, slots.to(torch.int32).unsqueeze(1), seq_lens, "rows", scale, value_dim,
                     starts, k_scales=k_scales, v_scales=v_scales, stride=stride,
                     ring=0 if starts is None else k.shape[2])


def state_update_fits(state: torch.Tensor) -> bool:
    return state.dtype in DTYPE_CODES and state.shape[-1] <= 1024


def state_update_eager(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                  dt_softplus: bool) -> torch.Tensor:
    """Mamba-2 layout (state [B, H, P, N], the rest fp32, any strides); updates state in place, returns y [B, H, P] fp32."""
    batch, heads, head_dim, dstate = state.shape
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32)

    def view(t, dims):  # (pointer, strides...) of an optional tensor; a missing one is NULL with zero strides
        return (None, *[0] * dims) if t is None else (t.data_ptr(), *t.stride())

    status = _library().selective_state_update(
        state.data_ptr(), *state.stride(), DTYPE_CODES[state.dtype], *view(x, 3), *view(dt, 3), *view(dt_bias, 2),
        *view(A, 3), *view(B, 3), *view(C, 3), *view(D, 2), *view(z, 3), out.data_ptr(),
        batch, heads, head_dim, dstate, B.shape[1], int(dt_softplus), torch.get_num_threads())
    if status:
        raise ValueError(f"selective_state_update: d_state {dstate} is beyond the CPU kernel's 1024")
    return out


# the op a compiled graph keeps; an eager step calls the function: an op that mutates an input runs custom_op's
# Python ADInplaceOrView kernel on every call, even in inference mode (~50 µs, against ~20 µs for the whole update
# of a `small` Mamba-2 layer's state)
_state_update = torch.library.custom_op("archzoo::selective_state_update", mutates_args=("state",))(state_update_eager)


@_state_update.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    return x.new_empty(x.shape, dtype=torch.float32)


def selective_scan_fits(channels: int, dstate: int) -> bool:
    return channels % 8 == 0 and 1 <= dstate <= 1024


@torch.library.custom_op("archzoo::selective_scan", mutates_args=())
def selective_scan_cpu(dt: torch.Tensor, A: torch.Tensor, dtx: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ssm/scan.py's scan_forward without saved states, on kernels/cpu/selective_scan.c: dt, dtx [b, T, d], A [d, n],
    B, C [b, T, n], h0 [b, d, n], all fp32. Returns y [b, T, d] and the final state [b, d, n]."""
    batch, length, channels = dt.shape
    dt, A, dtx, B, C = (t.contiguous() for t in (dt, A, dtx, B, C))
    state = h0.clone(memory_format=torch.contiguous_format)
    y = torch.empty(batch, length, channels, dtype=torch.float32)
    status = _library().selective_scan(dt.data_ptr(), dtx.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(),
                                       state.data_ptr(), y.data_ptr(), batch, length, channels, state.shape[-1],
                                       torch.get_num_threads())
    if status:
        raise ValueError(f"selective_scan: {channels} channels (a multiple of 8) and d_state {state.shape[-1]} "
                         "(1..1024) are beyond the CPU kernel")
    return y, state


@selective_scan_cpu.register_fake
def _(dt, A, dtx, B, C, h0):
    return dt.new_empty(dt.shape), h0.new_empty(h0.shape)


def selective_scan_backward_cpu(dt, A, dtx, B, C, h0, grad_y, grad_last):
    """The gradients of selective_scan_cpu (ssm/scan.py's SelectiveScan.backward) on kernels/cpu/selective_scan.c,
    which replays the forward per task instead of keeping every state: returns dL/d(dt, A, dtx, B, C, h0).
    grad_last may be None. fp32 throughout."""
    batch, length, channels = dt.shape
    dstate = A.shape[-1]
    groups = channels // 8
    dt, A, dtx, B, C, h0, grad_y = (t.contiguous() for t in (dt, A, dtx, B, C, h0, grad_y))
    grad_last = None if grad_last is None else grad_last.contiguous()
    g_dt, g_dtx = torch.empty_like(dt), torch.empty_like(dtx)
    g_A, g_h0 = torch.empty(batch, channels, dstate), torch.empty_like(h0)
    g_B, g_C = (torch.empty(batch, groups, length, dstate) for _ in range(2))  # per channel group, summed below
    status = _library().selective_scan_backward(
        dt.data_ptr(), dtx.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(), h0.data_ptr(), grad_y.data_ptr(),
        None if grad_last is None else grad_last.data_ptr(), g_dt.data_ptr(), g_dtx.data_ptr(), g_A.data_ptr(),
        g_B.data_ptr(), g_C.data_ptr(), g_h0.data_ptr(), batch, length, channels, dstate, torch.get_num_threads())
    if status:
        raise (MemoryError("selective_scan_backward: out of memory for the replayed states") if status == -2 else
               ValueError(f"selective_scan_backward: {channels} channels (a multiple of 8) and d_state {dstate} "
                          "(1..1024) are beyond the CPU kernel"))
    return g_dt, g_A.sum(0), g_dtx, g_B.sum(1), g_C.sum(1), g_h0


def selective_state_update_cpu(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """kernels/selective_state_update.py's contract, already in the Mamba-2 layout (its _as_multihead)."""
    f32 = [None if t is None else t.float() for t in (x, dt, A, B, C, D, z, dt_bias)]
    x32, dt32, A32, B32, C32, D32, z32, bias32 = f32
    update = _state_update if torch.compiler.is_compiling() else state_update_eager
    return update(state, x32, dt32, A32, B32, C32, D32, z32, bias32, dt_softplus).to(x.dtype)


def quantized_gemv_fits(x: torch.Tensor, group_size: int) -> bool:
    """Whether quantized_gemv takes x: fp32 / bf16 / fp16; int4 with a width of whole 16-column tiles and groups that
    are multiples of 32 (int8 takes any width)."""
    return x.dtype in DTYPE_CODES and (not group_size or (x.shape[-1] % 16 == 0 and group_size % 32 == 0))


@torch.library.custom_op("archzoo::quantized_gemv", mutates_args=())
def quantized_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   group_size: int) -> torch.Tensor:
    """quantized_gemv_eager as one op a compiled graph keeps."""
    return quantized_gemv_eager(x, weight, scales, zeros, group_size)


def quantized_gemv_eager(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                         group_size: int) -> torch.Tensor:
    """x [..., K] times an int8 [N, K] weight (group_size 0, zeros None; kernels/cpu/dense_gemv.c's int8_gemv) or an
    int4 [N, K / 2] one with scales and zeros [N, K / group_size] (kernels/cpu/quantized_gemv.c), in
    kernels/quantized_matmul.py's formats."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight, scales = weight.contiguous(), scales.contiguous()
    zeros = None if zeros is None else zeros.to(scales.dtype).contiguous()
    n = weight.shape[0]
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    lib, threads = _library(), torch.get_num_threads()
    if group_size == 0:
        status = lib.int8_gemv(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), DTYPE_CODES[x.dtype],
                               weight.data_ptr(), n, scales.data_ptr(), DTYPE_CODES[scales.dtype], out.data_ptr(),
                               out.stride(0), threads)
    else:
        status = lib.quantized_gemv(
            rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), DTYPE_CODES[x.dtype], weight.data_ptr(), n,
            group_size, scales.data_ptr(), zeros.data_ptr(), DTYPE_CODES[scales.dtype], out.data_ptr(), out.stride(0),
            threads)
    if status:
        raise (MemoryError("quantized_gemv: out of memory for the fp32 copy of x") if status == -2 else
               ValueError(f"quantized_gemv: width {rows.shape[1]} (int4: a multiple of 16) and group {group_size} (0 "
                          "for int8, or a multiple of 32 dividing the width), activations and scales fp32, bf16 or "
                          "fp16, are beyond the CPU kernels"))
    return out.reshape(*x.shape[:-1], n)


@quantized_gemv.register_fake
def _(x, weight, scales, zeros, group_size):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def read_bandwidth(buffer: torch.Tensor, threads: int) -> int:
    """Stream every 64-byte line of a contiguous CPU buffer once with `threads` threads (a multiple of 64 * threads
    bytes is read); returns the XOR of what was read, so no load can be skipped."""
    lib = _library()
    if lib is None or not buffer.is_contiguous() or buffer.device.type != "cpu":
        raise RuntimeError("read_bandwidth needs the compiled CPU kernels and a contiguous CPU buffer")
    usable = buffer.nbytes // (64 * threads) * (64 * threads)
    return lib.read_bandwidth(ctypes.c_void_p(buffer.data_ptr()), usable, threads)


def read_buffers(buffers: list[torch.Tensor], threads: int) -> int:
    """Stream every whole 64-byte line of each contiguous, 64-byte aligned CPU tensor once, one after another in one
    call with `threads` threads (each its share of each tensor, no wait between them): the rate the memory a
    model's weights lie in is read at. Returns the XOR of what was read."""
    lib = _library()
    bad = [i for i, b in enumerate(buffers)
           if b.device.type != "cpu" or not b.is_contiguous() or b.data_ptr() % 64]
    if lib is None or bad:
        raise ValueError("read_buffers needs the compiled CPU kernels and contiguous CPU tensors starting on a 64-byte "
                         f"line; tensors {bad} are not" if bad else "read_buffers needs the compiled CPU kernels")
    pointers = (ctypes.c_void_p * len(buffers))(*(b.data_ptr() for b in buffers))
    sizes = (ctypes.c_int64 * len(buffers))(*(b.nbytes for b in buffers))
    return lib.read_buffers(pointers, sizes, len(buffers), threads)


def greedy_rows(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Each row of logits [B, vocab]: its first largest value's index (torch.argmax's) and whether it is all finite
    (a non-finite row's index means nothing); in one read where the C kernels serve (a CPU fp32 / bf16 / fp16 row
    with unit stride), else torch's argmax and isfinite."""
    lib = _library()
    if (lib is None or logits.device.type != "cpu" or logits.dim() != 2 or logits.dtype not in DTYPE_CODES
            or logits.stride(-1) != 1 or logits.shape[1] == 0):
        return logits.argmax(dim=-1).tolist(), torch.isfinite(logits).all(dim=-1).tolist()
    rows = logits.shape[0]
    tokens, finite = (ctypes.c_int64 * rows)(), (ctypes.c_uint8 * rows)()
    lib.greedy_rows(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), DTYPE_CODES[logits.dtype], tokens,
                    finite)
    return list(tokens), [bool(f) for f in finite]


DENSE_DTYPES = (torch.float32, torch.bfloat16)


def dense_gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether dense_gemv takes these: x, weight and bias all fp32 or all bf16, the weight contiguous [N, K]."""
    return (x.dtype in DENSE_DTYPES and weight.dtype == x.dtype and weight.is_contiguous()
            and (bias is None or bias.dtype == x.dtype))


@torch.library.custom_op("archzoo::dense_gemv", mutates_args=())
def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """dense_gemv_eager as one op a compiled graph keeps (its dispatch costs ~8 µs a call more than the function)."""
    return dense_gemv_eager(x, weight, bias)


def dense_gemv_layers(xs: list[torch.Tensor], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """[F.linear(x, w) for x, w in zip(xs, weights)] on kernels/cpu/dense_gemv.c in one call from Python, the GEMVs
    one after another in C as a planned decode step calls them: a step's bare linear layers without Python between
    them (benchmarks/weight_streaming.py). Each x [m, K_i] and w [N_i, K_i] contiguous, all in one dtype (fp32, bf16)
    with the same m."""
    lib = _library()
    dtype, m = xs[0].dtype, xs[0].shape[0]
    if lib is None or dtype not in DENSE_DTYPES or len(xs) != len(weights) or any(
            x.dtype != dtype or w.dtype != dtype or x.dim() != 2 or x.shape[0] != m or w.dim() != 2
            or x.shape[1] != w.shape[1] or not x.is_contiguous() or not w.is_contiguous() for x, w in zip(xs, weights)):
        raise ValueError("dense_gemv_layers: contiguous x [m, K_i] and w [N_i, K_i] in one dtype "
                         f"({', '.join(map(str, DENSE_DTYPES))}) with the same m, and the compiled CPU kernels")
    outs = [torch.empty(m, w.shape[0], dtype=dtype) for w in weights]

    def array(values, kind):
        return (kind * len(values))(*values)

    status = lib.dense_gemv_layers(array([x.data_ptr() for x in xs], ctypes.c_void_p),
                                   array([w.data_ptr() for w in weights], ctypes.c_void_p),
                                   array([o.data_ptr() for o in outs], ctypes.c_void_p),
                                   array([w.shape[1] for w in weights], ctypes.c_int64),
                                   array([w.shape[0] for w in weights], ctypes.c_int64), len(xs), m,
                                   DTYPE_CODES[dtype], torch.get_num_threads())
    if status:
        raise MemoryError("dense_gemv_layers: out of memory for a widened copy of x") if status == -2 else \
            ValueError(f"dense_gemv_layers: dtype {dtype} is beyond the kernel")
    return outs


def row_prefetch_bytes(step_bytes: int) -> int:
    """How far ahead (bytes) the C GEMV prefetches a weight row for one row of x, in a step that streams step_bytes of
    weights (-1: not known, as for an op called on its own): further where they fit in half the CPU's last-level
    cache (kernels/cpu/dense_gemv.c). A planned decode step's op (decode_blocks) asks it from its weights' bytes."""
    return _library().row_prefetch_bytes(step_bytes)


def dense_gemv_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for decode-sized x [..., K] (each weight byte is read once for up to 16 rows) on
    kernels/cpu/dense_gemv.c: fp32, or bf16 with fp32 sums rounded once."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    n = weight.shape[0]
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    status = _library().dense_gemv(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), DTYPE_CODES[x.dtype],
                                   weight.data_ptr(), n, None if bias is None else bias.data_ptr(), out.data_ptr(),
                                   out.stride(0), row_prefetch_bytes(-1), torch.get_num_threads())
    if status:
        raise (MemoryError("dense_gemv: out of memory for the fp32 copy of x") if status == -2 else
               ValueError(f"dense_gemv: dtype {x.dtype} is beyond the CPU kernel (fp32, bf16)"))
    return out.reshape(*x.shape[:-1], n)


@dense_gemv.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@functools.cache
def _glue_registered() -> bool:
    """Builds (once per source and torch version, into cache_dir()) and loads kernels/cpu/ops.cpp, which registers
    the hot ops' CPU kernels in C++, and points it at the C kernels. Where it cannot build (no C++ compiler, ninja or
    torch headers), the Python glue is registered instead, said aloud: each call then costs ~10 µs more."""
    lib = _library()
    if lib is None:
        return False
    from torch.utils import cpp_extension  # imported here: it is slow to import and only the CPU kernels need it

    key = hashlib.sha256(GLUE.read_bytes() + f"{torch.__version__}".encode()).hexdigest()[:16]
    directory = cache_dir() / f"glue_{key}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = cpp_extension.load(f"archzoo_cpu_glue_{key}", [str(GLUE)], extra_cflags=["-O2"],
                                  build_directory=str(directory), is_python_module=False, verbose=False)
    except Exception as error:  # said aloud below; the Python glue serves
        warnings.warn(f"archzoo's C++ glue for the CPU kernels ({GLUE.name}) did not build "
                      f"({str(error).splitlines()[0][:200]}); decode attention and the GEMVs run their Python glue, "
                      "~10 µs more a call", RuntimeWarning, stacklevel=2)
        _DIRECT_CPU.impl("decode_attention", decode_attention_eager, "CPU")
        _DIRECT_CPU.impl("quantized_gemv", quantized_gemv_eager, "CPU")
        _DIRECT_CPU.impl("dense_gemv", dense_gemv_eager, "CPU")
        return False  # kernels/cpu_fused.py's ops are then called as their plain functions, never as ops
    glue = ctypes.CDLL(path)
    glue.archzoo_point_kernels(*(ctypes.cast(kernel, ctypes.c_void_p) for kernel in
                                 (lib.dense_gemv, lib.int8_gemv, lib.quantized_gemv, lib.decode_attention,
                                  lib.rms_norm, lib.rotary, lib.linear_attention_step, lib.attention_half,
                                  lib.mla_half, lib.ffn_gate_up, lib.gemv_residual, lib.mamba_half,
                                  lib.mamba2_half, lib.row_prefetch_bytes)))
    return True


@torch.compiler.assume_constant_result  # asked once at trace time (and the glue built then)
def glue_available() -> bool:
    return _glue_registered()
