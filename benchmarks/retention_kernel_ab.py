"""Interleaved A/B of the CPU decode-attention kernel before the retention policy (a window integer, revision
932970a) and after it (per-sequence span starts + sinks, this checkout): both built with the same flags, called in
turn in one process, outputs compared bit for bit. 16 sequences x 4096 keys, 8 query / 2 KV heads of 64, a
shuffled head-major paged pool; medians of 15 calls each, with and without a 1024-key window.

    python benchmarks/retention_kernel_ab.py
"""
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kernels.cpu_decode import FLAGS  # noqa: E402

BEFORE = "932970a"
BATCH, KEYS, HEADS, KV_HEADS, DIM, BLOCK = 16, 4096, 8, 2, 64, 16


def build() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    folder = Path(tempfile.mkdtemp())
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:kernels/cpu/decode_attention.c"],
                         capture_output=True, check=True, text=True).stdout
    (folder / "old.c").write_text(old)
    (folder / "new.c").write_text((ROOT / "kernels/cpu/decode_attention.c").read_text())
    (folder / "floats.h").write_text((ROOT / "kernels/cpu/floats.h").read_text())
    libraries = []
    for name, takes_starts in (("old", False), ("new", True)):
        subprocess.run(["cc", *FLAGS, str(folder / f"{name}.c"), "-o", str(folder / f"{name}.so"), "-lm"], check=True)
        lib = ctypes.CDLL(str(folder / f"{name}.so"))
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        span = [ptr, ptr, i64] if takes_starts else [ptr, i64]  # (seq_lens, starts, sinks) or (seq_lens, window)
        lib.decode_attention.argtypes = ([ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64] + span
                                         + [i32] * 6 + [ctypes.c_float, i32, ptr, i64, i64, i32, i32])
        libraries.append(lib)
    return libraries[0], libraries[1]


def main() -> None:
    old, new = build()
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    blocks = BATCH * KEYS // BLOCK
    for dtype, code in ((torch.float32, 0), (torch.bfloat16, 1)):
        k, v = (torch.randn(blocks, KV_HEADS, BLOCK, DIM).to(dtype).transpose(1, 2) for _ in range(2))
        table = torch.randperm(blocks).to(torch.int32).view(BATCH, KEYS // BLOCK).contiguous()
        lengths = torch.full((BATCH,), KEYS, dtype=torch.int32)
        q = torch.randn(BATCH, HEADS, DIM).to(dtype)

        def call(lib, window):
            out = torch.empty(BATCH, HEADS, DIM, dtype=dtype)
            strides = (k.stride(0), k.stride(1), k.stride(2))
            head = (q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), *strides, v.data_ptr(), *strides,
                    table.data_ptr(), table.stride(0), BLOCK, lengths.data_ptr())
            if lib is old:
                span = (window or 0,)
            else:
                starts = None if window is None else (lengths - window).clamp_min(0).to(torch.int32)
                span = (None if starts is None else starts.data_ptr(), 0)
            tail = (BATCH, HEADS, KV_HEADS, KV_HEADS, DIM, DIM, DIM**-0.5, max(1, 4 * threads // BATCH),
                    out.data_ptr(), out.stride(0), out.stride(1), code, threads)
            start = time.perf_counter()
            assert lib.decode_attention(*head, *span, *tail) == 0
            return time.perf_counter() - start, out

        for window in (None, 1024):
            before, after = [], []
            for _ in range(15):
                t_old, out_old = call(old, window)
                t_new, out_new = call(new, window)
                before.append(t_old)
                after.append(t_new)
            assert torch.equal(out_old, out_new), "the two kernels disagree"
            ratio = statistics.median(after) / statistics.median(before)
            print(f"{str(dtype)[6:]:8} window {window}: before {statistics.median(before) * 1e3:.2f} ms, "
                  f"after {statistics.median(after) * 1e3:.2f} ms, after/before {ratio:.3f}")


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
