"""Shared setup for the kernel tests: device choice, forcing the Triton path, paged-cache builder."""

import math
import os
from dataclasses import dataclass

import pytest
import torch

# Without CUDA the Triton path runs in triton's CPU interpreter. triton reads this variable when it is
# imported, which kernels/ defers to the first Triton call (after collection), so this is early enough.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import FORCE_TRITON_ENV  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def force_triton(monkeypatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")


@dataclass
class PagedCache:
    k_pool: torch.Tensor  # [num_blocks, block_size, KVH, Dk]
    v_pool: torch.Tensor  # [num_blocks, block_size, KVH, Dv]
    block_table: torch.Tensor  # [B, max_blocks] int32, -1 in unused entries
    seq_lens: torch.Tensor  # [B] int32


def build_paged_cache(seq_lens, block_size, num_kv_heads, dim_k, dim_v, dtype, device, retention=None,
                      head_major=False) -> PagedCache:
    """Random K/V for each sequence in shuffled pool blocks; every slot no sequence owns holds NaN,
    so a kernel that reads past a sequence's end or into a foreign block produces NaN.

    With a retention policy (cache.Retention), as the engine leaves it: blocks wholly among the dropped positions
    are back in the pool (table entry -1, contents NaN), and dropped positions in kept blocks hold NaN too.
    head_major: the pools are stored [num_blocks, KVH, block_size, D] and handed over as transposed views, as the
    engine keeps them.
    """
    generator = torch.Generator().manual_seed(sum(seq_lens) + block_size)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks nobody owns
    k_pool = torch.full((num_blocks, block_size, num_kv_heads, dim_k), float("nan"))
    v_pool = torch.full((num_blocks, block_size, num_kv_heads, dim_v), float("nan"))
    block_table = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    shuffled_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    for seq, (seq_len, num_seq_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        dead = range(0) if retention is None else retention.dead_blocks(seq_len, block_size)
        lo, hi = (0, 0) if retention is None else retention.dropped(seq_len)
        for entry in [e for e in range(num_seq_blocks) if e not in dead]:
            block = shuffled_blocks.pop()
            block_table[seq, entry] = block
            filled = min(block_size, seq_len - entry * block_size)
            k_pool[block, :filled] = torch.randn(filled, num_kv_heads, dim_k, generator=generator)
            v_pool[block, :filled] = torch.randn(filled, num_kv_heads, dim_v, generator=generator)
            first = entry * block_size  # dropped positions inside this kept block
            hidden = slice(max(lo, first) - first, max(0, min(hi, first + block_size) - first))
            k_pool[block, hidden] = v_pool[block, hidden] = float("nan")
    if head_major:
        k_pool, v_pool = (pool.transpose(1, 2).contiguous().transpose(1, 2) for pool in (k_pool, v_pool))
    return PagedCache(
        k_pool=k_pool.to(device, dtype),  # .to keeps the strides
        v_pool=v_pool.to(device, dtype),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


@pytest.fixture
def paged_cache():
    return build_paged_cache
