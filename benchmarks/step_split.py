"""Where an eager CPU decode step's time goes beyond its roofline floor: each cell's step split into its blocks (the
engine's plan of them, zoo/decode_plan.py: one C++ call over every block's fused halves, kernels/cpu_blocks.py, and
the final norm and the head where the plan ends at them), the plan's guard, the model's code around them (the
embedding, the step's rows; the final norm and the head where the plan does not run them), and the engine's step
around the model; beside the floor at the machine's read rate, swept just before and after the cell's
steps (the faster, as zoo compare prices a cell: a VM's memory reads at rates that change within a minute). Steps
without the plan, each block deciding and calling its own halves, time the mixer halves and the feed-forward halves
apart: the rate each streams its bytes at.

A step over its floor is over it somewhere: a half that streams below the read rate, or time spent streaming
nothing (Python, the engine), or memory slower than the floor's: the last columns name the part with the largest
excess over its own bytes' floor, and give the floor's read rate beside the rate the model's own parameters are read
at where they lie (harness/roofline.py's tensors_read_rate; on a VM a buffer's rate depends on where its pages land).
The cells default to `zoo compare`'s CPU default (its architectures, `small`, fp32, batch 1, 2, 4 x context 256,
1024, 2048, a contiguous cache), probed at a held context (harness/decode_probe.py). Rows go to OUT/results.jsonl
as each cell finishes (a re-run skips finished cells); a Markdown table is printed at the end.

    python benchmarks/step_split.py
    python benchmarks/step_split.py --archs gqa,mamba --batches 1 --contexts 256 --dtypes bfloat16 --preset base
"""
import argparse
import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

import zoo
from harness import roofline
from harness.compare_device import CPU_DEFAULTS
from harness.decode_probe import decode_probe
from harness.results import ResultStore
from kernels import cpu_blocks
from roofline import DTYPES, ints, names, validate  # the same axes, checked the same way

CELL_KEY = ("arch", "preset", "batch", "context", "dtype")
PARTS = ("blocks", "guard", "between", "engine")  # a planned step's, in order


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", type=names, default=zoo.compare_defaults(), help="default: zoo compare's")
    p.add_argument("--batches", type=ints, default=list(CPU_DEFAULTS.batches), help="default: 1,2,4")
    p.add_argument("--contexts", type=ints, default=list(CPU_DEFAULTS.contexts), help="default: 256,1024,2048")
    p.add_argument("--dtypes", type=names, default=["float32"], help="default: float32")
    p.add_argument("--preset", default=CPU_DEFAULTS.preset, choices=list(zoo.PRESETS), help="default: small")
    p.add_argument("--steps", type=int, default=31, help="timed steps a cell, after 5 untimed (default: 31)")
    p.add_argument("--out", default="results/step_split", help="results folder")
    p.set_defaults(device="cpu", layouts=["contiguous"])  # roofline.validate's checks; the fused halves are CPU's
    return p


@contextlib.contextmanager
def timed_parts(model, plans):
    """Seconds and calls by part while inside: the plan's op (blocks), the plans' lookup and guard, each kind of
    cpu_blocks' block halves (mixer, ffn: a step without plans calls them), and the model's forward (an instance
    attribute, which nn.Module.__call__ finds before the class's; the plan's guard covers the blocks, the final norm
    and the head, not the model itself)."""
    seconds, calls = collections.Counter(), collections.Counter()

    def timer(part, function):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start
                calls[part] += 1
        return call

    served, op = dict(cpu_blocks.SERVED), cpu_blocks.decode_blocks_op
    try:
        for kind, function in served.items():
            if kind not in ("norm", "head"):  # the model's final norm and head are no block halves
                cpu_blocks.SERVED[kind] = timer("ffn" if kind == "ffn" else "mixer", function)
        cpu_blocks.decode_blocks_op = timer("blocks", op)
        plans.plan = timer("guard", plans.plan)
        model.forward = timer("forward", model.forward)
        yield seconds, calls
    finally:
        cpu_blocks.SERVED.update(served)
        cpu_blocks.decode_blocks_op = op
        del plans.plan, model.forward


