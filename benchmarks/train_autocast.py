"""A `zoo train` step with and without bf16 autocast, on this machine: what `--autocast auto` chooses on CPU comes
from this (harness/train/settings.py, CPU_AUTOCAST). Two copies of the same model train on the same batches
(the trainer's own step: forward, backward, clipping, AdamW), interleaved step by step in one process so the
machine's drift falls on both; the median step of each is printed with its tokens/s.

    python benchmarks/train_autocast.py [--arch gqa] [--preset tiny] [--batch-size 32] [--context 256] [--steps 30]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo  # noqa: E402
from harness.train.corpus import load_corpus  # noqa: E402
from harness.train.settings import TrainSettings  # noqa: E402
from harness.train.trainer import Run, make_optimizer, train_step  # noqa: E402

WARMUP_STEPS = 10  # untimed: the allocator and the C kernels settle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TrainSettings()
    parser.add_argument("--arch", default=d.arch)
    parser.add_argument("--preset", default=d.preset)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--context", type=int, default=d.context)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per side")
    args = parser.parse_args()
    settings = TrainSettings(arch=args.arch, preset=args.preset, batch_size=args.batch_size, context=args.context)
    corpus = load_corpus()
    runs = {}
    for side in ("fp32", "bf16 autocast"):
        torch.manual_seed(0)
        model = zoo.build(args.arch, preset=args.preset).train()
        runs[side] = Run(settings, model, make_optimizer(model, settings.lr), corpus, {"step": 0})
    times = {side: [] for side in runs}
    for step in range(WARMUP_STEPS + args.steps):
        for side, run in runs.items():
            run.state["step"] = step
            start = time.perf_counter()
            train_step(run, settings.lr, use_autocast=side != "fp32")
            if step >= WARMUP_STEPS:
                times[side].append(time.perf_counter() - start)
    print(f"{args.arch}/{args.preset}, batch {args.batch_size} x context {args.context}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.steps} steps")
    print("| step | ms | tokens/s |")
    print("|---|---:|---:|")
    for side, seconds in times.items():
        median = statistics.median(seconds)
        print(f"| {side} | {1000 * median:.0f} | {args.batch_size * args.context / median:,.0f} |")


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        main()
