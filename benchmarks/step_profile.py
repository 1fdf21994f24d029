"""Where one decode step's time goes: torch.profiler's per-kernel table for an engine's decode step, eager and (on
CUDA) graph-replayed, beside the step's wall time and its roofline floor's bytes.

    PYTHONPATH=. python3 benchmarks/step_profile.py --device cuda --preset large --out DIR   # a GPU visit
    PYTHONPATH=. python3 benchmarks/step_profile.py --device cpu --preset tiny               # the same on the CPU
    PYTHONPATH=. python3 benchmarks/step_profile.py --device cpu --preset small --compile    # eager and torch.compile'd

A decode step far above its floor is either launch-bound (the kernels' summed device time is far under the step's
wall time) or kernel-bound (their sum is near it; the table then says which kernels hold the time)."""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import zoo
from harness import roofline
from harness.compare_device import device_defaults
from harness.decode_probe import decode_probe
from harness.results import write_atomic

TOP_KERNELS = 15


def build(arch: str, preset: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = zoo.build(arch, preset=preset)
    return model.to(dtype).eval()


def profile_steps(probe, steps: int, device: str) -> tuple[str, float, float]:
    """(the kernel table, summed device (or CPU op) seconds per step, median wall seconds per step)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        walls = [probe.step() for _ in range(steps)]
    averages = prof.key_averages()
    sort = "device_time_total" if device == "cuda" else "self_cpu_time_total"
    table = averages.table(sort_by=sort, row_limit=TOP_KERNELS, max_name_column_width=70)
    if device == "cuda":  # the kernels' own rows: the CPU-side ops that launched them would count them twice
        total_us = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA)
    else:
        total_us = sum(e.self_cpu_time_total for e in averages)
    return table, total_us / 1e6 / steps, statistics.median(walls)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--arch", default="gqa")
    p.add_argument("--preset", default="large")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--kv-cache", choices=("paged", "contiguous"),
                   help="the cache layout (default: zoo compare's on the device, paged on CUDA, contiguous on the CPU)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="default: bfloat16 on CUDA, float32 on the CPU (zoo compare's defaults)")
    p.add_argument("--compile", action="store_true", help="profile the torch.compile'd step beside the eager one")
    p.add_argument("--out", type=Path, help="folder for step_profile.md (printed either way)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype or device_defaults(args.device).dtype)
    model = build(args.arch, args.preset, args.device, dtype)
    cost = roofline.decode_step_cost(model, args.batch, args.context)
    parts = [f"# Decode step profile: {args.arch} `{args.preset}`, batch {args.batch}, context {args.context}, "
             f"{str(dtype).removeprefix('torch.')}, {args.device}"
             + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""),
             f"The step must read {cost.bytes / 1e9:.3f} GB (weights and cache) and do {cost.flops / 1e9:.2f} GFLOP."]
    kv_cache = args.kv_cache or device_defaults(args.device).kv_cache
    modes = [("eager", False, False)] + ([("graph replay", True, False)] if args.device == "cuda" else [])
    modes += [("compiled", False, True)] if args.compile else []
    for label, graphs, compiled in modes:
        probe = decode_probe(model, args.batch, args.context, kv_cache, 16, compile=compiled, cuda_graphs=graphs)
        probe.median_step(3, warmup=2)  # captures and compiles outside the profile
        start = time.perf_counter()
        table, busy_s, wall_s = profile_steps(probe, args.steps, args.device)
        parts.append(f"## {label}, {kv_cache} cache: step {wall_s * 1e3:.3f} ms wall (median of {args.steps}, "
                     "profiled); "
                     f"{'kernels' if args.device == 'cuda' else 'CPU ops'} {busy_s * 1e3:.3f} ms per step "
                     f"({busy_s / wall_s:.0%} of the wall time); read rate implied by the step: "
                     f"{cost.bytes / wall_s / 1e9:.0f} GB/s, by the kernels' time alone: "
                     f"{cost.bytes / busy_s / 1e9:.0f} GB/s ({time.perf_counter() - start:.1f} s to profile)\n\n"
                     f"```\n{table}\n```")
        del probe
    text = "\n\n".join(parts) + "\n"
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "step_profile.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
