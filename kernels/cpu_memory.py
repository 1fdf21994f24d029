"""CPU tensors in 2 MiB pages: a private anonymous mapping advised MADV_HUGEPAGE (Linux's transparent huge pages,
granted in the kernel's "always" and "madvise" modes), seen by torch through torch.frombuffer; torch's own
allocation where the platform has no such advice. An engine's runner moves a CPU model's weights here
(harness/engine/model_runner.py's place_weights) and its caches are allocated here (`zeros`).

Why: a decode step reads its weights and caches from memory once a step, and the rate memory is read at depends on
its pages. On the 2-core EPYC VM, one process, the read kernel (kernels/cpu/read_bandwidth.c) over a `small` gqa
model's fp32 weights where torch put them (4 KiB pages, long-lived): 24-29 GB/s; over the same weights copied into
one 2 MiB-page region: 36-46 (10 rounds each); the decode step fell 4.30 -> 3.80 ms (batch 1, context 256; the
median of 10 rounds of 15 steps), mamba's 6.32 -> 5.87, gqa's at batch 4 and context 1024 7.35 -> 6.66. The caches
there too, against the weights alone (old and new processes alternating, three rounds): mha at batch 1 and context
2048 7.3-7.9 against 8.3-8.6 ms, gqa at batch 4 and 2048 8.1-8.3 against 8.7-8.9 (mla's small latent cache: no
change). A page walk every 4 KiB, through a guest's and its host's tables, is what a 2 MiB page saves. The floor's
read buffer (harness/roofline.py) lies in such pages too, so it prices the rate this memory gives, not a rate no
step's memory could reach or one its memory beats.
"""
import ctypes
import math
import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
LINE = 64  # each tensor placed on a cache line, as torch's allocator places it (the C kernels read whole lines)


def huge_pages_off() -> str:
    """Why advised memory would not get huge pages here ("" where it may): no such advice on this platform, or the
    kernel's transparent huge pages set to never."""
    if getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return "this platform has no MADV_HUGEPAGE advice"
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return f"the kernel does not say its transparent huge page mode ({THP_MODE} unreadable)"
    if "[always]" in mode or "[madvise]" in mode:
        return ""
    return f"the kernel's transparent huge pages are off ({mode.strip()})"


def huge_page_region(nbytes: int) -> memoryview | None:
    """nbytes of uninitialised memory starting on a 2 MiB boundary, advised into huge pages (the kernel may still grant
    4 KiB ones: no error, only no gain); None where the platform has no such advice. The mapping lives as long as any
    view of it (a memoryview, or a tensor over one)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(advice)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE
    return memoryview(region)[start:start + nbytes]


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """huge_page_region's memory as a uint8 CPU tensor (torch.empty where there is none)."""
    region = huge_page_region(nbytes) if nbytes else None
    return torch.empty(nbytes, dtype=torch.uint8) if region is None else torch.frombuffer(region, dtype=torch.uint8)


def zeros(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros(*shape, dtype=dtype, device=device), in 2 MiB pages on a CPU where the kernel grants them: the
    engine's caches, which a decode step reads every step (less than one such page: torch's). A fresh mapping is
    zeros already; each page is written once here all the same, as torch.zeros writes them, so no first write in a
    timed decode step faults in (and zeroes) 2 MiB: left to the steps, TPOT at batch 1 measured 1.35x the median
    step in a `zoo compare` cell (mha, context 1024)."""
    nbytes = math.prod(shape) * dtype.itemsize
    wanted = torch.device(device).type == "cpu" and nbytes >= HUGE_PAGE and not huge_pages_off()  # less: no page gained
    region = huge_page_region(nbytes) if wanted else None
    if region is None:
        return torch.zeros(*shape, dtype=dtype, device=device)
    memory = torch.frombuffer(region, dtype=torch.uint8)
    memory[::mmap.PAGESIZE].zero_()  # a write in every page maps it now
    return memory.view(dtype).view(shape)


def movable(model: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of `model` that place_on_huge_pages moves: each CPU tensor (a tied one once) that is
    contiguous, not empty, the only tensor over its whole storage (a view, or a storage two tensors share, stays where
    it is), in memory torch allocated itself (a resizable storage: not a region already placed, not a mapped file)
    and not in shared memory (another process may map it)."""
    tensors = list({id(t): t for t in (*model.parameters(), *model.buffers())}.values())
    storages: dict[int, int] = {}
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        storages[key] = storages.get(key, 0) + 1
    return [t for t in tensors
            if t.device.type == "cpu" and t.is_contiguous() and t.numel() and not t.is_shared()
            and t.untyped_storage().resizable() and t.untyped_storage().nbytes() == t.nbytes
            and storages[t.untyped_storage().data_ptr()] == 1]


def placed_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes the region for `tensors` takes: each on a whole cache line."""
    return sum(-(-t.nbytes // LINE) * LINE for t in tensors)


@torch.no_grad()
def place_on_huge_pages(tensors: list[torch.Tensor]) -> None:
    """Copy `tensors` (movable's) into one 2 MiB-page region, each in place: every tensor keeps its object (a module,
    an optimizer or a plan that holds it holds the same tensor), its data now in the region. Each gets a storage of
    its own over its stretch of the region, so nothing sees them as sharing memory (safetensors refuses to save
    tensors that share a storage none of them covers); the old storages are freed where nothing else holds them."""
    region = huge_page_region(placed_bytes(tensors))
    if region is None:
        return
    offset = 0
    for t in tensors:
        view = torch.frombuffer(region[offset:offset + t.nbytes], dtype=torch.uint8).view(t.dtype).view(t.shape)
        view.copy_(t)
        t.data = view
        offset += -(-t.nbytes // LINE) * LINE
