"""Measured decode step vs its analytic roofline floor: every causal architecture at the `base` size.

Each cell (architecture x batch x context x layout x dtype) times the engine's decode step (harness.decode_probe:
caches filled at random as if `batch` prompts of `context` tokens had been prefilled, the context held fixed;
one warm-up step, then the median of --steps) and sets it beside the floor of that step
(harness.roofline: max(bytes / streaming rate, FLOPs / matmul rate), bytes = weights + cache read + cache written),
with both rates measured once per dtype per run. Rows go to OUT/results.jsonl as each cell finishes (a re-run skips
finished cells); a Markdown table is printed at the end and the chart written to --figure.

    python benchmarks/roofline.py                                   # the whole grid, CPU (hours)
    python benchmarks/roofline.py --archs gqa,mamba --batches 1 --contexts 512 --dtypes float32
    python benchmarks/roofline.py --device cuda --compile           # torch.compile'd decode step
"""
import argparse
import gc
import sys
from pathlib import Path

import torch

import zoo
from harness import roofline
from harness.engine.cache_pool import LAYOUTS
from harness.charts import floor_bars, plt
from harness.decode_probe import HEADROOM, decode_probe
from harness.results import ResultStore

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
CELL_KEY = ("arch", "preset", "batch", "context", "kv_cache", "dtype", "device", "compile", "block_size")
TABLE = [("arch", "arch", "{}"), ("dtype", "dtype", "{}"), ("batch", "batch", "{}"), ("context", "context", "{}"),
         ("layout", "kv_cache", "{}"), ("step p50 (ms)", "step_ms_p50", "{:.2f}"), ("floor (ms)", "floor_ms", "{:.2f}"),
         ("x floor", "fraction_of_floor", "{:.1f}"), ("bound", "bound", "{}"), ("MBU", "mbu", "{:.0%}"),
         ("MFU", "mfu", "{:.0%}"), ("weights MB", "weight_mb", "{:.1f}"), ("cache read MB", "cache_read_mb", "{:.1f}")]


