"""Memory a user's numbers ask for, checked against a limit before torch is asked for it.

Every size a user chooses (a config's widths and depth, an engine's pool, a training batch) is first priced in
bytes by a formula and then checked here, so a request for 10^15 bytes is a ValueError naming the field, the bytes
and the limit rather than an allocator failure halfway through a build (or a machine out of memory).

The limit is the memory the device has free now (a GPU's free memory; on CPU, the kernel's MemAvailable), or the
bytes in the ZOO_MEMORY_LIMIT environment variable when set (a deployment that shares the machine sets it lower;
a test sets it to a few MB).
"""
import os

import torch

LIMIT_VARIABLE = "ZOO_MEMORY_LIMIT"


def available_bytes(device) -> int:
    """The memory free on `device` now: a GPU's free memory (with what torch's caching allocator holds unused, which
    mem_get_info counts as used but torch allocates from first), or the CPU's MemAvailable (physical memory where the
    kernel does not report it)."""
    device = torch.device(device)
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_limit(device) -> tuple[int, str]:
    """(bytes, where the figure comes from): ZOO_MEMORY_LIMIT if set, else the device's free memory."""
    text = os.environ.get(LIMIT_VARIABLE)
    if text is not None:
        try:
            limit = int(text)
        except ValueError:
            limit = -1
        if limit < 0:
            raise ValueError(f"{LIMIT_VARIABLE} must be a number of bytes >= 0, got {text!r}")
        return limit, f"the {LIMIT_VARIABLE} limit"
    return available_bytes(device), f"this {torch.device(device).type} device's free memory"


def check_bytes(what: str, nbytes: int, device, lower: str) -> None:
    """Refuse `what` (e.g. "the model's parameters (d_model=10**9, ...)") if its nbytes exceed the limit; `lower`
    says which fields to lower."""
    limit, source = memory_limit(device)
    if nbytes > limit:
        raise ValueError(f"{what} would take {nbytes:,} B, more than {source} ({limit:,} B): lower {lower}")