def part_bytes(model, cost: roofline.StepCost, ends_at: str) -> dict[str, int]:
    """The bytes each part must stream a step, as the floor counts them: the mixer halves their weights, their norms'
    and the step's cache reads and writes; the feed-forward halves the rest of the blocks' weights (an MoE layer's
    routed experts only); the blocks both, and the final norm and the head where the plan ends at them (`ends_at`,
    zoo/decode_plan.py's), `between` them otherwise."""
    def nbytes(module) -> int:
        return 0 if module is None else sum(t.nbytes for t in (*module.parameters(), *module.buffers()))

    mixer = sum(nbytes(b.mixer) + nbytes(b.mixer_norm) for b in model.blocks)
    head, norm = model.head.weight.nbytes, nbytes(model.norm)
    ffn = max(cost.weight_bytes - mixer - head - norm, 0)
    mixer += cost.cache_read_bytes + cost.cache_write_bytes
    planned = {"blocks": 0, "norm": norm, "head": norm + head}[ends_at]
    return {"mixer": mixer, "ffn": ffn, "blocks": mixer + ffn + planned, "between": norm + head - planned}


def measure(model, cell: dict, rates: roofline.MachineRates, steps: int, buffer: torch.Tensor) -> dict:
    probe = decode_probe(model, cell["batch"], cell["context"], "contiguous")
    runner = probe.engine.runner
    plans = runner.decode_plans
    cost = roofline.decode_step_cost(model, cell["batch"], cell["context"])
    # the floor at the read rates swept just before and after the steps (the faster), as zoo compare prices a cell
    before = roofline.measure_read_rates(3, buffer=buffer, also=(min(cost.bytes, roofline.READ_BYTES),))
    for _ in range(5):  # untimed: the first steps' allocations, the plan's decisions
        probe.step()
    with timed_parts(model, plans) as (seconds, calls):
        walls = [probe.step() for _ in range(steps)]
        planned = dict(seconds)
        seconds.clear()
        runner.decode_plans = None
        probe.step()
        seconds.clear()
        for _ in range(steps):
            probe.step()
        runner.decode_plans = plans
    after = roofline.measure_read_rates(3, buffer=buffer, also=(min(cost.bytes, roofline.READ_BYTES),))
    rates = rates.priced_at(before.higher(after))
    # the rate the model's own memory is read at (its parameters and buffers where they lie), beside the floor's buffer
    own = roofline.tensors_read_rate([*model.parameters(), *model.buffers()])
    total = sum(walls)
    spent = {"blocks": planned.get("blocks", 0.0), "guard": planned["guard"],
             "between": planned["forward"] - planned.get("blocks", 0.0) - planned["guard"],
             "engine": total - planned["forward"]}
    rate = rates.stream_rate(cost.bytes)
    ends_at = max((plan.ends_at for plan in plans.plans.values() if plan.lists is not None), default="blocks")
    moved = part_bytes(model, cost, ends_at if spent["blocks"] > 0 else "blocks")
    ms = {part: 1000 * spent[part] / steps for part in PARTS}
    excess = {part: ms[part] - 1000 * moved.get(part, 0) / rate for part in PARTS}
    floor = roofline.floor_seconds(cost, rates)
    mean = total / steps
    gb_s = {"blocks": moved["blocks"] * steps / spent["blocks"] / 1e9 if spent["blocks"] > 0 else None}
    gb_s.update({part: moved[part] * steps / seconds[part] / 1e9 if seconds[part] > 0 else None
                 for part in ("mixer", "ffn")})
    return {**cell, "step_ms_mean": 1000 * mean, "step_ms_p50": 1000 * statistics.median(walls),
            "floor_ms": 1000 * floor, "fraction_of_floor": mean / floor, "read_gb_s": rate / 1e9,
            "weights_memory_gb_s": own / 1e9, "read_before_gb_s": before.at(cost.bytes) / 1e9,
            "read_after_gb_s": after.at(cost.bytes) / 1e9,
            "planned": spent["blocks"] > 0, "plan_ends_at": ends_at, **{f"{part}_ms": ms[part] for part in PARTS},
            **{f"{part}_mb": moved[part] / 1e6 for part in ("mixer", "ffn", "blocks", "between")},
            **{f"{part}_excess_ms": excess[part] for part in PARTS}, **{f"{p}_gb_s": v for p, v in gb_s.items()},
            **{f"unplanned_{part}_ms": 1000 * seconds[part] / steps for part in ("mixer", "ffn")},
            "largest_excess": max(PARTS, key=excess.get), "steps": steps, "threads": torch.get_num_threads()}