def names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def ints(text: str) -> list[int]:
    try:
        return [int(part) for part in names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    causal = ",".join(a for a in zoo.architectures() if zoo.is_causal(a))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", type=names, default=names(causal), help=f"comma-separated (default: every causal one: {causal})")
    p.add_argument("--batches", type=ints, default=[1, 16], help="comma-separated batch sizes (default: 1,16)")
    p.add_argument("--contexts", type=ints, default=[512, 4096], help="comma-separated cached tokens (default: 512,4096)")
    p.add_argument("--layouts", type=names, default=list(LAYOUTS), help=f"KV cache layouts (default: {','.join(LAYOUTS)})")
    p.add_argument("--dtypes", type=names, default=list(DTYPES), help=f"comma-separated (default: {','.join(DTYPES)})")
    p.add_argument("--preset", default="base", help="model size (default: base)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--compile", action="store_true", help="Engine(compile=True): torch.compile'd decode step")
    p.add_argument("--steps", type=int, default=7, help="timed decode steps per cell, median (default: 7)")
    p.add_argument("--block-size", type=int, default=16, help="paged layout: tokens per block (default: 16)")
    p.add_argument("--out", default="results/roofline", help="results folder (default: results/roofline)")
    p.add_argument("--figure", default=None, help="chart path (default: docs/figures/roofline_decode.png, "
                                                  "roofline_decode_compiled.png with --compile)")
    return p


def validate(args) -> None:
    """Every bad argument is reported, naming it and what is allowed, before any model is built."""
    for arch in args.archs:
        zoo.registry.check_architecture(arch)
        if not zoo.is_causal(arch):
            causal = [a for a in zoo.architectures() if zoo.is_causal(a)]
            raise ValueError(f"architecture {arch!r} is not causal (no decode step to time); allowed: {', '.join(causal)}")
    for dtype in args.dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    for layout in args.layouts:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    zoo.presets.preset_settings(args.preset)
    if not (args.archs and args.dtypes and args.layouts and args.batches and args.contexts):
        raise ValueError("every axis needs at least one value (--archs, --batches, --contexts, --layouts, --dtypes)")
    if min(args.batches) < 1 or min(args.contexts) < 1 or args.steps < 1:
        raise ValueError(f"batches, contexts and steps must be >= 1, got {args.batches}, {args.contexts}, {args.steps}")
    limit = zoo.PRESETS[args.preset].max_seq_len
    if max(args.contexts) + HEADROOM > limit:
        raise ValueError(f"context {max(args.contexts)} + {HEADROOM} exceeds the {args.preset!r} preset's max_seq_len={limit}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {args.device!r} requested but CUDA is not available")


def cells(args) -> list[dict]:
    """Grouped by (dtype, arch) so each model is built once."""
    return [{"arch": a, "preset": args.preset, "batch": b, "context": c, "kv_cache": layout, "dtype": d,
             "device": args.device, "compile": args.compile, "block_size": args.block_size}
            for d in args.dtypes for a in args.archs for b in args.batches for c in args.contexts for layout in args.layouts]


def build(arch: str, args, dtype: str):
    torch.manual_seed(0)
    return zoo.build(arch, preset=args.preset).to(device=args.device, dtype=DTYPES[dtype]).eval()


def measure(model, cell: dict, rates: roofline.MachineRates, steps: int) -> dict:
    probe = decode_probe(model, cell["batch"], cell["context"], cell["kv_cache"], cell["block_size"], cell["compile"])
    seconds = probe.median_step(steps)
    cost = roofline.decode_step_cost(model, cell["batch"], cell["context"])
    floor = roofline.floor_seconds(cost, rates)
    return {**cell, "step_ms_p50": 1000 * seconds, "floor_ms": 1000 * floor, "bound": roofline.bound(cost, rates),
            "fraction_of_floor": seconds / floor, "mbu": roofline.mbu(cost, seconds, rates),
            "mfu": roofline.mfu(cost, seconds, rates), "weight_mb": cost.weight_bytes / 1e6,
            "cache_read_mb": cost.cache_read_bytes / 1e6, "cache_write_mb": cost.cache_write_bytes / 1e6,
            "step_flops": cost.flops, "steps": steps, "threads": torch.get_num_threads(), **rates.row_fields(),
            "stream_gb_s": rates.stream_rate(cost.bytes) / 1e9}  # the read rate for this step's bytes: its floor's


def run(args) -> list[dict]:
    store = ResultStore(Path(args.out) / "results.jsonl", CELL_KEY)
    todo = [c for c in cells(args) if not store.done(c)]
    rates, model, built = {}, None, None
    for i, cell in enumerate(todo, 1):
        if cell["dtype"] not in rates:  # once per dtype per run, on the gqa weights at this size
            rates[cell["dtype"]] = roofline.measure_machine(build("gqa", args, cell["dtype"]), args.device)
            r = rates[cell["dtype"]]
            print(f"{cell['dtype']}: memory read {r.stream_bytes_per_s / 1e9:.1f} GB/s past any cache, "
                  f"{r.matmul_flops_per_s / 1e9:.1f} GFLOP/s matmul, torch's GEMV {r.gemv_bytes_per_s / 1e9:.1f} GB/s "
                  f"({r.how})", flush=True)
        if built != (cell["arch"], cell["dtype"]):
            model, built = None, None
            gc.collect()
            model, built = build(cell["arch"], args, cell["dtype"]), (cell["arch"], cell["dtype"])
        row = measure(model, cell, rates[cell["dtype"]], args.steps)
        store.append(row)
        gc.collect()  # the cell's engine and its caches
        print(f"[{i}/{len(todo)}] {cell['arch']} {cell['dtype']} batch {cell['batch']} context {cell['context']} "
              f"{cell['kv_cache']}: {row['step_ms_p50']:.2f} ms/step, floor {row['floor_ms']:.2f} ms "
              f"({row['bound']}), {row['fraction_of_floor']:.1f}x", flush=True)
    wanted = {store.key(c) for c in cells(args)}
    return [r for r in store.rows if store.key(r) in wanted]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(t for t, _, _ in TABLE) + " |",
             "|" + "|".join("---" if k in ("arch", "dtype", "kv_cache", "bound") else "---:" for _, k, _ in TABLE) + "|"]
    lines += ["| " + " | ".join(fmt.format(r[k]) for _, k, fmt in TABLE) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def chart(rows: list[dict], path: Path) -> Path:
    """A panel per (batch, context) (rows) and dtype (columns): per architecture a bar per layout, floor marked."""
    shapes = sorted({(r["batch"], r["context"]) for r in rows})
    dtypes = sorted({r["dtype"] for r in rows})
    n_archs = len({r["arch"] for r in rows})
    fig, axes = plt.subplots(len(shapes), len(dtypes), dpi=130, squeeze=False,
                             figsize=(max(5.5, 0.55 * n_archs + 1.8) * len(dtypes), 2.7 * len(shapes) + 0.9))
    for (batch, context), line in zip(shapes, axes):
        for dtype, ax in zip(dtypes, line):
            panel = [r for r in rows if (r["batch"], r["context"], r["dtype"]) == (batch, context, dtype)]
            if not panel:
                ax.set_visible(False)
                continue
            floor_bars(ax, panel, "kv_cache", str)
            ax.set_title(f"{dtype}, batch {batch}, context {context} (read {panel[0]['stream_gb_s']:.1f} GB/s, "
                         f"{panel[0]['matmul_gflop_s']:.0f} GFLOP/s)", fontsize=8.5)
            ax.set_ylabel("decode step (ms)")
    handles, labels = next(ax for ax in axes.flat if ax.get_visible()).get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncols=len(labels), fontsize=8, frameon=False)
    r = rows[0]
    fig.suptitle(f"Decode step vs roofline floor, {r['preset']} size, {r['device']}"
                 f"{', torch.compile' if r['compile'] else ''} (label: measured / floor)", x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        validate(args)
    except ValueError as error:
        print(f"roofline: error: {error}", file=sys.stderr)
        return 2
    rows = run(args)
    print(markdown(rows))
    figure = Path(args.figure or f"docs/figures/roofline_decode{'_compiled' if args.compile else ''}.png")
    print(f"wrote {Path(args.out) / 'results.jsonl'}, {chart(rows, figure)}")
    return 0


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        status = main()
    sys.exit(status)
