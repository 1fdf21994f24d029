"""Time the Triton kernels against their PyTorch references on a CUDA GPU.

Run from the repository root on a machine with CUDA and triton:

    python -m benchmarks.kernels_gpu                 # defaults: 32 query / 8 KV heads, head_dim 128
    python -m benchmarks.kernels_gpu --context 8192 --batches 1 8 32 --window 4096
    python -m benchmarks.kernels_gpu --device cpu --dtypes fp32 --batches 1 --context 64 ...   # interpreter smoke

Prints Markdown tables (decode attention, the same under a sliding window, MLA decode over a
paged latent cache, KV write, the Mamba-1 and Mamba-2 decode state update, linear-attention decode
step and chunked prefill) with median times from
triton.testing.do_bench (L2 flushed between runs, launch overhead included), the
PyTorch / Triton ratio, the bytes each kernel must move divided by its time, and that figure as a
share of the GPU's measured copy bandwidth (printed first). Each row is checked against the
reference before it is timed. Each table is a generator of row dicts (BENCHES; markdown() renders them), which
benchmarks/gpu_check.py records as data.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Iterator

import torch

from cache import Retention
from kernels import (
    linear_attention_chunked_ref,
    linear_attention_chunked_triton,
    linear_attention_step_ref,
    linear_attention_step_triton,
    mla_decode_attention_ref,
    mla_decode_attention_triton,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    selective_state_update_ref,
    selective_state_update_triton,
    write_paged_kv_ref,
    write_paged_kv_triton,
)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}  # max abs error, outputs are O(1)


class KernelMismatch(ValueError):
    """A Triton kernel's output differs from its reference by more than the dtype's tolerance: not timed."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=4096, help="keys per sequence")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=1024, help="keys a query sees in the sliding-window table")
    parser.add_argument("--mla-heads", type=int, default=128, help="query heads of the MLA table (DeepSeek-V3: 128)")
    parser.add_argument("--kv-lora-rank", type=int, default=512, help="MLA latent width, also the value width")
    parser.add_argument("--rope-dim", type=int, default=64, help="MLA rope key width, stored after the latent")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["fp16", "bf16"])
    parser.add_argument("--prefill-tokens", type=int, default=4096,
                        help="tokens in the prefill-sized write row and the linear-attention prefill table")
    parser.add_argument("--mamba-inner", type=int, default=5120, help="Mamba d_inner (2.8B / 2.7B models: 5120)")
    parser.add_argument("--mamba1-state", type=int, default=16, help="Mamba-1 d_state")
    parser.add_argument("--mamba2-head-dim", type=int, default=64, help="Mamba-2 head dim (d_inner / heads)")
    parser.add_argument("--mamba2-state", type=int, default=128, help="Mamba-2 d_state")
    parser.add_argument("--linear-heads", type=int, default=16, help="heads of the linear-attention tables")
    parser.add_argument("--linear-dim", type=int, default=128, help="feature (dk) and value (dv) width per head")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: triton's interpreter (TRITON_INTERPRET=1) at small shapes, timed by the wall "
                             "clock: a smoke test of this script, not a measurement")
    return parser.parse_args(argv)


def median_ms(device: str, fn) -> float:
    """do_bench's median on CUDA (L2 flushed, launch included); the wall-clock median of a few calls on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def copy_bandwidth_gbs(device: str = "cuda", nbytes: int = 2**30) -> float:
    """Peak to compare against: an `nbytes` device-to-device copy, bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median_ms(device, lambda: dst.copy_(src)) * 1e-3) / 1e9


def paged_pools(batch, args, row_shape, dtype, count):
    """`count` pools of rows of `row_shape`; every sequence `context` keys long, its blocks scattered over
    the pools in random order. Returns (*pools, block_table, seq_lens)."""
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = batch * blocks_per_seq
    pools = [torch.randn(num_blocks, args.block_size, *row_shape, dtype=dtype, device=args.device)
             for _ in range(count)]
    block_table = torch.randperm(num_blocks, device=args.device).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), args.context, dtype=torch.int32, device=args.device)
    return *pools, block_table, seq_lens


