"""A block's halves as one call each (kernels/cpu_blocks.py) against the modules' own path, on an eager CPU decode
step, as an interleaved A/B in one process.

Each cell builds one model and one engine (harness.decode_probe); its steps alternate between the fused halves (the
engine's plan of them, zoo/decode_plan.py) and the modules' path (each mixer's and feed-forward's `decode_half`
answering None, as where a half does not apply), so a neighbour's load on a shared machine falls on both alike. Rows
go to OUT/results.jsonl as each cell finishes (a re-run skips finished cells) and a Markdown table is printed at the
end.

    python benchmarks/fused_halves.py        # the compare default's architectures x batch 1, 4 x context 256, fp32
    python benchmarks/fused_halves.py --archs mamba2,mla --batches 1 --contexts 2048 --dtypes bfloat16
"""
import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

import zoo
from harness.decode_probe import decode_probe
from harness.results import ResultStore
from roofline import DTYPES, ints, names, validate  # the same axes, checked the same way

CELL_KEY = ("arch", "preset", "batch", "context", "dtype")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", type=names, default=zoo.compare_defaults(), help="default: zoo compare's")
    p.add_argument("--batches", type=ints, default=[1, 4], help="default: 1,4")
    p.add_argument("--contexts", type=ints, default=[256], help="default: 256")
    p.add_argument("--dtypes", type=names, default=["float32"], help="default: float32")
    p.add_argument("--preset", default="small", choices=list(zoo.PRESETS), help="default: small")
    p.add_argument("--rounds", type=int, default=8, help="fused / module-path alternations per cell (default: 8)")
    p.add_argument("--steps", type=int, default=15, help="steps a round measures, after 3 untimed (default: 15)")
    p.add_argument("--out", default="results/fused_halves", help="results folder")
    p.set_defaults(device="cpu", layouts=["contiguous"])  # roofline.validate's checks; the fused halves are CPU's
    return p


def fused_classes(model) -> set[type]:
    """The classes of the model's mixers and feed-forwards that offer a fused half."""
    return {type(m) for block in model.blocks for m in (block.mixer, block.mlp) if hasattr(m, "decode_half")}


@contextlib.contextmanager
def module_path(classes: set[type]):
    """Every half of these classes answers None for the duration: the block runs its norm and module."""
    saved = {cls: cls.__dict__["decode_half"] for cls in classes}
    try:
        for cls in classes:
            cls.decode_half = lambda *args: None
        yield
    finally:
        for cls, method in saved.items():
            cls.decode_half = method


def measure(model, cell: dict, rounds: int, steps: int) -> dict:
    probe = decode_probe(model, cell["batch"], cell["context"], "contiguous")
    classes = fused_classes(model)
    times = {"fused": [], "modules": []}
    for _ in range(rounds):
        times["fused"].append(probe.median_step(steps, warmup=3))
        with module_path(classes):
            times["modules"].append(probe.median_step(steps, warmup=3))
    fused, modules = (1000 * statistics.median(times[side]) for side in ("fused", "modules"))
    ratios = sorted(f / m for f, m in zip(times["fused"], times["modules"]))
    return {**cell, "fused_ms_p50": fused, "modules_ms_p50": modules, "fused_over_modules": fused / modules,
            "paired_ratio_p50": statistics.median(ratios), "rounds": rounds, "steps": steps,
            "classes": sorted(cls.__name__ for cls in classes), "threads": torch.get_num_threads()}


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        validate(args)
        if args.rounds < 1 or args.steps < 1:
            raise ValueError(f"rounds and steps must be >= 1, got {args.rounds} and {args.steps}")
    except ValueError as error:
        print(f"fused_halves: error: {error}", file=sys.stderr)
        return 2
    store = ResultStore(Path(args.out) / "results.jsonl", CELL_KEY)
    cells = [{"arch": a, "preset": args.preset, "batch": b, "context": c, "dtype": d}
             for d in args.dtypes for a in args.archs for b in args.batches for c in args.contexts]
    for i, cell in enumerate(cells, 1):
        if store.done(cell):
            continue
        torch.manual_seed(0)
        model = zoo.build(cell["arch"], preset=args.preset).to(DTYPES[cell["dtype"]]).eval()
        row = measure(model, cell, args.rounds, args.steps)
        store.append(row)
        print(f"[{i}/{len(cells)}] {cell['arch']} {cell['dtype']} batch {cell['batch']} context {cell['context']}: "
              f"fused {row['fused_ms_p50']:.2f} ms, modules {row['modules_ms_p50']:.2f} ms "
              f"(paired ratio {row['paired_ratio_p50']:.3f})", flush=True)
    wanted = {store.key(c) for c in cells}
    print("| arch | dtype | batch | context | modules' path ms | fused ms | paired fused / modules |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in (r for r in store.rows if store.key(r) in wanted):
        print(f"| {r['arch']} | {r['dtype']} | {r['batch']} | {r['context']} | {r['modules_ms_p50']:.2f} "
              f"| {r['fused_ms_p50']:.2f} | {r['paired_ratio_p50']:.3f} |")
    return 0


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        status = main()
    sys.exit(status)
