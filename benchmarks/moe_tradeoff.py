"""Dense vs MoE at decode, by batch: the registry's moe entry beside two gqa models with the same attention and a
SwiGLU feed-forward, one as wide as the experts a token applies (dense, equal active: top_k x expert_hidden) and one
as wide as all of them (dense, equal total: n_experts x expert_hidden), shared experts' width added to both; one
preset, random weights, fp32 on the CPU by default (--device cuda --dtype bfloat16 on a GPU, where --layers keeps
the large preset's models in memory). The parameter equalities are checked before anything is measured.

At batch 1 an MoE step reads the top_k experts its token is routed to; at batch B it reads the union over the batch,
for a uniform router E (1 - (1 - k/E)^B) of the E experts, which approaches all of them as B grows: the MoE step then
costs what the dense model of its total size costs. Each (model, batch) cell times the engine's decode step at a
fixed context (zoo compare's decode-probe: caches filled at random as if prefilled, each sequence's its own; one
untimed warm-up step, then the median of --steps), counts the distinct experts each step read, and sets the step
beside its roofline floor (the experts read as measured; the machine's rates measured once per run) and its MBU.
Rows go to OUT/results.jsonl as each finishes (a re-run skips finished ones); the table is printed and written to
OUT/table.md and the chart to OUT/tradeoff.png, with two crossovers: the smallest measured batch whose MoE step takes
90% of the equal-total dense step, and the batch at which a uniform router's expected experts read reaches 90% of E.

    python benchmarks/moe_tradeoff.py                             # small preset, batches 1..64, context 128
    python benchmarks/moe_tradeoff.py --preset tiny --batches 1,2 --steps 2 --out /tmp/moe_tradeoff
    python benchmarks/moe_tradeoff.py --device cuda --dtype bfloat16 --preset large --layers 8 --context 1024
"""
import argparse
import gc
import sys
from pathlib import Path

import torch
from matplotlib.ticker import NullFormatter, ScalarFormatter

import zoo
from harness import roofline
from harness.charts import MARKERS, plt
from harness.compare import floor_fields, routing_fields
from harness.decode_probe import HEADROOM, decode_probe
from harness.results import ResultStore, check_output_folder, write_atomic
from roofline import ints  # benchmarks/roofline.py's comma-separated integer axis
from zoo import checks
from zoo.ffn.moe import MoE