def table_row(title: str, first_column: str, key: str, dtype_name: str, triton_ms: float, torch_ms: float,
              nbytes: int, peak_gbs: float, max_err: float) -> dict:
    """One table row as data: both sides' times, the bytes the kernel must move over its time, against the copy rate."""
    achieved_gbs = nbytes / (triton_ms * 1e-3) / 1e9
    return {"table": title, "first_column": first_column, "key": key, "dtype": dtype_name,
            "triton_us": 1e3 * triton_ms, "torch_us": 1e3 * torch_ms, "torch_over_triton": torch_ms / triton_ms,
            "triton_gb_s": achieved_gbs, "copy_bw_pct": 100 * achieved_gbs / peak_gbs, "max_abs_diff": max_err}


HEADER = ["Triton (µs)", "PyTorch (µs)", "PyTorch / Triton", "Triton GB/s", "% of copy BW", "max abs diff"]


def cells(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_header(row: dict) -> str:
    return "\n".join([f"### {row['table']}", "", cells([row["first_column"], "dtype", *HEADER]),
                      cells(["---"] * (2 + len(HEADER)))])


def markdown_row(row: dict) -> str:
    return cells([row["key"], row["dtype"], f"{row['triton_us']:.1f}", f"{row['torch_us']:.1f}",
                  f"{row['torch_over_triton']:.2f}x", f"{row['triton_gb_s']:.0f}", f"{row['copy_bw_pct']:.0f}%",
                  f"{row['max_abs_diff']:.1e}"])


def markdown(rows: list[dict]) -> str:
    """The rows as Markdown, a table wherever the title changes."""
    lines, title = [], None
    for row in rows:
        if row["table"] != title:
            lines += ([""] if lines else []) + [markdown_header(row)]
            title = row["table"]
        lines.append(markdown_row(row))
    return "\n".join(lines) + "\n"


def bench_attention(args, peak_gbs, window=None) -> Iterator[dict]:
    title = (f"Paged decode attention: {args.heads} query / {args.kv_heads} KV heads, head_dim {args.head_dim}, "
             f"context {args.context}, block {args.block_size}")
    title, column = title if window is None else f"{title}, sliding window {window}", "batch"
    visible = args.context if window is None else min(window, args.context)
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for batch in args.batches:
            row_shape = (args.kv_heads, args.head_dim)
            k_pool, v_pool, block_table, seq_lens = paged_pools(batch, args, row_shape, dtype, count=2)
            q = torch.randn(batch, args.heads, args.head_dim, dtype=dtype, device=args.device)
            inputs = (q, k_pool, v_pool, block_table, seq_lens, args.head_dim**-0.5)
            span = {} if window is None else dict(starts=Retention(window=window).span_starts(seq_lens), max_keys=window)
            triton_out = paged_decode_attention_triton(*inputs, **span)
            ref_out = paged_decode_attention_ref(*inputs, **span)
            max_err = (triton_out.float() - ref_out.float()).abs().max().item()
            if max_err > TOLERANCE[dtype]:
                raise KernelMismatch(f"Triton attention differs from the reference by {max_err:.2e} "
                                     f"(batch {batch}, {dtype_name})")
            # the kernel's unavoidable traffic: every visible cached K and V once, plus q and the output
            kv_bytes = batch * visible * args.kv_heads * 2 * args.head_dim * k_pool.element_size()
            nbytes = kv_bytes + 2 * q.nbytes + block_table.nbytes
            triton_ms = median_ms(args.device, lambda: paged_decode_attention_triton(*inputs, **span))
            torch_ms = median_ms(args.device, lambda: paged_decode_attention_ref(*inputs, **span))
            yield table_row(title, column, str(batch), dtype_name, triton_ms, torch_ms, nbytes, peak_gbs, max_err)
            del k_pool, v_pool, inputs
            torch.cuda.empty_cache()


def bench_mla(args, peak_gbs) -> Iterator[dict]:
    width, value_dim = args.kv_lora_rank + args.rope_dim, args.kv_lora_rank
    column = "batch"
    title = (f"MLA decode attention (absorbed): {args.mla_heads} query heads over a paged latent of "
             f"{args.kv_lora_rank} + {args.rope_dim} per token, context {args.context}, block {args.block_size}")
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for batch in args.batches:
            latent_pool, block_table, seq_lens = paged_pools(batch, args, (width,), dtype, count=1)
            q = torch.randn(batch, args.mla_heads, width, dtype=dtype, device=args.device)
            inputs = (q, latent_pool, block_table, seq_lens, width**-0.5, value_dim)
            triton_out, ref_out = mla_decode_attention_triton(*inputs), mla_decode_attention_ref(*inputs)
            max_err = (triton_out.float() - ref_out.float()).abs().max().item()
            if max_err > TOLERANCE[dtype]:
                raise KernelMismatch(f"Triton MLA differs from the reference by {max_err:.2e} "
                                     f"(batch {batch}, {dtype_name})")
            # the kernel's unavoidable traffic: every cached latent row once (key and value), plus q and the output
            latent_bytes = batch * args.context * width * latent_pool.element_size()
            nbytes = latent_bytes + q.nbytes + triton_out.nbytes + block_table.nbytes
            triton_ms = median_ms(args.device, lambda: mla_decode_attention_triton(*inputs))
            torch_ms = median_ms(args.device, lambda: mla_decode_attention_ref(*inputs))
            yield table_row(title, column, str(batch), dtype_name, triton_ms, torch_ms, nbytes, peak_gbs, max_err)
            del latent_pool, inputs
            torch.cuda.empty_cache()


def bench_write(args, peak_gbs) -> Iterator[dict]:
    column = "tokens"
    title = (f"Paged KV write: {args.kv_heads} KV heads, head_dim {args.head_dim}, block {args.block_size} "
             f"(decode rows write one token per sequence, the last row a prefill)")
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for num_tokens in [*args.batches, args.prefill_tokens]:
            num_blocks = 2 * (-(-num_tokens // args.block_size))
            shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
            k_pools = [torch.zeros(shape, dtype=dtype, device=args.device) for _ in range(2)]
            v_pools = [torch.zeros(shape, dtype=dtype, device=args.device) for _ in range(2)]
            k = torch.randn(num_tokens, args.kv_heads, args.head_dim, dtype=dtype, device=args.device)
            v = torch.randn_like(k)
            slot_mapping = torch.randperm(num_blocks * args.block_size, device=args.device)[:num_tokens]
            write_paged_kv_triton(k, v, k_pools[0], v_pools[0], slot_mapping)
            write_paged_kv_ref(k, v, k_pools[1], v_pools[1], slot_mapping)
            max_err = max((a.float() - b.float()).abs().max().item() for a, b in (k_pools, v_pools))
            if max_err != 0:
                raise KernelMismatch(f"Triton KV write differs from the reference "
                                     f"({num_tokens} tokens, {dtype_name})")
            nbytes = 2 * (k.nbytes + v.nbytes) + slot_mapping.nbytes  # read the new K/V, write them once
            triton_ms = median_ms(args.device,
                                  lambda: write_paged_kv_triton(k, v, k_pools[0], v_pools[0], slot_mapping))
            torch_ms = median_ms(args.device, lambda: write_paged_kv_ref(k, v, k_pools[1], v_pools[1], slot_mapping))
            yield table_row(title, column, str(num_tokens), dtype_name, triton_ms, torch_ms, nbytes, peak_gbs, max_err)


def max_abs_diff(pairs) -> float:
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


def max_scaled_diff(pairs) -> float:
    """max |a - b| / (1 + |b|): absolute for O(1) values, relative above, so one ulp of a large bf16 value passes."""
    return max(((a.float() - b.float()).abs() / (1 + b.float().abs())).max().item() for a, b in pairs)


def bench_selective_state_update(args, peak_gbs) -> Iterator[dict]:
    mamba2_heads = args.mamba_inner // args.mamba2_head_dim
    column = "layout, batch"
    title = (f"Mamba decode state update (selective_state_update), d_inner {args.mamba_inner}: Mamba-1 "
             f"d_state {args.mamba1_state}; Mamba-2 {mamba2_heads} heads x {args.mamba2_head_dim}, "
             f"d_state {args.mamba2_state}, 1 group, per-head dt/A/D as stride-0 views. State fp32, "
             f"activations in the row's dtype; the diff column is max |Δ| / (1 + |reference|)")
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for layout in ["mamba1", "mamba2"]:
            for batch in args.batches:
                if layout == "mamba1":
                    rows, per_row, dstate = (batch, args.mamba_inner), (args.mamba_inner,), args.mamba1_state
                    B = torch.randn(batch, dstate, dtype=dtype, device=args.device)
                    dt = torch.randn(*rows, dtype=dtype, device=args.device)
                    A = -torch.rand(*per_row, dstate, device=args.device)
                    D, dt_bias = torch.randn(*per_row, device=args.device), torch.randn(*per_row, device=args.device)
                else:
                    heads, head_dim, dstate = mamba2_heads, args.mamba2_head_dim, args.mamba2_state
                    rows, per_row = (batch, heads, head_dim), (heads, head_dim)
                    B = torch.randn(batch, 1, dstate, dtype=dtype, device=args.device)
                    dt = torch.randn(batch, heads, 1, dtype=dtype, device=args.device).expand(*rows)
                    A = -torch.rand(heads, 1, 1, device=args.device).expand(heads, head_dim, dstate)
                    D = torch.randn(heads, 1, device=args.device).expand(*per_row)
                    dt_bias = torch.randn(heads, 1, device=args.device).expand(*per_row)
                x, z = torch.randn(*rows, dtype=dtype, device=args.device), torch.randn(*rows, dtype=dtype, device=args.device)
                state = torch.randn(*rows, dstate, device=args.device)
                ref_state = state.clone()
                C = torch.randn_like(B) * dstate**-0.5  # keeps y O(1) whatever d_state
                inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
                triton_y = selective_state_update_triton(state, **inputs)
                ref_y = selective_state_update_ref(ref_state, **inputs)
                max_err = max_scaled_diff([(triton_y, ref_y), (state, ref_state)])
                if max_err > TOLERANCE[dtype]:
                    raise KernelMismatch(f"Triton selective_state_update differs from the reference by "
                                         f"{max_err:.2e} ({layout}, batch {batch}, {dtype_name})")
                # the kernel's unavoidable traffic: the state read and written once, x, dt, z, B, C in, y out
                nbytes = 2 * state.nbytes + 4 * x.nbytes + 2 * B.nbytes + A.nbytes
                # the state keeps changing between timed runs: fine, its values do not change the work
                triton_ms = median_ms(args.device, lambda: selective_state_update_triton(state, **inputs))
                torch_ms = median_ms(args.device, lambda: selective_state_update_ref(ref_state, **inputs))
                yield table_row(title, column, f"{layout}, {batch}", dtype_name, triton_ms, torch_ms, nbytes,
                                peak_gbs, max_err)


def linear_attention_inputs(batch, length, args, dtype):
    """elu + 1 features (what the mixer passes), a fresh-ish fp32 state and normalizer."""
    shape = (batch, args.linear_heads, length, args.linear_dim)
    q = torch.nn.functional.elu(torch.randn(shape, dtype=dtype, device=args.device)) + 1
    k = torch.nn.functional.elu(torch.randn(shape, dtype=dtype, device=args.device)) + 1
    v = torch.randn(shape, dtype=dtype, device=args.device)
    state = torch.randn(batch, args.linear_heads, args.linear_dim, args.linear_dim, device=args.device)
    normalizer = 100 + torch.rand(batch, args.linear_heads, args.linear_dim, device=args.device)
    return q, k, v, state, normalizer


def bench_linear_attention_step(args, peak_gbs) -> Iterator[dict]:
    column = "batch"
    title = (f"Linear attention decode step: {args.linear_heads} heads, dk = dv = {args.linear_dim}, "
             f"fp32 state and normalizer updated in place")
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for batch in args.batches:
            q, k, v, state, normalizer = linear_attention_inputs(batch, 1, args, dtype)
            q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
            ref_state, ref_normalizer = state.clone(), normalizer.clone()
            triton_out = linear_attention_step_triton(q, k, v, state, normalizer)
            ref_out = linear_attention_step_ref(q, k, v, ref_state, ref_normalizer)
            max_err = max_abs_diff([(triton_out, ref_out), (state, ref_state), (normalizer, ref_normalizer)])
            if max_err > TOLERANCE[dtype]:
                raise KernelMismatch(f"Triton linear-attention step differs from the reference by {max_err:.2e} "
                                     f"(batch {batch}, {dtype_name})")
            # the kernel's unavoidable traffic: state and normalizer read and written once, q, k, v in, out out
            nbytes = 2 * (state.nbytes + normalizer.nbytes) + 4 * q.nbytes
            triton_ms = median_ms(args.device, lambda: linear_attention_step_triton(q, k, v, state, normalizer))
            torch_ms = median_ms(args.device, lambda: linear_attention_step_ref(q, k, v, ref_state, ref_normalizer))
            yield table_row(title, column, str(batch), dtype_name, triton_ms, torch_ms, nbytes, peak_gbs, max_err)


def bench_linear_attention_prefill(args, peak_gbs) -> Iterator[dict]:
    length = args.prefill_tokens
    column = "batch"
    title = (f"Linear attention chunked prefill: {length} tokens, {args.linear_heads} heads, "
             f"dk = dv = {args.linear_dim}, chunk 64, from an fp32 initial state (the GB/s column counts "
             f"q, k, v, out and the states once: this kernel is not memory-bound)")
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for batch in args.batches:
            q, k, v, state, normalizer = linear_attention_inputs(batch, length, args, dtype)
            triton_result = linear_attention_chunked_triton(q, k, v, state, normalizer)
            ref_result = linear_attention_chunked_ref(q, k, v, state, normalizer)
            # outputs are O(1); the states are sums over the prefill: compare them relative to their size
            out_err = max_abs_diff([(triton_result[0], ref_result[0])])
            state_err = max((a - b).abs().max().item() / b.abs().max().item()
                            for a, b in zip(triton_result[1:], ref_result[1:]))
            if out_err > TOLERANCE[dtype] or state_err > 1e-4:
                raise KernelMismatch(f"Triton linear-attention prefill differs from the reference by {out_err:.2e} "
                                     f"(out), {state_err:.2e} (relative, states) (batch {batch}, {dtype_name})")
            nbytes = 4 * q.nbytes + 2 * (state.nbytes + normalizer.nbytes)
            triton_ms = median_ms(args.device, lambda: linear_attention_chunked_triton(q, k, v, state, normalizer))
            torch_ms = median_ms(args.device, lambda: linear_attention_chunked_ref(q, k, v, state, normalizer))
            yield table_row(title, column, str(batch), dtype_name, triton_ms, torch_ms, nbytes, peak_gbs, out_err)
            del q, k, v, triton_result, ref_result
            torch.cuda.empty_cache()


def bench_window(args, peak_gbs) -> Iterator[dict]:
    return bench_attention(args, peak_gbs, window=args.window)


# every table, in the order they print: each a generator of rows, (args, copy GB/s) -> rows
BENCHES = [bench_attention, bench_window, bench_mla, bench_write, bench_selective_state_update,
           bench_linear_attention_step, bench_linear_attention_prefill]


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/kernels_gpu.py times CUDA kernels, and this machine has no CUDA device "
                 "(torch.cuda.is_available() is False). Nothing was measured.")
    try:
        import triton
    except ImportError:
        sys.exit("benchmarks/kernels_gpu.py needs triton (pip install triton). Nothing was measured.")
    peak_gbs = copy_bandwidth_gbs(args.device)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (triton interpreter)"
    print(f"## archzoo kernels on {device_name} (torch {torch.__version__}, triton {triton.__version__})")
    print(f"\nMeasured copy bandwidth (1 GiB device copy, read + write): {peak_gbs:.0f} GB/s")
    try:
        for bench in BENCHES:
            for i, row in enumerate(bench(args, peak_gbs)):
                if i == 0:
                    print(f"\n{markdown_header(row)}")
                print(markdown_row(row), flush=True)
    except KernelMismatch as error:
        sys.exit(str(error))


if __name__ == "__main__":
    main()
