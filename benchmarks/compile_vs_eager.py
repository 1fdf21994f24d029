"""Compiled vs eager decode step, each cell measured as an interleaved A/B in one process.

For each cell, one model gets two engines (harness.decode_probe): eager and `compile=True`. After both warm up
(the compiled one compiles), their steps alternate, so a neighbour's load on this shared machine falls on both
alike; the row records each one's median and their ratio. Rows go to OUT/results.jsonl as each cell finishes (a
re-run skips finished cells) and a Markdown table is printed at the end.

    python benchmarks/compile_vs_eager.py                          # gqa, mqa, mamba2 x batch 1,16 x context 4096, fp32
    python benchmarks/compile_vs_eager.py --archs mha --dtypes bfloat16 --contexts 512,4096
"""
import argparse
import gc
import statistics
import sys
from pathlib import Path

import torch

import zoo
from harness.decode_probe import decode_probe
from harness.results import ResultStore

CELL_KEY = ("arch", "preset", "batch", "context", "kv_cache", "dtype", "block_size")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def comma_list(kind):
    def parse(text: str) -> list:
        try:
            return [kind(part) for part in text.split(",") if part]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", type=comma_list(str), default=["gqa", "mqa", "mamba2"], help="default: gqa,mqa,mamba2")
    p.add_argument("--batches", type=comma_list(int), default=[1, 16], help="default: 1,16")
    p.add_argument("--contexts", type=comma_list(int), default=[4096], help="default: 4096")
    p.add_argument("--layouts", type=comma_list(str), default=["contiguous", "paged"], help="default: contiguous,paged")
    p.add_argument("--dtypes", type=comma_list(str), default=["float32"], help="default: float32")
    p.add_argument("--preset", default="base", choices=list(zoo.PRESETS), help="default: base")
    p.add_argument("--block-size", type=int, default=16, help="paged block size (default: 16)")
    p.add_argument("--pairs", type=int, default=7, help="eager/compiled step pairs per cell (default: 7)")
    p.add_argument("--out", default="results/compile_vs_eager", help="results folder")
    return p


def validate(args) -> None:
    """Every bad argument is named with what is allowed before any model is built."""
    for arch in args.archs:
        zoo.registry.check_architecture(arch)
        if not zoo.is_causal(arch):
            raise ValueError(f"architecture {arch!r} has no decode step; allowed: causal architectures (`zoo list`)")
    for dtype in args.dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    for layout in args.layouts:
        if layout not in ("contiguous", "paged"):
            raise ValueError(f"unknown layout {layout!r}; allowed: contiguous, paged")
    if not (args.archs and args.batches and args.contexts and args.layouts and args.dtypes):
        raise ValueError("every axis needs at least one value")
    if min(args.batches) < 1 or min(args.contexts) < 1 or args.pairs < 1:
        raise ValueError(f"batches, contexts and pairs must be >= 1, got {args.batches}, {args.contexts}, {args.pairs}")


def measure(model, cell: dict, pairs: int) -> dict:
    probes = {mode: decode_probe(model, cell["batch"], cell["context"], cell["kv_cache"], cell["block_size"],
                                 compile=mode == "compiled") for mode in ("eager", "compiled")}
    for probe in probes.values():
        probe.step()  # the compiled engine compiles here
        probe.step()
    times = {mode: [] for mode in probes}
    for _ in range(pairs):
        for mode, probe in probes.items():
            times[mode].append(probe.step())
    eager, compiled = (1000 * statistics.median(times[mode]) for mode in ("eager", "compiled"))
    return {**cell, "eager_ms_p50": eager, "compiled_ms_p50": compiled, "compiled_over_eager": compiled / eager,
            "pairs": pairs, "threads": torch.get_num_threads()}


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        validate(args)
    except ValueError as error:
        print(f"compile_vs_eager: error: {error}", file=sys.stderr)
        return 2
    store = ResultStore(Path(args.out) / "results.jsonl", CELL_KEY)
    cells = [{"arch": a, "preset": args.preset, "batch": b, "context": c, "kv_cache": layout, "dtype": d,
              "block_size": args.block_size}
             for d in args.dtypes for a in args.archs for b in args.batches for c in args.contexts for layout in args.layouts]
    for i, cell in enumerate(cells, 1):
        if store.done(cell):
            continue
        torch.manual_seed(0)
        model = zoo.build(cell["arch"], preset=args.preset).to(DTYPES[cell["dtype"]]).eval()
        row = measure(model, cell, args.pairs)
        store.append(row)
        del model
        gc.collect()
        torch._dynamo.reset()  # each cell compiles its own model; do not let dynamo's caches pile up
        print(f"[{i}/{len(cells)}] {cell['arch']} {cell['dtype']} batch {cell['batch']} context {cell['context']} "
              f"{cell['kv_cache']}: eager {row['eager_ms_p50']:.1f} ms, compiled {row['compiled_ms_p50']:.1f} ms "
              f"({row['compiled_over_eager']:.2f}x)", flush=True)
    wanted = {store.key(c) for c in cells}
    print("| arch | dtype | batch | context | layout | eager ms | compiled ms | compiled / eager |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for r in (r for r in store.rows if store.key(r) in wanted):
        print(f"| {r['arch']} | {r['dtype']} | {r['batch']} | {r['context']} | {r['kv_cache']} | {r['eager_ms_p50']:.1f} "
              f"| {r['compiled_ms_p50']:.1f} | {r['compiled_over_eager']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
