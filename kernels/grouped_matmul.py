"""Grouped matrix multiply for mixture-of-experts: each row multiplied by its own expert's weight, every expert's
rows in tiles that read that expert's weight tile once (a Triton kernel for CUDA beside the PyTorch reference).

    out[m] = x[source[m]] @ weight[experts[m]]^T      x [T, K], weight [E, N, K], experts [M], source [M] (default m)

The rows are (token, routed expert) pairs: `source` names each pair's token, so x is not copied per pair. Before the
kernel the rows are aligned by expert (vLLM's `moe_align_block_size` idea): sorted by expert and each expert's run
padded to a multiple of BLOCK_M rows, so a tile of rows belongs to one expert and the kernel loads one weight tile
for all of them. The aligned layout's size is bounded by M + E·(BLOCK_M − 1) whatever the routing, so every shape
follows from M and E alone: no host read, nothing data-dependent, and a graph-captured step can take it. Tiles past
the used ones are marked expert −1 and return at once.

`grouped_matmul` dispatches by kernels.dispatch.use_triton; elsewhere `grouped_matmul_ref`, a loop over the experts
present. Arithmetic in fp32 (tl.dot's "ieee" precision for fp32 inputs); output in x's dtype.
"""
from __future__ import annotations  # keeps the `tl.constexpr` annotations inert until triton is imported

import functools

import torch
import torch.nn.functional as F

from .dispatch import jit_kernels, use_triton
from .tiles import cdiv, padded

tl = None  # triton.language, bound by dispatch.jit_kernels on the first Triton call

BLOCK_M = 16  # rows a tile: the smallest tl.dot tile, so decode batches (a few pairs an expert) waste little padding


def _check_args(x, weight, experts, source) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"expected x [T, K] and weight [E, N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if experts.dim() != 1 or (source is not None and source.shape != experts.shape):
        raise ValueError(f"expected experts [M] and source [M] or None, got {tuple(experts.shape)} and "
                         f"{None if source is None else tuple(source.shape)}")
    if source is None and experts.shape[0] != x.shape[0]:
        raise ValueError(f"without source, experts names one expert per row of x: {experts.shape[0]} != {x.shape[0]}")


def grouped_matmul_ref(x, weight, experts, source=None) -> torch.Tensor:
    _check_args(x, weight, experts, source)
    rows = x if source is None else x[source]
    out = torch.zeros(experts.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    for e in experts.unique().tolist():
        mine = experts == e
        out[mine] = F.linear(rows[mine].float(), weight[e].float()).to(x.dtype)
    return out


def align_by_expert(experts: torch.Tensor, n_experts: int, block_m: int = BLOCK_M):
    """Rows sorted by expert, each expert's run padded to a multiple of block_m: (padded_rows [P] (row index, −1 for
    padding), tile_experts [P / block_m] (each tile's expert, −1 past the used tiles)), P = the bound
    M + n_experts·(block_m − 1) rounded up to block_m. Fixed shapes, computed on the device."""
    rows = experts.shape[0]
    size = cdiv(rows + n_experts * (block_m - 1), block_m) * block_m
    experts = experts.long()
    order = torch.argsort(experts, stable=True)
    # not bincount, whose output size is read from the data on the host
    counts = torch.zeros(n_experts, dtype=torch.int64, device=experts.device).index_add_(0, experts,
                                                                                          torch.ones_like(experts))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    sorted_experts = experts[order]
    rank = torch.arange(rows, device=experts.device) - (counts.cumsum(0) - counts)[sorted_experts]
    slots = (padded_ends - padded_counts)[sorted_experts] + rank
    padded_rows = torch.full((size,), -1, dtype=torch.int64, device=experts.device)
    padded_rows.scatter_(0, slots, order)
    tile_starts = torch.arange(0, size, block_m, device=experts.device)
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < n_experts, tile_experts, -1)
    return padded_rows, tile_experts


def _grouped_kernel(
    x_ptr, w_ptr, out_ptr, rows_ptr, tile_experts_ptr, source_ptr, K, N,
    stride_x_row, stride_x_k, stride_w_expert, stride_w_n, stride_w_k, stride_out_row, stride_out_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SOURCE: tl.constexpr,
):
    # one program per (tile of one expert's rows, tile of output columns): the expert's weight tile is loaded once
    # for all the tile's rows
    expert = tl.load(tile_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    slots = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + slots)
    row_ok = rows >= 0
    rows = tl.where(row_ok, rows, 0)
    tokens = tl.load(source_ptr + rows, mask=row_ok, other=0).to(tl.int64) if HAS_SOURCE else rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + tokens[:, None] * stride_x_row + ks[None, :] * stride_x_k,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + expert * stride_w_expert + cols[:, None] * stride_w_n + ks[None, :] * stride_w_k,
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        # "ieee": fp32 inputs would otherwise be rounded to tf32; ignored for 16-bit inputs
        acc += tl.dot(a, tl.trans(b), input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_out_row + cols[None, :] * stride_out_n,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@functools.cache
def _jitted_kernel():
    return jit_kernels(globals(), _grouped_kernel)[0]


def grouped_matmul_triton(x, weight, experts, source=None, block_n: int | None = None,
                          block_k: int | None = None) -> torch.Tensor:
    """block_n, block_k: output columns a program computes (default: all of them up to 128) and input columns a
    step multiplies (default 32: 64 costs ~230 registers a thread at 128 columns)."""
    _check_args(x, weight, experts, source)
    kernel = _jitted_kernel()
    n_experts, n_out, k = weight.shape
    block_n, block_k = block_n or min(128, padded(n_out)), block_k or 32
    padded_rows, tile_experts = align_by_expert(experts, n_experts)
    out = torch.empty(experts.shape[0], n_out, dtype=x.dtype, device=x.device)
    kernel[(tile_experts.shape[0], cdiv(n_out, block_n))](
        x, weight, out, padded_rows, tile_experts, experts if source is None else source, k, n_out,
        *x.stride(), *weight.stride(), *out.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, HAS_SOURCE=source is not None,
        num_warps=4 if block_n <= 64 else 8,  # 128 columns at 8 warps: ~150 registers a thread, no spills
    )
    return out


def grouped_matmul(x, weight, experts, source=None) -> torch.Tensor:
    if use_triton(x, weight, experts):
        return grouped_matmul_triton(x, weight, experts, source)
    return grouped_matmul_ref(x, weight, experts, source)