def rate(row: dict, part: str) -> str:
    gb_s = row[f"{part}_gb_s"]
    return "-" if gb_s is None else f"{gb_s:.1f}"


def own_rate(row: dict) -> str:
    return "-" if "weights_memory_gb_s" not in row else f"{row['weights_memory_gb_s']:.1f}"  # rows of older runs


def markdown(rows: list[dict]) -> str:
    lines = ["| arch | dtype | batch | context | step ms | floor ms | step / floor | plan ends at "
             "| blocks ms (GB/s) | guard ms | between ms | engine ms | unplanned mixer / ffn halves GB/s "
             "| largest excess | floor's read rate / the weights' memory's, GB/s |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['arch']} | {r['dtype']} | {r['batch']} | {r['context']} | {r['step_ms_mean']:.2f} "
                     f"| {r['floor_ms']:.2f} | {r['fraction_of_floor']:.2f}x | {r.get('plan_ends_at', '-')} "
                     f"| {r['blocks_ms']:.2f} ({rate(r, 'blocks')}) | {r['guard_ms']:.2f} | {r['between_ms']:.2f} "
                     f"| {r['engine_ms']:.2f} | {rate(r, 'mixer')} / {rate(r, 'ffn')} "
                     f"| {r['largest_excess']} (+{r[r['largest_excess'] + '_excess_ms']:.2f} ms) "
                     f"| {r['read_gb_s']:.1f} / {own_rate(r)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        validate(args)
        if args.steps < 1:
            raise ValueError(f"steps must be >= 1, got {args.steps}")
    except ValueError as error:
        print(f"step_split: error: {error}", file=sys.stderr)
        return 2
    store = ResultStore(Path(args.out) / "results.jsonl", CELL_KEY)
    cells = [{"arch": a, "preset": args.preset, "batch": b, "context": c, "dtype": d}
             for d in args.dtypes for a in args.archs for b in args.batches for c in args.contexts]
    rates, buffer = {}, roofline.read_buffer()  # the buffer each cell's read sweeps run over
    for i, cell in enumerate(cells, 1):
        if store.done(cell):
            continue
        torch.manual_seed(0)
        model = zoo.build(cell["arch"], preset=args.preset).to(DTYPES[cell["dtype"]]).eval()
        if cell["dtype"] not in rates:  # once a dtype, as zoo compare measures once a run
            rates[cell["dtype"]] = roofline.measure_machine(model)
        with torch.no_grad():
            row = measure(model, cell, rates[cell["dtype"]], args.steps, buffer)
        store.append(row)
        print(f"[{i}/{len(cells)}] {cell['arch']} {cell['dtype']} batch {cell['batch']} context {cell['context']}: "
              f"{row['step_ms_mean']:.2f} ms, {row['fraction_of_floor']:.2f}x its floor; most over: "
              f"{row['largest_excess']}", flush=True)
    wanted = {store.key(c) for c in cells}
    print(markdown([r for r in store.rows if store.key(r) in wanted]))
    return 0


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        status = main()
    sys.exit(status)
