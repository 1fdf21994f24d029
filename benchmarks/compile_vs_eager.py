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
from harness.engine.cache_pool import LAYOUTS
from harness.decode_probe import decode_probe
from harness.results import ResultStore
from roofline import DTYPES, ints, names, validate  # the same axes, checked the same way

CELL_KEY = ("arch", "preset", "batch", "context", "kv_cache", "dtype", "block_size")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", type=names, default=["gqa", "mqa", "mamba2"], help="default: gqa,mqa,mamba2")
    p.add_argument("--batches", type=ints, default=[1, 16], help="default: 1,16")
    p.add_argument("--contexts", type=ints, default=[4096], help="default: 4096")
    p.add_argument("--layouts", type=names, default=list(LAYOUTS), help=f"default: {','.join(LAYOUTS)}")
    p.add_argument("--dtypes", type=names, default=["float32"], help="default: float32")
    p.add_argument("--preset", default="base", choices=list(zoo.PRESETS), help="default: base")
    p.add_argument("--block-size", type=int, default=16, help="paged block size (default: 16)")
    p.add_argument("--steps", type=int, default=7, help="eager/compiled step pairs per cell (default: 7)")
    p.add_argument("--out", default="results/compile_vs_eager", help="results folder")
    p.set_defaults(device="cpu")  # roofline.validate's device check; this A/B is the CPU question
    return p


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
        row = measure(model, cell, args.steps)
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
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        status = main()
    sys.exit(status)