MODELS = ("moe", "dense-active", "dense-total")
CELL_KEY = ("model", "preset", "layers", "batch", "context", "device", "dtype")
# rows written before the device, dtype and layer options: the preset's depth in fp32 on the CPU
OLDER_ROWS = {"layers": None, "device": "cpu", "dtype": "float32"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SATURATION = 0.9  # a crossover: MoE's step at 90% of the equal-total dense step's, its experts read at 90% of E
# how a cell is timed, in zoo compare's fields (its floor_fields reads them): a contiguous cache in the model's dtype
PROBE = {"measure": "decode-probe", "kv_cache": "contiguous", "kv_dtype": "auto"}
TABLE = [("model", "model", "{}"), ("batch", "batch", "{}"), ("step p50 (ms)", "step_ms_p50", "{:.2f}"),
         ("floor (ms)", "floor_ms", "{:.2f}"), ("x floor", "fraction_of_floor", "{:.1f}"), ("MBU", "mbu", "{:.0%}"),
         ("/ equal total", "vs_equal_total", "{:.2f}"), ("experts read", "experts_read", "{:.2f}"),
         ("uniform expectation", "experts_read_uniform", "{:.2f}"), ("weights MB", "weight_mb", "{:.1f}"),
         ("step weights MB", "step_weight_mb", "{:.1f}"), ("params total (M)", "params_total_m", "{:.2f}"),
         ("params active (M)", "params_active_m", "{:.2f}")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="model size (default: small)")
    p.add_argument("--batches", type=ints, default=[1, 2, 4, 8, 16, 32, 64],
                   help="comma-separated batch sizes (default: 1,2,4,8,16,32,64)")
    p.add_argument("--context", type=int, default=128, help="cached tokens per sequence (default: 128)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per cell, median (default: 8)")
    p.add_argument("--layers", type=int, help="decoder layers of all three models (default: the preset's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu); on CUDA the steps replay graphs")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and cache (default: float32)")
    p.add_argument("--out", default="results/moe_tradeoff", help="results folder (default: results/moe_tradeoff)")
    return p


def validate(args) -> None:
    """Every bad argument is reported, naming it and what is allowed, before any model is built."""
    zoo.presets.preset_settings(args.preset)
    checks.integer_list("batches", args.batches, minimum=1)
    if len(set(args.batches)) != len(args.batches):
        raise ValueError(f"batches must be distinct, got {','.join(map(str, args.batches))}")
    checks.integer("context", args.context, minimum=1)
    checks.integer("steps", args.steps, minimum=1)
    if args.layers is not None:
        checks.integer("layers", args.layers, minimum=1)
    kind = args.device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device {args.device!r} is not supported; allowed: cpu, cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {args.device!r}: no CUDA device here; allowed: cpu")
    limit = zoo.PRESETS[args.preset].max_seq_len
    if args.context + HEADROOM > limit:
        raise ValueError(f"context {args.context} + {HEADROOM} exceeds the {args.preset!r} preset's "
                         f"max_seq_len={limit}")
    check_output_folder(Path(args.out))


def first_moe(model) -> MoE:
    return next(iter(zoo.moe_layers(model).values()))  # the entry gives every layer the same MoE


def dense_widths(moe_model) -> dict[str, int]:
    """The two dense SwiGLU widths; every token runs the shared experts, so both include them."""
    moe = first_moe(moe_model)
    shared = 0 if moe.shared_experts is None else moe.shared_experts.gate_proj.weight.shape[0]
    return {"dense-active": moe.top_k * moe.expert_hidden + shared,
            "dense-total": moe.n_experts * moe.expert_hidden + shared}


def router_weights(model) -> int:
    """The MoE weights a dense FFN has no counterpart for: each layer's router and shared-expert gate."""
    gates = [g for moe in zoo.moe_layers(model).values() for g in (moe.gate, moe.shared_expert_gate) if g is not None]
    return sum(p.numel() for gate in gates for p in gate.parameters())


def build(name: str, preset: str, widths: dict[str, int], layers: int | None = None, dtype: str = "float32"):
    """On the current default device (a GPU's `with torch.device("cuda")` builds there: no host copy of the weights)."""
    torch.manual_seed(0)
    depth = {} if layers is None else {"n_layers": layers}
    model = (zoo.build("moe", preset=preset, **depth) if name == "moe"
             else zoo.build("gqa", preset=preset, mlp_hidden=widths[name], **depth))
    return model.to(DTYPES[dtype]).eval()


def equal_ffn_widths(preset: str) -> dict[str, int]:
    """The dense widths, with the equalities they stand for checked on the meta device (no memory, no work): the
    equal-active dense model's weights are the MoE's active ones, the equal-total one's its total, less its routers."""
    with torch.device("meta"):
        moe = build("moe", preset, {})
        widths = dense_widths(moe)
        counts = {name: zoo.parameter_counts(build(name, preset, widths)) for name in widths}
    ffn_alike = zoo.parameter_counts(moe)
    got = {"dense-active": ffn_alike.active - router_weights(moe), "dense-total": ffn_alike.total - router_weights(moe)}
    for name, want in got.items():
        if (counts[name].total, counts[name].active) != (want, want):
            raise RuntimeError(f"{name} (SwiGLU {widths[name]}) has {counts[name]} parameters, not the MoE's {want}")
    return widths


def cells(args) -> list[dict]:
    """Grouped by model so each is built once."""
    return [{"model": m, "preset": args.preset, "layers": args.layers, "batch": b, "context": args.context,
             "device": args.device, "dtype": args.dtype, "steps": args.steps, **PROBE}
            for m in MODELS for b in args.batches]


def model_fields(name: str, model) -> dict:
    """A model's own figures, the same in each of its rows."""
    counts = zoo.parameter_counts(model)
    moe = first_moe(model) if name == "moe" else None
    return {"arch": model.config.name, "params_total": counts.total, "params_active": counts.active,
            "ffn_hidden": moe.expert_hidden if moe else model.config.mlp_hidden,  # each expert's, or the SwiGLU's
            "top_k": moe.top_k if moe else None, "threads": torch.get_num_threads(), "device_name": device_name(model)}


def device_name(model) -> str:
    device = next(model.parameters()).device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def fill_distinct(layers: list, seed: int = 0) -> None:
    """Every cache value drawn on its own. fill_random copies one slot's values into every other, so each sequence
    attends over the same cache, the routers see nearly the same hidden state in every row, and a batch of 16 read 3
    to 5 of 8 experts where distinct caches read all 8 (tiny and small presets, random weights): MoE's large-batch
    steps would look cheaper than they are."""
    generator = torch.Generator(device=layers[0].k.device).manual_seed(seed)  # drawn where the cache lives
    for layer in {id(layer): layer for layer in layers}.values():  # a layer object shared by several: once
        for t in (layer.k, layer.v):
            t.copy_(torch.randn(t.shape, generator=generator, device=t.device).to(t.dtype))


@torch.no_grad()
def measure(model, cell: dict, rates: roofline.MachineRates) -> dict:
    """zoo compare's decode-probe (one warm-up step, then the median of `steps` at the context held fixed) over
    distinct caches; the experts the timed steps read, a uniform router's expectation, weight bytes, floor and MBU."""
    probe = decode_probe(model, cell["batch"], cell["context"], cell["kv_cache"])
    fill_distinct(probe.engine.pool.layers)
    probe.step()  # the batch's shapes' first call, untimed and uncounted
    zoo.reset_decode_routing(probe.engine.model)
    step_s = probe.median_step(cell["steps"], warmup=0)
    experts_read = zoo.decode_experts_read(probe.engine.model)
    return {**cell, "step_ms_p50": 1000 * step_s, "decode_tok_s": cell["batch"] / step_s,
            "weight_bytes": zoo.parameter_bytes(model), **floor_fields(model, cell, step_s, rates, experts_read),
            **routing_fields(probe.engine.model, cell["batch"], experts_read)}


def measure_rates(args) -> roofline.MachineRates:
    """Once per run, on the preset's gqa weights, as zoo compare does: a yardstick that is none of the three."""
    with torch.device(args.device):
        yardstick = build("dense-active", args.preset, {"dense-active": zoo.PRESETS[args.preset].mlp_hidden},
                          args.layers, args.dtype)
    rates = roofline.measure_machine(yardstick, args.device)
    del yardstick
    print(f"memory read {rates.stream_bytes_per_s / 1e9:.1f} GB/s past any cache, "
          f"{rates.matmul_flops_per_s / 1e9:.1f} GFLOP/s matmul ({rates.how})", flush=True)
    return rates


def run(args) -> list[dict]:
    widths = equal_ffn_widths(args.preset)
    store = ResultStore(Path(args.out) / "results.jsonl", CELL_KEY, OLDER_ROWS)
    todo = [c for c in cells(args) if not store.done(c)]
    rates = measure_rates(args) if todo else None
    model, built, fields = None, None, {}
    for i, cell in enumerate(todo, 1):
        if cell["model"] != built:
            model = None
            gc.collect()  # the previous model's weights, before the next one's are allocated
            torch.cuda.empty_cache()
            with torch.device(args.device):
                model, built = build(cell["model"], args.preset, widths, args.layers, args.dtype), cell["model"]
            fields = model_fields(built, model)
        row = {**measure(model, cell, rates), **fields}
        store.append(row)
        gc.collect()  # the cell's engine and its caches
        routed = f", {row['experts_read']:.2f} experts read" if row["experts_read"] is not None else ""
        print(f"[{i}/{len(todo)}] {built} batch {cell['batch']}: {row['step_ms_p50']:.2f} ms/step, floor "
              f"{row['floor_ms']:.2f} ms ({row['bound']}), MBU {row['mbu']:.0%}{routed}", flush=True)
    wanted = {store.key(c) for c in cells(args)}
    return [r for r in store.rows if store.key(r) in wanted]


def table_rows(rows: list[dict]) -> list[dict]:
    """By batch, then model; each row's step over the equal-total dense step at its batch, and sizes in MB and M."""
    total = {r["batch"]: r["step_ms_p50"] for r in rows if r["model"] == "dense-total"}
    ordered = sorted(rows, key=lambda r: (r["batch"], MODELS.index(r["model"])))
    return [{**r, "vs_equal_total": r["step_ms_p50"] / total[r["batch"]], "weight_mb": r["weight_bytes"] / 1e6,
             "step_weight_mb": r["step_weight_bytes"] / 1e6, "params_total_m": r["params_total"] / 1e6,
             "params_active_m": r["params_active"] / 1e6} for r in ordered]


def markdown(rows: list[dict]) -> str:
    cell = lambda r, key, fmt: "-" if r[key] is None else fmt.format(r[key])  # noqa: E731
    lines = ["| " + " | ".join(t for t, _, _ in TABLE) + " |",
             "|" + "|".join("---" if k == "model" else "---:" for _, k, _ in TABLE) + "|"]
    lines += ["| " + " | ".join(cell(r, k, fmt) for _, k, fmt in TABLE) + " |" for r in table_rows(rows)]
    return "\n".join(lines) + "\n"


def saturation_batch(n_experts: int, top_k: int) -> int:
    """The smallest batch at which a uniform router's expected distinct experts reach SATURATION of all of them."""
    batch = 1
    while zoo.expected_experts_read(n_experts, top_k, batch) < SATURATION * n_experts:
        batch += 1
    return batch


def crossovers(rows: list[dict]) -> dict:
    """Where MoE stops being cheaper than the dense model of its total size: the smallest measured batch whose MoE step
    takes SATURATION of the equal-total dense step, and whose measured experts read reach SATURATION of E (None: not
    within the batches run); and the analytic batch at which a uniform router's expectation reaches it."""
    total = {r["batch"]: r["step_ms_p50"] for r in rows if r["model"] == "dense-total"}
    moe = sorted((r for r in rows if r["model"] == "moe"), key=lambda r: r["batch"])
    return {"step": next((r["batch"] for r in moe if r["step_ms_p50"] >= SATURATION * total[r["batch"]]), None),
            "experts": next((r["batch"] for r in moe if r["experts_read"] >= SATURATION * r["n_experts"]), None),
            "analytic": saturation_batch(moe[0]["n_experts"], moe[0]["top_k"]),
            "n_experts": moe[0]["n_experts"], "top_k": moe[0]["top_k"], "largest": moe[-1]["batch"]}


def crossover_text(c: dict) -> str:
    found = lambda batch: f"batch {batch}" if batch is not None else f"not by batch {c['largest']}"  # noqa: E731
    share = f"{SATURATION:.0%}"
    return (f"Crossover, MoE ({c['top_k']} of {c['n_experts']} experts) against the dense model of its total size:\n"
            f"- measured: its decode step reaches {share} of the equal-total dense step at {found(c['step'])}; "
            f"its experts read per step reach {share} of {c['n_experts']} at {found(c['experts'])}\n"
            f"- analytic: a uniform router's expected experts read, E (1 - (1 - k/E)^B), reaches {share} of "
            f"{c['n_experts']} at batch {c['analytic']}\n")


def log2_batches(ax, batches: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("batch (sequences per decode step)")
    ax.grid(True, which="both", alpha=0.3)


def label(row: dict) -> str:
    if row["model"] == "moe":
        return f"MoE, {row['top_k']} of {row['n_experts']} experts of {row['ffn_hidden']}"
    return f"dense, equal {row['model'].removeprefix('dense-')} (SwiGLU {row['ffn_hidden']})"


def chart(rows: list[dict], c: dict, path: Path) -> Path:
    """Left: decode step vs batch per model, its floor dashed; right: MoE's experts read per step, measured and a
    uniform router's expectation; each crossover a vertical line where it falls within the batches run."""
    fig, (steps, experts) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=120)
    batches = sorted({r["batch"] for r in rows})
    for i, name in enumerate(MODELS):
        mine = sorted((r for r in rows if r["model"] == name), key=lambda r: r["batch"])
        xs = [r["batch"] for r in mine]
        line, = steps.plot(xs, [r["step_ms_p50"] for r in mine], marker=MARKERS[i], label=label(mine[0]))
        steps.plot(xs, [r["floor_ms"] for r in mine], linestyle="--", color=line.get_color(), alpha=0.7,
                   label=f"{name} floor")
    moe = sorted((r for r in rows if r["model"] == "moe"), key=lambda r: r["batch"])
    every = range(1, batches[-1] + 1)
    experts.plot([r["batch"] for r in moe], [r["experts_read"] for r in moe], marker="o", label="measured")
    experts.plot(every, [zoo.expected_experts_read(c["n_experts"], c["top_k"], b) for b in every], linestyle="--",
                 label="uniform router: E (1 - (1 - k/E)^B)")
    experts.axhline(c["n_experts"], color="gray", linestyle=":", label=f"all {c['n_experts']} experts")
    for ax, batch, what in ((steps, c["step"], "measured"), (experts, c["analytic"], "analytic")):
        if batch is not None and batch <= batches[-1]:
            ax.axvline(batch, color="black", linewidth=0.8, label=f"{what} crossover ({SATURATION:.0%}): batch {batch}")
    for ax in (steps, experts):
        log2_batches(ax, batches)
        ax.legend(fontsize=7)
    steps.set_yscale("log")  # floors and steps apart by ratios, not differences
    steps.set(ylabel="decode step (ms, log)", title="decode step vs batch (dashed: roofline floor)")
    experts.set(ylabel="distinct experts read per step, per layer", title="MoE experts read per step", ylim=(0, None))
    r = rows[0]
    depth = "" if r.get("layers") is None else f", {r['layers']} layers"
    where = "CPU, {} threads".format(r["threads"]) if r.get("device", "cpu") == "cpu" else r["device_name"]
    fig.suptitle(f"Dense vs MoE decode, {r['preset']} preset{depth}, context {r['context']}, "
                 f"{r.get('dtype', 'float32')}, {where}", x=0.01, ha="left", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        validate(args)
    except ValueError as error:
        print(f"moe_tradeoff: error: {error}", file=sys.stderr)
        return 2
    rows = run(args)
    out = Path(args.out)
    report = markdown(rows) + "\n" + crossover_text(c := crossovers(rows))
    print(report)
    write_atomic(out / "table.md", report)
    print(f"wrote {out / 'results.jsonl'}, {out / 'table.md'}, {chart(rows, c, out / 'tradeoff.png')}")
    return 0


if __name__ == "__main__":
    from machine_watch import watched_run  # benchmarks/, beside this script when run as one

    with watched_run():
        status = main()
    sys.exit(status)
