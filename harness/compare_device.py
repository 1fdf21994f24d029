"""What `zoo compare` decides by its device: the defaults a setting left unset takes there, and whether a cell's
cache fits the device's free memory before its engine allocates anything."""
import gc
from dataclasses import dataclass

import torch

from harness.engine.cache_pool import pool_bytes, size_cache

# device memory a cell keeps free beyond its cache: a step's activations, the graph pool, allocator slack
WORKING_BYTES = 4 * 2**30


@dataclass(frozen=True)
class DeviceDefaults:
    """What an unset compare setting becomes on a device; see device_defaults."""

    preset: str
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    dtype: str
    kv_cache: str
    measure: str
    new_tokens: int


# 64 new tokens on the CPU: a cell's decode steps follow its read sweep and its prefill, and on a VM whose L3 holds a
# `small` model's weights the first ~10 of them ran up to 2x slower while the L3 refilled (the read kernel ramps the
# same way after a 100 ms pause: 128 MB at 9, 21, 22 ... 26 GB/s over 8 passes, against 40 without it). With 16,
# the median step fell on that ramp: batch 1 at a median 1.80-1.90x its floor, 64 gave 1.59-1.62x, and TPOT
# 1.05-1.06x the median step instead of 1.10-1.13x, in the same ~3.3 minutes (2-core Xeon VM, BENCHMARKS.md).
CPU_DEFAULTS = DeviceDefaults(preset="small", contexts=(256, 1024, 2048),
                              batches=(1, 2, 4),  # 8 made the CPU default prefill-bound (BENCHMARKS.md)
                              dtype="float32", kv_cache="contiguous", measure="generate", new_tokens=64)
# One H100 in 65 s (measured 2026-11-26, BENCHMARKS.md "Issue 30"): the large preset streams its weights in over
# 1 ms, so the floor is HBM's; prefilling 64 x 32k tokens would take minutes, so the decode step is probed without it.
CUDA_DEFAULTS = DeviceDefaults(preset="large", contexts=(1024, 8192, 32768), batches=(1, 16, 64),
                               dtype="bfloat16", kv_cache="paged", measure="decode-probe", new_tokens=16)


def is_cuda(device) -> bool:
    """Whether `device` names a CUDA device (parsed only: no GPU needed); a bad name is validate's to report."""
    try:
        return isinstance(device, str) and torch.device(device).type == "cuda"
    except RuntimeError:  # torch's word for a string that names no device
        return False


def device_defaults(device) -> DeviceDefaults:
    return CUDA_DEFAULTS if is_cuda(device) else CPU_DEFAULTS


def cell_cache_bytes(model, cell: dict) -> int:
    """What the cell's engine will allocate for caches, sized as the engine sizes them (harness/engine/cache_pool.py:
    size_cache, pool_bytes), with the spare slot and blocks CUDA graphs pad a batch into."""
    specs, dtype = model.cache_specs(), next(model.parameters()).dtype
    max_seq_len = cell["context"] + cell["new_tokens"]
    batch, blocks = size_cache(specs, dtype, cell["kv_cache"], cell["batch"], max_seq_len, cell["block_size"], None,
                               None, kv_format=cell["kv_dtype"])
    return pool_bytes(specs, dtype, cell["kv_cache"], batch + 1, max_seq_len, cell["block_size"],
                      [n + 1 for n in blocks], cell["kv_dtype"])


def free_device_bytes(device: str) -> int | None:
    """Bytes a new engine can allocate on a CUDA device; None elsewhere (compare sizes no CPU cell against memory)."""
    if not is_cuda(device):
        return None
    gc.collect()  # the previous cell's engine may still be held by a reference cycle
    torch.cuda.empty_cache()  # and its blocks cached by the allocator, which mem_get_info counts as used
    return torch.cuda.mem_get_info(device)[0]


def memory_shortfall(cache_bytes: int, free_bytes: int | None) -> str:
    """Why a cell cannot run on the device ("" when it fits): its caches and WORKING_BYTES beyond the free memory."""
    if free_bytes is None or cache_bytes + WORKING_BYTES <= free_bytes:
        return ""
    return (f"does not fit in device memory: {cache_bytes / 1e9:.1f} GB of cache + {WORKING_BYTES / 1e9:.1f} GB "
            f"working room > {free_bytes / 1e9:.1f} GB free")


def skip_reason(model, cell: dict, device: str) -> str:
    """Why the cell is skipped ("" when it runs), decided before its engine allocates anything."""
    free = free_device_bytes(device)
    return "" if free is None else memory_shortfall(cell_cache_bytes(model, cell), free)
